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
