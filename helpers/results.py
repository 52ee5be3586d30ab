"""The generic readers of the recorded GPU results (``bench/results/``): a record, the label of a section (GPU,
versions, date), a section's rows, a TFLOP/s plot, geometric means, and the cells of a text table.

The records are written by the bench scripts through ``bench/common.py``; ``h200.json`` (``RESULTS``) holds one
section per script (``prefill``, ``decode``, ``backward``, ``varlen``, ``paged``, ...), each with its own
``<section>_meta``. Each lesson's own tables of its records live in its folder (``helpers/lessonNN/``); the results
page of the site gathers them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["RESULTS_DIR", "RESULTS", "NOT_MEASURED", "load_json", "load_results", "results_label", "section_rows",
           "plot_tflops", "geomean", "geomean_ratio", "fmt", "ratio", "CHECK_TIMES", "check_times_table"]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
RESULTS = RESULTS_DIR / "h200.json"
CHECK_TIMES = RESULTS_DIR / "check_times.json"     # bench/time_check.py: the README's commands on a fresh clone


def load_json(path):
    """The JSON at path, or None when the file is not there (yet)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def load_results(path=RESULTS):
    """The committed benchmark (a dict), or None when the file is not there yet."""
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


NOT_MEASURED = "not measured yet"


def ratio(a, b) -> str:
    """A table cell: a / b with two decimals, or an em dash when either is missing."""
    return fmt(a / b if a and b else None, 2)


def check_times_table(res=None) -> str:
    """How long the README's commands took on a fresh clone (``bench/time_check.py``): a line per target, then
    ``make check`` in all; labelled with the machine, versions, commit and date."""
    res = load_json(CHECK_TIMES) if res is None else res
    if not res:
        return f"the README's commands on a fresh clone: {NOT_MEASURED}"
    m = res["meta"]
    lines = [f"{m['cores']} cores, {m['memory_gib']} GiB, Python {m['python']}, torch {m['torch']}, triton "
             f"{m['triton']}, {m['chromium']} · commit {m['commit']} · {m['date']} · {m['how']}",
             f"{'command':<22} {'wall time':>10}  result"]
    for target, s in res["steps"].items():
        lines.append(f"{'make ' + target:<22} {s['seconds'] / 60:>7.1f} min  {'ok' if s['returncode'] == 0 else 'FAILED'}")
    lines.append(f"{'make check, in all':<22} {res['make_check_seconds'] / 60:>7.1f} min  "
                 f"{'passed' if res['passed'] else 'FAILED'}")
    return "\n".join(lines)
