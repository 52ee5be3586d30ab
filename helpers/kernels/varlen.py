"""Packed variable-length attention forward in Triton (lesson 10).

Serving and training systems do not pad a batch of sequences to one length: they
pack them end to end and say where each starts with ``cu_seqlens`` (0, then the
cumulative lengths), the FlashAttention library's ``flash_attn_varlen_func``
layout. Two public functions:

* ``varlen_block_map(cu_seqlens_q, BLOCK_M) -> (seq_idx, q_start)``: the grid's
  map, in plain torch. Program p owns the block of BLOCK_M query rows of sequence
  ``seq_idx[p]`` that starts at packed row ``q_start[p]``; no program is spent on
  padding, and none waits on a host sync to learn the lengths.
* ``flash_attn_varlen_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal=False, sm_scale=None, *, window_size=(-1, -1), softcap=0.0,
  alibi_slopes=None) -> (O, lse)``: q ``[total_q, H, d]``,
  k, v ``[total_k, Hkv, d]``. Each program finds its sequence's rows and keys, then
  runs the dense forward's block body (``_attn_fwd_rows`` and its inner loop
  ``_attn_fwd_inner`` from helpers/kernels/forward.py: one source) with that
  sequence's lengths. Causal is bottom-right per sequence, as in the library; so are
  the sliding window and ALiBi (slopes [H] or [num_seqs, H]); softcap as in the dense forward.

References: Dao, "FlashAttention-2" (2023); the FlashAttention library's varlen
interface (``cu_seqlens``, ``max_seqlen``). Written for this course.
"""

import math

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .common import (LOG2E, SHAPES, TensorDescriptor, _check_head_dim, _check_qkv, head_block, prune_for_device,
                     tile_configs)
from .forward import _attn_fwd_rows, _check_mods, _check_use_tma, _set_kv_block_shape, _use_tma_default

__all__ = ["flash_attn_varlen_triton", "varlen_block_map", "varlen_block_m"]


# ----------------------------------------------------------------------------
# The grid's map: (sequence, Q block) per program, built on the device
# ----------------------------------------------------------------------------


def varlen_block_map(cu_seqlens_q, BLOCK_M, total_q=None):
    """Which (sequence, block of BLOCK_M query rows) each program of the varlen grid owns.

    cu_seqlens_q: [B + 1] int32 or int64, 0 then the cumulative query lengths: sequence b owns the
    packed rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1. BLOCK_M: query rows per program.
    total_q: the number of packed rows (q.shape[0]), known on the host, so that nothing is read back
    from the device (no sync); None reads cu_seqlens_q[-1].

    Returns (seq_idx, q_start), int32 [P] on cu_seqlens_q's device, with
    P = (total_q + B * (BLOCK_M - 1)) // BLOCK_M: an upper bound on the number of blocks (a sequence's
    last block leaves at most BLOCK_M - 1 rows empty), known without reading the lengths. Program p owns
    packed rows q_start[p] .. min(q_start[p] + BLOCK_M, cu_seqlens_q[seq_idx[p] + 1]) - 1; the spare
    programs at the end get seq_idx = q_start = -1 and return at once. A sequence of length 0 has no block.

    Order: by the block's index within its sequence, largest first; equal indices in sequence order.
    Under a causal mask a block's work grows with its index, and only long sequences have large
    indices, so the programs that run longest start first and the short ones fill in at the end.
    """
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise ValueError("cu_seqlens_q must be a 1-D tensor [B + 1] with B >= 1")
    if isinstance(BLOCK_M, bool) or not isinstance(BLOCK_M, int) or BLOCK_M < 1:
        raise ValueError(f"BLOCK_M must be a positive int, got {BLOCK_M!r}")
    cu = cu_seqlens_q.to(torch.int64)  # [B + 1]
    B = cu.numel() - 1
    if total_q is None:
        total_q = int(cu[-1])
    lens = cu[1:] - cu[:-1]  # [B] query rows per sequence
    n_blocks = (lens + BLOCK_M - 1) // BLOCK_M  # [B] blocks per sequence
    blocks_end = torch.cumsum(n_blocks, 0)  # [B] blocks of sequences 0..b together
    P = (total_q + B * (BLOCK_M - 1)) // BLOCK_M
    p = torch.arange(P, device=cu.device)  # [P] blocks in sequence order
    seq = torch.searchsorted(blocks_end, p, right=True)  # [P] the sequence of block p; B: spare
    real = seq < B  # [P]
    seq_c = seq.clamp(max=B - 1)  # [P] a valid index for the gathers
    blk = p - (blocks_end[seq_c] - n_blocks[seq_c])  # [P] block index within its sequence
    q_start = cu[seq_c] + blk * BLOCK_M  # [P] first packed row of the block
    order = torch.argsort(torch.where(real, -blk, 1), stable=True)  # [P] largest index first, spares last
    seq_idx = torch.where(real, seq, -1)[order].to(torch.int32)  # [P]
    q_start = torch.where(real, q_start, -1)[order].to(torch.int32)  # [P]
    return seq_idx, q_start


# ----------------------------------------------------------------------------
# The kernel: find this program's sequence, then the dense forward's block body
# ----------------------------------------------------------------------------


@triton.jit
def _attn_fwd_varlen(
    Q, K, V, O, LSE,
    desc_k, desc_v,  # TMA path: descriptors over K, V viewed as [total_k, Hkv * D]
    SEQ_IDX, Q_START, CU_Q, CU_K,  # the map [P], [P]; cu_seqlens [B + 1], [B + 1]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_q, H, Hkv, qk_scale,
    SLOPES, stride_sb,  # ALiBi: slope of (sequence b, head h) at SLOPES[b * stride_sb + h] (stride_sb = 0: per head)
    left, right, sm_scale, cap,  # the window (each side >= 0 when its switch is on), the score mod's scalars
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM): the columns past HEAD_DIM are masked
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + Nk - N + right (causal: right = 0)
    USE_TMA: tl.constexpr,
    WINDOW: tl.constexpr,  # a lower bound: j >= i + Nk - N - left
    SCORE_MOD: tl.constexpr,  # 0 none, 1 softcap, 2 ALiBi
):
    # grid = (P, H): program (p, h) owns entry p of the map for query head h
    pid = tl.program_id(0)
    off_h = tl.program_id(1)
    off_hkv = off_h // (H // Hkv)  # grouped-query attention

    seq = tl.load(SEQ_IDX + pid)
    if seq < 0:  # a spare program: the map's length P is an upper bound on the blocks
        return
    q_beg = tl.load(CU_Q + seq).to(tl.int32)  # first packed row of this sequence (cu_seqlens may be int64)
    k_beg = tl.load(CU_K + seq).to(tl.int32)  # and its first key; int32 like TMA's coordinates
    N = tl.load(CU_Q + seq + 1).to(tl.int32) - q_beg  # this sequence's query rows
    Nk = tl.load(CU_K + seq + 1).to(tl.int32) - k_beg  # and keys
    diag = Nk - N  # causal, bottom-right: row i sees key j when j <= i + Nk - N
    alibi_diag = diag  # ALiBi's distance |i + Nk - N - j|
    diag_lo = diag - left  # the window: i + diag - left <= j <= i + diag + right
    diag = diag + right
    start_m = (tl.load(Q_START + pid) - q_beg) // BLOCK_M  # block index within the sequence
    slope = 0.0
    if SCORE_MOD == 2:
        slope = tl.load(SLOPES + seq * stride_sb + off_h)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows, counted from the sequence's first
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    row_ok = offs_m < N  # [BLOCK_M]
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_M, D]

    q_base = Q + q_beg.to(tl.int64) * stride_qt + off_h.to(tl.int64) * stride_qh
    k_base = K + k_beg.to(tl.int64) * stride_kt + off_hkv.to(tl.int64) * stride_kh
    v_base = V + k_beg.to(tl.int64) * stride_vt + off_hkv.to(tl.int64) * stride_vh
    o_base = O + q_beg.to(tl.int64) * stride_ot + off_h.to(tl.int64) * stride_oh
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]  # [BLOCK_N, D]
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, D]
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=io_ok, other=0.0)  # [BLOCK_M, D]

    # TMA: this sequence's keys of KV head off_hkv start at row k_beg, column off_hkv * D. A masked tile
    # may run into the next sequence's rows: their scores are masked to -inf and their values zeroed, so
    # nothing of another request (not even a NaN) reaches this one.
    acc, lse = _attn_fwd_rows(
        q, k_ptrs, v_ptrs, stride_kt, stride_vt, desc_k, desc_v, k_beg, off_hkv * HEAD_DIM,
        start_m, offs_m, offs_n, qk_scale, Nk, diag, diag_lo, sm_scale, cap, slope, alibi_diag,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, USE_TMA, WINDOW, SCORE_MOD,
    )
    tl.store(LSE + off_h.to(tl.int64) * total_q + q_beg + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=io_ok)


# ----------------------------------------------------------------------------
# Configurations: BLOCK_M is fixed per head dim (the map is built for it), the rest autotuned
# ----------------------------------------------------------------------------

_INTERPRETER_VARLEN_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
# Per head-dim class: BLOCK_M, then (BLOCK_N, num_warps, num_stages) around what the dense forward's
# autotuner chose on the H200 (bench/results/h200.json: 128 x 64, 8 warps, 3 stages for d = 64; 128 x 128
# for d = 128). Three each: every config is compiled on first use, and `make bench` has a time budget.
_VARLEN_SHAPES = {
    64: (128, [(64, 8, 3), (64, 8, 4), (64, 4, 3)]),  # d <= 64
    128: (128, [(128, 8, 3), (64, 8, 3), (128, 8, 2)]),
    256: (64, [(64, 4, 3), (32, 4, 3), (64, 4, 2)]),  # smaller tiles: q and two K/V stages fit shared memory
}


def _d_class(d):
    """The configuration class of head dim d: its padded width, with everything up to 64 in one class."""
    return max(64, head_block(d))


def _varlen_shapes(d):
    bm, rest = _VARLEN_SHAPES[_d_class(d)]
    return [(bm, bn, w, s) for bn, w, s in rest]


SHAPES["varlen"] = lambda d: tile_configs(_varlen_shapes(d))


def varlen_block_m(d):
    """The BLOCK_M the varlen kernel uses for head dimension d (the map must be built for it)."""
    if interpreting():
        return _INTERPRETER_VARLEN_CONFIG["BLOCK_M"]
    return _VARLEN_SHAPES[_d_class(d)][0]


def _tuned(d_class):
    configs = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_kv_block_shape)
               for bn, w, s in _VARLEN_SHAPES[d_class][1]]
    return triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "USE_TMA", "WINDOW", "SCORE_MOD"],
                           prune_configs_by={"early_config_prune": lambda cs, nargs, **kw: prune_for_device(
                               "varlen", cs, nargs, kw)})(_attn_fwd_varlen)


_attn_fwd_varlen_tuned = {c: _tuned(c) for c in _VARLEN_SHAPES}


# ----------------------------------------------------------------------------
# The wrapper: checks, the map, the launch
# ----------------------------------------------------------------------------


def _check_cu_seqlens(name, cu, device):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [B + 1]), got {type(cu).__name__}")
    if cu.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu.shape)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 (or int64), got {str(cu.dtype).replace('torch.', '')}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least one sequence: [0, len_0, ...], got {cu.tolist()}")


def _check_cu_values(name, cu, total, max_seqlen, total_name, max_name):
    """The values of one cu_seqlens on the host: 0 first, never decreasing, ending at the packed total."""
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{name} must not decrease: {name}[{i}] = {cu[i]} > {name}[{i + 1}] = {cu[i + 1]}")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]} must equal {total_name} = {total} (the packed rows)")
    longest = max(lens)
    if max_seqlen < longest:
        b = lens.index(longest)
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than sequence {b}'s length {longest}")


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, validate):
    """The checks of the packed layout (the forward's and the backward's): returns (total_q, H, d, total_k, Hkv, B)."""
    _check_qkv(q, k, v, (3, 3, 3))
    total_q, H, d = q.shape
    total_k, Hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k must be [total_k, Hkv, d] = [total_k, Hkv, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if H == 0 or Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads")
    _check_head_dim(d)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences: "
                         f"B = {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name} must be an int, got {type(m).__name__}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    B = cu_seqlens_q.numel() - 1
    if validate:  # one copy to the host for both
        both = torch.cat([cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)]).tolist()
        _check_cu_values("cu_seqlens_q", both[:B + 1], total_q, max_seqlen_q, "total_q (q.shape[0])", "max_seqlen_q")
        _check_cu_values("cu_seqlens_k", both[B + 1:], total_k, max_seqlen_k, "total_k (k.shape[0])", "max_seqlen_k")
    return total_q, H, d, total_k, Hkv, B


def flash_attn_varlen_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                             sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, validate=True,
                             block_map=None, use_tma=None, config=None):
    """Attention over packed sequences of different lengths: returns ``(O, lse)``.

    q: [total_q, H, d]; k, v: [total_k, Hkv, d], H a multiple of Hkv (query head h reads KV head
    h // (H // Hkv)). cu_seqlens_q, cu_seqlens_k: int32 [B + 1] on q's device, 0 then the cumulative
    lengths: sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against k, v[cu_seqlens_k[b]:
    cu_seqlens_k[b + 1]]. Lengths may be 0 and may differ between q and k. max_seqlen_q, max_seqlen_k:
    at least the longest lengths (the library's arguments; checked, not needed for the grid).

    O: [total_q, H, d] in q's dtype; lse: [H, total_q] float32, natural log. causal: bottom-right per
    sequence, row i of a sequence with lengths (n, nk) sees key j when j <= i + nk - n (the library's
    convention); a row that sees no key (n > nk, or nk = 0) gets O = 0, lse = -inf.

    The library's ``flash_attn_varlen_func`` options, on the same per-sequence diagonal diag = nk - n:
    window_size=(left, right): row i sees key j when i + diag - left <= j <= i + diag + right (-1 unbounded;
    causal sets right = 0); softcap > 0: s = q.k * sm_scale becomes softcap * tanh(s / softcap); alibi_slopes:
    float32 [H] or [num_seqs, H] on q's device, s becomes s - slope[b, h] * |i + diag - j| (not with softcap).

    validate: check the cu_seqlens values (0 first, non-decreasing, ending at total_q / total_k, within
    max_seqlen): one copy to the host, a sync. False skips it (nothing then waits for the GPU; wrong
    values give wrong results). block_map: the grid's map, ``varlen_block_map(cu_seqlens_q,
    varlen_block_m(d), total_q)``, built once and passed to every layer's call of one batch (the
    layers share cu_seqlens); None builds it here (about 25 small torch ops). ``use_tma`` and
    ``config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) are for benchmarking; None autotunes.
    """
    total_q, H, d, total_k, Hkv, B = _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, causal, validate)
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, B, q.device, "num_seqs")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qk_scale = float(sm_scale) * LOG2E.value  # scores in base-2 units

    o = torch.empty_like(q)  # [total_q, H, d]
    lse = torch.empty((H, total_q), device=q.device, dtype=torch.float32)  # [H, total_q]
    if total_q == 0:
        return o, lse
    if total_k == 0:  # no sequence has a key: every row is empty (and there is nothing to point K at)
        return o.zero_(), lse.fill_(float("-inf"))
    if config is None and interpreting():
        config = _INTERPRETER_VARLEN_CONFIG
    block_m = config["BLOCK_M"] if config is not None else varlen_block_m(d)  # the map is built for it
    P = (total_q + B * (block_m - 1)) // block_m  # the map's length: an upper bound on the blocks
    if block_map is None:
        seq_idx, q_start = varlen_block_map(cu_seqlens_q, block_m, total_q=total_q)  # [P], [P]
    else:
        if not (isinstance(block_map, (tuple, list)) and len(block_map) == 2
                and all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.shape == (P,)
                        and t.device == q.device for t in block_map)):
            raise ValueError(f"block_map must be varlen_block_map(cu_seqlens_q, {block_m}, {total_q}): two int32 "
                             f"tensors of shape ({P},) on {q.device}")
        seq_idx, q_start = (t.contiguous() for t in block_map)
    if use_tma is None:
        use_tma = _use_tma_default(q)
    _check_use_tma(use_tma, q)
    desc_k = desc_v = None
    if use_tma:
        dummy_block = [16, d]  # replaced by the config's pre_hook
        desc_k = TensorDescriptor.from_tensor(k.view(total_k, Hkv * d), dummy_block)  # [total_k, Hkv*d]
        desc_v = TensorDescriptor.from_tensor(v.view(total_k, Hkv * d), dummy_block)  # [total_k, Hkv*d]

    args = (
        q, k, v, o, lse, desc_k, desc_v,
        seq_idx, q_start, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        total_q, H, Hkv, qk_scale,
        mods.slopes, mods.stride_sb, max(mods.left, 0), max(mods.right, 0), float(sm_scale), mods.cap,
    )
    grid = (seq_idx.numel(), H)
    meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), USE_TMA=bool(use_tma), **mods.meta())
    if config is not None:
        cfg = dict(config)
        if use_tma:
            desc_k.block_shape = [cfg["BLOCK_N"], d]
            desc_v.block_shape = [cfg["BLOCK_N"], d]
        _attn_fwd_varlen[grid](*args, **meta, **cfg)
    else:
        _attn_fwd_varlen_tuned[_d_class(d)][grid](*args, **meta, BLOCK_M=block_m)
    return o, lse
