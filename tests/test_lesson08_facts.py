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
    assert "FlashAttention-2's deterministic=True gives each thread block its own fp32 dQ slice" in interview


# --------------------------------------------------------------------------- 08: why not store P, in numbers
def test_lesson08_p_round_trip_against_the_matmuls():
    from helpers import lesson08
    t = lesson08.p_traffic_time(d=128)                            # H200 datasheet: 989 TFLOP/s, 4.8 TB/s
    assert t["p_round_trip"] / t["matmul_fwd"] == pytest.approx(1.61, abs=0.01)
    assert t["p_round_trip"] < t["matmul_bwd"]                    # less than the backward's matmuls
    assert t["standard_fwd"] == 2 * t["p_round_trip"]             # Algorithm 0: S and P, each written and read
    m = lesson08.p_traffic_time(d=128, flops=715e12, bytes_per_s=4.23e12)
    assert m["p_round_trip"] / m["matmul_fwd"] == pytest.approx(1.32, abs=0.01)
    text = _flat(_markdown("08_backward_pass"))
    assert "far more time than the matmuls" not in text
    assert "about 1.6× the forward's matmul time" in text and "Algorithm 0" in text
    out = _outputs("08_backward_pass", "lesson08.p_traffic_time(d=128)")
    assert "datasheet: P written + read 1.6x" in out and "measured : P written + read 1.3x" in out


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
    assert f"{f:.0f} vs {s_:.0f} tokens/s" in summary
    label = f"{rec['device_name']}, torch {rec['torch']}, triton {rec['triton']}, {rec['date']}"
    assert label.startswith("NVIDIA H200, torch ") and label in summary
    assert summary in _outputs("08_backward_pass", "training_summary(rec)")   # the worked output is the record's
    text = _flat(_markdown("08_backward_pass"))
    assert f"triton 3.6.0, {rec['date']}; the summary line names them too" in text
    assert "which the H200 measured slower" not in text
    assert "faster in 7 of the 8 shapes" in text and "within 3% at d = 128" in text
    assert "which keeps the tensor cores busy with warp-specialised" not in text
    assert "is our inference, not a documented fact" in text


# --------------------------------------------------------------------------- 10: page size, fragmentation, bytes, lse
def test_lesson08_gqa_and_training_figures_match_their_records():
    """The GQA backward ratios and the Llama training speedup in lesson 08 and the README are the records' own."""
    import json
    from conftest import ROOT
    from helpers.results import load_results
    rows = load_results()["backward_gqa"]
    assert rows and all(r["pass"] for r in rows)
    ratios = [r["triton_tflops"] / r["sdpa_flash_gqa_tflops"] for r in rows]
    repeated = [r["triton_tflops"] / r["triton_repeated_kv_tflops"] for r in rows]
    gqa = f"{min(ratios):.2f}–{max(ratios):.2f}× SDPA's flash backward"
    rep = f"{min(repeated):.2f}–{max(repeated):.2f}× the course's own backward"
    llama = json.loads((ROOT / "bench" / "results" / "train_llama.json").read_text())
    speedup = f"({llama['speedup_tokens_per_s']:.2f}×)"
    text = _flat(_markdown("08_backward_pass"))
    readme = _flat((ROOT / "README.md").read_text())
    assert gqa in text and rep in text and speedup in text and f"within {llama['max_loss_diff']:.3f} nats/byte" in text
    assert gqa in readme and f"{llama['speedup_tokens_per_s']:.2f}× the tokens per second" in readme
