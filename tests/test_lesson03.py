"""Lesson 03 (FlashAttention V2): the checker, its planted bugs, and the functions behind the pictures."""
from __future__ import annotations

import math

import matplotlib
import pytest
import torch
from conftest import rejects

from helpers import check, meter, reference
from helpers import lesson02, lesson03 as L

matplotlib.use("Agg")
NB = "03_flash_attention_v2"


# ------------------------------------------------------------------ planted bugs
def _v2(q, k, v, Br=4, Bc=3, *, scale=None, lse_as=None, no_alpha=False, in_place=False, reslice_q=False,
        o_every_step=False):
    """V2 with one planted mistake (right numbers, wrong traffic: ``reslice_q``, ``o_every_step``)."""
    N, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if in_place:
        q *= scale
        scale = 1.0
    O, lse = torch.empty(N, d), torch.empty(N)
    for i in range(0, N, Br):
        Qi = q[i:i + Br]
        m = torch.full((Qi.shape[0],), -math.inf)
        l = torch.zeros(Qi.shape[0])
        acc = torch.zeros(Qi.shape[0], d)
        for j in range(0, k.shape[0], Bc):
            S = (q[i:i + Br] if reslice_q else Qi) @ k[j:j + Bc].T * scale     # reslice_q: a new load each time
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + P.sum(1)
            acc = (acc if no_alpha else alpha[:, None] * acc) + P @ v[j:j + Bc]
            m = m_new
            if o_every_step:
                O[i:i + Br] = acc / l[:, None]
        if not o_every_step:
            O[i:i + Br] = acc / l[:, None]
        lse[i:i + Br] = {None: m + torch.log(l), "max": m, "log2": (m + torch.log(l)) / math.log(2),
                         "log_l": torch.log(l)}[lse_as]
    return O, lse


def lse_is_row_max(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, lse_as="max")


def lse_in_log2(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, lse_as="log2")


def lse_is_log_l(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, lse_as="log_l")


def exp2_lse_not_converted(q, k, v, Br=4, Bc=3):
    """The exp2 form, returning the base-2 LSE."""
    O, lse = L.flash_attn_v2_exp2(q, k, v, Br, Bc)
    return O, lse * L.LOG2E


def scale_one(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, scale=1.0)


def scale_over_d(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, scale=1.0 / q.shape[1])


def acc_not_rescaled(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, no_alpha=True)


def writes_into_q(q, k, v, Br=4, Bc=3):
    return _v2(q, k, v, Br, Bc, in_place=True)


def materialised(q, k, v, Br=4, Bc=3):
    """The right output and lse, from the whole score matrix."""
    S = q @ k.T / math.sqrt(q.shape[1])          # [N, Nk]
    lse = torch.logsumexp(S, dim=1)
    return torch.exp(S - lse[:, None]) @ v, lse


def v1_order_as_v2(q, k, v, Br=4, Bc=3):
    """V1's loop order (KV outside, O, m, l in HBM), returning (O, lse): right numbers, V1's traffic."""
    O = lesson02.flash_attn_v1_ref(q, k, v, Br, Bc)
    # recompute (m, l) the V1 way to produce lse: KV outside again
    N, d = q.shape
    m, l = torch.full((N,), -math.inf), torch.zeros(N)
    for j in range(0, k.shape[0], Bc):
        Kj = k[j:j + Bc]
        for i in range(0, N, Br):
            S = q[i:i + Br] @ Kj.T / math.sqrt(d)
            m_new = torch.maximum(m[i:i + Br], S.amax(1))
            l[i:i + Br] = torch.exp(m[i:i + Br] - m_new) * l[i:i + Br] + torch.exp(S - m_new[:, None]).sum(1)
            m[i:i + Br] = m_new
    return O, m + torch.log(l)


def v1_loop_order_acc(q, k, v, Br=4, Bc=3):
    """V1's order with an unnormalised acc in HBM and one division at the end: still V1's traffic."""
    N, d = q.shape
    acc, m, l = torch.zeros(N, d), torch.full((N,), -math.inf), torch.zeros(N)
    for j in range(0, k.shape[0], Bc):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]
        for i in range(0, N, Br):
            S = q[i:i + Br] @ Kj.T / math.sqrt(d)
            m_new = torch.maximum(m[i:i + Br], S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m[i:i + Br] - m_new)
            acc[i:i + Br] = alpha[:, None] * acc[i:i + Br] + P @ Vj
            l[i:i + Br] = alpha * l[i:i + Br] + P.sum(1)
            m[i:i + Br] = m_new
    return acc / l[:, None], m + torch.log(l)


def reslices_q(q, k, v, Br=4, Bc=3):
    """V2's order, but q[i:i+Br] sliced again inside the KV loop: a new load each time."""
    return _v2(q, k, v, Br, Bc, reslice_q=True)


def tiles_collected_then_cat(q, k, v, Br=4, Bc=3):
    """Correct, written another way: exp2 form, tiles collected in lists and concatenated once."""
    N, d = q.shape
    qk_scale = L.LOG2E / math.sqrt(d)
    outs, lses = [], []
    for Qi in q.split(Br):
        m = torch.full((Qi.shape[0],), -math.inf)
        l = torch.zeros(Qi.shape[0])
        acc = torch.zeros(Qi.shape[0], d)
        for Kj, Vj in zip(k.split(Bc), v.split(Bc)):
            S = (Qi @ Kj.T) * qk_scale
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp2(S - m_new[:, None])
            alpha = torch.exp2(m - m_new)
            l = alpha * l + P.sum(1)
            acc = alpha[:, None] * acc + P @ Vj
            m = m_new
        outs.append(acc / l[:, None])
        lses.append((m + torch.log2(l)) * math.log(2))
    return torch.cat(outs), torch.cat(lses)


# ------------------------------------------------------------------ the checker
@pytest.mark.parametrize("fn", [L.flash_attn_v2_ref, L.flash_attn_v2_exp2, tiles_collected_then_cat])
def test_other_correct_ways_pass(fn, capsys):
    check.flash_attn_v2(fn)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (lse_is_row_max, ["`lse`", "row max m, not the LSE"]),
    (lse_in_log2, ["`lse`", "log2"]),
    (exp2_lse_not_converted, ["`lse`", "log2"]),
    (lse_is_log_l, ["log(l) alone"]),
    (scale_one, ["`O`", "not scaled by 1/sqrt(d)"]),
    (scale_over_d, ["not 1/d"]),
    (acc_not_rescaled, ["(or acc) was not rescaled", "alpha * acc"]),
    (writes_into_q, ["changed its input `q` in place"]),
    (materialised, ["N x Nk score matrix", "defeats FlashAttention"]),
    (v1_order_as_v2, ["q was read", "O written", "V1's loop order"]),
    (v1_loop_order_acc, ["V1's loop order"]),
    (reslices_q, ["q was read", "load Qi = q[i:i+Br] once"]),
])
def test_planted_bugs_rejected(fn, words):
    rejects(check.flash_attn_v2, fn, *words)


def test_o_written_more_than_once_is_named():
    """q read once but O written at every KV block."""
    def writes_o_each_step(q, k, v, Br=4, Bc=3):
        return _v2(q, k, v, Br, Bc, o_every_step=True)
    rejects(check.flash_attn_v2, writes_o_each_step, "O was written 5 times", "write O[i:i+Br] = acc / l once")


# ------------------------------------------------------------------ plain functions
def test_loop_orders():
    assert L.loop_order(6, 6, 4, 3, 1) == [[1, 3], [2, 4]]
    assert L.loop_order(6, 6, 4, 3, 2) == [[1, 2], [3, 4]]
    o = L.loop_order(7, 11, 2, 5, 2)
    assert sorted(x for row in o for x in row) == list(range(1, 4 * 3 + 1))
    with pytest.raises(ValueError):
        L.loop_order(6, 6, 4, 3, 3)
    import matplotlib.pyplot as plt
    plt.close(L.render_loop_orders())


def test_q_blocks_in_any_order_are_bit_identical():
    q, k, v = torch.randn(23, 8), torch.randn(31, 8), torch.randn(31, 8)
    base = L.flash_attn_v2_ref(q, k, v, 4, 3)
    order = L.q_block_order(23, 4, seed=1)
    assert sorted(order) == list(range(6)) and order != list(range(6))
    shuffled = L.flash_attn_v2_ref(q, k, v, 4, 3, order=order)
    assert torch.equal(base[0], shuffled[0]) and torch.equal(base[1], shuffled[1])
    assert L.q_block_order(10, 4) == [0, 1, 2]


def test_exp2_form_matches_reference():
    q, k, v = torch.randn(9, 5) * 20, torch.randn(12, 5), torch.randn(12, 5)
    O_ref, lse_ref = reference.attention(q, k, v)
    O, lse = L.flash_attn_v2_exp2(q, k, v, 4, 3)
    assert torch.allclose(O.double(), O_ref, atol=1e-5) and torch.allclose(lse.double(), lse_ref, atol=1e-4)


def test_costs_v1_against_v2():
    N, d, B = 48, 8, 16
    a = L.cost(lesson02.flash_attn_v1_ref, N, N, d, B, B)
    b = L.cost(L.flash_attn_v2_ref, N, N, d, B, B)
    n_blocks = N // B
    assert b["writes"] == {"out0": 4 * N * d, "out1": 4 * N}              # O and lse once
    assert a["writes"]["out"] == n_blocks * 4 * N * d                      # O once per KV block
    assert b["reads"]["q"] == 4 * N * d and a["reads"]["q"] == n_blocks * 4 * N * d
    assert b["reads"]["k"] == n_blocks * 4 * N * d and a["reads"]["k"] == 4 * N * d
    assert b["div"] == N * d and a["div"] == n_blocks * N * d
    by_n = L.sweep_n(lesson02.flash_attn_v1_ref, L.flash_attn_v2_ref, [16, 32], d=4, Br=8, Bc=8)
    by_t = L.sweep_tiles(lesson02.flash_attn_v1_ref, L.flash_attn_v2_ref, [8, 16], N=32, d=4)
    assert [x for x, _, _ in by_n] == [16, 32] and [x for x, _, _ in by_t] == [8, 16]
    import matplotlib.pyplot as plt
    plt.close(L.plot_v1_v2(by_n, by_t, d=4, B=8, N=32))


def test_meter_sees_v2_as_described():
    q, k, v = torch.randn(32, 4), torch.randn(40, 4), torch.randn(40, 4)
    r = meter.measure(L.flash_attn_v2_ref, q, k, v, 8, 8, names=("q", "k", "v"))
    assert r.largest.numel <= 8 * 8


def test_learner_notebook_is_generated_from_the_worked_one():
    from helpers.generate import ROOT, drift
    assert not [p for p in drift(ROOT / "solutions", ROOT / "notebooks") if p.startswith(NB)]


# ------------------------------------------------------------------ issue 21
def v2_numpy_zeros_like(q, k, v, Br=4, Bc=3):
    """Correct V2 whose outputs start as np.zeros_like(...): that reads no element of q."""
    import numpy as np
    N, d = q.shape
    scale = 1 / math.sqrt(d)
    O = torch.from_numpy(np.zeros_like(q.numpy()))                  # [N, d]
    lse = torch.from_numpy(np.zeros_like(q[:, 0]))                  # [N]
    for i in range(0, N, Br):
        Qi = q[i:i + Br]
        acc, m, l = torch.zeros(Qi.shape[0], d), torch.full((Qi.shape[0],), -math.inf), torch.zeros(Qi.shape[0])
        for j in range(0, k.shape[0], Bc):
            S = Qi @ k[j:j + Bc].T * scale
            m_new = torch.maximum(m, S.amax(1))
            P, alpha = torch.exp(S - m_new[:, None]), torch.exp(m - m_new)
            l, acc, m = alpha * l + P.sum(1), alpha[:, None] * acc + P @ v[j:j + Bc], m_new
        O[i:i + Br] = acc / l[:, None]
        lse[i:i + Br] = m + torch.log(l)
    return O, lse


def test_v2_with_numpy_zeros_like_passes():
    check.flash_attn_v2(v2_numpy_zeros_like)


def v2_in_lists(q, k, v, Br=4, Bc=3):
    """Correct V2 in Python lists: tiles are slices of q.tolist(), k.tolist(), v.tolist(), loaded once each."""
    Q, K, V = q.tolist(), k.tolist(), v.tolist()
    d, scale = len(V[0]), 1 / math.sqrt(len(Q[0]))
    O, L = [], []
    for i in range(0, len(Q), Br):
        Qi = Q[i:i + Br]                                            # [Br][d], loaded once
        acc, m, l = [[0.0] * d for _ in Qi], [-math.inf] * len(Qi), [0.0] * len(Qi)
        for j in range(0, len(K), Bc):
            Kj, Vj = K[j:j + Bc], V[j:j + Bc]                       # [Bc][d]
            for r, qi in enumerate(Qi):
                s = [sum(a * b for a, b in zip(qi, kj)) * scale for kj in Kj]
                m_new = max(m[r], max(s))
                alpha, p = math.exp(m[r] - m_new), [math.exp(x - m_new) for x in s]
                l[r] = alpha * l[r] + sum(p)
                acc[r] = [alpha * acc[r][t] + sum(pj * vj[t] for pj, vj in zip(p, Vj)) for t in range(d)]
                m[r] = m_new
        O += [[x / l[r] for x in acc[r]] for r in range(len(Qi))]
        L += [m[r] + math.log(l[r]) for r in range(len(Qi))]
    return torch.tensor(O, dtype=q.dtype), torch.tensor(L, dtype=q.dtype)


def test_v2_in_python_lists_passes_and_says_the_meter_saw_no_flops(capsys):
    check.flash_attn_v2(v2_in_lists)
    out = capsys.readouterr().out
    assert "✅ flash_attn_v2" in out and "the meter saw no FLOPs" in out     # 0 FLOPs is a finding, not a pass
