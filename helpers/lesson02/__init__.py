"""Plain functions behind lesson 02 (FlashAttention V1): the tile grid, the V1 schedule
and its stepper picture, a reference V1, standard attention with its S and P in "HBM",
and the paper's I/O bounds.

The notebook's pictures and the tests use these; the learner writes ``flash_attn_v1``.
References: Dao et al. 2022, "FlashAttention", Algorithm 1 and Theorem 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Tile", "tile_grid", "V1Step", "v1_schedule", "render_v1_step", "flash_attn_v1_ref",
           "standard_attention", "paper_standard_elements", "paper_flash_elements", "sram_elements",
           "v1_traffic", "plot_v1_traffic"]


# ------------------------------------------------------------------ the grid of tiles
@dataclass
class Tile:
    i: int          # Q block number
    j: int          # KV block number
    rows: range     # query rows it covers
    cols: range     # key columns it covers

    @property
    def shape(self):
        return (len(self.rows), len(self.cols))


def tile_grid(N: int, Nk: int, Br: int, Bc: int) -> list[list[Tile]]:
    """tiles[i][j]: the tile of S for Q block i and KV block j; the last ones may be ragged."""
    return [[Tile(bi, bj, range(r, min(r + Br, N)), range(c, min(c + Bc, Nk)))
             for bj, c in enumerate(range(0, Nk, Bc))]
            for bi, r in enumerate(range(0, N, Br))]


# ------------------------------------------------------------------ V1's schedule
@dataclass
class V1Step:
    j: int              # KV block (outer loop)
    i: int              # Q block (inner loop)
    tile: Tile
    loaded_kv: bool     # True when this step loads a new Kj, Vj (first Q block of a KV block)
    reads: dict         # running totals in elements, after this step: q, k, v, O, m, l
    writes: dict        # running totals in elements, after this step: O, m, l


def v1_schedule(N: int, Nk: int, d: int, Br: int, Bc: int) -> list[V1Step]:
    """Every (KV block, Q block) step of V1, in order, with running HBM element counts.

    Per step V1 reads Qi [Br, d] and Oi, li, mi, and writes Oi, li, mi back; per KV block it
    reads Kj and Vj once. (Counts in elements; multiply by 4 for float32 bytes.)
    """
    grid = tile_grid(N, Nk, Br, Bc)
    reads = dict(q=0, k=0, v=0, O=0, m=0, l=0)
    writes = dict(O=0, m=0, l=0)
    steps = []
    for bj in range(len(grid[0]) if grid else 0):
        for bi in range(len(grid)):
            t = grid[bi][bj]
            r, c = len(t.rows), len(t.cols)
            if bi == 0:
                reads["k"] += c * d
                reads["v"] += c * d
            reads["q"] += r * d
            reads["O"] += r * d
            reads["m"] += r
            reads["l"] += r
            writes["O"] += r * d
            writes["m"] += r
            writes["l"] += r
            steps.append(V1Step(bj, bi, t, bi == 0, dict(reads), dict(writes)))
    return steps


def render_v1_step(step: int, N: int = 6, Nk: int = 6, d: int = 4, Br: int = 4, Bc: int = 3):
    """Draw V1 at ``step``: S's tiles (done, live, to do), what sits in SRAM, the HBM counts.

    Returns the matplotlib Figure (the stepper shows it; tests inspect it).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    steps = v1_schedule(N, Nk, d, Br, Bc)
    step = max(0, min(step, len(steps) - 1))
    s = steps[step]
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw=dict(width_ratios=[1, 1.15]))
    done = {(p.i, p.j) for p in steps[:step]}
    for p in steps:
        t = p.tile
        if (p.i, p.j) == (s.i, s.j):
            color, alpha = "tab:orange", 0.9
        elif (p.i, p.j) in done:
            color, alpha = "tab:blue", 0.35
        else:
            color, alpha = "lightgrey", 0.5
        ax.add_patch(Rectangle((t.cols.start, t.rows.start), len(t.cols), len(t.rows),
                               facecolor=color, alpha=alpha, edgecolor="black", lw=1.5))
        ax.text(t.cols.start + len(t.cols) / 2, t.rows.start + len(t.rows) / 2,
                f"S[{p.i},{p.j}]\n{len(t.rows)}x{len(t.cols)}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, Nk)
    ax.set_ylim(N, 0)
    ax.set_xticks(range(Nk + 1))
    ax.set_yticks(range(N + 1))
    ax.grid(True, lw=0.3)
    ax.set_xlabel("key column (KV block j: outer loop)")
    ax.set_ylabel("query row (Q block i: inner loop)")
    ax.set_title(f"V1 step {step + 1}/{len(steps)}: j = {s.j}, i = {s.i}")
    ax.set_aspect("equal")
    t = s.tile
    rows = f"{t.rows.start}:{t.rows.stop}"
    cols = f"{t.cols.start}:{t.cols.stop}"
    lines = [
        "SRAM now:",
        f"  Kj, Vj = k[{cols}], v[{cols}]   [{len(t.cols)}, {d}]"
        + ("   (just loaded)" if s.loaded_kv else "   (kept from step before)"),
        f"  Qi     = q[{rows}]   [{len(t.rows)}, {d}]",
        f"  Oi, mi, li = O[{rows}], m[{rows}], l[{rows}]   (read back)",
        f"  S_ij = Qi @ Kj.T * scale   [{len(t.rows)}, {len(t.cols)}]",
        "",
        "HBM so far (elements):",
        "  read   q {q}  k {k}  v {v}".format(**s.reads),
        "  read   O {O}  m {m}  l {l}".format(**s.reads),
        "  write  O {O}  m {m}  l {l}".format(**s.writes),
        "",
        f"O is read and written {s.j + 1} time(s) so far,",
        f"{math.ceil(Nk / Bc)} in all (once per KV block).",
    ]
    tx.axis("off")
    tx.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ reference V1 and standard attention
def flash_attn_v1_ref(q, k, v, Br=4, Bc=3):
    """FlashAttention V1 (Algorithm 1): KV blocks outside, Q blocks inside, O kept normalised."""
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    O = torch.zeros(N, v.shape[1], dtype=q.dtype)            # [N, d] in HBM
    l = torch.zeros(N, dtype=q.dtype)                         # [N] in HBM
    m = torch.full((N,), -math.inf, dtype=q.dtype)            # [N] in HBM
    for j in range(0, Nk, Bc):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]                     # [Bc, d]
        for i in range(0, N, Br):
            Qi, Oi, li, mi = q[i:i + Br], O[i:i + Br], l[i:i + Br], m[i:i + Br]
            S = Qi @ Kj.T * scale                             # [Br, Bc]
            m_blk = S.amax(dim=1)                             # [Br]
            P = torch.exp(S - m_blk[:, None])                 # [Br, Bc]
            l_blk = P.sum(dim=1)                              # [Br]
            m_new = torch.maximum(mi, m_blk)                  # [Br]
            alpha = torch.exp(mi - m_new)                     # [Br]
            beta = torch.exp(m_blk - m_new)                   # [Br]
            l_new = alpha * li + beta * l_blk                 # [Br]
            O[i:i + Br] = ((alpha * li)[:, None] * Oi + beta[:, None] * (P @ Vj)) / l_new[:, None]
            l[i:i + Br] = l_new
            m[i:i + Br] = m_new
    return O


def standard_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v as three kernels, returning (O, S, P) so that the meter
    counts S and P as HBM tensors (written by one kernel, read by the next), as in the paper."""
    scale = 1.0 / math.sqrt(q.shape[1])
    S = q @ k.T * scale                                      # [N, Nk], written to HBM
    P = torch.softmax(S, dim=1)                              # [N, Nk], S read, P written
    O = P @ v                                                # [N, d],  P and V read, O written
    return O, S, P


def sram_elements(d: int, Bc: int) -> int:
    """The SRAM size M the paper's Algorithm 1 implies for column tiles Bc = ceil(M / 4d)."""
    return 4 * d * Bc


def paper_standard_elements(N: int, d: int) -> int:
    """Theorem 2, standard attention: Theta(N d + N^2) HBM accesses (constant 1)."""
    return N * d + N * N


def paper_flash_elements(N: int, d: int, M: int) -> float:
    """Theorem 2, FlashAttention: Theta(N^2 d^2 / M) HBM accesses (constant 1)."""
    return N * N * d * d / M


# ------------------------------------------------------------------ measured traffic
def v1_traffic(v1, Ns, d=16, Br=16, Bc=16, seed=0):
    """Measured HBM bytes of ``v1`` and of standard attention for each N (N = Nk)."""
    from .. import meter
    g = torch.Generator().manual_seed(seed)
    rows = []
    for N in Ns:
        q, k, v = (torch.randn(N, d, generator=g) for _ in range(3))
        f = meter.measure(v1, q, k, v, Br, Bc, names=("q", "k", "v"))
        s = meter.measure(standard_attention, q, k, v, names=("q", "k", "v"))
        rows.append(dict(N=N, flash=f.hbm_bytes, standard=s.hbm_bytes, flash_reads=f.reads,
                         flash_writes=f.writes, standard_reads=s.reads, standard_writes=s.writes))
    return rows


def plot_v1_traffic(rows_by_bc, d=16):
    """Measured bytes (V1 for each Bc, and standard) against N, next to the paper's bounds (constant 1).

    ``rows_by_bc``: {Bc: v1_traffic(...) rows}.
    """
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    first = next(iter(rows_by_bc.values()))
    Ns = [r["N"] for r in first]
    ax.plot(Ns, [r["standard"] for r in first], "o-", color="tab:red", label="standard attention (measured)")
    ax.plot(Ns, [4 * paper_standard_elements(N, d) for N in Ns], "--", color="tab:red", alpha=0.6,
            label="4 B x (N d + N²)  (paper, standard)")
    for (Bc, rows), color in zip(rows_by_bc.items(), ["tab:blue", "tab:green", "tab:purple"]):
        M = sram_elements(d, Bc)
        ax.plot(Ns, [r["flash"] for r in rows], "o-", color=color, label=f"V1, Bc = {Bc} (measured)")
        ax.plot(Ns, [4 * paper_flash_elements(N, d, M) for N in Ns], "--", color=color, alpha=0.6,
                label=f"4 B x N² d² / M, M = 4 d Bc = {M}  (paper)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("N (= Nk)")
    ax.set_ylabel("HBM bytes read + written")
    ax.set_title(f"one head, d = {d}, float32, measured by helpers.meter")
    ax.legend(fontsize=7.5)
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    return fig
