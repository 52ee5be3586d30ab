"""Lesson 01's checkers: the worked solution passes, the stub fails strict, planted bugs are named."""
import math

import pytest
import torch

from helpers import check
from helpers.lesson01 import online_trace, score_bytes, stats_bytes
from conftest import notebook_namespace, rejects

NB = "01_online_softmax"


@pytest.fixture(scope="module")
def sol():
    return notebook_namespace(NB)


# ------------------------------------------------------------------ online_softmax_stats
def stats_forgot_rescale(x):
    m, l = -math.inf, 0.0
    for xi in x:
        xi = float(xi)
        m = max(m, xi)
        if m > -math.inf:
            l += math.exp(xi - m)
    return m, l


def stats_nan_on_empty(x):
    m, l = -math.inf, 0.0
    for xi in x:
        xi = float(xi)
        m_new = max(m, xi)
        l = l * math.exp(m - m_new) + math.exp(xi - m_new)
        m = m_new
    return m, l


def stats_two_pass(x):
    m = x.max()
    m_safe = m if m > -math.inf else torch.tensor(0.0)
    return float(m), float(torch.exp(x - m_safe).sum())


def stats_no_max(x):
    l = 0.0
    for xi in x:
        l += math.exp(min(float(xi), 700.0))
    return max(float(v) for v in x), l


def test_stats_forgot_rescale(sol):
    rejects(check.online_softmax_stats, stats_forgot_rescale, "multiply it by exp(m_old - m_new)")


def test_stats_nan_on_empty_row(sol):
    rejects(check.online_softmax_stats, stats_nan_on_empty, "all -inf", "NaN")


def test_stats_two_pass_rejected_though_right():
    msg = rejects(check.online_softmax_stats, stats_two_pass, "one operation", "2- or 3-pass")
    assert "one pass (metered)" in msg


def test_stats_without_max():
    rejects(check.online_softmax_stats, stats_no_max, "subtract the max")


def test_stats_another_correct_way():
    def online_via_lse(x):  # keeps lse instead of (m, l); still one pass
        lse, m = -math.inf, -math.inf
        for xi in x.tolist():
            hi, lo = max(lse, xi), min(lse, xi)
            lse = hi if lo == -math.inf else hi + math.log1p(math.exp(lo - hi))
            m = max(m, xi)
        return (m, math.exp(lse - m)) if lse > -math.inf else (-math.inf, 0.0)
    check.online_softmax_stats(online_via_lse)


def test_stats_wrong_types():
    rejects(check.online_softmax_stats, lambda x: None, "returned None", "return")
    rejects(check.online_softmax_stats, lambda x: 1.0, "expected (m, l)")
    rejects(check.online_softmax_stats, lambda x: ("a", "b"), "Python float")


# ------------------------------------------------------------------ merge_ml
def merge_no_safe_max(m1, l1, m2, l2):
    m = torch.maximum(m1, m2)
    return m, l1 * torch.exp(m1 - m) + l2 * torch.exp(m2 - m)


def merge_plain_sum(m1, l1, m2, l2):
    return torch.maximum(m1, m2), l1 + l2


def merge_one_side(m1, l1, m2, l2):
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, l1 * torch.exp(m1 - m_safe) + l2


def merge_in_place(m1, l1, m2, l2):
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l1 *= torch.exp(m1 - m_safe)
    return m, l1 + l2 * torch.exp(m2 - m_safe)


def merge_via_exp(m1, l1, m2, l2):  # exp(m) * l overflows for large m
    lse = torch.log(torch.exp(m1) * l1 + torch.exp(m2) * l2)
    m = torch.maximum(m1, m2)
    return m, torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(lse - m))


def test_merge_nan_when_both_empty(capsys):
    """The ❌ names the case and the bug; the exact fix comes only when asked, or when the mistake comes back."""
    from helpers import checking
    checking._HINTS_SEEN.clear()
    msg = rejects(check.merge_ml, merge_no_safe_max, "both statistics were -inf", "exp(-inf - -inf) is NaN",
                  'check.hint("merge_ml")')
    assert "torch.where" not in msg and "m_safe" not in msg                 # the fix is not handed over
    check.hint("merge_ml")
    assert "m_safe = torch.where(m == -inf, 0, m)" in capsys.readouterr().out
    again = rejects(check.merge_ml, merge_no_safe_max, "this mistake came back")
    assert "m_safe = torch.where(m == -inf, 0, m)" in again


def test_hint_without_a_failure_or_for_a_typo_says_so(capsys):
    from helpers import checking
    checking._LAST_FIX.pop("blockwise_stats", None)
    check.hint("blockwise_stats")
    check.hint("merge_mll")
    out = capsys.readouterr().out
    assert "no failed check in this session" in out and "no exercise called 'merge_mll'" in out


def test_merge_plain_sum():
    rejects(check.merge_ml, merge_plain_sum, "summed against different maxima")


def test_merge_one_side_rescaled():
    rejects(check.merge_ml, merge_one_side, "only l1 was rescaled")


def test_merge_changes_inputs():
    rejects(check.merge_ml, merge_in_place, "changed its input `l1` in place")


def test_merge_overflow():
    rejects(check.merge_ml, merge_via_exp, "large maxima", "exp(m) overflows")


def test_merge_wrong_dtype():
    def merge64(m1, l1, m2, l2):
        m, l = merge_ml_ref(m1, l1, m2, l2)
        return m.double(), l.double()
    rejects(check.merge_ml, merge64, "dtype torch.float64, expected torch.float32")


def merge_ml_ref(m1, l1, m2, l2):
    """Another correct way: the larger side keeps its l, the smaller one is scaled down."""
    first = m1 >= m2
    m = torch.where(first, m1, m2)
    big_l, small_l = torch.where(first, l1, l2), torch.where(first, l2, l1)
    gap = torch.where(first, m2 - m1, m1 - m2).nan_to_num(nan=-math.inf)   # <= 0; -inf - -inf -> -inf
    return m, big_l + small_l * torch.exp(gap)


def test_merge_another_correct_way():
    check.merge_ml(merge_ml_ref)


# ------------------------------------------------------------------ blockwise_stats
def test_blockwise_drops_ragged_block(sol):
    merge = sol["merge_ml"]

    def drop_last(x, Bc):
        R, n = x.shape
        m, l = torch.full((R,), -math.inf), torch.zeros(R)
        for j in range(0, n - Bc + 1, Bc):
            b = x[:, j:j + Bc]
            mj = b.amax(1)
            ms = torch.where(torch.isinf(mj), torch.zeros_like(mj), mj)
            m, l = merge(m, l, mj, torch.exp(b - ms[:, None]).sum(1))
        return m, l
    rejects(check.blockwise_stats, drop_last, "ragged block was dropped")


def test_blockwise_nan_in_empty_block(sol):
    merge = sol["merge_ml"]

    def unsafe(x, Bc):
        R, n = x.shape
        m, l = torch.full((R,), -math.inf), torch.zeros(R)
        for j in range(0, n, Bc):
            b = x[:, j:j + Bc]
            mj = b.amax(1)
            m, l = merge(m, l, mj, torch.exp(b - mj[:, None]).sum(1))
        return m, l
    rejects(check.blockwise_stats, unsafe, "safe max")


def test_blockwise_whole_row_rejected_though_right():
    def whole_row(x, Bc):
        m = x.amax(1)
        ms = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        return m, torch.exp(x - ms[:, None]).sum(1)
    rejects(check.blockwise_stats, whole_row, "made a tensor of shape", "never holds")


def test_blockwise_another_correct_way():
    def via_logsumexp_blocks(x, Bc):
        lse = torch.full((x.shape[0],), -math.inf)
        m = torch.full((x.shape[0],), -math.inf)
        for j in range(0, x.shape[1], Bc):
            block = x[:, j:j + Bc]                 # one pass: each block read once
            lse = torch.logaddexp(lse, torch.logsumexp(block, dim=1))
            m = torch.maximum(m, block.amax(1))
        return m, torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(lse - m))
    check.blockwise_stats(via_logsumexp_blocks)


# ------------------------------------------------------------------ lse_from_stats
@pytest.mark.parametrize("bug, words", [
    (lambda m, l: m.clone(), "row max m"),
    (lambda m, l: (m + torch.log(l)) / math.log(2), "log2"),
    (lambda m, l: torch.log(torch.exp(m) * l), "overflows"),
])
def test_lse_bugs(bug, words):
    rejects(check.lse_from_stats, bug, words)


def test_lse_another_correct_way():
    check.lse_from_stats(lambda m, l: torch.where(l > 0, m + torch.log(l), torch.full_like(m, -math.inf)))


# ------------------------------------------------------------------ the plain functions behind the pictures
def test_trace_matches_reference():
    x = torch.tensor([0.5, 2.0, -math.inf, 3.5, 1.0])
    steps = online_trace(x)
    assert [s.i for s in steps] == list(range(5))
    assert steps[-1].m == 3.5
    assert steps[-1].l == pytest.approx(float(torch.exp(x - 3.5).sum()))
    assert steps[1].alpha == pytest.approx(math.exp(0.5 - 2.0)) and steps[4].alpha == 1.0


def test_trace_empty_row_stays_empty():
    steps = online_trace(torch.full((3,), -math.inf))
    assert all(s.m == -math.inf and s.l == 0.0 for s in steps)


def test_bytes_figures_of_the_lesson():
    assert score_bytes(8192) == 128 * 2**20
    assert score_bytes(8192, heads=32) == 4 * 2**30
    assert stats_bytes(8192, heads=32) == 2 * 2**20


# ------------------------------------------------------------------ hints that name the mistake
def test_lse_in_log2_of_l_is_named():
    msg = rejects(check.lse_from_stats, lambda m, l: m + torch.log2(l), "m + log2(l)", "natural log")
    assert "overflows" not in msg


def test_blockwise_old_l_not_rescaled_is_named():
    def blockwise_stats(x, Bc):
        m = torch.full((x.shape[0],), -math.inf)
        l = torch.zeros(x.shape[0])
        for j in range(0, x.shape[1], Bc):
            block = x[:, j:j + Bc]
            m = torch.maximum(m, block.amax(1))
            m_safe = torch.where(torch.isneginf(m), 0.0, m)
            l = l + torch.exp(block - m_safe[:, None]).sum(1)      # BUG: the old l is not rescaled
        return m, l
    rejects(check.blockwise_stats, blockwise_stats, "running l was not rescaled", "exp(m_old - m_new)")


# ------------------------------------------------------------------ issue 21
def stats_two_pass_over_floats(x):
    xs = [float(t) for t in x]                    # one read of each element: the meter sees one pass
    m = max(xs)                                   # pass 1, over Python floats
    return (m, sum(math.exp(v - m) for v in xs)) if m > -math.inf else (m, 0.0)   # pass 2


def stats_two_pass_over_items(x):
    xs = [t.item() for t in x]
    m = max(xs)
    return (m, sum(math.exp(v - m) for v in xs)) if m > -math.inf else (m, 0.0)


def stats_two_pass_over_a_copied_list(x):
    xs = list(x.tolist())                         # each element read once, into a plain list the meter cannot follow
    m = max(xs)
    return (m, sum(math.exp(v - m) for v in xs)) if m > -math.inf else (m, 0.0)


def stats_two_pass_over_a_comprehension(x):
    xs = [v for v in x.tolist()]
    m = -math.inf
    for v in xs:
        m = max(m, v)
    return (m, sum(math.exp(v - m) for v in xs)) if m > -math.inf else (m, 0.0)


@pytest.mark.parametrize("fn", [stats_two_pass_over_floats, stats_two_pass_over_items, stats_two_pass_over_a_copied_list,
                                stats_two_pass_over_a_comprehension])
def test_stats_two_pass_over_a_list_of_floats_rejected(fn):
    rejects(check.online_softmax_stats, fn, "O(1) memory (metered)", "O(1)", "only the 2-pass softmax needs")


def blockwise_per_row_lists(x, Bc):
    m, l = [], []
    for row in x:
        xs = [float(t) for t in row]              # a whole row of Python floats
        mr = max(xs)
        m.append(mr)
        l.append(sum(math.exp(v - mr) for v in xs) if mr > -math.inf else 0.0)
    return torch.tensor(m, dtype=x.dtype), torch.tensor(l, dtype=x.dtype)


def test_blockwise_per_row_two_pass_over_floats_rejected():
    rejects(check.blockwise_stats, blockwise_per_row_lists, "O(R·Bc) memory (metered)", "a whole row (or more)")


def blockwise_numpy_state(x, Bc):                 # correct: (m, l) kept in numpy arrays made with np.*_like
    import numpy as np
    n = x.shape[1]
    m = np.full_like(x[:, 0], -math.inf, dtype=np.float64)     # np.*_like reads no element of x
    l = np.zeros_like(x[:, 0], dtype=np.float64)
    for j in range(0, n, Bc):
        block = x[:, j:j + Bc].double().numpy()                # [R, <=Bc]
        m_new = np.maximum(m, block.max(1))
        safe = np.where(m_new == -math.inf, 0.0, m_new)
        l = l * np.exp(m - safe) + np.exp(block - safe[:, None]).sum(1)
        m = m_new
    return torch.from_numpy(m).to(x.dtype), torch.from_numpy(l).to(x.dtype)


def test_blockwise_with_numpy_zeros_like_passes():
    check.blockwise_stats(blockwise_numpy_state)


def blockwise_in_lists(x, Bc):                    # correct: blocks sliced out of x.tolist(), read twice each
    rows = x.tolist()
    ms, ls = [-math.inf] * len(rows), [0.0] * len(rows)
    for j in range(0, len(rows[0]), Bc):
        for r in range(len(rows)):
            b = rows[r][j:j + Bc]                 # a slice is one load of the block; its values are then local
            mb = max(b)
            if mb == -math.inf:
                continue
            lb = sum(math.exp(v - mb) for v in b)
            mn = max(ms[r], mb)
            ls[r] = ls[r] * math.exp(ms[r] - mn) + lb * math.exp(mb - mn)
            ms[r] = mn
    return torch.tensor(ms, dtype=x.dtype), torch.tensor(ls, dtype=x.dtype)


def test_blockwise_in_python_lists_passes():
    check.blockwise_stats(blockwise_in_lists)
