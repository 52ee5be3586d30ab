"""Lesson 08's GPU section: the ``dkdv_inner`` checker, its planted bugs, and the recorded-results helpers.

Runs under the Triton interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET=1). The answer
is taken from the one source, the worked notebook ``solutions/08_backward_pass.ipynb``: the code cell
holding ``def dkdv_inner`` is written to a module file (Triton reads a kernel's source from its file)
and each planted bug is a one-line edit of that source.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import matplotlib
import nbformat
import pytest
import torch

matplotlib.use("Agg")

from helpers import check
from helpers.lesson08 import gpu_section  # noqa: E402
from helpers.generate import stub_source  # noqa: E402
from tests.conftest import rejects  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions" / "08_backward_pass.ipynb"
HEADER = "import triton\nimport triton.language as tl\n\n"


def _cell_source() -> str:
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    (src,) = [c.source for c in cells if c.cell_type == "code" and "def dkdv_inner" in c.source]
    return src.strip() + "\n"


def _load(tmp_path, src, name):
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dkdv_inner


def _planted(tmp_path, name, old, new):
    src = _cell_source()
    assert old in src, f"the planted bug {name!r} no longer applies to the cell's source"
    return _load(tmp_path, src.replace(old, new), name)


def test_solution_passes_strict(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")
    check.dkdv_inner(_load(tmp_path, _cell_source(), "inner_solution"))


def test_stub_is_not_attempted(tmp_path, monkeypatch, capsys):
    stub = _load(tmp_path, stub_source(_cell_source()), "inner_stub")
    monkeypatch.setenv("COURSE_STRICT", "0")
    check.dkdv_inner(stub)
    assert "not attempted" in capsys.readouterr().out
    monkeypatch.setenv("COURSE_STRICT", "1")
    rejects(check.dkdv_inner, stub, "not attempted")


def test_bug_no_delta(tmp_path):
    fn = _planted(tmp_path, "inner_no_delta", "(tl.dot(v, tl.trans(do)) - delta[None, :])", "tl.dot(v, tl.trans(do))")
    rejects(check.dkdv_inner, fn, "`dk`", "subtract D")


def test_bug_exp_not_exp2(tmp_path):
    fn = _planted(tmp_path, "inner_exp", "tl.math.exp2(tl.dot(k, tl.trans(q))", "tl.exp(tl.dot(k, tl.trans(q))")
    rejects(check.dkdv_inner, fn, "`dv`", "tl.exp on base-2")


def test_bug_no_causal_mask(tmp_path):
    fn = _planted(tmp_path, "inner_nomask", "keep = keep & (offs_n[:, None] <= rows[None, :])", "keep = keep")
    rejects(check.dkdv_inner, fn, "causal", "keys after the row")


def test_bug_dv_from_ds(tmp_path):
    src = _cell_source()
    dv_line = "        dv = tl.dot(pT.to(do.dtype), do, dv)"
    ds_line = "        dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])"
    line_of = {l.split("#")[0].rstrip(): l for l in src.splitlines()}
    assert dv_line in line_of and ds_line in line_of
    src = src.replace(line_of[dv_line] + "\n", "")
    src = src.replace(line_of[ds_line], line_of[ds_line] + "\n        dv = tl.dot(dsT.to(do.dtype), do, dv)")
    rejects(check.dkdv_inner, _load(tmp_path, src, "inner_dv_ds"), "`dv`", "uses P, not dS")


def test_bug_unmasked_row_loads(tmp_path):
    src = _cell_source().replace("q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)", "q = tl.load(Q + ptrs)")
    src = src.replace("do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)", "do = tl.load(DO + ptrs)")
    assert "tl.load(DO + ptrs)" in src
    rejects(check.dkdv_inner, _load(tmp_path, src, "inner_rows"), "NaN", "mask the query-row loads")


ANOTHER_WAY = '''
@triton.jit
def dkdv_inner(dk, dv, k, v, Q, DO, LSE2, DELTA, lo, hi, offs_n, N, Nk, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    # P untransposed [BLOCK_M, BLOCK_N], masks folded into the scores as -inf, transposes at the dots
    d = tl.arange(0, HEAD_DIM)
    for m0 in range(lo, hi, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        q = tl.load(Q + r[:, None] * HEAD_DIM + d[None, :], mask=(r < N)[:, None], other=0.0)
        g = tl.load(DO + r[:, None] * HEAD_DIM + d[None, :], mask=(r < N)[:, None], other=0.0)
        l2 = tl.load(LSE2 + r, mask=r < N, other=float("inf"))
        dd = tl.load(DELTA + r, mask=r < N, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        ok = (offs_n[None, :] < Nk) & (r[:, None] < N)
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= r[:, None])
        s = tl.where(ok, s, float("-inf"))
        p = tl.math.exp2(s - tl.where(r < N, l2, 0.0)[:, None])
        dv += tl.dot(tl.trans(p).to(g.dtype), g)
        ds = p * (tl.dot(g, tl.trans(v)) - dd[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    return dk, dv
'''


def test_another_correct_way_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")
    check.dkdv_inner(_load(tmp_path, ANOTHER_WAY, "inner_other"))


def test_not_a_jit_function_is_refused(tmp_path):
    def dkdv_inner(*args):
        return args[0], args[1]
    rejects(check.dkdv_inner, dkdv_inner, "@triton.jit")


# ------------------------------------------------------------------ the recorded results
def test_reference_grads_match_sdpa_autograd():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(4))
    _, dq, dk, dv = gpu_section.reference_grads(q, k, v, do, causal=True)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*a, is_causal=True).backward(do)
    for x, y in zip((dq, dk, dv), a):
        assert torch.allclose(x, y.grad, atol=1e-12)
    q2 = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    k2, v2 = torch.randn(1, 1, 0, 8, dtype=torch.float64), torch.randn(1, 1, 0, 8, dtype=torch.float64)
    o, dq2, _, _ = gpu_section.reference_grads(q2, torch.randn(1, 1, 3, 8, dtype=torch.float64),
                                                torch.randn(1, 1, 3, 8, dtype=torch.float64), q2, causal=True)
    assert torch.isfinite(dq2).all() and torch.isfinite(o).all()
    del k2, v2


def test_recorded_results_table_and_plots():
    res = gpu_section.load_results()
    assert res is not None and res.get("backward"), "bench/results/h200.json has no backward rows"
    table = gpu_section.backward_table(res)
    assert "NVIDIA H200" in table and "2026" in table
    assert len(table.splitlines()) == 2 + len(res["backward"])
    assert all(r["pass"] for r in res["backward"])
    ratio = gpu_section.geomean_ratio(res, "sdpa_flash_tflops")
    assert ratio is not None and math.isfinite(ratio)
    assert gpu_section.plot_backward(res).axes
    rec = gpu_section.load_training()
    assert rec is not None and set(rec["runs"]) == {"flash", "sdpa"}
    assert "tokens/s" in gpu_section.training_summary(rec)
    assert gpu_section.plot_training(rec).axes
    with pytest.raises(ValueError, match="no backward rows"):
        gpu_section.plot_backward({"backward": []})


# ------------------------------------------------------------------ what the numbers cannot show, and the error's size
@pytest.mark.parametrize("name, old, new, words", [
    ("inner_exp_ln2", "tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])",
     "tl.exp((tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :]) * 0.6931471805599453)",
     ["calls tl.exp", "tl.math.exp2"]),
    ("inner_from_0", "for start_m in range(lo, hi, BLOCK_M):", "for start_m in range(0, hi, BLOCK_M):",
     ["the loop starts at lo", "visited query rows before lo"]),
    ("inner_dk_twice", "dk = tl.dot(dsT.to(q.dtype), q, dk)", "dk = tl.dot((2.0 * dsT).to(q.dtype), q, dk)",
     ["`dk`", "not rounding, a wrong answer"]),
])
def test_bug_the_numbers_alone_miss_or_misname(tmp_path, name, old, new, words):
    msg = rejects(check.dkdv_inner, _planted(tmp_path, name, old, new), *words)
    assert "a little over" not in msg
