"""Facts the lessons state, held by tests (issue 16: the lessons say only what is true).

Each test pins one statement of a worked notebook to something that can be computed here:
the timing statistic the live cells use, the decode arithmetic intensity, the course's split
heuristic against the library's formula, the lse sentinels of an empty row, float16/bfloat16
behaviour of the ``-1e6`` trick. Where a fact comes from the FlashAttention sources, the test
names the file and function it was checked against.
"""
from __future__ import annotations

import inspect

import pytest
import torch


# --------------------------------------------------------------------------- item 3: the timing statistic
def test_triton_do_bench_default_is_the_mean():
    """Why the statistic must be named: Triton's own default is the mean, not the median."""
    triton_testing = pytest.importorskip("triton.testing")
    default = inspect.signature(triton_testing.do_bench).parameters["return_mode"].default
    assert default == "mean"


def test_lesson07_timing_asks_do_bench_for_the_median(monkeypatch):
    triton_testing = pytest.importorskip("triton.testing")
    from helpers import lesson07

    calls = []

    def fake_do_bench(fn, *args, **kwargs):
        calls.append(kwargs)
        return 1.25

    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    assert lesson07._do_bench(lambda: None) == 1.25
    assert calls and calls[0].get("return_mode") == "median"
    assert "quantiles" not in calls[0]          # quantiles would override return_mode


def test_bench_script_asks_for_the_median_everywhere():
    """bench/bench.py (the committed figures) and the notebook's helper use the same statistic."""
    from pathlib import Path
    import re

    src = (Path(__file__).resolve().parent.parent / "bench" / "bench.py").read_text()
    calls = re.findall(r"do_bench(?:_cudagraph)?\((?:[^()]|\([^()]*\))*\)", src)
    assert calls, "bench.py no longer calls do_bench"
    for call in calls:
        assert 'return_mode="median"' in call, call
