"""Lesson 10 (serving): the checkers reject the bugs learners make, with the hint for each; correct
code written another way passes; the plain functions behind the notebook (padding's waste, the
allocator, the paged cache, the recorded figures) are right and say clearly what is wrong with bad input."""
import json

import pytest
import torch

from conftest import rejects
from helpers import check, reference
from helpers import lesson10 as L
from helpers.lesson10 import check as C


# ------------------------------------------------------------------ exercise 1: varlen_block_map
def _map_loop(cu_seqlens, BLOCK_M, **knobs):
    """A learner's loop with one planted mistake: the checker's own (sequence, block) loop with one knob
    turned (its correctness is test_the_reference_and_the_checkers_loop_agree's)."""
    return C._map_model(cu_seqlens, BLOCK_M, **knobs)


def map_floor(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, n_blocks=lambda n, bm: n // bm)


def map_empty_gets_a_block(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, n_blocks=lambda n, bm: max(1, -(-n // bm)))


def map_plus_one(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, n_blocks=lambda n, bm: (n + bm) // bm)


def map_local_rows(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, start=lambda b, m, cu, bm: m * bm)


def map_block_numbers(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, start=lambda b, m, cu, bm: cu[b] + m)


def map_sequence_order(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, order="sequence")


def map_smallest_first(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, order="smallest first")


def map_no_spares(cu, BLOCK_M):
    seq, start = _map_loop(cu, BLOCK_M)
    return seq[seq >= 0], start[seq >= 0]


def map_spares_zero(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, spare=0)


def map_small_P(cu, BLOCK_M):
    return _map_loop(cu, BLOCK_M, P=lambda t, B, bm: -(-t // bm))


def map_cumulative_as_lengths(cu, BLOCK_M):        # lengths read as cu_seqlens[b + 1]
    return _map_loop(cu, BLOCK_M, lengths=lambda c: c[1:])


def map_int64(cu, BLOCK_M):
    return tuple(t.long() for t in _map_loop(cu, BLOCK_M))


def map_cat_crashes_on_empty(cu, BLOCK_M):         # right until no sequence has a token
    seqs, ms = [], []
    for b in range(len(cu) - 1):
        n = int(cu[b + 1] - cu[b])
        if n:
            m = torch.arange(-(-n // BLOCK_M))
            seqs.append(torch.full_like(m, b))
            ms.append(m)
    seq, m = torch.cat(seqs), torch.cat(ms)
    order = torch.sort(-m, stable=True).indices
    B = len(cu) - 1
    P = (int(cu[-1]) + B * (BLOCK_M - 1)) // BLOCK_M
    out = torch.full((2, P), -1, dtype=torch.int32)
    out[0, :len(m)] = seq[order].int()
    out[1, :len(m)] = (cu.long()[seq] + m * BLOCK_M)[order].int()
    return out[0], out[1]


def map_other_way(cu_seqlens, BLOCK_M):           # correct: one pass per block index, largest first
    cu = cu_seqlens.tolist()
    B, total = len(cu) - 1, cu[-1]
    lengths = [cu[b + 1] - cu[b] for b in range(B)]
    most = max([-(-n // BLOCK_M) for n in lengths], default=0)
    seq_idx, q_start = [], []
    for m in reversed(range(most)):
        for b in range(B):
            if m * BLOCK_M < lengths[b]:
                seq_idx.append(b)
                q_start.append(cu[b] + m * BLOCK_M)
    P = (total + B * (BLOCK_M - 1)) // BLOCK_M
    pad = [-1] * (P - len(seq_idx))
    return torch.tensor(seq_idx + pad, dtype=torch.int64).to(torch.int32), torch.tensor(q_start + pad).to(torch.int32)


def map_lexsort(cu_seqlens, BLOCK_M):             # correct: vectorised, sort key -m * B + b
    cu = cu_seqlens.long()
    B = len(cu) - 1
    nb = (cu[1:] - cu[:-1] + BLOCK_M - 1) // BLOCK_M
    cu_blocks = torch.cat([torch.zeros(1, dtype=torch.long), nb.cumsum(0)])
    p = torch.arange(int(cu_blocks[-1]))
    seq = torch.searchsorted(cu_blocks, p, right=True) - 1
    m = p - cu_blocks[seq]
    order = torch.argsort(-m * (B + 1) + seq)
    P = (int(cu[-1]) + B * (BLOCK_M - 1)) // BLOCK_M
    out = torch.full((2, P), -1, dtype=torch.int32)
    out[0, :len(p)] = seq[order].int()
    out[1, :len(p)] = (cu[seq] + m * BLOCK_M)[order].int()
    return out[0], out[1]


@pytest.mark.parametrize("fn, words", [
    (map_floor, ["ragged last block", "cdiv"]),
    (map_empty_gets_a_block, ["empty sequence got a block"]),
    (map_plus_one, ["one block too many"]),
    (map_local_rows, ["in the packed tensor", "cu_seqlens[b] + m * BLOCK_M"]),
    (map_block_numbers, ["not a block number"]),
    (map_sequence_order, ["in sequence order", "largest first"]),
    (map_smallest_first, ["smallest block index first"]),
    (map_no_spares, ["no spare entries", "(-1, -1)"]),
    (map_spares_zero, ["must be (-1, -1)"]),
    (map_small_P, ["too small"]),
    (map_cumulative_as_lengths, ["prefix sums", "cu_seqlens[b + 1] - cu_seqlens[b]"]),
    (map_int64, ["int32"]),
    (map_cat_crashes_on_empty, ["empty sequences", "torch.cat of an empty list"]),
], ids=lambda x: getattr(x, "__name__", ""))
def test_varlen_block_map_bug_rejected(fn, words):
    rejects(check.varlen_block_map, fn, *words)


def map_sparse(cu, BLOCK_M):                       # right numbers, as a sparse tensor
    return tuple(t.to_sparse() for t in _map_loop(cu, BLOCK_M))


def map_meta(cu, BLOCK_M):                         # the right shape, no numbers
    return tuple(t.to("meta") for t in _map_loop(cu, BLOCK_M))


def map_shifts(cu, BLOCK_M):                       # cdiv by shifts: right for powers of two only
    shift = BLOCK_M.bit_length() - 1
    return _map_loop(cu, BLOCK_M, n_blocks=lambda n, bm: (n + bm - 1) >> shift)


@pytest.mark.parametrize("fn, words", [
    (map_sparse, ["is a sparse_coo tensor", ".to_dense()"]),
    (map_meta, ["on the meta device", "no values"]),
    (map_shifts, ["BLOCK_M = 3", "entries"]),
], ids=lambda x: getattr(x, "__name__", ""))
def test_varlen_block_map_odd_outputs_get_a_verdict(fn, words):
    rejects(check.varlen_block_map, fn, *words)


@pytest.mark.parametrize("fn", [map_other_way, map_lexsort, L.varlen_block_map_ref])
def test_varlen_block_map_correct_ways_pass(fn, strict, capsys):
    check.varlen_block_map(fn)
    assert "✅ varlen_block_map" in capsys.readouterr().out


def test_the_reference_and_the_checkers_loop_agree():
    for case in C._map_cases():
        got, want = L.varlen_block_map_ref(*case.args), C._map_model(*case.args)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), case.name


def test_the_exercise_is_the_kernels_own_map():
    """The course's varlen kernel launches exactly this map: the exercise's spec is the kernel's."""
    pytest.importorskip("triton")
    tv = pytest.importorskip("helpers.kernels.varlen")
    for case in C._map_cases():
        got, want = tv.varlen_block_map(*case.args), L.varlen_block_map_ref(*case.args)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), case.name


def test_every_map_bug_model_differs_from_the_answer_on_some_case():
    """Each hint can fire: its model gives another answer than the truth on at least one case."""
    for i, (hint, _) in enumerate(C._map_bugs()):
        assert any(not C._same_pair(list(C._bug_models(*c.args))[i][1](), C._map_model(*c.args))
                   for c in C._map_cases()), hint


# ------------------------------------------------------------------ exercise 2: gather_kv
def gather_no_table(k_pages, block_table, cache_seqlens, b):
    bs = k_pages.shape[1]
    t = torch.arange(int(cache_seqlens[b]))
    return k_pages[t // bs, t % bs]


def gather_swapped(k_pages, block_table, cache_seqlens, b):
    bs = k_pages.shape[1]
    t = torch.arange(int(cache_seqlens[b]))
    return k_pages[block_table[b, t % bs].long(), t // bs]


def gather_ceil(k_pages, block_table, cache_seqlens, b):
    bs = k_pages.shape[1]
    t = torch.arange(int(cache_seqlens[b]))
    return k_pages[block_table[b, (t + bs - 1) // bs].long(), t % bs]


def gather_shifted(k_pages, block_table, cache_seqlens, b):
    bs = k_pages.shape[1]
    t = torch.arange(1, int(cache_seqlens[b]) + 1)
    return k_pages[block_table[b, t // bs].long(), t % bs]


def gather_row0(k_pages, block_table, cache_seqlens, b):
    bs = k_pages.shape[1]
    t = torch.arange(int(cache_seqlens[b]))
    return k_pages[block_table[0, t // bs].long(), t % bs]


def gather_whole_row_of_table(k_pages, block_table, cache_seqlens, b):   # reads the padding entries
    _, bs, Hkv, d = k_pages.shape
    return k_pages[block_table[b].long()].reshape(-1, Hkv, d)[:int(cache_seqlens[b])]


def _gather_lookup(k_pages, block_table, cache_seqlens, b, pad="", bits=False):
    """The lookup, with one knob: pad ("clamp", "mod", "onehot") reads the whole row of block_table, its padding
    made a valid block, then drops the extra rows; bits: shifts and masks for // and %."""
    num_blocks, bs, Hkv, d = k_pages.shape
    n = int(cache_seqlens[b])
    t = torch.arange(n)
    if bits:
        shift = bs.bit_length() - 1
        return k_pages[block_table[b, t >> shift].long(), t & (bs - 1)]
    if pad == "onehot":                           # a lookup as a matmul over the whole pool
        slot = block_table[b, t // bs].long() * bs + t % bs
        onehot = torch.nn.functional.one_hot(slot, num_blocks * bs).to(k_pages.dtype)       # [n, num_blocks * bs]
        return (onehot @ k_pages.reshape(num_blocks * bs, Hkv * d)).reshape(n, Hkv, d)
    row = block_table[b].long()
    row = row.clamp(0, num_blocks - 1) if pad == "clamp" else row % num_blocks
    return k_pages[row].reshape(-1, Hkv, d)[:n]


def gather_clamp(k_pages, block_table, cache_seqlens, b):
    return _gather_lookup(k_pages, block_table, cache_seqlens, b, pad="clamp")


def gather_mod(k_pages, block_table, cache_seqlens, b):
    return _gather_lookup(k_pages, block_table, cache_seqlens, b, pad="mod")


def gather_onehot(k_pages, block_table, cache_seqlens, b):
    return _gather_lookup(k_pages, block_table, cache_seqlens, b, pad="onehot")


def gather_bits(k_pages, block_table, cache_seqlens, b):
    return _gather_lookup(k_pages, block_table, cache_seqlens, b, bits=True)


def gather_whole_last_block(k_pages, block_table, cache_seqlens, b):
    _, bs, Hkv, d = k_pages.shape
    n_blocks = -(-int(cache_seqlens[b]) // bs)
    return k_pages[block_table[b, :n_blocks].long()].reshape(-1, Hkv, d)


def gather_cat(k_pages, block_table, cache_seqlens, b):                 # right, but crashes on an empty sequence
    bs = k_pages.shape[1]
    n = int(cache_seqlens[b])
    parts = [k_pages[int(block_table[b, p]), :min(bs, n - p * bs)] for p in range(-(-n // bs))]
    return torch.cat(parts)


def gather_other_way(k_pages, block_table, cache_seqlens, b):          # correct: flat slot numbers
    num_blocks, bs, Hkv, d = k_pages.shape
    n = int(cache_seqlens[b])
    n_blocks = -(-n // bs)
    slots = (block_table[b, :n_blocks].long()[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:n]
    return k_pages.reshape(num_blocks * bs, Hkv, d)[slots]


def gather_loop(k_pages, block_table, cache_seqlens, b):               # correct: block by block, empty-safe
    _, bs, Hkv, d = k_pages.shape
    n = int(cache_seqlens[b])
    out = k_pages.new_empty(n, Hkv, d)
    for p in range(-(-n // bs)):
        rows = min(bs, n - p * bs)
        out[p * bs:p * bs + rows] = k_pages[int(block_table[b, p]), :rows]
    return out


@pytest.mark.parametrize("fn, words", [
    (gather_no_table, ["used directly", "block_table[b, t // block_size]"]),
    (gather_swapped, ["swapped"]),
    (gather_ceil, ["off by one at a block boundary"]),
    (gather_shifted, ["off by one token"]),
    (gather_row0, ["wrong row of block_table"]),
    (gather_whole_row_of_table, ["read the padding entries", "aten.index"]),
    (gather_clamp, ["read the padding entries of block_table[1] (entries 4..7", "aten.clamp", "clamp, % num_blocks"]),
    (gather_mod, ["read the padding entries", "aten.remainder"]),
    (gather_onehot, ["computed with the whole pool", "one-hot"]),
    (gather_bits, ["block_size 3", "only for a power of two"]),
    (gather_whole_last_block, ["whole last block"]),
    (gather_cat, ["empty sequence", "[0, Hkv, d]"]),
], ids=lambda x: getattr(x, "__name__", ""))
def test_gather_kv_bug_rejected(fn, words):
    rejects(check.gather_kv, fn, *words)


@pytest.mark.parametrize("fn", [gather_other_way, gather_loop, L.gather_kv_ref])
def test_gather_kv_correct_ways_pass(fn, strict, capsys):
    check.gather_kv(fn)
    assert "✅ gather_kv" in capsys.readouterr().out


def test_gather_cases_are_not_identity_tables():
    """An identity block table hides a lookup that skips it: every case's pool is shuffled."""
    for c in C._gather_cases():
        _, table, seqlens, b = c.args
        n_blocks = -(-int(seqlens[b]) // c.args[0].shape[1])
        if n_blocks > 1:
            assert not torch.equal(table[b, :n_blocks].long(), torch.arange(n_blocks)), c.name


# ------------------------------------------------------------------ padding's waste, counted exactly
@pytest.mark.parametrize("causal", [True, False])
def test_padding_waste_counts_every_visible_pair(causal):
    lengths, H, Hkv, d = [5, 0, 12, 3, 1], 4, 2, 8
    w = L.padding_waste(lengths, H=H, Hkv=Hkv, d=d, causal=causal, bytes_per_elem=2)
    mask = lambda n: reference.causal_mask(n, n) if causal else torch.ones(n, n, dtype=torch.bool)  # noqa: E731
    useful = sum(int(mask(n).sum()) for n in lengths)
    padded = len(lengths) * int(mask(max(lengths)).sum())
    assert (w["useful_pairs"], w["padded_pairs"]) == (useful, padded)
    assert w["useful_flops"] == 4 * d * H * useful and w["padded_flops"] == 4 * d * H * padded
    assert w["useful_bytes"] == sum(lengths) * (2 * H + 2 * Hkv) * d * 2
    assert w["padded_bytes"] == len(lengths) * 12 * (2 * H + 2 * Hkv) * d * 2
    assert w["flops_ratio"] == padded / useful


def test_padding_waste_of_equal_lengths_is_none():
    w = L.padding_waste([64] * 8)
    assert w["flops_ratio"] == 1.0 and w["bytes_ratio"] == 1.0 and w["wasted_flops_frac"] == 0.0


def test_padding_waste_rejects_bad_input():
    with pytest.raises(ValueError, match="lengths"):
        L.padding_waste([])
    with pytest.raises(ValueError, match=">= 0"):
        L.padding_waste([3, -1])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        L.padding_waste([3], H=6, Hkv=4)


def test_length_mixes_are_seeded_and_in_range():
    assert L.long_tailed_lengths(seed=3) == L.long_tailed_lengths(seed=3) != L.long_tailed_lengths(seed=4)
    assert all(1 <= n <= 8192 for n in L.long_tailed_lengths(B=500, sigma=2.0))
    assert all(512 <= n <= 8192 for n in L.uniform_lengths())
    mix = L.few_long_many_short(B=20, n_long=3)
    assert len(mix) == 20 and mix.count(8192) == 3


# ------------------------------------------------------------------ cu_seqlens
def test_cu_seqlens_from_lengths():
    cu = L.cu_seqlens_from_lengths([5, 0, 12])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 5, 17]
    assert L.cu_seqlens_from_lengths([]).tolist() == [0]


@pytest.mark.parametrize("cu, words", [
    (torch.tensor([0, 5, 9]), "int32"),
    (torch.tensor([5, 9], dtype=torch.int32), "leading 0"),
    (torch.tensor([0, 9, 5], dtype=torch.int32), "never decrease"),
    (torch.tensor([[0, 5]], dtype=torch.int32), "1-D"),
    ([0, 5], "torch.Tensor"),
])
def test_bad_cu_seqlens_get_a_clear_error(cu, words):
    with pytest.raises(ValueError, match=words):
        L.varlen_block_map_ref(cu, 16)


def test_cu_seqlens_total_must_match():
    with pytest.raises(ValueError, match="packed tokens"):
        L.check_cu_seqlens(L.cu_seqlens_from_lengths([3, 4]), total=8)


# ------------------------------------------------------------------ the allocator and the paged cache
def test_allocator_hands_out_each_block_once_and_takes_them_back():
    a = L.BlockAllocator(6, seed=1)
    x, y = a.allocate(4), a.allocate(2)
    assert sorted(x + y) == list(range(6)) and a.num_free == 0
    with pytest.raises(L.CacheFull, match="asked for 1 blocks, 0 of 6 are free"):
        a.allocate(1)
    a.free(x[:2])
    assert a.num_free == 2 and sorted(a.allocate(2)) == sorted(x[:2])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([y[0], y[0]])


def test_allocator_without_seed_is_in_order_and_with_seed_is_not():
    assert L.BlockAllocator(5).allocate(5) == [0, 1, 2, 3, 4]
    assert L.BlockAllocator(8, seed=0).allocate(8) != list(range(8))


def test_paged_cache_appends_grow_blocks_and_gather_returns_what_was_written():
    g = torch.Generator().manual_seed(0)
    cache = L.PagedKVCache(num_blocks=12, block_size=4, Hkv=2, d=3, max_seqs=3, max_blocks=5, seed=2)
    written = {0: [], 1: []}
    for b, n in [(0, 6), (1, 9), (0, 1), (1, 3), (0, 1)]:             # a prefill, then decode-sized steps
        k, v = torch.randn(n, 2, 3, generator=g), torch.randn(n, 2, 3, generator=g)
        cache.append(b, k, v)
        written[b].append((k, v))
    for b in (0, 1):
        k_all = torch.cat([k for k, _ in written[b]])
        v_all = torch.cat([v for _, v in written[b]])
        k, v = cache.gather(b)
        assert torch.equal(k, k_all) and torch.equal(v, v_all)
        assert int(cache.cache_seqlens[b]) == len(k_all) and len(cache.blocks[b]) == -(-len(k_all) // 4)
    assert cache.allocator.num_free == 12 - 2 - 3
    cache.free(1)
    assert cache.allocator.num_free == 12 - 2 and int(cache.cache_seqlens[1]) == 0
    with pytest.raises(L.CacheFull, match="block_table"):
        cache.append(2, torch.zeros(21, 2, 3), torch.zeros(21, 2, 3))
    with pytest.raises(ValueError, match="Hkv=2"):
        cache.append(2, torch.zeros(1, 4, 3), torch.zeros(1, 4, 3))


def test_kv_cache_bytes_gqa_saves_h_over_hkv():
    mha, gqa = L.kv_cache_bytes(8192, 32, 32, 128), L.kv_cache_bytes(8192, 32, 8, 128)
    assert mha == 2 * 32 * 32 * 128 * 2 * 8192 and mha == 4 * gqa


# ------------------------------------------------------------------ recorded figures
def test_serving_tables_say_not_measured_yet_without_rows():
    text = L.serving_tables({"gpu": "NVIDIA H200", "decode": []})
    assert text.count(L.NOT_MEASURED) == 3


def test_serving_tables_show_rows_and_ratios(tmp_path, capsys):
    res = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "date": "2026-12-01",
           "varlen": [{"dtype": "bfloat16", "d": 128, "causal": True, "H": 32, "Hkv": 8, "total_tokens": 65536,
                       "lengths": "long-tailed", "triton_tflops": 400.0, "dense_triton_tflops": 440.0,
                       "sdpa_padded_tflops": 100.0}],
           "paged": [{"dtype": "bfloat16", "B": 8, "H": 32, "Hkv": 8, "d": 128, "block_size": 16,
                      "mean_len": 8192, "triton_gbs": 3800.0, "contig_triton_gbs": 4000.0, "sdpa_cudnn_gbs": 3900.0}],
           "decode": [{"dtype": "float16", "B": 1, "H": 8, "Hkv": 8, "Nk": 4096, "d": 128, "triton_gbs": 3000.0,
                       "triton_graph_gbs": 3500.0, "sdpa_cudnn_gbs": 3000.0}]}
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(res))
    L.show_serving_results(path=path)
    out = capsys.readouterr().out
    assert out.count("NVIDIA H200 · torch 2.11 · triton 3.6 · 2026-12-01") == 3 and L.NOT_MEASURED not in out
    assert " 0.91 " in out and " 4.00" in out and " 0.95" in out and " 3500 " in out


def test_serving_tables_read_what_the_bench_scripts_write():
    """bench_varlen's rows name their mix and summarise long length lists; each section has its own _meta."""
    res = {"gpu": "G", "varlen_meta": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "date": "2026-12-02"},
           "varlen": [{"dtype": "bfloat16", "d": 128, "causal": True, "H": 32, "Hkv": 8, "total_tokens": 65536,
                       "mix": "long-tailed", "lengths": {"count": 64, "min": 3, "max": 8192, "mean": 1024.0},
                       "triton_tflops": 1.0}],
           "paged": [{"dtype": "bfloat16", "B": 8, "H": 32, "Hkv": 8, "d": 128, "block_size": 16, "mean_len": 100,
                      "triton_gbs": 1.0, "triton_graph_gbs": 2345.0}]}
    text = L.serving_tables(res)
    assert "long-tailed 64 seqs 3-8192" in text and "NVIDIA H200 · torch 2.11 · triton 3.6 · 2026-12-02" in text
    assert "2345" in text and text.count(L.NOT_MEASURED) == 1


def test_serving_results_read_the_older_graph_key_and_a_missing_file(tmp_path, capsys):
    text = L.serving_tables({"decode": [{"dtype": "float16", "B": 1, "H": 8, "Hkv": 8, "Nk": 4096, "d": 128,
                                         "triton_gbs": 1.0, "triton_gbs_graph": 4321.0}]})
    assert "4321" in text
    L.show_serving_results(path=tmp_path / "missing.json")
    assert "no recorded results" in capsys.readouterr().out


def test_the_notebooks_words_about_the_mixes_hold():
    """Section 1's prose: in every mix padding's FLOP waste exceeds its byte waste, the uniform mix is the
    kindest, and the long-tailed mixes multiply the work most (the table prints the figures)."""
    from conftest import ROOT
    import nbformat
    nb = nbformat.read(ROOT / "solutions" / "10_serving.ipynb", as_version=4)
    src = next(c.source for c in nb.cells if c.cell_type == "code" and "mixes = {" in c.source)
    assert "L.uniform_lengths(64, seed=0)" in src and "L.long_tailed_lengths(64, seed=0, median=512, sigma=1.0)" in src \
        and "L.few_long_many_short(64, n_long=4, long=8192, seed=0)" in src
    shape = dict(H=32, Hkv=8, d=128, causal=True, bytes_per_elem=2)
    mixes = [L.uniform_lengths(64, seed=0), L.long_tailed_lengths(64, seed=0, median=512, sigma=1.0),
             L.few_long_many_short(64, n_long=4, long=8192, seed=0)]
    ws = [L.padding_waste(m, **shape) for m in mixes]
    assert all(w["flops_ratio"] > w["bytes_ratio"] > 1 for w in ws)
    assert ws[0]["flops_ratio"] < min(ws[1]["flops_ratio"], ws[2]["flops_ratio"])
    assert min(mixes[0]) >= 512


def test_gather_kv_ref_rejects_bad_input():
    k_pages, table, seqlens = torch.zeros(4, 2, 1, 3), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="not in the batch"):
        L.gather_kv_ref(k_pages, table, seqlens, 2)
    with pytest.raises(ValueError, match="need 3 blocks"):
        L.gather_kv_ref(k_pages, table, seqlens, 1)
    with pytest.raises(ValueError, match="expected k_pages"):
        L.gather_kv_ref(k_pages[0], table, seqlens, 0)
