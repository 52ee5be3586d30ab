"""Lesson 04's plain functions: causal tile classes, the work they save, and their pictures.

A (Q block, KV block) pair of a causal attention is one of three classes:

- ``skip``: every key of the tile is above the diagonal for every query of it (never computed),
- ``full``: every key is visible to every query (computed with no mask),
- ``partial``: the diagonal cuts the tile (computed, then masked).

Query ``i`` sees key ``j`` when ``j <= i + offset``: ``offset = 0`` for top-left
alignment (SDPA's ``is_causal=True``) and ``Nk - N`` for bottom-right (FlashAttention
since 2.1). ``helpers.reference.causal_mask`` is the element-level truth these agree with.
"""
from __future__ import annotations

import math

import torch

__all__ = ["SKIP", "FULL", "PARTIAL", "CLASSES", "offset", "tile_class", "tile_classes",
           "work_fraction", "render_tile_classes", "plot_work_saved", "tiled_masked_attention",
           "flash_attn_causal_ref"]

SKIP, FULL, PARTIAL = 0, 1, 2
CLASSES = ("skip", "full", "partial")


def offset(N: int, Nk: int, align: str) -> int:
    """The diagonal's shift: query i sees keys j <= i + offset."""
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return 0 if align == "top_left" else Nk - N


def tile_class(i0: int, j0: int, Br: int, Bc: int, N: int, Nk: int, align: str = "top_left") -> str:
    """'skip', 'full' or 'partial' for the tile of rows i0..i0+Br-1, columns j0..j0+Bc-1 (clipped)."""
    off = offset(N, Nk, align)
    i1, j1 = min(i0 + Br, N) - 1, min(j0 + Bc, Nk) - 1     # the last row and column in the tile
    if j0 > i1 + off:          # even the last query cannot see the first key
        return "skip"
    if j1 <= i0 + off:         # even the first query sees the last key
        return "full"
    return "partial"


def tile_classes(N: int, Nk: int, Br: int, Bc: int, align: str = "top_left") -> torch.Tensor:
    """int [ceil(N/Br), ceil(Nk/Bc)]: SKIP, FULL or PARTIAL for every tile."""
    rows = [[CLASSES.index(tile_class(i0, j0, Br, Bc, N, Nk, align)) for j0 in range(0, Nk, Bc)]
            for i0 in range(0, N, Br)]
    return torch.tensor(rows, dtype=torch.int64).reshape(math.ceil(N / Br), math.ceil(Nk / Bc))


def _areas(N, Nk, Br, Bc):
    """float [ceil(N/Br), ceil(Nk/Bc)]: how many scores each (clipped) tile holds."""
    h = torch.tensor([min(Br, N - i0) for i0 in range(0, N, Br)], dtype=torch.float64)
    w = torch.tensor([min(Bc, Nk - j0) for j0 in range(0, Nk, Bc)], dtype=torch.float64)
    return h[:, None] * w[None, :]


def work_fraction(N: int, Nk: int, Br: int, Bc: int, align: str = "top_left") -> dict:
    """Fractions of the N x Nk scores in skipped, full and partial tiles (they sum to 1).

    The work a tiled causal kernel does is ``full + partial``; it saves ``skip``. The
    scores that are really visible are ``visible`` (the limit as tiles shrink to 1 x 1).
    """
    cls, area = tile_classes(N, Nk, Br, Bc, align), _areas(N, Nk, Br, Bc)
    total = float(N * Nk)
    from ..reference import causal_mask
    out = {name: float(area[cls == c].sum()) / total for c, name in enumerate(CLASSES)}
    out["visible"] = float(causal_mask(N, Nk, align).sum()) / total
    return out




def render_tile_classes(N: int = 20, Nk: int = 20, Br: int = 4, Bc: int = 4, align: str = "top_left", ax=None):
    """Heat map of the tile classes, with each query's visible keys drawn on top; returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from ..reference import causal_mask

    if ax is None:
        _, ax = plt.subplots(figsize=(5.2, 5.2 * N / max(Nk, 1) if Nk >= N else 5.2))
    cls = tile_classes(N, Nk, Br, Bc, align)
    per_elem = cls.repeat_interleave(Br, 0)[:N].repeat_interleave(Bc, 1)[:, :Nk]     # [N, Nk]
    ax.imshow(per_elem.numpy(), cmap=ListedColormap(["#eeeeee", "#4c9be8", "#f5a142"]), vmin=0, vmax=2,
              interpolation="nearest", aspect="equal")
    vis = causal_mask(N, Nk, align)
    ys, xs = torch.nonzero(vis, as_tuple=True)
    ax.scatter(xs.numpy(), ys.numpy(), s=max(2, 900 / max(N, Nk) ** 1.3), c="k", marker="s", linewidths=0)
    for i0 in range(0, N + 1, Br):
        ax.axhline(min(i0, N) - 0.5, color="white", lw=1.5)
    for j0 in range(0, Nk + 1, Bc):
        ax.axvline(min(j0, Nk) - 0.5, color="white", lw=1.5)
    f = work_fraction(N, Nk, Br, Bc, align)
    n = {name: int((cls == c).sum()) for c, name in enumerate(CLASSES)}
    ax.set_title(f"{align}, N={N}, Nk={Nk}, Br={Br}, Bc={Bc}\n"
                 f"skip {n['skip']} (grey), full {n['full']} (blue), partial {n['partial']} (orange) tiles\n"
                 f"computed {f['full'] + f['partial']:.0%} of the scores, {f['visible']:.0%} are visible",
                 fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    return ax


def plot_work_saved(Ns=None, tiles=((16, 16), (64, 64), (128, 64)), align: str = "top_left", ax=None):
    """Fraction of the scores a causal kernel never computes, against N (= Nk), per tile size."""
    import matplotlib.pyplot as plt
    if Ns is None:
        Ns = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6))
    for Br, Bc in tiles:
        ax.plot(Ns, [work_fraction(N, N, Br, Bc, align)["skip"] for N in Ns], marker="o", ms=3,
                label=f"Br={Br}, Bc={Bc}")
    ax.plot(Ns, [(N - 1) / (2 * N) for N in Ns], "k--", lw=1, label="1 x 1 tiles: (N-1)/2N")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 0.55)
    ax.set_xlabel("N = Nk")
    ax.set_ylabel("fraction of scores skipped")
    ax.set_title("causal attention: work a tiled kernel never does")
    ax.legend(fontsize=8)
    return ax


# ------------------------------------------------------------------ the course's reference kernel
def tiled_masked_attention(q, k, v, vis, Br=4, Bc=3):
    """FlashAttention (V2 order) under a mask: tiles with no visible key are skipped, full tiles run
    unmasked, partial ones are masked. ``vis`` is a bool [N, Nk] (True = may attend) or a function
    ``(i0, j0, br, bc) -> bool [br, bc]`` giving one tile's mask (nothing N x Nk is then made).
    Returns (O [N, d], lse [N]) in q's dtype; a row that sees no key gets O = 0, lse = -inf.
    The course's stand-in for a learner's kernel."""
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    O = torch.zeros(N, v.shape[1], dtype=q.dtype)                       # [N, dv]
    lse = torch.full((N,), -math.inf, dtype=q.dtype)                    # [N]
    for i0 in range(0, N, Br):
        Qi = q[i0:i0 + Br]                                              # [Br, d]
        br = Qi.shape[0]
        m = torch.full((br,), -math.inf, dtype=q.dtype)
        l = torch.zeros(br, dtype=q.dtype)
        acc = torch.zeros(br, v.shape[1], dtype=q.dtype)                # [Br, dv]
        for j0 in range(0, Nk, Bc):
            bc = min(Bc, Nk - j0)
            tile = vis(i0, j0, br, bc) if callable(vis) else vis[i0:i0 + br, j0:j0 + bc]   # [Br, Bc]
            if not tile.any():
                continue                                                # skip: never computed
            S = Qi @ k[j0:j0 + Bc].T * scale                            # [Br, Bc]
            if not tile.all():
                S = S.masked_fill(~tile, -math.inf)                     # partial: masked
            m_new = torch.maximum(m, S.amax(1))
            m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
            P = torch.exp(S - m_safe[:, None])                          # [Br, Bc]
            alpha = torch.exp(m - m_safe)
            l = alpha * l + P.sum(1)
            acc = alpha[:, None] * acc + P @ v[j0:j0 + Bc]              # [Br, dv]
            m = m_new
        l_safe = torch.where(l == 0, 1.0, l)
        O[i0:i0 + br] = acc / l_safe[:, None]
        lse[i0:i0 + br] = torch.where(l == 0, -math.inf, m + torch.log(l_safe))
    return O, lse


def flash_attn_causal_ref(q, k, v, Br=4, Bc=3, align="top_left"):
    """The course's causal kernel (the exercise's signature): ``tiled_masked_attention`` with a causal mask."""
    N, Nk = q.shape[0], k.shape[0]
    off = offset(N, Nk, align)

    def tile_vis(i0, j0, br, bc):                     # one tile's mask, from its indices
        return torch.arange(j0, j0 + bc)[None, :] <= torch.arange(i0, i0 + br)[:, None] + off   # [br, bc]
    return tiled_masked_attention(q, k, v, tile_vis, Br, Bc)
