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
  ``num_splits`` pieces, a split kernel writes a partial ``(O_s, lse_s)`` per
  piece, and a combine kernel merges them with weights ``exp(lse_s - lse)``.
  Grouped-query attention: query head ``h`` reads KV head ``h // (H // Hkv)``.

References: Dao, "FlashAttention-2" (2023), Algorithm 1; Dao et al.,
"Flash-Decoding for long-context inference" (2023); the fused-attention and
matmul tutorials of Triton. Written for this course; numbers in
bench/NOTES.md.

Runs on a CUDA GPU (fp16, bf16) or, with ``TRITON_INTERPRET=1`` set before
Triton is imported, on the CPU through Triton's interpreter (fp32, fp16; one
small fixed tile configuration so tests stay fast).
"""

import math
import os

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Hopper and newer); absent in old Triton
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["flash_attn_triton", "flash_decode_triton", "interpreting"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 lse back to natural log


# The values of TRITON_INTERPRET that Triton itself takes as "on" (its getenv_bool: 1, true, on, yes, y,
# in any case); anything else, or unset, is off. tests/test_learner_machines.py compares with Triton's own.
TRUTHY = ("1", "true", "on", "yes", "y")


def interpreting() -> bool:
    """True when Triton runs kernels under its interpreter (TRITON_INTERPRET on, as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in TRUTHY


_interpreting = interpreting


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


def _fwd_configs():
    # (BLOCK_M, BLOCK_N, num_warps, num_stages): a small set around what won on an H200
    shapes = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_kv_block_shape)
        for bm, bn, w, s in shapes
    ]


def _set_kv_block_shape(nargs):
    for name in ("desc_k", "desc_v"):
        desc = nargs.get(name)
        if desc is not None:
            desc.block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


_attn_fwd_tuned = triton.autotune(
    configs=_fwd_configs(),
    key=["N", "Nk", "HEAD_DIM", "CAUSAL", "USE_TMA"],
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


def _check_device(*tensors):
    names = ("q", "k", "v")
    dev = tensors[0].device
    for name, t in zip(names, tensors):
        if t.device != dev:
            raise ValueError(f"q, k and v must be on one device; {name} is on {t.device}, q on {dev}")
    if _interpreting():
        if dev.type != "cpu":
            raise ValueError("with TRITON_INTERPRET=1 the tensors must be on the CPU")
        return _DTYPES_CPU
    if dev.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device (or set TRITON_INTERPRET=1 for the CPU), got {dev}")
    return _DTYPES_GPU


def _use_tma_default(q):
    if _interpreting() or TensorDescriptor is None or q.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 9 and q.dtype != torch.float32


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
    dtypes = None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = _check_device(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4, dtypes)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, N, d = q.shape
    Bk, Hkv, Nk, dk = k.shape
    if (Bk, dk) != (B, d):
        raise ValueError(f"k must be [B, Hkv, Nk, d] = [{B}, Hkv, Nk, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads (k is {tuple(k.shape)})")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dimension d must be one of 16, 32, 64, 128, 256; got {d}")
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
    if _interpreting() or config is not None:
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
# Decode: split kernel and combine kernel
# ----------------------------------------------------------------------------


@triton.jit
def _decode_split(
    Q, K, V, O, O_part, LSE_part,  # all contiguous: q [B, H, D], k and v [B, Hkv, Nk, D]
    Hkv, Nk, keys_per_split, num_splits, qk_scale,
    GROUP: tl.constexpr,  # query heads per KV head (H // Hkv)
    BLOCK_H: tl.constexpr,  # GROUP padded up to a dot-product tile (>= 16)
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT: tl.constexpr,  # num_splits == 1: write the final O here, no combine needed
):
    # grid = (num_splits, B * Hkv): one program = one KV head, one piece of the cache,
    # all GROUP query heads that read this KV head
    split = tl.program_id(0)
    off_bkv = tl.program_id(1)
    off_b = off_bkv // Hkv
    off_hkv = off_bkv % Hkv

    offs_g = tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads of the group
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    head_ok = offs_g < GROUP
    heads = off_hkv * GROUP + offs_g  # [BLOCK_H] query head index h

    bh = (off_b * (Hkv * GROUP) + heads).to(tl.int64)  # [BLOCK_H] row of q and O in [B*H, D]
    q = tl.load(Q + bh[:, None] * HEAD_DIM + offs_d[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, D]
    kv_base = off_bkv.to(tl.int64) * Nk * HEAD_DIM  # start of this KV head's [Nk, D] slab
    k_ptrs = K + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, D]
    v_ptrs = V + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, D]

    lo = split * keys_per_split  # keys_per_split is a multiple of BLOCK_N
    hi = tl.minimum(lo + keys_per_split, Nk)
    full_hi = tl.maximum(lo, (hi // BLOCK_N) * BLOCK_N)  # full tiles end here; [full_hi, hi) is ragged

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    for start_n in range(lo, full_hi, BLOCK_N):  # full tiles: no mask
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = tl.load(k_ptrs + start_n * HEAD_DIM)  # [BLOCK_N, D]
        v = tl.load(v_ptrs + start_n * HEAD_DIM)  # [BLOCK_N, D]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_H]
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_ij)  # [BLOCK_H]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # [BLOCK_H, D]
        m_i = m_ij

    if full_hi < hi:  # the ragged last tile of the cache
        key_ok = (full_hi + offs_n) < hi  # [BLOCK_N]
        k = tl.load(k_ptrs + full_hi * HEAD_DIM, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptrs + full_hi * HEAD_DIM, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
        qk = tl.where(key_ok[None, :], qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))  # finite: key_ok has at least one key
        p = tl.math.exp2(qk - m_ij[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # [BLOCK_H, D]
        m_i = m_ij

    # partial result of this split; a split with no keys writes O_s = 0, lse_s = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_s = acc / l_safe[:, None]  # [BLOCK_H, D]
    lse_s = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # [BLOCK_H]
    if DIRECT:
        tl.store(O + bh[:, None] * HEAD_DIM + offs_d[None, :], o_s.to(O.dtype.element_ty), mask=head_ok[:, None])
    else:
        row = bh * num_splits + split  # [BLOCK_H] index into [B, H, S]
        tl.store(LSE_part + row, lse_s, mask=head_ok)
        tl.store(O_part + row[:, None] * HEAD_DIM + offs_d[None, :], o_s, mask=head_ok[:, None])


@triton.jit
def _decode_combine(
    O_part, LSE_part, O,
    num_splits,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    HEAD_DIM: tl.constexpr,
):
    # grid = (B * H,): one program merges the num_splits partial results of one query head
    off_bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    s_ok = offs_s < num_splits
    lse_s = tl.load(LSE_part + off_bh * num_splits + offs_s, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    o_s = tl.load(O_part + (off_bh * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None], other=0.0)  # [BLOCK_S, D]
    lse_max = tl.max(lse_s, 0)  # scalar; -inf only if no split saw a key
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse_s - lse_max)  # [BLOCK_S]; 0 for an empty split
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.sum(w[:, None] * o_s, 0) / denom  # [D]
    tl.store(O + off_bh * HEAD_DIM + offs_d, o.to(O.dtype.element_ty))


_INTERPRETER_DECODE_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
_SPLIT_ALIGN = 128  # keys per split: a multiple of every BLOCK_N below, so only the last split is ragged
# (BLOCK_N, num_warps, num_stages): each program holds one SM (64-192 KB of pipelined K/V tiles)
_DECODE_SHAPES = [(128, 4, 3), (64, 4, 4), (128, 8, 3), (64, 4, 3)]

# A decode step is short (~0.1 ms for a 512 MiB cache), so the Python cost of a
# launch matters: the tuned choice is kept in a plain dict (not triton.autotune),
# the SM count is cached, and the split kernel takes no stride arguments.
_decode_choice = {}  # (device, dtype, B, Hkv, Nk, num_splits, group, d) -> config dict
_sm_count = {}


def _num_sms(device):
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def _tune_decode(key, launch):
    """Time each shape of _DECODE_SHAPES once for this key; keep the fastest."""
    best = None
    for bn, w, s in _DECODE_SHAPES:
        cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=s)
        ms = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=25, return_mode="median")
        if best is None or ms < best[0]:
            best = (ms, cfg)
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
    cap = max(1, min(max_splits, Nk // (4 * _SPLIT_ALIGN)))
    best, best_fill = 1, 0.0
    for s in range(1, cap + 1):
        programs = batch_kv_heads * s
        fill = programs / (num_sms * triton.cdiv(programs, num_sms))  # busy fraction of the SM slots
        if fill >= 0.95:
            return s
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def flash_decode_triton(q, k, v, num_splits=None, sm_scale=None, *, config=None):
    """Decode attention for one new token: returns O [B, H, d] in q's dtype.

    q: [B, H, d]; k, v: [B, Hkv, Nk, d] with H a multiple of Hkv (query head h
    reads KV head h // (H // Hkv)). No mask: the new token sees the whole cache.
    num_splits: how many pieces the cache is cut into; None picks it from
    B*Hkv, Nk and the SM count.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = _check_device(q, k, v)
    _check_tensor("q", q, 3, dtypes)
    _check_tensor("k", k, 4, dtypes)
    _check_tensor("v", v, 4, dtypes)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, d = q.shape
    Bk, Hkv, Nk, dk = k.shape
    if Bk != B or dk != d:
        raise ValueError(f"k must be [B, Hkv, Nk, d] = [{B}, Hkv, Nk, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dimension d must be one of 16, 32, 64, 128, 256; got {d}")
    if B == 0 or Nk == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    group = H // Hkv
    if num_splits is None:
        num_splits = _pick_num_splits(B * Hkv, Nk, _num_sms(q.device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    align = 16 if _interpreting() else _SPLIT_ALIGN
    keys_per_split = triton.cdiv(triton.cdiv(Nk, num_splits), align) * align  # whole tiles per split
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qk_scale = float(sm_scale) * LOG2E

    direct = num_splits == 1
    o = torch.empty_like(q)  # [B, H, d]
    if direct:  # nothing to combine: the split kernel writes O
        o_part = lse_part = o
    else:
        o_part = torch.empty((B, H, num_splits, d), device=q.device, dtype=torch.float32)  # [B, H, S, d]
        lse_part = torch.empty((B, H, num_splits), device=q.device, dtype=torch.float32)  # [B, H, S]
    args = (q, k, v, o, o_part, lse_part, Hkv, Nk, keys_per_split, num_splits, qk_scale)
    meta = dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, DIRECT=direct)
    grid = (num_splits, B * Hkv)

    def launch(cfg):
        _decode_split[grid](*args, **meta, **cfg)

    if config is None and _interpreting():
        config = _INTERPRETER_DECODE_CONFIG
    if config is None:
        key = (q.device, q.dtype, B, Hkv, Nk, num_splits, group, d)
        config = _decode_choice.get(key) or _tune_decode(key, launch)
    if keys_per_split % config["BLOCK_N"]:
        raise ValueError(f"config BLOCK_N must divide {align}")
    launch(config)
    if not direct:
        _decode_combine[(B * H,)](
            o_part, lse_part, o, num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=d,
        )
    return o
