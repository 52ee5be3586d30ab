"""Why softmax matters on Hopper, counted: the matmul FLOPs and exponentials of one head's tiled forward, and
the timeline picture of a simulated pipeline run (how busy the model's tensor cores are)."""
from __future__ import annotations

import math

import torch

from .pipeline import Run

__all__ = ["PAPER", "count_forward_ops", "softmax_share", "tensor_core_busy", "plot_timeline"]


# ------------------------------------------------------------------ why softmax matters on Hopper
# The FA3 paper's figures for the H100 SXM5 (Shah et al., 2024, §3.1, "Pingpong scheduling", in both the arXiv and
# the NeurIPS versions): "989 TFLOPS of FP16 matmul but only 3.9 TFLOPS of special functions such as exponential"
# (its footnote: 16 operations per SM per clock x 132 SMs x 1830 MHz). Not measured here.
PAPER = {"mma_tflops": 989.0, "exp_tflops": 3.9, "source": "FlashAttention-3 (Shah et al., 2024), §3.1, H100 SXM5"}


def count_forward_ops(N=256, Nk=256, d=64, BLOCK_M=64, BLOCK_N=64):
    """Count, by running it, the matmul FLOPs and the exponentials of one head's tiled forward
    (online softmax in base 2): a dispatch mode sees every aten op. Returns {"matmul_flops", "exps"}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"matmul_flops": 0, "exps": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name == "mm":
                (m, k), n = args[0].shape, args[1].shape[1]
                counts["matmul_flops"] += 2 * m * k * n
            elif name in ("exp", "exp2"):
                counts["exps"] += out.numel()
            return out

    rng = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=rng) for n in (N, Nk, Nk))
    with Count():
        _tiled_forward(q, k, v, BLOCK_M, BLOCK_N)
    return counts


def _tiled_forward(q, k, v, BLOCK_M, BLOCK_N):
    """The forward FA2 and FA3 both compute, tile by tile (base 2): what ``count_forward_ops`` counts."""
    N, d = q.shape
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    out = []
    for i in range(0, N, BLOCK_M):
        qi = q[i:i + BLOCK_M]                                         # [BLOCK_M, d]
        m = torch.full((qi.shape[0],), -math.inf)
        l = torch.zeros(qi.shape[0])
        acc = torch.zeros(qi.shape[0], d)
        for j in range(0, k.shape[0], BLOCK_N):
            s = (qi @ k[j:j + BLOCK_N].T) * qk_scale                  # [BLOCK_M, BLOCK_N]  GEMM0
            m_new = torch.maximum(m, s.amax(1))
            alpha = torch.exp2(m - m_new)                             # [BLOCK_M]
            p = torch.exp2(s - m_new[:, None])                        # [BLOCK_M, BLOCK_N]
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ v[j:j + BLOCK_N]         # [BLOCK_M, d]  GEMM1
            m = m_new
        out.append(acc / l[:, None])
    return torch.cat(out)


def softmax_share(d, mma_tflops=PAPER["mma_tflops"], exp_tflops=PAPER["exp_tflops"], **shape):
    """From counted ops and the given throughputs: the time of the exponentials against the matmuls, and the
    share of the total they take if nothing overlaps. Returns a dict of the counts and ratios."""
    c = count_forward_ops(d=d, **shape)
    t_mma = c["matmul_flops"] / (mma_tflops * 1e12)
    t_exp = c["exps"] / (exp_tflops * 1e12)
    return dict(d=d, **c, flops_per_exp=c["matmul_flops"] / c["exps"], exp_over_mma=t_exp / t_mma,
                share_if_serial=t_exp / (t_exp + t_mma))


# ------------------------------------------------------------------ the picture
_COLOURS = {"load": "#4c72b0", "gemm0": "#dd8452", "gemm1": "#c44e52", "softmax": "#55a868", "wait": "#dddddd"}


def tensor_core_busy(run: Run) -> float:
    """The fraction of the run's time the tensor cores spent on GEMMs (the model's, not a measurement)."""
    busy = sum(t1 - t0 for _, what, t0, t1, _, _ in run.events if what in ("gemm0", "gemm1"))
    return busy / max(run.time, 1)


def plot_timeline(run: Run, ax=None, title=""):
    """One lane per stage for the producer's loads (issue to landing) and one per consumer: its waits, GEMM0,
    softmax, GEMM1."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 2.4))
    names = sorted({e[0] for e in run.events}, key=lambda a: (a != "producer", a))
    loads = [e for e in run.events if e[1] == "load"]
    rows = {}
    y = 0
    for a in names:
        if a == "producer":                 # loads overlap in flight: one lane per stage
            for s in sorted({e[4] for e in loads}):
                rows[a, s] = y
                y += 1
        else:
            rows[a, None] = y
            y += 1
    for a, what, t0, t1, s, j in run.events:
        if a == "producer" and what == "wait":      # the lanes show the loads in flight; the waits are the gaps
            continue
        row = rows[a, s] if a == "producer" else rows[a, None]
        ax.barh(row, t1 - t0, left=t0, color=_COLOURS[what], edgecolor="white", height=0.8)
        if j is not None and what in ("load", "softmax") and t1 - t0 >= 2:
            ax.text((t0 + t1) / 2, row, str(j), ha="center", va="center", fontsize=7, color="white")
    labels = [f"TMA stage {s}" if a == "producer" else a.replace("consumer", "consumer WG ") for a, s in rows]
    ax.set_yticks(list(rows.values()), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (model ticks)")
    busy = tensor_core_busy(run)
    ax.set_title((title + ": " if title else "") + f"tensor cores busy {busy:.0%} of the time", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()], fontsize=7, ncol=5,
              loc="upper right", bbox_to_anchor=(1, 1.35), frameon=False)
    return ax
