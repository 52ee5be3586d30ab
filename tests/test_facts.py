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


# --------------------------------------------------------------------------- item 3: the timing statistic
def test_triton_do_bench_default_is_the_mean():
    """Why the statistic must be named: Triton's own default is the mean, not the median."""
    triton_testing = pytest.importorskip("triton.testing")
    default = inspect.signature(triton_testing.do_bench).parameters["return_mode"].default
    assert default == "mean"


def test_lesson07_timing_asks_do_bench_for_the_median(monkeypatch):
    triton_testing = pytest.importorskip("triton.testing")
    from helpers import lesson07

    calls = []

    def fake_do_bench(fn, *args, **kwargs):
        calls.append(kwargs)
        return 1.25

    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    assert lesson07._do_bench(lambda: None) == 1.25
    assert calls and calls[0].get("return_mode") == "median"
    assert "quantiles" not in calls[0]          # quantiles would override return_mode


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


# --------------------------------------------------------------------------- item 1: lse sentinels
def test_why_fa2_writes_plus_inf_for_an_empty_row():
    """The backward recomputes P = exp(S - lse); on an empty row S = -inf everywhere."""
    S = torch.full((3,), -float("inf"))
    assert torch.exp(S - float("inf")).eq(0).all()              # FA2's +inf: P = 0, no NaN
    assert torch.exp(S - (-float("inf"))).isnan().all()         # -inf there would give NaN


def test_a_merge_must_map_the_plus_inf_sentinel_first():
    from helpers import lesson05
    from helpers.reference import attention

    q, k, v = torch.randn(1, 4), torch.randn(6, 4), torch.randn(6, 4)
    o_ref, lse_ref = attention(q, k, v)                          # all 6 keys
    o1, lse1 = attention(q, k[:6], v[:6])                        # part 1: every key
    o2 = torch.zeros(1, 4, dtype=torch.float64)                  # part 2: no key (a padded split)
    fa2_lse2, course_lse2 = torch.tensor([float("inf")]), torch.tensor([-float("inf")])

    def merge(lses, outs):                                       # the course's safe LSE merge
        lses = torch.stack([l.double() for l in lses])           # [S, 1]
        m = lses.amax(0)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        w = torch.exp(lses - m)
        return (w[..., None] * torch.stack(outs)).sum(0) / w.sum(0)[..., None]

    assert merge([lse1, course_lse2], [o1, o2]).sub(o_ref).abs().max() < 1e-12
    assert merge([lse1, fa2_lse2], [o1, o2]).isnan().all()        # +inf as it comes from FA2: NaN
    mapped = lesson05.lse_empty_to_neg_inf(fa2_lse2)
    assert torch.isneginf(mapped).all() and torch.isposinf(fa2_lse2).all()   # a new tensor
    assert merge([lse1, mapped], [o1, o2]).sub(o_ref).abs().max() < 1e-12
    finite = torch.tensor([0.5, -3.0])
    assert torch.equal(lesson05.lse_empty_to_neg_inf(finite), finite)
    with pytest.raises(TypeError):
        lesson05.lse_empty_to_neg_inf(torch.tensor([1, 2]))


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


# --------------------------------------------------------------------------- the notebooks' text
def _markdown(name: str) -> str:
    import nbformat
    from pathlib import Path
    nb = nbformat.read(Path(__file__).resolve().parent.parent / "solutions" / f"{name}.ipynb", as_version=4)
    return "\n".join(c.source for c in nb.cells)


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


@pytest.mark.parametrize("name, wrong, right", [
    ("05_fully_masked_rows", "The FlashAttention convention",           # FA2 writes lse = +inf there
     "FA2's +∞ is for its backward pass"),
    ("05_fully_masked_rows", "it rounds to −∞",                         # masked_fill raises in float16
     "on a float16 tensor raises an overflow"),
    ("06_flash_decoding", "splits fall on page boundaries",             # FA2 splits on kBlockN tiles
     "FlashAttention-2 splits on key tiles of `kBlockN` = 64–256 keys"),
    ("06_flash_decoding", "The library calls this\npacking GQA",        # PackGQA is FA3's; FA2 swaps groups
     "FlashAttention-3 calls its version *PackGQA*"),
    ("06_flash_decoding", "a heuristic picks (like `L.suggest_splits`)",
     "the library's heuristic picks (`L.fa2_num_splits`, not the course's `L.suggest_splits`)"),
    ("07_triton_gpu", "`do_bench` reports a median",                    # its default is the mean
     "`do_bench` returns the *mean*"),
    ("07_triton_gpu", "~2 FLOPs per query head",                        # 1 FLOP per byte per query head
     "used for 1 FLOP per query head that shares it"),
    ("02_flash_attention_v1", "> The FLOPs are the same as standard attention",   # forward only
     "> The forward does the same matmul FLOPs as standard attention"),
])
def test_retracted_statements_stay_out(name, wrong, right):
    text = _markdown(name)
    assert wrong not in text
    assert right in text, f"{name} no longer says what replaced the retracted statement: {right!r}"


# =========================================================================== issue 23: lessons 06–10
def _cells(name: str, kind: str | None = None):
    import nbformat
    from pathlib import Path
    nb = nbformat.read(Path(__file__).resolve().parent.parent / "solutions" / f"{name}.ipynb", as_version=4)
    return [c for c in nb.cells if kind is None or c.cell_type == kind]


def _flat(text: str) -> str:
    """Markdown with its line breaks (and blockquote marks) folded into single spaces."""
    import re
    return re.sub(r"\s+", " ", text.replace("\n>", "\n"))


def _interview(name: str) -> str:
    cells = [c.source for c in _cells(name, "markdown") if "Say it in the interview" in c.source]
    assert len(cells) == 1, f"{name}: one interview section expected"
    return _flat(cells[0])


def _outputs(name: str, needle: str) -> str:
    """The text output of the one code cell whose source contains ``needle``."""
    cells = [c for c in _cells(name, "code") if needle in c.source]
    assert len(cells) == 1, (name, needle, len(cells))
    return "".join(o.get("text", "") for o in cells[0].get("outputs", []))


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
            assert r["transfer_ms"] < min(r["step_ms"]) / 5
    by = {(r["N"], r["layout"], r["overlap"]): r["ms"] for r in res["ring"]}
    assert by[(65536, "contiguous", False)] == 67.257 and by[(65536, "contiguous", True)] == 68.968
    text = _flat(_markdown("09_ring_attention"))
    assert "`c ≥ F / B`" in text and "67.26 against 68.97 ms" in text and "overlap changes little" in text
    assert "Why overlap pays" not in text
    assert "F / B = 1,319 tokens" in _outputs("09_ring_attention", "L.step_times(N, P=2)")


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


def test_lesson07_teaching_decode_figure_has_its_label():
    text = _flat(_markdown("07_triton_gpu"))
    assert ("0.99–1.06 TB/s effective (bytes counted once) at B = 8, H = 32, Hkv = 8, fp16, Nk 4k–64k, 0.24–0.37× "
            "cuDNN (one NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29") in text


# --------------------------------------------------------------------------- the interview answers (section 2 of the issue)
@pytest.mark.parametrize("name, must", [
    ("08_backward_pass", ["fp32 buffer", "preprocess that computes D also zeroes", "scales it and casts it",
                          "FlashAttention-3 makes the KV blocks take turns with a semaphore",
                          "the query heads of a group add into the same dK and dV",
                          "saves the random generator's seed and offset"]),
    ("09_ring_attention", ["c ≥ F/B", "dK and dV travel with it", "striped attention",
                           "Llama 3 used although its latency is exposed", "pass-KV", "pass-Q"]),
    ("10_serving", ["continuous batching", "reference count per block", "copy-on-write", "default of 16 tokens",
                    "lengthen the block table", "multiple of 256 tokens", "FlashAttention-3 takes any page size",
                    "longest causal blocks are launched first"]),
    ("12_masks_and_score_mods", ["kv_num_blocks", "full_kv_indices", "never read from HBM", "O(N · w)",
                                 "cap · tanh(scale · qk / cap)", "1 − tanh²", "memory and compute"]),
])
def test_interview_answers_carry_what_a_strong_answer_has(name, must):
    interview = _interview(name)
    for fact in must:
        assert fact in interview, (name, fact)


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


def test_lesson12_mask_figures_match_their_record():
    """Lesson 12's and the README's sentences on the recorded mask figures carry bench/results/masks_h200.json's
    ratios (recomputed here from its rows, not copied from its summary)."""
    import json
    import math
    from conftest import ROOT
    rec = json.loads((ROOT / "bench" / "results" / "masks_h200.json").read_text())
    rows = [r for r in rec["rows"] if "scaling" not in r["mask"]]
    assert len(rows) == 24 and all(r["pass"] for r in rows)
    ratio = lambda r, key: r[f"flex{key}"] / r[f"course{key}"]  # noqa: E731
    span = lambda xs: f"{min(xs):.2f}–{max(xs):.2f}×"  # noqa: E731
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    groups = {"windows": "window (", "documents": "documents", "softcap": "softcap", "ALiBi": "ALiBi"}
    fwd = {g: [ratio(r, "_ms") for r in rows if key in r["mask"]] for g, key in groups.items()}
    bwd = {g: [ratio(r, "_bwd_ms") for r in rows if key in r["mask"]] for g, key in groups.items()}
    assert all(len(v) == 8 if g in ("windows", "documents") else len(v) == 4 for g, v in fwd.items())
    sdpa = {r["d"]: r["sdpa_dense_ms"] / r["course_ms"] for r in rows if r["mask"] == "window (1024, 0)" and r["N"] == 32768}
    scale = {r["d"]: r for r in rec["rows"] if "scaling" in r["mask"]}
    grow = {d: next(r["course_ms"] for r in rec["rows"] if "scaling" in r["mask"] and r["d"] == d and r["N"] == 65536)
            / next(r["course_ms"] for r in rec["rows"] if "scaling" in r["mask"] and r["d"] == d and r["N"] == 8192)
            for d in scale}
    bs = [r["flex_ms"] / r["block_sparse_ms"] for r in rows if r.get("block_sparse_ms")]
    text = _flat(_markdown("12_masks_and_score_mods"))
    fwd_all = [x for v in fwd.values() for x in v]
    bwd_all = [x for v in bwd.values() for x in v]
    expected = [
        f"{sdpa[128]:.0f}× (d = 128) to {sdpa[64]:.0f}× (d = 64) faster",
        f"({grow[128]:.1f}× and {grow[64]:.1f}× from N = 8192 to 65536)",
        f"runs the forward {geo(fwd_all):.2f}× faster in geometric mean over 24 rows",
        f"(windows {span(fwd['windows'])}, documents {span(fwd['documents'])}, softcap {span(fwd['softcap'])}, "
        f"ALiBi {span(fwd['ALiBi'])})",
        f"runs at {geo(bwd_all):.2f}× FlexAttention's speed in geometric mean",
        f"softcap and ALiBi ({span(bwd['windows'] + bwd['softcap'] + bwd['ALiBi'])})",
        f"slower on packed documents ({span(bwd['documents'])})",
        f"runs the forward at {span(bs)} FlexAttention's speed",
    ]
    for sentence in expected:
        assert sentence in text, f"lesson 12 should say: {sentence}"
    # the interview: "faster than FlexAttention on every window, softcap and ALiBi row we timed"
    assert "on every window, softcap and ALiBi row we timed" in _interview("12_masks_and_score_mods")
    assert min(fwd["windows"] + fwd["softcap"] + fwd["ALiBi"]) > 1
    readme = _flat((ROOT / "README.md").read_text())
    for sentence in (f"{geo(fwd_all):.2f}× in geometric mean over the 24 rows", f"{geo(bwd_all):.2f}× in geometric mean",
                     f"ran {sdpa[128]:.0f}× (d = 128) and {sdpa[64]:.0f}× (d = 64) faster than SDPA",
                     f"grew {grow[128]:.1f}× and {grow[64]:.1f}× from N = 8192 to 65536"):
        assert sentence in readme, f"the README should say: {sentence}"



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
