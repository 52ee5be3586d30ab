"""Plain functions behind lesson 03 (FlashAttention V2): a reference V2 that can visit its
Q blocks in any order, the exp2 form the Triton kernel uses, and V1 vs V2 measured by
the meter (bytes read and written, divisions) against N and against the tile size.

References: Dao 2023, "FlashAttention-2", Algorithm 1; the Triton fused-attention tutorial
(exp2 with log2(e) folded into qk_scale).
"""
from __future__ import annotations

import math

import torch

from .. import meter
from ..reference import LOG2E  # log2(e): exp(x) = exp2(x * log2(e))

__all__ = ["loop_order", "render_loop_orders", "flash_attn_v2_ref", "flash_attn_v2_exp2", "q_block_order", "cost", "sweep_n", "sweep_tiles",
           "plot_v1_v2", "LOG2E"]


def q_block_order(N: int, Br: int, seed: int | None = None) -> list[int]:
    """The Q block numbers 0 .. ceil(N/Br)-1, shuffled when ``seed`` is given."""
    n = math.ceil(N / Br)
    if seed is None:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def flash_attn_v2_ref(q, k, v, Br=4, Bc=3, order=None):
    """FlashAttention V2: Q blocks outside (in ``order``), KV inside; acc unnormalised, one division."""
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    O = torch.empty(N, v.shape[1], dtype=q.dtype)                 # [N, d] in HBM, written once
    lse = torch.empty(N, dtype=q.dtype)                           # [N] in HBM, written once
    for bi in (order if order is not None else range(math.ceil(N / Br))):
        i = bi * Br
        Qi = q[i:i + Br]                                          # [Br, d], loaded once
        acc = torch.zeros(Qi.shape[0], v.shape[1], dtype=q.dtype)  # [Br, d] in SRAM
        m = torch.full((Qi.shape[0],), -math.inf, dtype=q.dtype)  # [Br]
        l = torch.zeros(Qi.shape[0], dtype=q.dtype)               # [Br]
        for j in range(0, Nk, Bc):
            Kj, Vj = k[j:j + Bc], v[j:j + Bc]                     # [Bc, d]
            S = Qi @ Kj.T * scale                                 # [Br, Bc]
            m_new = torch.maximum(m, S.amax(dim=1))               # [Br]
            P = torch.exp(S - m_new[:, None])                     # [Br, Bc]
            alpha = torch.exp(m - m_new)                          # [Br]
            l = alpha * l + P.sum(dim=1)
            acc = alpha[:, None] * acc + P @ Vj                   # [Br, d]
            m = m_new
        O[i:i + Br] = acc / l[:, None]
        lse[i:i + Br] = m + torch.log(l)
    return O, lse


def flash_attn_v2_exp2(q, k, v, Br=4, Bc=3):
    """V2 in the Triton kernel's form: exp2 with log2(e) folded into qk_scale; lse back in natural log."""
    N, d = q.shape
    Nk = k.shape[0]
    qk_scale = LOG2E / math.sqrt(d)                               # scores in log2 units
    O = torch.empty(N, v.shape[1], dtype=q.dtype)
    lse = torch.empty(N, dtype=q.dtype)
    for i in range(0, N, Br):
        Qi = q[i:i + Br]                                          # [Br, d]
        acc = torch.zeros(Qi.shape[0], v.shape[1], dtype=q.dtype)
        m = torch.full((Qi.shape[0],), -math.inf, dtype=q.dtype)  # running max, log2 units
        l = torch.zeros(Qi.shape[0], dtype=q.dtype)
        for j in range(0, Nk, Bc):
            S = Qi @ k[j:j + Bc].T * qk_scale                     # [Br, Bc]
            m_new = torch.maximum(m, S.amax(dim=1))
            P = torch.exp2(S - m_new[:, None])                    # [Br, Bc]
            alpha = torch.exp2(m - m_new)
            l = alpha * l + P.sum(dim=1)
            acc = alpha[:, None] * acc + P @ v[j:j + Bc]
            m = m_new
        O[i:i + Br] = acc / l[:, None]
        lse[i:i + Br] = (m + torch.log2(l)) / LOG2E               # log2 -> natural log
    return O, lse


# ------------------------------------------------------------------ the two loop orders
def loop_order(N: int, Nk: int, Br: int, Bc: int, version: int) -> list[list[int]]:
    """order[i][j]: the step (1, 2, ...) at which tile (Q block i, KV block j) is computed.

    version 1: KV blocks outside, Q blocks inside. version 2: Q blocks outside, KV inside.
    """
    if version not in (1, 2):
        raise ValueError("version must be 1 or 2")
    Tr, Tc = math.ceil(N / Br), math.ceil(Nk / Bc)
    if version == 1:
        return [[j * Tr + i + 1 for j in range(Tc)] for i in range(Tr)]
    return [[i * Tc + j + 1 for j in range(Tc)] for i in range(Tr)]


def render_loop_orders(N: int = 6, Nk: int = 6, Br: int = 4, Bc: int = 3):
    """V1's and V2's orders over the tiles of S, side by side, with where O is written."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, version in zip(axes, (1, 2)):
        order = loop_order(N, Nk, Br, Bc, version)
        for i, r in enumerate(range(0, N, Br)):
            for j, c in enumerate(range(0, Nk, Bc)):
                h, w = min(Br, N - r), min(Bc, Nk - c)
                ax.add_patch(Rectangle((c, r), w, h, facecolor=plt.cm.viridis(order[i][j] / (len(order) * len(order[0]) + 1)),
                                       alpha=0.55, edgecolor="black", lw=1.5))
                ax.text(c + w / 2, r + h / 2, str(order[i][j]), ha="center", va="center", fontsize=13)
        ax.set_xlim(0, Nk)
        ax.set_ylim(N, 0)
        ax.set_aspect("equal")
        ax.set_xlabel("key column")
        ax.set_ylabel("query row")
        ax.set_title("V1: KV outside; O written at every step" if version == 1 else
                     "V2: Q outside; O_i written once, after its row", fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ V1 vs V2, measured
def cost(fn, N, Nk, d, Br, Bc, seed=0) -> dict:
    """Measured cost of one call: bytes read, bytes written, divisions, and per-tensor bytes."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(N, d, generator=g), torch.randn(Nk, d, generator=g), torch.randn(Nk, d, generator=g)
    r = meter.measure(fn, q, k, v, Br, Bc, names=("q", "k", "v"))
    return dict(read=r.hbm_read_bytes, written=r.hbm_write_bytes, div=r.elementwise.get("div", 0),
                reads=r.reads, writes=r.writes, flops=r.flops)


def sweep_n(v1, v2, Ns, d=16, Br=16, Bc=16):
    """[(N, cost of v1, cost of v2)] for N = Nk in ``Ns``."""
    return [(N, cost(v1, N, N, d, Br, Bc), cost(v2, N, N, d, Br, Bc)) for N in Ns]


def sweep_tiles(v1, v2, tiles, N=128, d=16):
    """[(B, cost of v1, cost of v2)] with Br = Bc = B for B in ``tiles``."""
    return [(B, cost(v1, N, N, d, B, B), cost(v2, N, N, d, B, B)) for B in tiles]


def plot_v1_v2(by_n, by_tile, d=16, B=16, N=128):
    """Two rows of three panels: bytes read, bytes written, divisions; against N, then against B."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for row, (data, xlabel, title) in enumerate([
            (by_n, "N (= Nk)", f"d = {d}, Br = Bc = {B}"),
            (by_tile, "tile size Br = Bc", f"N = Nk = {N}, d = {d}")]):
        xs = [x for x, _, _ in data]
        for col, (key, ylabel) in enumerate([("read", "HBM bytes read"), ("written", "HBM bytes written"),
                                             ("div", "elements divided")]):
            ax = axes[row][col]
            ax.plot(xs, [a[key] for _, a, _ in data], "o-", color="tab:orange", label="V1 (KV outside)")
            ax.plot(xs, [b[key] for _, _, b in data], "s-", color="tab:green", label="V2 (Q outside)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel}\n{title}", fontsize=9)
            ax.grid(True, which="both", lw=0.3)
            if col == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
