"""Lesson 02 (FlashAttention V1): the checker, its planted bugs, and the functions behind the pictures."""
from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from helpers import check, meter, reference
from helpers import lesson02 as L
from helpers.lesson02.check import attention_cases, tiled_model

from conftest import rejects

matplotlib.use("Agg")
NB = "02_flash_attention_v1"


# ------------------------------------------------------------------ planted bugs, V1's loop order
def _v1(q, k, v, Br=4, Bc=3, *, scale=None, bug=None):
    """V1 with one planted mistake (the loop order of Algorithm 1)."""
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    O = torch.zeros(N, d)
    l = torch.zeros(N)
    m = torch.full((N,), -math.inf)
    for j in range(0, Nk, Bc):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]
        for i in range(0, N, Br):
            Qi, Oi, li, mi = q[i:i + Br], O[i:i + Br], l[i:i + Br], m[i:i + Br]
            S = Qi @ Kj.T * scale
            m_blk = S.amax(1)
            P = torch.exp(S - m_blk[:, None])
            m_new = torch.maximum(mi, m_blk)
            alpha, beta = torch.exp(mi - m_new), torch.exp(m_blk - m_new)
            l_new = (li if bug == "no_alpha_l" else alpha * li) + beta * P.sum(1)
            keep = {"no_l_back": alpha, "no_alpha": li}.get(bug, alpha * li)
            O[i:i + Br] = (keep[:, None] * Oi + beta[:, None] * (P @ Vj)) / l_new[:, None]
            l[i:i + Br], m[i:i + Br] = l_new, m_new
    return O


def no_alpha(q, k, v, Br=4, Bc=3):
    return _v1(q, k, v, Br, Bc, bug="no_alpha")


def no_alpha_l(q, k, v, Br=4, Bc=3):
    return _v1(q, k, v, Br, Bc, bug="no_alpha_l")


def no_l_back(q, k, v, Br=4, Bc=3):
    return _v1(q, k, v, Br, Bc, bug="no_l_back")


def scale_one(q, k, v, Br=4, Bc=3):
    return _v1(q, k, v, Br, Bc, scale=1.0)


def scale_over_d(q, k, v, Br=4, Bc=3):
    return _v1(q, k, v, Br, Bc, scale=1.0 / q.shape[1])


def drops_ragged(q, k, v, Br=4, Bc=3):
    N, Nk = q.shape[0], k.shape[0]
    O = torch.zeros(N, q.shape[1])
    nN, nK = N - N % Br, Nk - Nk % Bc
    if nN and nK:
        O[:nN] = _v1(q[:nN], k[:nK], v[:nK], Br, Bc)
    return O


def materialised(q, k, v, Br=4, Bc=3):
    """The right output, from the whole score matrix."""
    S = q @ k.T / math.sqrt(q.shape[1])                 # [N, Nk]
    P = torch.exp(S - S.amax(1, keepdim=True))
    return (P @ v) / P.sum(1, keepdim=True)


def calls_sdpa(q, k, v, Br=4, Bc=3):
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]


def v2_order(q, k, v, Br=4, Bc=3):
    """A correct output in V2's order: K and V are read once per Q block."""
    N, d = q.shape
    O = torch.empty(N, d)
    for i in range(0, N, Br):
        Qi = q[i:i + Br]
        m = torch.full((Qi.shape[0],), -math.inf)
        l = torch.zeros(Qi.shape[0])
        acc = torch.zeros(Qi.shape[0], d)
        for j in range(0, k.shape[0], Bc):
            S = Qi @ k[j:j + Bc].T / math.sqrt(d)
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + P.sum(1)
            acc = alpha[:, None] * acc + P @ v[j:j + Bc]
            m = m_new
        O[i:i + Br] = acc / l[:, None]
    return O


def in_place(q, k, v, Br=4, Bc=3):
    q *= 1.0 / math.sqrt(q.shape[1])
    return _v1(q, k, v, Br, Bc, scale=1.0)


def v1_lse_form(q, k, v, Br=4, Bc=3):
    """Correct, written another way: V1's order with the merge done through log-sum-exps."""
    N, d = q.shape
    O = torch.zeros(N, d)
    lse = torch.full((N,), -math.inf)
    for j in range(0, k.shape[0], Bc):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]
        for i in range(0, N, Br):
            Qi, Oi, lse_i = q[i:i + Br], O[i:i + Br], lse[i:i + Br]
            S = Qi @ Kj.T / math.sqrt(d)
            lse_blk = torch.logsumexp(S, dim=1)
            O_blk = torch.exp(S - lse_blk[:, None]) @ Vj
            lse_new = torch.logaddexp(lse_i, lse_blk)
            O[i:i + Br] = torch.exp(lse_i - lse_new)[:, None] * Oi + torch.exp(lse_blk - lse_new)[:, None] * O_blk
            lse[i:i + Br] = lse_new
    return O


# ------------------------------------------------------------------ the checker
def test_course_reference_passes(capsys):
    check.flash_attn_v1(L.flash_attn_v1_ref)
    assert "✅" in capsys.readouterr().out


def test_another_correct_way_passes(capsys):
    check.flash_attn_v1(v1_lse_form)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (no_l_back, ["multiplied back by the old l"]),
    (no_alpha, ["not rescaled when the max grew", "alpha = exp(m_old - m_new)"]),
    (no_alpha_l, ["running l was not rescaled"]),
    (scale_one, ["not scaled by 1/sqrt(d)"]),
    (scale_over_d, ["not 1/d"]),
    (drops_ragged, ["ragged"]),
    (materialised, ["N x Nk score matrix", "defeats FlashAttention"]),
    (calls_sdpa, ["SDPA or softmax"]),
    (v2_order, ["read 4 times", "KV loop outside"]),
    (in_place, ["changed its input `q` in place"]),
])
def test_planted_bugs_rejected(fn, words):
    rejects(check.flash_attn_v1, fn, *words)


def test_bug_models_agree_with_planted_code():
    """The checker's float64 model of the bug gives what the float32 buggy code gives."""
    for case in attention_cases()[:6]:
        got = no_l_back(*case.args, **case.kwargs).double()
        want = tiled_model(*case.args, case.kwargs["Br"], case.kwargs["Bc"], bug="no_l_back")[0]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ plain functions
def test_tile_grid_covers_everything_once():
    for N, Nk, Br, Bc in [(6, 6, 4, 3), (1, 9, 4, 3), (5, 3, 16, 16), (7, 11, 2, 5)]:
        grid = L.tile_grid(N, Nk, Br, Bc)
        assert len(grid) == math.ceil(N / Br) and len(grid[0]) == math.ceil(Nk / Bc)
        cover = torch.zeros(N, Nk, dtype=torch.int)
        for row in grid:
            for t in row:
                cover[t.rows.start:t.rows.stop, t.cols.start:t.cols.stop] += 1
        assert bool((cover == 1).all())
    assert L.tile_grid(6, 6, 4, 3)[1][0].shape == (2, 3)


def test_v1_schedule_counts_match_the_meter():
    N, Nk, d, Br, Bc = 10, 7, 4, 4, 3
    steps = L.v1_schedule(N, Nk, d, Br, Bc)
    assert [(s.j, s.i) for s in steps[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]   # KV outside
    last = steps[-1]
    q, k, v = torch.randn(N, d), torch.randn(Nk, d), torch.randn(Nk, d)
    r = meter.measure(L.flash_attn_v1_ref, q, k, v, Br, Bc, names=("q", "k", "v"))
    assert r.reads["q"] == 4 * last.reads["q"] and r.reads["k"] == 4 * last.reads["k"]
    assert r.reads["out"] == 4 * last.reads["O"] and r.writes["out"] == 4 * last.writes["O"]
    assert r.writes["buffer0"] == 4 * last.writes["l"] and r.writes["buffer1"] == 4 * last.writes["m"]
    assert last.writes["O"] == math.ceil(Nk / Bc) * N * d


def test_render_v1_step():
    import matplotlib.pyplot as plt
    n = len(L.v1_schedule(6, 6, 4, 4, 3))
    for step in (0, n - 1, n + 5):          # out of range is clamped
        fig = L.render_v1_step(step)
        assert len(fig.axes) == 2
        plt.close(fig)


def test_reference_v1_and_standard_attention():
    q, k, v = torch.randn(9, 5), torch.randn(13, 5), torch.randn(13, 5)
    O_ref, _ = reference.attention(q, k, v)
    assert torch.allclose(L.flash_attn_v1_ref(q, k, v).double(), O_ref, atol=1e-5)
    O, S, P = L.standard_attention(q, k, v)
    assert torch.allclose(O.double(), O_ref, atol=1e-5) and S.shape == P.shape == (9, 13)


def test_v1_traffic_and_bounds():
    rows = L.v1_traffic(L.flash_attn_v1_ref, [32, 64], d=8, Br=8, Bc=16)
    for r in rows:
        N = r["N"]
        # standard: S and P written and read once each, q k v read, O written (float32)
        assert r["standard"] == 4 * (4 * N * N + 4 * N * 8)
        # V1: K and V once, Q and O once per KV block
        assert r["flash_reads"]["k"] == 4 * N * 8
        assert r["flash_reads"]["q"] == 4 * N * 8 * (N // 16)
    assert L.sram_elements(16, 64) == 4096
    assert L.paper_flash_elements(64, 16, 4096) == 64 * 64 * 16 * 16 / 4096
    assert L.paper_standard_elements(64, 16) == 64 * 16 + 64 * 64
    import matplotlib.pyplot as plt
    fig = L.plot_v1_traffic({16: rows})
    plt.close(fig)


def test_learner_notebook_is_generated_from_the_worked_one():
    from helpers.generate import ROOT, drift
    assert not [p for p in drift(ROOT / "solutions", ROOT / "notebooks") if p.startswith(NB)]


# ------------------------------------------------------------------ issue 21
def v1_dense_in_lists(q, k, v, Br=4, Bc=3):
    """The whole score matrix, in pure Python lists: the meter sees no FLOPs and each input read once."""
    Q, K, V = ([[float(t) for t in row] for row in a] for a in (q, k, v))
    scale = 1 / math.sqrt(len(Q[0]))
    S = [[sum(a * b for a, b in zip(qi, kj)) * scale for kj in K] for qi in Q]      # [N][Nk]
    O = []
    for row in S:
        m = max(row)
        p = [math.exp(s - m) for s in row]
        O.append([sum(pj * V[j][t] for j, pj in enumerate(p)) / sum(p) for t in range(len(V[0]))])
    return torch.tensor(O, dtype=q.dtype)


def test_dense_v1_in_python_lists_rejected():
    rejects(check.flash_attn_v1, v1_dense_in_lists, "working memory (metered)", "Python objects",
            "O(N·d + Br·Bc)", "the N x Nk scores are 65,536", "N x Nk score matrix")
