"""Facts lesson 10 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


def test_lesson10_states_fa2s_page_size_rule():
    text = _flat(_markdown("10_serving"))
    assert "multiple of 256" in text and "`mha_fwd_kvcache` in `csrc/flash_attn/flash_api.cpp`" in text
    assert "vLLM's default 16-token blocks therefore cannot go through upstream FA2's API" in text
    assert "FlashAttention-3 (`hopper/flash_api.cpp`) has no such rule" in text


def test_lesson10_paging_leaves_internal_fragmentation():
    from helpers import lesson10 as L
    w = L.block_waste([17, 16, 0, 1], 16)                          # blocks: 2 + 1 + 0 + 1
    assert w == dict(held=64, wasted=30, fraction=30 / 64, per_seq=7.5, table_entries=4)
    with pytest.raises(ValueError):
        L.block_waste([3], 0)
    lengths = L.long_tailed_lengths(64, seed=0, median=512, sigma=1.0)
    assert L.block_waste(lengths, 16)["fraction"] < 0.01 < 0.1 < L.block_waste(lengths, 256)["fraction"]
    text = _flat(_markdown("10_serving"))
    assert "- No fragmentation:" not in text and "No fragmentation," not in _interview("10_serving")
    assert "No **external** fragmentation" in text and "Internal fragmentation remains" in text
    assert "blocks of  16, long-tailed (lognormal)" in _outputs("10_serving", "L.block_waste(lengths, block_size)")


def test_lesson10_byte_count_is_a_lower_bound():
    text = _flat(_markdown("10_serving"))
    assert "**lower bound** on what a FlashAttention forward moves" in text and "Theorem 2" in text


def test_empty_rows_lse_says_whose_convention():
    text10 = _flat(_markdown("10_serving"))
    assert "by this course's convention, lse = −inf" in text10 and "FlashAttention-2 writes lse = +∞" in text10
    text06 = _flat(_markdown("06_flash_decoding"))
    assert "does exactly `combine_splits`" not in text06
    assert "FlashAttention-2's combine writes `lse = +inf`" in text06


def test_lesson10_padding_and_the_tables_labels():
    from helpers import lesson10 as L
    interview = _interview("10_serving")
    assert "Serving never pads" not in interview
    assert "CUDA graph" in interview and "`remove_input_padding` off" in interview
    text = L.serving_tables(L.load_results())
    titles = [line for line in text.splitlines() if line and not line.startswith(" ") and "GB/s" in line or "TFLOP/s" in line]
    assert len(titles) == 3 and all("median" in t for t in titles)
    assert "eq_sdpa" in text and "equal-length, non-paged batch" in text
    paged_header = next(line for line in text.splitlines() if "block" in line and "mean_len" in line)
    assert "cudnn" not in paged_header
    assert "**equal-length, non-paged** batch" in _flat(_markdown("10_serving"))
    assert "eq_sdpa" in _outputs("10_serving", "L.show_serving_results()")


# --------------------------------------------------------------------------- Going deeper: the serving figures
def test_serving_summary_reads_each_section_and_labels_it():
    from helpers import lesson10 as L
    from helpers.results import results_label
    res = L.load_results()
    text = L.serving_summary(res)
    for section in ("varlen", "paged", "decode"):
        label = f"{len(res[section])} rows · {results_label(res, section)} · {res[f'{section}_meta']['timing']}"
        assert label in text, section
        assert "median" in res[f"{section}_meta"]["timing"]
    pg = [r for r in res["paged"] if r["block_size"] == 16]
    ratios = [r["triton_gbs"] / r["contig_triton_gbs"] for r in pg]
    assert f"16: {min(ratios):.2f}x to {max(ratios):.2f}x" in text
    assert text in _outputs("10_serving", "L.serving_summary(L.load_results())")   # the saved output is the record's
    assert L.serving_summary({}).count(L.NOT_MEASURED) == 3


def test_what_lesson10_says_of_the_serving_figures_follows_from_the_record():
    """Going deeper's words: packing against padding by mix; against the dense kernel; the block size; decode."""
    from helpers import lesson10 as L
    res = L.load_results()
    pad = {}
    for r in res["varlen"]:
        pad.setdefault(r["mix"], []).append(r["triton_tflops"] / r["sdpa_padded_tflops"])
    assert min(pad["long-tailed"]) > 3 * max(pad["uniform"])              # several times faster
    assert min(pad["uniform"]) > 1 > max(pad["equal"])                    # faster by less; cuDNN ahead on equal
    dense = {}
    for r in res["varlen"]:
        dense.setdefault(r["mix"], []).append(r["triton_tflops"] / r["dense_triton_tflops"])
    assert min(dense["long-tailed"]) > 1
    assert all(0.85 < x < 1.05 for m in ("uniform", "equal") for x in dense[m])      # close
    groups = {}
    for r in res["paged"]:
        groups.setdefault((r["dtype"], r["B"], r["mean_len"]), {})[r["block_size"]] = r["triton_gbs"] / r["contig_triton_gbs"]
    for g in groups.values():
        assert min(g, key=g.get) == 16
        assert all(x > 0.985 for b, x in g.items() if b >= 128)               # almost nothing from 128 on
    big = [r for r in res["decode"] if r["cache_mib"] >= 256]
    assert big and all(0.97 < r["triton_gbs"] / r["sdpa_cudnn_gbs"] < 1.03 for r in big)
    smallest = min(res["decode"], key=lambda r: r["cache_mib"])
    assert smallest["triton_gbs"] / smallest["triton_graph_gbs"] < 0.5       # launch-bound under do_bench
