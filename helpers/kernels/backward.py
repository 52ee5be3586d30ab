"""FlashAttention backward in Triton, and ``flash_attention``: an autograd Function over the course's kernels.

Public:

* ``flash_attn_bwd_triton(do, q, k, v, o, lse, causal=False, sm_scale=None, align="top_left", *,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None) -> (dq, dk, dv)``
* ``flash_attention(q, k, v, causal=False, sm_scale=None, align="top_left", *, window_size=(-1, -1), softcap=0.0,
  alibi_slopes=None, dropout_p=0.0, rng_state=None) -> O``: differentiable;
  forward = ``helpers.kernels.forward.flash_attn_triton`` (which also returns the lse the backward needs),
  backward = the kernels below.

The algorithm (Dao, "FlashAttention-2", 2023, Algorithm 2), per (batch, head), with S = q k^T * sm_scale,
P = softmax(S) recomputed from the saved natural-log ``lse`` (P = exp(S - lse)), never stored:

    D   = rowsum(dO * O)                 [N]      preprocess kernel (one pass over O and dO)
    dV  = P^T dO                         [Nk, d]  \\
    dP  = dO V^T                         [N, Nk]   |  dK/dV kernel: one program owns BLOCK_N keys,
    dS  = P * (dP - D[:, None])          [N, Nk]   |  keeps dK, dV in registers and streams the
    dK  = dS^T q * sm_scale              [Nk, d]  /   query blocks past them (KV outer)
    dQ  = dS k * sm_scale                [N, d]   a separate dQ kernel (Q outer, like the forward), or
                                                  atomic adds from the dK/dV kernel (``dq_mode``)

Every exponential is one ``exp2``: ``qk_scale = sm_scale * log2(e)`` and the preprocess turns the lse into
base 2 (``lse2 = lse * log2(e)``, +inf for a row that saw no key so that its P is exp2(-inf) = 0).
Causal tiles use the forward's three classes: tiles every (query, key) pair of which is visible run in a
loop without a mask, tiles on the diagonal band or on a ragged edge (N or Nk not a multiple of the block)
in a loop with one, and tiles nobody sees are never visited. Both alignments of the forward are supported
(row i sees key j when j <= i + diag; diag = 0 top-left, Nk - N bottom-right). The library's sliding window,
softcap and ALiBi use the forward's switches: a window's lower bound adds a masked band on the other side (rows
past it in the dK/dV kernel, keys before it in the dQ kernel, never visited beyond), P is recomputed from the
modified score, and dS goes through the softcap as dS * (1 - tanh^2) (ALiBi's bias passes it through).

Dropout (the forward's ``dropout_p`` and ``rng_state``): the mask Z is regenerated tile by tile from the same
Philox counters (``common._dropout_keep``), dV = (P * Z)^T dO / (1 - p), dP = Z * (dO V^T) / (1 - p), and D =
rowsum(dO * O) is unchanged (O is the dropped P times V). Any head dim from 1 to 256 and any strides with a unit
stride along d, as the forward (``_flash_bwd`` writes dq, dk, dv where it is told: the drop-in's packed forms pass
views of one packed gradient).

``dq_mode="separate"`` is deterministic (every dQ element is written once by one program);
``dq_mode="atomic"`` adds fp32 partials from many programs in whatever order they finish, so dQ can
differ in the last bits from run to run. Default: ``DEFAULT_DQ_MODE`` (set from the H200 measurements
in bench/NOTES.md).

Runs on a CUDA GPU (fp16, bf16; fp32 with tf32 dots) or with ``TRITON_INTERPRET=1`` on the CPU (fp32,
fp16; one small fixed tile configuration). Written for this course; numbers in bench/NOTES.md.
"""

import math

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .common import (LOG2E, SHAPES, _check_dense_kv, _check_qkv, _dropout_keep, _load_d, _score_mod, draw_rng_state,
                     head_block, prune_for_device, tile_configs)
from .forward import NO_DROPOUT, _check_dropout_args, _check_fwd_inputs, _check_mods, flash_attn_triton

__all__ = ["flash_attention", "flash_attn_bwd_triton", "FlashAttentionFunction", "DEFAULT_DQ_MODE"]

DEFAULT_DQ_MODE = "separate"


# ----------------------------------------------------------------------------
# Preprocess: D = rowsum(dO * O) and the lse in base 2
# ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N"])
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2, N, stride_oh, stride_om, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    # grid = (cdiv(N, BLOCK_M), B * H). O, DO: row n of head bh at bh * stride_oh + n * stride_om (dense
    # [B, H, N, d]: N * d and d; packed [total_q, H, d]: d and H * d); LSE, DELTA, LSE2 [B*H, N] contiguous
    off_bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    ptrs = off_bh * stride_oh + rows[:, None] * stride_om  # [BLOCK_M, 1]
    _preprocess_rows(O + ptrs, DO + ptrs, LSE, DELTA, LSE2, off_bh, rows, N, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["N"])
def _bwd_preprocess_strided(O, DO, LSE, DELTA, LSE2, N, H, stride_ob, stride_oh, stride_om, stride_dob, stride_doh,
                            stride_dom, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid = (cdiv(N, BLOCK_M), B * H): the dense backward's, O and dO [B, H, N, d] each with its own strides
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // H
    off_h = off_bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + rows[:, None].to(tl.int64) * stride_om  # [BLOCK_M, 1]
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + rows[:, None].to(tl.int64) * stride_dom
    _preprocess_rows(o_ptrs, do_ptrs, LSE, DELTA, LSE2, off_bh, rows, N, HEAD_DIM, BLOCK_D)


@triton.jit
def _preprocess_rows(o_rows, do_rows, LSE, DELTA, LSE2, off_bh, rows, N, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """D = rowsum(dO * O) and lse2 for one block of rows; o_rows, do_rows [BLOCK_M, 1]: each row's first element."""
    offs_d = tl.arange(0, BLOCK_D)  # [D]; columns past HEAD_DIM masked
    ok = rows < N
    io_ok = ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_M, D]
    o = tl.load(o_rows + offs_d[None, :], mask=io_ok, other=0.0).to(tl.float32)
    do = tl.load(do_rows + offs_d[None, :], mask=io_ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)  # [BLOCK_M]
    lse = tl.load(LSE + off_bh * N + rows, mask=ok, other=0.0)  # [BLOCK_M] natural log
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # base 2; +inf: P = 0
    tl.store(DELTA + off_bh * N + rows, delta, mask=ok)
    tl.store(LSE2 + off_bh * N + rows, lse2, mask=ok)


# ----------------------------------------------------------------------------
# dK, dV (and dQ by atomics): KV blocks outer, query blocks inner
# ----------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,  # [BLOCK_N, D] fp32 accumulators; this program's keys and values
    Q, DO, LSE2, DELTA, DQ,  # this query head's base pointers: Q, DO, DQ [N, D]; LSE2, DELTA [N]
    stride_qm, stride_dom, stride_dqm,  # elements from one query row to the next in Q, DO and DQ
    lo, hi,  # query rows [lo, hi) to visit, lo a multiple of BLOCK_M
    offs_n, N, Nk, diag, qk_scale, sm_scale,  # offs_n [BLOCK_N]: this program's key indices
    diag_lo, cap, slope, alibi_diag,  # the window's lower bound; the score mod's scalars (common._score_mod)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM): the tiles' width, the columns past HEAD_DIM masked
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,  # False: every (row, key) pair visible, rows < N; True: bands / ragged edges
    CAUSAL: tl.constexpr,  # an upper bound: row i sees keys j <= i + diag
    DQ_ATOMIC: tl.constexpr,
    WINDOW: tl.constexpr,  # a lower bound: row i sees keys j >= i + diag_lo
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both)
    DROPOUT: tl.constexpr,  # the forward's dropout mask, regenerated (common._dropout_keep)
    p_drop, seed, drop_off, bh,  # its probability, Philox key and counter offset; this query head (b * H + h)
):
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    d_ok = offs_d < HEAD_DIM  # [D]
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        ptrs = rows[:, None] * stride_qm + offs_d[None, :]  # [BLOCK_M, D]
        do_ptrs = rows[:, None] * stride_dom + offs_d[None, :]  # [BLOCK_M, D]
        dq_ptrs = rows[:, None] * stride_dqm + offs_d[None, :]  # [BLOCK_M, D]
        if MASKED:
            row_ok = rows < N
            io_ok = row_ok[:, None] & d_ok[None, :]  # [BLOCK_M, D]
            q = tl.load(Q + ptrs, mask=io_ok, other=0.0)  # [BLOCK_M, D]
            do = tl.load(DO + do_ptrs, mask=io_ok, other=0.0)  # [BLOCK_M, D]
            lse2 = tl.load(LSE2 + rows, mask=row_ok, other=float("inf"))  # [BLOCK_M]; padding: P = 0
            delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)  # [BLOCK_M]
        else:
            q = _load_d(Q + ptrs, d_ok, BLOCK_D != HEAD_DIM)
            do = _load_d(DO + do_ptrs, d_ok, BLOCK_D != HEAD_DIM)
            lse2 = tl.load(LSE2 + rows)
            delta = tl.load(DELTA + rows)
        # P^T recomputed from the saved lse: one exp2 per score
        qkT = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
        if SCORE_MOD == 0:
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        else:  # the forward's modified score; dmodT = its derivative (softcap: 1 - tanh^2)
            s2T, dmodT = _score_mod(qkT, rows[None, :], offs_n[:, None], sm_scale, cap, slope, alibi_diag, SCORE_MOD)
            pT = tl.math.exp2(s2T - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            keep = offs_n[:, None] < Nk  # [BLOCK_N, 1] the ragged key tail
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :] + diag)  # [BLOCK_N, BLOCK_M]
            if WINDOW:
                keep = keep & (offs_n[:, None] >= rows[None, :] + diag_lo)  # [BLOCK_N, BLOCK_M]
            pT = tl.where(keep, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M] = (dO V^T)^T, the gradient of the dropped P
        if DROPOUT:  # O = (P * Z) V / (1 - p): dV sees the dropped P, dP = Z * (dO V^T) / (1 - p)
            keepT = _dropout_keep(seed, drop_off, bh, rows[None, :], offs_n[:, None], p_drop)  # [BLOCK_N, BLOCK_M]
            inv_keep = 1.0 / (1.0 - p_drop)
            dv = tl.dot(tl.where(keepT, pT * inv_keep, 0.0).to(do.dtype), do, dv)  # [BLOCK_N, D] += (P Z)^T dO
            dpT = tl.where(keepT, dpT * inv_keep, 0.0)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv)  # [BLOCK_N, D] += P^T dO
        dsT = pT * (dpT - delta[None, :])  # [BLOCK_N, BLOCK_M]
        if SCORE_MOD & 1:
            dsT = dsT * dmodT  # through the softcap (ALiBi's bias passes dS through)
        dk = tl.dot(dsT.to(q.dtype), q, dk)  # [BLOCK_N, D] += dS^T q
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k) * sm_scale  # [BLOCK_M, D]
            if MASKED:
                tl.atomic_add(DQ + dq_ptrs, dq, mask=io_ok, sem="relaxed")
            elif BLOCK_D != HEAD_DIM:
                tl.atomic_add(DQ + dq_ptrs, dq, mask=d_ok[None, :], sem="relaxed")
            else:
                tl.atomic_add(DQ + dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_group(
    dk, dv, k, v,  # [BLOCK_N, D] fp32 accumulators; this program's keys and values
    Q, DO, LSE2, DELTA, DQ,  # base pointers of the group's first query head (its row 0)
    stride_qh, stride_lh,  # from one query head to the next: in Q, DO, DQ; in LSE2, DELTA
    stride_qm,  # from one query row to the next in Q, DO, DQ
    GROUP, start_n, offs_n, N, Nk, diag, qk_scale, sm_scale,  # start_n: this block's first key (of this sequence)
    SLOPE, diag_lo, cap, alibi_diag,  # SLOPE: the group's first head's ALiBi slope (the next heads' follow it)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: row i sees keys j <= i + diag
    DQ_ATOMIC: tl.constexpr,
    EVEN: tl.constexpr,  # N a multiple of BLOCK_M and Nk of BLOCK_N (False: both ragged loops are in the code)
    WINDOW: tl.constexpr,  # a lower bound: row i sees keys j >= i + diag_lo
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both)
    # last and optional (a caller written before them still compiles): DO's and DQ's own strides (None: Q's), and
    # dropout (its probability, the Philox key and counter offset, the group's first query head b * H + h)
    stride_doh=None, stride_dom=None, stride_dqh=None, stride_dqm=None,
    DROPOUT: tl.constexpr = False, p_drop=0.0, seed=0, drop_off=0, bh0=0,
):
    """dK, dV of one block of BLOCK_N keys from the GROUP query heads that read its KV head, one head after the
    other, summed in the accumulators. Shared by the dense kernel and the packed variable-length one
    (helpers/kernels/varlen_backward.py): the caller finds the keys and the heads' pointers."""
    if stride_doh is None:  # DO and DQ in Q's layout (the packed kernel's)
        s_doh = stride_qh
        s_dom = stride_qm
    else:
        s_doh = stride_doh
        s_dom = stride_dom
    if stride_dqh is None:
        s_dqh = stride_qh
        s_dqm = stride_qm
    else:
        s_dqh = stride_dqh
        s_dqm = stride_dqm
    # Row classes for this key block (the same for every query head). Row i sees key j when j <= i + diag
    # (CAUSAL) and j >= i + diag_lo (WINDOW). Rows < m_lo see none of these keys (upper bound): never visited.
    # Masked: rows [m_lo, band_hi) (the upper band) and [tail_lo, m_hi) (the lower band and the ragged row
    # tail); no mask: [off_lo, off_hi), whole query blocks that see every key of a whole key block.
    # Rows >= m_hi see none of these keys (lower bound; N without WINDOW): never visited.
    N_full = (N // BLOCK_M) * BLOCK_M
    if CAUSAL:
        m_lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M  # block of the first row that sees key start_n
        r_all = tl.maximum(start_n + BLOCK_N - 1 - diag, 0)  # rows >= this see every key of the block
        m_mid = ((r_all + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
        m_mid = 0
    m_lo = tl.minimum(m_lo, N_full + BLOCK_M)
    if start_n + BLOCK_N <= Nk:
        off_lo = tl.minimum(tl.maximum(m_mid, m_lo), N_full)
        off_hi = tl.maximum(N_full, off_lo)
    else:  # the ragged last key block: every tile masked
        off_lo = tl.minimum(m_lo, N_full)
        off_hi = off_lo
    if WINDOW:
        r_full_end = tl.maximum(start_n - diag_lo + 1, 0)  # rows < this see the block's first key from below
        off_hi = tl.maximum(tl.minimum(off_hi, (r_full_end // BLOCK_M) * BLOCK_M), off_lo)
        m_hi = tl.minimum(tl.maximum(start_n + BLOCK_N - diag_lo, 0), N)  # rows >= this see none of the keys
        band_hi = tl.minimum(off_lo, m_hi)  # a window narrower than a tile: the upper band may reach m_hi
    else:
        m_hi = N
        band_hi = off_lo
    tail_lo = tl.maximum(off_hi, m_lo)

    q_base, do_base, dq_base, lse2_base, delta_base = Q, DO, DQ, LSE2, DELTA
    for g in range(0, GROUP):  # the group's query heads, one after the other
        slope = 0.0
        if SCORE_MOD & 2:
            slope = tl.load(SLOPE + g)
        if CAUSAL or not EVEN:  # not causal and even: the band is empty, so the loop is left out
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, stride_qm,
                                     s_dom, s_dqm, m_lo, band_hi, offs_n, N, Nk, diag, qk_scale, sm_scale,
                                     diag_lo, cap, slope, alibi_diag,
                                     HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, DQ_ATOMIC, WINDOW, SCORE_MOD,
                                     DROPOUT, p_drop, seed, drop_off, bh0 + g)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, stride_qm,
                                 s_dom, s_dqm, off_lo, off_hi, offs_n, N, Nk, diag, qk_scale, sm_scale,
                                 diag_lo, cap, slope, alibi_diag,
                                 HEAD_DIM, BLOCK_D, BLOCK_M, False, CAUSAL, DQ_ATOMIC, WINDOW, SCORE_MOD,
                                 DROPOUT, p_drop, seed, drop_off, bh0 + g)
        if WINDOW or not EVEN:  # the lower band and the ragged row tail
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, dq_base, stride_qm,
                                     s_dom, s_dqm, tail_lo, m_hi, offs_n, N, Nk, diag, qk_scale, sm_scale,
                                     diag_lo, cap, slope, alibi_diag,
                                     HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, DQ_ATOMIC, WINDOW, SCORE_MOD,
                                     DROPOUT, p_drop, seed, drop_off, bh0 + g)
        q_base += stride_qh  # the next head (pointer steps: no int32 product of the head index and its stride)
        do_base += s_doh
        dq_base += s_dqh
        lse2_base += stride_lh
        delta_base += stride_lh
    return dk, dv


# EVEN: N a multiple of BLOCK_M and Nk of BLOCK_N, known when the kernel is compiled, so the loops for
# ragged edges are not in the code at all (not just empty at run time). N and Nk are specialised on
# (Triton records whether each is divisible by 16): on an H200 that made the dK/dV kernel 11-14% faster
# than leaving them unspecialised (bench/NOTES.md, backward v3); diag is not.
def _even(args):
    return args["N"] % args["BLOCK_M"] == 0 and args["Nk"] % args["BLOCK_N"] == 0


@triton.jit(do_not_specialize=["diag", "diag_lo", "alibi_diag", "seed", "drop_off"])
def _bwd_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ,  # Q, DO, DQ [B, H, N, D]; K, V, DK, DV [B, Hkv, Nk, D], each with its own
    # strides (a unit stride along D); LSE2, DELTA [B*H, N] contiguous; DQ fp32 if atomic
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    N, Nk, diag, qk_scale, sm_scale,
    GROUP,  # query heads per KV head (H // Hkv; 1 without grouped-query attention)
    Hkv,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: row i sees keys j <= i + diag
    DQ_ATOMIC: tl.constexpr,
    EVEN: tl.constexpr,  # _even(): no ragged query or key block
    # the library's options, last and off by default:
    SLOPES=None, stride_sb=0, H=1,  # ALiBi: slope of (b, h) at SLOPES[b * stride_sb + h]
    diag_lo=0, cap=1.0, alibi_diag=0,  # the window's lower bound; the score mod's scalars
    WINDOW: tl.constexpr = False,  # a lower bound: row i sees keys j >= i + diag_lo
    SCORE_MOD: tl.constexpr = 0,  # bits: 1 softcap, 2 ALiBi (3: both)
    p_drop=0.0, seed=0, drop_off=0,  # dropout: the forward's probability, Philox key and counter offset
    DROPOUT: tl.constexpr = False,
):
    # grid = (cdiv(Nk, BLOCK_N), B * Hkv); with causal top-left the first key blocks are seen by the most
    # rows, so program 0 (launched first) is the heaviest. Grouped-query attention: this program owns
    # BLOCK_N keys of one KV head and visits the GROUP query heads that read it one after the other, summing
    # their dK, dV in registers: K and V are read once, dK and dV written once (no atomics, deterministic).
    start_n = tl.program_id(0) * BLOCK_N
    off_bkv = tl.program_id(1).to(tl.int64)  # b * Hkv + kv head
    off_b = off_bkv // Hkv
    off_hkv = off_bkv % Hkv
    h0 = off_hkv * GROUP  # the group's first query head
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key indices
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    kv_ok = (offs_n < Nk)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_N, D]
    rows_n = offs_n[:, None].to(tl.int64)
    k = tl.load(K + off_b * stride_kb + off_hkv * stride_kh + rows_n * stride_kn + offs_d[None, :], mask=kv_ok,
                other=0.0)  # [BLOCK_N, D]
    v = tl.load(V + off_b * stride_vb + off_hkv * stride_vh + rows_n * stride_vn + offs_d[None, :], mask=kv_ok,
                other=0.0)  # [BLOCK_N, D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    bh0 = off_bkv * GROUP  # b * H + the group's first query head
    slope_ptr = SLOPES
    if SCORE_MOD & 2:
        slope_ptr = SLOPES + off_b * stride_sb + h0

    dk, dv = _bwd_dkdv_group(dk, dv, k, v, Q + off_b * stride_qb + h0 * stride_qh,
                             DO + off_b * stride_dob + h0 * stride_doh, LSE2 + bh0 * N, DELTA + bh0 * N,
                             DQ + off_b * stride_dqb + h0 * stride_dqh,
                             stride_qh, N, stride_qm, GROUP, start_n, offs_n, N, Nk, diag, qk_scale, sm_scale,
                             slope_ptr, diag_lo, cap, alibi_diag,
                             HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, DQ_ATOMIC, EVEN, WINDOW, SCORE_MOD,
                             stride_doh, stride_dom, stride_dqh, stride_dqm, DROPOUT, p_drop, seed, drop_off, bh0)

    dk = dk * sm_scale  # dS was taken w.r.t. S = q k^T * sm_scale
    tl.store(DK + off_b * stride_dkb + off_hkv * stride_dkh + rows_n * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + off_b * stride_dvb + off_hkv * stride_dvh + rows_n * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_ok)


# ----------------------------------------------------------------------------
# dQ: query blocks outer, key blocks inner (the forward's loop and tile classes)
# ----------------------------------------------------------------------------


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta,  # dq [BLOCK_M, D] fp32; q, do [BLOCK_M, D]; lse2, delta [BLOCK_M]
    K, V,  # this query head's KV head's base pointers [Nk, D]
    stride_kn,  # elements from one key row to the next in K and V (HEAD_DIM dense; Hkv * D packed)
    lo, hi, offs_m, Nk, diag, qk_scale,
    diag_lo, sm_scale, cap, slope, alibi_diag,  # the window's lower bound; the score mod's scalars
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM)
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: row i sees keys j <= i + diag
    WINDOW: tl.constexpr,  # a lower bound: row i sees keys j >= i + diag_lo
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both)
    stride_vn,  # from one value row to the next in V
    DROPOUT: tl.constexpr,  # the forward's dropout mask, regenerated
    p_drop, seed, drop_off, bh,  # its probability, Philox key and counter offset; this query head (b * H + h)
):
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # [D]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ptrs = cols[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, D]
        v_ptrs = cols[:, None] * stride_vn + offs_d[None, :]  # [BLOCK_N, D]
        if MASKED:
            kv_ok = (cols[:, None] < Nk) & d_ok[None, :]  # [BLOCK_N, D]
            k = tl.load(K + ptrs, mask=kv_ok, other=0.0)  # [BLOCK_N, D]
            v = tl.load(V + v_ptrs, mask=kv_ok, other=0.0)  # [BLOCK_N, D]
        else:
            k = _load_d(K + ptrs, d_ok, BLOCK_D != HEAD_DIM)
            v = _load_d(V + v_ptrs, d_ok, BLOCK_D != HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        if SCORE_MOD == 0:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        else:  # the forward's modified score; dmod = its derivative (softcap: 1 - tanh^2)
            s2, dmod = _score_mod(qk, offs_m[:, None], cols[None, :], sm_scale, cap, slope, alibi_diag, SCORE_MOD)
            p = tl.math.exp2(s2 - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        if MASKED:
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            if WINDOW:
                keep = keep & (cols[None, :] >= offs_m[:, None] + diag_lo)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N]
        if DROPOUT:  # dP = Z * (dO V^T) / (1 - p)
            keep = _dropout_keep(seed, drop_off, bh, offs_m[:, None], cols[None, :], p_drop)  # [BLOCK_M, BLOCK_N]
            dp = tl.where(keep, dp * (1.0 / (1.0 - p_drop)), 0.0)
        ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
        if SCORE_MOD & 1:
            ds = ds * dmod  # through the softcap (ALiBi's bias passes dS through)
        dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D] += dS k
    return dq


@triton.jit
def _bwd_dq_rows(
    dq, q, do, lse2, delta, K, V, stride_kn,  # as in _bwd_dq_inner
    start_m, offs_m, Nk, diag, qk_scale,  # start_m: the block's index within its sequence
    diag_lo, sm_scale, cap, slope, alibi_diag,  # as in _bwd_dq_inner
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN: tl.constexpr,
    WINDOW: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    # last and optional (a caller written before them still compiles): V's own row stride (None: K's), dropout
    stride_vn=None, DROPOUT: tl.constexpr = False, p_drop=0.0, seed=0, drop_off=0, bh=0,
):
    """dQ of one block of query rows over keys [0, Nk) in the forward's tile classes (forward._attn_fwd_rows).
    Shared by the dense kernel and the packed variable-length one."""
    if stride_vn is None:
        s_vn = stride_kn
    else:
        s_vn = stride_vn
    if CAUSAL:  # as in the forward: [full_lo, band_lo) no mask, [band_lo, band_hi) masked, the rest never visited
        first_row_end = tl.minimum(tl.maximum(start_m * BLOCK_M + diag + 1, 0), Nk)
        band_lo = (first_row_end // BLOCK_N) * BLOCK_N
        band_hi = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M + diag, 0), Nk)
    else:
        band_lo = (Nk // BLOCK_N) * BLOCK_N
        band_hi = Nk
    if WINDOW:  # the lower band [win_lo, full_lo), masked; keys below win_lo never visited
        win_lo = tl.minimum(tl.maximum(start_m * BLOCK_M + diag_lo, 0), Nk)
        last_row_lo = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M - 1 + diag_lo, 0), Nk)
        full_lo = ((last_row_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, (win_lo // BLOCK_N) * BLOCK_N,
                           tl.minimum(full_lo, band_hi), offs_m, Nk, diag, qk_scale,
                           diag_lo, sm_scale, cap, slope, alibi_diag,
                           HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, WINDOW, SCORE_MOD,
                           s_vn, DROPOUT, p_drop, seed, drop_off, bh)
        band_lo = tl.maximum(band_lo, full_lo)
    else:
        full_lo = 0
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, full_lo, band_lo, offs_m, Nk, diag, qk_scale,
                       diag_lo, sm_scale, cap, slope, alibi_diag,
                       HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, WINDOW, SCORE_MOD,
                       s_vn, DROPOUT, p_drop, seed, drop_off, bh)
    if CAUSAL or not EVEN:  # not causal and even: nothing is masked, the loop is left out
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, band_lo, band_hi, offs_m, Nk, diag, qk_scale,
                           diag_lo, sm_scale, cap, slope, alibi_diag,
                           HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, WINDOW, SCORE_MOD,
                           s_vn, DROPOUT, p_drop, seed, drop_off, bh)
    return dq


@triton.jit(do_not_specialize=["diag", "diag_lo", "alibi_diag", "seed", "drop_off"])
def _bwd_dq(
    Q, K, V, DO, LSE2, DELTA, DQ,  # Q, DO, DQ [B, H, N, D]; K, V [B, Hkv, Nk, D], each with its own strides
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    N, Nk, diag, qk_scale, sm_scale,
    GROUP,  # query heads per KV head: query head h reads KV head h // GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: row i sees keys j <= i + diag
    EVEN: tl.constexpr,  # _even(): no ragged query or key block
    # the library's options, last and off by default:
    SLOPES=None, stride_sb=0, H=1,  # ALiBi: slope of (b, h) at SLOPES[b * stride_sb + h]
    diag_lo=0, cap=1.0, alibi_diag=0,  # the window's lower bound; the score mod's scalars
    WINDOW: tl.constexpr = False,  # a lower bound: row i sees keys j >= i + diag_lo
    SCORE_MOD: tl.constexpr = 0,  # bits: 1 softcap, 2 ALiBi (3: both)
    p_drop=0.0, seed=0, drop_off=0,  # dropout: the forward's probability, Philox key and counter offset
    DROPOUT: tl.constexpr = False,
):
    # grid = (cdiv(N, BLOCK_M), B * H); causal blocks run heaviest (last) first
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_M, D]
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + rows * stride_qm + offs_d[None, :], mask=io_ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dom + offs_d[None, :], mask=io_ok,
                 other=0.0)
    lse2 = tl.load(LSE2 + off_bh * N + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + off_bh * N + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    slope = 0.0
    if SCORE_MOD & 2:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h)
    dq = _bwd_dq_rows(dq, q, do, lse2, delta, k_base, v_base, stride_kn, start_m, offs_m, Nk, diag, qk_scale,
                      diag_lo, sm_scale, cap, slope, alibi_diag,
                      HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, EVEN, WINDOW, SCORE_MOD,
                      stride_vn, DROPOUT, p_drop, seed, drop_off, off_bh)
    dq = dq * sm_scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=io_ok)


@triton.jit
def _cast_rows(SRC, DST, numel, BLOCK: tl.constexpr):
    """DST = SRC cast to DST's dtype (the fp32 atomic dQ accumulator to q's dtype)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    tl.store(DST + offs, tl.load(SRC + offs, mask=ok).to(DST.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------
# Configurations and wrapper
# ----------------------------------------------------------------------------

_INTERPRETER_BWD_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
_PRE_BLOCK_M = 64

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner: the winners of the H200 sweep
# (bench/NOTES.md, backward v1); dK/dV: 32x64 for d = 64, 64x128 / 128x128 for d = 128. Head dims that are not
# a power of two run in the next one's tiles (d = 80, 96 as 128).
_DKDV_SHAPES = [(32, 64, 4, 3), (64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
_DQ_SHAPES = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)]
# d in (128, 256]: 256-wide tiles, two stages. Not measured on a GPU yet: the first of each fits sm_90 and sm_80,
# the second sm_86/89's 99 KB; nothing fits a T4's 64 KB (the launcher says so).
_DKDV_SHAPES_256 = [(32, 64, 8, 2), (32, 32, 4, 2)]
_DQ_SHAPES_256 = [(64, 32, 4, 2), (32, 32, 4, 2)]


def _d_class(d):
    """128 for head dims up to 128 (their tiles are at most 128 wide), 256 above."""
    return 128 if head_block(d) <= 128 else 256


_SHAPES_BY_CLASS = {"dkdv": {128: _DKDV_SHAPES, 256: _DKDV_SHAPES_256}, "dq": {128: _DQ_SHAPES, 256: _DQ_SHAPES_256}}
SHAPES.update(dkdv=lambda d: tile_configs(_SHAPES_BY_CLASS["dkdv"][_d_class(d)]),
              dq=lambda d: tile_configs(_SHAPES_BY_CLASS["dq"][_d_class(d)]))


def _configs(shapes):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


def _prune(kind):  # triton.autotune's early_config_prune: the configurations that fit this GPU
    return {"early_config_prune": lambda configs, nargs, **kw: prune_for_device(kind, configs, nargs, kw)}


# d class -> autotuner
_bwd_dkdv_tuned = {c: triton.autotune(configs=_configs(_SHAPES_BY_CLASS["dkdv"][c]),
                                      key=["N", "Nk", "HEAD_DIM", "CAUSAL", "DQ_ATOMIC", "WINDOW", "SCORE_MOD", "DROPOUT"],
                                      reset_to_zero=["DQ"], prune_configs_by=_prune("dkdv"))(
    triton.heuristics({"EVEN": _even})(_bwd_dkdv)) for c in (128, 256)}
_bwd_dq_tuned = {c: triton.autotune(configs=_configs(_SHAPES_BY_CLASS["dq"][c]),
                                    key=["N", "Nk", "HEAD_DIM", "CAUSAL", "WINDOW", "SCORE_MOD", "DROPOUT"],
                                    prune_configs_by=_prune("dq"))(triton.heuristics({"EVEN": _even})(_bwd_dq))
                 for c in (128, 256)}


def _check_inputs(q, k, v, causal, align):
    _check_qkv(q, k, v, (4, 4, 4))
    B, H, N, d = q.shape
    Hkv, _ = _check_dense_kv(q, k, v)
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return B, H, Hkv, N, k.shape[2], d


def _check_bwd_inputs(q, k, v, causal, align):
    """The dense backward's checks (the forward's: any d from 1 to 256, any strides with a unit stride along d)."""
    B, H, Hkv, N, Nk, d = _check_fwd_inputs(q, k, v, align)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return B, H, Hkv, N, Nk, d


def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _flash_bwd(do, q, k, v, o, lse, mods, sm_scale, diag0, *, dq_mode=None, dropout=NO_DROPOUT, dq=None, dk=None,
               dv=None, config=None):
    """The dense backward's launches on checked inputs (any strides with a unit stride along d, as the forward's):
    fills and returns (dq, dk, dv), allocated like q, k, v where not given (the packed interface passes views of one
    packed gradient, so nothing is concatenated afterwards)."""
    B, H, N, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = H // Hkv
    dq_mode = DEFAULT_DQ_MODE if dq_mode is None else dq_mode
    if dq_mode not in ("separate", "atomic"):
        raise ValueError(f"dq_mode must be 'separate' or 'atomic', got {dq_mode!r}")
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    if do.stride(-1) != 1:
        do = do.contiguous()
    if o.stride(-1) != 1:
        o = o.contiguous()
    lse = lse.contiguous()
    sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
    qk_scale = sm_scale * LOG2E.value
    diag, diag_lo = mods.diags(diag0)  # row i sees keys i + diag_lo <= j <= i + diag

    delta = torch.empty((B, H, N), device=q.device, dtype=torch.float32)  # [B, H, N] rowsum(dO * O)
    lse2 = torch.empty_like(delta)  # [B, H, N] lse in base 2, +inf on empty rows
    _bwd_preprocess_strided[(triton.cdiv(N, _PRE_BLOCK_M), B * H)](
        o, do, lse, delta, lse2, N, H, *_strides3(o), *_strides3(do), HEAD_DIM=d, BLOCK_M=_PRE_BLOCK_M,
        BLOCK_D=head_block(d))
    dk = torch.empty_like(k) if dk is None else dk  # [B, Hkv, Nk, d]
    dv = torch.empty_like(v) if dv is None else dv  # [B, Hkv, Nk, d]
    dq = torch.empty_like(q) if dq is None else dq  # [B, H, N, d]
    atomic = dq_mode == "atomic"
    dq_acc = torch.zeros((B, H, N, d), device=q.device, dtype=torch.float32) if atomic else dq  # fp32 sums
    mod_args = dict(SLOPES=mods.slopes, stride_sb=mods.stride_sb, H=H, diag_lo=diag_lo, cap=mods.cap,
                    alibi_diag=diag0 if mods.score_mod & 2 else 0, **mods.meta(), **dropout.meta())
    strides = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dq_acc))
    args = (q, k, v, do, lse2, delta, dk, dv, dq_acc, *strides, *_strides3(dk), *_strides3(dv),
            N, Nk, diag, qk_scale, sm_scale, group, Hkv)
    meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), DQ_ATOMIC=atomic, **mod_args)
    if config is None and interpreting():
        config = {"dkdv": _INTERPRETER_BWD_CONFIG, "dq": _INTERPRETER_BWD_CONFIG}
    if config is not None:
        cfg = config["dkdv"]
        _bwd_dkdv[(triton.cdiv(Nk, cfg["BLOCK_N"]), B * Hkv)](*args, **meta, **cfg, EVEN=_even(dict(N=N, Nk=Nk, **cfg)))
    else:
        _bwd_dkdv_tuned[_d_class(d)][lambda m: (triton.cdiv(Nk, m["BLOCK_N"]), B * Hkv)](*args, **meta)
    if atomic:
        if dq.is_contiguous():
            n = dq.numel()
            _cast_rows[(triton.cdiv(n, 1024),)](dq_acc, dq, n, BLOCK=1024)
        else:
            dq.copy_(dq_acc)
    else:
        dq_args = (q, k, v, do, lse2, delta, dq, *strides, N, Nk, diag, qk_scale, sm_scale, group)
        dq_meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), **mod_args)
        if config is not None:
            cfg = config["dq"]
            _bwd_dq[(triton.cdiv(N, cfg["BLOCK_M"]), B * H)](*dq_args, **dq_meta, **cfg,
                                                             EVEN=_even(dict(N=N, Nk=Nk, **cfg)))
        else:
            _bwd_dq_tuned[_d_class(d)][lambda m: (triton.cdiv(N, m["BLOCK_M"]), B * H)](*dq_args, **dq_meta)
    return dq, dk, dv


def flash_attn_bwd_triton(do, q, k, v, o, lse, causal=False, sm_scale=None, align="top_left", *,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                          dq_mode=None, config=None):
    """Gradients ``(dq, dk, dv)`` of O = attention(q, k, v) for the upstream gradient ``do``.

    q, o, do: [B, H, N, d]; k, v: [B, Hkv, Nk, d] (H a multiple of Hkv: grouped-query attention, query
    head h reads KV head h // (H // Hkv); dk, dv sum over each KV head's group inside the kernel), any d from 1 to
    256 and any strides with a unit stride along d, as in the forward (dq, dk, dv come out like q, k, v); lse:
    [B, H, N] float32 natural log, as returned by ``flash_attn_triton`` (-inf for a row that saw no key: its
    gradients are 0). ``causal``, ``align``, ``sm_scale``, ``window_size``, ``softcap``, ``alibi_slopes`` exactly as
    in the forward (softcap's gradient is dS * (1 - tanh^2); ALiBi's bias passes dS through; the slopes get no
    gradient). ``dropout_p`` and ``rng_state``: the forward's (the mask is regenerated from the same Philox
    counters: dV = (P Z)^T dO / (1 - p), dP = Z (dO V^T) / (1 - p), dS = P (dP - D) with D = rowsum(dO O) as
    without dropout). ``dq_mode``: "separate" (a dQ kernel; deterministic) or "atomic" (fp32 atomic adds from the
    dK/dV kernel); None = DEFAULT_DQ_MODE. ``config``: None autotunes; a dict {"dkdv": {BLOCK_M, BLOCK_N,
    num_warps, num_stages}, "dq": {...}} fixes the tiles.
    """
    B, H, Hkv, N, Nk, d = _check_bwd_inputs(q, k, v, causal, align)
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, B, q.device, both=True)
    dropout = _check_dropout_args(dropout_p, rng_state, draw=False)
    for name, x, shape in (("o", o, q.shape), ("do", do, q.shape)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must be a tensor of q's shape {tuple(shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, H, N) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be a float32 tensor of shape {(B, H, N)} (the forward's second output)")
    diag0 = (Nk - N) if align == "bottom_right" else 0
    return _flash_bwd(do, q, k, v, o, lse, mods, sm_scale, diag0, dq_mode=dq_mode, dropout=dropout, config=config)


class FlashAttentionFunction(torch.autograd.Function):
    """O = dropout(softmax(q k^T * sm_scale [+ mask, score mods])) v with the course's Triton forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, align, dq_mode, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_state=None):
        mods = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        drop = dict(dropout_p=dropout_p, rng_state=rng_state)
        if dropout_p > 0 and rng_state is None:  # drawn here, so that the backward regenerates the same mask
            drop["rng_state"] = draw_rng_state()
        o, lse = flash_attn_triton(q, k, v, causal=causal, sm_scale=sm_scale, align=align, **mods, **drop)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, sm_scale, align, dq_mode, mods, drop)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, sm_scale, align, dq_mode, mods, drop = ctx.args
        dq, dk, dv = flash_attn_bwd_triton(do, q, k, v, o, lse, causal, sm_scale, align, dq_mode=dq_mode, **mods,
                                           **drop)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def flash_attention(q, k, v, causal=False, sm_scale=None, align="top_left", *, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, rng_state=None, dq_mode=None):
    """Differentiable attention: q [B, H, N, d], k, v [B, Hkv, Nk, d] -> O [B, H, N, d] (q's dtype).

    The drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
    dropout_p=dropout_p)`` (``align="top_left"`` is SDPA's causal mask; "bottom_right" is the FlashAttention
    library's). H a multiple of Hkv: grouped-query attention (SDPA's ``enable_gqa=True``), with no copy of k and v
    in either pass. fp16/bf16 (and fp32) on a CUDA GPU; fp32/fp16 on the CPU under TRITON_INTERPRET=1. Any d from 1
    to 256 (d > 128 needs more shared memory than a T4's 64 KB: a clear error there); any strides with a unit
    stride along d (the library's [B, N, H, d] as a transposed view).

    ``window_size``, ``softcap``, ``alibi_slopes``: the FlashAttention library's (``flash_attn_func``), on the
    causal diagonal of ``align`` (see ``flash_attn_triton``): row i sees key j when i + diag - left <= j <=
    i + diag + right; softcap * tanh(s / softcap) on the scaled score, then s - slope[b, h] * |i + diag - j|
    (either or both). The slopes get no gradient. ``dropout_p``: the library's dropout on P (the mask drawn from
    torch's generator unless ``rng_state`` = (seed, offset) names it; the backward regenerates it).
    """
    B, H, _, _, _, _ = _check_bwd_inputs(q, k, v, causal, align)
    _check_mods(causal, window_size, softcap, alibi_slopes, H, B, q.device, both=True)
    _check_dropout_args(dropout_p, rng_state)
    return FlashAttentionFunction.apply(q, k, v, causal, sm_scale, align, dq_mode, window_size, softcap, alibi_slopes,
                                        dropout_p, rng_state)
