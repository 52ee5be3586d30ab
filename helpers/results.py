"""The recorded GPU results (``bench/results/h200.json``, written by ``make bench``) as lessons 07, 08
and 10 read them: the file, the label of a section (GPU, versions, date), and a number for a table.

The file's top-level gpu/torch/triton/date are the prefill run's; a section measured in another run
(``backward``, ``decode``, ``varlen``, ``paged``) carries its own ``<section>_meta`` with them.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["RESULTS", "load_results", "results_label", "fmt"]

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "h200.json"


def load_results(path=RESULTS):
    """The committed benchmark (a dict), or None when the file is not there yet."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def results_label(res, section: str | None = None) -> str:
    """GPU, versions and date of the run behind ``section`` (its ``<section>_meta``, else the top level)."""
    res = res or {}
    meta = res.get(f"{section}_meta", res) if section else res
    return (f"{meta.get('gpu', meta.get('device_name', '?'))} · torch {meta.get('torch', '?')} · "
            f"triton {meta.get('triton', '?')} · {meta.get('date', '?')}")


def fmt(x, nd=0) -> str:
    """A table cell: x with nd decimals, or an em dash for a missing number."""
    return "—" if x is None else f"{x:.{nd}f}"
