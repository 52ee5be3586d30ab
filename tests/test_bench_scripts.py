"""The GPU benchmark scripts run end to end on tiny sizes under Triton's interpreter (--smoke).

Not a measurement: it proves the script's paths (lengths, the float64 check, the three timed calls,
the JSON merge that keeps every other key) run and write rows with the keys `make bench` promises.
"""

import importlib.util
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARLEN_KEYS = {"dtype", "d", "causal", "H", "Hkv", "total_tokens", "lengths", "triton_tflops",
               "dense_triton_tflops", "sdpa_padded_tflops", "mix", "err_ratio"}


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU interpreter run")
def test_bench_varlen_smoke_merges_rows(tmp_path):
    bench = _load("bench_varlen")
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"prefill": [{"N": 1}], "gpu": "kept"}))
    rows = bench.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["prefill"] == [{"N": 1}] and data["gpu"] == "kept", "other keys must be left as they were"
    assert data["varlen"] == rows and len(rows) >= 2
    meta = data["varlen_meta"]
    assert {"gpu", "torch", "triton", "date"} <= set(meta) and len(meta["details"]) == len(rows)
    for row, detail in zip(rows, meta["details"]):
        assert set(row) == VARLEN_KEYS
        assert detail["pass"] and row["err_ratio"] <= 2 + 1e-5 / detail["sdpa_err"], (row, detail)
        for key in ("triton_tflops", "dense_triton_tflops", "sdpa_padded_tflops"):
            assert row[key] is not None and row[key] >= 0
    assert {r["Hkv"] < r["H"] for r in rows} == {True, False}, "GQA and MHA rows"
    assert {r["causal"] for r in rows} == {True, False}


def test_varlen_useful_flops_count_visible_pairs():
    bench = _load("bench_varlen")
    for n, nk in ((5, 5), (3, 7), (7, 3), (1, 1), (4, 0)):
        brute = sum(1 for i in range(n) for j in range(nk) if j <= i + nk - n)
        assert bench.visible_pairs(n, nk, True) == brute
        assert bench.visible_pairs(n, nk, False) == n * nk
    assert bench.useful_flops([4, 2], H=3, d=8, causal=True) == 4 * 3 * 8 * (10 + 3)
    import random
    for mix in ("uniform", "long-tailed", "equal"):
        lens = bench.make_lengths(mix, 32768, random.Random(0))
        assert sum(lens) == 32768 and min(lens) >= 1, mix


PAGED_KEYS = {"dtype", "B", "H", "Hkv", "d", "block_size", "mean_len", "triton_gbs", "contig_triton_gbs",
              "sdpa_cudnn_gbs"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU interpreter run")
def test_bench_kvcache_smoke_merges_rows(tmp_path):
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"decode": [{"kept": 1}], "paged": [{"stale": 1}]}))
    rows = _load("bench_kvcache").main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["decode"] == [{"kept": 1}], "other keys must be left as they were"
    assert data["paged"] == json.loads(json.dumps(rows)) and len(rows) == 2
    for r in rows:
        assert PAGED_KEYS <= set(r), PAGED_KEYS - set(r)
        assert r["pass"] and r["contig_pass"], r
        assert r["err"] <= 2 * r["sdpa_err"] + 1e-5
        assert sum(r["lengths"]) == r["B"] * r["mean_len"]
    assert {"gpu", "torch", "triton", "date"} <= set(data["paged_meta"])
