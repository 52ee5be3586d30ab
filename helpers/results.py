"""The recorded GPU results as the lessons read them: every reader of ``bench/results/``, the label of a
section (GPU, versions, date), a section's rows, the geometric-mean ratios, and the tables the lessons
print (07: prefill and decode, 08: backward, 09: the ring, 10: serving, 11: the Gluon forward).

Files (written by the bench scripts through ``bench/common.py``):
- ``h200.json`` (``RESULTS``, lessons 07, 08 and 10): one section per script (``prefill``, ``decode``,
  ``backward``, ``varlen``, ``paged``), each with its own ``<section>_meta``; the top-level
  gpu/torch/triton/date are the prefill run's in files written before each section carried a meta.
- ``train_gpt.json`` (``TRAINING``, lesson 08): bench/train_gpt.py's record.
- ``ring_h200x2.json`` (``RING``, lesson 09): bench/ring_gpu.py's two-GPU rows.
- ``gluon_h200.json`` (``GLUON``, lesson 11): bench/bench_gluon.py's ``meta`` and ``rows`` (non-causal; per row
  ``<variant>_tflops`` of the Gluon kernels beside ``triton_tflops`` and SDPA's ``sdpa_flash_tflops``,
  ``sdpa_cudnn_tflops``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["RESULTS", "TRAINING", "RING", "load_json", "load_results", "load_training", "load_gpu_results",
           "results_label", "section_rows", "plot_tflops", "geomean", "geomean_ratio", "fmt", "decode_rows", "prefill_table",
           "decode_table", "backward_table", "gpu_results_table", "NOT_MEASURED", "serving_results",
           "serving_tables", "GLUON", "GLUON_FA3", "GLUON_VARIANTS", "load_gluon", "gluon_label", "gluon_ratios",
           "GLUON_FORWARD", "GLUON_BACKWARD", "gluon_targets", "gluon_targets_table",
           "gluon_table", "plot_gluon", "GLUON_PROFILE", "gluon_profile", "gluon_profile_table"]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
RESULTS = RESULTS_DIR / "h200.json"
TRAINING = RESULTS_DIR / "train_gpt.json"
RING = RESULTS_DIR / "ring_h200x2.json"
GLUON = RESULTS_DIR / "gluon_h200.json"
GLUON_FA3 = RESULTS_DIR / "gluon_h200_variants.json"  # FA3's overlap and ping-pong variants, N = 16384
GLUON_FORWARD = RESULTS_DIR / "gluon_forward_h200.json"    # issue 26's forward target: variant "auto" vs SDPA
GLUON_BACKWARD = RESULTS_DIR / "gluon_backward_h200.json"  # issue 26's backward target: gluon_backward vs SDPA
GLUON_PROFILE = RESULTS_DIR / "gluon_profile_h200.json"    # bench/profile_gluon.py: Nsight Compute, Gluon vs cuDNN


def load_json(path):
    """The JSON at path, or None when the file is not there (yet)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def load_results(path=RESULTS):
    """The committed benchmark (a dict), or None when the file is not there yet."""
    return load_json(path)


def load_training(path=TRAINING):
    """The GPT training record (bench/train_gpt.py), or None when none is recorded."""
    return load_json(path)


def load_gpu_results(path=RING):
    """The recorded two-GPU ring measurement (bench/ring_gpu.py's JSON), or None when none is recorded."""
    return load_json(path)


def results_label(res, section: str | None = None) -> str:
    """GPU, versions and date of the run behind ``section`` (its ``<section>_meta``, else the top level)."""
    res = res or {}
    meta = res.get(f"{section}_meta", res) if section else res
    return (f"{meta.get('gpu', meta.get('device_name', '?'))} · torch {meta.get('torch', '?')} · "
            f"triton {meta.get('triton', '?')} · {meta.get('date', '?')}")


def section_rows(res, section: str, dtype=None, d=None, causal=None) -> list:
    """The rows of a prefill-shaped section (``prefill``, ``backward``), filtered, sorted by (dtype, d, causal, N)."""
    rows = [r for r in (res or {}).get(section, [])
            if (dtype is None or r["dtype"] == dtype) and (d is None or r["d"] == d)
            and (causal is None or bool(r["causal"]) == bool(causal))]
    return sorted(rows, key=lambda r: (r["dtype"], r["d"], bool(r["causal"]), r["N"]))


def plot_tflops(res, section: str, impls, empty: str, ceilings=None):
    """TFLOP/s against N, one panel per (dtype, d, causal) of a prefill-shaped section (``prefill``,
    ``backward``), one line per ``(row key, label, style)`` of ``impls``; ``ceilings={'tflops': x}`` draws the
    matrix rate. Raises ValueError(``empty``) when the section has no rows."""
    import matplotlib.pyplot as plt
    keys = sorted({(r["dtype"], r["d"], bool(r["causal"])) for r in section_rows(res, section)})
    if not keys:
        raise ValueError(empty)
    cols = min(4, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.0 * nrows), squeeze=False)
    for ax, (dt, d, causal) in zip(axes.flat, keys):
        rows = section_rows(res, section, dt, d, causal)
        for key, label, style in impls:
            pts = [(r["N"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, label=label, ms=3)
        if ceilings and ceilings.get("tflops"):
            ax.axhline(ceilings["tflops"], color="k", lw=0.8, ls=":", label="measured matmul rate")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dt}, d={d}, {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{section}: " + results_label(res, section), fontsize=10)
    fig.tight_layout()
    return fig


def geomean(xs):
    """Geometric mean of the numbers in xs, missing ones (None, 0) left out; None when none is left."""
    logs = [math.log(x) for x in xs if x]
    return math.exp(sum(logs) / len(logs)) if logs else None


def geomean_ratio(res, section: str, other: str, min_N: int = 2048, **filters):
    """Geometric mean over ``section``'s rows with N >= min_N of triton_tflops / ``other`` (None if no row has both)."""
    return geomean([r["triton_tflops"] / r[other] for r in section_rows(res, section, **filters)
                    if r["N"] >= min_N and r.get("triton_tflops") and r.get(other)])


def fmt(x, nd=0) -> str:
    """A table cell: x with nd decimals, or an em dash for a missing number."""
    return "—" if x is None else f"{x:.{nd}f}"


_f = fmt


# ------------------------------------------------------------------ the tables the lessons show
# lesson 07: prefill and decode


def decode_rows(res):
    return sorted(res.get("decode", []), key=lambda r: (r["dtype"], r["d"], r["H"], r["Hkv"], r["B"], r["Nk"]))


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


# lesson 08: the backward
def backward_table(res) -> str:
    """A plain-text table of the backward rows: TFLOP/s (FLOPs = 2.5 x 4BHN²d, halved when causal)."""
    lines = ["backward alone, TFLOP/s (FLOPs = 2.5·4·B·H·N²·d, halved when causal); " + results_label(res, "backward"),
             f"{'dtype':>8} {'d':>4} {'causal':>6} {'N':>6} {'triton':>7} {'flash':>6} {'cudnn':>6} {'flex':>6} "
             f"{'t/flash':>7} {'t/cudnn':>7} {'err/sdpa':>8} {'ok':>3}"]
    for r in section_rows(res, "backward"):
        t, f, c = r.get("triton_tflops"), r.get("sdpa_flash_tflops"), r.get("sdpa_cudnn_tflops")
        lines.append(f"{r['dtype']:>8} {r['d']:>4} {str(bool(r['causal'])):>6} {r['N']:>6} {_f(t):>7} {_f(f):>6} "
                     f"{_f(c):>6} {_f(r.get('flex_tflops')):>6} {_f(t / f if t and f else None, 2):>7} "
                     f"{_f(t / c if t and c else None, 2):>7} {_f(r.get('err_ratio'), 2):>8} "
                     f"{'✓' if r.get('pass') else '✗':>3}")
    return "\n".join(lines)


# lesson 09: ring attention on two GPUs
def gpu_results_table(res) -> str:
    """The "ring" rows as a text table, with the machine, versions and date; each row says whether it was causal."""
    meta = res.get("meta", {})
    lines = [f"{meta.get('gpus', '?')} x {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, {meta.get('date', '?')}",
             f"{'layout':10s} {'causal':>6s} {'overlap':>7s} {'N':>8s} {'ring ms':>9s} {'1 GPU ms':>9s} {'speedup':>8s}"]
    for row in res.get("ring", []):
        single = row.get("single_gpu_ms")
        lines.append(f"{row['layout']:10s} {str(bool(row.get('causal'))):>6s} {str(row['overlap']):>7s} "
                     f"{row['N']:>8d} {row['ms']:>9.2f} "
                     f"{(f'{single:.2f}' if single else 'n/a'):>9s} "
                     f"{(format(row['speedup'], '.2f') + 'x' if row.get('speedup') else 'n/a'):>8s}")
    return "\n".join(lines)


# lesson 10: serving (varlen prefill, paged decode, decode)
NOT_MEASURED = "not measured yet"


def serving_results(res) -> dict:
    """``{"varlen": [...], "paged": [...], "decode": [...]}``: the rows of each section, [] when absent."""
    res = res or {}
    return {key: list(res.get(key) or []) for key in ("varlen", "paged", "decode")}


def _ratio(a, b):
    return _f(a / b if a and b else None, 2)


def _lengths_label(row) -> str:
    """A varlen row's length mix: its name ("mix") and the lengths (a list, or bench_varlen's summary dict)."""
    lengths = row.get("lengths")
    if isinstance(lengths, dict) and {"count", "min", "max"} <= set(lengths):
        text = f"{lengths['count']} seqs {lengths['min']}-{lengths['max']}"
    elif isinstance(lengths, (list, tuple)) and lengths:
        text = f"{len(lengths)} seqs {min(lengths)}-{max(lengths)}"
    else:
        text = str(lengths) if lengths else ""
    return " ".join(x for x in (str(row.get("mix") or ""), text) if x) or "?"


def _graph_gbs(r):
    return r.get("triton_graph_gbs", r.get("triton_gbs_graph"))


def serving_tables(res) -> str:
    """The three tables, each with its label, or "not measured yet" for a section with no rows."""
    rows = serving_results(res)
    out = []
    out.append("varlen prefill (packed), TFLOP/s of useful work (padding not counted); median of do_bench")
    if rows["varlen"]:
        out.append("  " + results_label(res, "varlen"))
        out.append(f"{'dtype':>8} {'d':>4} {'causal':>6} {'H':>3} {'Hkv':>3} {'tokens':>7} {'lengths':>30} "
                   f"{'varlen':>7} {'dense':>7} {'padded':>7} {'v/dense':>7} {'v/padded':>8}")
        for r in rows["varlen"]:
            t, dn, sp = r.get("triton_tflops"), r.get("dense_triton_tflops"), r.get("sdpa_padded_tflops")
            out.append(f"{r.get('dtype', '?'):>8} {r.get('d', '?'):>4} {str(bool(r.get('causal'))):>6} "
                       f"{r.get('H', '?'):>3} {r.get('Hkv', '?'):>3} {r.get('total_tokens', '?'):>7} "
                       f"{_lengths_label(r)[:30]:>30} {_f(t):>7} {_f(dn):>7} {_f(sp):>7} "
                       f"{_ratio(t, dn):>7} {_ratio(t, sp):>8}")
    else:
        out.append(f"  {NOT_MEASURED}")
    out.append("")
    out.append("paged decode, GB/s (K and V read once); median of do_bench, graph: median of do_bench_cudagraph")
    if rows["paged"]:
        out.append("  " + results_label(res, "paged"))
        out.append(f"{'dtype':>8} {'B':>3} {'H':>3} {'Hkv':>3} {'d':>4} {'block':>5} {'mean_len':>8} "
                   f"{'paged':>7} {'graph':>7} {'contig':>7} {'eq_sdpa':>7} {'p/contig':>8}")
        for r in rows["paged"]:
            t, c, cu = r.get("triton_gbs"), r.get("contig_triton_gbs"), r.get("sdpa_cudnn_gbs")
            out.append(f"{r.get('dtype', '?'):>8} {r.get('B', '?'):>3} {r.get('H', '?'):>3} {r.get('Hkv', '?'):>3} "
                       f"{r.get('d', '?'):>4} {r.get('block_size', '?'):>5} {_f(r.get('mean_len')):>8} {_f(t):>7} "
                       f"{_f(_graph_gbs(r)):>7} {_f(c):>7} {_f(cu):>7} {_ratio(t, c):>8}")
        out.append("  eq_sdpa: SDPA (cuDNN backend) on an equal-length, non-paged batch with the same total tokens,")
        out.append("  not a paged kernel: SDPA cannot take per-sequence lengths without a mask")
    else:
        out.append(f"  {NOT_MEASURED}")
    out.append("")
    out.append("decode (contiguous cache), GB/s: medians of do_bench and of do_bench_cudagraph (graph)")
    if rows["decode"]:
        out.append("  " + results_label(res, "decode"))
        out.append(f"{'dtype':>8} {'B':>3} {'H':>3} {'Hkv':>3} {'Nk':>7} {'d':>4} {'triton':>7} {'graph':>7} "
                   f"{'cudnn':>7} {'tri/cudnn':>9}")
        for r in sorted(rows["decode"], key=lambda r: (r.get("dtype", ""), r.get("d", 0), r.get("H", 0),
                                                        r.get("Hkv", 0), r.get("B", 0), r.get("Nk", 0))):
            t, cu = r.get("triton_gbs"), r.get("sdpa_cudnn_gbs")
            out.append(f"{r.get('dtype', '?'):>8} {r.get('B', '?'):>3} {r.get('H', '?'):>3} {r.get('Hkv', '?'):>3} "
                       f"{r.get('Nk', '?'):>7} {r.get('d', '?'):>4} {_f(t):>7} {_f(_graph_gbs(r)):>7} {_f(cu):>7} "
                       f"{_ratio(t, cu):>9}")
    else:
        out.append(f"  {NOT_MEASURED}")
    return "\n".join(out)


# lesson 11: the Gluon forward on Hopper (bench/bench_gluon.py)
GLUON_VARIANTS = {"gluon": "one partition", "gluon_ws": "producer warp + consumers",
                  "gluon_overlap": "2 consumer warpgroups, intra-warpgroup overlap",
                  "gluon_pp": "2 consumer warpgroups, ping-pong + overlap"}


def load_gluon(path=GLUON):
    """bench/bench_gluon.py's record (``{"meta", "rows"}``), or None when none is recorded."""
    return load_json(path)


def gluon_label(res) -> str:
    """GPU, versions, date and the timing statistic of a Gluon record."""
    meta = (res or {}).get("meta", {})
    return (results_label(meta) + f" · {'causal' if meta.get('causal') else 'non-causal'} · "
            f"{meta.get('timing', 'timing not recorded')}")


def _gluon_rows(res):
    return sorted((res or {}).get("rows", []), key=lambda r: (r["dtype"], r["d"], r["N"]))


def gluon_ratios(res, min_N: int = 0) -> dict:
    """``{(variant, peer): (geomean, lowest, highest)}`` of ``variant_tflops / peer_tflops`` over the rows with
    N >= min_N where both were measured, for each Gluon variant present and peer triton, sdpa_flash, sdpa_cudnn."""
    out = {}
    rows = [r for r in _gluon_rows(res) if r["N"] >= min_N]
    for var in GLUON_VARIANTS:
        for peer in ("triton", "sdpa_flash", "sdpa_cudnn"):
            xs = [r[f"{var}_tflops"] / r[f"{peer}_tflops"] for r in rows
                  if r.get(f"{var}_tflops") and r.get(f"{peer}_tflops")]
            if xs:
                out[(var, peer)] = (geomean(xs), min(xs), max(xs))
    return out


def gluon_table(res) -> str:
    """A plain-text table of a Gluon record: TFLOP/s of each Gluon variant, the course's Triton forward and SDPA's
    flash and cuDNN backends, the one-partition kernel's ratios, then the geomean ratios; labelled with the GPU,
    versions, date and statistic."""
    rows = _gluon_rows(res)
    variants = [v for v in GLUON_VARIANTS if any(f"{v}_tflops" in r or f"{v}_error" in r for r in rows)]
    lines = [f"Gluon forward, TFLOP/s (FLOPs = 4·B·H·N²·d); {gluon_label(res)}",
             f"{'dtype':>8} {'d':>4} {'N':>6} {'B':>3} {'H':>3} " + " ".join(f"{v:>9}" for v in variants) +
             f" {'triton':>7} {'flash':>7} {'cudnn':>7} {'g/triton':>8} {'g/cudnn':>8} {'ok':>3}"]
    for r in rows:
        g, t, cu = r.get("gluon_tflops"), r.get("triton_tflops"), r.get("sdpa_cudnn_tflops")
        ok = all(r.get(f"{v}_pass") for v in variants)
        lines.append(f"{r['dtype']:>8} {r['d']:>4} {r['N']:>6} {r['B']:>3} {r['H']:>3} " +
                     " ".join(f"{_f(r.get(f'{v}_tflops')):>9}" for v in variants) +
                     f" {_f(t):>7} {_f(r.get('sdpa_flash_tflops')):>7} {_f(cu):>7} {_ratio(g, t):>8} "
                     f"{_ratio(g, cu):>8} {'✓' if ok else '✗':>3}")
    lines.append("  ✓: every Gluon variant's O within 2x SDPA's own error against float64 (timed only then)")
    for (var, peer), (gm, lo, hi) in gluon_ratios(res).items():
        lines.append(f"  {GLUON_VARIANTS[var]} / {peer.replace('sdpa_', 'SDPA ')}: geomean {gm:.2f}x "
                     f"({lo:.2f}-{hi:.2f}x over {len(rows)} rows)")
    return "\n".join(lines)


def gluon_targets(fwd=None, bwd=None) -> dict:
    """Issue 26's two figures from their records (``GLUON_FORWARD``, ``GLUON_BACKWARD``): ``{"forward": ...,
    "backward": ...}``, each ``{"rows", "vs_cudnn": (geomean, lowest, highest), "below": rows under cuDNN, "vs_flash"
    (geomean), "vs_triton" (backward only: the course's Triton backward, geomean)}``, or None where not recorded. The
    forward's kernel is ``gluon_auto``, the backward's ``gluon`` (dq_mode "separate", the default)."""
    fwd = load_json(GLUON_FORWARD) if fwd is None else fwd
    bwd = load_json(GLUON_BACKWARD) if bwd is None else bwd
    out = {}
    for name, res, key in (("forward", fwd, "gluon_auto"), ("backward", bwd, "gluon")):
        rows = [r for r in (res or {}).get("rows", []) if r.get(f"{key}_tflops") and r.get("sdpa_cudnn_tflops")]
        if not rows:
            out[name] = None
            continue
        xs = [r[f"{key}_tflops"] / r["sdpa_cudnn_tflops"] for r in rows]
        fig = {"rows": len(rows), "vs_cudnn": (geomean(xs), min(xs), max(xs)), "below": sum(x < 1 for x in xs),
               "vs_flash": geomean([r[f"{key}_tflops"] / r["sdpa_flash_tflops"] for r in rows]), "meta": res["meta"]}
        if name == "backward":
            fig["vs_triton"] = geomean([r[f"{key}_tflops"] / r["triton_tflops"] for r in rows])
        out[name] = fig
    return out


def gluon_targets_table(fwd=None, bwd=None) -> str:
    """The forward and backward records side by side, TFLOP/s per row (the Gluon kernel, SDPA cuDNN, the ratio),
    then each direction's geomean against cuDNN and flash; labelled with the GPU, versions, date and statistic."""
    fwd = load_json(GLUON_FORWARD) if fwd is None else fwd
    bwd = load_json(GLUON_BACKWARD) if bwd is None else bwd
    if not fwd or not bwd:
        return f"Gluon forward and backward: {NOT_MEASURED}"
    key = lambda r: (r["dtype"], r["d"], r["N"], r["causal"])  # noqa: E731
    back = {key(r): r for r in bwd["rows"]}
    lines = [f"Gluon kernels on {results_label(fwd['meta'])} · {fwd['meta'].get('timing', '')}",
             "TFLOP/s: forward 4·B·H·N²·d, backward 2.5× that, causal half; forward = variant 'auto', "
             "backward = dq_mode 'separate'",
             f"{'dtype':>8} {'d':>4} {'N':>6} {'causal':>6} | {'fwd':>6} {'cudnn':>6} {'ratio':>6} | "
             f"{'bwd':>6} {'cudnn':>6} {'ratio':>6}"]
    for r in sorted(fwd["rows"], key=key):
        b = back.get(key(r), {})
        lines.append(f"{r['dtype']:>8} {r['d']:>4} {r['N']:>6} {str(r['causal']):>6} | "
                     f"{_f(r.get('gluon_auto_tflops')):>6} {_f(r.get('sdpa_cudnn_tflops')):>6} "
                     f"{_ratio(r.get('gluon_auto_tflops'), r.get('sdpa_cudnn_tflops')):>6} | "
                     f"{_f(b.get('gluon_tflops')):>6} {_f(b.get('sdpa_cudnn_tflops')):>6} "
                     f"{_ratio(b.get('gluon_tflops'), b.get('sdpa_cudnn_tflops')):>6}")
    for name, fig in gluon_targets(fwd, bwd).items():
        if fig:
            gm, lo, hi = fig["vs_cudnn"]
            lines.append(f"  {name}: {gm:.2f}x cuDNN in geomean ({lo:.2f}-{hi:.2f}x, {fig['below']} of {fig['rows']} "
                         f"rows below 1), {fig['vs_flash']:.2f}x SDPA flash")
    return "\n".join(lines)


def gluon_profile(res=None) -> dict:
    """The Nsight Compute record (``GLUON_PROFILE``) per case, ``{case: {"ms", "kernels", "main"}}``: ``ms`` the
    call's kernels together, ``main`` the kernel with the most tensor-core work (the attention kernel, not cuDNN's
    small preprocess and conversion kernels). {} when nothing is recorded."""
    res = load_json(GLUON_PROFILE) if res is None else res
    out = {}
    for row in (res or {}).get("rows", []):
        ks = row["kernels"]
        main = max(ks, key=lambda k: k.get("tensor_pct", 0) * k.get("ns", 0))
        out[row["case"]] = {"ms": row["ms"], "kernels": ks, "main": main}
    return out


def gluon_profile_table(res=None) -> str:
    """The Nsight Compute record, a line per kernel: its time and how busy the tensor cores (wgmma counts in the
    hmma pipe), the exponential unit (XU) and the FMA pipe were, its registers per thread and grid; then per case
    the Gluon call's time over cuDNN's. Labelled with the GPU, versions, date and tool."""
    res = load_json(GLUON_PROFILE) if res is None else res
    if not res or not res.get("rows"):
        return f"Nsight Compute profile of the Gluon kernels: {NOT_MEASURED}"
    prof = gluon_profile(res)
    lines = [f"Nsight Compute on {results_label(res['meta'])} · {res['meta'].get('tool', '')}",
             f"{res['meta'].get('shapes', '')}; % of each pipe's sustained peak while the SMs are active",
             f"{'case':28} {'kernel':34} {'us':>8} {'tensor':>7} {'xu':>6} {'fma':>6} {'regs':>5} {'grid':>6}"]
    for case, p in prof.items():
        for k in p["kernels"]:
            lines.append(f"{case:28} {k['kernel'][:34]:34} {k.get('ns', 0) / 1e3:8.0f} {k.get('tensor_pct', 0):6.1f}% "
                         f"{k.get('xu_pct', 0):5.1f}% {k.get('fma_pct', 0):5.1f}% {k.get('registers', 0):5.0f} "
                         f"{k.get('grid', 0):6.0f}")
    for case, p in prof.items():
        twin = case.replace("-gluon-", "-cudnn-")
        if "-gluon-" in case and twin in prof:
            lines.append(f"  {case.replace('-gluon', '')}: the Gluon call takes {p['ms'] / prof[twin]['ms']:.2f}x "
                         f"cuDNN's time under ncu")
    return "\n".join(lines)


def plot_gluon(res):
    """TFLOP/s against N, one panel per (dtype, d), one line per Gluon variant and peer (``plot_tflops``)."""
    impls = [(f"{v}_tflops", f"Gluon: {label}", style) for (v, label), style in
             zip(GLUON_VARIANTS.items(), ("o-", "s--", "v-", "^-."))]
    impls += [("triton_tflops", "course Triton (tl)", "k.-"), ("sdpa_flash_tflops", "SDPA flash", "x:"),
              ("sdpa_cudnn_tflops", "SDPA cuDNN", "d:")]
    meta = (res or {}).get("meta", {})
    shaped = {"gluon": [dict(r, causal=bool(meta.get("causal"))) for r in (res or {}).get("rows", [])],
              "gluon_meta": meta}
    fig = plot_tflops(shaped, "gluon", impls, empty="no Gluon rows recorded")
    fig.suptitle("Gluon forward: " + gluon_label(res), fontsize=9)
    return fig
