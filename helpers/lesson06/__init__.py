"""Lesson 06, Flash-Decoding: the plain functions behind its plots and its explorer.

- ``split_bounds(Nk, num_splits)``: the course's rule for cutting a KV cache into splits.
- ``work_units`` / ``waves`` / ``suggest_splits``: how many independent blocks a decode
  launch has and how well they fill the H200's 132 SMs; ``suggest_splits`` is the *course's*
  split rule (a simplification).
- ``num_splits_heuristic`` / ``fa2_num_splits``: the *library's* rule, FlashAttention-2's
  ``num_splits_heuristic`` and its call in ``set_params_splitkv`` (``csrc/flash_attn/flash_api.cpp``),
  restated here so the course's rule and the library's can be shown side by side.
- ``decode_flops_per_byte``: the arithmetic intensity of one decode step (G FLOP/byte in bf16).
- ``kv_bytes_per_token`` / ``decode_kv_time_s``: decode is memory-bound; time ~ bytes / bandwidth.
- ``make_paged_cache``: a contiguous cache cut into pages, scattered in a pool, with its block table.
- ``plot_*`` / ``render_explorer``: the figures (matplotlib only; widgets call ``render_explorer``).
- ``split_sweep_rows`` / ``split_sweep_table`` / ``split_sweep_summary``: what the number of splits did to the
  course's paged decode kernel on the H200, read from ``bench/results/h200.json`` (its ``"paged"`` rows).

Numbers for the H200 SXM (NVIDIA's datasheet): 132 SMs, 4.8 TB/s of HBM3e bandwidth,
about 989 TFLOP/s dense BF16.
"""
from __future__ import annotations

import math

import torch

__all__ = ["H200_SMS", "H200_BYTES_PER_S", "H200_BF16_FLOPS", "split_bounds", "work_units", "waves",
           "suggest_splits", "num_splits_heuristic", "fa2_num_splits", "decode_flops_per_byte",
           "kv_bytes_per_token", "decode_kv_time_s", "make_paged_cache",
           "plot_work_units", "plot_decode_time", "render_explorer", "plot_paged_cache", "MODELS",
           "plot_split_weights", "combine_splits_ref", "flash_decode_ref", "flash_decode_paged_ref",
           "split_sweep_rows", "split_sweep_table", "split_sweep_summary"]

H200_SMS = 132
H200_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12

# layers, query heads H, KV heads Hkv, head dim d (from the models' published configs)
MODELS = {
    "Llama-3-8B (GQA)": dict(layers=32, H=32, Hkv=8, d=128),
    "Llama-3-70B (GQA)": dict(layers=80, H=64, Hkv=8, d=128),
    "same 8B shape, MHA (Hkv = H)": dict(layers=32, H=32, Hkv=32, d=128),
}


# ----------------------------------------------------------------- splits and work units
def split_bounds(Nk: int, num_splits: int) -> list[tuple[int, int]]:
    """[(start, end)] of each split: ``chunk = ceil(Nk / num_splits)``, split s is
    ``[s*chunk, min((s+1)*chunk, Nk))``. Always ``num_splits`` pairs; some may be empty
    (``start == end``) when there are more splits than keys, or ``Nk`` is not a multiple."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    chunk = max(1, -(-Nk // num_splits))
    return [(min(s * chunk, Nk), min((s + 1) * chunk, Nk)) for s in range(num_splits)]


def work_units(B: int, H: int, num_splits: int = 1, Nq: int = 1, BLOCK_M: int = 128) -> int:
    """Independent blocks of one attention launch: B x H x (query blocks) x splits."""
    return B * H * max(1, -(-Nq // BLOCK_M)) * num_splits


def waves(units: int, n_sms: int = H200_SMS) -> tuple[int, float]:
    """(number of waves, efficiency = busy SM-slots / all SM-slots), one block per SM at a time."""
    n = max(1, -(-units // n_sms))
    return n, units / (n * n_sms)


def suggest_splits(B: int, H: int, Nk: int, n_sms: int = H200_SMS, BLOCK_N: int = 128,
                   max_splits: int = 128) -> int:
    """The course's split rule (a simplification of FlashAttention-2's, not the same): 1 when
    B*H already fills 80% of the SMs; else the fewest splits whose wave efficiency is within 85%
    of the best, never more splits than key blocks of ``BLOCK_N`` keys.

    Where the library differs (``fa2_num_splits``): it counts 2 blocks per SM (``2 * SMs``), it
    counts KV heads, not query heads, in a GQA decode, its key tile depends on the head dim, and
    it skips split counts that give the same tiles per split as one split fewer.
    """
    base = B * H
    if base >= 0.8 * n_sms:
        return 1
    n_blocks = max(1, -(-Nk // BLOCK_N))
    top = max(1, min(max_splits, n_sms, n_blocks))
    eff = {s: waves(base * s, n_sms)[1] for s in range(1, top + 1)}
    best = max(eff.values())
    return min(s for s, e in eff.items() if e >= 0.85 * best)


def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                         max_splits: int) -> int:
    """FlashAttention-2's ``num_splits_heuristic`` (``csrc/flash_attn/flash_api.cpp``), restated.

    ``batch_nheads_mblocks`` blocks already there; ``num_sms`` is what the library passes, which
    is ``2 * multiProcessorCount`` in current FA2 (see ``fa2_num_splits``). Rule: 1 split when
    the blocks reach 80% of ``num_sms``; otherwise the smallest split count whose wave
    efficiency ``w / ceil(w)`` (``w = blocks * splits / num_sms``) is at least 85% of the best,
    over split counts up to ``min(max_splits, num_sms, num_n_blocks)``, leaving out any count
    that gives each split as many key blocks as one split fewer does. The efficiency is
    computed in float32, as the C++ does.
    """
    if min(batch_nheads_mblocks, num_sms, num_n_blocks, max_splits) < 1:
        raise ValueError("num_splits_heuristic: every argument must be >= 1, got "
                         f"{(batch_nheads_mblocks, num_sms, num_n_blocks, max_splits)}")
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    top = min(max_splits, num_sms, num_n_blocks)

    def blocks_per_split(s):
        return -(-num_n_blocks // s)

    eligible = [s for s in range(1, top + 1) if s == 1 or blocks_per_split(s) != blocks_per_split(s - 1)]
    eff = {}
    for s in eligible:
        w = torch.tensor(batch_nheads_mblocks * s, dtype=torch.float32) / num_sms   # float, as in C++
        eff[s] = float(w / torch.ceil(w))
    best = max(eff.values())
    return next((s for s in eligible if eff[s] >= 0.85 * best), 1)


def fa2_num_splits(B: int, H: int, Hkv: int, Nk: int, d: int, Nq: int = 1, n_sms: int = H200_SMS,
                   dropout_p: float = 0.0) -> int:
    """The split count FlashAttention-2 picks by itself (``num_splits=0``), as ``set_params_splitkv``
    in ``csrc/flash_attn/flash_api.cpp`` computes it (the recent source; an older revision of the
    file, commit 765fbd9, passed ``multiProcessorCount`` instead of twice it, and at most 64 splits).

    - no split with dropout (the split kernel has none);
    - decode with GQA (``Nq == 1``, ``H > Hkv``, ``d % 8 == 0``, no window, no ALiBi) is first
      reshaped (``seqlenq_ngroups_swapped``): the G query heads of a KV head become G query
      *rows*, so the heuristic counts ``B * Hkv`` heads with ``ceil(G / 64)`` row blocks;
    - row blocks of 64 (the split kernel's ``kBlockM``); key tiles ``kBlockN`` = 256 for
      ``d <= 64``, 128 for ``d <= 128``, else 64;
    - ``num_splits_heuristic(B * heads * m_blocks, 2 * SMs, n_blocks, 128)``: twice the SMs
      "to hard-code the fact that we're using 128 threads per block" (the source's comment).
    """
    if H % Hkv or min(B, H, Hkv, Nk, d, Nq, n_sms) < 1:
        raise ValueError(f"fa2_num_splits: need positive sizes and H % Hkv == 0, got H={H}, Hkv={Hkv}")
    if dropout_p > 0:
        return 1
    heads, rows = H, Nq
    if Nq == 1 and H > Hkv and d % 8 == 0:               # seqlenq_ngroups_swapped
        heads, rows = Hkv, H // Hkv
    block_n = 256 if d <= 64 else 128 if d <= 128 else 64
    n_blocks = -(-Nk // block_n)
    m_blocks = -(-rows // 64)
    return num_splits_heuristic(B * heads * m_blocks, 2 * n_sms, n_blocks, 128)


# ----------------------------------------------------------------- bytes and time
def decode_flops_per_byte(G: int = 1, bytes_per_elem: int = 2) -> float:
    """Arithmetic intensity of decode attention when each KV head is read once for its G query heads.

    Per key and KV head: K_j and V_j are ``2 * d`` numbers (``2 * d * bytes_per_elem`` bytes);
    each of the G query heads does ``2 * d`` FLOPs for ``q . K_j`` and ``2 * d`` for ``p * V_j``:
    ``4 * d * G`` FLOPs. So ``2 * G / bytes_per_elem`` FLOP/byte: G in bf16/fp16, 1 per query head.
    (A kernel that re-reads the KV head for every query head gets 1 FLOP/byte whatever G is.)
    """
    if G < 1 or bytes_per_elem <= 0:
        raise ValueError(f"decode_flops_per_byte: need G >= 1 and bytes_per_elem > 0, got {G}, {bytes_per_elem}")
    return 2 * G / bytes_per_elem


def kv_bytes_per_token(layers: int, Hkv: int, d: int, bytes_per_elem: int = 2, **_) -> int:
    """Bytes of K and V one token adds to the cache, over all layers (bf16: 2 bytes)."""
    return 2 * layers * Hkv * d * bytes_per_elem


def decode_kv_time_s(Nk: int, B: int = 1, bandwidth: float = H200_BYTES_PER_S, **model) -> float:
    """Lower bound on the attention part of one decode step: read every K and V once."""
    return B * Nk * kv_bytes_per_token(**model) / bandwidth


# ----------------------------------------------------------------- a paged cache
def make_paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int, extra_pages: int = 3,
                     seed: int = 0, fill: float = 50.0):
    """Cut a contiguous cache k, v ``[Hkv, Nk, d]`` into pages and scatter them in a pool.

    Returns ``(k_pages, v_pages, block_table, seqlen)``: the pools ``[num_pages, page_size,
    Hkv, d]`` (the library's layout), ``block_table`` int32 ``[n_logical]`` with
    ``block_table[p]`` = the physical page holding tokens ``p*page_size ...``, and the
    number of valid tokens. Unused slots (the tail of the last page, the extra pages)
    hold ``fill``, so reading them changes the answer.
    """
    Hkv, Nk, d = k.shape
    n_logical = max(1, -(-Nk // page_size))
    num_pages = n_logical + extra_pages
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)
    block_table = perm[:n_logical].to(torch.int32)
    k_pages = torch.full((num_pages, page_size, Hkv, d), fill, dtype=k.dtype)
    v_pages = torch.full((num_pages, page_size, Hkv, d), -fill, dtype=v.dtype)
    for p in range(n_logical):
        t0, t1 = p * page_size, min((p + 1) * page_size, Nk)
        k_pages[block_table[p], : t1 - t0] = k[:, t0:t1].transpose(0, 1)   # [t1-t0, Hkv, d]
        v_pages[block_table[p], : t1 - t0] = v[:, t0:t1].transpose(0, 1)
    return k_pages, v_pages, block_table, Nk


# ----------------------------------------------------------------- figures
def plot_work_units(H: int = 32, n_sms: int = H200_SMS, ax=None):
    """Blocks per launch against the SMs: prefill (one per query block), decode, decode with splits."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(8, 3.6))[1]
    batches = [1, 2, 4, 8, 16, 32]
    rows = [("prefill, 4k tokens (split over Q)", dict(Nq=4096)),
            ("decode (one query token)", dict(Nq=1)),
            ("decode, 8 KV splits", dict(Nq=1, num_splits=8))]
    width = 0.27
    for i, (label, kw) in enumerate(rows):
        units = [work_units(B, H, **kw) for B in batches]
        ax.bar([x + (i - 1) * width for x in range(len(batches))], units, width, label=label)
    ax.axhline(n_sms, color="k", ls="--", lw=1)
    ax.text(len(batches) - 0.5, n_sms * 1.1, f"{n_sms} SMs", ha="right", va="bottom")
    ax.set_yscale("log")
    ax.set_xticks(range(len(batches)), [f"B={B}" for B in batches])
    ax.set_ylabel("independent blocks")
    ax.set_title(f"Work units per launch, H = {H} query heads")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_decode_time(Nks=(1024, 4096, 16384, 65536, 131072), B: int = 1, ax=None):
    """Time to read K and V once per decode step, for each model in ``MODELS``."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(6.5, 3.6))[1]
    for name, cfg in MODELS.items():
        ax.plot(Nks, [decode_kv_time_s(N, B, **cfg) * 1e3 for N in Nks], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache length Nk (tokens)")
    ax.set_ylabel("ms per token (K, V reads only)")
    ax.set_title(f"Decode, batch {B}: bytes of K and V / 4.8 TB/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def render_explorer(B: int = 1, H: int = 8, Nk: int = 1000, num_splits: int = 4, n_sms: int = H200_SMS):
    """The explorer's picture: the SMs filled by B*H*splits blocks, and where the splits cut the cache.

    Returns ``(units, n_waves, efficiency, bounds)`` so a test can read what was drawn.
    """
    import matplotlib.pyplot as plt
    units = work_units(B, H, num_splits)
    n_waves, eff = waves(units, n_sms)
    bounds = split_bounds(Nk, num_splits)
    fig, (a0, a1) = plt.subplots(2, 1, figsize=(9, 4.2), gridspec_kw={"height_ratios": [1.4, 1]})
    # top: one column per SM, one row per wave; a filled cell runs a block
    grid = torch.zeros(n_waves, n_sms)
    for u in range(units):
        grid[u // n_sms, u % n_sms] = 1
    a0.imshow(grid, aspect="auto", cmap="Greens", vmin=0, vmax=1.3, interpolation="nearest")
    a0.set_yticks(range(n_waves), [f"wave {w + 1}" for w in range(n_waves)] if n_waves <= 8 else None)
    if n_waves > 8:
        a0.set_yticks([])
    a0.set_xlabel("SM")
    a0.set_title(f"B={B} x H={H} x splits={num_splits} = {units} blocks on {n_sms} SMs: "
                 f"{n_waves} wave(s), {eff:.0%} of SM slots busy", fontsize=10)
    # bottom: the KV cache, coloured by split
    cmap = plt.get_cmap("tab20")
    for s, (a, b) in enumerate(bounds):
        if b > a:
            a1.barh(0, b - a, left=a, color=cmap(s % 20), edgecolor="k", lw=0.5)
            if num_splits <= 16:
                a1.text((a + b) / 2, 0, str(s), ha="center", va="center", fontsize=8)
    empty = sum(1 for a, b in bounds if a == b)
    a1.set_xlim(0, max(Nk, 1))
    a1.set_yticks([])
    a1.set_xlabel("key position in the cache")
    chunk = bounds[0][1] - bounds[0][0]
    a1.set_title(f"Nk={Nk}: {num_splits} splits of up to {chunk} keys"
                 + (f", {empty} empty (lse = -inf, O = 0)" if empty else ""), fontsize=10)
    fig.tight_layout()
    return units, n_waves, eff, bounds


def plot_paged_cache(block_table, seqlen: int, page_size: int, num_pages: int, ax=None):
    """Logical pages of one sequence (top) and where they live in the page pool (bottom)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(9, 2.8))[1]
    bt = [int(p) for p in block_table]
    cmap = plt.get_cmap("tab10")
    for p, phys in enumerate(bt):
        used = min(page_size, seqlen - p * page_size)
        c = cmap(p % 10)
        ax.add_patch(plt.Rectangle((p, 1.2), 0.9, 0.6, color=c))
        ax.text(p + 0.45, 1.5, f"L{p}\n{used}/{page_size}", ha="center", va="center", fontsize=8)
        ax.add_patch(plt.Rectangle((phys, 0), 0.9, 0.6, color=c))
        ax.annotate("", xy=(phys + 0.45, 0.62), xytext=(p + 0.45, 1.18),
                    arrowprops=dict(arrowstyle="->", color="0.4", lw=0.8))
    for phys in range(num_pages):
        if phys not in bt:
            ax.add_patch(plt.Rectangle((phys, 0), 0.9, 0.6, fill=False, ec="0.6", ls=":"))
        ax.text(phys + 0.45, -0.25, f"P{phys}", ha="center", fontsize=8)
    ax.set_xlim(-0.2, max(num_pages, len(bt)) + 0.2)
    ax.set_ylim(-0.5, 2.0)
    ax.axis("off")
    ax.set_title(f"block_table = {bt}: logical page -> physical page (seqlen {seqlen}, page_size {page_size})",
                 fontsize=10)
    return ax


# ----------------------------------------------------------------- the course's references (the exercises' signatures)
def combine_splits_ref(o_parts, lse_parts):
    """(O [H, d], lse [H]) from S partials [S, H, d], [S, H]: weights exp(lse_s - lse); empty splits weigh 0."""
    lse = torch.logsumexp(lse_parts, dim=0)                                # [H]
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
    w = torch.exp(lse_parts - lse_safe)                                    # [S, H], 0 for an empty split
    return (w[:, :, None] * o_parts).sum(0), lse


def flash_decode_ref(q, k, v, num_splits=4):
    """Split-KV decode: q [H, d], k and v [Hkv, Nk, d] -> (O [H, d], lse [H]); head h reads KV head h // G."""
    H, d = q.shape
    Hkv, Nk, _ = k.shape
    G = H // Hkv
    o_parts = torch.zeros(num_splits, H, d, dtype=q.dtype)
    lse_parts = torch.full((num_splits, H), -math.inf, dtype=q.dtype)
    for s, (a, b) in enumerate(split_bounds(Nk, num_splits)):
        if b <= a:
            continue                                                       # an empty split: (0, -inf)
        for g in range(Hkv):
            S = q[g * G:(g + 1) * G] @ k[g, a:b].T / math.sqrt(d)          # [G, n]
            lse_parts[s, g * G:(g + 1) * G] = torch.logsumexp(S, -1)
            o_parts[s, g * G:(g + 1) * G] = torch.softmax(S, -1) @ v[g, a:b]   # [G, d]
    return combine_splits_ref(o_parts, lse_parts)


def flash_decode_paged_ref(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
    """Decode over a paged cache (pools [num_pages, page_size, Hkv, d]): the logical pages are cut into
    splits, each split reads only its own pages through block_table; the partials are combined."""
    H, d = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    G = H // Hkv
    n_pages = -(-seqlen // page_size)
    o_parts = torch.zeros(num_splits, H, d, dtype=q.dtype)
    lse_parts = torch.full((num_splits, H), -math.inf, dtype=q.dtype)
    for s, (a, b) in enumerate(split_bounds(n_pages, num_splits)):
        if b <= a:
            continue                                                       # no page in this split
        idx = block_table[a:b].long()
        n = min(seqlen, b * page_size) - a * page_size                     # real tokens in these pages
        k = k_pages[idx].reshape(-1, Hkv, d)[:n]                           # [n, Hkv, d]
        v = v_pages[idx].reshape(-1, Hkv, d)[:n]
        for g in range(Hkv):
            S = q[g * G:(g + 1) * G] @ k[:, g].T / math.sqrt(d)            # [G, n]
            lse_parts[s, g * G:(g + 1) * G] = torch.logsumexp(S, -1)
            o_parts[s, g * G:(g + 1) * G] = torch.softmax(S, -1) @ v[:, g]
    return combine_splits_ref(o_parts, lse_parts)


def plot_split_weights(lse_parts: torch.Tensor, head: int = 0, ax=None):
    """The combine's weights exp(lse_s - lse) for one head: a softmax over the splits' lse."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(6, 2.8))[1]
    w = torch.softmax(lse_parts[:, head].double(), dim=0)          # [S]
    w = torch.nan_to_num(w, nan=0.0)
    ax.bar(range(len(w)), w.tolist(), color="tab:blue")
    ax.set_xlabel("split s")
    ax.set_ylabel("exp(lse_s - lse)")
    ax.set_title(f"head {head}: each split's share of the softmax mass (sums to {float(w.sum()):.3f})", fontsize=10)
    return w


# ----------------------------------------------------------------- measured: what the splits buy
def split_sweep_rows(res) -> list[dict]:
    """The paged-decode rows of a record (``res["paged"]``) as ``{..., "gbs": {num_splits: GB/s}}``.

    Each row's own run (its default ``num_splits``, ``triton_gbs``) and the other counts it swept
    (``splits_sweep_gbs``), one dict per row, sorted by (dtype, B, mean_len, block_size).
    """
    out = []
    for r in (res or {}).get("paged") or []:
        gbs = {int(s): g for s, g in (r.get("splits_sweep_gbs") or {}).items() if g}
        if r.get("triton_gbs"):
            gbs[int(r["num_splits"])] = r["triton_gbs"]
        out.append(dict(dtype=r["dtype"], B=r["B"], H=r["H"], Hkv=r["Hkv"], d=r["d"], block_size=r["block_size"],
                        mean_len=r["mean_len"], default=int(r["num_splits"]), gbs=dict(sorted(gbs.items()))))
    return sorted(out, key=lambda r: (r["dtype"], r["B"], r["mean_len"], r["block_size"]))


def _label(res) -> str:
    from ..results import results_label
    timing = ((res or {}).get("paged_meta") or {}).get("timing", "").split(";")[0]
    return results_label(res, "paged") + (f" · {timing}" if timing else "")


def split_sweep_table(res) -> str:
    """A plain-text table: GB/s of the paged decode at each number of splits measured (* = the default's)."""
    rows = split_sweep_rows(res)
    if not rows:
        return "paged decode: no rows in this record (not measured yet)"
    counts = sorted({s for r in rows for s in r["gbs"]})
    lines = ["paged decode, GB/s (K and V read once) by num_splits (* = the kernel's default); " + _label(res),
             f"{'dtype':>8} {'B':>3} {'H':>3} {'Hkv':>3} {'block':>5} {'mean_len':>8} {'B·Hkv':>5} "
             + " ".join(f"{f'{s} split' + ('s' if s > 1 else ''):>9}" for s in counts)]
    for r in rows:
        cells = [(f"{r['gbs'][s]:.0f}" + ("*" if s == r["default"] else " ")) if s in r["gbs"] else "— "
                 for s in counts]
        lines.append(f"{r['dtype']:>8} {r['B']:>3} {r['H']:>3} {r['Hkv']:>3} {r['block_size']:>5} "
                     f"{r['mean_len']:>8} {r['B'] * r['Hkv']:>5} " + " ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def split_sweep_summary(res) -> str:
    """One line per batch size: the slowest and the fastest number of splits and their GB/s ratio, per row
    (a geometric mean over the block sizes), with the record's label."""
    from ..results import geomean
    rows = split_sweep_rows(res)
    if not rows:
        return "paged decode: no rows in this record (not measured yet)"
    lines = []
    for B in sorted({r["B"] for r in rows}):
        sel = [r for r in rows if r["B"] == B and len(r["gbs"]) > 1]
        if not sel:
            continue
        common = sorted(set.intersection(*(set(r["gbs"]) for r in sel)))
        mean = {s: geomean([r["gbs"][s] for r in sel]) for s in common}
        lo, hi = min(mean, key=mean.get), max(mean, key=mean.get)
        lines.append(f"B = {B} ({sel[0]['B'] * sel[0]['Hkv']} KV-head programs per split, {len(sel)} rows): "
                     f"fastest at {hi} splits, {mean[hi] / mean[lo]:.2f}x the GB/s of {lo} "
                     f"(geomean over the rows; the kernel's default: "
                     f"{' or '.join(str(s) for s in sorted({r['default'] for r in sel}))})")
    return "\n".join(lines + [_label(res)])
