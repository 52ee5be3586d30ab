"""Lesson 12's recorded results: the course's kernels against FlexAttention and against SDPA with a dense mask
(``bench/bench_masks.py``, record ``bench/results/masks_h200.json``), as a table and the summary the lesson's words
rest on, each labelled with the GPU, versions, date, batch sizes, FlexAttention's configuration and the statistic."""
from __future__ import annotations

from ..results import RESULTS_DIR, geomean, load_json, results_label

__all__ = ["MASKS_RESULTS", "FLEX_CONFIG", "GROUPS", "masks_label", "masks_table", "masks_summary", "summary_lines",
           "packed_documents_summary", "packed_documents_table"]

MASKS_RESULTS = RESULTS_DIR / "masks_h200.json"        # bench/bench_masks.py on an H200

# How bench/bench_masks.py runs its peer (main(): the compile, the block mask): the record's meta names only the block
# size ("flex_block"), so the rest is said here, from the script, until a run writes it into the meta ("flex").
FLEX_CONFIG = ("torch.compile(flex_attention, dynamic=False), default kernel options; its block mask "
               "create_block_mask(mask_mod, B=None, H=None, N, N, BLOCK_SIZE={block}), built before timing "
               "(bench/bench_masks.py)")

# The lesson's groups of masks, by the names bench_masks.py gives its rows.
GROUPS = {"windows": "window (", "documents": "documents", "softcap": "softcap", "ALiBi": "ALiBi"}


def _rows(res, scaling=False):
    return [r for r in (res or {}).get("rows", []) if ("scaling" in r.get("mask", "")) == scaling]


def masks_label(res) -> str:
    """GPU, versions, date, dtype, heads, the batch size at each N, the statistic, the correctness rule and
    FlexAttention's configuration of a masks record."""
    meta = (res or {}).get("meta", {})
    batches = sorted({(r["N"], r["B"]) for r in _rows(res) if "B" in r and "N" in r})
    b = ", ".join(f"B = {B} at N = {N}" for N, B in batches) or "B not recorded"
    flex = meta.get("flex") or FLEX_CONFIG.format(block=meta.get("flex_block", "?"))
    return (f"{results_label(meta)} · {meta.get('dtype', '?')}, H = {meta.get('H', '?')}, {b} · "
            f"{meta.get('timing', 'timing not recorded')} · every row first checked against float64 (within twice "
            f"FlexAttention's own error)\nFlexAttention: {flex}")


def _cell(x, nd=3):
    return f"{x:.{nd}f}" if x else "-"


def _x(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def masks_table(res=None) -> str:
    """Every row of a masks record: ms of the course's path for the mask (route: the dense kernels with the library's
    arguments, the varlen kernels, the block-sparse kernel), of FlexAttention, of this lesson's block-sparse kernel on
    the same mask and of SDPA with a dense boolean mask, each peer's time over the course's (x), the backward's, and
    the share of tiles visited against the share of pairs visible. Labelled by ``masks_label``."""
    res = load_json(MASKS_RESULTS) if res is None else res
    if not res:
        return "No figures are recorded yet."
    head = (f"{'mask':>24} {'d':>4} {'N':>6} {'B':>2} {'route':>7} {'visible':>7} {'tiles':>6} {'course':>7} "
            f"{'flex':>7} {'x':>5} {'bsparse':>7} {'x':>5} {'sdpa':>7} {'x':>6} {'bwd':>7} {'flex':>7} {'x':>5}")
    lines = [f"Masks and score mods, ms; x = the other's time over the course's; {masks_label(res)}",
             "visible: share of (query, key) pairs a mask keeps; tiles: share of the course's tiles visited", head]
    for r in _rows(res) + _rows(res, scaling=True):
        c, f, bs, sd = r.get("course_ms"), r.get("flex_ms"), r.get("block_sparse_ms"), r.get("sdpa_dense_ms")
        cb, fb = r.get("course_bwd_ms"), r.get("flex_bwd_ms")
        vis, til = r.get("visible"), r.get("tiles_visited")
        lines.append(f"{r.get('mask', '?'):>24} {r.get('d', '-'):>4} {r.get('N', '-'):>6} {r.get('B', '-'):>2} "
                     f"{r.get('route', '-'):>7} {f'{vis:.1%}' if vis else '-':>7} {f'{til:.1%}' if til else '-':>6} "
                     f"{_cell(c):>7} {_cell(f):>7} {_x(f, c):>5} {_cell(bs):>7} {_x(bs, c):>5} {_cell(sd):>7} "
                     f"{_x(sd, c):>6} {_cell(cb):>7} {_cell(fb):>7} {_x(fb, cb):>5}")
    return "\n".join(lines)


def masks_summary(res=None) -> dict:
    """The figures the lesson's words rest on, computed from the record's rows (not from its stored summary):
    FlexAttention's time over the course's, forward and backward, in geometric mean and per group (``GROUPS``); SDPA
    with the dense mask over the course at the longest N it ran; the window's growth in its own B = 1 rows
    (``--scaling``); FlexAttention over this lesson's block-sparse kernel; tiles visited against pairs visible."""
    res = load_json(MASKS_RESULTS) if res is None else res
    rows = [r for r in _rows(res) if r.get("pass")]
    out = {"rows": len(rows), "fwd": {}, "bwd": {}}
    for g, key in GROUPS.items():
        out["fwd"][g] = [r["flex_ms"] / r["course_ms"] for r in rows if key in r["mask"] and r.get("course_ms")]
        out["bwd"][g] = [r["flex_bwd_ms"] / r["course_bwd_ms"] for r in rows if key in r["mask"] and r.get("course_bwd_ms")]
    out["fwd_geomean"] = geomean([x for xs in out["fwd"].values() for x in xs])
    out["bwd_geomean"] = geomean([x for xs in out["bwd"].values() for x in xs])
    dense = [r for r in rows if r.get("sdpa_dense_ms")]
    top = max((r["N"] for r in dense), default=None)
    out["sdpa"] = {(r["mask"], r["d"], r["N"], r["B"]): r["sdpa_dense_ms"] / r["course_ms"] for r in dense if r["N"] == top}
    sc = {(r["d"], r["N"]): r for r in _rows(res, scaling=True) if r.get("course_ms")}
    out["scaling"] = {d: (sc[d, hi]["course_ms"] / sc[d, lo]["course_ms"], hi / lo, sc[d, lo]["B"], lo, hi)
                      for d in sorted({d for d, _ in sc}) for lo, hi in [(min(n for e, n in sc if e == d),
                                                                          max(n for e, n in sc if e == d))]
                      if hi > lo}
    out["block_sparse"] = [r["flex_ms"] / r["block_sparse_ms"] for r in rows if r.get("block_sparse_ms")]
    out["block_sparse_vs_course"] = [r["block_sparse_ms"] / r["course_ms"] for r in rows if r.get("block_sparse_ms")]
    out["tiles_over_visible"] = {(r["mask"], r["d"], r["N"]): r["tiles_visited"] / r["visible"] for r in rows
                                 if r.get("visible") and r.get("tiles_visited")}
    return out


def _span(xs):
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"


def summary_lines(res=None) -> str:
    """``masks_summary`` as lines, labelled by ``masks_label``."""
    res = load_json(MASKS_RESULTS) if res is None else res
    if not res:
        return "No figures are recorded yet."
    s = masks_summary(res)
    fw, bw = s["fwd"], s["bwd"]
    lines = [f"Summary of {MASKS_RESULTS.name}: {masks_label(res)}",
             f"  forward, FlexAttention's time over the course's: {s['fwd_geomean']:.2f}x in geomean over {s['rows']} rows; "
             + ", ".join(f"{g} {_span(xs)}" for g, xs in fw.items()),
             f"  backward, the same: {s['bwd_geomean']:.2f}x in geomean; " + ", ".join(f"{g} {_span(xs)}"
                                                                                    for g, xs in bw.items())]
    lines += [f"  SDPA with the dense [N, N] mask over the course, {m}, d = {d}, N = {N}, B = {B}: {x:.0f}x"
              for (m, d, N, B), x in s["sdpa"].items()]
    lines += [f"  window (1024, 0), rows of their own at B = {B}: N x{n:.0f} ({lo} to {hi}), the course's forward time "
              f"x{x:.2f} (d = {d})" for d, (x, n, B, lo, hi) in s["scaling"].items()]
    lines.append(f"  this lesson's block-sparse kernel on the same masks ({len(s['block_sparse'])} rows, windows and "
                 f"documents): FlexAttention's time over its {_span(s['block_sparse'])}; its time over the course's "
                 f"path {_span(s['block_sparse_vs_course'])}")
    docs = {k: x for k, x in s["tiles_over_visible"].items() if k[0] == "64 documents"}
    lines.append("  tiles visited over pairs visible, 64 documents: " + ", ".join(
        f"d = {d}, N = {N}: {x:.1f}x" for (_, d, N), x in docs.items()))
    return "\n".join(lines)


# ------------------------------------------------------------------ packed documents (bench/bench_varlen.py --packed)
def _packed(res):
    from ..results import load_results
    res = load_results() if res is None else res
    return (res or {}).get("packed_documents", []), (res or {}).get("packed_documents_meta", {})


def _lengths(r) -> str:
    n = r.get("lengths")
    if isinstance(n, dict):
        return f"{n['count']} docs {n['min']}-{n['max']}"
    return f"{len(n)} docs {min(n)}-{max(n)}" if n else "?"


def packed_documents_summary(res=None) -> dict:
    """Over the causal rows that passed: FlexAttention's time over the course's, forward and backward (geometric mean,
    lowest, the rows below 0.9), recomputed from the rows. {} when nothing is recorded."""
    rows, _ = _packed(res)
    rows = [r for r in rows if r.get("causal") and r.get("pass") and r.get("fwd_course_ms") and r.get("fwd_flex_ms")]
    if not rows:
        return {}
    out = {"rows": len(rows)}
    for way in ("fwd", "bwd"):
        xs = [r[f"{way}_flex_ms"] / r[f"{way}_course_ms"] for r in rows]
        out[way] = (geomean(xs), min(xs), max(xs))
        out[f"{way}_below_0.9"] = [f"{r['mix']} T={r['T']} d={r['d']} H/Hkv={r['H']}/{r['Hkv']}"
                                   for r, x in zip(rows, xs) if x < 0.9]
    return out


def packed_documents_table(res=None) -> str:
    """The packed-documents rows: each mix's forward and backward times, the course's and FlexAttention's (and SDPA's
    with a dense mask where it ran), FlexAttention's time over the course's; then the summary over the causal rows.
    Labelled with the GPU, versions, date, the statistic and how each peer was run."""
    rows, meta = _packed(res)
    if not rows:
        return "packed documents against FlexAttention: not measured yet"
    lines = [f"packed documents, causal within each document: {results_label(meta)} · {meta.get('dtype', '?')} · "
             f"{meta.get('timing', '')}",
             f"  course: {meta.get('course', '?')}", f"  FlexAttention: {meta.get('flex', '?')}",
             f"  SDPA: {meta.get('sdpa', '?')}", f"  every row first checked: {meta.get('check', '?')}",
             f"{'mix':<26} {'lengths':<18} {'T':>6} {'d':>4} {'H/Hkv':>6} {'causal':>6} | {'fwd':>6} {'flex':>6} "
             f"{'x':>5} | {'bwd':>6} {'flex':>6} {'x':>5} | {'sdpa fwd':>8} {'ok':>3}"]
    for r in rows:
        fx = r["fwd_flex_ms"] / r["fwd_course_ms"] if r.get("fwd_course_ms") and r.get("fwd_flex_ms") else None
        bx = r["bwd_flex_ms"] / r["bwd_course_ms"] if r.get("bwd_course_ms") and r.get("bwd_flex_ms") else None
        lines.append(f"{r['mix'][:26]:<26} {_lengths(r)[:18]:<18} {r['T']:>6} {r['d']:>4} {r['H']:>3}/{r['Hkv']:<2} "
                     f"{str(bool(r['causal'])):>6} | {_cell(r.get('fwd_course_ms')):>6} {_cell(r.get('fwd_flex_ms')):>6} "
                     f"{_cell(fx, 2):>5} | {_cell(r.get('bwd_course_ms')):>6} {_cell(r.get('bwd_flex_ms')):>6} "
                     f"{_cell(bx, 2):>5} | {_cell(r.get('fwd_sdpa_ms')):>8} {'✓' if r.get('pass') else '✗':>3}")
    lines.append("  ms; x = FlexAttention's time / the course's (above 1: the course is faster)")
    s = packed_documents_summary(res)
    if s:
        for way, name in (("fwd", "forward"), ("bwd", "backward")):
            gm, lo, hi = s[way]
            below = s[f"{way}_below_0.9"]
            lines.append(f"  {name}: {gm:.2f}x FlexAttention in geometric mean over {s['rows']} causal rows "
                         f"({lo:.2f}-{hi:.2f}x; below 0.9x: {', '.join(below) if below else 'none'})")
    return "\n".join(lines)
