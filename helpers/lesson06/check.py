"""Checkers of lesson 06, Flash-Decoding: the LSE combine, split-KV decode with GQA, a paged cache.

References: ``helpers.reference.attention`` (SDPA and ``torch.logsumexp`` in float64) on the
whole cache; the combine's synthetic cases through ``torch.logsumexp`` in float64.
Layouts: q ``[H, d]`` (one token per query head), k and v ``[Hkv, Nk, d]``, query head h
reads KV head ``h // (H // Hkv)``; the paged pools are ``[num_pages, page_size, Hkv, d]``.
"""
from __future__ import annotations

import math

import torch

from .. import reference
from ..checking import Bug, Case, exercise
from ..lesson06 import make_paged_cache, split_bounds
from ..cases import NEG_INF, check_o_lse, gen

_gen = gen


# ------------------------------------------------------------------ shared models
def _ref_decode(q, k, v, kv_of=None):
    """(O [H, d], lse [H]) in float64: query head h against KV head kv_of(h) (grouped by default)."""
    H, d = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    heads = [kv_of(h, H, Hkv) if kv_of else h // G for h in range(H)]
    kk, vv = k[heads], v[heads]                                   # [H, Nk, d]
    o, lse = reference.attention(q[:, None, :], kk, vv)         # [H, 1, d], [H, 1]
    return o[:, 0], lse[:, 0]


def _round_robin(h, H, Hkv):
    return h % Hkv


def _partials64(q, k, v, bounds):
    """Per-split (O_s, lse_s) in float64 with the grouped head map: [S, H, d], [S, H]."""
    H, d = q.shape
    o_parts = torch.zeros(len(bounds), H, d, dtype=torch.float64)
    lse_parts = torch.full((len(bounds), H), NEG_INF, dtype=torch.float64)
    for s, (a, b) in enumerate(bounds):
        if b > a:
            o_parts[s], lse_parts[s] = _ref_decode(q, k[:, a:b], v[:, a:b])
    return o_parts, lse_parts


def _combine64(o_parts, lse_parts):
    o_parts, lse_parts = o_parts.double(), lse_parts.double()
    lse = torch.logsumexp(lse_parts, dim=0)                       # [H]
    w = torch.where(torch.isneginf(lse_parts), torch.zeros_like(lse_parts),
                    torch.exp(lse_parts - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)))
    return (w[:, :, None] * o_parts).sum(0), lse


# ------------------------------------------------------------------ combine_splits
def _split_case(name, H, Nk, d, S, seed, scale=1.0, note=""):
    """Partials of real attention over S splits of a cache (default dtype), so the answer is attention."""
    rng = _gen(seed)
    q = torch.randn(H, d, generator=rng) * scale
    k, v = torch.randn(H, Nk, d, generator=rng), torch.randn(H, Nk, d, generator=rng)
    o64, lse64 = _partials64(q, k, v, split_bounds(Nk, S))
    dt = torch.get_default_dtype()
    c = Case(name, o64.to(dt), lse64.to(dt), note=note)
    c.want = _ref_decode(q, k, v)
    return c


def _combine_cases():
    rng = _gen(11)
    cases = [
        _split_case("4 splits of real attention", H=3, Nk=40, d=8, S=4, seed=1),
        _split_case("1 split (nothing to combine)", H=2, Nk=9, d=4, S=1, seed=2),
        _split_case("16 splits, d=5", H=4, Nk=61, d=5, S=16, seed=3),
        _split_case("more splits than keys (empty splits: lse = -inf, O = 0)", H=2, Nk=3, d=4, S=7, seed=4,
                    note="splits 3..6 hold no key; they must weigh nothing"),
        _split_case("large logits (q scaled by 40: lse in the hundreds)", H=3, Nk=30, d=8, S=5, seed=5, scale=40.0),
    ]
    # synthetic partials: lse far apart, huge, and heads with every split empty
    S, H, d = 5, 6, 7
    o = torch.randn(S, H, d, generator=rng)
    lse = torch.randn(S, H, generator=rng) * 3
    far = lse.clone()
    far[:, 0] = torch.tensor([0.0, 30.0, -30.0, 5.0, 29.0])
    cases.append(Case("lse far apart", o, far))
    holes = lse.clone()
    o_holes = o.clone()
    holes[[0, 2, 3], 1] = NEG_INF
    holes[:, 4] = NEG_INF           # head 4: every split empty
    holes[1:, 5] = NEG_INF          # head 5: only split 0 has keys
    o_holes[:, 4] = 0.0
    o_holes[[0, 2, 3], 1] = 0.0
    o_holes[1:, 5] = 0.0
    cases.append(Case("every split of head 4 is empty", o_holes, holes,
                      note="a head with no keys at all (cache_seqlens = 0): O = 0 and lse = -inf, never NaN"))
    cases.append(Case("huge lse (exp(lse) overflows float32 and float64)", o, lse + 1000.0,
                      note="exp(1000) is inf: weigh by exp(lse_s - lse), never by exp(lse_s)"))
    cases.append(Case("one head, one split", o[:1, :1], lse[:1, :1]))
    return cases


def _combine_bugs():
    def mean(c):
        return c.args[0].double().mean(0)

    def mean_nonempty(c):
        o, lse = c.args
        keep = (~torch.isneginf(lse)).double()                       # [S, H]
        return (o.double() * keep[:, :, None]).sum(0) / keep.sum(0).clamp(min=1)[:, None]

    def unnormalised(c):
        o, lse = (a.double() for a in c.args)
        return (torch.exp(lse - lse.amax(0))[:, :, None] * o).sum(0)

    def by_max(c):
        o, lse = c.args
        return o.double()[lse.argmax(0), torch.arange(lse.shape[1])]

    return [
        Bug("that is a plain mean of the partial outputs: a split's O_s is the average over ITS keys "
            "only, so weigh it by its share of the softmax mass, exp(lse_s - lse)", mean),
        Bug("that is a mean over the non-empty splits: splits hold different amounts of softmax mass; "
            "weigh each O_s by exp(lse_s - lse)", mean_nonempty),
        Bug("the weights exp(lse_s - max_s lse_s) do not sum to 1: divide by their sum "
            "(equivalently, use exp(lse_s - lse) with lse = logsumexp over splits)", unnormalised),
        Bug("that is the O of the split with the largest lse alone: every split contributes, "
            "weighted by exp(lse_s - lse)", by_max),
    ]


def _combine_lse_bugs():
    return [
        Bug("that is max_s lse_s: the total lse is the log of the SUM of the splits' masses, "
            "lse = logsumexp_s(lse_s)", lambda c: c.args[1].double().amax(0)),
        Bug("that is the sum of the lse_s: masses add, so their logs combine by logsumexp, not by +",
            lambda c: c.args[1].double().sum(0)),
        Bug("that is the mean of the lse_s: lse = logsumexp over the splits", lambda c: c.args[1].double().mean(0)),
        Bug("exp(lse_s) overflowed to inf: subtract the largest lse_s before exp, "
            "lse = m + log(sum_s exp(lse_s - m))",
            lambda c: torch.log(torch.exp(c.args[1].float()).sum(0))),
    ]


def _combine_nan_hint(case):
    if "empty" in case.name:
        return ("NaN for a head whose every split is empty: its lse is -inf and exp(lse_s - lse) = "
                "exp(-inf - (-inf)) = NaN. Use a safe max (0 where it is -inf) so the weights are 0, "
                "O = 0 and lse = -inf")
    if "huge" in case.name:
        return "exp(lse_s) overflowed to inf (inf / inf = NaN): subtract the largest lse_s before exp"
    return ""


@exercise("combine_splits", arg_names=["o_parts", "lse_parts"], reference="attention over the whole cache "
          "(float64 SDPA) / torch.logsumexp")
def combine_splits(g):
    bugs, lse_bugs = _combine_bugs(), _combine_lse_bugs()
    for case in _combine_cases():
        o_parts, lse_parts = case.args
        out = g.call(case)
        # float32 holds lse ~ 1000 to ~6e-5, so exp(lse_s - lse) carries that relative error
        rtol = 5e-4 if "huge" in case.name else 1e-4
        check_o_lse(g, out, getattr(case, "want", None) or _combine64(o_parts, lse_parts), dtype=o_parts.dtype,
                    o_tol=(rtol, 1e-5), lse_tol=(1e-5, 1e-5), o_bugs=bugs, lse_bugs=lse_bugs,
                    nan_hint=_combine_nan_hint(case), lse_first=True,
                    o_hint="O = sum_s exp(lse_s - lse) * O_s",
                    lse_hint="lse = m + log(sum_s exp(lse_s - m)) with m = max_s lse_s")
        g.count()


# ------------------------------------------------------------------ flash_decode
def _decode_case(name, H, Hkv, Nk, d, S, seed, scale=1.0, note=""):
    rng = _gen(seed)
    q = torch.randn(H, d, generator=rng) * scale
    k, v = torch.randn(Hkv, Nk, d, generator=rng), torch.randn(Hkv, Nk, d, generator=rng)
    return Case(name, q, k, v, num_splits=S, note=note)


def _decode_cases():
    return [
        _decode_case("GQA: H=4 query heads on Hkv=2 KV heads, 4 splits", 4, 2, 37, 8, 4, 21),
        _decode_case("MHA (Hkv = H)", 3, 3, 20, 8, 3, 22),
        _decode_case("MQA (Hkv = 1), d=5", 6, 1, 29, 5, 4, 23),
        _decode_case("GQA, groups of 4: H=8, Hkv=2", 8, 2, 45, 8, 5, 24),
        _decode_case("1 split", 4, 2, 17, 8, 1, 25),
        _decode_case("Nk not a multiple of num_splits (Nk=10, 4 splits)", 4, 2, 10, 8, 4, 26,
                     note="with chunk = ceil(10/4) = 3 the splits hold 3, 3, 3, 1 keys"),
        _decode_case("more splits than keys (Nk=3, num_splits=8)", 4, 2, 3, 8, 8, 27,
                     note="5 splits hold no key: each gives O_s = 0, lse_s = -inf, and no error"),
        _decode_case("more splits than keys (one key in the cache)", 2, 1, 1, 4, 4, 28,
                     note="the first decode step after a one-token prompt"),
        _decode_case("large logits (q scaled by 30)", 4, 2, 33, 8, 3, 29, scale=30.0),
        _decode_case("long cache, 16 splits", 6, 3, 70, 6, 16, 30),
    ]


def _decode_bugs():
    def round_robin(c):
        return _ref_decode(*c.args, kv_of=_round_robin)

    def mean_combine(c):
        q, k, v = c.args
        o, _ = _partials64(q, k, v, split_bounds(k.shape[1], c.kwargs["num_splits"]))
        return o.mean(0)

    def dropped_tail(c):
        q, k, v = c.args
        S = c.kwargs["num_splits"]
        n = (k.shape[1] // S) * S
        if n in (0, k.shape[1]):
            raise ValueError("no tail")
        return _ref_decode(q, k[:, :n], v[:, :n])

    def no_scale(c):
        q, k, v = c.args
        return _ref_decode(q * math.sqrt(q.shape[1]), k, v)

    def first(i):
        return lambda f: (lambda c: f(c)[i])

    return [
        Bug("query heads were mapped to KV heads round-robin (h % Hkv): GQA groups are contiguous, "
            "query head h reads KV head h // (H // Hkv)", first(0)(round_robin)),
        Bug("the splits were averaged: weigh each split's O_s by exp(lse_s - lse) (combine_splits)", mean_combine),
        Bug("the last Nk % num_splits keys were dropped: with chunk = Nk // num_splits the tail is "
            "lost; use chunk = ceil(Nk / num_splits) and clip the last split at Nk", first(0)(dropped_tail)),
        Bug("the scores were not scaled: S = q k^T / sqrt(d)", first(0)(no_scale)),
    ], [
        Bug("lse: query heads were mapped round-robin (h % Hkv): query head h reads KV head h // (H // Hkv)",
            first(1)(round_robin)),
        Bug("lse: the last Nk % num_splits keys were dropped: use chunk = ceil(Nk / num_splits)",
            first(1)(dropped_tail)),
        Bug("lse: the scores were not scaled by 1/sqrt(d)", first(1)(no_scale)),
    ]


_EMPTY_SPLIT_NAN = ("NaN: a split with no keys (more splits than keys) must give O_s = 0 and lse_s = -inf; "
                    "skip it (or give it those values) instead of taking the max and the softmax of nothing")
_EMPTY_SPLIT_ERROR = ("with more splits than keys (or pages) some splits hold nothing: guard them (`if start >= end: "
                      "continue`, leaving O_s = 0 and lse_s = -inf, which combine_splits weighs 0) instead of "
                      "taking the max and the softmax of an empty slice")


def _error_hint(case):
    return _EMPTY_SPLIT_ERROR if "more splits than" in case.name else ""


@exercise("flash_decode", arg_names=["q", "k", "v"], reference="float64 SDPA over the whole cache")
def flash_decode(g):
    o_bugs, lse_bugs = _decode_bugs()
    for case in _decode_cases():
        q, k, v = case.args
        out = g.call(case, error_hint=_error_hint(case))
        check_o_lse(g, out, _ref_decode(q, k, v), dtype=q.dtype, o_tol=(1e-4, 1e-5), lse_tol=(1e-5, 1e-5),
                    o_bugs=o_bugs, lse_bugs=lse_bugs, nan_hint=_EMPTY_SPLIT_NAN,
                    o_hint="each split: softmax(q k_s^T * qk_scale) v_s with its lse_s; then combine_splits",
                    lse_hint="lse = logsumexp over all keys of q k^T * qk_scale (natural log)")
        g.count()
    _decode_idea(g)


def _decode_idea(g):
    """Split the cache (no score row over all of it) and read each KV head once per group."""
    H, Hkv, Nk, d, S = 4, 1, 96, 4, 8
    gen = _gen(31)
    q, k, v = torch.randn(H, d, generator=gen), torch.randn(Hkv, Nk, d, generator=gen),\
        torch.randn(Hkv, Nk, d, generator=gen)
    r = g.measure(Case(f"metered: H={H} query heads on one KV head, Nk={Nk}, num_splits={S}", q, k, v,
                       num_splits=S), names=["q", "k", "v"])
    chunk = Nk // S
    escaped = r.escapes.get("tolist", 0) + r.escapes.get("numpy", 0) + r.escapes.get("__array__", 0)
    if escaped and r.total_flops < H * Nk * d:
        g.fail(f"your function took its inputs out of torch (.tolist() or .numpy(), {escaped} time(s)) and did "
               f"{r.total_flops:,} FLOPs in tensor ops; the {H} heads against {Nk} keys are {4 * H * Nk * d:,}",
               hint="the math ran in Python numbers, one at a time: Flash-Decoding is a kernel's work on tiles. "
                    "Keep q, k, v as tensors and compute each split with tensor ops, S = q_g @ k[g, a:b].T * "
                    "qk_scale ([G, chunk]), its softmax and lse, then P @ v[g, a:b]")
    if r.largest.numel >= H * Nk:
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}); "
               f"with {S} splits of {chunk} keys nothing as large as [H, Nk] = [{H}, {Nk}] is needed",
               hint="a score row over the whole cache, or K copied once per query head "
                    "(repeat_interleave), is one big work unit per head: the point of Flash-Decoding is "
                    "that each split is its own small block, [G, chunk] scores at most")
    widest = max((hi - lo for lo, hi in r.read_ranges.get("k", [])), default=0)
    if widest > chunk * d:
        g.fail(f"one op read {widest // d} keys of k at once; a split holds {chunk}",
               hint="that is the whole cache in one go: one work unit per head, which leaves most SMs idle "
                    "in decode. Slice k[g, start:end] for each split and combine the partials")
    k_bytes = k.numel() * k.element_size()
    got = r.reads.get("k", 0)
    if got > k_bytes:
        g.fail(f"your function read {got / k_bytes:.1f} x the bytes of k (k is read {got} bytes, holds {k_bytes})",
               hint=f"the {H} query heads of a GQA group share their KV head: take the group's queries "
                    "together, q[g*G:(g+1)*G] ([G, d]), against one K slice, so each K and V byte is read "
                    "once per split, not G times; that is the memory GQA saves")


# ------------------------------------------------------------------ flash_decode_paged
def _paged_case(name, H, Hkv, Nk, d, page_size, S, seed, scale=1.0, extra_pages=3, pad_table=0, note=""):
    rng = _gen(seed)
    q = torch.randn(H, d, generator=rng) * scale
    k, v = torch.randn(Hkv, Nk, d, generator=rng), torch.randn(Hkv, Nk, d, generator=rng)
    k_pages, v_pages, table, seqlen = make_paged_cache(k, v, page_size, extra_pages=extra_pages + pad_table,
                                                       seed=seed)
    if pad_table:  # the library's table is [B, max_pages]: entries past the sequence's pages are junk
        unused = [p for p in range(k_pages.shape[0]) if p not in set(table.tolist())][:pad_table]
        table = torch.cat([table, torch.tensor(unused, dtype=torch.int32)])
    c = Case(name, q, k_pages, v_pages, table, seqlen, num_splits=S, note=note)
    c.contiguous = (k, v)
    return c


def _paged_cases():
    return [
        _paged_case("GQA, 10 pages of 4, last page 1/4 full", 4, 2, 37, 8, 4, 3, 41,
                    note="unused slots and unused pages hold junk (50.0): read only seqlen tokens"),
        _paged_case("seqlen a multiple of the page size", 4, 2, 32, 8, 8, 2, 42),
        _paged_case("one page, 3 of 8 slots used; more splits than pages", 2, 1, 3, 4, 8, 4, 43),
        _paged_case("page_size 1", 4, 4, 9, 8, 1, 3, 44),
        _paged_case("block_table longer than the sequence (junk entries past seqlen)", 6, 2, 21, 5, 4, 2, 45,
                    pad_table=3, note="like the library's [batch, max_pages] table: use seqlen, not len(block_table)"),
        _paged_case("large logits (q scaled by 30)", 4, 2, 26, 8, 4, 3, 46, scale=30.0),
        _paged_case("MQA, 8 splits", 8, 1, 50, 8, 4, 8, 47),
    ]


def _paged_bugs():
    def pages_as_stored(c, table_of):
        q, k_pages, v_pages, table, seqlen = c.args
        P, ps = k_pages.shape[:2]
        n = -(-seqlen // ps)
        idx = table_of(table, n, P)
        k = k_pages[idx].reshape(n * ps, *k_pages.shape[2:])[:seqlen].transpose(0, 1)  # [Hkv, seqlen, d]
        v = v_pages[idx].reshape(n * ps, *v_pages.shape[2:])[:seqlen].transpose(0, 1)
        return _ref_decode(q, k, v)

    def identity(c):
        return pages_as_stored(c, lambda t, n, P: torch.arange(n))

    def whole_last_page(c):
        q, k_pages, v_pages, table, seqlen = c.args
        ps = k_pages.shape[1]
        n = -(-seqlen // ps)
        if n * ps == seqlen:
            raise ValueError("no partial page")
        k = k_pages[table[:n].long()].reshape(n * ps, *k_pages.shape[2:]).transpose(0, 1)
        v = v_pages[table[:n].long()].reshape(n * ps, *v_pages.shape[2:]).transpose(0, 1)
        return _ref_decode(q, k, v)

    def round_robin(c):
        k, v = c.contiguous
        return _ref_decode(c.args[0], k, v, kv_of=_round_robin)

    def first(f, i):
        return lambda c: f(c)[i]

    o = [Bug("the pages were read in the order they are stored (physical page p for logical page p): "
             "look each logical page up in the table, k_pages[block_table[p]]", first(identity, 0)),
         Bug("the whole last page was read, its unused slots too: only seqlen - p*page_size tokens of "
             "the last page are real", first(whole_last_page, 0)),
         Bug("query heads were mapped to KV heads round-robin (h % Hkv): query head h reads KV head "
             "h // (H // Hkv)", first(round_robin, 0))]
    lse = [Bug("lse: the pages were read in storage order; use k_pages[block_table[p]]", first(identity, 1)),
           Bug("lse: the unused slots of the last page were read; stop at seqlen", first(whole_last_page, 1)),
           Bug("lse: query heads were mapped round-robin; use h // (H // Hkv)", first(round_robin, 1))]
    return o, lse


@exercise("flash_decode_paged", arg_names=["q", "k_pages", "v_pages", "block_table", "seqlen"],
          reference="float64 SDPA over the contiguous cache")
def flash_decode_paged(g):
    o_bugs, lse_bugs = _paged_bugs()
    for case in _paged_cases():
        q = case.args[0]
        out = g.call(case, error_hint=_error_hint(case))
        check_o_lse(g, out, _ref_decode(q, *case.contiguous), dtype=q.dtype, o_tol=(1e-4, 1e-5),
                    lse_tol=(1e-5, 1e-5), o_bugs=o_bugs, lse_bugs=lse_bugs, nan_hint=_EMPTY_SPLIT_NAN,
                    o_hint="the same answer as flash_decode on the contiguous cache: logical page p of the "
                           "sequence is physical page block_table[p]",
                    lse_hint="lse over the seqlen real tokens")
        g.count()
    _paged_idea(g)


def _paged_idea(g):
    """Read the pages where they lie, a split of whole pages at a time: no contiguous copy of the whole
    sequence's cache, and no read that starts inside a page (a split boundary inside a page)."""
    H, Hkv, Nk, d, ps, S = 4, 2, 62, 4, 4, 5
    case = _paged_case(f"metered: seqlen={Nk} in pages of {ps}, num_splits={S}", H, Hkv, Nk, d, ps, S, 48,
                       note=f"{-(-Nk // ps)} pages: {-(-Nk // ps) // S + 1} whole pages per split; "
                            f"a split over tokens would hold {-(-Nk // S)} tokens, straddling pages")
    r = g.measure(case, names=["q", "k_pages", "v_pages", "block_table"])
    if r.largest.numel >= Hkv * Nk * d:
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}), "
               f"as large as the whole sequence's K ({Hkv} x {Nk} x {d})",
               hint="that is a contiguous copy of the cache: exactly what paging exists to avoid (the copy "
                    "costs a full extra read and write per step). Read the pages of one split at a time "
                    "through block_table")
    k_pages, table = case.args[1], case.args[3]
    n_pages = -(-Nk // ps)
    logical = {int(p): i for i, p in enumerate(table[:n_pages].tolist())}
    per_token = Hkv * d
    for name in ("k_pages", "v_pages"):
        for elems in r.read_elements.get(name, []):
            token = elems // per_token                                   # page * page_size + slot
            page, slot = token // ps, token % ps
            first = torch.full((k_pages.shape[0],), ps, dtype=torch.int64).scatter_reduce(0, page, slot, "amin")
            inside = (first > 0) & (first < ps)
            if inside.any():
                p = int(inside.nonzero()[0])
                lp = logical.get(p)
                where = f"logical page {lp}, tokens {lp * ps}..{lp * ps + ps - 1}" if lp is not None else "not in the table"
                g.fail(f"one read of {name} started at slot {int(first[p])} of page {p} ({where}): inside a page; "
                       f"with {n_pages} pages and num_splits = {S}, a split covers whole pages",
                       hint="that is a split over tokens (ceil(seqlen / num_splits) tokens per split, so a split "
                            "boundary falls inside a page) or a page read token by token. Split over pages: "
                            "ceil(n_pages / num_splits) pages per split, and read each page's real tokens in one "
                            "slice, k_pages[block_table[p], :n]: a GPU split walks whole blocks of the table")
