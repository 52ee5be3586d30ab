"""Block-sparse attention in Triton (lesson 12's GPU part): ``flash_attn_block_sparse_triton(q, k, v, block_mask,
score_mod=None, sm_scale=None) -> (O, lse)``.

A mask is one of a small fixed set, evaluated inside the kernel as a ``tl.constexpr`` variant (no code is
generated from Python functions): causal and sliding window with the FlashAttention library's
``window_size=(left, right)`` (bottom-right aligned, -1 unbounded), packed documents from a per-token id tensor,
prefix-LM. Every one of them lets query row ``i`` see one interval of keys, so the block index is computed exactly
from the rows' intervals, with tensor ops on the mask's device (no host sync), in FlexAttention's ``BlockMask``
layout (lesson 12's ``build_block_mask``): per Q block the partial KV blocks (``kv_num_blocks``, ``kv_indices``)
and the full ones (``full_kv_num_blocks``, ``full_kv_indices``), plus the transposed lists per KV block
(``q_num_blocks``, ``q_indices``, ...) that a backward's dK/dV kernel walks.

One program per (Q block, b * h), the last Q blocks launched first, visits the full KV blocks first (no mask),
then the partial ones (mask applied), with the online softmax of the dense forward (``m_i``, ``l_i``, ``acc``,
base 2); on sm_90 K and V come through TMA descriptors, and the launcher autotunes num_warps and num_stages for
the tile the block mask fixes. Score modifications are
``tl.constexpr`` switches on the scaled score ``s = q k^T * sm_scale``, applied before the mask and the running
max: softcap ``cap * tanh(s / cap)`` (Gemma 2) and ALiBi ``s - slope_h * |i + Nk - N - j|``. k, v may have fewer
heads than q (grouped-query attention). A row that sees no key gets O = 0 and lse = -inf.

The backward (``flash_attn_block_sparse``, an autograd Function) recomputes P from lse tile by tile: a dK/dV
kernel per KV block walks the transposed index (its full Q blocks, then its partial ones), a dQ kernel per Q block
the forward's; softcap's gradient is ``dS * (1 - tanh^2)``, ALiBi passes dS through.

References: Dong et al., "Flex Attention" (2024) and ``torch.nn.attention.flex_attention``; Dao, "FlashAttention-2"
(2023); the fused-attention tutorial of Triton. Written for this course.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .common import (LN2, LOG2E, SHAPES, TensorDescriptor, _check_alibi_slopes, _check_dense_kv, _check_qkv,
                     _check_window, _device_limits, _score_mod, fitting_configs, smem_estimate, tile_configs,
                     use_tma_for)

__all__ = ["MaskSpec", "full_mask", "causal_mask", "sliding_window_mask", "document_mask", "prefix_lm_mask",
           "SoftCap", "ALiBi", "BlockSparseMask", "build_block_mask_triton", "block_sparse_tiles",
           "flash_attn_block_sparse_triton", "flash_attn_block_sparse",
           "launch_configs_block_sparse", "bwd_configs"]

# the mask variants the kernel knows (its MASK constexpr)
_NONE, _WINDOW, _DOCUMENT, _PREFIX = 0, 1, 2, 3
_KINDS = {"none": _NONE, "window": _WINDOW, "document": _DOCUMENT, "prefix_lm": _PREFIX}
# the score modifications (its SCORE_MOD constexpr)
_MOD_NONE, _MOD_SOFTCAP, _MOD_ALIBI = 0, 1, 2


# ----------------------------------------------------------------------------
# Masks and score modifications: small descriptions the kernel reads as constexpr switches
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """Which keys each query row sees. ``kind``: "none", "window" (causal is the window (-1, 0)), "document",
    "prefix_lm". ``left``/``right``: the window, -1 unbounded, bottom-right aligned (query i sees keys
    i + Nk - N - left .. i + Nk - N + right); for a document mask only right = 0 (causal) or -1 is used.
    ``doc_ids``: int [N] or [B, N] (document mask); ``prefix``: the prefix-LM's bidirectional prefix."""
    kind: str
    left: int = -1
    right: int = -1
    doc_ids: torch.Tensor | None = None
    prefix: int = 0
    label: str = ""

    def __repr__(self):
        return self.label or self.kind


def full_mask() -> MaskSpec:
    """Every query sees every key."""
    return MaskSpec("none", label="full")


def causal_mask() -> MaskSpec:
    """The library's causal mask, bottom-right aligned: query i sees keys j <= i + Nk - N."""
    return MaskSpec("window", -1, 0, label="causal")


def sliding_window_mask(window_size=(-1, -1), causal: bool = False) -> MaskSpec:
    """``flash_attn_func(..., window_size=(left, right), causal=causal)``: query i sees keys
    ``i + Nk - N - left <= j <= i + Nk - N + right``; -1 is unbounded; causal sets right = 0."""
    left, right = _check_window(window_size)
    if causal:
        right = 0
    return MaskSpec("window", left, right, label=f"window({left}, {right})")


def document_mask(doc_ids, causal: bool = False) -> MaskSpec:
    """Packed documents: query i sees key j when both lie in one document, a maximal run of equal ids in
    ``doc_ids`` (int [N], or [B, N] per sequence of the batch), and j <= i if causal. Self-attention: N = Nk."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer torch.Tensor [N] or [B, N], got "
                        f"{type(doc_ids).__name__ if not isinstance(doc_ids, torch.Tensor) else doc_ids.dtype}")
    if doc_ids.dim() not in (1, 2) or doc_ids.shape[-1] == 0:
        raise ValueError(f"doc_ids must be [N] or [B, N] with N >= 1, got shape {tuple(doc_ids.shape)}")
    return MaskSpec("document", -1, 0 if causal else -1, doc_ids=doc_ids,
                    label=f"document{'(causal)' if causal else ''}")


def prefix_lm_mask(prefix: int) -> MaskSpec:
    """Prefix-LM: the first ``prefix`` tokens are seen by every query, the rest causally. Self-attention: N = Nk."""
    if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
        raise ValueError(f"prefix must be an int >= 0, got {prefix!r}")
    return MaskSpec("prefix_lm", prefix=prefix, label=f"prefix_lm({prefix})")


@dataclass(frozen=True, eq=False)
class SoftCap:
    """Gemma 2's softcapping of the scaled score: ``cap * tanh(s / cap)``, cap > 0."""
    cap: float


@dataclass(frozen=True, eq=False)
class ALiBi:
    """ALiBi as the library adds it: ``s - slopes[h] * |i + Nk - N - j|``; slopes [H] or [B, H] (float32 on q's device)."""
    slopes: torch.Tensor


# ----------------------------------------------------------------------------
# The block index, built on the device from the rows' key intervals
# ----------------------------------------------------------------------------


@dataclass(eq=False)
class BlockSparseMask:
    """FlexAttention's BlockMask layout with Bm = 1 or B, one head slot (the masks here do not depend on the
    head): ``kv_num_blocks`` int32 [Bm, 1, Tq], ``kv_indices`` [Bm, 1, Tq, Tk] (partial KV blocks first,
    ascending), ``full_kv_num_blocks`` / ``full_kv_indices`` (full ones); the transposed lists per KV block
    ``q_num_blocks`` [Bm, 1, Tk], ``q_indices`` [Bm, 1, Tk, Tq], ``full_q_num_blocks``, ``full_q_indices``;
    the tiles ``BLOCK_M`` x ``BLOCK_N``, the lengths ``N``, ``Nk``, the ``mask`` and ``doc`` (int32 [Bm, N], the
    first token of each token's document: what the kernel compares on partial tiles; None for other masks)."""
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    BLOCK_M: int
    BLOCK_N: int
    N: int
    Nk: int
    mask: MaskSpec
    doc: torch.Tensor | None = None

    def classes(self, b=0):
        """int64 [Tq, Tk] of sequence b: 0 skip, 1 full, 2 partial (lesson 12's SKIP, FULL, PARTIAL)."""
        Tq, Tk = self.kv_indices.shape[-2:]
        cls = torch.zeros(Tq, Tk, dtype=torch.int64, device=self.kv_indices.device)
        cols = torch.arange(Tk, device=cls.device)
        for num, idx, c in ((self.full_kv_num_blocks, self.full_kv_indices, 1), (self.kv_num_blocks, self.kv_indices, 2)):
            listed = cols[None, :] < num[b, 0][:, None].long()  # [Tq, Tk] the first num entries of each row
            cls.scatter_add_(1, idx[b, 0].long(), torch.where(listed, c, 0))
        return cls


def _row_intervals(mask: MaskSpec, N: int, Nk: int, device):
    """(lo, hi) int64 [Bm, N]: row i sees keys lo..hi inclusive (empty when lo > hi), and the document runs'
    first tokens (int32 [Bm, N], or None)."""
    i = torch.arange(N, device=device)[None, :]  # [1, N]
    off = Nk - N
    lo = torch.zeros_like(i)
    hi = torch.full_like(i, Nk - 1)
    doc = None
    if mask.kind in ("window", "document"):
        if mask.left >= 0:
            lo = torch.maximum(lo, i + off - mask.left)
        if mask.right >= 0:
            hi = torch.minimum(hi, i + off + mask.right)
    if mask.kind == "document":
        ids = mask.doc_ids.to(device)
        ids = ids[None, :] if ids.dim() == 1 else ids  # [Bm, N]
        Bm = ids.shape[0]
        idx = i.expand(Bm, N)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a document starts here
        last = torch.ones_like(ids, dtype=torch.bool)
        last[:, :-1] = new[:, 1:]  # a document ends here
        start = torch.where(new, idx, 0).cummax(1).values  # [Bm, N] first token of each token's document
        end = torch.where(last, idx, N - 1).flip(1).cummin(1).values.flip(1)  # [Bm, N] its last token
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, end)
        doc = start.to(torch.int32).contiguous()
    elif mask.kind == "prefix_lm":
        hi = torch.clamp(torch.maximum(i, torch.full_like(i, mask.prefix - 1)), max=Nk - 1)
    return lo, hi, doc


def _ordered(listed):
    """listed bool [..., T] -> (num int32 [...], indices int32 [..., T]): the listed blocks ascending, then the
    others ascending (create_block_mask's stable argsort; a kernel reads only the first num)."""
    num = listed.sum(-1).to(torch.int32)
    idx = torch.argsort((~listed).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _check_mask_spec(mask, N, Nk):
    if not isinstance(mask, MaskSpec):
        raise TypeError("mask must be a MaskSpec: full_mask(), causal_mask(), sliding_window_mask(...), "
                        f"document_mask(...) or prefix_lm_mask(...); got {type(mask).__name__}")
    if mask.kind not in _KINDS:
        raise ValueError(f"unknown mask kind {mask.kind!r}; expected one of {', '.join(_KINDS)}")
    if mask.kind in ("document", "prefix_lm") and N != Nk:
        raise ValueError(f"a {mask.kind} mask is for self-attention: N must equal Nk, got N = {N}, Nk = {Nk}")
    if mask.kind == "document" and mask.doc_ids.shape[-1] != N:
        raise ValueError(f"doc_ids has {mask.doc_ids.shape[-1]} tokens per sequence; the sequence has N = {N}")


def build_block_mask_triton(mask: MaskSpec, N: int, Nk: int, BLOCK_M: int, BLOCK_N: int, device=None):
    """The block index of ``mask`` for N queries and Nk keys in BLOCK_M x BLOCK_N tiles, built with tensor ops
    on ``device`` (default: the doc ids' device, else the CPU): a ``BlockSparseMask``. A ragged last block counts
    its padding as masked (never full), as in ``create_block_mask``."""
    _check_mask_spec(mask, N, Nk)
    for name, n in (("N", N), ("Nk", Nk)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    for name, b in (("BLOCK_M", BLOCK_M), ("BLOCK_N", BLOCK_N)):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a Triton tile), got {b!r}")
    if device is None:
        device = mask.doc_ids.device if mask.doc_ids is not None else "cpu"
    Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
    lo, hi, doc = _row_intervals(mask, N, Nk, device)  # [Bm or 1, N]
    Bm = lo.shape[0]
    pad = Tq * BLOCK_M - N  # padding rows see nothing
    lo = torch.nn.functional.pad(lo.expand(Bm, N), (0, pad), value=Nk)[..., None]  # [Bm, Tq*BLOCK_M, 1]
    hi = torch.nn.functional.pad(hi.expand(Bm, N), (0, pad), value=-1)[..., None]
    c0 = torch.arange(Tk, device=device) * BLOCK_N  # [Tk] first key of each KV block
    c1 = torch.clamp(c0 + BLOCK_N, max=Nk) - 1  # [Tk] its last real key
    some = ((lo <= c1) & (hi >= c0) & (lo <= hi)).view(Bm, Tq, BLOCK_M, Tk).any(2)  # [Bm, Tq, Tk]
    every = ((lo <= c0) & (hi >= c0 + BLOCK_N - 1)).view(Bm, Tq, BLOCK_M, Tk).all(2)  # [Bm, Tq, Tk]
    full = every & some
    partial = some & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(1, 2))
    fq_num, fq_idx = _ordered(full.transpose(1, 2))
    h1 = lambda t: t.unsqueeze(1).contiguous()  # noqa: E731  [Bm, 1, ...]: one head slot
    return BlockSparseMask(h1(kv_num), h1(kv_idx), h1(full_num), h1(full_idx), h1(q_num), h1(q_idx), h1(fq_num),
                           h1(fq_idx), BLOCK_M, BLOCK_N, N, Nk, mask, doc)


# ----------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------


@triton.jit
def _block_sparse_inner(
    acc, l_i, m_i, q,  # running state [BLOCK_M, D], [BLOCK_M], [BLOCK_M]; q [BLOCK_M, D]
    k_ptrs, v_ptrs, stride_kn, stride_vn,  # pointer path: tile of key/value rows at start_n = 0
    desc_k, desc_v, kv_row0,  # TMA path: 2-D descriptors over [B*Hkv*Nk, D]; this head's keys start at kv_row0
    idx_ptr, num,  # this Q block's list of KV blocks and how many to visit
    offs_m, offs_n, sm_scale, qk_scale, Nk, off, lo_w, hi_w, prefix, doc_q, doc_base, cap, slope,
    BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr,  # False: full tiles, every pair visible, no mask; True: the mask applied
    MASK: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Each block's index is loaded one iteration ahead and carried into the next (FlexAttention advances its
    # pointers the same way): the K/V loads of tile t then wait on no load of iteration t, so Triton's pipeliner
    # can issue them num_stages - 1 tiles early, as in the dense loop.
    nxt = tl.load(idx_ptr, mask=num > 0, other=0)
    for t in range(0, num):
        start_n = tl.multiple_of(nxt * BLOCK_N, BLOCK_N)
        nxt = tl.load(idx_ptr + t + 1, mask=t + 1 < num, other=0)  # the next block's index
        cols = start_n + offs_n  # [BLOCK_N]
        # -- load one tile of keys and values (a full tile is never ragged: no bounds check) --
        if USE_TMA:
            k = desc_k.load([kv_row0 + start_n, 0])  # [BLOCK_N, D]
            v = desc_v.load([kv_row0 + start_n, 0])  # [BLOCK_N, D]
            if PARTIAL:  # rows past Nk belong to the next head: masked scores, and zeroed values (p = 0 times a
                # NaN or inf there would still be NaN)
                v = tl.where((start_n + offs_n)[:, None] < Nk, v, 0.0)
        elif PARTIAL:
            in_range = cols[:, None] < Nk  # [BLOCK_N, 1]
            k = tl.load(k_ptrs + start_n * stride_kn, mask=in_range, other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptrs + start_n * stride_vn, mask=in_range, other=0.0)  # [BLOCK_N, D]
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)  # [BLOCK_N, D]
            v = tl.load(v_ptrs + start_n * stride_vn)  # [BLOCK_N, D]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        # -- the score modification, on the scaled score, before the mask and the running max --
        if SCORE_MOD == 0:
            s = qk  # scaled below (base 2), where the scale can fold into one fused multiply-add
        else:  # base 2; ALiBi's distance i + Nk - N - j
            s, _ = _score_mod(qk, offs_m[:, None], cols[None, :], sm_scale, cap, slope, off, SCORE_MOD)
        if PARTIAL:
            keep = cols[None, :] < Nk  # [1, BLOCK_N]
            if MASK == 1 or MASK == 2:  # window (causal included); a document's causal bound
                keep = keep & (cols[None, :] >= offs_m[:, None] + off - lo_w) & (cols[None, :] <= offs_m[:, None] + off + hi_w)
            if MASK == 2:
                doc_k = tl.load(doc_base + cols, mask=cols < Nk, other=-1)  # [BLOCK_N]
                keep = keep & (doc_q[:, None] == doc_k[None, :])
            if MASK == 3:
                keep = keep & ((cols[None, :] <= offs_m[:, None]) | (cols[None, :] < prefix))
            if SCORE_MOD == 0:
                s = s * qk_scale  # base 2
            s = tl.where(keep, s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            # A row with no key yet subtracts 0 (no NaN), but its running max stays -inf: were it set to 0, a
            # later key with a very negative score would give p = exp2(s - 0), which fp16 rounds or flushes to 0
            # in P V while l keeps it (FlashAttention's Check_inf also substitutes only in the subtraction).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        elif SCORE_MOD == 0:  # a full tile, raw scores: the max before scaling, then one FMA per score
            m_ij = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # [BLOCK_M]
            m_sub = m_ij
            p = tl.math.exp2(s * qk_scale - m_ij[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            m_ij = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            m_sub = m_ij
            p = tl.math.exp2(s - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        # -- online softmax: rescale what we had, add this tile --
        alpha = tl.math.exp2(m_i - m_sub)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)  # [BLOCK_M]
        acc = acc * alpha[:, None]  # [BLOCK_M, D]
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_block_sparse(
    Q, K, V, O, LSE,
    desc_k, desc_v,  # TMA descriptors over K, V viewed [B*Hkv*Nk, D] (USE_TMA), else unused
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, DOC, SLOPES,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_doc_b, stride_sb,  # batch strides of the block index, the doc runs, the slopes (0: shared)
    H, Hkv, N, Nk, Tk, lo_w, hi_w, prefix, sm_scale, qk_scale, cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,  # 0 none, 1 window (causal included), 2 document, 3 prefix-LM
    SCORE_MOD: tl.constexpr,  # 0 none, 1 softcap, 2 ALiBi
    USE_TMA: tl.constexpr,  # K, V tiles through the TMA (sm_90, d a power of two)
):
    # grid = (Tq, B * H); the last Q blocks first: under causal, window and prefix-LM masks they have the most
    # tiles, and a heavy block launched last would leave the GPU waiting on it
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
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

    row_ok = offs_m < N  # [BLOCK_M]
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    # this Q block's two lists (the mask's batch entry: stride_mb = 0 when one index serves the batch)
    row = off_b * stride_mb + start_m
    kv_num = tl.load(KV_NUM + row)
    full_num = tl.load(FULL_NUM + row)
    kv_idx = KV_IDX + row.to(tl.int64) * Tk
    full_idx = FULL_IDX + row.to(tl.int64) * Tk

    doc_base = DOC + off_b.to(tl.int64) * stride_doc_b
    doc_q = offs_m  # unused unless MASK == 2
    if MASK == 2:
        doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-2)  # [BLOCK_M]
    slope = 0.0
    if SCORE_MOD == 2:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h)
    off = Nk - N  # bottom-right alignment of the window and of ALiBi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running numerator
    acc, l_i, m_i = _block_sparse_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, full_idx, full_num,
        offs_m, offs_n, sm_scale, qk_scale, Nk, off, lo_w, hi_w, prefix, doc_q, doc_base, cap, slope,
        BLOCK_N, False, MASK, SCORE_MOD, USE_TMA,
    )
    acc, l_i, m_i = _block_sparse_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, desc_k, desc_v, kv_row0, kv_idx, kv_num,
        offs_m, offs_n, sm_scale, qk_scale, Nk, off, lo_w, hi_w, prefix, doc_q, doc_base, cap, slope,
        BLOCK_N, True, MASK, SCORE_MOD, USE_TMA,
    )

    # epilogue: normalise; a row that saw no key gets O = 0, lse = -inf
    empty = l_i == 0.0  # [BLOCK_M]
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]  # [BLOCK_M, D]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)  # [BLOCK_M] natural log
    tl.store(LSE + off_bh.to(tl.int64) * N + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------
# Backward: dK/dV over the transposed index, dQ over the forward's
# ----------------------------------------------------------------------------


@triton.jit
def _bwd_tile(q, k, v, do, lse2, delta, offs_m, cols, sm_scale, qk_scale, Nk, off, lo_w, hi_w, prefix, doc_q,
              doc_base, cap, slope,
              PARTIAL: tl.constexpr, MASK: tl.constexpr, SCORE_MOD: tl.constexpr):
    """One tile's P [BLOCK_M, BLOCK_N] (recomputed from lse) and dS [BLOCK_M, BLOCK_N], the gradient with
    respect to the scaled score s = q k^T * sm_scale (through the score modification)."""
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
    dmod = 1.0
    if SCORE_MOD == 0:
        s2 = qk * qk_scale  # base 2
    else:
        s2, dmod = _score_mod(qk, offs_m[:, None], cols[None, :], sm_scale, cap, slope, off, SCORE_MOD)
    p = tl.math.exp2(s2 - lse2[:, None])  # [BLOCK_M, BLOCK_N]; lse2 = +inf on rows that see nothing: p = 0
    if PARTIAL:
        keep = cols[None, :] < Nk
        if MASK == 1 or MASK == 2:
            keep = keep & (cols[None, :] >= offs_m[:, None] + off - lo_w) & (cols[None, :] <= offs_m[:, None] + off + hi_w)
        if MASK == 2:
            doc_k = tl.load(doc_base + cols, mask=cols < Nk, other=-1)
            keep = keep & (doc_q[:, None] == doc_k[None, :])
        if MASK == 3:
            keep = keep & ((cols[None, :] <= offs_m[:, None]) | (cols[None, :] < prefix))
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None]) * dmod  # [BLOCK_M, BLOCK_N]
    return p, ds


@triton.jit
def _bwd_dkdv_block_sparse(
    Q, K, V, DO, LSE2, DELTA, DK, DV,
    Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, DOC, SLOPES,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_mb, stride_doc_b, stride_sb,
    H, Hkv, N, Nk, Tq, lo_w, hi_w, prefix, sm_scale, qk_scale, cap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, SCORE_MOD: tl.constexpr,
):
    # grid = (Tk, B * H): one program per (KV block, query head); dK, dV per query head [B, H, Nk, d] (fp32),
    # summed over a GQA group by the launcher. q, dO are [B, H, N, d] like O; k, v [B, Hkv, Nk, d].
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // (H // Hkv)
    offs_m0 = tl.arange(0, BLOCK_M)
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols < Nk
    kv_off = off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    k = tl.load(K + kv_off + cols[:, None] * stride_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)  # [BLOCK_N, D]
    v = tl.load(V + kv_off + cols[:, None] * stride_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    q_off = off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    row = off_b * stride_mb + start_n
    doc_base = DOC + off_b.to(tl.int64) * stride_doc_b
    slope = 0.0
    if SCORE_MOD == 2:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h)
    off = Nk - N
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for which in tl.static_range(2):  # 0: the full Q blocks of this KV block, 1: the partial ones
        if which == 0:
            num = tl.load(FULL_Q_NUM + row)
            idx = FULL_Q_IDX + row.to(tl.int64) * Tq
        else:
            num = tl.load(Q_NUM + row)
            idx = Q_IDX + row.to(tl.int64) * Tq
        nxt = tl.load(idx, mask=num > 0, other=0)  # one block ahead, as in the forward
        for t in range(0, num):
            offs_m = nxt * BLOCK_M + offs_m0  # [BLOCK_M]
            nxt = tl.load(idx + t + 1, mask=t + 1 < num, other=0)
            row_ok = offs_m < N
            q = tl.load(Q + q_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + q_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE2 + off_bh.to(tl.int64) * N + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + off_bh.to(tl.int64) * N + offs_m, mask=row_ok, other=0.0)
            doc_q = offs_m
            if MASK == 2:
                doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-2)
            p, ds = _bwd_tile(q, k, v, do, lse2, delta, offs_m, cols, sm_scale, qk_scale, Nk, off, lo_w, hi_w,
                              prefix, doc_q, doc_base, cap, slope, which == 1, MASK, SCORE_MOD)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)  # [BLOCK_N, D]
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)  # [BLOCK_N, D]
    out = off_bh.to(tl.int64) * Nk * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, dk * sm_scale, mask=col_ok[:, None])
    tl.store(DV + out, dv, mask=col_ok[:, None])


@triton.jit
def _bwd_dq_block_sparse(
    Q, K, V, DO, LSE2, DELTA, DQ,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, DOC, SLOPES,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_mb, stride_doc_b, stride_sb,
    H, Hkv, N, Nk, Tk, lo_w, hi_w, prefix, sm_scale, qk_scale, cap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, SCORE_MOD: tl.constexpr,
):
    # grid = (Tq, B * H): one program per (Q block, head) walks the forward's lists
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // (H // Hkv)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    q_off = off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    kv_off = off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    q = tl.load(Q + q_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE2 + off_bh.to(tl.int64) * N + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + off_bh.to(tl.int64) * N + offs_m, mask=row_ok, other=0.0)
    doc_base = DOC + off_b.to(tl.int64) * stride_doc_b
    doc_q = offs_m
    if MASK == 2:
        doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-2)
    slope = 0.0
    if SCORE_MOD == 2:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h)
    off = Nk - N
    row = off_b * stride_mb + start_m
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for which in tl.static_range(2):  # 0: full KV blocks, 1: partial ones
        if which == 0:
            num = tl.load(FULL_NUM + row)
            idx = FULL_IDX + row.to(tl.int64) * Tk
        else:
            num = tl.load(KV_NUM + row)
            idx = KV_IDX + row.to(tl.int64) * Tk
        nxt = tl.load(idx, mask=num > 0, other=0)  # one block ahead, as in the forward
        for t in range(0, num):
            cols = nxt * BLOCK_N + offs_n  # [BLOCK_N]
            nxt = tl.load(idx + t + 1, mask=t + 1 < num, other=0)
            col_ok = cols < Nk
            k = tl.load(K + kv_off + cols[:, None] * stride_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(V + kv_off + cols[:, None] * stride_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            p, ds = _bwd_tile(q, k, v, do, lse2, delta, offs_m, cols, sm_scale, qk_scale, Nk, off, lo_w, hi_w,
                              prefix, doc_q, doc_base, cap, slope, which == 1, MASK, SCORE_MOD)
            dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D]
    tl.store(DQ + q_off + offs_m[:, None] * stride_qm + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# ----------------------------------------------------------------------------
# Configurations and the wrapper
# ----------------------------------------------------------------------------

_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
# (BLOCK_M, BLOCK_N, num_warps, num_stages). The block mask fixes the tile: block_sparse_tiles gives the first tile
# here that fits the GPU (the dense forward's winners on an H200, then smaller ones), and the forward autotunes
# num_warps and num_stages over the entries of that tile that fit; the backward takes the first.
_SHAPES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3),
           (64, 64, 4, 2)]
SHAPES["block_sparse"] = lambda d: tile_configs(_SHAPES)
# Shared memory: the dense forward's (Q on sm_90, num_stages K/V tiles in flight; the index and doc loads are
# scalars and vectors). common.smem_estimate knows the kernel as "fwd".
SMEM_KIND = "fwd"


def launch_configs_block_sparse(d, dtype, capability=None, smem=None):
    """The configurations the launcher may use for head dim d: every one (capability None), or those that fit
    a GPU of this (major, minor) with ``smem`` bytes of shared memory per block (before sm_80, the first)."""
    configs = SHAPES["block_sparse"](d)
    return configs if capability is None else fitting_configs(SMEM_KIND, configs, d, dtype, capability, smem)


def block_sparse_tiles(d: int, dtype=torch.float16, device=None, backward: bool = False):
    """(BLOCK_M, BLOCK_N) to build the block mask with, for head dim d on ``device``: 16 x 16 under the
    interpreter (or on the CPU), else the first configuration that fits the GPU (``backward``: the backward
    too; a ValueError where nothing does, as on a T4)."""
    device = torch.device(device) if device is not None else None
    if interpreting() or device is None or device.type != "cuda":
        return _INTERPRETER_CONFIG["BLOCK_M"], _INTERPRETER_CONFIG["BLOCK_N"]
    cap, smem = _device_limits(device)
    return _tiles_for(d, dtype, cap, smem, backward)


def _tiles_for(d, dtype, cap, smem, backward):
    configs = SHAPES["block_sparse"](d) if backward and cap >= (8, 0) else launch_configs_block_sparse(d, dtype, cap, smem)
    for cfg in configs:
        elt = torch.empty((), dtype=dtype).element_size()
        if smem_estimate(SMEM_KIND, cfg, d, elt, cap) > smem:
            continue
        if backward:
            try:
                bwd_configs(cfg, d, dtype, cap, smem)
            except ValueError:
                continue
        return cfg["BLOCK_M"], cfg["BLOCK_N"]
    raise ValueError(f"no tile of the block-sparse {'backward' if backward else 'forward'} fits this GPU's "
                     f"{smem // 1024} KB of shared memory at head dim {d} (sm_{cap[0]}{cap[1]})")


def _tile_configs(bm, bn, d, dtype, device):
    """The configurations of tile bm x bn that fit this GPU (the forward autotunes over them, the backward starts
    from the first); the interpreter's one on the CPU."""
    if interpreting() or device.type != "cuda":
        return [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)]
    cap, smem = _device_limits(device)
    try:
        fits = launch_configs_block_sparse(d, dtype, cap, smem)
    except ValueError:
        fits = []
    keep = [cfg for cfg in fits if (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (bm, bn)]
    if not keep:
        raise ValueError(f"no configuration of the block-sparse kernel runs {bm} x {bn} tiles at head dim {d} on "
                         f"this GPU (sm_{cap[0]}{cap[1]}); build the block mask with block_sparse_tiles(d, dtype, "
                         "device)")
    return keep


def _prune_to_tile(configs, nargs, **kwargs):
    """triton.autotune's early_config_prune: the (num_warps, num_stages) of this launch's tile that fit the GPU."""
    args = {**nargs, **kwargs}
    q = args["Q"]
    fits = {(c["num_warps"], c["num_stages"])
            for c in _tile_configs(args["BLOCK_M"], args["BLOCK_N"], args["HEAD_DIM"], q.dtype, q.device)}
    return [c for c in configs if (c.num_warps, c.num_stages) in fits]


_attn_fwd_block_sparse_tuned = triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=st) for w, st in sorted({(w, st) for *_, w, st in _SHAPES})],
    key=["N", "Nk", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "MASK", "SCORE_MOD", "USE_TMA"],
    prune_configs_by={"early_config_prune": _prune_to_tile},
)(_attn_fwd_block_sparse)


def bwd_configs(cfg, d, dtype, capability, smem):
    """The backward's launch options for the forward's tile ``cfg``: num_stages 2, when both backward kernels fit
    (common.smem_estimate's "dkdv" and "dq"; no atomics), as a dict. (At num_stages 1 Triton stages the transposed
    tiles in shared memory instead, more than the estimate says: not offered.)"""
    elt = torch.empty((), dtype=dtype).element_size()
    for stages in (2,):
        c = dict(cfg, num_stages=stages)
        if max(smem_estimate("dkdv", c, d, elt, capability), smem_estimate("dq", c, d, elt, capability)) <= smem:
            return c
    raise ValueError(f"the block-sparse backward does not fit {cfg['BLOCK_M']} x {cfg['BLOCK_N']} tiles at head dim "
                     f"{d} in this GPU's {smem // 1024} KB of shared memory (sm_{capability[0]}{capability[1]}): "
                     "build the block mask with block_sparse_tiles(d, dtype, device, backward=True)")


def _bwd_config(cfg, d, dtype, device):
    if interpreting() or device.type != "cuda":
        return dict(cfg)
    cap, smem = _device_limits(device)
    return bwd_configs(cfg, d, dtype, cap, smem)


def _check_block_mask(bm, B, N, Nk, device):
    if not isinstance(bm, BlockSparseMask):
        raise TypeError(f"block_mask must be a BlockSparseMask from build_block_mask_triton, got {type(bm).__name__}")
    if (bm.N, bm.Nk) != (N, Nk):
        raise ValueError(f"block_mask was built for N = {bm.N}, Nk = {bm.Nk}; q and k have N = {N}, Nk = {Nk}")
    if bm.kv_num_blocks.device != device:
        raise ValueError(f"block_mask is on {bm.kv_num_blocks.device}, q on {device}: build it on q's device")
    Bm = bm.kv_num_blocks.shape[0]
    if Bm not in (1, B):
        raise ValueError(f"block_mask is for a batch of {Bm}; q's batch is {B}")
    Tq, Tk = -(-N // bm.BLOCK_M), -(-Nk // bm.BLOCK_N)
    if tuple(bm.kv_indices.shape) != (Bm, 1, Tq, Tk) or tuple(bm.full_kv_indices.shape) != (Bm, 1, Tq, Tk):
        raise ValueError(f"block_mask's kv_indices must be [{Bm}, 1, {Tq}, {Tk}], got {tuple(bm.kv_indices.shape)}")
    return Bm, Tq, Tk


def _score_mod_args(score_mod, B, H, device):
    """(SCORE_MOD, cap, slopes tensor or None, slopes' batch stride)."""
    if score_mod is None:
        return _MOD_NONE, 1.0, None, 0
    if isinstance(score_mod, SoftCap):
        cap = score_mod.cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"softcap's cap must be a finite number > 0, got {cap!r}")
        return _MOD_SOFTCAP, float(cap), None, 0
    if isinstance(score_mod, ALiBi):
        s = _check_alibi_slopes(score_mod.slopes, B, H, device, name="ALiBi slopes")
        return _MOD_ALIBI, 1.0, s, (H if s.dim() == 2 else 0)
    raise TypeError(f"score_mod must be None, SoftCap(cap) or ALiBi(slopes); got {type(score_mod).__name__} "
                    "(arbitrary Python score_mods are FlexAttention's: this kernel has a fixed set)")


def _prepare(q, k, v, block_mask, score_mod, sm_scale):
    """Every check and every scalar the three kernels share, as a namespace-like dict."""
    _check_qkv(q, k, v, (4, 4, 4))
    B, H, N, d = q.shape
    Hkv, Nk = _check_dense_kv(q, k, v)
    if N == 0 or Nk == 0 or B == 0 or H == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    Bm, Tq, Tk = _check_block_mask(block_mask, B, N, Nk, q.device)
    mod, cap, slopes, stride_sb = _score_mod_args(score_mod, B, H, q.device)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    mask = block_mask.mask
    kind = _KINDS[mask.kind]
    big = N + Nk + 1  # "unbounded": further than any key
    doc = block_mask.doc
    if kind == _DOCUMENT and doc.shape[0] not in (1, B):
        raise ValueError(f"the document mask has {doc.shape[0]} sequences; q's batch is {B}")
    cfgs = _tile_configs(block_mask.BLOCK_M, block_mask.BLOCK_N, d, q.dtype, q.device)
    use_tma = (not interpreting() and q.device.type == "cuda"
               and use_tma_for(_device_limits(q.device)[0], q.dtype, d))
    return dict(B=B, H=H, Hkv=Hkv, N=N, Nk=Nk, d=d, Bm=Bm, Tq=Tq, Tk=Tk, MASK=kind, SCORE_MOD=mod, cap=cap,
                slopes=slopes if slopes is not None else torch.empty(1, device=q.device),
                stride_sb=stride_sb, sm_scale=float(sm_scale), qk_scale=float(sm_scale) * LOG2E.value,
                lo_w=mask.left if mask.left >= 0 else big, hi_w=mask.right if mask.right >= 0 else big,
                prefix=mask.prefix, doc=doc if doc is not None else block_mask.kv_num_blocks,
                stride_doc_b=N if doc is not None and doc.shape[0] > 1 else 0,
                stride_mb=Tq if Bm > 1 else 0, stride_mb_t=Tk if Bm > 1 else 0, cfg=cfgs[0],
                tune=len(cfgs) > 1, use_tma=use_tma)


def _forward(q, k, v, block_mask, a):
    o = torch.empty_like(q)  # [B, H, N, d]
    lse = torch.empty((a["B"], a["H"], a["N"]), device=q.device, dtype=torch.float32)  # [B, H, N]
    bm, B, Hkv, Nk, d = block_mask, a["B"], a["Hkv"], a["Nk"], a["d"]
    desc_k = desc_v = None
    if a["use_tma"]:
        desc_k = TensorDescriptor.from_tensor(k.view(B * Hkv * Nk, d), [bm.BLOCK_N, d])  # [B*Hkv*Nk, d]
        desc_v = TensorDescriptor.from_tensor(v.view(B * Hkv * Nk, d), [bm.BLOCK_N, d])
    args = (
        q, k, v, o, lse, desc_k, desc_v,
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, a["doc"], a["slopes"],
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        a["stride_mb"], a["stride_doc_b"], a["stride_sb"],
        a["H"], Hkv, a["N"], Nk, a["Tk"], a["lo_w"], a["hi_w"], a["prefix"], a["sm_scale"], a["qk_scale"], a["cap"],
    )
    meta = dict(HEAD_DIM=d, BLOCK_M=bm.BLOCK_M, BLOCK_N=bm.BLOCK_N, MASK=a["MASK"], SCORE_MOD=a["SCORE_MOD"],
                USE_TMA=a["use_tma"])
    grid = (a["Tq"], B * a["H"])
    if a["tune"]:
        _attn_fwd_block_sparse_tuned[grid](*args, **meta)
    else:
        cfg = a["cfg"]
        _attn_fwd_block_sparse[grid](*args, **meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o, lse


def flash_attn_block_sparse_triton(q, k, v, block_mask, score_mod=None, sm_scale=None):
    """Block-sparse attention forward: returns ``(O, lse)``.

    q: [B, H, N, d]; k, v: [B, Hkv, Nk, d] (H a multiple of Hkv: grouped-query attention). ``block_mask``: a
    ``BlockSparseMask`` from ``build_block_mask_triton(mask, N, Nk, BLOCK_M, BLOCK_N, device=q.device)``, its
    tiles from ``block_sparse_tiles(d, dtype, device)`` (16 x 16 under the interpreter); its batch 1 (shared) or
    B (a document mask per sequence). ``score_mod``: None, ``SoftCap(cap)`` or ``ALiBi(slopes)``, applied to the
    scaled score before the mask. O: [B, H, N, d] in q's dtype; lse: [B, H, N] float32, natural log, -inf for a
    row that sees no key (its O is 0). sm_scale defaults to 1/sqrt(d). No gradient: ``flash_attn_block_sparse``
    is the differentiable one."""
    return _forward(q, k, v, block_mask, _prepare(q, k, v, block_mask, score_mod, sm_scale))


def _backward(q, k, v, o, lse, do, block_mask, a):
    """(dq, dk, dv): delta = rowsum(dO * O) in torch, then the dK/dV kernel per query head over the transposed
    lists (summed over each GQA group here) and the dQ kernel over the forward's."""
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1)  # [B, H, N]
    lse2 = torch.where(torch.isneginf(lse), float("inf"), lse * LOG2E.value)  # base 2; +inf: the row's P is 0
    B, H, Hkv, N, Nk, d = a["B"], a["H"], a["Hkv"], a["N"], a["Nk"], a["d"]
    dk = torch.empty(B, H, Nk, d, device=q.device, dtype=torch.float32)  # per query head
    dv = torch.empty_like(dk)
    dq = torch.empty_like(q)
    bm, cfg = block_mask, _bwd_config(a["cfg"], d, q.dtype, q.device)
    common = (a["doc"], a["slopes"], q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    _bwd_dkdv_block_sparse[(a["Tk"], B * H)](
        q, k, v, do, lse2, delta, dk, dv, bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices,
        *common, a["stride_mb_t"], a["stride_doc_b"], a["stride_sb"],
        H, Hkv, N, Nk, a["Tq"], a["lo_w"], a["hi_w"], a["prefix"], a["sm_scale"], a["qk_scale"], a["cap"],
        HEAD_DIM=d, MASK=a["MASK"], SCORE_MOD=a["SCORE_MOD"], **cfg)
    _bwd_dq_block_sparse[(a["Tq"], B * H)](
        q, k, v, do, lse2, delta, dq, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
        *common, a["stride_mb"], a["stride_doc_b"], a["stride_sb"],
        H, Hkv, N, Nk, a["Tk"], a["lo_w"], a["hi_w"], a["prefix"], a["sm_scale"], a["qk_scale"], a["cap"],
        HEAD_DIM=d, MASK=a["MASK"], SCORE_MOD=a["SCORE_MOD"], **cfg)
    g = H // Hkv
    dk = dk.view(B, Hkv, g, Nk, d).sum(2).to(k.dtype)
    dv = dv.view(B, Hkv, g, Nk, d).sum(2).to(v.dtype)
    return dq, dk, dv


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_mask, score_mod, sm_scale):
        a = _prepare(q, k, v, block_mask, score_mod, sm_scale)
        o, lse = _forward(q, k, v, block_mask, a)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.block_mask, ctx.a = block_mask, a
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.block_mask, ctx.a)
        return dq, dk, dv, None, None, None


def flash_attn_block_sparse(q, k, v, block_mask, score_mod=None, sm_scale=None):
    """``flash_attn_block_sparse_triton`` with a backward (autograd): returns ``(O, lse)``; gradients flow to
    q, k and v through O (lse is not differentiable). Softcap's gradient is dS * (1 - tanh^2); ALiBi's bias passes
    dS through; the slopes get no gradient."""
    return _BlockSparseAttention.apply(q, k, v, block_mask, score_mod, sm_scale)
