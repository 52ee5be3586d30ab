"""The idea checks see all the work: answers with the right output that break the lesson's idea.

Each planted answer below was accepted with ✅ before the meter followed inputs through
copies, numpy arrays and Python lists, counted elementwise FLOPs and divisions: each must
now fail with a hint that names its actual mistake. Correct answers written another way
(einsum, a tile at a time in float64, a one-pass loop over ``x.tolist()``) must still pass.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import check
from conftest import notebook_namespace, rejects

NEG_INF = -math.inf


@pytest.fixture(scope="module")
def ns01():
    return notebook_namespace("01_online_softmax")


@pytest.fixture(scope="module")
def ns06():
    return notebook_namespace("06_flash_decoding")


# ------------------------------------------------------------------ 01: online_softmax_stats
def stats_two_pass_tolist(x):
    xs = x.tolist()
    m = max(xs)                                   # pass 1
    if m == NEG_INF:
        return m, 0.0
    return m, sum(math.exp(v - m) for v in xs)    # pass 2


def stats_two_pass_numpy(x):
    a = x.numpy()
    m = float(a.max())
    return m, (float(np.exp(a.astype(np.float64) - m).sum()) if m > NEG_INF else 0.0)


def stats_amax_logsumexp(x):
    m = x.amax()
    lse = torch.logsumexp(x.double(), 0)
    return float(m), (float(torch.exp(lse - float(m))) if m > NEG_INF else 0.0)


def stats_two_pass_on_a_copy(x):
    x = x.double()                                # a copy is still x
    m = NEG_INF
    for xi in x:
        m = max(m, float(xi))
    if m == NEG_INF:
        return m, 0.0
    return m, sum(math.exp(float(xi) - m) for xi in x)


def stats_one_pass_tolist(x):                     # correct, another way: one pass over a Python list
    m, l = NEG_INF, 0.0
    for xi in x.double().tolist():
        m_new = max(m, xi)
        if m_new == NEG_INF:
            continue
        l = l * math.exp(m - m_new) + math.exp(xi - m_new)
        m = m_new
    return m, l


def stats_one_pass_numpy(x):                      # correct, another way: one pass over a numpy array
    m, l = NEG_INF, 0.0
    for xi in np.asarray(x):
        xi = float(xi)
        m_new = max(m, xi)
        if m_new == NEG_INF:
            continue
        l = l * math.exp(m - m_new) + math.exp(xi - m_new)
        m = m_new
    return m, l


def test_stats_two_pass_over_tolist():
    rejects(check.online_softmax_stats, stats_two_pass_tolist, "2 times", "x.tolist()", "2-pass softmax",
            "one pass (metered)")


def test_stats_two_pass_over_numpy():
    rejects(check.online_softmax_stats, stats_two_pass_numpy, "12 elements of x in one operation", "numpy",
            "2- or 3-pass")


def test_stats_amax_and_logsumexp():
    rejects(check.online_softmax_stats, stats_amax_logsumexp, "12 elements of x in one operation", "2- or 3-pass")


def test_stats_two_pass_on_a_copy():
    rejects(check.online_softmax_stats, stats_two_pass_on_a_copy, "2 times", "2-pass softmax")


@pytest.mark.parametrize("fn", [stats_one_pass_tolist, stats_one_pass_numpy])
def test_stats_one_pass_written_another_way_passes(fn):
    check.online_softmax_stats(fn)


# ------------------------------------------------------------------ 01: blockwise_stats
def blockwise_two_pass(x, Bc):
    R, n = x.shape
    m = torch.full((R,), NEG_INF)
    for j in range(0, n, Bc):                     # pass 1: the max
        m = torch.maximum(m, x[:, j:j + Bc].amax(1))
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    l = torch.zeros(R)
    for j in range(0, n, Bc):                     # pass 2: the sum against it
        l = l + torch.exp(x[:, j:j + Bc] - m_safe[:, None]).sum(1)
    return m, l


def blockwise_whole_row(x, Bc):
    m = x.amax(1)                                 # [R], but it reads the whole row
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    return m, torch.where(m == NEG_INF, 0.0, torch.exp(torch.logsumexp(x.double(), 1) - m_safe).float())


def blockwise_numpy_row(x, Bc):
    a = x.double().numpy()
    m = a.max(1)                                  # the whole row, in numpy
    m_safe = np.where(m == NEG_INF, 0.0, m)
    l = np.exp(a - m_safe[:, None]).sum(1)
    return torch.from_numpy(m).float(), torch.from_numpy(l).float()


def blockwise_einsum_style(x, Bc):                # correct, another way: float64 blocks, torch.logsumexp per block
    R, n = x.shape
    lse = torch.full((R,), NEG_INF, dtype=torch.float64)
    m = torch.full((R,), NEG_INF, dtype=torch.float64)
    for j in range(0, n, Bc):
        block = x[:, j:j + Bc].double()           # [R, <=Bc], a load of one block
        m = torch.maximum(m, block.amax(1))
        lse = torch.logaddexp(lse, torch.logsumexp(block, 1))
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    return m.float(), torch.where(m == NEG_INF, 0.0, torch.exp(lse - m_safe)).float()


def test_blockwise_two_pass():
    rejects(check.blockwise_stats, blockwise_two_pass, "2 times", "2-pass version", "blocks only (metered)")


def test_blockwise_amax_and_logsumexp_of_the_row():
    rejects(check.blockwise_stats, blockwise_whole_row, "one operation read 192 elements", "whole row at once")


def test_blockwise_row_in_numpy():
    rejects(check.blockwise_stats, blockwise_numpy_row, "made a tensor of shape [4, 48] (np.", "never holds")


def test_blockwise_written_another_way_passes(ns01):
    check.blockwise_stats(blockwise_einsum_style)
