"""Facts lesson 11 states, held by tests: each figure comes from its record through a function of
helpers/lesson11/records.py (or is computed by a cell), and each claim the prose makes in words follows from the
record. A table shows its record's rows and its label (GPU, versions, date, statistic)."""
from __future__ import annotations

import importlib.util
import math

import pytest

from conftest import ROOT, cells as _cells, flat as _flat, interview as _interview, markdown as _markdown  # noqa: F401
from helpers.lesson11 import records as R
from helpers.results import load_json

NB = "11_hopper_fa3"
LABEL = ("NVIDIA H200", "torch 2.11.0+cu130", "triton 3.6.0", "2026-12-01", "median")


def _labelled(text, *extra):
    for word in LABEL[:4] + extra:
        assert word in text, f"{word!r} missing from:\n{text[:400]}"


def _ratios(rows, a, b):
    return [r[f"{a}_tflops"] / r[f"{b}_tflops"] for r in rows]


# ------------------------------------------------------------------ the constants the tables read from the kernels
def test_kernel_constants_are_the_kernels_own():
    routes, auto = R.kernel_constant("GLUON_ROUTES", "forward"), R.kernel_constant("AUTO_VARIANT")
    assert routes == {(64, False), (128, False), (128, True)} and auto[(64, False)] == "one"
    if importlib.util.find_spec("triton"):
        from helpers.kernels import forward
        assert routes == forward.GLUON_ROUTES
    with pytest.raises(KeyError):
        R.kernel_constant("NO_SUCH_NAME")


# ------------------------------------------------------------------ section 8: the first kernels, the variants
def test_first_kernels_table_and_what_the_lesson_says_of_it():
    """gluon_h200.json: one partition level with the Triton kernel, the producer split slower on every row, cuDNN
    ahead of the one-partition kernel on every row, both Gluon kernels ahead of SDPA flash on every row."""
    res = R.load_gluon()
    rows = res["rows"]
    table = R.gluon_table(res)
    _labelled(table, "non-causal", "L2 flushed")
    assert sum(ln.startswith(("bfloat16", " float16")) for ln in table.splitlines()) == len(rows) == 8
    one = _ratios(rows, "gluon", "triton")
    assert all(0.9 < x < 1.05 for x in one) and 0.93 < R.geomean(one) < 1.03
    assert all(x < 1 for x in _ratios(rows, "gluon_ws", "triton"))
    assert all(x < 1 for x in _ratios(rows, "gluon", "sdpa_cudnn"))
    assert all(x > 1 for v in ("gluon", "gluon_ws") for x in _ratios(rows, v, "sdpa_flash"))


def test_variants_table_and_what_the_lesson_says_of_it():
    """gluon_h200_variants.json: ping-pong behind cuDNN everywhere, at best level with the Triton kernel, level with the
    one-partition kernel at d = 128 and behind it at d = 64; the overlap alone below both; cuDNN first in all rows
    but one of the two records, where the Triton and one-partition kernels lead by a little."""
    res = R.load_gluon(R.GLUON_FA3)
    rows = res["rows"]
    table = R.gluon_table(res)
    _labelled(table)
    assert "ping-pong + overlap / one partition at d = 128" in table and "at d = 64" in table
    assert all(x < 1 for x in _ratios(rows, "gluon_pp", "sdpa_cudnn"))
    assert max(_ratios(rows, "gluon_pp", "triton")) < 1.005
    vs_one = R.gluon_vs_one(res)
    assert 0.98 < vs_one[("gluon_pp", 128)][0] < 1.03 and vs_one[("gluon_pp", 64)][2] < 0.95
    assert all(r["gluon_overlap_tflops"] < min(r["gluon_pp_tflops"], r["gluon_tflops"]) for r in rows)
    f = R.fastest()
    assert f["rows"] == 12 and f["cudnn_first"] == 11 and len(f["others"]) == 1
    (row, ahead), = f["others"]
    assert {k for k, _ in ahead} == {"gluon", "triton"} and all(0 < x < 0.03 for _, x in ahead)
    assert "SDPA cuDNN in 11 of 12 rows" in R.fastest_line()


def test_causal_table_and_the_pp128_experiment():
    """gluon_h200_causal.json: the best variant behind cuDNN but in the two d = 64 rows without a mask (the
    one-partition kernel); pp128 about half of pp at d = 128, close to it at d = 64."""
    c = R.gluon_causal()
    table = R.gluon_causal_table()
    _labelled(table, "causal and not, per row")
    assert len(c["rows"]) == 8 and sum("N=16384" in ln for ln in table.splitlines()) >= 8
    assert all(r[f"{v}_pass"] for r in c["rows"] for v in ("gluon", "gluon_pp", "gluon_pp128"))
    assert [(r["d"], r["causal"], v) for r, v, _ in c["ahead"]] == [(64, False, "one")] * 2
    lo, hi = c["pp128_vs_pp"][128]
    assert 0.4 < lo <= hi < 0.6
    lo, hi = c["pp128_vs_pp"][64]
    assert 0.9 < lo <= hi < 1.05


def test_ptxas_lines_say_the_versions_and_the_spills():
    rep = {"triton": "3.9.0", "ptxas": "V13.4.59", "rows": [
        dict(variant="pp128", d=128, dtype="bf16", causal=False, report=True, spill_stores=764, spill_loads=1272,
             registers=168, notes=[("C7512", "wgmma.mma_async instructions are serialized")]),
        dict(variant="pp", d=128, dtype="bf16", causal=False, report=False)]}
    from helpers.lesson11 import ptxas_lines
    out = ptxas_lines(rep)
    for word in ("ptxas V13.4.59", "Triton 3.9.0", "sm_90a", "764 spill stores", "C7512", "printed no ptxas report"):
        assert word in out
    assert "could not be made" in ptxas_lines({"error": "no Triton"})


def test_the_notebook_computes_ptxas_report_where_it_has_no_record():
    """ptxas's spill bytes have no record: a cell computes them here (and the prose gives no number)."""
    code = [c for c in _cells(NB, "code") if "ptxas_report()" in c.source]
    assert len(code) == 1
    out = "".join(o.get("text", "") for o in code[0].get("outputs", []))
    assert "pp128" in out and ("spill stores" in out or "could not be made" in out)
    assert "bytes per\nthread" not in _markdown(NB) and "392" not in _markdown(NB)


# ------------------------------------------------------------------ tuned, routed, and the backward
def test_the_sweep_found_the_causal_grid():
    """Call 1: every Gluon tiling's causal rows far below its non-causal ones, the Triton forward's not."""
    ratios = R.causal_over_full()
    gl_ = [x for k, x in ratios.items() if k.startswith("gluon")]
    assert len(gl_) == 7 and max(gl_) < 0.95 and ratios["triton"] > 0.95
    table = R.causal_over_full_table()
    _labelled(table, "B·H, query blocks")
    assert all(k in table for k in ratios)


def test_hbm_need_is_close_to_the_copy_rate():
    h = R.hbm_need()
    assert h["flop_per_byte"] == 128 and 0.6 < h["need_gbs"][1] / h["copy_gbs"] < 1.0
    line = R.hbm_line()
    assert "h200.json" in line and "2026-11-29" in line and "2026-12-01" in line


def test_route_table_splits_the_rows_by_what_flash_attn_triton_runs():
    """Call 2: "auto" faster than the Triton kernel on every routed row; within a few percent of it on the d = 64
    causal rows, which stay with the Triton kernel; "auto"'s pick the faster of the two default-tile variants in all
    rows but one; another tiling ahead by a little in a few rows."""
    rt = R.route()
    routed = [x for x in rt["rows"] if x["routed"]]
    other = [x for x in rt["rows"] if not x["routed"]]
    assert len(routed) == 12 and len(other) == 4
    assert all((x["row"]["d"], x["row"]["causal"]) == (64, True) for x in other)
    assert min(x["vs_triton"] for x in routed) > 1
    assert all(0.95 < x["vs_triton"] < 1.05 for x in other)
    assert sum(not x["beats_other"] for x in rt["rows"]) == 1
    ahead = [x for x in rt["rows"] if x["lead"] > 0]
    assert 1 <= len(ahead) <= 6 and max(x["lead"] for x in ahead) < 0.05
    table = R.route_table()
    _labelled(table, "call 2", "GLUON_ROUTES")
    assert "routed rows (12)" in table and "not routed rows (4)" in table


def test_targets_split_the_forward_by_route():
    """The forward record's 16 rows: where routed, the Gluon kernel about level with cuDNN in geomean and well ahead
    of SDPA flash, short of the 1.05x target; the lowest rows are the short causal d = 64 ones, which are not routed
    (their Triton figures come from call 2). The backward: behind cuDNN on every row, ahead of the Triton backward at
    d = 128 and behind it at d = 64, the atomic mode slower in geomean."""
    t = R.gluon_targets()
    fwd, un, tri, bwd = t["forward"], t["forward_unrouted"], t["triton_unrouted"], t["backward"]
    assert fwd["rows"] == 12 and un["rows"] == 4 and tri["rows"] == 4
    assert 0.97 < fwd["vs_cudnn"][0] < 1.05 and fwd["vs_flash"] > 1.3
    rows = sorted(load_json(R.GLUON_FORWARD)["rows"], key=lambda r: r["gluon_auto_tflops"] / r["sdpa_cudnn_tflops"])
    assert all(r["d"] == 64 and r["causal"] and r["N"] == 4096 for r in rows[:2])
    assert bwd["below"] == bwd["rows"] == 16
    b_rows = load_json(R.GLUON_BACKWARD)["rows"]
    assert all(r["gluon_tflops"] > r["triton_tflops"] for r in b_rows if r["d"] == 128)
    assert all(r["gluon_tflops"] < r["triton_tflops"] for r in b_rows if r["d"] == 64)
    assert bwd["atomic_vs_cudnn"][0] < bwd["vs_cudnn"][0]
    table = R.gluon_targets_table()
    _labelled(table)
    runs = [ln.split("|")[0].split()[-1] for ln in table.splitlines() if ln.startswith(("bfloat16", " float16"))]
    assert len(runs) == 16 and runs.count("triton") == 4 and runs.count("gluon") == 12
    assert "from call 2" in table and "rows not routed" in table


# ------------------------------------------------------------------ Nsight Compute and the persistent variant
def test_profile_says_what_the_lesson_says():
    p = R.gluon_profile()
    main = {case: v["main"] for case, v in p.items()}
    ratio = {case: p[case]["ms"] / p[case.replace("-gluon-", "-cudnn-")]["ms"] for case in p if "-gluon-" in case}
    assert abs(main["fwd-gluon-d128-N16384"]["tensor_pct"] - main["fwd-cudnn-d128-N16384"]["tensor_pct"]) < 2
    assert 0.95 < ratio["fwd-gluon-d128-N16384"] < 1.05                                    # "level"
    g64, c64 = main["fwd-gluon-d64-N4096-causal"], main["fwd-cudnn-d64-N4096-causal"]
    assert ratio["fwd-gluon-d64-N4096-causal"] > 1 and g64["tensor_pct"] < c64["tensor_pct"]
    assert g64["registers"] == c64["registers"] and c64["grid"] == 132 and g64["grid"] > 132 * 10
    assert abs(ratio["bwd-gluon-d128-N16384"] - 7 / 5) < 0.05                              # "that 7/5"
    dkdv = next(k for k in p["bwd-gluon-d128-N16384"]["kernels"] if k["kernel"] == "_bwd_dkdv")
    assert dkdv["registers"] == 255
    assert ratio["bwd-gluon-d64-N4096-causal"] > 7 / 5 + 0.05
    dkdv64 = next(k for k in p["bwd-gluon-d64-N4096-causal"]["kernels"] if k["kernel"] == "_bwd_dkdv")
    assert dkdv64["tensor_pct"] < main["bwd-cudnn-d64-N4096-causal"]["tensor_pct"]
    _labelled(R.gluon_profile_table(), "Nsight Compute")


def test_ppp_table_names_its_two_baselines():
    """Slower than the one-item grid on every causal row and on most others; at d = 64 without a mask the baseline
    is the one-partition kernel."""
    p = R.gluon_ppp()
    assert set(p) == {("one", False), ("pp", False), ("pp", True)}
    assert all(x < 1 for x in p[("pp", True)])
    others = p[("one", False)] + p[("pp", False)]
    assert sum(x < 1 for x in others) > len(others) / 2
    table = R.gluon_ppp_table()
    _labelled(table)
    assert "against 'one', no mask" in table and "against 'pp', causal" in table


def test_selftests_are_read_from_their_logs():
    text = R.selftest_summary()
    assert text.count("ALL OK") == len(R.SELFTESTS)
    for n in ("20 cases", "68 cases", "136 cases, 0 failed"):
        assert n in text
    assert "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0" in text


def test_every_results_cell_ran_and_shows_its_label():
    """Each table the lesson's words rest on is printed by a cell, and its saved output carries the record's label."""
    for fn in ("selftest_summary", "gluon_table", "fastest_line", "gluon_causal_table", "causal_over_full_table",
               "hbm_line", "route_table", "gluon_targets_table", "gluon_profile_table", "gluon_ppp_table"):
        found = [c for c in _cells(NB, "code") if f"records.{fn}(" in c.source]
        assert found, f"no cell calls records.{fn}"
        out = "".join(o.get("text", "") for c in found for o in c.get("outputs", []))
        assert "NVIDIA H200" in out, fn


# ------------------------------------------------------------------ issue 36's corrections, held
def test_issue_36_corrections_stay():
    from helpers.lesson11 import PAPER
    assert "§3.1" in PAPER["source"]
    text = _flat(_markdown(NB))
    for wrong in ("FA3 paper (§3.2)", "FA3 §3.2 forces", "`tma.async_load` from 3.7", "Triton's `tl` cannot say",
                  "FA3's way:", "writes P and dS to shared memory", "fastest in a run of every variant",
                  "the next tile's Q Kᵀ issued before this tile's softmax", "FA2 cannot do this on Hopper"):
        assert wrong not in text, wrong
    src = (ROOT / "helpers" / "kernels" / "gluon_forward.py").read_text()
    assert "FA3's tile for d = 128" not in src and "async_load from 3.7" not in src
    hopper = (ROOT / "helpers" / "lesson11" / "hopper.py").read_text()
    assert 'flash_attn_triton(q, k, v, backend="triton")' in hopper



def test_a_long_tables_summary_is_its_label_and_summary_lines():
    """The lesson shows each long table as its label and summary lines, the rows in a cell with folded output."""
    full = R.route_table()
    short = R.summary(full)
    assert short.splitlines()[0] == full.splitlines()[0]
    assert all(ln.startswith("  ") for ln in short.splitlines()[1:]) and "routed rows (12)" in short
    assert not any(ln.startswith(("bfloat16", " float16")) for ln in short.splitlines())
    for fn in ("route_table", "gluon_targets_table", "gluon_profile_table", "gluon_ppp_table"):
        folded = [c for c in _cells(NB, "code") if c.source.startswith(f"print(records.{fn}())")]
        assert len(folded) == 1 and folded[0].metadata["jupyter"]["outputs_hidden"] is True, fn
