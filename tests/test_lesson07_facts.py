"""Facts lesson 07 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


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


def test_lesson07_teaching_decode_figure_has_its_label():
    text = _flat(_markdown("07_triton_gpu"))
    assert ("0.99–1.06 TB/s effective (bytes counted once) at B = 8, H = 32, Hkv = 8, fp16, Nk 4k–64k, 0.24–0.37× "
            "cuDNN (one NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29") in text
