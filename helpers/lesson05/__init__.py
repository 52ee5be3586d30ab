"""Lesson 05's plain functions: masks that leave rows (or tiles) with nothing to attend to.

``make_mask(kind, N, Nk)`` draws the usual sources of fully masked rows and empty tiles;
``mask_summary`` counts them; ``render_mask`` draws a mask with its tiles (the widget's
picture). Masks are bool ``[N, Nk]``, True where query i may attend to key j.
``lse_empty_to_neg_inf`` brings an lse written with FlashAttention-2's sentinel for an empty row
(+inf) to the course's (-inf) before a merge.
"""
from __future__ import annotations

import math

import torch

__all__ = ["KINDS", "make_mask", "mask_summary", "render_mask", "lse_empty_to_neg_inf", "flash_attn_masked_ref"]

KINDS = ("bottom_right causal", "padding", "sliding window", "packed documents", "random")


def make_mask(kind: str, N: int, Nk: int, window: int = 3, seed: int = 0) -> torch.Tensor:
    """bool [N, Nk] for one of ``KINDS``.

    - bottom_right causal: j <= i + Nk - N; with N > Nk the first N - Nk rows see nothing.
    - padding: the last third of the queries and of the keys are padding; a padded query
      attends to nothing (q_valid[:, None] & k_valid[None, :]).
    - sliding window: bottom-right causal, and only the last ``window`` keys: j > i + Nk - N - window.
    - packed documents: three documents packed into one sequence (block diagonal, causal inside).
    - random: each entry visible with probability 1/3, then two rows cleared.
    """
    i = torch.arange(N)[:, None]
    j = torch.arange(Nk)[None, :]
    off = Nk - N
    if kind == "bottom_right causal":
        return j <= i + off
    if kind == "padding":
        q_valid = torch.arange(N) < N - N // 3
        k_valid = torch.arange(Nk) < Nk - Nk // 3
        return q_valid[:, None] & k_valid[None, :]
    if kind == "sliding window":
        return (j <= i + off) & (j > i + off - window)
    if kind == "packed documents":
        # document id of each position, for three documents of about equal length
        dq = (torch.arange(N) * 3) // max(N, 1)
        dk = (torch.arange(Nk) * 3) // max(Nk, 1)
        pos_q = (torch.arange(N) + 1) * Nk / max(N, 1) - 1       # queries spread over the same span, end-aligned
        return (dq[:, None] == dk[None, :]) & (j <= pos_q[:, None])
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        m = torch.rand(N, Nk, generator=g) < 1 / 3
        m[torch.randperm(N, generator=g)[:2]] = False
        return m
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def mask_summary(mask: torch.Tensor, Br: int, Bc: int) -> dict:
    """Counts: fully masked rows, tiles with no visible key (skippable), tiles computed, all tiles."""
    N, Nk = mask.shape
    empty_tiles = computed = 0
    for i0 in range(0, N, Br):
        for j0 in range(0, Nk, Bc):
            if mask[i0:i0 + Br, j0:j0 + Bc].any():
                computed += 1
            else:
                empty_tiles += 1
    return {"empty_rows": int((~mask.any(1)).sum()), "empty_tiles": empty_tiles, "computed_tiles": computed,
            "tiles": math.ceil(N / Br) * math.ceil(Nk / Bc)}


def render_mask(kind: str = "bottom_right causal", N: int = 16, Nk: int = 12, Br: int = 4, Bc: int = 4,
                ax=None):
    """The mask (black = visible), its skippable tiles (grey) and its fully masked rows (red)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    mask = make_mask(kind, N, Nk)
    if ax is None:
        _, ax = plt.subplots(figsize=(5.2, 5.2))
    tile_any = torch.zeros(N, Nk, dtype=torch.bool)
    for i0 in range(0, N, Br):
        for j0 in range(0, Nk, Bc):
            tile_any[i0:i0 + Br, j0:j0 + Bc] = mask[i0:i0 + Br, j0:j0 + Bc].any()
    img = torch.where(mask, 2, torch.where(tile_any, 1, 0))                  # 0 skipped, 1 computed, 2 visible
    ax.imshow(img.numpy(), cmap=ListedColormap(["#dddddd", "#cfe3f7", "#222222"]), vmin=0, vmax=2,
              interpolation="nearest", aspect="equal")
    empty = (~mask.any(1)).nonzero().flatten()
    for i in empty.tolist():
        ax.plot([-0.5, Nk - 0.5], [i, i], color="#d62728", lw=2, alpha=0.7)
    for i0 in range(0, N + 1, Br):
        ax.axhline(min(i0, N) - 0.5, color="white", lw=1.5)
    for j0 in range(0, Nk + 1, Bc):
        ax.axvline(min(j0, Nk) - 0.5, color="white", lw=1.5)
    s = mask_summary(mask, Br, Bc)
    ax.set_title(f"{kind}: N={N}, Nk={Nk}, Br={Br}, Bc={Bc}\n"
                 f"{s['empty_rows']} fully masked rows (red)\n"
                 f"{s['empty_tiles']} of {s['tiles']} tiles with no visible key (grey)", fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    return ax


def lse_empty_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """The same lse with the +inf sentinel of an empty row replaced by -inf (the course's convention).

    A row that saw no key has no finite lse, so each library writes a sentinel:
    FlashAttention-2's forward writes +inf (``Softmax::normalize_softmax_lse`` in
    ``csrc/flash_attn/src/softmax.h``; ``mha_fwd`` also fills +inf when ``seqlen_k == 0``) so
    that its backward's ``exp(S - lse)`` is ``exp(-inf) = 0`` on that row; its split-KV partials
    use -inf, and so does FlashAttention-3 (``hopper/softmax.h``). A merge weighs a part by
    ``exp(lse_s - max lse)``, so a +inf part poisons it (NaN); mapping +inf to -inf first gives
    that part weight 0. A real lse is never +inf, so the mapping is safe. Returns a new tensor.
    """
    if not torch.is_tensor(lse) or not lse.is_floating_point():
        raise TypeError(f"lse_empty_to_neg_inf: expected a floating-point tensor, got {type(lse).__name__}"
                        + (f" of {lse.dtype}" if torch.is_tensor(lse) else ""))
    return torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)


def flash_attn_masked_ref(q, k, v, mask, Br=4, Bc=3):
    """The course's masked kernel (the exercise's signature): tiles with no visible key skipped,
    a fully masked row gives O = 0 and lse = -inf."""
    from ..lesson04 import tiled_masked_attention
    return tiled_masked_attention(q, k, v, mask, Br, Bc)
