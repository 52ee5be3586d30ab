"""Facts the lessons state, held by tests (the lessons say only what is true).

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

from conftest import markdown


# --------------------------------------------------------------------------- item 3: the timing statistic
def test_triton_do_bench_default_is_the_mean():
    """Why the statistic must be named: Triton's own default is the mean, not the median."""
    triton_testing = pytest.importorskip("triton.testing")
    default = inspect.signature(triton_testing.do_bench).parameters["return_mode"].default
    assert default == "mean"


def test_bench_script_asks_for_the_median_everywhere():
    """Every bench script (the committed figures) and the notebook's helper use the same statistic: each
    do_bench call under bench/ asks for the median, and the scripts time through bench/common.py's one helper."""
    from pathlib import Path
    import re

    bench = Path(__file__).resolve().parent.parent / "bench"
    callers = {}
    for path in sorted(bench.glob("*.py")):
        calls = re.findall(r"do_bench(?:_cudagraph)?\((?:[^()]|\([^()]*\))*\)", path.read_text())
        for call in calls:
            assert 'return_mode="median"' in call, (path.name, call)
        if calls:
            callers[path.name] = len(calls)
    assert "common.py" in callers, "bench/common.py no longer calls do_bench"
    assert set(callers) == {"common.py"}, f"time through common.bench_ms / graph_ms, not do_bench directly: {callers}"


# --------------------------------------------------------------------------- item 1: lse sentinels
def test_why_fa2_writes_plus_inf_for_an_empty_row():
    """The backward recomputes P = exp(S - lse); on an empty row S = -inf everywhere."""
    S = torch.full((3,), -float("inf"))
    assert torch.exp(S - float("inf")).eq(0).all()              # FA2's +inf: P = 0, no NaN
    assert torch.exp(S - (-float("inf"))).isnan().all()         # -inf there would give NaN


def test_reference_uses_the_course_sentinel():
    from helpers.reference import attention
    q, k, v = torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    o, lse = attention(q, k, v, mask=mask)
    assert torch.isneginf(lse[1]) and o[1].eq(0).all()


# --------------------------------------------------------------------------- item 11: -1e6 in half precision
def test_minus_1e6_in_float16_and_bfloat16():
    S = torch.randn(2, 3)
    empty = torch.tensor([[False, True, False], [True, True, True]])
    with pytest.raises(RuntimeError, match="overflow"):
        S.half().masked_fill(empty, -1e6)                        # fp16: masked_fill refuses
    assert torch.isneginf(torch.tensor(-1e6).half())             # only a cast rounds to -inf
    P = torch.softmax(S.bfloat16().masked_fill(empty, -1e6).float(), -1)
    assert torch.allclose(P[1], torch.full((3,), 1 / 3))         # bf16: silent uniform average of V
    P = torch.softmax(S.half().masked_fill(empty, torch.finfo(torch.float16).min).float(), -1)
    assert torch.allclose(P[1], torch.full((3,), 1 / 3))         # finfo.min: the same silent bug


# --------------------------------------------------------------------------- statements retracted for good
@pytest.mark.parametrize("name, wrong", [
    ("05_fully_masked_rows", "The FlashAttention convention"),          # FA2 writes lse = +inf there
    ("05_fully_masked_rows", "it rounds to −∞"),                        # masked_fill raises in float16
    ("06_flash_decoding", "splits fall on page boundaries"),            # FA2 splits on kBlockN tiles
    ("06_flash_decoding", "The library calls this\npacking GQA"),       # PackGQA is FA3's; FA2 swaps groups
    ("06_flash_decoding", "a heuristic picks (like `L.suggest_splits`)"),
    ("07_triton_gpu", "`do_bench` reports a median"),                   # its default is the mean
    ("07_triton_gpu", "~2 FLOPs per query head"),                       # 1 FLOP per byte per query head
    ("02_flash_attention_v1", "> The FLOPs are the same as standard attention"),   # forward only
])
def test_retracted_statements_stay_out(name, wrong):
    assert wrong not in markdown(name)
