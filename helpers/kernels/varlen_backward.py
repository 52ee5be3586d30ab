"""The backward of packed variable-length attention, and ``flash_attention_varlen``: an autograd Function over it.

Public:

* ``flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
  sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None) -> O``:
  differentiable (dropout's mask regenerated in the backward from the forward's rng_state), the
  FlashAttention library's ``flash_attn_varlen_func`` layout (q ``[total_q, H, d]``, k, v ``[total_k, Hkv, d]``,
  causal, the window and ALiBi bottom-right per sequence); forward =
  ``helpers.kernels.varlen.flash_attn_varlen_triton``, backward = the kernels below. The training path:
  ``batch = prepare_varlen(cu_seqlens)`` once per batch, then ``flash_attention_varlen(q, k, v, batch,
  causal=True)`` in every layer: neither pass reads anything back from the GPU (a step can be captured in a
  CUDA graph). With the library's four arguments instead, each call prepares its own batch (the slow path).
* ``flash_attn_varlen_bwd_triton(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  causal=False, sm_scale=None, *, window_size, softcap, alibi_slopes, dropout_p, rng_state) -> (dq, dk, dv)``
  (dropout_p > 0 needs the forward's rng_state); a ``VarlenBatch`` may
  stand for the four layout arguments, as in the forward.

The dense backward's kernels on the packed layout (helpers/kernels/backward.py): the preprocess with the packed
strides; a dK/dV kernel whose program owns BLOCK_N keys of one sequence and one KV head (the batch's map of key
blocks) and runs the dense ``_bwd_dkdv_group`` over that KV head's H // Hkv query heads with the sequence's
lengths (no atomics, deterministic); a dQ kernel whose program owns BLOCK_M query rows of one sequence and one
query head (the map of query blocks) and runs the dense ``_bwd_dq_rows``. So every document gets the dense
backward's tile classes: row (or key) tiles nobody sees are never visited, tiles seen in full run without a mask,
the diagonal band and the ragged edges with one. Both maps list the heaviest blocks first; the grid is flat over
(map entry, head), the heads fastest, as in the forward. The tiles of each kernel are chosen per shape class by
timing its candidates once (``varlen.tuned_launch``); every launch writes its outputs, so timing repeats are
harmless.

Written for this course.
"""

import math

import torch
import triton
import triton.language as tl

from .backward import _DKDV_SHAPES_256, _DQ_SHAPES_256, _PRE_BLOCK_M, _bwd_dkdv_group, _bwd_dq_rows, _bwd_preprocess
from .common import LOG2E, SHAPES, head_block, tile_configs
from .forward import _check_dropout_args, _check_mods
from . import varlen as _varlen
from .varlen import (VarlenBatch, _LayoutRef, _check_packed, _d_class, _layout, _plan_for, class_candidates,  # noqa: F401
                     prepare_varlen, tuned_launch)  # VarlenBatch, prepare_varlen: re-exported

__all__ = ["flash_attention_varlen", "flash_attn_varlen_bwd_triton", "FlashAttentionVarlenFunction",
           "varlen_bwd_configs", "prepare_varlen", "VarlenBatch"]  # the last two re-exported from .varlen


@triton.jit(do_not_specialize=["total_q", "seed", "drop_off"])  # one compile for every batch size and mask
def _bwd_dkdv_varlen(
    Q, K, V, DO, LSE2, DELTA, DK, DV,  # Q, DO [total_q, H, D]; K, V, DK, DV [total_k, Hkv, D]; LSE2, DELTA [H, total_q]
    # (Q, K, V with the strides below, unit along D; DO, DK, DV contiguous)
    SEQ_IDX, K_START, CU_Q, CU_K,  # the map over the keys [P], [P]; cu_seqlens [B + 1], [B + 1]
    total_q, H, Hkv, qk_scale, sm_scale,
    SLOPES, stride_sb,  # ALiBi: slope of (sequence b, head h) at SLOPES[b * stride_sb + h]
    left, right, cap,  # the window (each side >= 0 when its switch is on); softcap's cap
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,  # token and head strides of Q, K, V
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + Nk - N + right
    WINDOW: tl.constexpr,  # a lower bound: j >= i + Nk - N - left
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both)
    p_drop=0.0, seed=0, drop_off=0,  # dropout: the forward's probability, Philox key and counter offset
    DROPOUT: tl.constexpr = False,  # the forward's mask regenerated (counters: seq * H + head, row, key)
):
    # grid = (P * Hkv,): program pid owns the BLOCK_N keys of entry pid // Hkv of the map, of KV head pid % Hkv
    pid = tl.program_id(0)
    entry = pid // Hkv
    off_hkv = pid % Hkv
    group = H // Hkv
    seq = tl.load(SEQ_IDX + entry)
    if seq < 0:  # a spare program of lesson 10's map (an upper bound on the blocks)
        return
    q_beg = tl.load(CU_Q + seq).to(tl.int32)
    k_beg = tl.load(CU_K + seq).to(tl.int32)
    N = tl.load(CU_Q + seq + 1).to(tl.int32) - q_beg  # this sequence's query rows
    Nk = tl.load(CU_K + seq + 1).to(tl.int32) - k_beg  # and keys
    diag = Nk - N  # causal, bottom-right: row i sees key j when j <= i + Nk - N
    alibi_diag = diag
    diag_lo = diag - left  # the window: i + diag - left <= j <= i + diag + right
    diag = diag + right
    start_n = tl.load(K_START + entry) - k_beg  # the block's first key within the sequence

    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] keys, counted from the sequence's first
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    kv_ptrs = ((k_beg + offs_n).to(tl.int64) * Hkv + off_hkv)[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, D]
    kv_ok = (offs_n < Nk)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_N, D]
    keys = (k_beg + offs_n).to(tl.int64)[:, None]  # [BLOCK_N, 1] packed key rows
    k = tl.load(K + keys * stride_kt + off_hkv.to(tl.int64) * stride_kh + offs_d[None, :], mask=kv_ok,
                other=0.0)  # [BLOCK_N, D]
    v = tl.load(V + keys * stride_vt + off_hkv.to(tl.int64) * stride_vh + offs_d[None, :], mask=kv_ok,
                other=0.0)  # [BLOCK_N, D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    h0 = off_hkv * group  # the group's first query head
    q0 = q_beg.to(tl.int64) * stride_qt + h0.to(tl.int64) * stride_qh  # its row 0 in Q
    do0 = (q_beg.to(tl.int64) * H + h0) * HEAD_DIM  # and in DO
    l0 = h0.to(tl.int64) * total_q + q_beg  # and in LSE2, DELTA
    slope_ptr = SLOPES
    if SCORE_MOD & 2:
        slope_ptr = SLOPES + seq * stride_sb + h0  # the group's first head; the next heads' slopes follow
    dk, dv = _bwd_dkdv_group(dk, dv, k, v, Q + q0, DO + do0, LSE2 + l0, DELTA + l0, Q,  # DQ unused (no atomics)
                             stride_qh, total_q, stride_qt, group, start_n, offs_n, N, Nk, diag, qk_scale, sm_scale,
                             slope_ptr, diag_lo, cap, alibi_diag,
                             HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, False, False, WINDOW, SCORE_MOD,
                             HEAD_DIM, H * HEAD_DIM, None, None, DROPOUT, p_drop, seed, drop_off, seq * H + h0)
    dk = dk * sm_scale  # dS was taken w.r.t. S = q k^T * sm_scale
    tl.store(DK + kv_ptrs, dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit(do_not_specialize=["total_q", "seed", "drop_off"])
def _bwd_dq_varlen(
    Q, K, V, DO, LSE2, DELTA, DQ,  # Q, DO, DQ [total_q, H, D]; K, V [total_k, Hkv, D]; LSE2, DELTA [H, total_q]
    # (Q, K, V with the strides below, unit along D; DO, DQ contiguous)
    SEQ_IDX, Q_START, CU_Q, CU_K,  # the map over the query rows [P], [P]; cu_seqlens [B + 1], [B + 1]
    total_q, H, Hkv, qk_scale, sm_scale,
    SLOPES, stride_sb,  # ALiBi: slope of (sequence b, head h) at SLOPES[b * stride_sb + h]
    left, right, cap,  # the window (each side >= 0 when its switch is on); softcap's cap
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,  # token and head strides of Q, K, V
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + Nk - N + right
    WINDOW: tl.constexpr,  # a lower bound: j >= i + Nk - N - left
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both)
    p_drop=0.0, seed=0, drop_off=0,  # dropout: the forward's probability, Philox key and counter offset
    DROPOUT: tl.constexpr = False,  # the forward's mask regenerated (counters: seq * H + head, row, key)
):
    # grid = (P * H,): program pid owns the BLOCK_M query rows of entry pid // H of the map, of query head pid % H
    pid = tl.program_id(0)
    entry = pid // H
    off_h = pid % H
    off_hkv = off_h // (H // Hkv)  # grouped-query attention
    seq = tl.load(SEQ_IDX + entry)
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
    start_m = (tl.load(Q_START + entry) - q_beg) // BLOCK_M  # block index within the sequence
    slope = 0.0
    if SCORE_MOD & 2:
        slope = tl.load(SLOPES + seq * stride_sb + off_h)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows, counted from the sequence's first
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_M, D]
    ptrs = ((q_beg + offs_m).to(tl.int64) * H + off_h)[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_M, D] DO, DQ
    q_ptrs = ((q_beg + offs_m).to(tl.int64) * stride_qt + off_h.to(tl.int64) * stride_qh)[:, None] + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=io_ok, other=0.0)
    do = tl.load(DO + ptrs, mask=io_ok, other=0.0)
    l_rows = off_h.to(tl.int64) * total_q + q_beg + offs_m  # [BLOCK_M]
    lse2 = tl.load(LSE2 + l_rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k0 = k_beg.to(tl.int64) * stride_kt + off_hkv.to(tl.int64) * stride_kh  # this sequence's key 0 of KV head off_hkv
    v0 = k_beg.to(tl.int64) * stride_vt + off_hkv.to(tl.int64) * stride_vh
    dq = _bwd_dq_rows(dq, q, do, lse2, delta, K + k0, V + v0, stride_kt, start_m, offs_m, Nk, diag, qk_scale,
                      diag_lo, sm_scale, cap, slope, alibi_diag,
                      HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, False, WINDOW, SCORE_MOD,
                      stride_vt, DROPOUT, p_drop, seed, drop_off, seq * H + off_h)
    dq = dq * sm_scale
    tl.store(DQ + ptrs, dq.to(DQ.dtype.element_ty), mask=io_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class, the dense backward's H200 winners (bench/NOTES.md,
# backward v1; bench/results/h200.json): the dK/dV kernel's large tile on long causal rows, its middle and small
# ones on shorter rows and without a mask (at d = 128 each of them holds K, V, dK, dV in registers and ptxas spills
# some: the timing decides); the dQ kernel's two, and at d = 128 its 64 x 32 tile, the one that fits the 99 KB of
# sm_86/89. The first of each that fits is what runs where nothing is timed. On Hopper a batch of short documents
# (``VarlenBatch.length_class``) adds the 32 x 32 tile in two stages to both: a 32-token document's keys (dK/dV)
# or rows (dQ) in one tile, and more programs side by side on an SM (the forward's short set says why). At d = 128
# the dK/dV kernel's small tile also comes in two stages: a key block of a packed row loops over few query tiles per
# head, three times per head (the upper band, the unmasked middle, the lower band), and each loop fills and drains
# its software pipeline; two stages fill faster and keep more programs on an SM (bench/NOTES.md, packed backward).
_VARLEN_BWD_SHAPES = {
    "dkdv": {64: [(32, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
             128: [(128, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 2)], 256: _DKDV_SHAPES_256},
    "dq": {64: [(64, 64, 4, 3), (128, 64, 8, 3)], 128: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)],
           256: _DQ_SHAPES_256},
}
_VARLEN_BWD_SHORT_SHAPES = {kind: {64: [(32, 32, 4, 2)], 128: [(32, 32, 4, 2)], 256: []} for kind in ("dkdv", "dq")}
SHAPES.update(varlen_dkdv=lambda d: tile_configs(_VARLEN_BWD_SHAPES["dkdv"][_d_class(d)]),
              varlen_dq=lambda d: tile_configs(_VARLEN_BWD_SHAPES["dq"][_d_class(d)]),
              varlen_dkdv_short=lambda d: tile_configs(_VARLEN_BWD_SHORT_SHAPES["dkdv"][_d_class(d)]),
              varlen_dq_short=lambda d: tile_configs(_VARLEN_BWD_SHORT_SHAPES["dq"][_d_class(d)]))


def varlen_bwd_configs(d, q, length_class="long"):
    """(dK/dV candidates, dQ candidates) for head dim d on q's device and a batch of this length class: the
    configurations of each kernel's set (and on sm_90 its short set, for "short") that fit its shared memory
    (``varlen.class_candidates``; one fixed small tile under the interpreter). The launcher times them on first
    use."""
    return tuple(class_candidates(f"varlen_{kind}", kind, d, q.dtype, q.device, length_class)
                 for kind in ("dkdv", "dq"))


def flash_attn_varlen_bwd_triton(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None,
                                 max_seqlen_k=None, causal=False, sm_scale=None, *, window_size=(-1, -1), softcap=0.0,
                                 alibi_slopes=None, dropout_p=0.0, rng_state=None, validate=True, config=None):
    """Gradients ``(dq, dk, dv)`` of O = flash_attn_varlen_triton(q, k, v, ...) for the upstream gradient ``do``.

    q, o, do: [total_q, H, d]; k, v: [total_k, Hkv, d] (q, k, v with any strides, unit along d; dq, dk, dv come
    back contiguous); lse: [H, total_q] float32, the forward's second output
    (-inf on rows that saw no key: their gradients are 0). The layout: a ``VarlenBatch`` (``prepare_varlen``) in
    place of cu_seqlens_q (its launch plans kept per call shape, as the forward's); or the library's cu_seqlens
    and max_seqlen, exactly the forward's (``validate``: prepare a batch here, one host copy; False: nothing read
    back, lesson 10's maps built on the device). causal (bottom-right per sequence), sm_scale, window_size,
    softcap, alibi_slopes: the forward's. ``config``: {"dkdv": {...}, "dq": {...}} (BLOCK_M, BLOCK_N, num_warps,
    num_stages) fixes the tiles; None chooses them (``varlen.tuned_launch``). dropout_p > 0: the forward's
    probability with the forward's ``rng_state=(seed, offset)`` (required), whose mask is regenerated.
    """
    dropout = _check_dropout_args(dropout_p, rng_state, draw=False)
    rng = (dropout.seed, dropout.offset) if dropout.p > 0 else None
    if (isinstance(cu_seqlens_q, VarlenBatch) and cu_seqlens_k is None and max_seqlen_q is None
            and max_seqlen_k is None and config is None):
        plan = _plan_for(cu_seqlens_q, q, k, v, causal, sm_scale, window_size, softcap, alibi_slopes, dropout.p)
        _check_grad_inputs(do, o, lse, q, plan.H)
        return _bwd_plan(plan, q, k, v).run(do, q, k, v, o.contiguous(), lse.contiguous(), rng)
    total_q, H, d, total_k, Hkv = _check_packed(q, k, v)
    layout = _layout(q, total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, layout.num_seqs, q.device, "num_seqs",
                       both=True)
    _check_grad_inputs(do, o, lse, q, H)
    return _BwdPlan(q, k, v, layout, mods, sm_scale, config, dropout.p).run(do, q, k, v, o.contiguous(),
                                                                        lse.contiguous(), rng)


def _check_grad_inputs(do, o, lse, q, H):
    for name, x in (("o", o), ("do", do)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(q.shape) or x.device != q.device:
            raise ValueError(f"{name} must be a tensor of q's shape {tuple(q.shape)} on {q.device}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (H, q.shape[0]) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be a float32 tensor of shape {(H, q.shape[0])} (the forward's second output)")


def _bwd_plan(fwd, q, k, v):
    """The backward's plan of a forward plan (``varlen._FwdPlan``: the same batch, shapes, strides and options; q,
    k and v of them), built on its first backward and kept beside it."""
    if fwd.bwd is None:
        fwd.bwd = _BwdPlan(q, k, v, fwd.layout, fwd.mods, fwd.sm_scale, p_drop=fwd.p_drop)
        fwd.bwd._layout = fwd._layout  # weak where the forward's is (a plan its batch keeps)
    return fwd.bwd


class _BwdPlan(_LayoutRef):
    """The backward's three launches on one batch and one call shape, everything but the tensors: the preprocess
    (D = rowsum(dO * O), the lse in base 2), then the dK/dV and dQ kernels in their chosen configurations (each
    timed on its shape class's first call, ``varlen.tuned_launch``)."""

    def __init__(self, q, k, v, layout, mods, sm_scale, config=None, p_drop=0.0):
        total_q, H, d = q.shape[0], q.shape[1], q.shape[2]
        total_k, Hkv = k.shape[0], k.shape[1]
        self._layout, self.mods, self.H, self.Hkv, self.d = layout, mods, H, Hkv, d
        self.p_drop = p_drop  # the forward's dropout probability; its seed and offset come with each run
        self.dtype, self.device = q.dtype, q.device
        self.empty = total_q == 0 or total_k == 0  # no row sees a key: every gradient is 0
        if self.empty:
            return
        sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
        self.n, self.n_pad = H * total_q, -(-H * total_q // 4) * 4  # D and the lse2 in one buffer, each aligned
        self.shape = (H, total_q)
        # the dense preprocess with the packed strides: "head" h starts at column h * d, rows are H * d apart
        self.pre = _bwd_preprocess[(triton.cdiv(total_q, _PRE_BLOCK_M), H)]
        self.pre_args = (total_q, d, H * d)
        self.pre_meta = dict(HEAD_DIM=d, BLOCK_M=_PRE_BLOCK_M, BLOCK_D=head_block(d))
        self.causal = mods.right >= 0
        self.meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), **mods.meta())
        if p_drop > 0:
            self.meta.update(DROPOUT=True, p_drop=p_drop)
        self.tail = (layout.cu_seqlens_q, layout.cu_seqlens_k, total_q, H, Hkv, sm_scale * LOG2E.value, sm_scale,
                     mods.slopes, mods.stride_sb, max(mods.left, 0), max(mods.right, 0), mods.cap,
                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        shape_class = (d, q.dtype, mods.right >= 0, mods.left >= 0, mods.score_mod, H // Hkv, layout.length_class,
                       q.device.index, p_drop > 0)
        self.keys = {"dkdv": ("varlen dkdv",) + shape_class, "dq": ("varlen dq",) + shape_class}
        self.config = config
        self.parts = {}
        for kind in ("dkdv", "dq"):
            cfg = config[kind] if config is not None else _varlen._chosen.get(self.keys[kind])
            if cfg is not None:
                self.parts[kind] = self._parts(kind, dict(cfg))

    def _parts(self, kind, cfg):
        """(the launcher of its grid or None, the map, the constexprs) of kernel kind in configuration cfg."""
        if kind == "dkdv":  # key blocks of BLOCK_N, one program per (entry, KV head)
            seq, start = self.layout.block_map(cfg["BLOCK_N"], "k", self.causal)
            grid, fn = seq.numel() * self.Hkv, _bwd_dkdv_varlen
        else:  # query blocks of BLOCK_M, one program per (entry, query head)
            seq, start = self.layout.block_map(cfg["BLOCK_M"], "q", self.causal)
            grid, fn = seq.numel() * self.H, _bwd_dq_varlen
        return (fn[(grid,)] if grid else None, (seq, start) + self.tail, {**self.meta, **cfg})

    def _configs(self, kind):
        return varlen_bwd_configs(self.d, self, self.layout.length_class)[0 if kind == "dkdv" else 1]

    def run(self, do, q, k, v, o, lse, rng=None):
        """(dq, dk, dv) for this call's tensors (of the plan's shapes; o and lse the forward's); rng: the forward's
        dropout (seed, offset), with a plan that has dropout."""
        if self.p_drop > 0 and rng is None:
            raise ValueError("dropout_p > 0 in the backward needs the forward's rng_state=(seed, offset)")
        drop = {} if self.p_drop == 0 else dict(seed=rng[0], drop_off=rng[1])
        if self.empty:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if do.dtype != q.dtype or not do.is_contiguous():
            do = do.to(q.dtype).contiguous()
        # every row of dq and every key of dk, dv belongs to one block of its map, whose program writes it (0 where
        # nothing is seen), so nothing needs zeroing first; contiguous, whatever the strides of q, k, v
        dq, dk, dv = (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v))
        buf = torch.empty(2 * self.n_pad, device=q.device, dtype=torch.float32)
        delta = buf[:self.n].view(self.shape)  # [H, total_q] rowsum(dO * O)
        lse2 = buf[self.n_pad:self.n_pad + self.n].view(self.shape)  # [H, total_q] lse in base 2, +inf on empty rows
        self.pre(o, do, lse, delta, lse2, *self.pre_args, **self.pre_meta)
        for kind, outs in (("dkdv", (dk, dv)), ("dq", (dq,))):
            head = (q, k, v, do, lse2, delta) + outs
            parts = self.parts.get(kind)
            if parts is None:
                tuned_launch(self.keys[kind], lambda kind=kind: self._configs(kind),
                             lambda cfg, kind=kind, head=head: self._launch(self._parts(kind, cfg), head, drop),
                             q.device)
                cfg = _varlen._chosen.get(self.keys[kind])
                if cfg is not None:
                    self.parts[kind] = self._parts(kind, cfg)
            else:
                self._launch(parts, head, drop)
        return dq, dk, dv

    @staticmethod
    def _launch(parts, head, drop):
        launcher, args, kwargs = parts
        if launcher is not None:
            launcher(*head, *args, **drop, **kwargs)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """O = flash_attn_varlen_func(q, k, v, ...) with the course's Triton forward and backward, on a launch plan of a
    ``VarlenBatch`` (``varlen._plan_for``: the batch, the shapes and the options, checked when it was built); the
    backward runs on exactly the batch the forward ran on."""

    @staticmethod
    def forward(ctx, q, k, v, plan, rng=None):
        o, lse = plan.run(q, k, v, rng)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.batch, ctx.rng = plan, plan.layout, rng  # the batch lives until the backward has run
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd_plan(ctx.plan, q, k, v).run(do, q, k, v, o, lse, ctx.rng)
        return dq, dk, dv, None, None


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           dropout_p=0.0, rng_state=None):
    """Differentiable attention over packed sequences (the library's ``flash_attn_varlen_func``): O [total_q, H, d].

    q: [total_q, H, d]; k, v: [total_k, Hkv, d], H a multiple of Hkv; any d from 1 to 256. The layout:

    * ``flash_attention_varlen(q, k, v, batch, causal=True)`` with ``batch = prepare_varlen(cu_seqlens)`` made once
      per batch and passed to every layer (the training path: no host sync in the forward or the backward; the
      first layer's call checks the inputs and builds the launch plans, the other layers' calls reuse them);
    * or the library's ``cu_seqlens_q, cu_seqlens_k`` (int32 [B + 1], 0 then the cumulative lengths) and
      ``max_seqlen_q, max_seqlen_k``: checked and prepared in this call (one copy of cu_seqlens to the host, the
      maps built again: the slow path, for a single call).

    causal: bottom-right per sequence. Gradients flow to q, k and v. ``window_size``, ``softcap``,
    ``alibi_slopes`` ([H] or [num_seqs, H]; with softcap too), ``dropout_p`` and ``rng_state`` (None: drawn from
    torch's generator, kept for the backward): the library's, bottom-right per sequence (see
    ``flash_attn_varlen_triton``).
    """
    if isinstance(cu_seqlens_q, VarlenBatch) and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None:
        batch = cu_seqlens_q
    else:
        total_q, _, _, total_k, _ = _check_packed(q, k, v)
        batch = _layout(q, total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, True)
    dropout = _check_dropout_args(dropout_p, rng_state)
    plan = _plan_for(batch, q, k, v, causal, sm_scale, window_size, softcap, alibi_slopes, dropout.p)
    rng = (dropout.seed, dropout.offset) if dropout.p > 0 else None
    return FlashAttentionVarlenFunction.apply(q, k, v, plan, rng)
