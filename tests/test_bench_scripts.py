"""The GPU benchmark scripts' CPU smoke runs (Triton's interpreter, tiny sizes): they run, check, and merge their rows."""

import importlib.util
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import ROOT  # noqa: E402
from helpers.triton_attention import interpreting  # noqa: E402

PAGED_KEYS = {"dtype", "B", "H", "Hkv", "d", "block_size", "mean_len", "triton_gbs", "contig_triton_gbs",
              "sdpa_cudnn_gbs"}


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not interpreting(), reason="the smoke run needs Triton's interpreter")
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
