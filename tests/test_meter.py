"""The meter measures what it claims: FLOPs (matmul and elementwise), the largest tile, HBM bytes per
tensor, each input's elements followed through copies, numpy arrays and Python lists."""
import math

import numpy as np
import pytest
import torch

from helpers import meter


def standard(q, k, v):
    s = q @ k.T / math.sqrt(q.shape[1])          # [N, Nk]
    return torch.softmax(s, dim=1) @ v


def tiled_v1_like(q, k, v, Br=4, Bc=3):
    N, d = q.shape
    O = torch.zeros_like(q)
    for j in range(0, k.shape[0], Bc):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]        # loaded once per outer step
        for i in range(0, N, Br):
            Qi = q[i:i + Br]                       # loaded again for every KV block
            O[i:i + Br] = O[i:i + Br] + (Qi @ Kj.T) @ Vj
    return O


def test_standard_attention_counts():
    q, k, v = torch.randn(16, 8), torch.randn(12, 8), torch.randn(12, 8)
    r = meter.measure(standard, q, k, v, names="qkv")
    assert r.flops == 2 * 16 * 12 * 8 * 2
    assert r.largest.shape == (16, 12)
    assert r.reads == {"q": 16 * 8 * 4, "k": 12 * 8 * 4, "v": 12 * 8 * 4}
    assert r.writes == {"out": 16 * 8 * 4}


def test_tiles_are_loaded_once_per_slice():
    N, Nk, d = 8, 9, 4
    q, k, v = torch.randn(N, d), torch.randn(Nk, d), torch.randn(Nk, d)
    r = meter.measure(tiled_v1_like, q, k, v, names="qkv")
    n_kv_blocks = 3
    assert r.reads["k"] == Nk * d * 4 and r.reads["v"] == Nk * d * 4
    assert r.reads["q"] == n_kv_blocks * N * d * 4
    assert r.writes["out"] == n_kv_blocks * N * d * 4
    assert r.largest.numel <= 4 * d


def test_piecewise_buffers_are_hbm():
    def with_stats(x):
        m = torch.full((x.shape[0],), -math.inf)
        for i in range(0, x.shape[0], 2):
            m[i:i + 2] = x[i:i + 2].amax(1)
        return x.sum(1) - m
    r = meter.measure(with_stats, torch.randn(6, 5), names=["x"])
    assert r.writes["buffer0"] == 6 * 4
    assert r.reads["buffer0"] == 6 * 4


def test_elementwise_counts_divisions():
    r = meter.measure(lambda a: a / 3.0 + a.exp() / 2.0, torch.randn(10), names=["a"])
    assert r.elementwise["div"] == 20 and r.elementwise["exp"] == 10


# ------------------------------------------------------------------ provenance: an input's elements wherever they go
def test_a_whole_copy_is_the_input():
    def on_copies(q, k):
        q64, kT = q.double(), k.T.contiguous()            # whole copies: no read yet
        return sum(float((q64[i:i + 2] @ kT.double()).sum()) for i in range(0, 6, 2))
    q, k = torch.randn(6, 4), torch.randn(5, 4)
    r = meter.measure(on_copies, q, k, names="qk")
    assert r.reads["q"] == q.numel() * 4                  # each q tile once, counted in q's dtype
    assert r.reads["k"] == 3 * k.numel() * 4              # kT.double() is a new copy of all of k, read per tile
    assert r.passes("q") == 1 and r.passes("k") == 3


def test_a_copy_of_a_piece_is_a_load():
    r = meter.measure(lambda x: x[2:5].double().sum() + x[2:5].double().sum(), torch.randn(8), names=["x"])
    assert r.read_sizes["x"] == [3, 3] and r.read_ranges["x"] == [(2, 5), (2, 5)]
    assert r.element_reads["x"].tolist() == [0, 0, 2, 2, 2, 0, 0, 0]


def test_tolist_elements_are_followed():
    def two_pass(x):
        xs = x.tolist()
        m = max(xs)
        return m, sum(v - m for v in xs)
    r = meter.measure(two_pass, torch.randn(5), names=["x"])
    assert r.read_sizes["x"] == [1] * 10 and r.passes("x") == 2 and r.escapes["tolist"] == 1
    assert [lo for lo, _ in r.read_ranges["x"]] == [0, 1, 2, 3, 4] * 2


def test_tolist_of_a_2d_input_follows_rows():
    r = meter.measure(lambda x: [row[1] for row in x.tolist()], torch.randn(3, 4), names=["x"])
    assert [lo for lo, _ in r.read_ranges["x"]] == [1, 5, 9]


def test_numpy_work_is_metered():
    def scores(q, k):
        S = q.numpy() @ np.asarray(k).T                   # [N, Nk] made in numpy
        return torch.from_numpy(np.exp(S - S.max(1, keepdims=True)))
    q, k = torch.randn(6, 4), torch.randn(7, 4)
    r = meter.measure(scores, q, k, names="qk")
    assert r.largest.shape == (6, 7) and r.largest.made_by == "np.matmul"
    assert r.flops == 2 * 6 * 7 * 4
    assert r.reads == {"q": q.numel() * 4, "k": k.numel() * 4}
    assert r.elementwise_flops == 3 * 6 * 7               # max (a reduction), subtract, exp


def test_numpy_tiles_are_loads_and_copies_are_the_input():
    def tiles(x):
        a = np.array(x, dtype=np.float64)                 # a whole copy: still x
        return float(sum(a[i:i + 2].sum() for i in range(0, 6, 2)) + a[0])
    r = meter.measure(tiles, torch.randn(6), names=["x"])
    assert r.read_sizes["x"] == [2, 2, 2, 1] and r.element_reads["x"].tolist() == [2, 1, 1, 1, 1, 1]


def test_numpy_fancy_indexing_is_a_gather_into_sram():
    """a[idx] copies: one load of exactly those elements, and an array made (the largest here)."""
    def gather(x):
        rows = np.asarray(x)[np.array([3, 0, 3])]         # [3, 4], a copy
        return float(rows.sum() + np.asarray(x)[1:2].sum())
    r = meter.measure(gather, torch.arange(20.0).reshape(5, 4), names=["x"])
    assert r.largest.shape == (3, 4) and r.largest.made_by == "np.ndarray[idx]"
    assert r.read_sizes["x"] == [12, 4] and r.element_reads["x"].tolist() == [1] * 8 + [0] * 4 + [2] * 4 + [0] * 4


# ------------------------------------------------------------------ what the work costs
def test_elementwise_flops_match_a_matmul():
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    by_mm = meter.measure(lambda a, b: a @ b.T, a, b)
    by_products = meter.measure(lambda a, b: (a[:, None] * b[None]).sum(-1), a, b)
    assert by_mm.flops == by_products.elementwise_flops == 2 * 4 * 3 * 8
    assert by_products.flops == 0 and by_mm.elementwise_flops == 0


def test_matrix_vector_products_count():
    r = meter.measure(lambda a, x: (a @ x) + torch.dot(x, x), torch.randn(5, 3), torch.randn(3))
    assert r.flops == 2 * 5 * 3 + 2 * 3


def test_divisions_by_a_tensor_not_by_a_constant():
    def f(s, l):
        return (s / math.sqrt(8.0)) / l[:, None] + 1 / l[:, None]
    r = meter.measure(f, torch.randn(4, 6), torch.rand(4) + 1)
    assert r.divisions == 4 * 6 + 4


def test_noop_masks_are_counted():
    def f(s):
        s = s.masked_fill(torch.zeros(3, 4, dtype=torch.bool), -math.inf)   # changes nothing
        s = s.masked_fill(torch.eye(3, 4, dtype=torch.bool), -math.inf)     # does
        return torch.where(torch.ones(3, 4, dtype=torch.bool), s, 0.0)      # changes nothing
    assert meter.measure(f, torch.randn(3, 4)).noop_masks == 2


# ------------------------------------------------------------------ Grader.measure: one error behaviour
def test_an_error_while_metered_is_a_verdict_with_the_case():
    from helpers import check
    from helpers.checking import CheckFailure
    from tests.conftest import notebook_namespace
    sol = notebook_namespace("04_causal_tile_classes")["flash_attn_causal"]

    def fails_when_metered(q, k, v, Br=4, Bc=3, align="top_left"):
        if q.shape == (24, 16):                           # only the metered case's shape
            raise RuntimeError("boom")
        return sol(q, k, v, Br, Bc, align)
    with pytest.raises(CheckFailure) as info:
        check.flash_attn_causal(fails_when_metered)
    msg = str(info.value)
    assert "raised RuntimeError while metered" in msg and "boom" in msg and "the work done (metered)" in msg
    assert "Traceback" not in msg


# ------------------------------------------------------------------ issue 21
def test_numpy_shape_only_constructors_read_nothing():
    """np.zeros_like(x) looks at x's shape and dtype, like torch.zeros_like: not a read of x."""
    x = torch.randn(4, 8)

    def f(x):
        z = np.zeros_like(x)
        e = np.empty_like(x.numpy())
        o = np.ones_like(x[:, 0])
        fl = np.full_like(x.numpy(), 2.0)
        return torch.from_numpy(z + o[:, None] + fl + e.shape[0])
    r = meter.measure(f, x, names=["x"])
    assert r.read_sizes.get("x", []) == [] and r.passes("x") == 0


def test_a_mask_added_as_arithmetic_is_seen():
    S = torch.randn(4, 3)

    def all_true(S):
        keep = torch.ones(4, 3, dtype=torch.bool)
        return S + torch.log(keep.float())   # adds 0 everywhere: a mask that changes nothing

    def times_all_true(S):
        return S * (torch.arange(3)[None, :] < 5).float().expand(4, 3)

    def diagonal(S):
        keep = torch.arange(3)[None, :] <= torch.arange(4)[:, None]
        return S + torch.log(keep.float())

    def accumulate(S):
        acc = torch.zeros(4, 3)
        return acc + S                       # an accumulator starting at 0 is no mask
    assert meter.measure(all_true, S).noop_masks == 1
    assert meter.measure(times_all_true, S).noop_masks == 1
    assert meter.measure(diagonal, S).noop_masks == 0
    assert meter.measure(accumulate, S).noop_masks == 0


def test_working_memory_sees_tensors_alive_at_once_and_python_lists():
    x = torch.randn(4096)

    def tiles_dropped(x):
        return sum(float((x[i:i + 64] * 2).sum()) for i in range(0, 4096, 64))

    def tiles_kept(x):
        kept = [x[i:i + 64] * 2 for i in range(0, 4096, 64)]
        return sum(float(t.sum()) for t in kept)

    def floats(x):
        xs = [float(t) for t in x]
        return max(xs)

    def tolist(x):
        return max(x.tolist())
    assert meter.torch_peak(tiles_dropped, x)[0] <= 3 * 64
    assert meter.torch_peak(tiles_kept, x)[0] >= 4096
    m = meter.python_peak(floats, x)
    assert m.python_peak >= 3 * 4096 and m.input_lists == 0      # about 32 bytes a float in a list
    m = meter.python_peak(tolist, x)
    assert m.input_lists >= 3 * 4096 and m.python_peak - m.input_lists < 1024   # followed: counted apart
    assert meter.python_peak(tiles_dropped, x).python_peak < 1024
