"""Plain functions behind notebook 07 (the Triton GPU port): references, tile classes,
split bounds, and the benchmark tables and plots.

Nothing here imports Triton at module level: ``helpers.lesson07.check`` imports this file
whenever any notebook runs ``from helpers import check``. The GPU timing functions import
``triton`` inside themselves and are only called on a CUDA machine.

References: ``helpers.reference`` (float64 SDPA and ``torch.logsumexp``); the benchmark file
``bench/results/h200.json`` written by ``make bench`` (format in the notebook).
"""
from __future__ import annotations



import torch

from .. import reference, triton_mode
from ..results import RESULTS, load_results, plot_tflops, results_label, section_rows
from ..results import fmt as _f
from ..results import geomean_ratio as _geomean_ratio
from ..triton_mode import TritonMissing  # noqa: F401 - the stop every Triton lesson raises

__all__ = ["LOG2E", "LN2", "reference_bhnd", "reference_decode", "split_bounds", "tile_classes",
           "plot_tile_classes", "sdpa_error", "load_results", "results_label", "prefill_rows",
           "decode_rows", "prefill_table", "decode_table", "geomean_ratio", "prefill_summary", "decode_summary", "plot_prefill", "plot_decode",
           "bench_prefill_live", "bench_decode_live", "measure_ceilings", "RESULTS",
           "TritonMissing", "require_triton", "show_recorded_results"]

LOG2E, LN2 = reference.LOG2E, reference.LN2  # log2(e), ln(2): the kernels work in base 2

OFF_BAND, ON_BAND, SKIPPED = 1, 2, 0


# ------------------------------------------------------------------ references
def reference_bhnd(q, k, v, causal=False, sm_scale=None):
    """(O, lse) in float64 for q ``[B, H, N, d]``, k, v ``[B, H, Nk, d]``; causal is top-left (j <= i)."""
    mask = reference.causal_mask(q.shape[-2], k.shape[-2], "top_left") if causal else None
    return reference.attention(q, k, v, mask=mask, scale=sm_scale)


def reference_decode(q, k, v, sm_scale=None):
    """O in float64 for one new token: q ``[B, H, d]``, k, v ``[B, Hkv, Nk, d]`` (GQA: head h reads h // (H/Hkv))."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                     # [B, H, Nk, d]
    v = v.repeat_interleave(group, dim=1)                     # [B, H, Nk, d]
    o, _ = reference.attention(q[:, :, None, :], k, v, scale=sm_scale)   # [B, H, 1, d]
    return o[:, :, 0]                                          # [B, H, d]




def sdpa_error(q, k, v, o_ref, causal=False, sm_scale=None):
    """max |SDPA(q, k, v) - o_ref| with SDPA run in q's own dtype: the yardstick of FlashAttention's tests."""
    import torch.nn.functional as F
    mask = reference.causal_mask(q.shape[-2], k.shape[-2], "top_left", device=q.device) if causal else None
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)
    return (o.double().cpu() - o_ref.cpu()).abs().max().item()


# ------------------------------------------------------------------ the kernels' bookkeeping
def split_bounds(Nk: int, num_splits: int):
    """The key ranges ``[(lo, hi)]`` of Flash-Decoding's splits: ``cdiv(Nk, num_splits)`` keys each.

    The last splits can be short or empty (lo >= hi) when num_splits does not divide Nk.
    """
    per = -(-Nk // num_splits)
    return [(min(s * per, Nk), min((s + 1) * per, Nk)) for s in range(num_splits)]


def band(start_m: int, N: int, Nk: int, BLOCK_M: int, BLOCK_N: int, causal: bool):
    """(band_lo, band_hi) of one query block, as the kernel computes them.

    Key tiles in ``[0, band_lo)`` are seen in full by every row of the block (off-band, no mask);
    ``[band_lo, band_hi)`` need a mask (the causal diagonal, the ragged last tile); keys from
    ``band_hi`` on are seen by no row of the block and never loaded.
    """
    full = (Nk // BLOCK_N) * BLOCK_N                          # end of the whole tiles
    if not causal:
        return full, Nk
    row0 = start_m * BLOCK_M                                  # the block's first row sees keys j <= row0
    band_lo = min(((row0 + 1) // BLOCK_N) * BLOCK_N, full)
    band_hi = min(row0 + BLOCK_M, Nk)                         # its last row sees keys j <= row0 + BLOCK_M - 1
    return band_lo, max(band_hi, band_lo)


def tile_classes(N: int, Nk: int, BLOCK_M: int, BLOCK_N: int, causal: bool) -> torch.Tensor:
    """int ``[cdiv(N, BLOCK_M), cdiv(Nk, BLOCK_N)]``: 1 off-band (no mask), 2 on-band (masked), 0 never visited."""
    nm, nn = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
    out = torch.zeros(nm, nn, dtype=torch.int64)
    for i in range(nm):
        lo, hi = band(i, N, Nk, BLOCK_M, BLOCK_N, causal)
        for j in range(nn):
            start = j * BLOCK_N
            out[i, j] = OFF_BAND if start < lo else ON_BAND if start < hi else SKIPPED
    return out


def plot_tile_classes(N=256, Nk=256, BLOCK_M=64, BLOCK_N=32, causal=True, ax=None):
    """The grid of one head's programs (rows) and key tiles (columns), coloured by class."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    cls = tile_classes(N, Nk, BLOCK_M, BLOCK_N, causal)
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 4))
    ax.imshow(cls.numpy(), cmap=ListedColormap(["#eeeeee", "#4c72b0", "#dd8452"]), vmin=0, vmax=2,
              aspect="auto", interpolation="nearest")
    counts = {c: int((cls == c).sum()) for c in (OFF_BAND, ON_BAND, SKIPPED)}
    ax.set_title(f"N={N}, Nk={Nk}, BLOCK_M={BLOCK_M}, BLOCK_N={BLOCK_N}, causal={causal}\n"
                 f"blue: off-band, no mask ({counts[OFF_BAND]})   orange: masked ({counts[ON_BAND]})   "
                 f"grey: never visited ({counts[SKIPPED]})", fontsize=8)
    ax.set_xlabel("key tile (BLOCK_N keys)")
    ax.set_ylabel("program = query block (BLOCK_M rows)")
    return ax


# ------------------------------------------------------------------ benchmark results
def prefill_rows(res, dtype=None, d=None, causal=None):
    return section_rows(res, "prefill", dtype, d, causal)


def geomean_ratio(res, other: str, min_N: int = 2048, **filters):
    """Geometric mean over prefill rows with N >= min_N of triton_tflops / ``other`` (None if no row has both)."""
    return _geomean_ratio(res, "prefill", other, min_N, **filters)


_IMPLS = [("triton_tflops", "Triton (this course)", "-o"), ("sdpa_flash_tflops", "SDPA flash", "--s"),
          ("sdpa_cudnn_tflops", "SDPA cuDNN", "--^"), ("sdpa_efficient_tflops", "SDPA efficient", ":v")]


def plot_prefill(res, ceilings=None):
    """TFLOP/s against N, one panel per (dtype, d, causal); ``ceilings={'tflops': x}`` draws the matrix rate."""
    return plot_tflops(res, "prefill", _IMPLS, "no prefill rows in these results", ceilings)


def plot_decode(res, ceilings=None):
    """Effective GB/s against the cache length Nk, one line per (B, H, Hkv, d, dtype) and implementation."""
    import matplotlib.pyplot as plt
    rows = decode_rows(res)
    if not rows:
        raise ValueError("no decode rows in these results")
    groups = sorted({(r["dtype"], r["B"], r["H"], r["Hkv"], r["d"]) for r in rows})
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for gi, (dt, B, H, Hkv, d) in enumerate(groups):
        sel = [r for r in rows if (r["dtype"], r["B"], r["H"], r["Hkv"], r["d"]) == (dt, B, H, Hkv, d)]
        c = colors[gi % len(colors)]
        a = ax[0] if H == Hkv else ax[1]
        for key, style, lab in (("triton_gbs", "-o", "Triton"), ("sdpa_cudnn_gbs", "--^", "cuDNN"),
                                ("sdpa_flash_gbs", ":s", "flash")):
            pts = [(r["Nk"], r[key]) for r in sel if r.get(key)]
            if pts:
                a.plot(*zip(*pts), style, color=c, ms=3, label=f"{lab} {dt} B={B} H={H}/{Hkv} d={d}")
    for a, title in zip(ax, ("MHA (H = Hkv)", "GQA (H > Hkv)")):
        if ceilings and ceilings.get("gbs"):
            a.axhline(ceilings["gbs"], color="k", lw=0.8, ls=":", label="measured copy bandwidth")
        a.set_xscale("log", base=2)
        a.set_xlabel("cache length Nk")
        a.set_title(title, fontsize=9)
        if a.lines:
            a.legend(fontsize=6)
    ax[0].set_ylabel("GB/s (K and V read once)")
    fig.suptitle("decode: " + results_label(res, "decode"), fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ live timing (CUDA only)
def _do_bench(fn):
    """Median time of ``fn`` in ms, as ``bench/bench.py`` measures it (same warm-up and repetitions).

    ``triton.testing.do_bench`` returns the *mean* unless asked otherwise (its default
    ``return_mode="mean"``), so the statistic is named here: the live cells and the committed
    figures are then the same statistic.
    """
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # milliseconds


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _time_sdpa(backend, q, k, v, causal, **kw):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)  # fails here if the backend refuses
            return _do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw))
    except RuntimeError:
        return None


def bench_prefill_live(fn, Ns=(512, 1024, 2048, 4096, 8192), dtype=torch.float16, d=64, causal=False,
                       tokens=16384, H=16):
    """Rows in ``bench/results/h200.json``'s prefill format, timed now with do_bench (CUDA only)."""
    rows = []
    for N in Ns:
        B = max(1, tokens // N)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        tf = lambda ms: None if ms is None else flops / ms / 1e9  # noqa: E731 - ms -> TFLOP/s
        row = {"dtype": str(dtype).replace("torch.", ""), "d": d, "causal": causal, "N": N, "B": B, "H": H,
               "triton_tflops": tf(_do_bench(lambda: fn(q, k, v, causal=causal)))}
        for name, backend in _sdpa_backends().items():
            row[f"sdpa_{name}_tflops"] = tf(_time_sdpa(backend, q, k, v, causal))
        rows.append(row)
    return rows


def bench_decode_live(fn, Nks=(4096, 16384, 65536), B=8, H=32, Hkv=8, d=128, dtype=torch.float16):
    """Rows in the decode format (effective GB/s: K and V read once), timed now (CUDA only)."""
    rows = []
    for Nk in Nks:
        q = torch.randn(B, H, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, Hkv, Nk, d, device="cuda", dtype=dtype) for _ in range(2))
        nbytes = 2 * k.numel() * k.element_size()
        gbs = lambda ms: None if ms is None else nbytes / ms / 1e6  # noqa: E731 - ms -> GB/s
        row = {"dtype": str(dtype).replace("torch.", ""), "B": B, "H": H, "Hkv": Hkv, "Nk": Nk, "d": d,
               "num_splits": None, "triton_gbs": gbs(_do_bench(lambda: fn(q, k, v)))}
        for name in ("flash", "cudnn"):   # a backend that refuses GQA or this shape gives None
            row[f"sdpa_{name}_gbs"] = gbs(_time_sdpa(_sdpa_backends()[name], q[:, :, None], k, v, False,
                                                     enable_gqa=H != Hkv))
        rows.append(row)
    return rows


def measure_ceilings(dtype=torch.float16):
    """The chip's measured copy bandwidth (GB/s) and dense matmul rate (TFLOP/s), CUDA only."""
    x = torch.empty(2**28, device="cuda", dtype=torch.uint8)           # 256 MiB
    y = torch.empty_like(x)
    ms_copy = _do_bench(lambda: y.copy_(x))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
    ms_mm = _do_bench(lambda: a @ b)
    return {"gbs": 2 * x.numel() / ms_copy / 1e6, "tflops": 2 * 8192**3 / ms_mm / 1e9}


# ------------------------------------------------------------------ without Triton (macOS, Windows)
NO_TRITON = ("Triton is not installed in this Python (PyPI has it for Linux only, not for macOS or Windows), "
             "so this notebook's kernels cannot run here: below are the results recorded on an NVIDIA H200, "
             "and README.md (section 3) says how to run the kernels on Linux or in WSL2.")


def require_triton():
    """Return if Triton can run here; otherwise say so, show the recorded H200 results, and stop
    (``helpers.triton_mode.require_triton``: one line, no traceback)."""
    triton_mode.require_triton(NO_TRITON, show_recorded_results)


def show_recorded_results(res=None):
    """The committed benchmark (``bench/results/h200.json``): its summaries and tables, then its plots."""
    res = load_results() if res is None else res
    if res is None:
        print(f"(no recorded results: {RESULTS} is missing)")
        return
    print()
    print(prefill_summary(res))
    print(decode_summary(res))
    print()
    print(prefill_table(res))
    print()
    print(decode_table(res))
    import io

    import matplotlib.pyplot as plt
    figs = ([plot_prefill(res)] if res.get("prefill") else []) + ([plot_decode(res)] if res.get("decode") else [])
    try:
        from IPython.display import Image, display
    except ImportError:          # plain Python: matplotlib's own window
        plt.show()
        return
    for fig in figs:             # as PNGs now (whatever the backend), before the notebook stops
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        plt.close(fig)
        display(Image(data=buf.getvalue(), format="png"))


def decode_rows(res):
    return sorted((res or {}).get("decode") or [], key=lambda r: (r["dtype"], r["d"], r["H"], r["Hkv"], r["B"], r["Nk"]))


def prefill_table(res) -> str:
    """A plain-text table of the prefill rows: TFLOP/s of Triton and of SDPA's three backends."""
    head = f"{'dtype':>8} {'d':>4} {'causal':>6} {'N':>6} {'B':>3} {'H':>3} {'triton':>7} {'flash':>7} " \
           f"{'cudnn':>7} {'effic.':>7} {'tri/flash':>9} {'tri/cudnn':>9}"
    lines = ["prefill, TFLOP/s (FLOPs = 4·B·H·N²·d, halved when causal)", head]
    for r in section_rows(res, "prefill"):
        t, fl, cu = r.get("triton_tflops"), r.get("sdpa_flash_tflops"), r.get("sdpa_cudnn_tflops")
        lines.append(f"{r['dtype']:>8} {r['d']:>4} {str(bool(r['causal'])):>6} {r['N']:>6} {r['B']:>3} {r['H']:>3} "
                     f"{_f(t):>7} {_f(fl):>7} {_f(cu):>7} {_f(r.get('sdpa_efficient_tflops')):>7} "
                     f"{_f(t / fl if t and fl else None, 2):>9} {_f(t / cu if t and cu else None, 2):>9}")
    return "\n".join(lines)


def decode_table(res) -> str:
    """A plain-text table of the decode rows: effective GB/s (K and V read once)."""
    head = f"{'dtype':>8} {'B':>3} {'H':>3} {'Hkv':>3} {'Nk':>7} {'d':>4} {'splits':>6} {'triton':>7} " \
           f"{'flash':>7} {'cudnn':>7} {'tri/cudnn':>9}"
    lines = ["decode, GB/s (bytes = K and V read once); " + results_label(res, "decode"), head]
    for r in decode_rows(res):
        t, cu = r.get("triton_gbs"), r.get("sdpa_cudnn_gbs")
        lines.append(f"{r['dtype']:>8} {r['B']:>3} {r['H']:>3} {r['Hkv']:>3} {r['Nk']:>7} {r['d']:>4} "
                     f"{str(r.get('num_splits', '—')):>6} {_f(t):>7} {_f(r.get('sdpa_flash_gbs')):>7} {_f(cu):>7} "
                     f"{_f(t / cu if t and cu else None, 2):>9}")
    return "\n".join(lines)


def _statistic(res, section) -> str:
    meta = (res or {}).get(f"{section}_meta") or res or {}
    return meta.get("timing", "")


def prefill_summary(res, min_N: int = 2048) -> str:
    """The prefill rows in a few lines: the geometric means of Triton / SDPA flash and Triton / SDPA cuDNN over
    the rows with N >= min_N (every dtype, head dim and causal setting), how many of all the rows Triton is the
    faster on, and the label (GPU, versions, date) and statistic."""
    rows = section_rows(res, "prefill")
    if not rows:
        return "prefill: no rows in this record (not measured yet)"
    long = [r for r in rows if r["N"] >= min_N]
    dtypes = " and ".join(sorted({r["dtype"] for r in long}))
    lines = [f"prefill, geomean over N >= {min_N} ({dtypes}, d {' and '.join(str(d) for d in sorted({r['d'] for r in long}))}, "
             f"causal and not; {len(long)} rows):"]
    for other, name in (("sdpa_flash_tflops", "flash"), ("sdpa_cudnn_tflops", "cuDNN")):
        g = geomean_ratio(res, other, min_N)
        pairs = [(r["triton_tflops"], r[other]) for r in rows if r.get("triton_tflops") and r.get(other)]
        faster = sum(t > o for t, o in pairs)
        lines.append(f"  Triton / SDPA {name}: " + ("—" if g is None else f"{g:.2f}x")
                     + f"; Triton the faster on {faster} of {len(pairs)} rows (all N)")
    lines.append("  " + results_label(res, "prefill") + " · " + _statistic(res, "prefill"))
    return "\n".join(lines)


def decode_summary(res, min_cache_mib: float = 256) -> str:
    """The decode rows in a few lines: on caches of at least ``min_cache_mib`` MiB the range of Triton's GB/s and of
    Triton / cuDNN; on the smaller caches the same ratio; the label and statistic."""
    rows = decode_rows(res)
    if not rows:
        return "decode: no rows in this record (not measured yet)"
    big = [r for r in rows if r.get("cache_mib", 0) >= min_cache_mib and r.get("triton_gbs")]
    small = [r for r in rows if r.get("cache_mib", 0) < min_cache_mib and r.get("triton_gbs")]
    lines = ["decode, GB/s (K and V read once):"]
    for sel, what in ((big, f"caches of {min_cache_mib:g} MiB or more"), (small, "smaller caches")):
        cu = [r["triton_gbs"] / r["sdpa_cudnn_gbs"] for r in sel if r.get("sdpa_cudnn_gbs")]
        if sel:
            lines.append(f"  {what} ({len(sel)} rows): Triton {min(r['triton_gbs'] for r in sel):.0f} to "
                         f"{max(r['triton_gbs'] for r in sel):.0f} GB/s, Triton / cuDNN "
                         + (f"{min(cu):.2f}x to {max(cu):.2f}x" if cu else "—"))
    lines.append("  " + results_label(res, "decode") + " · " + _statistic(res, "decode"))
    return "\n".join(lines)
