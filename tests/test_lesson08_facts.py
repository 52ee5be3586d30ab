"""Facts lesson 08 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


# --------------------------------------------------------------------------- 08: determinism as the libraries do it
def test_lesson08_deterministic_backward_is_attributed():
    text = _flat(_markdown("08_backward_pass"))
    for fact in ("fixes the **order**", "own** fp32 slice of `dq_accum`", "`convert_dQ` sums",
                 "semaphore per (batch, head)", "`hopper/epilogue_bwd.hpp`", "is the course's choice for its"):
        assert fact in text, fact
    interview = _interview("08_backward_pass")
    assert "a deterministic variant runs a separate dQ pass" not in interview
    assert "FlashAttention-2 gives each thread block its own fp32 dQ slice" in interview
    assert "FlashAttention-2's deterministic=True gives each thread block its own fp32 dQ slice" in text   # Check yourself


# --------------------------------------------------------------------------- 08: why not store P, in numbers
def test_lesson08_p_round_trip_against_the_matmuls():
    from helpers import lesson08
    t = lesson08.p_traffic_time(d=128)                            # H200 datasheet: 989 TFLOP/s, 4.8 TB/s
    assert t["p_round_trip"] / t["matmul_fwd"] == pytest.approx(1.61, abs=0.01)
    assert t["p_round_trip"] < t["matmul_bwd"]                    # less than the backward's matmuls
    assert t["standard_fwd"] == 2 * t["p_round_trip"]             # Algorithm 0: S and P, each written and read
    rates = lesson08.measured_rates()                              # bench/results/h200.json's ceilings
    from helpers.results import load_results
    ceil = load_results()["ceilings"]
    assert rates["flops"] == ceil["bf16_matmul_tflops"] * 1e12 and rates["bytes_per_s"] == pytest.approx(
        ceil["copy_gbs_read_plus_write"] * 1e9)
    m = lesson08.p_traffic_time(d=128, flops=rates["flops"], bytes_per_s=rates["bytes_per_s"])
    assert 1 < m["p_round_trip"] / m["matmul_fwd"] < t["p_round_trip"] / t["matmul_fwd"]   # "a little less"
    assert lesson08.measured_rates({}) is None
    text = _flat(_markdown("08_backward_pass"))
    assert "far more time than the matmuls" not in text
    assert "about 1.6× the forward's matmul time" in text and "Algorithm 0" in text
    out = _outputs("08_backward_pass", "lesson08.p_traffic_time(d=128)")
    assert "datasheet: P written + read 1.6x" in out
    assert f"measured : P written + read {m['p_round_trip'] / m['matmul_fwd']:.1f}x" in out and rates["label"] in out


def test_lesson08_gqa_breaks_one_writer_per_dk_row():
    text = _flat(_markdown("08_backward_pass"))
    assert "is one thread block: no two write the same rows" not in text           # the unqualified claim
    assert "within a head, no two write the same rows of `dK`, `dV`. Under GQA" in text
    assert "Under GQA that no longer holds" in text and "expanded `dK`, `dV`" in text
    assert "fp32 `dK`, `dV` buffers with atomic adds" in text


def test_lesson08_figures_carry_their_machine_and_numbers():
    from helpers.lesson08 import gpu_section
    rec = gpu_section.load_training()
    summary = gpu_section.training_summary(rec)
    f, s_ = rec["runs"]["flash"]["tokens_per_s"], rec["runs"]["sdpa"]["tokens_per_s"]
    assert f"{f:.0f} vs {s_:.0f} tokens/s" in summary and f"last {rec['runs']['flash']['timed_steps']} steps" in summary
    label = f"{rec['device_name']}, torch {rec['torch']}, triton {rec['triton']}, {rec['date']}"
    assert label.startswith("NVIDIA H200, torch ") and label in summary
    assert summary in _outputs("08_backward_pass", "training_summary(rec)")   # the worked output is the record's
    text = _flat(_markdown("08_backward_pass"))
    assert "which the H200 measured slower" not in text
    assert "which keeps the tensor cores busy with warp-specialised" not in text
    assert "is our inference, not a documented fact" in text
    assert rec["speedup_tokens_per_s"] < 1 and rec["max_loss_diff"] < 0.05       # "a little slower", "close"
    assert abs(rec["runs"]["flash"]["loss"][-1] - rec["runs"]["sdpa"]["loss"][-1]) < 0.01   # "end level"


def test_lesson08_backward_summary_reads_the_record():
    from helpers.lesson08 import gpu_section
    from helpers.results import results_label
    res = gpu_section.load_results()
    text = gpu_section.backward_summary(res)
    for other, name in (("sdpa_flash_tflops", "flash"), ("sdpa_cudnn_tflops", "cuDNN")):
        assert f"Triton / SDPA {name}: {gpu_section.geomean_ratio(res, other):.2f}x" in text
    assert text.splitlines()[-1].strip() == results_label(res, "backward") + " · " + res["backward_meta"]["timing"]
    assert text in _outputs("08_backward_pass", "gpu_section.backward_summary(res)")
    assert gpu_section.backward_summary({}).endswith("(not measured yet)")
    rows = res["backward"]
    assert all(r["triton_tflops"] > r["sdpa_flash_tflops"] for r in rows)                # beats flash on every row
    ahead = [r for r in rows if r["triton_tflops"] > r["sdpa_cudnn_tflops"]]             # behind cuDNN but ...
    assert ahead and all(r["N"] == min(x["N"] for x in rows) and r["d"] == 64 for r in ahead)


def test_lesson08_gqa_and_training_figures_match_their_records():
    """The GQA backward ratios and the Llama training speedup: the notebook prints them from the records."""
    import json
    from conftest import ROOT
    from helpers.lesson08 import gpu_section
    from helpers.results import load_results
    res = load_results()
    rows = res["backward_gqa"]
    assert rows and all(r["pass"] for r in rows)
    ratios = [r["triton_tflops"] / r["sdpa_flash_gqa_tflops"] for r in rows]
    repeated = [r["triton_tflops"] / r["triton_repeated_kv_tflops"] for r in rows]
    assert min(ratios) > 1 and min(repeated) >= 1                      # faster than SDPA, at least as fast as repeated
    gqa = gpu_section.gqa_summary(res)
    assert f"{min(ratios):.2f}x to {max(ratios):.2f}x" in gqa and f"{min(repeated):.2f}x to {max(repeated):.2f}x" in gqa
    assert gpu_section.results_label(res, "backward_gqa") in gqa
    llama = json.loads((ROOT / "bench" / "results" / "train_llama.json").read_text())
    assert llama == gpu_section.load_llama()
    lsum = gpu_section.llama_summary(llama)
    assert f"(the course {llama['speedup_tokens_per_s']:.2f}x)" in lsum and f"within {llama['max_loss_diff']:.3f} nats/byte" in lsum
    assert llama["speedup_tokens_per_s"] > 1
    shown = _outputs("08_backward_pass", "gpu_section.gqa_summary(res)")
    assert gqa in shown and lsum in shown


def test_lesson08_says_the_packed_path_trained_faster_than_flexattention_only_if_it_did():
    from conftest import markdown
    from helpers.lesson08 import gpu_section
    rec = gpu_section.load_llama()
    runs = rec["runs"]
    text = markdown("08_backward_pass")
    claim = "ran faster than FlexAttention with a document block mask"
    assert (claim in text) == (runs["course"]["tokens_per_s"] > runs["flex"]["tokens_per_s"])
    assert runs["course"]["tokens_per_s"] > runs["sdpa"]["tokens_per_s"]
    summary = gpu_section.llama_summary(rec)
    assert "FlexAttention" in summary and f"{runs['flex']['tokens_per_s'] / 1e3:.0f}k" in summary
