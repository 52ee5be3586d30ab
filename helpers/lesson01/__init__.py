"""Plain functions behind lesson 01's pictures: the online-softmax trace and the memory sums."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Step", "online_trace", "score_bytes", "stats_bytes", "render_trace", "plot_bytes_vs_n"]


@dataclass
class Step:
    i: int          # which element was just read
    x: float        # its value
    m_old: float
    m: float        # running max after this element
    alpha: float    # exp(m_old - m): what the old l is multiplied by
    l: float        # running sum of exp(x_j - m) over j <= i


def online_trace(x) -> list[Step]:
    """One Step per element of ``x``: the online softmax (m, l) as it walks the row."""
    steps, m, l = [], -math.inf, 0.0
    for i, xi in enumerate(float(v) for v in x):
        m_new = max(m, xi)
        if m_new == -math.inf:          # nothing seen yet but -inf: (m, l) stays (-inf, 0)
            alpha = 1.0
        else:
            alpha = math.exp(m - m_new)  # exp(-inf) = 0 for the first finite element
            l = l * alpha + math.exp(xi - m_new)
        steps.append(Step(i, xi, m, m_new, alpha, l))
        m = m_new
    return steps


def score_bytes(N: int, heads: int = 1, bytes_per_element: int = 2, Nk: int | None = None) -> int:
    """Bytes of the N x Nk score matrix (fp16 by default) for ``heads`` heads."""
    return N * (N if Nk is None else Nk) * heads * bytes_per_element


def stats_bytes(N: int, heads: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes of the per-row statistics m and l (fp32) for ``heads`` heads."""
    return 2 * N * heads * bytes_per_element


def render_trace(x, step: int):
    """Draw the row with the elements read so far, and a table of m, l, alpha up to ``step``."""
    import matplotlib.pyplot as plt
    steps = online_trace(x)
    s = steps[step]
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [3, 2]})
    vals = [float(v) for v in x]
    colors = ["tab:blue" if i <= step else "lightgray" for i in range(len(vals))]
    ax.bar(range(len(vals)), vals, color=colors)
    ax.axhline(s.m, color="tab:red", ls="--", label=f"m = {s.m:.3g}")
    ax.set_title(f"step {step}: read x[{step}] = {s.x:.3g}")
    ax.set_xlabel("i")
    ax.legend(loc="upper left")
    tx.axis("off")
    rows = [[str(t.i), f"{t.x:.3g}", f"{t.m:.3g}", f"{t.alpha:.3g}", f"{t.l:.4g}"] for t in steps[: step + 1]][-8:]
    table = tx.table(cellText=rows, colLabels=["i", "x_i", "m", "alpha", "l"], loc="center")
    table.scale(1, 1.2)
    fig.tight_layout()
    return fig


def plot_bytes_vs_n(ns, heads: int = 32):
    """Score-matrix bytes against (m, l) bytes, for ``heads`` heads, log-log."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    gib = 2 ** 30
    ax.loglog(ns, [score_bytes(n, heads) / gib for n in ns], "o-", label=f"S = QKᵀ, fp16, {heads} heads")
    ax.loglog(ns, [stats_bytes(n, heads) / gib for n in ns], "s-", label=f"m and l, fp32, {heads} heads")
    sram = 132 * 228 * 1024  # shared memory of all 132 SMs of an H100/H200, 228 KiB each
    ax.axhline(sram / gib, color="gray", ls=":", label=f"all shared memory of an H200: {sram / 2**20:.0f} MiB")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("GiB")
    ax.set_title("What the softmax needs to keep, per layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
