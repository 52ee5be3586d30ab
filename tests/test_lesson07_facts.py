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


def test_lesson07_summaries_read_the_record_and_label_it():
    from helpers import lesson07
    from helpers.results import geomean_ratio, results_label
    res = lesson07.load_results()
    text = lesson07.prefill_summary(res)
    for other, name in (("sdpa_flash_tflops", "flash"), ("sdpa_cudnn_tflops", "cuDNN")):
        assert f"Triton / SDPA {name}: {geomean_ratio(res, 'prefill', other):.2f}x" in text
    n_long = sum(r["N"] >= 2048 for r in res["prefill"])
    assert f"{n_long} rows" in text and f"of {len(res['prefill'])} rows" in text
    assert text.splitlines()[-1].strip() == results_label(res, "prefill") + " · " + res["timing"]
    dec = lesson07.decode_summary(res)
    big = [r for r in res["decode"] if r["cache_mib"] >= 256]
    assert f"({len(big)} rows): Triton {min(r['triton_gbs'] for r in big):.0f} to " in dec
    assert dec.splitlines()[-1].strip() == results_label(res, "decode") + " · " + res["decode_meta"]["timing"]
    shown = _outputs("07_triton_gpu", "lesson07.prefill_summary(res)")
    assert text in shown and dec in shown                                   # the saved output is the record's
    assert lesson07.prefill_summary(None).endswith("(not measured yet)")
    assert lesson07.decode_summary({}).endswith("(not measured yet)")


def test_what_lesson07_says_of_the_h200_results_follows_from_the_record():
    """Faster than SDPA flash on every row; behind cuDNN on all but the longest causal rows at d = 128, a little on
    long sequences and further on short ones; decode
    level with cuDNN on caches of 256 MiB or more, launch-bound on the smallest."""
    from helpers import lesson07
    res = lesson07.load_results()
    rows = res["prefill"]
    assert all(r["triton_tflops"] > r["sdpa_flash_tflops"] for r in rows)
    ahead = [r for r in rows if r["triton_tflops"] > r["sdpa_cudnn_tflops"]]
    assert 0 < len(ahead) <= len(rows) // 10
    assert all(r["causal"] and r["d"] == 128 and r["N"] == max(x["N"] for x in rows) for r in ahead)
    assert 0.9 < lesson07.geomean_ratio(res, "sdpa_cudnn_tflops") < 1          # a little behind on long sequences
    for key in {(r["dtype"], r["d"], r["causal"]) for r in rows}:               # further on short ones
        sel = {r["N"]: r["triton_tflops"] / r["sdpa_cudnn_tflops"] for r in rows
               if (r["dtype"], r["d"], r["causal"]) == key}
        assert min(sel, key=sel.get) <= 1024, key
    big = [r for r in res["decode"] if r["cache_mib"] >= 256]
    assert all(0.97 < r["triton_gbs"] / r["sdpa_cudnn_gbs"] < 1.03 for r in big)
    smallest = min(res["decode"], key=lambda r: r["cache_mib"])
    assert smallest["triton_gbs"] < smallest["triton_graph_gbs"] / 2
