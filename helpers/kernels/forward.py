"""The FlashAttention-2 forward in Triton (lesson 07): ``flash_attn_triton(q, k, v, causal=False, sm_scale=None,
align="top_left", *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)
-> (O, lse)``.

k, v may have fewer heads than q (grouped-query attention). One program owns BLOCK_M query rows of one
(batch, head), keeps them in registers and streams the keys and values past them BLOCK_N at a time, with the
online softmax (``m_i``, ``l_i``, ``acc``, ``alpha``) in base 2: ``log2(e)`` is folded into ``qk_scale`` so every
exponential is one ``exp2``. Key tiles fall into three classes: tiles every row of the block sees in full (the
off-band loop, no mask), tiles that need a mask (the causal diagonal band and the ragged last tile: the on-band
loop) and tiles no row sees (never visited). The block body ``_attn_fwd_rows`` is shared with the packed
variable-length forward (``helpers/kernels/varlen.py``).

The FlashAttention library's options, as ``tl.constexpr`` switches of the same loop (off: the code of plain
attention, unchanged): a sliding window (``window_size``; the upper bound reuses the causal switch, the lower
bound ``WINDOW`` adds a masked lower band before the full tiles, and keys below it are never visited), Gemma 2's
softcap and ALiBi, either or both (``SCORE_MOD`` bits: the score is modified in natural units, the cap first, then
times log2(e)), and dropout (``DROPOUT``: each entry of P kept or dropped by a Philox draw on its own counter, so
``l_i`` sums the undropped P and the lse is the undropped one, as the library's; ``dropout_keep_mask`` writes the
same mask for a reference). ``_check_mods`` and ``Mods`` check the arguments for every launcher (dense, packed,
forward, backward).

Any head dim from 1 to 256: the tiles are ``head_block(d)`` wide (a power of two), loads and stores masked along
d. Any strides with a unit stride along d: the library's ``[B, N, H, d]`` is read in place as a transposed view
(``_flash_fwd``, the launch the drop-in ``helpers/kernels/interface.py`` calls), K and V through TMA where one 2-D
descriptor can view them (``_tma_layout``: head-major or token-major).

References: Dao, "FlashAttention-2" (2023), Algorithm 1; the fused-attention tutorial of Triton; Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3" (2011) for Philox. Written for this course; numbers in
bench/NOTES.md.

Runs on a CUDA GPU (fp16, bf16; fp32 with tf32 dots) or, without one (``helpers.triton_mode`` sets
``TRITON_INTERPRET=1`` before Triton is imported), on the CPU through Triton's interpreter (fp32, fp16; one
small fixed tile configuration so tests stay fast).
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .common import (LN2, LOG2E, SHAPES, TensorDescriptor, _check_alibi_slopes, _check_dense_kv, _check_dropout,
                     _check_qkv, _check_rng_state, _check_softcap, _check_window, _device_limits, _dropout_keep, _load_d,
                     _score_mod, draw_rng_state, head_block, prune_for_device, tile_configs, use_tma_for)

__all__ = ["flash_attn_triton", "dropout_keep_mask"]


# ----------------------------------------------------------------------------
# Forward (prefill): the inner loop, on its own
# ----------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,  # running state [BLOCK_M, D], [BLOCK_M], [BLOCK_M]; q [BLOCK_M, D]
    k_ptrs, v_ptrs, stride_kn, stride_vn,  # pointer path: tile of key/value rows at start_n = 0
    desc_k, desc_v, kv_row0, kv_col0,  # TMA path: 2-D descriptors; this head's keys start at (kv_row0, kv_col0)
    lo, hi,  # key range [lo, hi) to visit, lo a multiple of BLOCK_N
    offs_m, offs_n, qk_scale, Nk, diag,  # diag: row i sees keys j <= i + diag (CAUSAL: the upper bound)
    diag_lo, sm_scale, cap, slope, alibi_diag,  # WINDOW: row i sees keys j >= i + diag_lo; the score mod's scalars
    HEAD_DIM: tl.constexpr,  # the head dim d (a multiple of 8)
    BLOCK_D: tl.constexpr,  # the width the tiles have: head_block(d), the next power of two >= 16
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: full tiles, all visible; True: the bands / ragged tail
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + diag
    USE_TMA: tl.constexpr,
    WINDOW: tl.constexpr,  # a lower bound: j >= i + diag_lo
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both)
    DROPOUT: tl.constexpr,  # the library's dropout on P: l_i sums the undropped p, acc the kept ones
    p_drop, seed, drop_off, bh,  # its probability, Philox key and counter offset, the query head (b * H + h)
    # paged K/V, last and off by default (the packed forward's block_table): key j is row j % page of page
    # BT[j // page]; k_ptrs, v_ptrs then point at column 0 of the KV head in page 0, stride_kn, stride_vn are the
    # row strides within a page, stride_kp, stride_vp the page strides (a lookup of BLOCK_N table entries per tile)
    PAGED: tl.constexpr = False, BT=None, page=1, stride_kp=0, stride_vp=0,
):
    d_ok = tl.arange(0, BLOCK_D) < HEAD_DIM  # [BLOCK_D] the real columns (zeros are loaded past d)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        # -- load one tile of keys and values --------------------------------
        if PAGED:
            keys = start_n + offs_n  # [BLOCK_N]
            pg = tl.load(BT + keys // page, mask=keys < Nk, other=0).to(tl.int64)  # [BLOCK_N] each key's page
            r = (keys % page).to(tl.int64)  # [BLOCK_N] its row in the page
            kp = k_ptrs + (pg * stride_kp + r * stride_kn)[:, None]  # [BLOCK_N, D]
            vp = v_ptrs + (pg * stride_vp + r * stride_vn)[:, None]  # [BLOCK_N, D]
            if MASKED:
                in_range = (keys[:, None] < Nk) & d_ok[None, :]  # [BLOCK_N, D]
                k = tl.load(kp, mask=in_range, other=0.0)  # [BLOCK_N, D]
                v = tl.load(vp, mask=in_range, other=0.0)  # [BLOCK_N, D]
            else:
                k = _load_d(kp, d_ok, BLOCK_D != HEAD_DIM)  # [BLOCK_N, D]
                v = _load_d(vp, d_ok, BLOCK_D != HEAD_DIM)  # [BLOCK_N, D]
        elif USE_TMA:
            k = desc_k.load([kv_row0 + start_n, kv_col0])  # [BLOCK_N, D]
            v = desc_v.load([kv_row0 + start_n, kv_col0])  # [BLOCK_N, D]
            if MASKED:  # rows past Nk belong to the next head or sequence: their scores are masked, and
                # zeroing their values keeps a NaN or inf there out of this one (p = 0 times NaN is NaN)
                v = tl.where((start_n + offs_n)[:, None] < Nk, v, 0.0)
        elif MASKED:
            in_range = ((start_n + offs_n)[:, None] < Nk) & d_ok[None, :]  # [BLOCK_N, D]
            k = tl.load(k_ptrs + start_n * stride_kn, mask=in_range, other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptrs + start_n * stride_vn, mask=in_range, other=0.0)  # [BLOCK_N, D]
        else:
            k = _load_d(k_ptrs + start_n * stride_kn, d_ok, BLOCK_D != HEAD_DIM)  # [BLOCK_N, D]
            v = _load_d(v_ptrs + start_n * stride_vn, d_ok, BLOCK_D != HEAD_DIM)  # [BLOCK_N, D]
        # -- scores, in base-2 units -----------------------------------------
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        if MASKED:
            cols = start_n + offs_n  # [BLOCK_N]
            keep = cols[None, :] < Nk  # [1, BLOCK_N]
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)  # [BLOCK_M, BLOCK_N]
            if WINDOW:
                keep = keep & (cols[None, :] >= offs_m[:, None] + diag_lo)  # [BLOCK_M, BLOCK_N]
            if SCORE_MOD == 0:
                qk = tl.where(keep, qk * qk_scale, float("-inf"))
            else:  # the modification before the mask and the running max
                s2, _ = _score_mod(qk, offs_m[:, None], cols[None, :], sm_scale, cap, slope, alibi_diag, SCORE_MOD)
                qk = tl.where(keep, s2, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
            # a row that has seen no key yet subtracts 0 instead of -inf (no NaN)
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            if not WINDOW:  # its first key is in the first tile visited: it may keep the 0 as its max
                m_ij = m_sub
            # With a lower bound a row's first key can come in a later tile: its max stays -inf, else a far key
            # with a very negative score would give p = exp2(s - 0), lost to underflow in P V while l keeps it.
            p = tl.math.exp2(qk - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        elif SCORE_MOD == 0:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
            m_sub = m_ij
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            cols = start_n + offs_n  # [BLOCK_N]
            s2, _ = _score_mod(qk, offs_m[:, None], cols[None, :], sm_scale, cap, slope, alibi_diag, SCORE_MOD)
            m_ij = tl.maximum(m_i, tl.max(s2, 1))  # [BLOCK_M]
            m_sub = m_ij
            p = tl.math.exp2(s2 - m_ij[:, None])  # [BLOCK_M, BLOCK_N]
        # -- online softmax: rescale what we had, add this tile ---------------
        alpha = tl.math.exp2(m_i - m_sub)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)  # [BLOCK_M]
        acc = acc * alpha[:, None]  # [BLOCK_M, D]
        if DROPOUT:  # the mask on P; l_i keeps the undropped sum, so the lse is the undropped one
            keep = _dropout_keep(seed, drop_off, bh, offs_m[:, None], (start_n + offs_n)[None, :], p_drop)
            p = tl.where(keep, p, 0.0)  # [BLOCK_M, BLOCK_N]
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_rows(
    q,  # [BLOCK_M, D] this block's query rows (zeros past the last row)
    k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,  # as in _attn_fwd_inner
    start_m, offs_m, offs_n, qk_scale, Nk, diag,  # start_m: block index; offs_m: rows from 0 of the sequence
    diag_lo, sm_scale, cap, slope, alibi_diag,  # as in _attn_fwd_inner
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    # dropout, last and off by default (a caller written before it still compiles): its probability, the Philox key
    # and counter offset, the query head the counters name (common._dropout_keep)
    DROPOUT: tl.constexpr = False, p_drop=0.0, seed=0, drop_off=0, bh=0,
):
    """One block of query rows against keys [0, Nk): returns (O [BLOCK_M, D] float32, lse [BLOCK_M] natural log).

    Row i sees key j when j < Nk, j <= i + diag (CAUSAL) and j >= i + diag_lo (WINDOW). Shared by the dense
    forward and the packed variable-length one (helpers/kernels/varlen.py): the caller finds the rows and the
    keys, this visits the key tiles in their classes and normalises. With DROPOUT, O = (P * keep) V / (1 - p_drop)
    and the lse is that of the undropped P (the library's semantics).
    """
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running numerator (columns past d stay 0)

    # Tile classes, in key order. Keys [0, win_lo): seen by no row (below the first row's lower bound), never
    # visited. [win_lo, full_lo): the lower band, masked (WINDOW only). [full_lo, band_lo): seen in full by every
    # row, no mask. [band_lo, band_hi): the upper band (diagonal, ragged tail), masked. Keys >= band_hi: seen by
    # no row of this block, never visited. Without WINDOW, win_lo = full_lo = 0: lesson 04's three classes.
    if CAUSAL:
        first_row_end = tl.minimum(tl.maximum(start_m * BLOCK_M + diag + 1, 0), Nk)  # keys < this: all rows
        band_lo = (first_row_end // BLOCK_N) * BLOCK_N
        band_hi = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M + diag, 0), Nk)
    else:
        band_lo = (Nk // BLOCK_N) * BLOCK_N
        band_hi = Nk
    if WINDOW:
        win_lo = tl.minimum(tl.maximum(start_m * BLOCK_M + diag_lo, 0), Nk)  # the first row's first key
        last_row_lo = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M - 1 + diag_lo, 0), Nk)  # keys >= : all rows
        full_lo = ((last_row_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,
            (win_lo // BLOCK_N) * BLOCK_N, tl.minimum(full_lo, band_hi), offs_m, offs_n, qk_scale, Nk, diag,
            diag_lo, sm_scale, cap, slope, alibi_diag,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, USE_TMA, WINDOW, SCORE_MOD, DROPOUT, p_drop, seed, drop_off, bh,
        )
        band_lo = tl.maximum(band_lo, full_lo)  # a window narrower than a tile: no full tile, nothing twice
    else:
        full_lo = 0

    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,
        full_lo, band_lo, offs_m, offs_n, qk_scale, Nk, diag,
        diag_lo, sm_scale, cap, slope, alibi_diag,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, USE_TMA, WINDOW, SCORE_MOD, DROPOUT, p_drop, seed, drop_off, bh,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,
        band_lo, band_hi, offs_m, offs_n, qk_scale, Nk, diag,
        diag_lo, sm_scale, cap, slope, alibi_diag,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, USE_TMA, WINDOW, SCORE_MOD, DROPOUT, p_drop, seed, drop_off, bh,
    )

    # epilogue: normalise; a row that saw no key gets O = 0, lse = -inf
    empty = l_i == 0.0  # [BLOCK_M]
    l_safe = tl.where(empty, 1.0, l_i)
    if DROPOUT:
        l_safe = l_safe * (1.0 - p_drop)  # the kept entries scaled by 1 / (1 - p_drop)
    acc = acc / l_safe[:, None]  # [BLOCK_M, D]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)  # [BLOCK_M] natural log
    return acc, lse


# the window's and ALiBi's offsets, the dropout seeds: one compile for all N and every call
@triton.jit(do_not_specialize=["diag_lo", "alibi_diag", "seed", "drop_off"])
def _attn_fwd(
    Q, K, V, O, LSE,
    desc_k, desc_v,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    H, Hkv, N, Nk, diag, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM): loads and stores along d are masked with HEAD_DIM
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: row i sees keys j <= i + diag
    USE_TMA: tl.constexpr,
    # the library's options, last and off by default (a launch written before them still runs):
    SLOPES=None, stride_sb=0,  # ALiBi: slope of (b, h) at SLOPES[b * stride_sb + h] (stride_sb = 0: one per head)
    diag_lo=0, sm_scale=1.0, cap=1.0, alibi_diag=0,  # the window's lower bound, the score mod's scalars
    WINDOW: tl.constexpr = False,  # a lower bound: row i sees keys j >= i + diag_lo
    SCORE_MOD: tl.constexpr = 0,  # bits: 1 softcap, 2 ALiBi (3: both)
    tma_rb=0, tma_rh=0, tma_ch=0,  # TMA: KV head (b, h) starts at row b * tma_rb + h * tma_rh, column h * tma_ch
    p_drop=0.0, seed=0, drop_off=0,  # dropout: its probability, the Philox key and counter offset
    DROPOUT: tl.constexpr = False,
):
    # grid = (cdiv(N, BLOCK_M), B * H); causal blocks run heaviest (last) first
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // (H // Hkv)  # grouped-query attention: H // Hkv query heads share a KV head

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N] key rows within a tile
    offs_d = tl.arange(0, BLOCK_D)  # [D] (D = BLOCK_D, the columns past HEAD_DIM masked)
    d_ok = offs_d < HEAD_DIM  # [D]

    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, D]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]  # [BLOCK_N, D]
    # TMA: the descriptors view K, V as 2-D [rows, columns] with the token stride as the row stride ([B*Hkv*Nk, D]
    # for [B, Hkv, Nk, D]; [B*Nk, Hkv*D] for the library's [B, Nk, Hkv, D]): this KV head's keys start here
    kv_row0 = off_b * tma_rb + off_hkv * tma_rh
    kv_col0 = off_hkv * tma_ch

    row_ok = offs_m < N  # [BLOCK_M] the last block may run past N
    io_ok = row_ok[:, None] & d_ok[None, :]  # [BLOCK_M, D]
    rows64 = offs_m[:, None].to(tl.int64)  # [BLOCK_M, 1]: the library's [B, N, H, d] puts rows H * d apart
    q = tl.load(q_base + rows64 * stride_qm + offs_d[None, :], mask=io_ok, other=0.0)  # [BLOCK_M, D]
    slope = 0.0
    if SCORE_MOD & 2:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h)

    acc, lse = _attn_fwd_rows(
        q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,
        start_m, offs_m, offs_n, qk_scale, Nk, diag, diag_lo, sm_scale, cap, slope, alibi_diag,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, USE_TMA, WINDOW, SCORE_MOD, DROPOUT, p_drop, seed, drop_off, off_bh,
    )
    tl.store(LSE + off_bh.to(tl.int64) * N + offs_m, lse, mask=row_ok)
    tl.store(o_base + rows64 * stride_om + offs_d[None, :], acc.to(O.dtype.element_ty), mask=io_ok)


# ----------------------------------------------------------------------------
# Forward: configurations and wrapper
# ----------------------------------------------------------------------------

_INTERPRETER_FWD_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


# (BLOCK_M, BLOCK_N, num_warps, num_stages): a small set around what won on an H200
_FWD_SHAPES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3)]


def _fwd_configs():
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_kv_block_shape)
        for bm, bn, w, s in _FWD_SHAPES
    ]


SHAPES["fwd"] = lambda d: tile_configs(_FWD_SHAPES)


def _set_kv_block_shape(nargs):
    for name in ("desc_k", "desc_v"):
        desc = nargs.get(name)
        if desc is not None:
            desc.block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


_attn_fwd_tuned = triton.autotune(
    configs=_fwd_configs(),
    key=["N", "Nk", "HEAD_DIM", "CAUSAL", "USE_TMA", "WINDOW", "SCORE_MOD", "DROPOUT"],
    prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: prune_for_device("fwd", configs, nargs, kw)},
)(_attn_fwd)


def _use_tma_default(q):
    if interpreting() or q.device.type != "cuda":
        return False
    return use_tma_for(_device_limits(q.device)[0], q.dtype) and use_tma_for((9, 0), q.dtype, q.shape[-1])


def _check_use_tma(use_tma, q):
    """An explicit use_tma=True on a GPU without TMA (before sm_90), or for a head dim that is not a power of two:
    a clear error, not a compile error."""
    if use_tma and not interpreting() and q.device.type == "cuda":
        cap = _device_limits(q.device)[0]
        if not use_tma_for(cap, q.dtype):
            raise ValueError(f"use_tma=True needs TMA (compute capability 9.0 or newer, fp16 or bf16); this is "
                             f"sm_{cap[0]}{cap[1]} with {str(q.dtype).replace('torch.', '')}: leave use_tma=None")
    if use_tma and head_block(q.shape[-1]) != q.shape[-1]:
        raise ValueError(f"use_tma=True needs a head dim that is a power of two (16 .. 256); d = {q.shape[-1]} "
                         f"takes the pointer path: leave use_tma=None")


# ----------------------------------------------------------------------------
# The FlashAttention library's window_size, softcap, alibi_slopes: checks and the kernels' switches
# ----------------------------------------------------------------------------

class Mods(NamedTuple):
    """The checked window and score modification: ``left``, ``right`` (-1 unbounded; causal folded in as right = 0),
    ``score_mod`` (bits: 1 softcap, 2 ALiBi), ``cap``, ``slopes`` (float32 [H] or [B, H], or None) and the slopes'
    batch stride (0 for [H])."""
    left: int
    right: int
    score_mod: int
    cap: float
    slopes: torch.Tensor | None
    stride_sb: int

    def diags(self, diag):
        """(upper, lower) bounds for the kernels from the causal diagonal ``diag``: row i sees key j when
        i + diag - left <= j <= i + diag + right. An unbounded side gives 0 (its switch is off)."""
        return (diag + self.right if self.right >= 0 else 0), (diag - self.left if self.left >= 0 else 0)

    def meta(self):
        """The kernels' constexpr switches: CAUSAL (an upper bound), WINDOW (a lower bound), SCORE_MOD."""
        return dict(CAUSAL=self.right >= 0, WINDOW=self.left >= 0, SCORE_MOD=self.score_mod)


def _check_mods(causal, window_size, softcap, alibi_slopes, H, batch, device, batch_name="B", both=False):
    """Checks the library's arguments; returns ``Mods``. ``batch``: the slopes' leading dim when 2-D (B, or the
    number of sequences of a packed batch, named ``batch_name``). ``both``: the caller's kernels take softcap and
    ALiBi together (SCORE_MOD 3: the dense forward and backward); else the pair is refused."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    left, right = _check_window(window_size)
    if causal:
        right = 0  # the library: causal with a window means right = 0
    softcap = _check_softcap(softcap)
    score_mod, cap, stride_sb = (1 if softcap > 0 else 0), (softcap if softcap > 0 else 1.0), 0
    if alibi_slopes is not None:
        if softcap > 0 and not both:
            raise ValueError("softcap and alibi_slopes together are not supported: pass one of them")
        alibi_slopes = _check_alibi_slopes(alibi_slopes, batch, H, device, batch_name)
        score_mod, stride_sb = score_mod | 2, (H if alibi_slopes.dim() == 2 else 0)
    return Mods(left, right, score_mod, cap, alibi_slopes, stride_sb)


class Dropout(NamedTuple):
    """The library's dropout for one call: probability ``p`` (0.0 = off) and the Philox ``seed`` and ``offset``
    (``common.draw_rng_state``) that name its mask; the backward takes the same three and regenerates it."""
    p: float = 0.0
    seed: int = 0
    offset: int = 0

    def meta(self):
        return dict(DROPOUT=self.p > 0, p_drop=self.p, seed=self.seed, drop_off=self.offset)


NO_DROPOUT = Dropout()


def _check_dropout_args(dropout_p, rng_state, draw=True):
    """``Dropout`` from the public arguments: rng_state (seed, offset), or with ``draw`` a fresh one when None."""
    p = _check_dropout(dropout_p)
    if p == 0.0:
        return NO_DROPOUT
    if rng_state is None:
        if not draw:
            raise ValueError("dropout_p > 0 in the backward needs the forward's rng_state=(seed, offset)")
        rng_state = draw_rng_state()
    return Dropout(p, *_check_rng_state(rng_state))


BACKENDS = ("auto", "triton", "gluon")
# (d, causal) where backend="auto" takes the Gluon forward: where it was faster than this file's kernel on an H200
# (bf16 and fp16, N 4096 and 16384; bench/NOTES.md, issue 26 call 2; lesson 11's route table prints the run). Not
# d = 64 causal: there it was within a few percent at N >= 4096, and at N = 2048 (the GPT of bench/train_gpt.py,
# B = 16, H = 12) routing it made the attention forward slower (bench/results/logs/train_gpt_gluon_fwd_2026-12-01.txt).
GLUON_ROUTES = {(64, False), (128, False), (128, True)}


def _why_not_gluon(q, mods, use_tma, config):
    """'' when lesson 11's Gluon forward (``gluon_forward.py``, sm_90 only) can take this call, else why not: it
    takes bf16/fp16, d = 64 or 128, full or causal attention (either alignment), GQA; no window, softcap or ALiBi,
    and no fixed Triton tiles (``use_tma``, ``config`` name the Triton kernel's)."""
    if interpreting() or q.device.type != "cuda":
        return "the Gluon kernels run only natively on an sm_90 GPU (no interpreter, no CPU)"
    cap = _device_limits(q.device)[0]
    if cap != (9, 0):
        return f"the Gluon kernels need sm_90 (H100, H200); this GPU is sm_{cap[0]}{cap[1]}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon kernels take bfloat16 or float16, not {str(q.dtype).replace('torch.', '')}"
    if q.shape[-1] not in (64, 128):
        return f"the Gluon kernels take d = 64 or 128, not {q.shape[-1]}"
    if mods.left >= 0 or mods.right > 0 or mods.score_mod:
        return "the Gluon kernels have no window_size, softcap or alibi_slopes"
    if use_tma is not None or config is not None:
        return "use_tma and config fix the Triton kernel's tiles"
    try:
        from . import gluon_forward  # noqa: F401  (a Triton without Gluon's Hopper API cannot import it)
    except ImportError as e:
        return f"this Triton has no Gluon Hopper API ({e})"
    return ""


def _tma_layout(k, v):
    """How the TMA descriptors view K and V [B, Hkv, Nk, d] (any strides, d a power of two): (rows, columns,
    row stride, tma_rb, tma_rh, tma_ch), KV head (b, h) starting at row b * tma_rb + h * tma_rh, column
    h * tma_ch of a 2-D [rows, columns] view whose row stride is the token stride; None where no such view exists
    (or K and V differ in strides, or an address or row is not 16-byte aligned). Two layouts have one:
    head-major (a head's keys are whole rows: [B, Hkv, Nk, d]) and token-major (a token's heads side by side in
    one row: the library's [B, Nk, Hkv, d], and the packed kv[:, :, 0] and qkv[:, :, 1])."""
    B, Hkv, Nk, d = k.shape
    if k.stride() != v.stride():
        return None
    sb, sh, sn, _ = k.stride()
    elt = k.element_size()
    if sn <= 0 or (sn * elt) % 16 or k.data_ptr() % 16 or v.data_ptr() % 16:
        return None
    if B > 1 and sb % sn:
        return None
    rb = sb // sn if B > 1 else 0
    if Hkv == 1 or sh % sn == 0 and sh >= sn * Nk:  # head-major: each head its own rows
        rh = sh // sn if Hkv > 1 else 0
        return (B - 1) * rb + (Hkv - 1) * rh + Nk, d, sn, rb, rh, 0
    if (Hkv - 1) * sh + d <= sn and sh >= d:  # token-major: the heads side by side in a row
        return (B - 1) * rb + Nk, (Hkv - 1) * sh + d, sn, rb, 0, sh
    return None


def _flash_fwd(q, k, v, mods, sm_scale, diag0, *, o=None, dropout=NO_DROPOUT, use_tma=None, config=None):
    """The dense forward's launch on checked inputs: q [B, H, N, d], k, v [B, Hkv, Nk, d], any strides with a unit
    stride along d (the library's [B, N, H, d] passed as a transposed view: nothing is copied); ``o``: where O goes
    (q's shape, any such strides; None allocates one like q). Row i sees keys diag_lo + i <= j <= i + diag, from
    ``mods`` and the causal diagonal ``diag0``. Returns (o, lse [B, H, N] float32)."""
    B, H, N, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qk_scale = float(sm_scale) * LOG2E.value  # scores in base-2 units: exp(s) = exp2(s * LOG2E)
    diag, diag_lo = mods.diags(diag0)  # row i sees keys diag_lo + i <= j <= i + diag
    if o is None:
        o = torch.empty_like(q)  # [B, H, N, d]
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)  # [B, H, N]
    view = _tma_layout(k, v) if use_tma is not False and head_block(d) == d else None
    if use_tma is None:
        use_tma = _use_tma_default(q) and view is not None
    _check_use_tma(use_tma, q)
    if use_tma and view is None:
        raise ValueError(f"use_tma=True needs k and v in a layout one 2-D descriptor can view (head-major or "
                         f"token-major, 16-byte aligned rows); these have strides {k.stride()}, {v.stride()}: "
                         f"leave use_tma=None")
    desc_k = desc_v = None
    tma = dict(tma_rb=0, tma_rh=0, tma_ch=0)
    if use_tma:
        rows, cols, row_stride, rb, rh, ch = view
        dummy_block = [16, d]  # replaced by the config's pre_hook
        desc_k = TensorDescriptor(k, [rows, cols], [row_stride, 1], dummy_block)  # [rows, cols] over k's storage
        desc_v = TensorDescriptor(v, [rows, cols], [row_stride, 1], dummy_block)
        tma = dict(tma_rb=rb, tma_rh=rh, tma_ch=ch)

    args = (
        q, k, v, o, lse, desc_k, desc_v,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        H, Hkv, N, Nk, diag, qk_scale,
    )
    meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), USE_TMA=bool(use_tma), SLOPES=mods.slopes, stride_sb=mods.stride_sb,
                diag_lo=diag_lo, sm_scale=float(sm_scale), cap=mods.cap,
                alibi_diag=diag0 if mods.score_mod & 2 else 0, **mods.meta(), **tma, **dropout.meta())
    if interpreting() or config is not None:
        cfg = dict(_INTERPRETER_FWD_CONFIG if config is None else config)
        if use_tma:
            desc_k.block_shape = [cfg["BLOCK_N"], d]
            desc_v.block_shape = [cfg["BLOCK_N"], d]
        grid = (triton.cdiv(N, cfg["BLOCK_M"]), B * H)
        _attn_fwd[grid](*args, **meta, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
        _attn_fwd_tuned[grid](*args, **meta)
    return o, lse


def _check_fwd_inputs(q, k, v, align, strided=True):
    """The dense entry points' checks of q [B, H, N, d], k, v [B, Hkv, Nk, d] (any d from 1 to 256; any strides
    with a unit stride along d): returns (B, H, Hkv, N, Nk, d)."""
    _check_qkv(q, k, v, (4, 4, 4), strided=strided)
    B, H, N, d = q.shape
    Hkv, Nk = _check_dense_kv(q, k, v, any_d=True)
    if N == 0 or Nk == 0 or B == 0 or H == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return B, H, Hkv, N, Nk, d


def dropout_keep_mask(B, H, N, Nk, dropout_p, rng_state, device, *, row0=0):
    """The keep mask the kernels apply for ``dropout_p`` and ``rng_state`` = (seed, offset): bool [B, H, N, Nk],
    True where P[b, h, i, j] is kept (``common._dropout_keep`` on the same counters, in a kernel of its own): the
    reference a test builds from the kernels' own mask, and the sign pattern of ``return_attn_probs``. ``row0``:
    the first row's index (a mask of rows row0 .. row0 + N - 1)."""
    drop = _check_dropout_args(dropout_p, rng_state, draw=False)
    keep = torch.empty((B, H, N, Nk), device=device, dtype=torch.int8)
    if keep.numel():
        grid = (triton.cdiv(N, _MASK_BLOCK), triton.cdiv(Nk, _MASK_BLOCK), B * H)
        _dropout_mask_kernel[grid](keep, N, Nk, row0, drop.p, drop.seed, drop.offset, BLOCK=_MASK_BLOCK)
    return keep.bool()


_MASK_BLOCK = 32


@triton.jit(do_not_specialize=["seed", "drop_off"])
def _dropout_mask_kernel(KEEP, N, Nk, row0, p_drop, seed, drop_off, BLOCK: tl.constexpr):
    # grid = (cdiv(N, BLOCK), cdiv(Nk, BLOCK), B * H); KEEP [B * H, N, Nk] int8
    bh = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    keep = _dropout_keep(seed, drop_off, bh, (row0 + rows)[:, None], cols[None, :], p_drop)  # [BLOCK, BLOCK]
    ok = (rows < N)[:, None] & (cols < Nk)[None, :]
    ptrs = KEEP + bh.to(tl.int64) * N * Nk + rows[:, None].to(tl.int64) * Nk + cols[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=ok)


def flash_attn_triton(q, k, v, causal=False, sm_scale=None, align="top_left", *, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, rng_state=None, use_tma=None, config=None, backend="auto"):
    """Attention forward: returns ``(O, lse)``.

    q: [B, H, N, d], any d from 1 to 256 (a d that is not a power of two computes in the next one's tiles, masked
    along d); k, v: [B, Hkv, Nk, d] (Nk may differ from N; H a multiple of Hkv: grouped-query attention, query head
    h reads KV head h // (H // Hkv)). Any strides with a unit stride along d: the library's [B, N, H, d] passed as
    ``x.transpose(1, 2)`` is read in place. fp16 or bf16 on a GPU (fp32 too, with tf32 dot products); fp32 or fp16
    under the interpreter. O: [B, H, N, d] in q's dtype (q's strides where q is dense, else contiguous); lse:
    [B, H, N] float32, natural log of each row's softmax denominator (with the scale applied), -inf for a row that
    sees no key (its O is 0).

    causal: query row i sees key j when j <= i + diag, where diag = 0 for
    ``align="top_left"`` (SDPA ``is_causal=True``) and diag = Nk - N for
    ``align="bottom_right"`` (the FlashAttention library: the last query sees
    every key). The two agree when N == Nk. With bottom_right and N > Nk the
    first N - Nk rows see nothing: O = 0, lse = -inf.

    The FlashAttention library's ``flash_attn_func`` options, on the same diagonal (diag = 0 top-left, Nk - N
    bottom-right):

    * window_size=(left, right): row i sees key j when i + diag - left <= j <= i + diag + right; -1 is
      unbounded on that side; causal=True sets right = 0. (-1, -1) without causal is full attention, (-1, 0)
      is causal. A row that sees no key gets O = 0, lse = -inf.
    * softcap > 0: the scaled score s = q.k * sm_scale becomes softcap * tanh(s / softcap) (Gemma 2), before
      the mask and the softmax; 0.0 is off.
    * alibi_slopes: float32 [H] or [B, H] on q's device: s becomes s - slope[b, h] * |i + diag - j| (after the
      softcap when both are given, as in the library).
    * dropout_p: the probability of dropping an entry of P after the softmax; the kept ones are scaled by
      1 / (1 - dropout_p) and the lse is that of the undropped P. ``rng_state`` = (seed, offset) names the mask
      (``dropout_keep_mask`` rebuilds it); None draws one from torch's generator (``torch.manual_seed`` makes it
      reproducible). The backward needs the same rng_state: ``flash_attention`` keeps it for you.

    sm_scale: defaults to 1/sqrt(d). ``use_tma`` and ``config`` (a dict with
    BLOCK_M, BLOCK_N, num_warps, num_stages) are for benchmarking; leave them
    as None to autotune.

    backend: "auto" runs lesson 11's Gluon forward (``gluon_forward(..., variant="auto")``) where it can take the
    call and was measured faster (``GLUON_ROUTES``): an sm_90 GPU with bf16/fp16, d = 128 full or causal or d = 64
    full, contiguous inputs, and no window, softcap, ALiBi, dropout, ``use_tma`` or ``config``; the Triton kernel
    everywhere else. "triton" always runs the Triton kernel; "gluon" the Gluon one, or a ValueError that says why
    it does not.
    """
    B, H, Hkv, N, Nk, d = _check_fwd_inputs(q, k, v, align)
    mods = _check_mods(bool(causal), window_size, softcap, alibi_slopes, H, B, q.device, both=True)
    dropout = _check_dropout_args(dropout_p, rng_state)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend != "triton":
        why = _why_not_gluon(q, mods, use_tma, config)
        if not why and dropout.p > 0:
            why = "the Gluon kernels have no dropout"
        if not why and not all(t.is_contiguous() for t in (q, k, v)):
            why = "the Gluon kernels take contiguous q, k, v"
        if backend == "gluon" and why:
            raise ValueError(f"backend='gluon': {why}")
        if not why and (backend == "gluon" or (d, mods.right == 0) in GLUON_ROUTES):
            from .gluon_forward import gluon_forward
            return gluon_forward(q, k, v, sm_scale=float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale),
                                 variant="auto", causal=mods.right == 0, align=align)
    diag0 = (Nk - N) if align == "bottom_right" else 0
    return _flash_fwd(q, k, v, mods, sm_scale, diag0, dropout=dropout, use_tma=use_tma, config=config)
