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
    causal = meta.get("causal")
    mask = "causal and not, per row" if causal == "per row" else "causal" if causal else "non-causal"
    return results_label(meta) + f" · {mask} · {meta.get('timing', 'timing not recorded')}"


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
    for (var, d), (gm, lo, hi) in gluon_vs_one(res).items():
        lines.append(f"  {GLUON_VARIANTS[var]} / one partition at d = {d}: geomean {gm:.2f}x ({lo:.2f}-{hi:.2f}x)")
    return "\n".join(lines)


def _vs(rows, key, peer):
    xs = [r[f"{key}_tflops"] / r[f"{peer}_tflops"] for r in rows if r.get(f"{key}_tflops") and r.get(f"{peer}_tflops")]
    return (geomean(xs), min(xs), max(xs)) if xs else None


def gluon_targets(fwd=None, bwd=None, grid=None) -> dict:
    """Issue 26's two records (``GLUON_FORWARD``, ``GLUON_BACKWARD``) as the lesson reads them. The forward's rows are
    split by what ``flash_attn_triton`` runs on sm_90 (``forward.GLUON_ROUTES``): ``"forward"`` over the routed rows
    (the Gluon kernel, ``gluon_auto``), ``"forward_unrouted"`` the Gluon kernel on the others, where
    ``flash_attn_triton`` runs the Triton kernel, whose time there is not in this record: ``"triton_unrouted"`` takes
    it from call 2 (``GRID_RUN``, another run), Triton over cuDNN. Each ``{"rows", "vs_cudnn": (geomean, lowest,
    highest), "below": rows under cuDNN, "vs_flash", "meta"}``; the backward (``gluon``, dq_mode "separate") adds
    ``"vs_triton"`` (the course's Triton backward, geomean), ``"vs_triton_by_d"`` and ``"atomic_vs_cudnn"``.
    None where not recorded."""
    fwd = load_json(GLUON_FORWARD) if fwd is None else fwd
    bwd = load_json(GLUON_BACKWARD) if bwd is None else bwd
    routes = kernel_constant("GLUON_ROUTES", "forward")
    routed = lambda r: (r["d"], bool(r["causal"])) in routes  # noqa: E731

    def fig(rows, key, res):
        rows = [r for r in rows if r.get(f"{key}_tflops") and r.get("sdpa_cudnn_tflops")]
        if not rows:
            return None
        vs = _vs(rows, key, "sdpa_cudnn")
        return {"rows": len(rows), "vs_cudnn": vs, "below": sum(r[f"{key}_tflops"] < r["sdpa_cudnn_tflops"] for r in rows),
                "vs_flash": _vs(rows, key, "sdpa_flash")[0], "meta": res["meta"]}
    f_rows = (fwd or {}).get("rows", [])
    out = {"forward": fig([r for r in f_rows if routed(r)], "gluon_auto", fwd),
           "forward_unrouted": fig([r for r in f_rows if not routed(r)], "gluon_auto", fwd)}
    rt = route(grid)
    shapes = {(r["dtype"], r["d"], r["N"], bool(r["causal"])) for r in f_rows if not routed(r)}
    tri = [x["row"] for x in rt["rows"] if (x["row"]["dtype"], x["row"]["d"], x["row"]["N"], bool(x["row"]["causal"]))
           in shapes]
    out["triton_unrouted"] = fig(tri, "triton", {"meta": rt["meta"]}) if tri else None
    b_rows = (bwd or {}).get("rows", [])
    out["backward"] = fig(b_rows, "gluon", bwd)
    if out["backward"]:
        out["backward"]["vs_triton"] = _vs(b_rows, "gluon", "triton")[0]
        out["backward"]["vs_triton_by_d"] = {d: _vs([r for r in b_rows if r["d"] == d], "gluon", "triton")
                                             for d in sorted({r["d"] for r in b_rows})}
        out["backward"]["atomic_vs_cudnn"] = _vs(b_rows, "gluon_atomic", "sdpa_cudnn")
    return out


def gluon_targets_table(fwd=None, bwd=None, grid=None) -> str:
    """The forward and backward records side by side, TFLOP/s per row (the Gluon kernel, SDPA cuDNN, the ratio), the
    forward's rows marked by what ``flash_attn_triton`` runs there (``forward.GLUON_ROUTES``); then the lines the
    lesson's words rest on. Labelled with the GPU, versions, date and statistic."""
    fwd = load_json(GLUON_FORWARD) if fwd is None else fwd
    bwd = load_json(GLUON_BACKWARD) if bwd is None else bwd
    if not fwd or not bwd:
        return f"Gluon forward and backward: {NOT_MEASURED}"
    routes = kernel_constant("GLUON_ROUTES", "forward")
    key = lambda r: (r["dtype"], r["d"], r["N"], r["causal"])  # noqa: E731
    back = {key(r): r for r in bwd["rows"]}
    t = gluon_targets(fwd, bwd, grid)
    lines = [f"Gluon kernels on {results_label(fwd['meta'])} · {fwd['meta'].get('timing', '')}",
             "TFLOP/s: forward 4·B·H·N²·d, backward 2.5× that, causal half; forward = gluon_forward(variant='auto'), "
             "backward = dq_mode 'separate'",
             "runs: what flash_attn_triton runs on sm_90 now (forward.GLUON_ROUTES); the record's note predates the "
             "route table, when every row was routed",
             f"{'dtype':>8} {'d':>4} {'N':>6} {'causal':>6} {'runs':>6} | {'fwd':>6} {'cudnn':>6} {'ratio':>6} | "
             f"{'bwd':>6} {'cudnn':>6} {'ratio':>6}"]
    for r in sorted(fwd["rows"], key=key):
        b = back.get(key(r), {})
        runs = "gluon" if (r["d"], bool(r["causal"])) in routes else "triton"
        lines.append(f"{r['dtype']:>8} {r['d']:>4} {r['N']:>6} {str(r['causal']):>6} {runs:>6} | "
                     f"{_f(r.get('gluon_auto_tflops')):>6} {_f(r.get('sdpa_cudnn_tflops')):>6} "
                     f"{_ratio(r.get('gluon_auto_tflops'), r.get('sdpa_cudnn_tflops')):>6} | "
                     f"{_f(b.get('gluon_tflops')):>6} {_f(b.get('sdpa_cudnn_tflops')):>6} "
                     f"{_ratio(b.get('gluon_tflops'), b.get('sdpa_cudnn_tflops')):>6}")
    names = {"forward": "forward, routed rows (the Gluon kernel runs)",
             "forward_unrouted": "forward, rows not routed: the Gluon kernel, which flash_attn_triton does not run there",
             "triton_unrouted": "forward, rows not routed: the Triton kernel flash_attn_triton runs, from call 2 "
                                f"(another run, {results_label((t.get('triton_unrouted') or {}).get('meta', {}))})",
             "backward": "backward (dq_mode 'separate')"}
    for name, fig in t.items():
        if fig:
            gm, lo, hi = fig["vs_cudnn"]
            lines.append(f"  {names[name]}: {gm:.2f}x cuDNN in geomean ({lo:.2f}-{hi:.2f}x, {fig['below']} of "
                         f"{fig['rows']} rows below 1), {fig['vs_flash']:.2f}x SDPA flash")
    b = t["backward"]
    if b:
        lines.append("  backward / the course's Triton backward: geomean " + f"{b['vs_triton']:.2f}x; " + "; ".join(
            f"d = {d}: {g:.2f}x ({lo:.2f}-{hi:.2f}x)" for d, (g, lo, hi) in b["vs_triton_by_d"].items()))
        gm, lo, hi = b["atomic_vs_cudnn"]
        lines.append(f"  backward, dq_mode 'atomic': {gm:.2f}x cuDNN in geomean ({lo:.2f}-{hi:.2f}x)")
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
            g, c = p["main"], prof[twin]["main"]
            lines.append(f"  {case.replace('-gluon', '')}: the Gluon call takes {p['ms'] / prof[twin]['ms']:.2f}x "
                         f"cuDNN's time under ncu; tensor pipe {g.get('tensor_pct', 0):.1f}% ({g['kernel'][:12]}) "
                         f"against {c.get('tensor_pct', 0):.1f}%; registers {g.get('registers', 0):.0f} against "
                         f"{c.get('registers', 0):.0f}; grid {g.get('grid', 0):.0f} against {c.get('grid', 0):.0f}")
    return "\n".join(lines)


def summary(table: str) -> str:
    """A table's label (its first line) and its summary lines (those indented by two spaces), without its rows: the
    line the lesson shows above a long table, whose full form goes in a cell with folded output."""
    lines = table.splitlines()
    return "\n".join(lines[:1] + [ln for ln in lines[1:] if ln.startswith("  ") and not ln.startswith("   ")])


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


# ------------------------------------------------------------------ the runs behind the prose (issue 36: every figure
# from its record). Each function reads one record and labels what it prints with the GPU, versions, date and statistic.
LOGS = RESULTS_DIR / "logs"
GLUON_CAUSAL = RESULTS_DIR / "gluon_h200_causal.json"      # causal and GQA: one, pp, pp128 against cuDNN
GRID_RUN = (LOGS / "gluon_fwd_grid_d64_2026-12-01.json",   # issue 26's call 2: the grid's fix, the Triton forward
            LOGS / "gluon_fwd_grid_d128_2026-12-01.json")  # beside each Gluon variant and tiling
SWEEP_D64 = LOGS / "gluon_sweep_tiles_d64_2026-12-01.json"  # call 1: the tiles' sweep, the old causal grid
PPP_RUN = LOGS / "gluon_ppp_2026-12-01.json"                # the persistent variant against "auto"
DEVICE = RESULTS_DIR / "h200.json"                          # bench/bench.py's ceilings (the copy rate)
SELFTESTS = {"first kernels": "gluon_h200_2026-12-01.log", "overlap and ping-pong": "gluon_variants_h200_2026-12-01.log",
             **{f"causal and GQA, {v}": f"gluon_selftest_causal_gqa_{v}.log" for v in ("one", "ws", "overlap", "pp",
                                                                                        "pp128")},
             "backward, both dQ modes": "gluon_backward_selftest_2026-12-01.log",
             "persistent (ppp)": "gluon_selftest_ppp_2026-12-01.log"}
_KERNELS = RESULTS_DIR.parent.parent / "helpers" / "kernels"


def kernel_constant(name: str, module: str = "gluon_forward"):
    """A literal constant of a kernel module (``AUTO_VARIANT``, ``GLUON_ROUTES``), read from its source with ``ast``:
    the kernels import Triton, which a machine without it lacks, and the value must be the kernels' own."""
    import ast
    tree = ast.parse((_KERNELS / f"{module}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{name} is not a constant of helpers/kernels/{module}.py")


def _key(variant: str) -> str:
    """A variant's column in bench_gluon.py's records: "one" -> "gluon", "pp" -> "gluon_pp"."""
    return "gluon" if variant == "one" else f"gluon_{variant}"


def _span(xs) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "—"


def _shape(r) -> str:
    kv = f":{r['Hkv']}" if r.get("Hkv", r.get("H")) != r.get("H") else ""
    return f"{r['dtype']:>8} d={r['d']:<3} N={r['N']:<5} B={r['B']} H={r['H']}{kv} {'causal' if r.get('causal') else 'full  '}"


def selftest_summary(names=None) -> str:
    """The self-tests behind the timings: for each log in ``bench/results/logs`` (``SELFTESTS``), the machine and
    versions its first line names (or that it names none) and its summary lines (cases, worst errors, verdict)."""
    import re
    lines = ["Self-tests against float64 (bench/results/logs; each case within 2x SDPA's own error)"]
    for what, name in (names or SELFTESTS).items():
        path = LOGS / name
        if not path.exists():
            lines.append(f"  {what}: {name} {NOT_MEASURED}")
            continue
        text = path.read_text(encoding="utf-8").splitlines()
        head = text[0] if text and text[0].startswith("NVIDIA") else "the log names no GPU"
        date = re.search(r"20\d\d-\d\d-\d\d", name)
        found = sorted({ln.strip() for ln in text if re.search(r"\d+ cases", ln) and not ln.startswith("{")})
        when = date.group(0) if date else "no date in its name"
        lines.append(f"  {what} ({name}; {head.split(', variant')[0]}; {when}): " + (" | ".join(found) or "no summary"))
    return "\n".join(lines)


def gluon_vs_one(res) -> dict:
    """``{(variant, d): (geomean, lowest, highest)}`` of each Gluon variant's TFLOP/s over the one-partition kernel's,
    per head dim, over the rows where both were timed."""
    out = {}
    for var in GLUON_VARIANTS:
        if var == "gluon":
            continue
        for d in sorted({r["d"] for r in _gluon_rows(res)}):
            xs = [r[f"{var}_tflops"] / r["gluon_tflops"] for r in _gluon_rows(res)
                  if r["d"] == d and r.get(f"{var}_tflops") and r.get("gluon_tflops")]
            if xs:
                out[(var, d)] = (geomean(xs), min(xs), max(xs))
    return out


def fastest(recs=None) -> dict:
    """Over the rows of the non-causal records (``GLUON`` and ``GLUON_FA3`` by default), which kernel was the fastest:
    ``{"rows", "cudnn_first", "others": [(row, [(kernel, its lead over cuDNN)])]}``."""
    recs = [load_json(GLUON), load_json(GLUON_FA3)] if recs is None else recs
    rows = [r for res in recs for r in _gluon_rows(res)]
    others = []
    for r in rows:
        cu = r["sdpa_cudnn_tflops"]
        ahead = [(k[:-7], r[k] / cu - 1) for k in sorted(r) if k.endswith("_tflops") and r[k] and r[k] > cu]
        if ahead:
            others.append((r, ahead))
    return {"rows": len(rows), "cudnn_first": len(rows) - len(others), "others": others}


def fastest_line(recs=None) -> str:
    f = fastest(recs)
    lines = [f"  fastest per row over both records: SDPA cuDNN in {f['cudnn_first']} of {f['rows']} rows"]
    for r, ahead in f["others"]:
        lines.append(f"    ahead of cuDNN in {_shape(r)}: " + ", ".join(f"{k} by {x:.1%}" for k, x in ahead))
    return "\n".join(lines)


def gluon_causal(res=None) -> dict:
    """The causal and GQA record (``GLUON_CAUSAL``): per row the best variant over cuDNN; the rows where it is ahead;
    ``pp128 / pp`` per head dim. ``{"rows", "best", "ahead", "pp128_vs_pp": {d: (lo, hi)}, "tflops": {(v, d): (lo, hi)}}``."""
    res = load_json(GLUON_CAUSAL) if res is None else res
    rows = sorted((res or {}).get("rows", []), key=lambda r: (r["d"], r["causal"], r["H"] // r["Hkv"]))
    vs = ("one", "pp", "pp128")
    best = [(r, max(vs, key=lambda v: r[f"{_key(v)}_tflops"])) for r in rows]
    out = {"rows": rows, "best": [(r, v, r[f"{_key(v)}_tflops"] / r["sdpa_cudnn_tflops"]) for r, v in best]}
    out["ahead"] = [(r, v, x) for r, v, x in out["best"] if x > 1]
    out["pp128_vs_pp"], out["tflops"] = {}, {}
    for d in sorted({r["d"] for r in rows}):
        xs = [r["gluon_pp128_tflops"] / r["gluon_pp_tflops"] for r in rows if r["d"] == d]
        out["pp128_vs_pp"][d] = (min(xs), max(xs))
        for v in vs:
            t = [r[f"{_key(v)}_tflops"] for r in rows if r["d"] == d]
            out["tflops"][(v, d)] = (min(t), max(t))
    return out


def gluon_causal_table(res=None) -> str:
    """The causal and GQA record as a table: TFLOP/s of the one-partition, ping-pong and 128-rows-a-warpgroup kernels,
    the Triton forward and cuDNN, the best Gluon variant over cuDNN; then the lines the lesson's words rest on."""
    res = load_json(GLUON_CAUSAL) if res is None else res
    if not res or not res.get("rows"):
        return f"Causal and GQA figures of the Gluon forward: {NOT_MEASURED}"
    c = gluon_causal(res)
    lines = [f"Gluon forward, causal and GQA, TFLOP/s (causal: half the FLOPs); {gluon_label(res)}",
             f"{'shape':44} {'one':>5} {'pp':>5} {'pp128':>5} {'triton':>6} {'cudnn':>5}  best/cuDNN  ok"]
    for r, v, x in c["best"]:
        ok = all(r.get(f"{_key(u)}_pass") for u in ("one", "pp", "pp128"))
        lines.append(f"{_shape(r):44} {_f(r['gluon_tflops']):>5} {_f(r['gluon_pp_tflops']):>5} "
                     f"{_f(r['gluon_pp128_tflops']):>5} {_f(r['triton_tflops']):>6} {_f(r['sdpa_cudnn_tflops']):>5}"
                     f"  {x:5.2f} {v:<5} {'✓' if ok else '✗'}")
    lines.append(f"  best Gluon variant / cuDNN: {_span([x for _, _, x in c['best']])}; ahead of cuDNN in "
                 f"{len(c['ahead'])} rows: " + "; ".join(f"{_shape(r)} ({v})" for r, v, _ in c["ahead"]))
    for d, (lo, hi) in c["pp128_vs_pp"].items():
        lines.append(f"  pp128 / pp at d = {d}: {lo:.2f}-{hi:.2f}x (pp128 {c['tflops'][('pp128', d)][0]:.0f}-"
                     f"{c['tflops'][('pp128', d)][1]:.0f}, pp {c['tflops'][('pp', d)][0]:.0f}-"
                     f"{c['tflops'][('pp', d)][1]:.0f} TFLOP/s)")
    return "\n".join(lines)


def causal_over_full(res=None) -> dict:
    """The tiles' sweep at d = 64 (``SWEEP_D64``, call 1, when the causal grid still ran (B·H, query blocks)): for each
    kernel timed, its causal TFLOP/s over its non-causal TFLOP/s on the same shape. ``{kernel: ratio}``."""
    res = load_json(SWEEP_D64) if res is None else res
    rows = {bool(r["causal"]): r for r in (res or {}).get("rows", [])}
    if set(rows) != {False, True}:
        return {}
    keys = [k[:-7] for k in rows[False] if k.endswith("_tflops") and not k.startswith("sdpa")]
    return {k: rows[True][f"{k}_tflops"] / rows[False][f"{k}_tflops"] for k in keys if rows[True].get(f"{k}_tflops")}


def causal_over_full_table(res=None) -> str:
    res = load_json(SWEEP_D64) if res is None else res
    ratios = causal_over_full(res)
    if not ratios:
        return f"The tiles' sweep at d = 64: {NOT_MEASURED}"
    r = res["rows"][0]
    gl_ = [x for k, x in ratios.items() if k.startswith("gluon")]
    lines = [f"Causal over non-causal TFLOP/s, the causal grid still (B·H, query blocks); {gluon_label(res)}",
             f"  {r['dtype']}, d = {r['d']}, N = {r['N']}, B = {r['B']}, H = {r['H']} (bench_gluon.py's sweep of tiles, "
             "call 1)"]
    lines += [f"  {k:22} {x:.2f}" for k, x in ratios.items()]
    lines.append(f"  the {len(gl_)} Gluon tilings: {_span(gl_)}; the Triton forward (grid (query blocks, B·H)): "
                 f"{ratios.get('triton', float('nan')):.2f}x")
    return "\n".join(lines)


def route(grid=None) -> dict:
    """Call 2 (``GRID_RUN``): the kernel ``"auto"`` picks (``AUTO_VARIANT``) over the course's Triton forward, split by
    what ``flash_attn_triton`` runs on sm_90 (``forward.GLUON_ROUTES``); and whether "auto"'s pick beat the other
    default-tile variant ("one" or "pp") and every tiling the run timed."""
    grid = [load_json(p) for p in GRID_RUN] if grid is None else grid
    auto, routes = kernel_constant("AUTO_VARIANT"), kernel_constant("GLUON_ROUTES", "forward")
    out = {"rows": [], "meta": (grid[0] or {}).get("meta", {}), "routes": routes, "auto": auto}
    for res in grid:
        for r in (res or {}).get("rows", []):
            pick = auto[(r["d"], bool(r["causal"]))]
            other = "pp" if pick == "one" else "one"
            tilings = {k[:-7]: r[k] for k in r if k.endswith("_tflops") and k.startswith("gluon")}
            mine = r[f"{_key(pick)}_tflops"]
            out["rows"].append(dict(row=r, pick=pick, routed=(r["d"], bool(r["causal"])) in routes,
                                    vs_triton=mine / r["triton_tflops"], triton_vs_cudnn=r["triton_tflops"] /
                                    r["sdpa_cudnn_tflops"], beats_other=mine >= r[f"{_key(other)}_tflops"],
                                    best=max(tilings, key=tilings.get), lead=max(tilings.values()) / mine - 1))
    return out


def route_table(grid=None) -> str:
    """Call 2 as a table: per row, "auto"'s kernel, its TFLOP/s, the Triton forward's, their ratio, the fastest tiling
    the run timed; then the routed and unrouted rows' ratios and how often "auto"'s pick was the faster of the two
    default-tile variants."""
    rt = route(grid)
    if not rt["rows"]:
        return f"The Gluon forward beside the Triton forward (call 2): {NOT_MEASURED}"
    lines = [f"Gluon forward ('auto') and the course's Triton forward, TFLOP/s; {results_label(rt['meta'])} · "
             f"{rt['meta'].get('timing', '')} (bench_gluon.py, issue 26's call 2)",
             f"routed: flash_attn_triton runs the Gluon kernel on sm_90 (forward.GLUON_ROUTES = "
             f"{sorted(rt['routes'])}); elsewhere it runs the Triton kernel",
             f"{'shape':44} {'routed':>6} {'auto':>5} {'TFLOP/s':>7} {'triton':>6} {'ratio':>5}  fastest timed"]
    for x in sorted(rt["rows"], key=lambda x: (not x["routed"], x["row"]["d"], x["row"]["causal"], x["row"]["dtype"],
                                              x["row"]["N"])):
        r = x["row"]
        lines.append(f"{_shape(r):44} {'yes' if x['routed'] else 'no':>6} {x['pick']:>5} "
                     f"{_f(r[_key(x['pick']) + '_tflops']):>7} {_f(r['triton_tflops']):>6} {x['vs_triton']:5.2f}  "
                     f"{x['best']}" + (f" (+{x['lead']:.1%})" if x["lead"] > 0 else ""))
    for routed in (True, False):
        xs = [x["vs_triton"] for x in rt["rows"] if x["routed"] == routed]
        lines.append(f"  {'routed' if routed else 'not routed'} rows ({len(xs)}): 'auto' / Triton geomean "
                     f"{geomean(xs):.2f}x ({_span(xs)})")
    beats = sum(x["beats_other"] for x in rt["rows"])
    ahead = [x for x in rt["rows"] if x["lead"] > 0]
    lines.append(f"  'auto''s pick faster than the other default-tile variant ('one' or 'pp') in {beats} of "
                 f"{len(rt['rows'])} rows; another tiling ahead of it in {len(ahead)} rows, by at most "
                 f"{max([x['lead'] for x in ahead] or [0]):.1%}")
    return "\n".join(lines)


def hbm_need(sweep=None, device=None) -> dict:
    """The HBM rate a 128-row program needs when nothing hits L2 (128 FLOPs per byte of K and V: 4·128·BLOCK_N·d FLOPs
    over 2·BLOCK_N·d·2 bytes), at the rates the sweep's kernels reached (``SWEEP_D64``), beside the GPU's measured
    device-to-device copy rate (``DEVICE``'s ceilings, read + write). GB/s."""
    sweep = load_json(SWEEP_D64) if sweep is None else sweep
    device = load_json(DEVICE) if device is None else device
    rates = [r[k] for r in (sweep or {}).get("rows", []) for k in r if k.startswith("gluon") and k.endswith("_tflops")]
    copy = ((device or {}).get("ceilings") or {}).get("copy_gbs_read_plus_write")
    return {"tflops": (min(rates), max(rates)) if rates else None, "flop_per_byte": 4 * 128 / 4,
            "need_gbs": tuple(t * 1e3 / 128 for t in (min(rates), max(rates))) if rates else None, "copy_gbs": copy,
            "sweep_meta": (sweep or {}).get("meta", {}), "device_meta": device or {}}


def hbm_line(sweep=None, device=None) -> str:
    h = hbm_need(sweep, device)
    if not h["need_gbs"] or not h["copy_gbs"]:
        return f"HBM rate against the copy rate: {NOT_MEASURED}"
    return (f"At {h['tflops'][0]:.0f}-{h['tflops'][1]:.0f} TFLOP/s (the Gluon tilings at d = 64, "
            f"{results_label(h['sweep_meta'])}) and {h['flop_per_byte']:.0f} FLOPs a byte, a program needs "
            f"{h['need_gbs'][0]:.0f}-{h['need_gbs'][1]:.0f} GB/s of K and V from HBM when nothing hits L2;\n"
            f"the device-to-device copy rate measured on the same GPU: {h['copy_gbs']:.0f} GB/s read + write "
            f"(bench/results/h200.json ceilings; {results_label(h['device_meta'])})")


def gluon_ppp(res=None) -> dict:
    """The persistent variant's run (``PPP_RUN``): ``ppp / auto`` per row, with the kernel "auto" ran on each
    (``AUTO_VARIANT``): ``{(baseline kernel, causal): [ratios]}``."""
    res = load_json(PPP_RUN) if res is None else res
    auto = kernel_constant("AUTO_VARIANT")
    out = {}
    for r in (res or {}).get("rows", []):
        out.setdefault((auto[(r["d"], bool(r["causal"]))], bool(r["causal"])), []).append(
            r["gluon_ppp_tflops"] / r["gluon_auto_tflops"])
    return out


def gluon_ppp_table(res=None) -> str:
    res = load_json(PPP_RUN) if res is None else res
    if not res or not res.get("rows"):
        return f"The persistent Gluon forward: {NOT_MEASURED}"
    auto = kernel_constant("AUTO_VARIANT")
    lines = [f"Gluon forward, persistent ('ppp', one program per SM) against 'auto' (one program per item), TFLOP/s; "
             f"{gluon_label(res)}", f"{'shape':44} {'auto is':>7} {'auto':>5} {'ppp':>5} {'ppp/auto':>8}  ok"]
    for r in sorted(res["rows"], key=lambda r: (r["causal"], r["d"], r["dtype"], r["N"])):
        ok = r.get("gluon_ppp_pass") and r.get("gluon_auto_pass")
        lines.append(f"{_shape(r):44} {auto[(r['d'], bool(r['causal']))]:>7} {_f(r['gluon_auto_tflops']):>5} "
                     f"{_f(r['gluon_ppp_tflops']):>5} {r['gluon_ppp_tflops'] / r['gluon_auto_tflops']:8.2f}  "
                     f"{'✓' if ok else '✗'}")
    for (base, causal), xs in sorted(gluon_ppp(res).items()):
        lines.append(f"  against '{base}', {'causal' if causal else 'no mask'}: {_span(xs)} over {len(xs)} rows")
    return "\n".join(lines)
