"""Facts lesson 09 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


# --------------------------------------------------------------------------- 09: all-gather, Llama 3 §3.3.2
def test_lesson09_gives_llama3s_reasons_for_all_gather():
    text = _flat(_markdown("09_ring_attention"))
    assert "§3.3.2" in text and "exposed on the critical path" in text
    assert "document masks" in text and "much smaller than Q" in text
    assert "overlaps well" not in text


# --------------------------------------------------------------------------- 09: the sizes that were measured
def test_lesson09_names_only_the_measured_lengths():
    res = __import__("helpers.lesson09", fromlist=["x"]).load_gpu_results()
    assert res["meta"]["skipped_for_time"] == [524288]
    assert max(r["N"] for r in res["ring"]) == 262144
    text = _flat(_markdown("09_ring_attention"))
    assert "64k to 256k" in text and "skipped_for_time" in text
    assert "64k to 512k" not in text


# --------------------------------------------------------------------------- 09: the table says which rows are causal
def test_lesson09_gpu_table_labels_causal_rows():
    from helpers import lesson09 as L
    res = L.load_gpu_results()
    table = L.gpu_results_table(res).splitlines()
    assert table[1].split()[:3] == ["layout", "causal", "overlap"]
    rows = [line.split() for line in table[2:]]
    assert len(rows) == len(res["ring"])
    for row, rec in zip(rows, res["ring"]):
        assert row[0] == rec["layout"] and row[1] == str(rec["causal"])
        assert rec["causal"] == (rec["layout"] == "zigzag")          # what the notebook says of the rows
    assert "contiguous rows are **not causal**" in _flat(_markdown("09_ring_attention"))
    out = _outputs("09_ring_attention", "gpu_results_table").splitlines()
    assert any(line.split()[:3] == ["layout", "causal", "overlap"] for line in out)      # the saved output too


# --------------------------------------------------------------------------- 09: when overlap pays
def test_lesson09_overlap_condition_and_the_measured_numbers():
    from helpers import lesson09 as L
    F_over_B = 0.6 * L.H200_BF16_FLOPS / L.NVLINK_BYTES_PER_S            # tokens: Ring Attention §3, c >= F/B
    assert 1250 < F_over_B < 1350
    res = L.load_gpu_results()
    for r in res["ring"]:
        chunk = r["N"] // r["world"] // (2 if r["layout"] == "zigzag" else 1)
        assert chunk >= 16384 > 10 * F_over_B                            # the measured chunks are far past it
        if r["step_ms"]:
            assert r["transfer_ms"] < min(r["step_ms"]) / 5             # "a small fraction of a step's compute"
    text = _flat(_markdown("09_ring_attention"))
    assert "`c ≥ F / B`" in text and "overlap changes little" in text
    assert "Why overlap pays" not in text
    assert "F / B = 1,319 tokens" in _outputs("09_ring_attention", "L.step_times(N, P=2)")


def test_lesson09_overlap_summary_reads_the_record():
    from helpers import lesson09 as L
    res = L.load_gpu_results()
    summary = L.overlap_summary(res)
    assert summary.splitlines()[-1] == L.ring_label(res)
    meta = res["meta"]
    assert all(str(meta[k]) in L.ring_label(res) for k in ("gpu", "torch", "triton", "date", "timing"))
    by = {(r["layout"], r["N"], r["overlap"]): r["ms"] for r in res["ring"]}
    ratios = [by[(lay, N, True)] / by[(lay, N, False)] for (lay, N, o) in by if o]
    assert f"{min(ratios):.3f}x to {max(ratios):.3f}x over {len(ratios)} (layout, N) pairs" in summary
    transfer = [r["transfer_ms"] for r in res["ring"]]
    assert f"{min(transfer):.1f} to {max(transfer):.1f} ms" in summary
    assert summary in _outputs("09_ring_attention", "L.overlap_summary(res)")      # the saved output is the record's
    assert L.overlap_summary(None).endswith("(not measured yet)")


def test_lesson09_what_going_deeper_says_follows_from_the_record():
    """Faster than one GPU on every row, closer to 2x as N grows; overlap within a few percent either way, and
    without overlap the faster one in two pairs."""
    from helpers import lesson09 as L
    rows = L.load_gpu_results()["ring"]
    assert all(1 < r["speedup"] < 2 for r in rows)
    for key in {(r["layout"], r["overlap"]) for r in rows}:
        s = [r["speedup"] for r in sorted(rows, key=lambda r: r["N"]) if (r["layout"], r["overlap"]) == key]
        assert s == sorted(s), key
    by = {(r["layout"], r["N"], r["overlap"]): r["ms"] for r in rows}
    ratios = {(lay, N): by[(lay, N, True)] / by[(lay, N, False)] for (lay, N, o) in by if o}
    assert all(abs(x - 1) < 0.05 for x in ratios.values())
    assert sum(x > 1 for x in ratios.values()) == 2


# --------------------------------------------------------------------------- 09: the causal imbalance is 2P - 1
@pytest.mark.parametrize("P", [2, 4, 8])
def test_lesson09_contiguous_causal_imbalance_is_2P_minus_1(P):
    from helpers import lesson09 as L
    totals = [sum(row) for row in L.ring_schedule(P, "contiguous")]
    assert max(totals) / min(totals) == 2 * P - 1
    text = _flat(_markdown("09_ring_attention"))
    assert "**`2P - 1` times**" in text and "1.45×" in text and "256k" in text
    assert "`P` times the work of the first" not in text


# --------------------------------------------------------------------------- 09: activations already hold K/V
def test_lesson09_memory_counts_kv_once():
    import matplotlib
    matplotlib.use("Agg")
    from helpers import lesson09 as L
    N = 131072
    assert L.activation_bytes(N) / L.H200_HBM_BYTES == pytest.approx(4.14, abs=0.01)      # 4.1 H200s, not four
    assert L.kv_bytes(1048576) < L.H200_HBM_BYTES                                           # 137 GB < 141 GB
    ax = L.plot_memory(Ns=(N,), Ps=(1, 2))
    ys = sorted(line.get_ydata()[0] for line in ax.lines if len(line.get_ydata()) == 1)
    assert ys == pytest.approx([L.activation_bytes(N) / 2e9, L.activation_bytes(N) / 1e9])  # no K/V added on top
    text = _flat(_markdown("09_ring_attention"))
    assert "4.1 H200s" in text and "97% of one H200" in text and "a **part** of the activations" in text
    assert "four H200s" not in text and "not its K and V" not in text
    out = _outputs("09_ring_attention", "L.activation_bytes(N)")
    assert "  601.3" not in out and "584.1" in out                                         # per GPU = activations / P
