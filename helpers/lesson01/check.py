"""Checkers of lesson 01, the online softmax: (m, l), their merge, blocks, the LSE.

References: ``torch.logsumexp`` in float64 (``helpers.reference``).
"""
from __future__ import annotations

import math

import torch

from .. import reference
from ..checking import Budget, Bug, Case, exercise
from ..cases import NEG_INF, gen

_gen = gen


# ------------------------------------------------------------------ shared bug models
def _stats_no_rescale(x):
    """l += exp(x_i - m_new) without multiplying the old l by exp(m_old - m_new)."""
    m, l = NEG_INF, 0.0
    for xi in x.double().tolist():
        m = max(m, xi)
        l += math.exp(xi - m) if m > NEG_INF else 0.0
    return m, l


def _stats_inverted_rescale(x):
    """l * exp(m_new - m_old): the rescale factor upside down."""
    m, l = NEG_INF, 0.0
    for xi in x.double().tolist():
        m_new = max(m, xi)
        l = (l * math.exp(min(m_new - m, 700)) if m > NEG_INF else 0.0) + math.exp(xi - m_new)
        m = m_new
    return m, l


# ------------------------------------------------------------------ online_softmax_stats
def _row_cases():
    rng = _gen(1)
    cases = [
        Case("one element", torch.tensor([0.5])),
        Case("increasing (rescale at every step)", torch.arange(6.0) * 1.5),
        Case("decreasing (no rescale needed)", torch.arange(6.0, 0, -1)),
        Case("random", torch.randn(37, generator=rng)),
        Case("large logits (exp overflows without the max)", torch.randn(20, generator=rng) * 50 + 1000,
             note="exp(1000) is inf in float32 and float64"),
        Case("very negative logits (exp underflows without the max)", torch.randn(9, generator=rng) - 2000),
        Case("-inf first (a masked key before any real one)", torch.tensor([NEG_INF, NEG_INF, 1.0, 2.0])),
        Case("-inf last", torch.tensor([3.0, 1.0, NEG_INF])),
        Case("all -inf (a fully masked row)", torch.full((5,), NEG_INF)),
        Case("ties", torch.tensor([2.0, 2.0, 2.0, 2.0])),
    ]
    cases += [Case(f"random, n={n}", torch.randn(n, generator=rng) * 4) for n in (2, 3, 64, 129)]
    return cases


_LIST_HINT = ("a list (or array) of x's values is the whole row in working memory, which only the 2-pass softmax "
              "needs (the max first, then the sum against it): the online version keeps m and l alone as it walks x "
              "(`for xi in x:` or `for xi in x.tolist():`), rescaling l by exp(m_old - m_new) when the max grows")


def _stats_budget(case):
    """O(1): m, l and a few temporaries, beyond a copy of x."""
    return Budget(64, "O(1) (m, l and a few numbers)", torch=False, hint=_LIST_HINT)


STATS_MEM_N = 16384


@exercise("online_softmax_stats", arg_names=["x"], reference="torch.logsumexp", budget=_stats_budget)
def online_softmax_stats(g):
    for case in _row_cases():
        x = case.args[0]
        out = g.call(case)
        m_got, l_got = g.expect_tuple(out, 2, "(m, l)")
        m_got, l_got = g.expect_float(m_got, "m"), g.expect_float(l_got, "l")
        m_ref, l_ref = reference.softmax_stats(x)
        g.compare(m_got, m_ref, "m", hint="m is the largest element seen so far (start from -inf)")
        g.compare(l_got, l_ref, "l", rtol=1e-5, bugs=[
            Bug("when m grows, the old l was summed against the old max: multiply it by "
                "exp(m_old - m_new) before adding exp(x_i - m_new)", lambda c: _stats_no_rescale(c.args[0])[1]),
            Bug("the rescale factor is upside down: it is exp(m_old - m_new) (<= 1), not exp(m_new - m_old)",
                lambda c: _stats_inverted_rescale(c.args[0])[1]),
            Bug("l should be the sum of exp(x_i - m), not of exp(x_i): subtract the max",
                lambda c: torch.exp(c.args[0].double()).sum()),
        ], hint="l = sum over i of exp(x_i - m), with m the final max",
           nan_hint="an all -inf row must give (-inf, 0.0): exp(-inf - -inf) is NaN; skip the update "
                    "while m is still -inf")
        g.count()
    _one_pass(g)
    g.check_memory(Case(f"O(1) memory (metered): n = {STATS_MEM_N}", torch.randn(STATS_MEM_N, generator=_gen(7))))


def _via(r):
    """How the function got at x's elements, when not through torch ops (for the verdict)."""
    ways = sorted(r.escapes)
    return f" (through {', '.join('x.' + w + '()' if not w.startswith('np.') else w + '(x)' for w in ways)})" \
        if ways else ""


def _one_pass(g):
    """The point of the exercise: a single left-to-right pass over x, one element at a time.

    The meter follows x's elements through copies (``x.double()``), ``x.tolist()`` and
    ``x.numpy()``, so a second pass over any of them is a second pass over x.
    """
    x = torch.randn(12, generator=_gen(2))
    r = g.measure(Case("one pass (metered)", x))
    for n in r.read_sizes.get("x", []):
        if n > 1:
            g.fail(f"your function read {n} elements of x in one operation{_via(r)} "
                   f"(ops seen: {', '.join(sorted(set(r.ops) - {'select', 'slice', 'unbind'}))})",
                   hint="that is the 2- or 3-pass softmax (max first, then the sum): the online version visits "
                        "x once, element by element (`for xi in x:`), keeping only m and l")
    passes = r.passes("x")
    if passes > 1:
        worst = int(r.element_reads["x"].argmax())
        g.fail(f"your function read x[{worst}] {passes} times{_via(r)}: that is {passes} passes over x",
               hint="that is the 2-pass softmax (the max first, then the sum against it), one element at a time: "
                    "the online version keeps m and l up to date as it goes, rescaling l by exp(m_old - m_new) "
                    "when the max grows, so one left-to-right pass is enough")
    frontier = -1
    for lo, _hi in r.read_ranges.get("x", []):
        if lo < frontier:
            g.fail(f"your function went back to x[{lo}] after reading x[{frontier}]: that is a second pass",
                   hint="keep m and l up to date as you go, so one left-to-right pass is enough")
        frontier = max(frontier, lo)


# ------------------------------------------------------------------ merge_ml
def _merge_cases():
    rng = _gen(3)
    n = 64
    m1, m2 = torch.randn(n, generator=rng) * 3, torch.randn(n, generator=rng) * 3
    l1, l2 = torch.rand(n, generator=rng) * 5 + 1, torch.rand(n, generator=rng) * 5 + 1
    t = torch.tensor
    return [
        Case("random", m1, l1, m2, l2),
        Case("equal maxima", t([1.0, -2.0, 0.0]), t([2.0, 1.0, 3.0]), t([1.0, -2.0, 0.0]), t([1.0, 4.0, 1.0])),
        Case("left side empty (-inf, 0)", t([NEG_INF, NEG_INF]), t([0.0, 0.0]), t([0.5, -3.0]), t([2.0, 1.0])),
        Case("right side empty (-inf, 0)", t([0.5, 7.0]), t([2.0, 1.0]), t([NEG_INF, NEG_INF]), t([0.0, 0.0])),
        Case("both sides empty (-inf, 0)", t([NEG_INF, 1.0, NEG_INF]), t([0.0, 2.0, 0.0]),
             t([NEG_INF, 0.0, NEG_INF]), t([0.0, 1.0, 0.0]),
             note="a tile or a split where no key is visible, for this row"),
        Case("large maxima (exp(m) overflows)", m1[:8] + 1e4, l1[:8], m2[:8] + 1e4, l2[:8]),
        Case("far apart maxima", t([0.0, 100.0]), t([3.0, 1.0]), t([100.0, 0.0]), t([2.0, 4.0])),
        Case("scalars (0-d tensors)", t(1.5), t(2.0), t(-0.5), t(3.0)),
    ]


def _merge_models():
    def no_rescale(c):
        return c.args[1].double() + c.args[3].double()

    def one_side_rescaled(c):
        m1, l1, m2, l2 = (a.double() for a in c.args)
        m = torch.maximum(m1, m2)
        return l1 * torch.exp(m1 - m) + l2

    def inverted(c):
        m1, l1, m2, l2 = (a.double() for a in c.args)
        m = torch.maximum(m1, m2)
        return l1 * torch.exp(m - m1) + l2 * torch.exp(m - m2)

    return [
        Bug("l1 and l2 were summed against different maxima: rescale each to the new max, "
            "l = l1 * exp(m1 - m) + l2 * exp(m2 - m)", no_rescale),
        Bug("only l1 was rescaled: l2 also needs exp(m2 - m)", one_side_rescaled),
        Bug("the rescale factor is upside down: exp(m_i - m), which is <= 1", inverted),
    ]


@exercise("merge_ml", arg_names=["m1", "l1", "m2", "l2"], reference="torch.logsumexp")
def merge_ml(g):
    bugs = _merge_models()
    for case in _merge_cases():
        out = g.call(case)
        m_got, l_got = g.expect_tuple(out, 2, "(m, l)")
        shape = case.args[0].shape
        g.expect_tensor(m_got, "m", shape=shape, dtype=case.args[0].dtype)
        g.expect_tensor(l_got, "l", shape=shape, dtype=case.args[0].dtype)
        m_ref, l_ref = reference.merge_ml(*case.args)
        both_empty = ("both statistics were -inf (two empty sides): exp(-inf - -inf) is NaN; where the merged m "
                      "is -inf, nothing was seen, and the rescale factors must not be computed from it")
        both_empty_fix = "m_safe = torch.where(m == -inf, 0, m), then rescale by exp(m1 - m_safe), exp(m2 - m_safe)"
        g.compare(m_got, m_ref, "m", hint="m = max(m1, m2)")
        overflow = ("exp(m) overflows float32 above m = 88: never form exp(m1) or exp(m2) alone; "
                    "rescale by exp(m1 - m) and exp(m2 - m), which are <= 1")
        large = "large" in case.name
        g.compare(l_got, l_ref, "l", rtol=1e-5, bugs=bugs, nan_hint=overflow if large else both_empty,
                  nan_fix="" if large else both_empty_fix,
                  hint=overflow if large else "each side's l must be rescaled to the merged max before adding",
                  fix="" if large else "l = l1 * exp(m1 - m) + l2 * exp(m2 - m)")
        g.count()


# ------------------------------------------------------------------ blockwise_stats
def _block_cases():
    rng = _gen(4)
    x = torch.randn(5, 23, generator=rng) * 3
    holes = x.clone()
    holes[1, :7] = NEG_INF       # the first blocks of row 1 are empty
    holes[3, :] = NEG_INF        # row 3 is fully masked
    holes[4, 10:] = NEG_INF      # the last blocks of row 4 are empty
    return [
        Case("random, ragged last block", x, 4),
        Case("Bc = 1", x[:2], 1),
        Case("Bc = n (one block)", x, 23),
        Case("Bc > n (a tile larger than the input)", x, 64),
        Case("n = 1", x[:, :1], 3),
        Case("one row", x[:1], 5),
        Case("empty blocks and a fully masked row", holes, 3,
             note="row 3 is all -inf; rows 1 and 4 have blocks that are all -inf"),
        Case("large logits", x * 40 + 2000, 6),
        Case("random, wide", torch.randn(3, 200, generator=rng), 16),
    ]


def _blockwise_ref_dropping_last(c):
    x, Bc = c.args
    n = x.shape[1]
    full = (n // Bc) * Bc
    if full == 0:
        raise ValueError("no full block")
    return reference.softmax_stats(x[:, :full])[1]


def _blockwise_no_rescale(c):
    """Each block's l (against its own max) added as it is."""
    x, Bc = c.args
    l = torch.zeros(x.shape[0], dtype=torch.float64)
    m = torch.full((x.shape[0],), NEG_INF, dtype=torch.float64)
    for j in range(0, x.shape[1], Bc):
        mj, lj = reference.softmax_stats(x[:, j:j + Bc])
        m = torch.maximum(m, mj)
        l = l + lj
    return l


def _blockwise_old_l_not_rescaled(c):
    """The block summed against the new max, but the running l never multiplied by exp(m_old - m_new)."""
    x, Bc = c.args
    x = x.double()
    l = torch.zeros(x.shape[0], dtype=torch.float64)
    m = torch.full((x.shape[0],), NEG_INF, dtype=torch.float64)
    for j in range(0, x.shape[1], Bc):
        block = x[:, j:j + Bc]                                           # [R, <=Bc]
        m = torch.maximum(m, block.amax(1))
        m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        l = l + torch.exp(block - m_safe[:, None]).sum(1)
    return l


def _blocks_budget(case):
    """O(R·Bc): a few blocks and the running (m, l); a (m_j, l_j) per block is tolerated (a second pass over
    those is the split-KV merge, not a second pass over x)."""
    x, Bc = case.args
    R, n = x.shape
    return Budget(4 * R * Bc + 4 * R * -(-n // Bc) + 8 * R, f"O(R·Bc) (R = {R}, Bc = {Bc}, n = {n})",
                  hint="that is a whole row (or more) held at once, e.g. a list of a row's values: merge each "
                       "block's (m_j, l_j) from x[:, j:j+Bc] into the running (m, l) as you go, and let the block go")


BLOCKS_MEM = (2, 16384, 64)   # R, n, Bc: one row of Python floats is twice the float64 copy of x allowed


@exercise("blockwise_stats", arg_names=["x", "Bc"], reference="torch.logsumexp", budget=_blocks_budget)
def blockwise_stats(g):
    bugs = [
        Bug("the last, ragged block was dropped: range(0, n, Bc) with x[:, j:j+Bc] covers it",
            _blockwise_ref_dropping_last),
        Bug("each block's l was added as it is: rescale the running l and the block's l to the new max "
            "(that is merge_ml)", _blockwise_no_rescale),
        Bug("the running l was not rescaled when the max grew: the block is summed against the new max, but "
            "the old l was summed against the old one; multiply it by exp(m_old - m_new) first "
            "(merge_ml does both)", _blockwise_old_l_not_rescaled),
    ]
    for case in _block_cases():
        x, Bc = case.args
        out = g.call(case)
        m_got, l_got = g.expect_tuple(out, 2, "(m, l)")
        g.expect_tensor(m_got, "m", shape=(x.shape[0],), dtype=x.dtype)
        g.expect_tensor(l_got, "l", shape=(x.shape[0],), dtype=x.dtype)
        m_ref, l_ref = reference.softmax_stats(x)
        g.compare(m_got, m_ref, "m", hint="m is the row max over all blocks")
        g.compare(l_got, l_ref, "l", rtol=1e-5, bugs=bugs,
                  nan_hint="a block that is all -inf for some row has (-inf, 0): computing its l as "
                           "exp(x - max) gives exp(-inf - -inf) = NaN; use a safe max (0 where the max is -inf)")
        g.count()
    _blocks_only(g)
    R, n, Bc = BLOCKS_MEM
    g.check_memory(Case(f"O(R·Bc) memory (metered): R = {R}, n = {n}, Bc = {Bc}",
                        torch.randn(R, n, generator=_gen(8)), Bc))


def _blocks_only(g):
    """The idea: one pass over x, a block at a time; nothing read or made wider than [R, Bc]."""
    R, n, Bc = 4, 48, 8
    x = torch.randn(R, n, generator=_gen(5))
    r = g.measure(Case("blocks only (metered)", x, Bc))
    if r.largest.numel > R * Bc:
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}); "
               f"with Bc = {Bc} nothing wider than [R, Bc] = [{R}, {Bc}] is needed",
               hint="compute each block's (m, l) from x[:, j:j+Bc] alone and merge: a kernel never holds "
                    "the whole row")
    widest = max(r.read_sizes.get("x", [0]))
    if widest > R * Bc:
        g.fail(f"one operation read {widest} elements of x{_via(r)}; with Bc = {Bc} a block is [R, Bc] = "
               f"[{R}, {Bc}] = {R * Bc} elements (ops seen: {', '.join(sorted(r.ops))})",
               hint="that is the whole row at once (e.g. x.amax(1) or torch.logsumexp(x, 1)): a kernel never holds "
                    "the row. Compute each block's (m_j, l_j) from x[:, j:j+Bc] alone and merge it into (m, l)")
    passes = r.passes("x")
    if passes > 1:
        g.fail(f"your function read every block of x {passes} times{_via(r)}: {passes} passes over x",
               hint="that is the 2-pass version (the max over all blocks first, then the sums against it): "
                    "merge each block's (m_j, l_j) into the running (m, l) as you go (merge_ml rescales both "
                    "to the new max), so each block is read once")


# ------------------------------------------------------------------ lse_from_stats
def _lse_cases():
    rng = _gen(6)
    t = torch.tensor
    return [
        Case("random", torch.randn(16, generator=rng), torch.rand(16, generator=rng) * 10 + 1),
        Case("l = 1 (one dominant element)", t([0.0, 3.0, -2.0]), t([1.0, 1.0, 1.0])),
        Case("empty rows (-inf, 0)", t([NEG_INF, 2.0, NEG_INF]), t([0.0, 3.0, 0.0])),
        Case("large m (exp(m) overflows)", t([1e4, 5e3, -1e4]), t([2.0, 7.0, 1.5])),
    ]


@exercise("lse_from_stats", arg_names=["m", "l"], reference="torch.logsumexp")
def lse_from_stats(g):
    bugs = [
        Bug("that is the row max m, not the LSE: lse = m + log(l)", lambda c: c.args[0]),
        Bug("that is m + log2(l): the course's lse is the natural log, lse = m + torch.log(l) "
            "(m is already in natural-log units: it is a max of the x_i)",
            lambda c: c.args[0].double() + torch.log2(c.args[1].double())),
        Bug("that is log2 of the sum: the course's lse is the natural log, m + ln(l)",
            lambda c: (c.args[0].double() + torch.log(c.args[1].double())) / math.log(2)),
        Bug("that is log(l) alone: add m back, lse = m + log(l)", lambda c: torch.log(c.args[1].double())),
        Bug("that is m + l: the LSE adds the log of l, lse = m + log(l)",
            lambda c: c.args[0].double() + c.args[1].double()),
    ]
    for case in _lse_cases():
        out = g.call(case)
        lse = g.expect_tensor(out, "lse", shape=case.args[0].shape, dtype=case.args[0].dtype)
        large = "large" in case.name
        g.compare(lse, reference.lse_from_stats(*case.args), "lse", rtol=1e-6, bugs=bugs,
                  hint="log(exp(m) * l) overflows for large m: use m + log(l)" if large else
                       "lse = m + log(l), natural log, elementwise")
        g.count()
