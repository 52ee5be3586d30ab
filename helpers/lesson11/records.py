"""Lesson 11's recorded results: the Gluon kernels on an H200 (``bench/bench_gluon.py``, ``bench/profile_gluon.py``),
read from their records in ``bench/results/`` and shown as tables and plots with their GPU, versions, date and
statistic."""
from __future__ import annotations

from ..results import NOT_MEASURED, RESULTS_DIR, geomean, load_json, plot_tflops, results_label
from ..results import fmt as _f
from ..results import ratio as _ratio

GLUON = RESULTS_DIR / "gluon_h200.json"


GLUON_FA3 = RESULTS_DIR / "gluon_h200_variants.json"  # FA3's overlap and ping-pong variants, N = 16384


GLUON_FORWARD = RESULTS_DIR / "gluon_forward_h200.json"    # issue 26's forward target: variant "auto" vs SDPA


GLUON_BACKWARD = RESULTS_DIR / "gluon_backward_h200.json"  # issue 26's backward target: gluon_backward vs SDPA


GLUON_PROFILE = RESULTS_DIR / "gluon_profile_h200.json"    # bench/profile_gluon.py: Nsight Compute, Gluon vs cuDNN


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
