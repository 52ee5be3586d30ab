"""The FlashAttention library's public interface over the course's kernels: a drop-in for ``flash_attn``.

    from helpers.kernels.interface import flash_attn_func      # in place of: from flash_attn import flash_attn_func

The seven functions of ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention), with its names,
argument order, defaults, layouts and return values:

* ``flash_attn_func(q, k, v, ...)``, q ``[B, N, H, d]``, k, v ``[B, Nk, Hkv, d]``; ``flash_attn_kvpacked_func``
  (kv ``[B, Nk, 2, Hkv, d]``) and ``flash_attn_qkvpacked_func`` (qkv ``[B, N, 3, H, d]``). Differentiable.
* ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``, q
  ``[total_q, H, d]``, k, v ``[total_k, Hkv, d]``; its kvpacked (kv ``[total_k, 2, Hkv, d]``) and qkvpacked (qkv
  ``[total, 3, H, d]``) forms. Differentiable.
* ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ...)``: decoding against a contiguous or paged
  cache, the new keys and values written into it in place, rotary embeddings applied to them and to q.

Returns as the library's: ``out``, or with ``return_attn_probs=True`` ``(out, softmax_lse, S_dmask)`` (lse
``[B, H, N]``, packed ``[H, total_q]``, natural log; S_dmask None without dropout, else the probabilities
``[B, H, N, Nk]`` with the dropped entries negated, a tensor for tests, as the library says of its own).

How the names map onto the kernels: the dense forms run ``forward._flash_fwd`` and ``backward._flash_bwd`` on
transposed views of the library's ``[B, N, H, d]`` (the kernels take any strides with a unit stride along d, so q, k
and v are read in place, K and V through TMA where the GPU has it) and write O into a ``[B, N, H, d]`` tensor, the
gradients of the packed forms into views of one packed gradient (nothing is concatenated). The packed ones run the
varlen kernels through their public functions (``prepare_varlen``, ``flash_attn_varlen_triton``,
``flash_attn_varlen_bwd_triton``): one ``VarlenBatch`` per batch, kept while the same cu_seqlens tensors come back
unchanged (every layer of a step), so cu_seqlens is copied to the host once per batch. ``flash_attn_with_kvcache``
runs ``kvcache.flash_attn_with_kvcache_triton``. Each option the kernels have is passed through: causal
(bottom-right, as the library), window_size, softcap and ALiBi (together too), dropout (Philox, reproducible under
``torch.manual_seed``, the backward regenerating the forward's mask; packed, sequence b's mask is the dense mask of
batch entry b), any head dim from 1 to 256, GQA/MQA, N != Nk; in ``flash_attn_varlen_func``, ``block_table``
(paged K/V, forward only as the library's: the output carries no gradient). ``deterministic``: the course's
backward is deterministic already (no atomics for dQ by default); True pins it.

What is refused, with a message that says so (``NotImplementedError``): in ``flash_attn_with_kvcache``,
``cache_leftpad``, ``return_softmax_lse`` and ``cache_batch_idx`` over a contiguous cache whose length is not a
multiple of 16. Nothing is copied: the varlen forms hand the kernels their q, k, v (the packed kv[:, 0], qkv[:, 1]
views too) with their strides, and autograd gathers the packed forms' gradients.

Written for this course.
"""

import torch

from .backward import DEFAULT_DQ_MODE, _check_bwd_inputs, _flash_bwd
from .common import _check_qkv
from .forward import _check_dropout_args, _check_mods, _flash_fwd, dropout_keep_mask
from .kvcache import flash_attn_with_kvcache_triton
from .varlen import VarlenBatch, prepare_varlen, flash_attn_varlen_triton
from .varlen_backward import flash_attn_varlen_bwd_triton

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


# ----------------------------------------------------------------------------
# Dense: [B, N, H, d] as transposed views of the kernels' [B, H, N, d]
# ----------------------------------------------------------------------------


def _t(x):
    """[B, N, H, d] <-> [B, H, N, d], a view."""
    return x.transpose(1, 2)


def _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_softmax):
    """The forward of the three dense forms on [B, N, H, d] views; saves what the backward needs in ctx. Returns
    out [B, N, H, d] (contiguous), or (out, lse, S_dmask) when return_softmax."""
    qt, kt, vt = _t(q), _t(k), _t(v)  # [B, H, N, d], [B, Hkv, Nk, d]: views
    B, H, Hkv, N, Nk, d = _check_bwd_inputs(qt, kt, vt, causal, "bottom_right")
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, B, q.device, both=True)
    dropout = _check_dropout_args(dropout_p, None)  # a fresh (seed, offset) from torch's generator
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty((B, N, H, d), device=q.device, dtype=q.dtype)  # the library's layout, contiguous
    _, lse = _flash_fwd(qt, kt, vt, mods, scale, Nk - N, o=_t(out), dropout=dropout)  # bottom-right diagonal
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (mods, scale, Nk - N, "separate" if deterministic else DEFAULT_DQ_MODE, dropout)
    if not return_softmax:
        return out
    ctx.mark_non_differentiable(lse)
    probs = _attn_probs(qt, kt, lse, mods, scale, Nk - N, dropout) if dropout.p > 0 else None
    return out, lse, probs


def _dense_backward(ctx, dout, dq=None, dk=None, dv=None):
    """The backward of the dense forms: fills dq, dk, dv ([B, N, H, d] tensors or views; None allocates them)."""
    q, k, v, out, lse = ctx.saved_tensors
    mods, scale, diag0, dq_mode, dropout = ctx.args
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    _flash_bwd(_t(dout), _t(q), _t(k), _t(v), _t(out), lse, mods, scale, diag0, dq_mode=dq_mode, dropout=dropout,
               dq=_t(dq), dk=_t(dk), dv=_t(dv))
    return dq, dk, dv


def _attn_probs(qt, kt, lse, mods, scale, diag0, dropout):
    """The library's S_dmask, for tests: the probabilities P [B, H, N, Nk] (q's dtype) the kernel normalised by its
    lse, each dropped entry negated. Materialises the N x Nk scores, as the library's own does."""
    B, H, N, d = qt.shape
    Hkv, Nk = kt.shape[1], kt.shape[2]
    s = qt.float() @ kt.float().repeat_interleave(H // Hkv, 1).transpose(-1, -2) * scale  # [B, H, N, Nk]
    i = torch.arange(N, device=qt.device)[:, None]
    j = torch.arange(Nk, device=qt.device)[None, :]
    if mods.score_mod & 1:
        s = mods.cap * torch.tanh(s / mods.cap)
    if mods.score_mod & 2:
        s = s - mods.slopes.expand(B, H)[:, :, None, None] * (i + diag0 - j).abs()
    keep = torch.ones(N, Nk, dtype=torch.bool, device=qt.device)
    if mods.right >= 0:
        keep &= j <= i + diag0 + mods.right
    if mods.left >= 0:
        keep &= j >= i + diag0 - mods.left
    p = torch.exp(s - lse[..., None]).masked_fill(~keep, 0.0).nan_to_num(0.0)  # [B, H, N, Nk]
    kept = dropout_keep_mask(B, H, N, Nk, dropout.p, (dropout.seed, dropout.offset), qt.device)
    return torch.where(kept, p, -p).to(qt.dtype)


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax):
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        dq, dk, dv = _dense_backward(ctx, dout)
        return dq, dk, dv, None, None, None, None, None, None, None, None


class _FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax):
        _check_packed("kv", kv, 5, 2)
        ctx.kv_like = kv
        return _dense_forward(ctx, q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                              softcap, alibi_slopes, deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        dkv = _packed_grad(ctx.kv_like)  # [B, Nk, 2, Hkv, d]: dk and dv written into its halves
        ctx.kv_like = None
        dq, _, _ = _dense_backward(ctx, dout, dk=dkv[:, :, 0], dv=dkv[:, :, 1])
        return dq, dkv, None, None, None, None, None, None, None, None


class _FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax):
        _check_packed("qkv", qkv, 5, 3)
        ctx.qkv_like = qkv
        return _dense_forward(ctx, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                              window_size, softcap, alibi_slopes, deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        dqkv = _packed_grad(ctx.qkv_like)  # [B, N, 3, H, d]
        ctx.qkv_like = None
        _dense_backward(ctx, dout, dq=dqkv[:, :, 0], dk=dqkv[:, :, 1], dv=dqkv[:, :, 2])
        return dqkv, None, None, None, None, None, None, None, None


def _check_packed(name, x, ndim, parts):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim or x.shape[-3] != parts:
        shape = "[B, N, 3, H, d]" if parts == 3 else "[B, Nk, 2, Hkv, d]"
        if ndim == 4:
            shape = "[total, 3, H, d]" if parts == 3 else "[total_k, 2, Hkv, d]"
        raise ValueError(f"{name} must be {shape}, got shape {tuple(x.shape)}")


def _packed_grad(x):
    """An empty gradient for the packed tensor x, in x's layout where x is dense (its halves or thirds are then views
    with the strides of x's parts), else contiguous."""
    return torch.empty_like(x)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """The library's ``flash_attn_qkvpacked_func``: qkv [B, N, 3, H, d] -> out [B, N, H, d] (differentiable; the
    gradient dqkv written as one tensor, nothing concatenated). See ``flash_attn_func`` for the options."""
    return _FlashAttnQKVPackedFunc.apply(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                         deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """The library's ``flash_attn_kvpacked_func``: q [B, N, H, d], kv [B, Nk, 2, Hkv, d] -> out [B, N, H, d]
    (differentiable; dkv written as one tensor). See ``flash_attn_func`` for the options."""
    return _FlashAttnKVPackedFunc.apply(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        deterministic, return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """The library's ``flash_attn_func`` on the course's kernels: q [B, N, H, d], k, v [B, Nk, Hkv, d] (H a multiple
    of Hkv: GQA/MQA, query heads h * G .. h * G + G - 1 read KV head h), any d from 1 to 256 -> out [B, N, H, d].

    causal: bottom-right (query i sees keys j <= i + Nk - N; a row that sees none gets out = 0). window_size
    (left, right): query i sees keys i + Nk - N - left <= j <= i + Nk - N + right (-1: unbounded). softcap > 0:
    s = softcap * tanh(s / softcap) on the scaled score. alibi_slopes float32 [H] or [B, H]: s -= slope *
    |i + Nk - N - j| (with softcap too: the cap first). dropout_p: P's entries dropped with that probability after
    the softmax, the kept ones scaled by 1 / (1 - p), the mask drawn from torch's generator (reproducible under
    ``torch.manual_seed``) and regenerated by the backward. softmax_scale: 1 / sqrt(d) by default.
    deterministic: the backward is deterministic either way here (True pins it). return_attn_probs: also the lse
    [B, H, N] and S_dmask (None without dropout; else P [B, H, N, Nk] with the dropped entries negated).
    """
    return _FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs)


# ----------------------------------------------------------------------------
# Varlen: the packed layout through the varlen kernels' public functions
# ----------------------------------------------------------------------------


_last_batch = []  # [(cu_seqlens_q, cu_seqlens_k, (their versions, max_seqlen_q, max_seqlen_k, device), batch)]


def _batch_for(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device):
    """The ``VarlenBatch`` of the library's four layout arguments: prepared once (one copy of cu_seqlens to the
    host) and kept while the same tensors, unchanged (their version counter), come back, as every layer of a step
    passes them; a ``VarlenBatch`` in place of cu_seqlens_q is taken as it is."""
    if isinstance(cu_seqlens_q, VarlenBatch):
        if cu_seqlens_k is not None or max_seqlen_q is not None or max_seqlen_k is not None:
            raise TypeError("with a VarlenBatch in place of cu_seqlens_q, pass None for cu_seqlens_k, max_seqlen_q "
                            "and max_seqlen_k: the batch holds them")
        return cu_seqlens_q
    versions = (getattr(cu_seqlens_q, "_version", None), getattr(cu_seqlens_k, "_version", None),
                max_seqlen_q, max_seqlen_k, device)
    if _last_batch:
        cu_q, cu_k, old_versions, batch = _last_batch[0]
        if cu_q is cu_seqlens_q and cu_k is cu_seqlens_k and old_versions == versions:
            return batch
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (int32 [B + 1]), got {type(cu).__name__}")
        if cu.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    batch = prepare_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device=device)
    _last_batch[:] = [(cu_seqlens_q, cu_seqlens_k, versions, batch)]  # holding them: their ids are not reused
    return batch


def _varlen_attn_probs(q, k, lse, batch, mods, scale, dropout):
    """The varlen forms' S_dmask, for tests: [B, H, max_seqlen_q, max_seqlen_k] in q's dtype, sequence b's
    probabilities (normalised by the kernel's lse) in its top-left [len_q, len_k] corner, each dropped entry negated,
    zeros elsewhere (the library pads its own to rounded lengths). The mask is the kernels': sequence b's is the dense
    mask of batch entry b (``dropout_keep_mask`` with B = num_seqs)."""
    B, H, G = batch.num_seqs, q.shape[1], q.shape[1] // k.shape[1]
    Mq, Mk = batch.max_seqlen_q, batch.max_seqlen_k
    cu_q, cu_k = (c.tolist() for c in batch._cu_host)  # host values: nothing read back
    kept = dropout_keep_mask(B, H, Mq, Mk, dropout.p, (dropout.seed, dropout.offset), q.device)
    probs = torch.zeros((B, H, Mq, Mk), device=q.device, dtype=torch.float32)
    for b in range(B):
        n, nk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if n == 0 or nk == 0:
            continue
        qb = q[cu_q[b]:cu_q[b + 1]].float().transpose(0, 1)  # [H, n, d]
        kb = k[cu_k[b]:cu_k[b + 1]].float().repeat_interleave(G, 1).transpose(0, 1)  # [H, nk, d]
        s = qb @ kb.transpose(-1, -2) * scale  # [H, n, nk]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        diag0 = nk - n
        if mods.score_mod & 1:
            s = mods.cap * torch.tanh(s / mods.cap)
        if mods.score_mod & 2:
            slope = mods.slopes[b] if mods.slopes.dim() == 2 else mods.slopes  # [H]
            s = s - slope[:, None, None] * (i + diag0 - j).abs()
        seen = torch.ones(n, nk, dtype=torch.bool, device=q.device)
        if mods.right >= 0:
            seen &= j <= i + diag0 + mods.right
        if mods.left >= 0:
            seen &= j >= i + diag0 - mods.left
        p = torch.exp(s - lse[:, cu_q[b]:cu_q[b + 1], None]).masked_fill(~seen, 0.0).nan_to_num(0.0)
        probs[b, :, :n, :nk] = p
    return torch.where(kept, probs, -probs).to(q.dtype)


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, batch, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                return_softmax):
        d = q.shape[-1]
        scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
        dropout = _check_dropout_args(dropout_p, None)  # a fresh (seed, offset) from torch's generator
        mods = dict(causal=causal, sm_scale=scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout.p, rng_state=(dropout.seed, dropout.offset))
        o, lse = flash_attn_varlen_triton(q, k, v, batch, **mods)  # [total_q, H, d], [H, total_q]; q, k, v in place
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (batch, mods)
        if not return_softmax:
            return o
        ctx.mark_non_differentiable(lse)
        probs = None
        if dropout.p > 0:
            checked = _check_mods(causal, window_size, softcap, alibi_slopes, q.shape[1], batch.num_seqs, q.device,
                                  "num_seqs", both=True)
            probs = _varlen_attn_probs(q, k, lse, batch, checked, scale, dropout)
        return o, lse, probs

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, o, lse = ctx.saved_tensors
        batch, mods = ctx.args
        dq, dk, dv = flash_attn_varlen_bwd_triton(dout, q, k, v, o, lse, batch, **mods)  # q, k, v in place
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _varlen_paged(q, k, v, batch, block_table, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, return_softmax):
    """flash_attn_varlen_func with block_table: k, v pages [num_blocks, page_block_size, Hkv, d], sequence b's key
    j in page block_table[b, j // page_block_size]. Forward only, as the library's (its paged varlen has no
    backward): the output carries no gradient."""
    d = q.shape[-1]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    dropout = _check_dropout_args(dropout_p, None)
    with torch.no_grad():
        qc = q.detach()
        o, lse = flash_attn_varlen_triton(qc, k.detach(), v.detach(), batch, causal=causal, sm_scale=scale,
                                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                          dropout_p=dropout.p, rng_state=(dropout.seed, dropout.offset),
                                          block_table=block_table)
        if not return_softmax:
            return o
        probs = None
        if dropout.p > 0:  # for tests: the pages gathered into packed keys (one host copy of the table)
            table = block_table.tolist()
            lens = batch.lengths_k.tolist()
            kp = torch.cat([k[table[b]].flatten(0, 1)[:n] for b, n in enumerate(lens)])  # [total_k, Hkv, d]
            checked = _check_mods(causal, window_size, softcap, alibi_slopes, q.shape[1], batch.num_seqs, q.device,
                                  "num_seqs", both=True)
            probs = _varlen_attn_probs(qc, kp, lse, batch, checked, scale, dropout)
        return o, lse, probs


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table):
    """The varlen forms' common path: the refusals, the inputs' checks, the batch, the autograd Function (the
    packed forms pass their kv or qkv views; autograd gathers the gradients into the packed tensor)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    _check_qkv(q, k, v, (3, 4, 4) if block_table is not None else (3, 3, 3), strided=True)
    batch = _batch_for(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
    if block_table is not None:
        return _varlen_paged(q, k, v, batch, block_table, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, return_attn_probs)
    return _FlashAttnVarlenFunc.apply(q, k, v, batch, dropout_p, softmax_scale, causal, window_size, softcap,
                                      alibi_slopes, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """The library's ``flash_attn_varlen_qkvpacked_func``: qkv [total, 3, H, d], cu_seqlens int32 [B + 1] ->
    out [total, H, d] (differentiable). See ``flash_attn_varlen_func``."""
    _check_packed("qkv", qkv, 4, 3)
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """The library's ``flash_attn_varlen_kvpacked_func``: q [total_q, H, d], kv [total_k, 2, Hkv, d] ->
    out [total_q, H, d] (differentiable). See ``flash_attn_varlen_func``."""
    _check_packed("kv", kv, 4, 2)
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """The library's ``flash_attn_varlen_func``: q [total_q, H, d], k, v [total_k, Hkv, d], cu_seqlens_q and
    cu_seqlens_k int32 [B + 1] (0, then the cumulative lengths), max_seqlen_q, max_seqlen_k the longest lengths ->
    out [total_q, H, d] (differentiable). causal, window_size and ALiBi ([H] or [B, H]) bottom-right per sequence;
    softcap (with ALiBi too); dropout_p as in ``flash_attn_func`` (sequence b's mask the dense one of batch entry
    b); any d from 1 to 256. return_attn_probs adds the lse [H, total_q] and S_dmask (None without dropout; else
    [B, H, max_seqlen_q, max_seqlen_k], sequence b's P in its top-left corner, dropped entries negated).
    block_table int32 [B, max_blocks]: k, v are pages [num_blocks, page_block_size, Hkv, d] (any page size here),
    sequence b's key j in page block_table[b, j // page_block_size]; forward only, as the library's. A
    ``VarlenBatch`` (``prepare_varlen``) may stand in place of cu_seqlens_q, with None for the next three.
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)


# ----------------------------------------------------------------------------
# The KV cache: new keys and values appended in place, rotary embeddings, then the course's kvcache kernel
# ----------------------------------------------------------------------------


def _rotary(x, cos, sin, positions, interleaved):
    """The library's rotary embedding (``flash_attn.layers.rotary.apply_rotary_emb``) on x [B, N, H, d] at positions
    [B, N]: the first rotary_dim = 2 * cos.shape[-1] columns rotated, pairs (2i, 2i + 1) when interleaved (GPT-J),
    else (i, i + rotary_dim / 2) (GPT-NeoX); computed in fp32, returned in x's dtype."""
    rd = 2 * cos.shape[-1]
    if rd > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[-1] = {rd} is larger than the head dim {x.shape[-1]}")
    c = cos[positions].float()[:, :, None, :]  # [B, N, 1, rd / 2]
    s = sin[positions].float()[:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)  # [B, N, H, rd]
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)  # [B, N, H, rd]
    return torch.cat([rot.to(x.dtype), x[..., rd:]], -1)


def _contiguous_as_pages(k_cache, v_cache, cache_batch_idx):
    """A contiguous cache [B_cache, Nmax, Hkv, d] read through cache_batch_idx [B], as a paged one: pages of the
    largest power of two (16 .. 256) dividing Nmax, views of the same memory, and the block table that names
    sequence b's pages (cache row cache_batch_idx[b]). Returns (k_pages, v_pages, block_table, page)."""
    Bc, Nmax, Hkv, d = k_cache.shape
    page = next((p for p in (256, 128, 64, 32, 16) if Nmax % p == 0), None)
    if page is None:
        raise NotImplementedError(f"cache_batch_idx with a contiguous cache of length {Nmax}: the course's kvcache "
                                  f"kernel reads it as pages of 16 to 256 rows, and {Nmax} is not a multiple of 16")
    per_seq = Nmax // page
    table = (cache_batch_idx.to(torch.int32)[:, None] * per_seq
             + torch.arange(per_seq, device=k_cache.device, dtype=torch.int32)[None, :])  # [B, per_seq]
    pages = lambda c: c.view(Bc * per_seq, page, Hkv, d)  # noqa: E731
    return pages(k_cache), pages(v_cache), table.contiguous(), page


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """The library's ``flash_attn_with_kvcache``: q [B, Nq, H, d] against k_cache, v_cache ([B_cache, Nmax, Hkv, d],
    or pages [num_blocks, page_block_size, Hkv, d] with block_table int32 [B, max_blocks]) -> out [B, Nq, H, d].

    cache_seqlens (int or int32 [B]; None: the whole cache) counts the tokens already cached. k, v [B, Nnew, Hkv, d]
    given: written into the cache in place at positions cache_seqlens .. cache_seqlens + Nnew - 1 (the rotary
    embedding applied to k first), and attention runs over cache_seqlens + Nnew keys. rotary_cos, rotary_sin
    [seqlen_ro, rotary_dim / 2] (with k, v): k rotated at its positions, q at cache_seqlens + i when causal or
    windowed, else at cache_seqlens. cache_batch_idx int32 [B]: the cache row of each sequence (a contiguous cache:
    read as pages of it, no copy). causal (bottom-right), window_size, softcap, alibi_slopes ([H] or [B, H]) as in
    the library; num_splits 0 lets the kernel choose. Not differentiable (neither is the library's). Refused
    (NotImplementedError): cache_leftpad, return_softmax_lse (the kvcache kernel merges its splits without writing
    the lse), cache_batch_idx with a contiguous cache not a multiple of 16 long.
    """
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad in flash_attn_with_kvcache: the course's kvcache kernel reads each "
                                  "sequence's keys from position 0")
    if return_softmax_lse:
        raise NotImplementedError("return_softmax_lse=True in flash_attn_with_kvcache: the course's kvcache kernel "
                                  "merges its splits in the launch without writing the lse")
    if (k is None) != (v is None):
        raise ValueError("k and v come together: pass both (new keys and values to append) or neither")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos and rotary_sin apply to the new k and q: pass k and v with them")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin come together")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [B, Nq, H, d], got {getattr(q, 'shape', type(q).__name__)}")
    B, Nq = q.shape[0], q.shape[1]
    paged = block_table is not None
    if cache_batch_idx is not None:
        if paged:
            raise ValueError("cache_batch_idx indexes a contiguous cache; with block_table the table names the pages")
        if not isinstance(cache_batch_idx, torch.Tensor) or tuple(cache_batch_idx.shape) != (B,):
            raise ValueError(f"cache_batch_idx must be an int32 tensor [B] = [{B}]")
        capacity = k_cache.shape[1]
        k_cache, v_cache, block_table, _ = _contiguous_as_pages(k_cache, v_cache, cache_batch_idx)
    elif paged:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens with them")
        cache_seqlens = torch.full((B,), capacity, dtype=torch.int32, device=q.device)  # the whole cache
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor [B], got {type(cache_seqlens).__name__}")
    seqlens = cache_seqlens.to(torch.int32)
    if k is not None:
        n_new = k.shape[1]
        if k.dim() != 4 or tuple(v.shape) != tuple(k.shape) or k.shape[0] != B:
            raise ValueError(f"k and v must be [B, Nnew, Hkv, d] with B = {B}, got {tuple(k.shape)}, {tuple(v.shape)}")
        pos = seqlens.long()[:, None] + torch.arange(n_new, device=q.device)[None, :]  # [B, Nnew] cache positions
        if rotary_cos is not None:
            k = _rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
            q_pos = (seqlens.long()[:, None] + torch.arange(Nq, device=q.device)[None, :]
                     if causal or tuple(window_size) != (-1, -1) else seqlens.long()[:, None].expand(B, Nq))
            q = _rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        if block_table is not None:  # page and row of each new token
            page = k_cache.shape[1]
            where = (block_table.long().gather(1, pos // page), pos % page)
        else:
            where = (torch.arange(B, device=q.device)[:, None], pos)
        k_cache[where] = k.to(k_cache.dtype)  # in place, as the library's
        v_cache[where] = v.to(v_cache.dtype)
        seqlens = seqlens + n_new
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the kernel chooses), got {num_splits!r}")
    out = flash_attn_with_kvcache_triton(
        q.contiguous(), k_cache, v_cache, seqlens.contiguous(), block_table, causal=causal,
        num_splits=num_splits or None, sm_scale=softmax_scale, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes)
    return out
