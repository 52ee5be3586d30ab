"""Facts lesson 06 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


# --------------------------------------------------------------------------- items 4 and 6: decode intensity
@pytest.mark.parametrize("H, Hkv", [(8, 8), (32, 8), (8, 1)])
def test_decode_flops_per_byte_is_G_in_bf16(H, Hkv):
    """06: G FLOP/byte when each KV head is read once for its group; 07: 1 FLOP/byte per query head.

    The FLOPs are counted by torch.utils.flop_counter on the group-packed decode, the bytes are
    K and V in bf16, read once.
    """
    from torch.utils.flop_counter import FlopCounterMode
    from helpers import lesson06 as L

    G, d, Nk = H // Hkv, 64, 96
    q = torch.randn(Hkv, G, d, dtype=torch.bfloat16)          # [Hkv, G, d]: the group's rows together
    k = torch.randn(Hkv, Nk, d, dtype=torch.bfloat16)
    v = torch.randn(Hkv, Nk, d, dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as fc:
        p = torch.softmax((q @ k.transpose(1, 2)).float(), -1).to(torch.bfloat16)   # [Hkv, G, Nk]
        p @ v                                                                          # [Hkv, G, d]
    nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    measured = fc.get_total_flops() / nbytes
    assert measured == pytest.approx(G)
    assert L.decode_flops_per_byte(G) == pytest.approx(measured)
    assert L.decode_flops_per_byte(G) / G == 1.0                 # per query head: 1 FLOP per byte
    assert L.decode_flops_per_byte(G, bytes_per_elem=4) == G / 2  # fp32 cache: half as many per byte


def test_decode_flops_per_byte_rejects_bad_input():
    from helpers import lesson06 as L
    with pytest.raises(ValueError, match="G >= 1"):
        L.decode_flops_per_byte(0)


# --------------------------------------------------------------------------- item 5: the split heuristics
def test_library_heuristic_on_the_examples_of_its_own_source_comments():
    """flash_api.cpp's comment: 48 blocks on 108 SMs -> 2 splits (efficiency 0.89 beats 3 splits' 0.67);
    with 64 key blocks, 12 splits give the same blocks per split as 11 and are not eligible."""
    from helpers.lesson06 import num_splits_heuristic
    assert num_splits_heuristic(48, 108, 64, 128) == 2
    assert num_splits_heuristic(212, 264, 64, 128) == 1           # >= 80% of the 264 slots: no split
    assert num_splits_heuristic(211, 264, 64, 128) > 1
    # Eligibility, with at most 12 splits of 64 key blocks: ceil(64/12) == ceil(64/11) == 6 and
    # ceil(64/9) == ceil(64/8) == 8, so 9 and 12 are skipped. 11 blocks on 132 slots: 12 splits
    # would fill them exactly (1.0) and make the threshold 0.85, so 11 (0.917) would win; without
    # 12 the best is 11's 0.917, the threshold 0.779, and 10 splits (0.833) win.
    assert num_splits_heuristic(11, 132, 64, 12) == 10
    with pytest.raises(ValueError):
        num_splits_heuristic(0, 132, 64, 128)


def test_course_rule_and_library_rule_on_the_lessons_examples():
    """06's examples (d = 128, Nk = 8192, H200's 132 SMs): the course's rule and FA2's differ.

    By hand for B = 1, H = 32 (MHA): FA2 compares 32·s blocks with 2 × 132 = 264 slots; the best
    eligible efficiency is s = 8 (256/264 = 0.97), 85% of it is 0.82, and s = 7 gives 224/264 = 0.85:
    7 splits. The course compares with 132 and picks 4 (128/132). B = 4: 128 < 0.8·264 = 211, so
    FA2 splits (2: 256/264), while the course's 128 >= 0.8·132 does not.
    """
    from helpers import lesson06 as L
    cases = {(1, 32): (4, 7), (4, 32): (1, 2), (8, 32): (1, 1)}
    for (B, H), (course, library) in cases.items():
        assert L.suggest_splits(B, H, 8192) == course, (B, H)
        assert L.fa2_num_splits(B, H, H, 8192, d=128) == library, (B, H)


def test_fa2_counts_kv_heads_in_gqa_decode():
    """seqlenq_ngroups_swapped: H = 32 on Hkv = 8 is 8 heads of 4 query rows (one 64-row block)."""
    from helpers import lesson06 as L
    assert L.fa2_num_splits(1, 32, 8, 8192, d=128) == L.num_splits_heuristic(8, 264, 64, 128) == 32
    assert L.fa2_num_splits(1, 32, 32, 8192, d=128) == L.num_splits_heuristic(32, 264, 64, 128)
    assert L.fa2_num_splits(1, 32, 32, 8192, d=128, dropout_p=0.1) == 1   # no split kernel with dropout
    assert L.fa2_num_splits(1, 32, 32, 8192, d=64) == L.num_splits_heuristic(32, 264, 32, 128)  # 256-key tiles
    with pytest.raises(ValueError, match="H % Hkv"):
        L.fa2_num_splits(1, 32, 5, 8192, d=128)


# The library's keyword order, read in flash_attn/flash_attn_interface.py (a recent one, with softcap and cache_leftpad).
LIBRARY_SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                        "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                               "deterministic", "return_attn_probs", "block_table"],
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"],
}
# The packed forms, from the same file (tests/test_interface.py holds helpers/kernels/interface.py to all six and
# flash_attn_with_kvcache, defaults included).
LIBRARY_PACKED_SIGNATURES = {
    "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                 "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                  "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                        "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", "dropout_p", "softmax_scale", "causal",
                                         "window_size", "softcap", "alibi_slopes", "deterministic",
                                         "return_attn_probs"],
}


@pytest.mark.parametrize("fn", sorted(LIBRARY_SIGNATURES))
def test_lesson06_table_gives_the_librarys_argument_order(fn):
    import ast
    import re
    text = _markdown("06_flash_decoding")
    m = re.search(rf"`({fn}\([^`]*\))`", text)
    assert m, f"06's table no longer shows {fn}(...)"
    call = ast.parse(m.group(1), mode="eval").body
    names = [a.id for a in call.args] + [kw.arg for kw in call.keywords]
    assert names == LIBRARY_SIGNATURES[fn]


# --------------------------------------------------------------------------- Going deeper: the measured split sweep
def test_split_sweep_table_shows_the_records_rows_and_label():
    from helpers import lesson06 as L
    from helpers.results import load_results, results_label
    res = load_results()
    table = L.split_sweep_table(res).splitlines()
    assert results_label(res, "paged") in table[0] and "median" in table[0]
    body = table[2:]
    assert len(body) == len(res["paged"]) == len(L.split_sweep_rows(res))
    for line, r in zip(body, L.split_sweep_rows(res)):
        cells = line.split()
        assert cells[:6] == [r["dtype"], str(r["B"]), str(r["H"]), str(r["Hkv"]), str(r["block_size"]),
                             str(r["mean_len"])]
        assert f"{r['gbs'][r['default']]:.0f}*" in cells                     # the default's own run, starred
    assert L.split_sweep_table({}).endswith("(not measured yet)")


def test_split_sweep_rows_merge_the_default_run_with_the_sweep():
    from helpers import lesson06 as L
    row = {"dtype": "bfloat16", "B": 8, "H": 32, "Hkv": 8, "d": 128, "block_size": 16, "mean_len": 100,
           "num_splits": 2, "triton_gbs": 30.0, "splits_sweep_gbs": {"1": 20.0, "4": 40.0}}
    [r] = L.split_sweep_rows({"paged": [row]})
    assert r["gbs"] == {1: 20.0, 2: 30.0, 4: 40.0} and r["default"] == 2
    assert "fastest at 4 splits, 2.00x the GB/s of 1" in L.split_sweep_summary({"paged": [row]})


def test_what_the_lesson_says_of_the_split_sweep_follows_from_the_record():
    """06's Going deeper: one split the slowest on every row; four the fastest at B = 8, eight no better; at
    B = 16 the default (one split) slower than two and four on every row; block size moves the rate less."""
    from helpers import lesson06 as L
    from helpers.results import load_results
    rows = L.split_sweep_rows(load_results())
    assert rows
    for r in rows:
        assert min(r["gbs"], key=r["gbs"].get) == 1
        assert r["gbs"][4] == max(r["gbs"].values()) or r["gbs"][8] <= 1.01 * r["gbs"][4]
    b8 = [r for r in rows if r["B"] == 8]
    assert b8 and all(r["B"] * r["Hkv"] < L.H200_SMS for r in b8)             # one split leaves SMs idle
    assert all(abs(r["gbs"][8] / r["gbs"][4] - 1) < 0.02 for r in b8)
    b16 = [r for r in rows if r["B"] == 16]
    assert b16 and all(r["default"] == 1 and r["gbs"][1] < r["gbs"][2] < r["gbs"][4] for r in b16)
    groups = {(r["B"], r["dtype"], r["mean_len"]) for r in rows}
    for key in groups:                                     # same batch and cache, block sizes 16 to 256
        sel = [r for r in rows if (r["B"], r["dtype"], r["mean_len"]) == key]
        if len(sel) < 2:
            continue
        by_block = [r["gbs"][4] for r in sel]
        by_splits = [max(r["gbs"].values()) / min(r["gbs"].values()) for r in sel]
        assert max(by_block) / min(by_block) < min(by_splits), key
