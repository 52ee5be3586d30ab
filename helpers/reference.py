"""The float64 references every checker compares against.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA)
and the log-sum-exp through ``torch.logsumexp``, both on float64 copies; the gradients
(``attention_grads``) are torch.autograd's through that same forward. The course's
convention for a row with nothing to attend to: O = 0, lse = -inf (torch.logsumexp's value for
an empty row; FlashAttention-2's own forward returns lse = +inf there, lesson 05 says why).
CPU lessons work per head: q ``[N, d]``, k and v ``[Nk, d]``, scale ``1/sqrt(d)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["LOG2E", "LN2", "softmax_stats", "merge_ml", "lse_from_stats", "causal_mask", "attention", "attention_grads"]


LOG2E = 1.0 / math.log(2.0)  # log2(e): exp(x) = exp2(x * LOG2E); the kernels work in base 2
LN2 = math.log(2.0)  # ln(2): a base-2 log times LN2 is the natural log

def softmax_stats(x: torch.Tensor, dim: int = -1):
    """(m, l) of x along ``dim`` in float64: m = max, l = sum(exp(x - m)); (-inf, 0) when empty."""
    x = x.double()
    m = x.amax(dim=dim)
    lse = torch.logsumexp(x, dim=dim)
    l = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(lse), torch.exp(lse - m))
    return m, l


def merge_ml(m1, l1, m2, l2):
    """The merge of two (m, l) statistics, in float64, through log-sum-exp."""
    m1, l1, m2, l2 = (torch.as_tensor(t, dtype=torch.float64) for t in (m1, l1, m2, l2))
    m = torch.maximum(m1, m2)
    lse = torch.logaddexp(m1 + torch.log(l1), m2 + torch.log(l2))
    l = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(lse), torch.exp(lse - m))
    return m, l


def lse_from_stats(m, l):
    m, l = torch.as_tensor(m, dtype=torch.float64), torch.as_tensor(l, dtype=torch.float64)
    return torch.where(l > 0, m + torch.log(l), torch.full_like(m, -math.inf))


def causal_mask(N: int, Nk: int, align: str = "top_left", device=None) -> torch.Tensor:
    """bool [N, Nk], True where query i may see key j.

    top_left (SDPA's ``is_causal=True``): j <= i.  bottom_right (the FlashAttention
    library since 2.1): j <= i + (Nk - N), so the last query sees every key.
    """
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    i = torch.arange(N, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    offset = 0 if align == "top_left" else Nk - N
    return j <= i + offset


def attention(q, k, v, mask=None, scale=None):
    """(O, lse) of softmax(q k^T * scale) v in float64, via SDPA and torch.logsumexp.

    q ``[..., N, d]``, k ``[..., Nk, d]``, v ``[..., Nk, dv]``; ``mask`` bool broadcastable
    to ``[..., N, Nk]``, True = may attend. Fully masked rows: O = 0, lse = -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale                       # [..., N, Nk]
    if mask is not None:
        mask = mask.to(q.device)                                # a mask built on the CPU, q on a GPU
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)                            # [..., N]
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64), lse
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    empty = torch.isneginf(lse)
    o = torch.where(empty[..., None], torch.zeros_like(o), o)   # the convention, whatever the SDPA version gives
    return o, lse


def attention_grads(q, k, v, do, mask=None, scale=None):
    """(O, lse, dq, dk, dv) in float64: ``attention``'s forward and torch.autograd's gradients for ``dO = do``.

    Shapes as ``attention``; on the inputs' device. A row that sees no key has O = 0 and zero gradients.
    """
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    O, lse = attention(q64, k64, v64, mask=mask, scale=scale)
    if not O.requires_grad:                                     # no query or no key: nothing to differentiate
        return O, lse, torch.zeros_like(q64), torch.zeros_like(k64), torch.zeros_like(v64)
    O.backward(do.detach().double())
    return O.detach(), lse.detach(), q64.grad, k64.grad, v64.grad
