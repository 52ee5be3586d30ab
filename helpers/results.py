"""The recorded GPU results as the lessons read them: every reader of ``bench/results/``, the label of a
section (GPU, versions, date), a section's rows, the geometric-mean ratios, and a number for a table.

Files (written by the bench scripts through ``bench/common.py``):
- ``h200.json`` (``RESULTS``, lessons 07, 08 and 10): one section per script (``prefill``, ``decode``,
  ``backward``, ``varlen``, ``paged``), each with its own ``<section>_meta``; the top-level
  gpu/torch/triton/date are the prefill run's in files written before each section carried a meta.
- ``train_gpt.json`` (``TRAINING``, lesson 08): bench/train_gpt.py's record.
- ``ring_h200x2.json`` (``RING``, lesson 09): bench/ring_gpu.py's two-GPU rows.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["RESULTS", "TRAINING", "RING", "load_json", "load_results", "load_training", "load_gpu_results",
           "results_label", "section_rows", "geomean", "geomean_ratio", "fmt"]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
RESULTS = RESULTS_DIR / "h200.json"
TRAINING = RESULTS_DIR / "train_gpt.json"
RING = RESULTS_DIR / "ring_h200x2.json"


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
