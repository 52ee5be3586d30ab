"""The backward of packed variable-length attention, and ``flash_attention_varlen``: an autograd Function over it.

Public:

* ``flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
  sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None) -> O``: differentiable, the
  FlashAttention library's ``flash_attn_varlen_func`` layout (q ``[total_q, H, d]``, k, v ``[total_k, Hkv, d]``,
  causal, the window and ALiBi bottom-right per sequence); forward =
  ``helpers.kernels.varlen.flash_attn_varlen_triton``, backward = the kernels below.
* ``flash_attn_varlen_bwd_triton(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  causal=False, sm_scale=None, *, window_size, softcap, alibi_slopes) -> (dq, dk, dv)``.

The dense backward's kernels on the packed layout (helpers/kernels/backward.py): the preprocess with the packed
strides; a dK/dV kernel whose program owns BLOCK_N keys of one sequence and one KV head (the map of
``varlen_block_map`` over cu_seqlens_k) and runs the dense ``_bwd_dkdv_group`` over that KV head's H // Hkv
query heads with the sequence's lengths (no atomics, deterministic); a dQ kernel whose program owns BLOCK_M
query rows of one sequence and one query head (the map over cu_seqlens_q) and runs the dense ``_bwd_dq_rows``.
The maps are built on the device (no host sync); the cu_seqlens are the ones the forward saved (checked there),
so forward and backward cannot disagree about them.

Written for this course.
"""

import math

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .backward import _PRE_BLOCK_M, _bwd_dkdv_group, _bwd_dq_rows, _bwd_preprocess
from .common import LOG2E, _device_limits, _shapes, fitting_configs, head_block
from .forward import _check_mods
from .varlen import _check_varlen_inputs, flash_attn_varlen_triton, varlen_block_map

__all__ = ["flash_attention_varlen", "flash_attn_varlen_bwd_triton", "FlashAttentionVarlenFunction"]


@triton.jit
def _bwd_dkdv_varlen(
    Q, K, V, DO, LSE2, DELTA, DK, DV,  # Q, DO [total_q, H, D]; K, V, DK, DV [total_k, Hkv, D]; LSE2, DELTA [H, total_q]
    SEQ_IDX, K_START, CU_Q, CU_K,  # the map over the keys [P], [P]; cu_seqlens [B + 1], [B + 1]
    total_q, H, Hkv, qk_scale, sm_scale,
    SLOPES, stride_sb,  # ALiBi: slope of (sequence b, head h) at SLOPES[b * stride_sb + h]
    left, right, cap,  # the window (each side >= 0 when its switch is on); softcap's cap
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + Nk - N + right
    WINDOW: tl.constexpr,  # a lower bound: j >= i + Nk - N - left
    SCORE_MOD: tl.constexpr,  # 0 none, 1 softcap, 2 ALiBi
):
    # grid = (P, Hkv): program (p, hkv) owns the BLOCK_N keys of entry p of the map, of KV head hkv
    pid = tl.program_id(0)
    off_hkv = tl.program_id(1)
    group = H // Hkv
    seq = tl.load(SEQ_IDX + pid)
    if seq < 0:  # a spare program: the map's length is an upper bound on the blocks
        return
    q_beg = tl.load(CU_Q + seq).to(tl.int32)
    k_beg = tl.load(CU_K + seq).to(tl.int32)
    N = tl.load(CU_Q + seq + 1).to(tl.int32) - q_beg  # this sequence's query rows
    Nk = tl.load(CU_K + seq + 1).to(tl.int32) - k_beg  # and keys
    diag = Nk - N  # causal, bottom-right: row i sees key j when j <= i + Nk - N
    alibi_diag = diag
    diag_lo = diag - left  # the window: i + diag - left <= j <= i + diag + right
    diag = diag + right
    start_n = tl.load(K_START + pid) - k_beg  # the block's first key within the sequence

    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] keys, counted from the sequence's first
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    kv_ptrs = ((k_beg + offs_n).to(tl.int64) * Hkv + off_hkv)[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, D]
    kv_ok = (offs_n < Nk)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_N, D]
    k = tl.load(K + kv_ptrs, mask=kv_ok, other=0.0)  # [BLOCK_N, D]
    v = tl.load(V + kv_ptrs, mask=kv_ok, other=0.0)  # [BLOCK_N, D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    h0 = off_hkv * group  # the group's first query head
    q0 = (q_beg.to(tl.int64) * H + h0) * HEAD_DIM  # its row 0 in Q and DO
    l0 = h0.to(tl.int64) * total_q + q_beg  # and in LSE2, DELTA
    slope_ptr = SLOPES
    if SCORE_MOD == 2:
        slope_ptr = SLOPES + seq * stride_sb + h0  # the group's first head; the next heads' slopes follow
    dk, dv = _bwd_dkdv_group(dk, dv, k, v, Q + q0, DO + q0, LSE2 + l0, DELTA + l0, Q,  # DQ unused (no atomics)
                             HEAD_DIM, total_q, H * HEAD_DIM, group, start_n, offs_n, N, Nk, diag, qk_scale, sm_scale,
                             slope_ptr, diag_lo, cap, alibi_diag,
                             HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, False, False, WINDOW, SCORE_MOD)
    dk = dk * sm_scale  # dS was taken w.r.t. S = q k^T * sm_scale
    tl.store(DK + kv_ptrs, dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _bwd_dq_varlen(
    Q, K, V, DO, LSE2, DELTA, DQ,  # Q, DO, DQ [total_q, H, D]; K, V [total_k, Hkv, D]; LSE2, DELTA [H, total_q]
    SEQ_IDX, Q_START, CU_Q, CU_K,  # the map over the query rows [P], [P]; cu_seqlens [B + 1], [B + 1]
    total_q, H, Hkv, qk_scale, sm_scale,
    SLOPES, stride_sb,  # ALiBi: slope of (sequence b, head h) at SLOPES[b * stride_sb + h]
    left, right, cap,  # the window (each side >= 0 when its switch is on); softcap's cap
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + Nk - N + right
    WINDOW: tl.constexpr,  # a lower bound: j >= i + Nk - N - left
    SCORE_MOD: tl.constexpr,  # 0 none, 1 softcap, 2 ALiBi
):
    # grid = (P, H): program (p, h) owns the BLOCK_M query rows of entry p of the map, of query head h
    pid = tl.program_id(0)
    off_h = tl.program_id(1)
    off_hkv = off_h // (H // Hkv)  # grouped-query attention
    seq = tl.load(SEQ_IDX + pid)
    if seq < 0:
        return
    q_beg = tl.load(CU_Q + seq).to(tl.int32)
    k_beg = tl.load(CU_K + seq).to(tl.int32)
    N = tl.load(CU_Q + seq + 1).to(tl.int32) - q_beg
    Nk = tl.load(CU_K + seq + 1).to(tl.int32) - k_beg
    diag = Nk - N
    alibi_diag = diag
    diag_lo = diag - left
    diag = diag + right
    start_m = (tl.load(Q_START + pid) - q_beg) // BLOCK_M  # block index within the sequence
    slope = 0.0
    if SCORE_MOD == 2:
        slope = tl.load(SLOPES + seq * stride_sb + off_h)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows, counted from the sequence's first
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_M, D]
    ptrs = ((q_beg + offs_m).to(tl.int64) * H + off_h)[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_M, D]
    q = tl.load(Q + ptrs, mask=io_ok, other=0.0)
    do = tl.load(DO + ptrs, mask=io_ok, other=0.0)
    l_rows = off_h.to(tl.int64) * total_q + q_beg + offs_m  # [BLOCK_M]
    lse2 = tl.load(LSE2 + l_rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv0 = (k_beg.to(tl.int64) * Hkv + off_hkv) * HEAD_DIM  # this sequence's key 0 of KV head off_hkv
    dq = _bwd_dq_rows(dq, q, do, lse2, delta, K + kv0, V + kv0, Hkv * HEAD_DIM, start_m, offs_m, Nk, diag, qk_scale,
                      diag_lo, sm_scale, cap, slope, alibi_diag,
                      HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, False, WINDOW, SCORE_MOD)
    dq = dq * sm_scale
    tl.store(DQ + ptrs, dq.to(DQ.dtype.element_ty), mask=io_ok)


_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def varlen_bwd_configs(d, q):
    """(dK/dV config, dQ config) for head dim d on q's device: the first of the dense backward's tile sets that fits
    its shared memory (one fixed configuration each, as the maps are built for their blocks; not autotuned)."""
    if interpreting() or q.device.type != "cuda":
        return _INTERPRETER_CONFIG, _INTERPRETER_CONFIG
    cap, smem = _device_limits(q.device)
    return tuple(fitting_configs(kind, _shapes(kind, d), d, q.dtype, cap, smem)[0] for kind in ("dkdv", "dq"))


def flash_attn_varlen_bwd_triton(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal=False, sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                 validate=True, config=None):
    """Gradients ``(dq, dk, dv)`` of O = flash_attn_varlen_triton(q, k, v, ...) for the upstream gradient ``do``.

    q, o, do: [total_q, H, d]; k, v: [total_k, Hkv, d]; lse: [H, total_q] float32, the forward's second output
    (-inf on rows that saw no key: their gradients are 0). cu_seqlens, max_seqlen, causal (bottom-right per
    sequence), sm_scale, window_size, softcap, alibi_slopes: exactly the forward's. ``validate``: check the
    cu_seqlens values (a host sync); ``flash_attention_varlen`` passes False, its forward checked them.
    ``config``: {"dkdv": {...}, "dq": {...}} (BLOCK_M, BLOCK_N, num_warps, num_stages) fixes the tiles.
    """
    total_q, H, d, total_k, Hkv, B = _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, causal, validate)
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, B, q.device, "num_seqs")
    for name, x in (("o", o), ("do", do)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(q.shape) or x.device != q.device:
            raise ValueError(f"{name} must be a tensor of q's shape {tuple(q.shape)} on {q.device}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (H, total_q) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be a float32 tensor of shape {(H, total_q)} (the forward's second output)")
    do = do.to(q.dtype).contiguous()
    o, lse = o.contiguous(), lse.contiguous()
    sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
    qk_scale = sm_scale * LOG2E.value
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)  # zeros: empty sequences stay 0
    if total_q == 0 or total_k == 0:  # no row sees a key: every gradient is 0
        return dq, dk, dv

    delta = torch.empty((H, total_q), device=q.device, dtype=torch.float32)  # [H, total_q] rowsum(dO * O)
    lse2 = torch.empty_like(delta)  # [H, total_q] lse in base 2, +inf on empty rows
    # the dense preprocess with the packed strides: "head" h starts at column h * d, rows are H * d apart
    _bwd_preprocess[(triton.cdiv(total_q, _PRE_BLOCK_M), H)](o, do, lse, delta, lse2, total_q, d, H * d, HEAD_DIM=d,
                                                             BLOCK_M=_PRE_BLOCK_M, BLOCK_D=head_block(d))
    cfg_kv, cfg_q = (config["dkdv"], config["dq"]) if config is not None else varlen_bwd_configs(d, q)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), **mods.meta())
    mod_args = (mods.slopes, mods.stride_sb, max(mods.left, 0), max(mods.right, 0), mods.cap)

    seq_k, k_start = varlen_block_map(cu_k, cfg_kv["BLOCK_N"], total_q=total_k)  # [P_k], [P_k]: key blocks
    _bwd_dkdv_varlen[(seq_k.numel(), Hkv)](q, k, v, do, lse2, delta, dk, dv, seq_k, k_start, cu_q, cu_k,
                                           total_q, H, Hkv, qk_scale, sm_scale, *mod_args, **meta, **cfg_kv)
    seq_q, q_start = varlen_block_map(cu_q, cfg_q["BLOCK_M"], total_q=total_q)  # [P_q], [P_q]: query blocks
    _bwd_dq_varlen[(seq_q.numel(), H)](q, k, v, do, lse2, delta, dq, seq_q, q_start, cu_q, cu_k,
                                       total_q, H, Hkv, qk_scale, sm_scale, *mod_args, **meta, **cfg_q)
    return dq, dk, dv


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """O = flash_attn_varlen_func(q, k, v, ...) with the course's Triton forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
        mods = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        o, lse = flash_attn_varlen_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, sm_scale=sm_scale, **mods)
        # the cu_seqlens travel with the saved tensors: the backward uses exactly these (an in-place change to them
        # before backward is an autograd error, not a silent mismatch)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, causal, sm_scale, mods)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, sm_scale, mods = ctx.args
        dq, dk, dv = flash_attn_varlen_bwd_triton(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, sm_scale,
                                                  validate=False, **mods)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Differentiable attention over packed sequences (the library's ``flash_attn_varlen_func``): O [total_q, H, d].

    q: [total_q, H, d]; k, v: [total_k, Hkv, d], H a multiple of Hkv; cu_seqlens_q, cu_seqlens_k: int32 [B + 1]
    (0, then the cumulative lengths; checked once, in the forward); causal: bottom-right per sequence. d a
    multiple of 8 up to 256. Gradients flow to q, k and v. ``window_size``, ``softcap``, ``alibi_slopes`` ([H] or
    [num_seqs, H]): the library's, bottom-right per sequence (see ``flash_attn_varlen_triton``).
    """
    return FlashAttentionVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal, sm_scale, window_size, softcap, alibi_slopes)
