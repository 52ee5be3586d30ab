"""The meter measures what it claims: FLOPs, the largest tile, HBM bytes per tensor."""
import math

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
