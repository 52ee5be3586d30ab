"""Facts lesson 11 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


def test_lesson11_fa3_variant_figures_match_their_record():
    """Lesson 11's sentence on FA3's ping-pong kernel carries the ratios of bench/results/gluon_h200_variants.json."""
    from helpers.lesson11 import records as results
    rec = results.load_gluon(results.GLUON_FA3)
    rows = rec["rows"]
    assert rows and all(r["gluon_pp_pass"] and r["gluon_overlap_pass"] for r in rows)

    def span(a, b):
        xs = [r[f"{a}_tflops"] / r[f"{b}_tflops"] for r in rows]
        return f"{min(xs):.2f}–{max(xs):.2f}×"
    text = _flat(_markdown("11_hopper_fa3"))
    assert f"the ping-pong kernel reaches {span('gluon_pp', 'triton')} the course's Triton forward" in text
    assert f"and {span('gluon_pp', 'sdpa_cudnn')} cuDNN" in text
    every = results.load_gluon()["rows"] + rows
    fastest = sum(r["sdpa_cudnn_tflops"] >= max(v for k, v in r.items() if k.endswith("_tflops")) for r in every)
    assert f"fastest in {fastest} of the {len(every)} rows timed" in text


def test_lesson11_causal_gqa_figures_match_their_record():
    """Lesson 11's paragraph on the causal and GQA run carries bench/results/gluon_h200_causal.json's figures."""
    import json
    from conftest import ROOT
    rows = json.loads((ROOT / "bench" / "results" / "gluon_h200_causal.json").read_text())["rows"]
    assert len(rows) == 8 and all(r[f"{v}_pass"] for r in rows for v in ("gluon", "gluon_pp", "gluon_pp128"))
    best = [max(r[f"{v}_tflops"] for v in ("gluon", "gluon_pp", "gluon_pp128")) / r["sdpa_cudnn_tflops"] for r in rows]
    one64 = [r["gluon_tflops"] / r["sdpa_cudnn_tflops"] for r in rows if r["d"] == 64 and not r["causal"]]
    span = lambda xs, n=2: f"{min(xs):.{n}f}–{max(xs):.{n}f}"  # noqa: E731
    tf = lambda v, d: [r[f"{v}_tflops"] for r in rows if r["d"] == d]  # noqa: E731
    ahead = [r for r, b in zip(rows, best) if b > 1]
    assert {(r["d"], r["causal"]) for r in ahead} == {(64, False)} and len(ahead) == 2  # "only in the two rows ..."
    text = _flat(_markdown("11_hopper_fa3"))
    for sentence in (f"The best variant per row ran at {span(best)}× cuDNN",
                     f"(the one-partition kernel, {span(one64)}×)",
                     f"ran at {span(tf('gluon_pp128', 128), 0)} TFLOP/s there, about half of `pp`'s {span(tf('gluon_pp', 128), 0)}",
                     f"it ran at {span(tf('gluon_pp128', 64), 0)} TFLOP/s against `pp`'s {span(tf('gluon_pp', 64), 0)}"):
        assert sentence in text, f"lesson 11 should say: {sentence}"


def test_lesson11_gluon_targets_match_their_records():
    """Lesson 11's paragraph on the routed forward and the Gluon backward carries gluon_forward_h200.json's and
    gluon_backward_h200.json's figures (recomputed from their rows by helpers.results.gluon_targets)."""
    import json
    from conftest import ROOT
    from helpers.lesson11 import records as results
    t = results.gluon_targets()
    fwd, bwd = t["forward"], t["backward"]
    assert fwd["rows"] == 16 and bwd["rows"] == 16
    rows_f = json.loads((ROOT / "bench" / "results" / "gluon_forward_h200.json").read_text())["rows"]
    rows_b = json.loads((ROOT / "bench" / "results" / "gluon_backward_h200.json").read_text())["rows"]
    assert all(r["gluon_auto_pass"] for r in rows_f) and all(r["gluon_pass"] and r["gluon_atomic_pass"] for r in rows_b)
    short = [r["gluon_auto_tflops"] / r["sdpa_cudnn_tflops"] for r in rows_f
             if r["causal"] and r["d"] == 64 and r["N"] == 4096]
    atomic = results.geomean([r["gluon_atomic_tflops"] / r["sdpa_cudnn_tflops"] for r in rows_b])
    ahead128 = all(r["gluon_tflops"] > r["triton_tflops"] for r in rows_b if r["d"] == 128)
    behind64 = all(r["gluon_tflops"] < r["triton_tflops"] for r in rows_b if r["d"] == 64)
    assert ahead128 and behind64                                   # "ahead of it at d = 128, behind at d = 64"
    span = lambda lo_hi: f"{lo_hi[0]:.2f}–{lo_hi[1]:.2f}×"  # noqa: E731
    text = _flat(_markdown("11_hopper_fa3"))
    for sentence in (
            f"runs at {fwd['vs_cudnn'][0]:.2f}× cuDNN in geometric mean over the 16 rows "
            f"({span(fwd['vs_cudnn'][1:])}; {fwd['below']} of 16 below it) and {fwd['vs_flash']:.2f}× SDPA's flash",
            f"(N = 4096: {span((min(short), max(short)))})",
            f"{bwd['vs_cudnn'][0]:.2f}× cuDNN in geometric mean ({span(bwd['vs_cudnn'][1:])}) and "
            f"{bwd['vs_triton']:.2f}× the course's Triton backward",
            f"The atomic variant ran at {atomic:.2f}× cuDNN"):
        assert sentence in text, f"lesson 11 should say: {sentence}"
    # "1.02–1.22× in one run": the routed shapes (forward.GLUON_ROUTES) against the Triton forward in the run that
    # timed both (call 2's files), the kernel "auto" picks for each
    from helpers.kernels.forward import GLUON_ROUTES
    logs = ROOT / "bench" / "results" / "logs"
    both = [r for d in (64, 128) for r in json.loads((logs / f"gluon_fwd_grid_d{d}_2026-12-01.json").read_text())["rows"]]
    pick = {(64, False): "gluon", (128, False): "gluon_pp", (128, True): "gluon_pp"}
    assert set(pick) == GLUON_ROUTES
    routed = [r[f"{pick[(r['d'], r['causal'])]}_tflops"] / r["triton_tflops"] for r in both if (r["d"], r["causal"]) in pick]
    assert len(routed) == 12 and f"({span((min(routed), max(routed)))} in one run;" in text
    readme = _flat((ROOT / "README.md").read_text())
    for sentence in (
            f"ran at {fwd['vs_cudnn'][0]:.2f}× cuDNN in geometric mean over 16 rows",
            f"{span(fwd['vs_cudnn'][1:])}, {fwd['below']} rows below 1) and {fwd['vs_flash']:.2f}× SDPA flash",
            f"ran at {bwd['vs_cudnn'][0]:.2f}× cuDNN ({span(bwd['vs_cudnn'][1:])}) and {bwd['vs_triton']:.2f}× the Triton "
            "backward"):
        assert sentence in readme, f"the README should say: {sentence}"


def test_lesson11_profile_paragraph_matches_its_record():
    """Lesson 11's "What Nsight Compute shows" carries gluon_profile_h200.json's figures (bench/profile_gluon.py),
    read through helpers.results.gluon_profile, and the persistent variant's run beside the one-item grid."""
    from conftest import ROOT as ROOT_FACTS
    from helpers.lesson11 import records as results
    p = results.gluon_profile()
    main = {case: v["main"] for case, v in p.items()}
    ratio = {case: p[case]["ms"] / p[case.replace("-gluon-", "-cudnn-")]["ms"] for case in p if "-gluon-" in case}
    dkdv, dq = (next(k for k in p["bwd-gluon-d128-N16384"]["kernels"] if k["kernel"] == name)
                for name in ("_bwd_dkdv", "_bwd_dq"))
    dkdv64 = next(k for k in p["bwd-gluon-d64-N4096-causal"]["kernels"] if k["kernel"] == "_bwd_dkdv")
    fwd64, cud64 = main["fwd-gluon-d64-N4096-causal"], main["fwd-cudnn-d64-N4096-causal"]
    assert fwd64["registers"] == cud64["registers"] == 168 and cud64["grid"] == 132 and fwd64["grid"] == 8192
    text = _flat(_markdown("11_hopper_fa3"))
    for sentence in (
            f"busy {main['fwd-gluon-d128-N16384']['tensor_pct']:.1f}% of the time in the Gluon forward and "
            f"{main['fwd-cudnn-d128-N16384']['tensor_pct']:.1f}% in cuDNN's, and the two calls take the same time "
            f"({ratio['fwd-gluon-d128-N16384']:.2f}×)",
            f"The Gluon call takes {ratio['fwd-gluon-d64-N4096-causal']:.2f}× cuDNN's time, and its tensor cores are "
            f"busy {fwd64['tensor_pct']:.1f}% of the time against {cud64['tensor_pct']:.1f}%",
            f"{dkdv['tensor_pct']:.1f}% and {dq['tensor_pct']:.1f}% of the time, cuDNN's one kernel "
            f"{main['bwd-cudnn-d128-N16384']['tensor_pct']:.1f}%",
            f"the Gluon call takes {ratio['bwd-gluon-d128-N16384']:.2f}× cuDNN's time",
            f"it already holds {dkdv['registers']:.0f} a thread",
            f"{ratio['bwd-gluon-d64-N4096-causal']:.2f}× cuDNN's time; the dK/dV kernel keeps the tensor cores busy "
            f"only {dkdv64['tensor_pct']:.1f}% of the time against cuDNN's "
            f"{main['bwd-cudnn-d64-N4096-causal']['tensor_pct']:.1f}%"):
        assert sentence in text, f"lesson 11 should say: {sentence}"
    assert abs(ratio["bwd-gluon-d128-N16384"] - 7 / 5) < 0.05      # "7/5 = 1.4 is what the record shows"
    import json
    ppp = json.loads((ROOT_FACTS / "bench" / "results" / "logs" / "gluon_ppp_2026-12-01.json").read_text())["rows"]
    assert len(ppp) == 16 and all(r["gluon_ppp_pass"] and r["gluon_auto_pass"] for r in ppp)
    for causal in (True, False):
        xs = [r["gluon_ppp_tflops"] / r["gluon_auto_tflops"] for r in ppp if r["causal"] == causal]
        span = f"{min(xs):.2f}–{max(xs):.2f}× " + ("the one-item grid on the causal rows" if causal else "on the others")
        assert span in text, f"lesson 11 should say: {span}"
        if causal:
            readme_ppp = _flat((ROOT_FACTS / "README.md").read_text())
            assert f"{min(xs):.2f}–{max(xs):.2f}× the one-item grid on causal rows" in readme_ppp
    from conftest import ROOT
    readme = _flat((ROOT / "README.md").read_text())
    for sentence in (
            f"as busy as cuDNN's ({main['fwd-gluon-d128-N16384']['tensor_pct']:.1f}% and "
            f"{main['fwd-cudnn-d128-N16384']['tensor_pct']:.1f}%)",
            f"less so ({fwd64['tensor_pct']:.1f}% against {cud64['tensor_pct']:.1f}%)",
            f"the call takes {ratio['bwd-gluon-d128-N16384']:.2f}× cuDNN's time at d = 128"):
        assert sentence in readme, f"the README should say: {sentence}"
