"""Lesson 09, ring attention: the course's launcher and the plain functions behind the plots.

The launcher runs a learner's ``ring_attention`` on real ``torch.distributed`` processes
(gloo, 127.0.0.1), one per rank:

- ``run_ring(fn, q, k, v, world_size, causal=False, layout="contiguous", backend="gloo")
  -> (O, lse)``: lays the global ``[B, H, N, d]`` tensors out over the ranks, starts the
  process group, calls ``fn(q_r, k_r, v_r, causal=..., layout=...)`` on every rank and
  gathers ``O`` and ``lse`` back into global order.
- ``launch(fn, jobs, world_size)``: the same for several inputs in one process group (the
  checker uses it: starting processes is the expensive part), returning per rank what
  ``fn`` returned and what the launcher measured (``RankStats``).

The launcher itself (shipping a function by source, the worker processes, the probes and
what they measure) is ``helpers/lesson09/launcher.py``; its public names are re-exported here.

References: Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers" (2023);
Brandon et al., "Striped Attention" (2023) and the zigzag layout of Llama 3's context
parallelism (Meta, "The Llama 3 Herd of Models", 2024); Jacobs et al., "DeepSpeed
Ulysses" (2023).
"""
from __future__ import annotations

import math

import torch

from ..results import RESULTS_DIR, load_json
from .launcher import (LAST_PIDS, START_METHOD_ENV, RankStats, RingError, RingNotImplemented,  # noqa: F401
                            ShipError, launch, ship)

__all__ = ["run_ring", "launch", "RingError", "RankStats", "shard", "unshard", "chunks_of_rank",
           "check_layout", "chunk_attention", "merge_reference", "ring_schedule", "plot_schedule",
           "kv_bytes", "activation_bytes", "plot_memory", "step_times", "plot_overlap",
           "load_gpu_results", "gpu_results_table", "ring_label", "overlap_summary", "H200_HBM_BYTES", "H200_BF16_FLOPS",
           "NVLINK_BYTES_PER_S", "START_METHOD_ENV", "GPU_RESULTS"]

LAYOUTS = ("contiguous", "zigzag")
H200_HBM_BYTES = 141e9            # NVIDIA's datasheet (HBM3e)
H200_BF16_FLOPS = 989e12          # dense BF16, datasheet
NVLINK_BYTES_PER_S = 450e9        # NVLink 4 on an H200, one direction (NVIDIA's datasheet gives both together)
RING = RESULTS_DIR / "ring_h200x2.json"     # bench/ring_gpu.py's two-GPU record
GPU_RESULTS = str(RING)


# ---------------------------------------------------------------------------- layouts
def check_layout(N: int, world_size: int, layout: str) -> int:
    """Validate; return the number of chunks the sequence is cut into (P or 2P)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    n_chunks = world_size if layout == "contiguous" else 2 * world_size
    if N % n_chunks:
        raise ValueError(f"N = {N} does not split evenly: the {layout} layout over {world_size} ranks cuts the "
                         f"sequence into {n_chunks} equal chunks, so N must be a multiple of {n_chunks}")
    return n_chunks


def chunks_of_rank(rank: int, world_size: int, layout: str) -> list[int]:
    """Which chunks (in sequence order) rank ``rank`` holds: [r] of P, or zigzag [r, 2P-1-r] of 2P."""
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def shard(x: torch.Tensor, world_size: int, layout: str = "contiguous", dim: int = -2) -> list[torch.Tensor]:
    """Cut ``x`` along ``dim`` (the sequence) into each rank's local tensor (chunks concatenated in order)."""
    n_chunks = check_layout(x.shape[dim], world_size, layout)
    pieces = x.chunk(n_chunks, dim=dim)
    return [torch.cat([pieces[c] for c in chunks_of_rank(r, world_size, layout)], dim=dim).contiguous()
            for r in range(world_size)]


def unshard(parts: list[torch.Tensor], layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The inverse of ``shard``: the ranks' local tensors back in sequence order."""
    P = len(parts)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    check_layout(sum(p.shape[dim] for p in parts), P, layout)
    halves = {}
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        halves[r], halves[2 * P - 1 - r] = a, b
    return torch.cat([halves[c] for c in range(2 * P)], dim=dim)


# ---------------------------------------------------------------------------- one chunk pair
def chunk_attention(q, k, v, causal=False):
    """(O, lse) of q ``[B, H, nq, d]`` against k, v ``[B, H, nk, d]``, in float32 (float64 inputs: float64).

    ``causal=True`` masks top-left aligned (query i sees keys j <= i), which is what a
    chunk pair on the diagonal needs. Rows that see no key: O = 0, lse = -inf. The same
    contract as ``helpers.kernels.forward.flash_attn_triton`` (the per-chunk kernel on GPUs).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)                   # no copy of a float32/float64 chunk
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale              # [B, H, nq, nk]
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)                                    # [B, H, nq]
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])                                  # [B, H, nq, nk], 0 where masked
    return (p @ v.to(acc)).to(q.dtype), lse


def merge_reference(o_a, lse_a, o_b, lse_b):
    """Lesson 06's merge of two partial (O, lse), for any leading shape; -inf on both sides stays (0, -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)       # 0 for an empty side
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse




def run_ring(fn, q, k, v, world_size, causal=False, layout="contiguous", backend="gloo", *, timeout=20.0,
             stats=False, start_method=None):
    """Run ``fn`` as ring attention on ``world_size`` processes; return the global ``(O, lse)``.

    q, k, v ``[B, H, N, d]``, N a multiple of world_size (contiguous) or 2·world_size
    (zigzag). Rank r gets its chunk(s) of each and calls ``fn(q_r, k_r, v_r, causal=causal,
    layout=layout)``, which returns its ``(O_r [B, H, n, d], lse_r [B, H, n])``. With
    ``stats=True`` also returns the list of ``RankStats``, one per rank.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, N, d] tensor, got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: expected the same [B, H, N, d]")
    check_layout(q.shape[2], world_size, layout)
    per_rank = list(zip(*(shard(t, world_size, layout) for t in (q, k, v))))
    res = launch(fn, [(per_rank, {"causal": causal, "layout": layout})], world_size, timeout=timeout,
                 start_method=start_method, backend=backend)[0]
    outs = []
    for r, rr in enumerate(res):
        out = rr.out
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise RingError(f"rank {r} returned a {type(out).__name__}, expected (O, lse)", ranks=[r], kind="output")
        outs.append(out)
    O = unshard([o for o, _ in outs], layout, dim=-2)
    lse = unshard([l for _, l in outs], layout, dim=-1)
    return (O, lse, [rr.stats for rr in res]) if stats else (O, lse)


# ---------------------------------------------------------------------------- schedules and pictures
def ring_schedule(P: int, layout: str = "contiguous", causal: bool = True):
    """work[r][t]: the fraction of one (N/P x N/P) block of scores that rank r must compute at step t.

    At step t rank r holds the K/V of rank (r - t) mod P (chunks pass to r + 1). Visible area
    only (a kernel that skips masked tiles): a diagonal block is half visible.
    """
    n = 2 * P if layout == "zigzag" else P
    area = 1.0 / (n // P) ** 2        # one chunk-by-chunk block, in units of a rank's block
    work = [[0.0] * P for _ in range(P)]
    for r in range(P):
        for t in range(P):
            s = (r - t) % P
            for a in chunks_of_rank(r, P, layout):
                for b in chunks_of_rank(s, P, layout):
                    if not causal or b < a:
                        work[r][t] += area
                    elif b == a:
                        work[r][t] += area / 2
    return work


def plot_schedule(P: int = 4, axes=None):
    """Work per rank and step, causal, contiguous vs zigzag (heat maps) and the total per rank (bars)."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    totals = {}
    for ax, layout in zip(axes[:2], LAYOUTS):
        w = ring_schedule(P, layout, causal=True)
        totals[layout] = [sum(row) for row in w]
        ax.imshow(w, cmap="Blues", vmin=0, vmax=1)
        for r in range(P):
            for t in range(P):
                ax.text(t, r, f"{w[r][t]:.2g}", ha="center", va="center", fontsize=8,
                        color="white" if w[r][t] > 0.6 else "black")
        ax.set_xticks(range(P))
        ax.set_yticks(range(P))
        ax.set_xlabel("step t")
        ax.set_ylabel("rank r")
        ax.set_title(f"{layout}: work per step (blocks)", fontsize=10)
    x = range(P)
    axes[2].bar([i - 0.2 for i in x], totals["contiguous"], 0.4, label="contiguous")
    axes[2].bar([i + 0.2 for i in x], totals["zigzag"], 0.4, label="zigzag")
    axes[2].set_xlabel("rank r")
    axes[2].set_title("causal work per rank (blocks)", fontsize=10)
    axes[2].legend(fontsize=8)
    plt.tight_layout()
    return axes


def kv_bytes(N, layers=32, Hkv=8, d=128, bytes_per_elem=2, B=1):
    """Bytes of K and V for N tokens over all layers (a KV cache, or what the attention reads)."""
    return 2 * B * N * layers * Hkv * d * bytes_per_elem


def activation_bytes(N, layers=32, hidden=4096, B=1):
    """Activations a training step keeps for backward, ~34·N·hidden bytes per layer in bf16 with
    FlashAttention (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models", 2022: s·b·h·(34 + 5·a·s/h), whose second term FlashAttention removes). The 34 already
    counts the layer's Q, K and V, its dropout masks and a GeLU MLP of width 4·h (that paper's model),
    so K/V (``kv_bytes``) is a part of this figure, not something to add to it."""
    return 34 * B * N * hidden * layers


def plot_memory(Ns=(131072, 262144, 524288, 1048576), Ps=(1, 2, 4, 8), ax=None, **model):
    """Per-GPU memory of training activations (K/V among them; a Llama-3-8B shape) vs N, sharded over P GPUs."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 3.4))[1]
    for P in Ps:
        ax.plot(Ns, [activation_bytes(N, **model) / P / 1e9 for N in Ns], "o-", label=f"P = {P}")
    ax.axhline(H200_HBM_BYTES / 1e9, color="k", ls=":", lw=1)
    ax.text(Ns[0], H200_HBM_BYTES / 1e9 * 1.1, "one H200 (141 GB)", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("GB per GPU")
    ax.set_title("activations of a training step, K/V included (32 layers, hidden 4096)", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def step_times(N, P=2, B=1, H=32, d=128, bytes_per_elem=2, flops=H200_BF16_FLOPS, link=NVLINK_BYTES_PER_S,
               efficiency=0.6):
    """(compute_s, comm_s) of one non-causal ring step: an (N/P)^2 block vs sending one K/V chunk.

    A model, not a measurement: compute at ``efficiency`` x the datasheet's dense BF16 rate,
    the chunk over one NVLink direction at the datasheet rate.
    """
    n = N // P
    compute = 4 * B * H * n * n * d / (flops * efficiency)
    comm = 2 * B * H * n * d * bytes_per_elem / link
    return compute, comm


def plot_overlap(Ns=(4096, 16384, 65536, 262144, 1048576), P=2, ax=None):
    """Compute vs communication per step (model): compute grows as N^2, the chunk as N."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    c = [step_times(N, P)[0] * 1e3 for N in Ns]
    m = [step_times(N, P)[1] * 1e3 for N in Ns]
    ax.loglog(Ns, c, "o-", label="compute one block")
    ax.loglog(Ns, m, "s-", label="send one K/V chunk")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens N")
    ax.set_ylabel("ms per step")
    ax.set_title(f"one ring step on H200s, P = {P} (model: 60% of 989 TFLOP/s, 450 GB/s)", fontsize=10)
    ax.legend(fontsize=8)
    return ax




def load_gpu_results(path=RING):
    """The recorded two-GPU ring measurement (bench/ring_gpu.py's JSON), or None when none is recorded."""
    return load_json(path)


# lesson 09: ring attention on two GPUs
def ring_label(res) -> str:
    """The machine, versions, date and statistic of the two-GPU record (its ``meta``)."""
    meta = (res or {}).get("meta", {})
    label = (f"{meta.get('gpus', '?')} x {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, {meta.get('date', '?')}")
    return label + (f"; {meta['timing']}" if meta.get("timing") else "")


def overlap_summary(res, efficiency=0.6) -> str:
    """What the two-GPU record says of overlap: the tokens of K/V each step sends against the model's F / B
    (``efficiency`` x the datasheet's BF16 rate over one NVLink direction), one chunk's transfer time against a
    step's compute, the end-to-end time with overlap over without for each (layout, N), and the speedup over one
    GPU; the record's label last."""
    rows = (res or {}).get("ring") or []
    if not rows:
        return "ring attention on two GPUs: no rows in this record (not measured yet)"
    f_over_b = efficiency * H200_BF16_FLOPS / NVLINK_BYTES_PER_S
    sent = sorted({r["N"] // r["world"] for r in rows})                     # K/V tokens passed per step
    transfer = [r["transfer_ms"] for r in rows if r.get("transfer_ms")]
    steps = [s for r in rows for s in (r.get("step_ms") or [])]
    by = {(r["layout"], r["N"], bool(r["overlap"])): r["ms"] for r in rows}
    ratios = {(lay, N): by[(lay, N, True)] / by[(lay, N, False)] for (lay, N, o) in by if o and (lay, N, False) in by}
    slower = sorted(k for k, x in ratios.items() if x > 1)
    speed = [r["speedup"] for r in rows if r.get("speedup")]
    lines = [f"K/V sent per step: {sent[0]:,} to {sent[-1]:,} tokens, {sent[0] / f_over_b:.0f}x to "
             f"{sent[-1] / f_over_b:.0f}x F / B = {f_over_b:,.0f} tokens (the model above)"]
    if transfer and steps:
        lines.append(f"one K/V chunk over NVLink: {min(transfer):.1f} to {max(transfer):.1f} ms; one ring step's "
                     f"compute: {min(steps):.1f} to {max(steps):.1f} ms")
    if ratios:
        lines.append(f"end to end, with overlap / without: {min(ratios.values()):.3f}x to {max(ratios.values()):.3f}x "
                     f"over {len(ratios)} (layout, N) pairs; without overlap faster in {len(slower)}: "
                     + (", ".join(f"{lay} {N // 1024}k" for lay, N in slower) or "none"))
    if speed:
        lines.append(f"two GPUs against one on the whole sequence: {min(speed):.2f}x to {max(speed):.2f}x")
    return "\n".join(lines + [ring_label(res)])


def gpu_results_table(res) -> str:
    """The "ring" rows as a text table, with the machine, versions and date; each row says whether it was causal."""
    lines = [ring_label(res),
             f"{'layout':10s} {'causal':>6s} {'overlap':>7s} {'N':>8s} {'ring ms':>9s} {'1 GPU ms':>9s} {'speedup':>8s}"]
    for row in res.get("ring", []):
        single = row.get("single_gpu_ms")
        lines.append(f"{row['layout']:10s} {str(bool(row.get('causal'))):>6s} {str(row['overlap']):>7s} "
                     f"{row['N']:>8d} {row['ms']:>9.2f} "
                     f"{(f'{single:.2f}' if single else 'n/a'):>9s} "
                     f"{(format(row['speedup'], '.2f') + 'x' if row.get('speedup') else 'n/a'):>8s}")
    return "\n".join(lines)
