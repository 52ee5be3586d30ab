"""Flash-Decoding in Triton (lessons 07 and 10): ``flash_decode_triton(q, k, v, num_splits=None) -> O``.

One new token per sequence against a long KV cache. The cache is cut into ``num_splits`` pieces, each program
writes a partial ``(O_s, lse_s)`` for its piece, and the last program of a head to finish (an atomic counter)
merges them with weights ``exp(lse_s - lse)``: one kernel launch per call. Grouped-query attention: query head
``h`` reads KV head ``h // (H // Hkv)``. The same kernel serves ``flash_attn_with_kvcache_triton``
(``helpers/kernels/kvcache.py``) through ``_decode_launch``.

References: Dao et al., "Flash-Decoding for long-context inference" (2023); the matmul tutorial of Triton.
Written for this course; numbers in bench/NOTES.md.
"""

import math

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .common import (LOG2E, SHAPES, _capturing, _cdiv, _check_dense_kv, _check_qkv, _device_limits, _load_d,
                     _next_pow2, _num_sms, _shapes, _tanh, fitting_configs, head_block)

__all__ = ["flash_decode_triton"]


# ----------------------------------------------------------------------------
# Decode: one kernel, split-KV with the combine inside (one launch per call)
# ----------------------------------------------------------------------------
#
# One kernel serves flash_decode_triton (k, v [B, Hkv, Nk, d], every sequence Nk keys, one
# query token) and flash_attn_with_kvcache_triton in helpers/kernels/kvcache.py (a cache
# [B, Nmax, Hkv, d] or pages [num_blocks, PAGE, Hkv, d] with a block table, a length per
# sequence, Nq new tokens with a bottom-right causal mask or sliding window (WINDOW), softcap
# and ALiBi (SCORE_MOD)). With a window the splits cut only the keys some row of the program
# sees: a short window over a long cache costs its own tiles, not the cache's.
#
# grid = (S, B * Hkv * NUM_RB). A program owns one piece (split) of one sequence's keys
# for one KV head, and all the query rows that read that head: the GROUP = H / Hkv query
# heads times the NQ new tokens, NQ * GROUP rows packed into a [BLOCK_H, D] tile (>= 16
# rows, so the dot products use the tensor cores; more than _MAX_BLOCK_H rows are cut into
# NUM_RB row blocks). Each program writes a partial (O_s, lse_s), then increments a counter
# of its (b, kv head, row block); the program that brings it to S merges the S partials,
# writes O and resets the counter to 0 for the next call.


@triton.jit
def _decode_tail_offsets(
    BlockTable, table_row, start_n, hi, offs_n, offs_d, tile, head_off, stride_kb,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, TOKEN_STRIDE: tl.constexpr,
):
    """Element offsets [BLOCK_N, D] of keys start_n .. start_n + BLOCK_N - 1 (those < hi valid) in K and V.

    tile [BLOCK_N, D] holds the offsets inside one contiguous tile. Contiguous (PAGE = 0):
    head_off already holds the sequence's and head's start. Paged: token t lives in page
    BlockTable[b, t // PAGE], row t % PAGE; a tile that fits in one page (BLOCK_N <= PAGE,
    tiles start at multiples of BLOCK_N) needs one scalar load of the table, smaller pages
    are gathered row by row (rows >= hi read page 0 and are masked by the caller)."""
    if PAGE == 0:
        offs = head_off + start_n.to(tl.int64) * TOKEN_STRIDE + tile  # scalar + [BLOCK_N, D]
    elif BLOCK_N <= PAGE:
        page = tl.load(BlockTable + table_row + start_n // PAGE).to(tl.int64)  # scalar; start_n < hi
        offs = head_off + page * stride_kb + (start_n % PAGE) * TOKEN_STRIDE + tile  # [BLOCK_N, D]
    else:
        tok = start_n + offs_n  # [BLOCK_N]
        page = tl.load(BlockTable + table_row + tok // PAGE, mask=tok < hi, other=0).to(tl.int64)  # [BLOCK_N]
        row = head_off + page * stride_kb + (tok % PAGE) * TOKEN_STRIDE  # [BLOCK_N]
        offs = row[:, None] + offs_d[None, :]  # [BLOCK_N, D]
    return offs


@triton.jit
def _decode_step(q, k, v, m_i, l_i, acc, qk_scale, cols, key_ok, row_lo, row_end, sm_scale, softcap, slope, pos,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr, SCORE_MOD: tl.constexpr):
    """One key tile of the online softmax: returns the updated (m_i, l_i, acc), all base 2.

    MASKED: key j of the tile counts for row r when key_ok[j] and cols[j] < row_end[r] (and
    cols[j] >= row_lo[r] with WINDOW); a row that has seen no key yet keeps m_i = -inf and
    subtracts 0 (no NaN). Unmasked: every key counts, and key_ok, row_lo, row_end are not read.
    SCORE_MOD (a bit set, on the scaled score s in natural units, before the mask and the max):
    1 softcap: s = softcap * tanh(s / softcap); 2 ALiBi: s -= slope[r] * |pos[r] - cols[j]|."""
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
    if SCORE_MOD != 0:
        s = qk * sm_scale  # [BLOCK_H, BLOCK_N] natural units
        if SCORE_MOD & 1:
            s = softcap * _tanh(s / softcap)
        if SCORE_MOD & 2:
            s = s - slope[:, None] * tl.abs(pos[:, None] - cols[None, :]).to(tl.float32)
        qk = s * LOG2E  # base 2, the scale applied: stands for qk * qk_scale below
        qk_scale = 1.0
    if MASKED:
        keep = key_ok[None, :] & (cols[None, :] < row_end[:, None])  # [BLOCK_H, BLOCK_N]
        if WINDOW:
            keep = keep & (cols[None, :] >= row_lo[:, None])
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_H]; -inf for a row that has seen no key yet
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # subtract 0 there instead (no NaN)
        p = tl.math.exp2(qk - m_sub[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_sub)  # [BLOCK_H]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_H]
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_ij)  # [BLOCK_H]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # [BLOCK_H, D]
    return m_ij, l_i, acc


@triton.jit
def _decode_kernel(
    Q, K, V, O,  # q and O: [B, NQ, H, D] contiguous ([B, H, D] when NQ = 1); K, V: see HEAD_MAJOR, PAGE
    O_part, LSE_part, Counter,  # workspace: [P, S, BLOCK_H, D] f32, [P, S, BLOCK_H] f32, [P] int32 (P = grid[1])
    SeqLens, BlockTable,  # int32 [B] (VARLEN); int32 [B, max_blocks] (PAGE > 0)
    Nk,  # keys per sequence (not VARLEN) or the cache's capacity per sequence (VARLEN: lengths are clamped to it)
    stride_kb,  # elements from one sequence (contiguous) or one page (paged) to the next
    max_blocks,  # the block table's row length
    num_splits, qk_scale,
    sm_scale, softcap, Slopes, stride_sb,  # SCORE_MOD: the cap (1); ALiBi slopes f32 [H] or [B, H], batch stride H or 0 (2)
    win_left, win_right,  # WINDOW: the row of position p sees keys p - win_left <= j <= p + win_right (both >= 0)
    HKV: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head (H // Hkv)
    NQ: tl.constexpr,  # new query tokens per sequence
    NUM_RB: tl.constexpr,  # row blocks: cdiv(NQ * GROUP, BLOCK_H)
    BLOCK_H: tl.constexpr,  # query rows per program (>= 16)
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM): the tiles' width, columns past HEAD_DIM masked (O_part is BLOCK_D wide)
    HEAD_MAJOR: tl.constexpr,  # True: K [B, Hkv, Nk, D]; False: [B, Nmax, Hkv, D] or pages [n, PAGE, Hkv, D]
    PAGE: tl.constexpr,  # 0: contiguous cache; else the page (block) size, a power of two
    VARLEN: tl.constexpr,  # lengths from SeqLens (else every sequence has Nk keys)
    CAUSAL: tl.constexpr,  # bottom-right: query row i sees keys j <= len - NQ + i
    DIRECT: tl.constexpr,  # num_splits == 1: write O directly, no partials, no counter
    WINDOW: tl.constexpr = False,  # a sliding window (win_left, win_right; CAUSAL is then False)
    SCORE_MOD: tl.constexpr = 0,  # bits: 1 softcap, 2 ALiBi (3: softcap, then ALiBi)
):
    split = tl.program_id(0)
    pid = tl.program_id(1)  # (b, kv head, row block)
    rb = pid % NUM_RB
    off_bkv = pid // NUM_RB
    off_b = off_bkv // HKV
    off_hkv = off_bkv % HKV

    # -- the query tile: row r = i * GROUP + g is new token i of query head hkv * GROUP + g
    offs_r = rb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    d_ok = offs_d < HEAD_DIM  # [D]
    row_ok = offs_r < NQ * GROUP
    qi = offs_r // GROUP  # [BLOCK_H] new token of each row
    head = off_hkv * GROUP + offs_r % GROUP  # [BLOCK_H] query head of each row
    q_row = ((off_b * NQ + qi) * (HKV * GROUP) + head).to(tl.int64) * HEAD_DIM  # [BLOCK_H] row start in q and O
    io_ok = row_ok[:, None] & d_ok[None, :]  # [BLOCK_H, D]
    q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=io_ok, other=0.0)  # [BLOCK_H, D]

    # -- this sequence's keys, and which of them each row sees
    if VARLEN:
        seqlen = tl.minimum(tl.maximum(tl.load(SeqLens + off_b), 0), Nk)  # clamped: never read past the cache
    else:
        seqlen = Nk
    pos = seqlen - NQ + qi  # [BLOCK_H] position of each row's token in its sequence (bottom-right)
    first_r = rb * BLOCK_H
    last_r = tl.minimum(first_r + BLOCK_H, NQ * GROUP) - 1
    row_lo = offs_r  # [BLOCK_H] first key each row sees (read with WINDOW only)
    if WINDOW:
        # row r sees keys row_lo[r] <= j < row_end[r]; both bounds grow with the row's token
        row_lo = tl.maximum(pos - win_left, 0)  # [BLOCK_H]
        row_end = tl.minimum(tl.maximum(pos + win_right + 1, 0), seqlen)  # [BLOCK_H] exclusive end per row
        pos_first = seqlen - NQ + first_r // GROUP
        pos_last = seqlen - NQ + last_r // GROUP
        key_lo = tl.maximum(pos_first - win_left, 0)  # keys < key_lo: seen by no row of the tile
        all_lo = tl.maximum(pos_last - win_left, 0)  # keys in [all_lo, all_end): seen by every row
        all_end = tl.minimum(tl.maximum(pos_first + win_right + 1, 0), seqlen)
        key_end = tl.minimum(tl.maximum(pos_last + win_right + 1, 0), seqlen)  # keys >= key_end: seen by none
    elif CAUSAL:
        diag = seqlen - NQ + 1  # row i sees keys j < diag + i
        row_end = tl.minimum(tl.maximum(diag + qi, 0), seqlen)  # [BLOCK_H] exclusive end per row
        all_end = tl.maximum(diag + first_r // GROUP, 0)  # keys < all_end: seen by every row of the tile
        key_end = tl.maximum(diag + last_r // GROUP, 0)  # keys >= key_end: seen by none
    else:
        row_end = tl.full([BLOCK_H], 0, tl.int32) + seqlen
        all_end = seqlen
        key_end = seqlen

    # -- this split's keys [lo, hi): the sequence cut in num_splits pieces of whole tiles
    if WINDOW:  # only the keys some row sees, from the tile holding key_lo (tiles start at multiples of BLOCK_N)
        base = key_lo // BLOCK_N * BLOCK_N
        keys_per_split = tl.cdiv(tl.cdiv(tl.maximum(key_end - base, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = base + split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, key_end)
        # unmasked tiles [full_lo, full_hi): the first tile at or after all_lo, up to all_end
        full_lo = tl.minimum(lo + tl.cdiv(tl.maximum(all_lo - lo, 0), BLOCK_N) * BLOCK_N, tl.maximum(hi, lo))
    else:
        keys_per_split = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, key_end)
        full_lo = lo
    full_hi = full_lo + tl.maximum(tl.minimum(hi, all_end) - full_lo, 0) // BLOCK_N * BLOCK_N  # unmasked tiles end here
    masked_lo = full_hi  # masked tiles: [full_hi, hi), the ragged end and the causal band
    if WINDOW:  # and [lo, full_lo), the window's lower edge: the one masked loop starts full_lo - lo keys early,
        masked_lo = full_hi - (full_lo - lo)  # and maps those keys back to [lo, full_lo)

    slope = tl.zeros([BLOCK_H], dtype=tl.float32)  # [BLOCK_H] ALiBi slope of each row's query head
    if SCORE_MOD & 2:
        slope = tl.load(Slopes + off_b * stride_sb + head, mask=row_ok, other=0.0)

    TOKEN_STRIDE: tl.constexpr = HEAD_DIM if HEAD_MAJOR else HKV * HEAD_DIM
    if PAGE == 0:
        if HEAD_MAJOR:
            head_off = off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * Nk * HEAD_DIM
        else:
            head_off = off_b.to(tl.int64) * stride_kb + off_hkv * HEAD_DIM
    else:
        head_off = (off_hkv * HEAD_DIM).to(tl.int64)
    table_row = off_b.to(tl.int64) * max_blocks
    tile = offs_n[:, None] * TOKEN_STRIDE + offs_d[None, :]  # [BLOCK_N, D] offsets inside a contiguous tile

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # Paged: the page numbers of the next tile are loaded one iteration ahead (carried in
    # `pages`), so the K/V addresses of a tile do not wait on a load of the same iteration
    # and Triton's pipeliner keeps num_stages - 1 tiles in flight, as for a contiguous cache.
    # (With the table load in the same iteration it keeps one: measured as shared memory of
    # the sm_90 compile, 72 KB instead of 136 KB at BLOCK_N = 128, num_stages = 3.)
    if PAGE == 0:
        pages = 0
    elif BLOCK_N <= PAGE:  # one page per tile: a scalar
        pages = tl.load(BlockTable + table_row + full_lo // PAGE, mask=full_lo < full_hi, other=0)
    else:  # several pages per tile: a page per key row
        pages = tl.load(BlockTable + table_row + (full_lo + offs_n) // PAGE, mask=full_lo + offs_n < full_hi, other=0)
    for start_n in range(full_lo, full_hi, BLOCK_N):  # tiles every row sees in full: no mask
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if PAGE == 0:
            offs = head_off + start_n.to(tl.int64) * TOKEN_STRIDE + tile  # scalar + [BLOCK_N, D]
        elif BLOCK_N <= PAGE:
            offs = head_off + pages.to(tl.int64) * stride_kb + (start_n % PAGE) * TOKEN_STRIDE + tile  # [BLOCK_N, D]
            nxt = start_n + BLOCK_N
            pages = tl.load(BlockTable + table_row + nxt // PAGE, mask=nxt < full_hi, other=0)
        else:
            row = head_off + pages.to(tl.int64) * stride_kb + ((start_n + offs_n) % PAGE) * TOKEN_STRIDE  # [BLOCK_N]
            offs = row[:, None] + offs_d[None, :]  # [BLOCK_N, D]
            nxt = start_n + BLOCK_N + offs_n  # [BLOCK_N]
            pages = tl.load(BlockTable + table_row + nxt // PAGE, mask=nxt < full_hi, other=0)
        k = _load_d(K + offs, d_ok, BLOCK_D != HEAD_DIM)  # [BLOCK_N, D]
        v = _load_d(V + offs, d_ok, BLOCK_D != HEAD_DIM)  # [BLOCK_N, D]
        m_i, l_i, acc = _decode_step(q, k, v, m_i, l_i, acc, qk_scale, start_n + offs_n, offs_n, offs_n, offs_n,
                                     sm_scale, softcap, slope, pos, False, WINDOW, SCORE_MOD)

    for start_n in range(masked_lo, hi, BLOCK_N):  # the ragged end, the causal band, the window's edges: masked
        if WINDOW:
            start_n = tl.where(start_n < full_hi, start_n - (full_hi - full_lo), start_n)  # the lower edge
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # [BLOCK_N]
        key_ok = cols < hi  # [BLOCK_N]
        offs = _decode_tail_offsets(BlockTable, table_row, start_n, hi, offs_n, offs_d, tile, head_off, stride_kb,
                                    BLOCK_N, PAGE, TOKEN_STRIDE)  # [BLOCK_N, D]
        k = tl.load(K + offs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + offs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
        m_i, l_i, acc = _decode_step(q, k, v, m_i, l_i, acc, qk_scale, cols, key_ok, row_lo, row_end,
                                     sm_scale, softcap, slope, pos, True, WINDOW, SCORE_MOD)

    # -- this split's partial result; a split (or row) with no keys: O_s = 0, lse_s = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_s = acc / l_safe[:, None]  # [BLOCK_H, D]
    o_ptrs = O + q_row[:, None] + offs_d[None, :]  # [BLOCK_H, D]
    if DIRECT:
        tl.store(o_ptrs, o_s.to(O.dtype.element_ty), mask=io_ok)
    else:
        lse_s = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))  # [BLOCK_H] base 2
        offs_h = tl.arange(0, BLOCK_H)
        part0 = pid.to(tl.int64) * num_splits * BLOCK_H  # this (b, kv head, row block)'s partials
        part = part0 + split * BLOCK_H + offs_h  # [BLOCK_H]
        tl.store(LSE_part + part, lse_s)
        tl.store(O_part + part[:, None] * BLOCK_D + offs_d[None, :], o_s)
        # Every thread's partial is written before one thread counts this split done (the
        # barrier), and the count is a release at GPU scope: a program that reads count
        # S - 1 has acquired every other split's partial.
        tl.debug_barrier()
        done = tl.atomic_add(Counter + pid, 1, sem="acq_rel", scope="gpu")  # splits finished before this one
        if done == num_splits - 1:  # the last split of this (b, kv head, row block): merge
            # .cg: read from L2 (coherent across SMs), never a stale L1 line
            lse_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            for s in range(0, num_splits):
                lse_max = tl.maximum(lse_max, tl.load(LSE_part + part0 + s * BLOCK_H + offs_h, cache_modifier=".cg"))
            lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a row no split saw: weights 0
            o_sum = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
            for s in range(0, num_splits):
                rows_s = part0 + s * BLOCK_H + offs_h  # [BLOCK_H]
                w = tl.math.exp2(tl.load(LSE_part + rows_s, cache_modifier=".cg") - lse_ref)  # [BLOCK_H]
                o_p = tl.load(O_part + rows_s[:, None] * BLOCK_D + offs_d[None, :], cache_modifier=".cg")
                o_sum += w[:, None] * o_p  # [BLOCK_H, D]
                w_sum += w
            o_fin = o_sum / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]  # [BLOCK_H, D]
            tl.store(o_ptrs, o_fin.to(O.dtype.element_ty), mask=io_ok)
            tl.atomic_xchg(Counter + pid, 0)  # ready for the next call, no memset launch


_INTERPRETER_DECODE_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
_SPLIT_ALIGN = 128  # _pick_num_splits keeps at least 4 * _SPLIT_ALIGN keys a split
_MAX_BLOCK_H = 64  # query rows per program; NQ * GROUP rows beyond it take more row blocks
# (BLOCK_N, num_warps, num_stages): each program holds one SM (64-192 KB of pipelined K/V tiles)
_DECODE_SHAPES = [(128, 4, 3), (64, 4, 4), (128, 8, 3), (64, 4, 3)]
SHAPES["decode"] = lambda d: [dict(BLOCK_N=bn, num_warps=w, num_stages=s) for bn, w, s in _DECODE_SHAPES]

# A decode step is short (it reads the cache once, at memory speed), so the Python cost of a call matters:
# one launch (the combine is inside the kernel), the tuned choice kept in a plain dict (not
# triton.autotune), the SM count cached, the partials' workspace and the counters cached per
# device, no device sync anywhere.
_decode_choice = {}  # _decode_key(...) -> config dict
_workspace = {}  # device -> (O_part f32, LSE_part f32, counters int32), flat, grown when too small
# Why reusing one workspace and one set of counters is safe: calls on one stream run one after
# another, and each call leaves every counter it used at 0 (the merging program resets it).
# Calls on two streams at once would share them and race: such a caller needs a workspace per
# stream (key _workspace by the stream too). A call inside CUDA-graph capture that would need a
# bigger workspace gets its own, uncached, so the graph never depends on a buffer this module drops.






def _decode_workspace(device, programs, num_splits, block_h, d):
    """(O_part, LSE_part, counters) with room for this call; counters all 0 between calls."""
    n_lse = programs * num_splits * block_h
    ws = _workspace.get(device)
    if ws is not None and ws[1].numel() >= n_lse and ws[0].numel() >= n_lse * d and ws[2].numel() >= programs:
        return ws
    old = ws or (torch.empty(0), torch.empty(0), torch.empty(0))
    new = (
        torch.empty(max(n_lse * d, old[0].numel()), device=device, dtype=torch.float32),  # [P * S * BLOCK_H * D]
        torch.empty(max(n_lse, old[1].numel()), device=device, dtype=torch.float32),  # [P * S * BLOCK_H]
        old[2] if old[2].numel() >= programs else torch.zeros(programs, device=device, dtype=torch.int32),  # [P]
    )
    if not _capturing(device):
        _workspace[device] = new
    return new


def _decode_configs(q, d, block_h):
    """The shapes of _DECODE_SHAPES that fit q's GPU (every one under the interpreter)."""
    if q.device.type != "cuda" or interpreting():
        return _shapes("decode", d)
    cap, smem = _device_limits(q.device)
    return fitting_configs("decode", _shapes("decode", d), d, q.dtype, cap, smem, block_h=block_h)


def _tune_decode(key, launch, configs):
    """Time each configuration once for this key; keep the fastest."""
    best, error = None, None
    for cfg in configs:
        try:
            ms = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=25, return_mode="median")
        except triton.runtime.errors.OutOfResources as e:  # e.g. d = 256: these tiles overflow shared memory
            error = e
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        raise error
    _decode_choice[key] = best[1]
    return best[1]






def _pick_num_splits(batch_kv_heads, Nk, num_sms, max_splits=128):
    """The fewest splits that keep the SMs at least 95% busy.

    Decode streams the cache once, so what matters is that every SM has a
    program pulling bytes until the end. With one program per SM (their
    pipelined tiles fill shared memory), B*Hkv*S programs run in
    ceil(B*Hkv*S / num_sms) waves; S is the smallest split count whose waves
    are at least 95% full. Each split keeps at least 4 * _SPLIT_ALIGN keys.
    """
    key = (batch_kv_heads, Nk, num_sms, max_splits)
    if key not in _splits_memo:  # a loop of up to max_splits steps: once per shape
        _splits_memo[key] = _pick_num_splits_uncached(*key)
    return _splits_memo[key]


_splits_memo = {}


def _pick_num_splits_uncached(batch_kv_heads, Nk, num_sms, max_splits):
    cap = max(1, min(max_splits, Nk // (4 * _SPLIT_ALIGN)))
    best, best_fill = 1, 0.0
    for s in range(1, cap + 1):
        programs = batch_kv_heads * s
        fill = programs / (num_sms * _cdiv(programs, num_sms))  # busy fraction of the SM slots
        if fill >= 0.95:
            return s
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def _decode_rows(group, nq):
    """(BLOCK_H, NUM_RB): the [BLOCK_H, D] query tile of a program and how many cover NQ * GROUP rows."""
    rows = group * nq
    block_h = max(16, min(_next_pow2(rows), _MAX_BLOCK_H))
    return block_h, _cdiv(rows, block_h)


def _decode_key(q, B, Hkv, Nk, num_splits, group, nq, d, page, causal, window=False, score_mod=0):
    return (q.device, q.dtype, B, Hkv, Nk, num_splits, group, nq, d, page, causal, window, score_mod)


def _check_num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def _decode_launch(q, k, v, o, seqlens, block_table, *, B, Hkv, group, nq, d, Nk, stride_kb, max_blocks,
                   head_major, page, causal, num_splits, sm_scale, config, window=(-1, -1), softcap=0.0,
                   alibi_slopes=None):
    """Launch _decode_kernel once (validated inputs; shared by both wrappers); fills o.

    window (left, right), -1 unbounded, causal sets right = 0; softcap > 0 on; alibi_slopes
    float32 contiguous [H] or [B, H]: the library's meaning, checked by the caller."""
    block_h, num_rb = _decode_rows(group, nq)
    programs = B * Hkv * num_rb
    left, right = window
    if causal:
        right = 0
    windowed = left >= 0 or right > 0  # else no bound, or the causal one alone (CAUSAL, as without a window)
    causal = not windowed and right == 0
    if num_splits is None:
        # a program's rows (tokens at p >= len - nq) see keys j >= p - left: at most left + nq of them
        seen = min(Nk, left + nq) if left >= 0 else Nk
        num_splits = _pick_num_splits(programs, seen, _num_sms(q.device))
    else:
        _check_num_splits(num_splits)
    direct = num_splits == 1
    if direct:  # nothing to merge: the kernel writes O (the workspace arguments are unused)
        o_part = lse_part = counters = o
    else:
        o_part, lse_part, counters = _decode_workspace(q.device, programs, num_splits, block_h, head_block(d))
    sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
    qk_scale = sm_scale * LOG2E.value
    unbounded = Nk + nq  # further than any key from any row
    win_left, win_right = (min(w, unbounded) if w >= 0 else unbounded for w in (left, right))
    score_mod = (1 if softcap > 0 else 0) | (2 if alibi_slopes is not None else 0)
    stride_sb = alibi_slopes.shape[-1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    args = (q, k, v, o, o_part, lse_part, counters,
            o if seqlens is None else seqlens, o if block_table is None else block_table,
            Nk, stride_kb, max_blocks, num_splits, qk_scale,
            sm_scale, float(softcap) if softcap > 0 else 1.0, o if alibi_slopes is None else alibi_slopes, stride_sb,
            win_left, win_right)
    meta = dict(HKV=Hkv, GROUP=group, NQ=nq, NUM_RB=num_rb, BLOCK_H=block_h, HEAD_DIM=d, BLOCK_D=head_block(d),
                HEAD_MAJOR=head_major, PAGE=page, VARLEN=seqlens is not None, CAUSAL=causal, DIRECT=direct,
                WINDOW=windowed, SCORE_MOD=score_mod)
    grid = (num_splits, programs)

    def launch(cfg):
        _decode_kernel[grid](*args, **meta, **cfg)

    if config is None and interpreting():
        config = _INTERPRETER_DECODE_CONFIG
    if config is None:
        key = _decode_key(q, B, Hkv, Nk, num_splits, group, nq, d, page, causal, windowed, score_mod)
        config = _decode_choice.get(key)
        if config is None:
            # timing inside CUDA-graph capture is impossible: take the first shape there, untuned
            configs = _decode_configs(q, d, block_h)
            config = configs[0] if _capturing(q.device) else _tune_decode(key, launch, configs)
    launch(config)
    return o


def flash_decode_triton(q, k, v, num_splits=None, sm_scale=None, *, config=None):
    """Decode attention for one new token: returns O [B, H, d] in q's dtype.

    q: [B, H, d]; k, v: [B, Hkv, Nk, d] with H a multiple of Hkv (query head h
    reads KV head h // (H // Hkv)). No mask: the new token sees the whole cache.
    num_splits: how many pieces the cache is cut into; None picks it from
    B*Hkv, Nk and the SM count. One kernel launch per call, whatever num_splits.
    """
    _check_qkv(q, k, v, (3, 4, 4))
    B, H, d = q.shape
    Hkv, Nk = _check_dense_kv(q, k, v)
    if B == 0 or Nk == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    o = torch.empty_like(q)  # [B, H, d]
    return _decode_launch(q, k, v, o, None, None, B=B, Hkv=Hkv, group=H // Hkv, nq=1, d=d, Nk=Nk,
                          stride_kb=Hkv * Nk * d, max_blocks=0, head_major=True, page=0, causal=False,
                          num_splits=num_splits, sm_scale=sm_scale, config=config)
