"""FlashAttention forward and FlashDecoding in Triton (notebook 07).

Two public functions:

* ``flash_attn_triton(q, k, v, causal=False, sm_scale=None, align="top_left") -> (O, lse)``:
  the FlashAttention-2 forward pass (k, v may have fewer heads than q: grouped-query
  attention). One program owns BLOCK_M query rows of one
  (batch, head), keeps them in registers and streams the keys and values past
  them BLOCK_N at a time, with the online softmax (``m_i``, ``l_i``, ``acc``,
  ``alpha``) in base 2: ``log2(e)`` is folded into ``qk_scale`` so every
  exponential is one ``exp2``. Key tiles fall into three classes: tiles every
  row of the block sees in full (the off-band loop, no mask), tiles that need a
  mask (the causal diagonal band and the ragged last tile: the on-band loop) and
  tiles no row sees (never visited).
* ``flash_decode_triton(q, k, v, num_splits=None) -> O``: one new token per
  sequence against a long KV cache (Flash-Decoding). The cache is cut into
  ``num_splits`` pieces, each program writes a partial ``(O_s, lse_s)`` for its
  piece, and the last program of a head to finish (an atomic counter) merges
  them with weights ``exp(lse_s - lse)``: one kernel launch per call.
  Grouped-query attention: query head ``h`` reads KV head ``h // (H // Hkv)``.
  The same kernel serves ``flash_attn_with_kvcache_triton`` (helpers/triton_kvcache.py).

References: Dao, "FlashAttention-2" (2023), Algorithm 1; Dao et al.,
"Flash-Decoding for long-context inference" (2023); the fused-attention and
matmul tutorials of Triton. Written for this course; numbers in
bench/NOTES.md.

Runs on a CUDA GPU (fp16, bf16) or, without one (``helpers.triton_mode`` sets ``TRITON_INTERPRET=1`` before
Triton is imported), on the CPU through Triton's interpreter (fp32, fp16; one
small fixed tile configuration so tests stay fast).
"""

import math

import torch
import triton
import triton.language as tl

from .triton_mode import interpreting

try:  # host-side TMA descriptors (Hopper and newer); absent in old Triton
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["flash_attn_triton", "flash_decode_triton", "interpreting"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


# ----------------------------------------------------------------------------
# Forward (prefill): the inner loop, on its own
# ----------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,  # running state [BLOCK_M, D], [BLOCK_M], [BLOCK_M]; q [BLOCK_M, D]
    k_ptrs, v_ptrs, stride_kn, stride_vn,  # pointer path: tile of key/value rows at start_n = 0
    desc_k, desc_v, kv_row0, kv_col0,  # TMA path: 2-D descriptors; this head's keys start at (kv_row0, kv_col0)
    lo, hi,  # key range [lo, hi) to visit, lo a multiple of BLOCK_N
    offs_m, offs_n, qk_scale, Nk, diag,  # diag: row i sees keys j <= i + diag (causal)
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: off-band tiles, all visible; True: the band / ragged tail
    CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        # -- load one tile of keys and values --------------------------------
        if USE_TMA:
            k = desc_k.load([kv_row0 + start_n, kv_col0])  # [BLOCK_N, D]
            v = desc_v.load([kv_row0 + start_n, kv_col0])  # [BLOCK_N, D]
            if MASKED:  # rows past Nk belong to the next head or sequence: their scores are masked, and
                # zeroing their values keeps a NaN or inf there out of this one (p = 0 times NaN is NaN)
                v = tl.where((start_n + offs_n)[:, None] < Nk, v, 0.0)
        elif MASKED:
            in_range = (start_n + offs_n)[:, None] < Nk  # [BLOCK_N, 1]
            k = tl.load(k_ptrs + start_n * stride_kn, mask=in_range, other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptrs + start_n * stride_vn, mask=in_range, other=0.0)  # [BLOCK_N, D]
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)  # [BLOCK_N, D]
            v = tl.load(v_ptrs + start_n * stride_vn)  # [BLOCK_N, D]
        # -- scores, in base-2 units -----------------------------------------
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        if MASKED:
            cols = start_n + offs_n  # [BLOCK_N]
            keep = cols[None, :] < Nk  # [1, BLOCK_N]
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)  # [BLOCK_M, BLOCK_N]
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
            # a row that has seen no key yet keeps m = -inf: subtract 0 instead (no NaN)
            m_ij = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_ij[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])  # [BLOCK_M, BLOCK_N]
        # -- online softmax: rescale what we had, add this tile ---------------
        alpha = tl.math.exp2(m_i - m_ij)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)  # [BLOCK_M]
        acc = acc * alpha[:, None]  # [BLOCK_M, D]
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_rows(
    q,  # [BLOCK_M, D] this block's query rows (zeros past the last row)
    k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,  # as in _attn_fwd_inner
    start_m, offs_m, offs_n, qk_scale, Nk, diag,  # start_m: block index; offs_m: rows from 0 of the sequence
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """One block of query rows against keys [0, Nk): returns (O [BLOCK_M, D] float32, lse [BLOCK_M] natural log).

    Shared by the dense forward and the packed variable-length one (helpers/triton_varlen.py): the caller
    finds the rows and the keys, this visits the key tiles in their classes and normalises.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running numerator

    # Tile classes. Off-band: keys [0, band_lo) are seen in full by every row.
    # On-band: keys [band_lo, band_hi) need a mask (diagonal, ragged tail).
    # Keys >= band_hi are seen by no row of this block: never visited.
    if CAUSAL:
        first_row_end = tl.minimum(tl.maximum(start_m * BLOCK_M + diag + 1, 0), Nk)  # keys < this: all rows
        band_lo = (first_row_end // BLOCK_N) * BLOCK_N
        band_hi = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M + diag, 0), Nk)
    else:
        band_lo = (Nk // BLOCK_N) * BLOCK_N
        band_hi = Nk

    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,
        0, band_lo, offs_m, offs_n, qk_scale, Nk, diag,
        BLOCK_N, False, CAUSAL, USE_TMA,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_col0,
        band_lo, band_hi, offs_m, offs_n, qk_scale, Nk, diag,
        BLOCK_N, True, CAUSAL, USE_TMA,
    )

    # epilogue: normalise; a row that saw no key gets O = 0, lse = -inf
    empty = l_i == 0.0  # [BLOCK_M]
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]  # [BLOCK_M, D]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # [BLOCK_M] natural log
    return acc, lse


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE,
    desc_k, desc_v,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    H, Hkv, N, Nk, diag, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
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
    offs_d = tl.arange(0, HEAD_DIM)  # [D]

    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, D]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]  # [BLOCK_N, D]
    kv_row0 = (off_b * Hkv + off_hkv) * Nk  # first row of this KV head in the [B*Hkv*Nk, D] view

    row_ok = offs_m < N  # [BLOCK_M] the last block may run past N
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    acc, lse = _attn_fwd_rows(
        q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, 0,
        start_m, offs_m, offs_n, qk_scale, Nk, diag,
        HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, USE_TMA,
    )
    tl.store(LSE + off_bh.to(tl.int64) * N + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])


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


def _set_kv_block_shape(nargs):
    for name in ("desc_k", "desc_v"):
        desc = nargs.get(name)
        if desc is not None:
            desc.block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


_attn_fwd_tuned = triton.autotune(
    configs=_fwd_configs(),
    key=["N", "Nk", "HEAD_DIM", "CAUSAL", "USE_TMA"],
    prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: prune_for_device("fwd", configs, nargs, kw)},
)(_attn_fwd)

_DTYPES_GPU = (torch.float16, torch.bfloat16, torch.float32)
_DTYPES_CPU = (torch.float16, torch.float32)


def _check_tensor(name, x, ndim, dtypes):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; expected one of: {names}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_device(*tensors, names=("q", "k", "v")):
    dev = tensors[0].device
    for name, t in zip(names, tensors):
        if t.device != dev:
            raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must be on one device; "
                             f"{name} is on {t.device}, {names[0]} on {dev}")
    if interpreting():
        if dev.type != "cpu":
            raise ValueError("with TRITON_INTERPRET=1 the tensors must be on the CPU")
        return _DTYPES_CPU
    if dev.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device (or set TRITON_INTERPRET=1 for the CPU), got {dev}")
    return _DTYPES_GPU


HEAD_DIMS = (16, 32, 64, 128, 256)  # what every kernel here compiles for (tl.arange needs a power of two)


def _check_head_dim(d):
    if d not in HEAD_DIMS:
        raise ValueError(f"head dimension d must be one of {', '.join(map(str, HEAD_DIMS))}; got {d}")


def _check_qkv(q, k, v, ndims, names=("q", "k", "v")):
    """The checks every entry point makes of its three tensors, in this order: each a tensor, one device
    (the CPU under the interpreter, CUDA otherwise), ranks ``ndims`` (q's, k's and v's), an allowed dtype,
    contiguous, one dtype for all three."""
    tensors = (q, k, v)
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = _check_device(*tensors, names=names)
    for name, x, ndim in zip(names, tensors, ndims):
        _check_tensor(name, x, ndim, dtypes)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{', '.join(names)} must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "cuda" and not interpreting():
        check_dtype_for(_device_limits(q.device)[0], q.dtype)


def _use_tma_default(q):
    if interpreting() or q.device.type != "cuda":
        return False
    return use_tma_for(_device_limits(q.device)[0], q.dtype)


def _check_use_tma(use_tma, q):
    """An explicit use_tma=True on a GPU without TMA (before sm_90): a clear error, not a compile error."""
    if use_tma and not interpreting() and q.device.type == "cuda":
        cap = _device_limits(q.device)[0]
        if not use_tma_for(cap, q.dtype):
            raise ValueError(f"use_tma=True needs TMA (compute capability 9.0 or newer, fp16 or bf16); this is "
                             f"sm_{cap[0]}{cap[1]} with {str(q.dtype).replace('torch.', '')}: leave use_tma=None")


def flash_attn_triton(q, k, v, causal=False, sm_scale=None, align="top_left", *, use_tma=None, config=None):
    """Attention forward: returns ``(O, lse)``.

    q: [B, H, N, d]; k, v: [B, Hkv, Nk, d] (Nk may differ from N; H a multiple of
    Hkv: grouped-query attention, query head h reads KV head h // (H // Hkv)). fp16 or bf16 on
    a GPU (fp32 too, with tf32 dot products); fp32 or fp16 under the interpreter.
    O: [B, H, N, d] in q's dtype; lse: [B, H, N] float32, natural log of each
    row's softmax denominator (with the scale applied), -inf for a row that sees
    no key (its O is 0).

    causal: query row i sees key j when j <= i + diag, where diag = 0 for
    ``align="top_left"`` (SDPA ``is_causal=True``) and diag = Nk - N for
    ``align="bottom_right"`` (the FlashAttention library: the last query sees
    every key). The two agree when N == Nk. With bottom_right and N > Nk the
    first N - Nk rows see nothing: O = 0, lse = -inf.

    sm_scale: defaults to 1/sqrt(d). ``use_tma`` and ``config`` (a dict with
    BLOCK_M, BLOCK_N, num_warps, num_stages) are for benchmarking; leave them
    as None to autotune.
    """
    _check_qkv(q, k, v, (4, 4, 4))
    B, H, N, d = q.shape
    Bk, Hkv, Nk, dk = k.shape
    if (Bk, dk) != (B, d):
        raise ValueError(f"k must be [B, Hkv, Nk, d] = [{B}, Hkv, Nk, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads (k is {tuple(k.shape)})")
    _check_head_dim(d)
    if N == 0 or Nk == 0 or B == 0 or H == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qk_scale = float(sm_scale) * LOG2E  # scores in base-2 units: exp(s) = exp2(s * LOG2E)
    diag = (Nk - N) if (causal and align == "bottom_right") else 0

    o = torch.empty_like(q)  # [B, H, N, d]
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)  # [B, H, N]
    if use_tma is None:
        use_tma = _use_tma_default(q)
    _check_use_tma(use_tma, q)
    desc_k = desc_v = None
    if use_tma:
        dummy_block = [16, d]  # replaced by the config's pre_hook
        desc_k = TensorDescriptor.from_tensor(k.view(B * Hkv * Nk, d), dummy_block)  # [B*Hkv*Nk, d]
        desc_v = TensorDescriptor.from_tensor(v.view(B * Hkv * Nk, d), dummy_block)  # [B*Hkv*Nk, d]

    args = (
        q, k, v, o, lse, desc_k, desc_v,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        H, Hkv, N, Nk, diag, qk_scale,
    )
    if interpreting() or config is not None:
        cfg = dict(_INTERPRETER_FWD_CONFIG if config is None else config)
        if use_tma:
            desc_k.block_shape = [cfg["BLOCK_N"], d]
            desc_v.block_shape = [cfg["BLOCK_N"], d]
        grid = (triton.cdiv(N, cfg["BLOCK_M"]), B * H)
        _attn_fwd[grid](*args, HEAD_DIM=d, CAUSAL=bool(causal), USE_TMA=bool(use_tma), **cfg)
    else:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
        _attn_fwd_tuned[grid](*args, HEAD_DIM=d, CAUSAL=bool(causal), USE_TMA=bool(use_tma))
    return o, lse


# ----------------------------------------------------------------------------
# Decode: one kernel, split-KV with the combine inside (one launch per call)
# ----------------------------------------------------------------------------
#
# One kernel serves flash_decode_triton (k, v [B, Hkv, Nk, d], every sequence Nk keys, one
# query token) and flash_attn_with_kvcache_triton in helpers/triton_kvcache.py (a cache
# [B, Nmax, Hkv, d] or pages [num_blocks, PAGE, Hkv, d] with a block table, a length per
# sequence, Nq new tokens with a bottom-right causal mask).
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
def _decode_step(q, k, v, m_i, l_i, acc, qk_scale, cols, key_ok, row_end, MASKED: tl.constexpr):
    """One key tile of the online softmax: returns the updated (m_i, l_i, acc), all base 2.

    MASKED: key j of the tile counts for row r when key_ok[j] and cols[j] < row_end[r]; a row
    that has seen no key yet keeps m_i = -inf and subtracts 0 (no NaN). Unmasked: every key
    counts, and cols, key_ok, row_end are not read."""
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
    if MASKED:
        keep = key_ok[None, :] & (cols[None, :] < row_end[:, None])  # [BLOCK_H, BLOCK_N]
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
    HKV: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head (H // Hkv)
    NQ: tl.constexpr,  # new query tokens per sequence
    NUM_RB: tl.constexpr,  # row blocks: cdiv(NQ * GROUP, BLOCK_H)
    BLOCK_H: tl.constexpr,  # query rows per program (>= 16)
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,  # True: K [B, Hkv, Nk, D]; False: [B, Nmax, Hkv, D] or pages [n, PAGE, Hkv, D]
    PAGE: tl.constexpr,  # 0: contiguous cache; else the page (block) size, a power of two
    VARLEN: tl.constexpr,  # lengths from SeqLens (else every sequence has Nk keys)
    CAUSAL: tl.constexpr,  # bottom-right: query row i sees keys j <= len - NQ + i
    DIRECT: tl.constexpr,  # num_splits == 1: write O directly, no partials, no counter
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
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    row_ok = offs_r < NQ * GROUP
    qi = offs_r // GROUP  # [BLOCK_H] new token of each row
    head = off_hkv * GROUP + offs_r % GROUP  # [BLOCK_H] query head of each row
    q_row = ((off_b * NQ + qi) * (HKV * GROUP) + head).to(tl.int64) * HEAD_DIM  # [BLOCK_H] row start in q and O
    q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_H, D]

    # -- this sequence's keys, and which of them each row sees
    if VARLEN:
        seqlen = tl.minimum(tl.maximum(tl.load(SeqLens + off_b), 0), Nk)  # clamped: never read past the cache
    else:
        seqlen = Nk
    if CAUSAL:
        diag = seqlen - NQ + 1  # row i sees keys j < diag + i
        row_end = tl.minimum(tl.maximum(diag + qi, 0), seqlen)  # [BLOCK_H] exclusive end per row
        first_r = rb * BLOCK_H
        last_r = tl.minimum(first_r + BLOCK_H, NQ * GROUP) - 1
        all_end = tl.maximum(diag + first_r // GROUP, 0)  # keys < all_end: seen by every row of the tile
        key_end = tl.maximum(diag + last_r // GROUP, 0)  # keys >= key_end: seen by none
    else:
        row_end = tl.full([BLOCK_H], 0, tl.int32) + seqlen
        all_end = seqlen
        key_end = seqlen

    # -- this split's keys [lo, hi): the sequence cut in num_splits pieces of whole tiles
    keys_per_split = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, key_end)
    full_hi = lo + tl.maximum(tl.minimum(hi, all_end) - lo, 0) // BLOCK_N * BLOCK_N  # unmasked tiles end here

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
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    # Paged: the page numbers of the next tile are loaded one iteration ahead (carried in
    # `pages`), so the K/V addresses of a tile do not wait on a load of the same iteration
    # and Triton's pipeliner keeps num_stages - 1 tiles in flight, as for a contiguous cache.
    # (With the table load in the same iteration it keeps one: measured as shared memory of
    # the sm_90 compile, 72 KB instead of 136 KB at BLOCK_N = 128, num_stages = 3.)
    if PAGE == 0:
        pages = 0
    elif BLOCK_N <= PAGE:  # one page per tile: a scalar
        pages = tl.load(BlockTable + table_row + lo // PAGE, mask=lo < full_hi, other=0)
    else:  # several pages per tile: a page per key row
        pages = tl.load(BlockTable + table_row + (lo + offs_n) // PAGE, mask=lo + offs_n < full_hi, other=0)
    for start_n in range(lo, full_hi, BLOCK_N):  # tiles every row sees in full: no mask
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
        k = tl.load(K + offs)  # [BLOCK_N, D]
        v = tl.load(V + offs)  # [BLOCK_N, D]
        m_i, l_i, acc = _decode_step(q, k, v, m_i, l_i, acc, qk_scale, offs_n, offs_n, offs_n, MASKED=False)

    for start_n in range(full_hi, hi, BLOCK_N):  # the ragged end and the causal band: masked
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # [BLOCK_N]
        key_ok = cols < hi  # [BLOCK_N]
        offs = _decode_tail_offsets(BlockTable, table_row, start_n, hi, offs_n, offs_d, tile, head_off, stride_kb,
                                    BLOCK_N, PAGE, TOKEN_STRIDE)  # [BLOCK_N, D]
        k = tl.load(K + offs, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + offs, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        m_i, l_i, acc = _decode_step(q, k, v, m_i, l_i, acc, qk_scale, cols, key_ok, row_end, MASKED=True)

    # -- this split's partial result; a split (or row) with no keys: O_s = 0, lse_s = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_s = acc / l_safe[:, None]  # [BLOCK_H, D]
    o_ptrs = O + q_row[:, None] + offs_d[None, :]  # [BLOCK_H, D]
    if DIRECT:
        tl.store(o_ptrs, o_s.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        lse_s = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))  # [BLOCK_H] base 2
        offs_h = tl.arange(0, BLOCK_H)
        part0 = pid.to(tl.int64) * num_splits * BLOCK_H  # this (b, kv head, row block)'s partials
        part = part0 + split * BLOCK_H + offs_h  # [BLOCK_H]
        tl.store(LSE_part + part, lse_s)
        tl.store(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], o_s)
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
            o_sum = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
            w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
            for s in range(0, num_splits):
                rows_s = part0 + s * BLOCK_H + offs_h  # [BLOCK_H]
                w = tl.math.exp2(tl.load(LSE_part + rows_s, cache_modifier=".cg") - lse_ref)  # [BLOCK_H]
                o_p = tl.load(O_part + rows_s[:, None] * HEAD_DIM + offs_d[None, :], cache_modifier=".cg")
                o_sum += w[:, None] * o_p  # [BLOCK_H, D]
                w_sum += w
            o_fin = o_sum / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]  # [BLOCK_H, D]
            tl.store(o_ptrs, o_fin.to(O.dtype.element_ty), mask=row_ok[:, None])
            tl.atomic_xchg(Counter + pid, 0)  # ready for the next call, no memset launch


_INTERPRETER_DECODE_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
_SPLIT_ALIGN = 128  # _pick_num_splits keeps at least 4 * _SPLIT_ALIGN keys a split
_MAX_BLOCK_H = 64  # query rows per program; NQ * GROUP rows beyond it take more row blocks
# (BLOCK_N, num_warps, num_stages): each program holds one SM (64-192 KB of pipelined K/V tiles)
_DECODE_SHAPES = [(128, 4, 3), (64, 4, 4), (128, 8, 3), (64, 4, 3)]

# A decode step is short (~0.1 ms for a 512 MiB cache), so the Python cost of a call matters:
# one launch (the combine is inside the kernel), the tuned choice kept in a plain dict (not
# triton.autotune), the SM count cached, the partials' workspace and the counters cached per
# device, no device sync anywhere.
_decode_choice = {}  # _decode_key(...) -> config dict
_sm_count = {}
_workspace = {}  # device -> (O_part f32, LSE_part f32, counters int32), flat, grown when too small
# Why reusing one workspace and one set of counters is safe: calls on one stream run one after
# another, and each call leaves every counter it used at 0 (the merging program resets it).
# Calls on two streams at once would share them and race: such a caller needs a workspace per
# stream (key _workspace by the stream too). A call inside CUDA-graph capture that would need a
# bigger workspace gets its own, uncached, so the graph never depends on a buffer this module drops.


def _num_sms(device):
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def _capturing(device):
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


def _cdiv(a, b):  # triton.cdiv and triton.next_power_of_2 cost ~5 us a call on the host (Triton 3.9)
    return -(-a // b)


def _next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


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


def _decode_key(q, B, Hkv, Nk, num_splits, group, nq, d, page, causal):
    return (q.device, q.dtype, B, Hkv, Nk, num_splits, group, nq, d, page, causal)


def _check_num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def _decode_launch(q, k, v, o, seqlens, block_table, *, B, Hkv, group, nq, d, Nk, stride_kb, max_blocks,
                   head_major, page, causal, num_splits, sm_scale, config):
    """Launch _decode_kernel once (validated inputs; shared by both wrappers); fills o."""
    block_h, num_rb = _decode_rows(group, nq)
    programs = B * Hkv * num_rb
    if num_splits is None:
        num_splits = _pick_num_splits(programs, Nk, _num_sms(q.device))
    else:
        _check_num_splits(num_splits)
    direct = num_splits == 1
    if direct:  # nothing to merge: the kernel writes O (the workspace arguments are unused)
        o_part = lse_part = counters = o
    else:
        o_part, lse_part, counters = _decode_workspace(q.device, programs, num_splits, block_h, d)
    qk_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale) * LOG2E
    args = (q, k, v, o, o_part, lse_part, counters,
            o if seqlens is None else seqlens, o if block_table is None else block_table,
            Nk, stride_kb, max_blocks, num_splits, qk_scale)
    meta = dict(HKV=Hkv, GROUP=group, NQ=nq, NUM_RB=num_rb, BLOCK_H=block_h, HEAD_DIM=d,
                HEAD_MAJOR=head_major, PAGE=page, VARLEN=seqlens is not None, CAUSAL=causal, DIRECT=direct)
    grid = (num_splits, programs)

    def launch(cfg):
        _decode_kernel[grid](*args, **meta, **cfg)

    if config is None and interpreting():
        config = _INTERPRETER_DECODE_CONFIG
    if config is None:
        key = _decode_key(q, B, Hkv, Nk, num_splits, group, nq, d, page, causal)
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
    Bk, Hkv, Nk, dk = k.shape
    if Bk != B or dk != d:
        raise ValueError(f"k must be [B, Hkv, Nk, d] = [{B}, Hkv, Nk, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads")
    _check_head_dim(d)
    if B == 0 or Nk == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    o = torch.empty_like(q)  # [B, H, d]
    return _decode_launch(q, k, v, o, None, None, B=B, Hkv=Hkv, group=H // Hkv, nq=1, d=d, Nk=Nk,
                          stride_kb=Hkv * Nk * d, max_blocks=0, head_major=True, page=0, causal=False,
                          num_splits=num_splits, sm_scale=sm_scale, config=config)


# ----------------------------------------------------------------------------
# What a GPU can run: shared memory per configuration, TMA, bf16
# ----------------------------------------------------------------------------


# kind -> f(d) -> [(BLOCK_M, BLOCK_N, num_warps, num_stages)]: the kernels that import this module register
# their configurations here, so this module never imports them back (tests/test_layout.py: no cycles).
SHAPES = {}


def _shapes(kind, d):
    """The launcher's configurations of ``kind`` for head dim d, as dicts (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if kind == "fwd":
        shapes = _FWD_SHAPES
    elif kind == "decode":
        return [dict(BLOCK_N=bn, num_warps=w, num_stages=s) for bn, w, s in _DECODE_SHAPES]
    elif kind in SHAPES:          # registered by the backward and varlen modules (they import this one)
        shapes = SHAPES[kind](d)
    else:
        raise ValueError(f"unknown kernel kind {kind!r} (is the module that launches it imported?)")
    return [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


# Shared memory one configuration takes, in bytes: upper bounds fitted to what Triton 3.9 lays out when it
# compiles the kernels for sm_90 and sm_8x (tests/test_compile_targets.py checks them against every compiled
# configuration). Mostly the pipelined tiles: num_stages of them in flight. Before sm_80 Triton neither
# pipelines nor uses tensor cores, and the launchers keep only their smallest configuration there.
_SMEM_SLACK = 2048  # barriers and small scratch


def smem_estimate(kind, cfg, d, elt, capability, block_h=64, atomic=False):
    """Shared memory (bytes) of kernel ``kind`` in configuration ``cfg`` for head dim d and elt-byte inputs on a
    GPU of this (major, minor); ``block_h``: the decode kernel's query rows per program; ``atomic``: the dK/dV
    kernel adds dQ atomically (fp32 tiles of dQ and dS^T on their way to the atomics)."""
    bm, bn, stages = cfg.get("BLOCK_M", 0), cfg["BLOCK_N"], cfg["num_stages"]
    hopper = capability[0] >= 9
    if capability < (8, 0):  # no pipelining, dots on CUDA cores: the operands of the dots staged in shared memory
        outer, inner = (block_h if kind == "decode" else bm), bn
        if kind == "dkdv":  # one program owns BLOCK_N keys and streams the BLOCK_M query rows
            outer, inner = bn, bm
        tiles = 2 * outer + inner if kind in ("dkdv", "dq") else outer + inner
        return max(tiles * 2 * d * elt, 8 * outer * inner)  # d-wide tiles, or (small d) the fp32 scores
    if kind in ("fwd", "varlen"):  # K, V tiles in flight; Q too on sm_90 (wgmma's operand)
        return stages * 2 * bn * d * elt + (bm * d * elt if hopper else 0) + _SMEM_SLACK
    if kind == "decode":  # K, V tiles in flight; the query tile and P
        return (stages - 1) * 2 * bn * d * elt + block_h * (d + bn) * elt + _SMEM_SLACK
    if kind == "dkdv":  # q, dO tiles in flight; K, V
        return stages * 2 * bm * d * elt + 2 * bn * d * elt + (bm * (d + bn) * 4 if atomic else 0) + _SMEM_SLACK
    if kind == "dq":  # K, V tiles in flight; q, dO
        return stages * 2 * bn * d * elt + 2 * bm * d * elt + _SMEM_SLACK
    raise ValueError(f"unknown kernel kind {kind!r}")


def fitting_configs(kind, configs, d, dtype, capability, smem, **shape):
    """The configurations (dicts) of ``configs`` a launcher tries on a GPU of this capability with ``smem`` bytes
    of shared memory per block: those that fit; before sm_80 only the first that fits (no pipelining there, and
    each compile of these kernels takes a CPU about a minute without tensor cores)."""
    elt = torch.empty((), dtype=dtype).element_size()
    keep = [c for c in configs if smem_estimate(kind, c, d, elt, capability, **shape) <= smem]
    if capability < (8, 0):
        keep = keep[:1]
    if not keep:
        raise ValueError(f"no configuration of the {kind} kernel fits this GPU's {smem // 1024} KB of shared memory "
                         f"per block at head dim {d} (sm_{capability[0]}{capability[1]}): use a smaller head dim")
    return keep


def launch_configs(kind, d, dtype, capability=None, smem=None):
    """The configurations the launcher of ``kind`` tries for head dim d and ``dtype``: every one (capability
    None), or those ``fitting_configs`` keeps on a GPU of this capability and shared memory."""
    configs = _shapes(kind, d)
    return configs if capability is None else fitting_configs(kind, configs, d, dtype, capability, smem)


def _config_dict(c):
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def prune_for_device(kind, configs, nargs, kwargs):
    """triton.autotune's early_config_prune: the triton.Configs that fit the GPU of the query tensor Q."""
    args = {**nargs, **kwargs}
    q = args["Q"]
    if q.device.type != "cuda" or interpreting():
        return configs
    cap, smem = _device_limits(q.device)
    fixed = {"BLOCK_M": args["BLOCK_M"]} if "BLOCK_M" in args else {}  # the varlen kernel's, fixed per head dim
    as_dict = {id(c): {**fixed, **_config_dict(c)} for c in configs}
    keep = fitting_configs(kind, list(as_dict.values()), args["HEAD_DIM"], q.dtype, cap, smem,
                           atomic=bool(args.get("DQ_ATOMIC", False)))
    return [c for c in configs if as_dict[id(c)] in keep]


_limits = {}  # device index -> ((major, minor), shared memory per block in bytes)


def _device_limits(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _limits:
        props = torch.cuda.get_device_properties(idx)
        _limits[idx] = ((props.major, props.minor), props.shared_memory_per_block_optin)
    return _limits[idx]


def use_tma_for(capability, dtype):
    """Whether the forward kernels load K and V through TMA descriptors on a GPU of this (major, minor)."""
    return TensorDescriptor is not None and capability[0] >= 9 and dtype != torch.float32


def check_dtype_for(capability, dtype):
    """Raise a ValueError naming the way out when a GPU of this (major, minor) cannot run ``dtype`` here:
    bf16 before sm_80 (a T4 is sm_75: no bf16 arithmetic; Triton would emulate it, slowly, if it compiles)."""
    if dtype == torch.bfloat16 and capability < (8, 0):
        raise ValueError(f"bfloat16 needs a GPU of compute capability 8.0 or newer (A100, RTX 30/40, L4, H100); "
                         f"this one is sm_{capability[0]}{capability[1]} (a T4 is sm_75): use torch.float16")
