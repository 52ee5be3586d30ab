"""Checkers of lesson 12, masks and score modifications as block sparsity: ``build_block_mask``,
``flash_attn_block_sparse`` and ``softcap_grad``.

References: ``torch.nn.attention.flex_attention.create_block_mask`` on the CPU (the block mask, index for
index), ``helpers.lesson12.attention_mods_ref`` (the modification applied densely in float64, then the
mask, then softmax; checked against FlexAttention's own eager path in tests/test_lesson12.py) and
``torch.autograd`` in float64 (softcap's gradient). The tile loop's work is counted: the meter's matmul
FLOPs must be those of the listed tiles, and a counting ``mask_mod`` sees on which (query, key) pairs the
mask was evaluated (a full tile needs none).
"""
from __future__ import annotations

import math

import torch

from ..checking import Bug, Case, exercise
from ..lesson12 import (FULL, PARTIAL, SKIP, MaskMod, ScoreMod, alibi, alibi_slopes, attention_mods_ref,
                        build_block_mask_ref, causal, dense_mask, document, flex_block_mask, no_mask, prefix_lm,
                        relative_bias, sliding_window, softcap)
from ..cases import visible_tile_flops, check_o_lse, gen, qkv, saw_no_flops

NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


# ------------------------------------------------------------------ build_block_mask: the cases
def _doc(lengths, is_causal=False):
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return document(ids, is_causal), len(ids)


def _bm_cases():
    rng = gen(1201)
    lengths = [int(x) for x in torch.randint(1, 9, (8,), generator=rng)] + [1]
    rand_doc, n_rand = _doc(lengths, is_causal=True)
    doc, n_doc = _doc([1, 2, 4, 1, 5, 1])
    ones, n_ones = _doc([1] * 9)
    return [
        Case("causal, N = Nk = 12, 4 x 4 blocks (the walk-through)", causal(12, 12), 12, 12, 4, 4),
        Case("causal, N = 11, Nk = 13, 4 x 3 blocks: ragged last blocks both ways", causal(11, 13), 11, 13, 4, 3,
             note="the padding of a ragged block counts as masked: that tile is never full"),
        Case("causal bottom-right with N > Nk: the first rows see nothing", causal(13, 7), 13, 7, 4, 3),
        Case("sliding window (3, 0), causal, N = Nk = 17", sliding_window(17, 17, (3, 0), True), 17, 17, 4, 4),
        Case("sliding window (2, 1), not causal, N = 9, Nk = 20 (bottom-right offset Nk - N)",
             sliding_window(9, 20, (2, 1)), 9, 20, 4, 3),
        Case("sliding window (2, 0) with N > Nk: rows that see nothing", sliding_window(20, 9, (2, 0)), 20, 9, 4, 3),
        Case("a window wider than the sequence (50, 50)", sliding_window(10, 10, (50, 50)), 10, 10, 4, 3),
        Case("window (0, 0): each query sees one key", sliding_window(10, 10, (0, 0)), 10, 10, 4, 3),
        Case("sliding window (1, 1) with 2 x 8 blocks: the band crosses a tile between its corners",
             sliding_window(16, 16, (1, 1)), 16, 16, 2, 8,
             note="all four corners of the tile (rows 4-5, keys 0-7) are masked, yet keys 3-6 are visible"),
        Case("document mask, lengths 1, 2, 4, 1, 5, 1", doc, n_doc, n_doc, 4, 3),
        Case("nine documents of length 1", ones, n_ones, n_ones, 4, 4),
        Case(f"causal document mask, random lengths {lengths}", rand_doc, n_rand, n_rand, 8, 4),
        Case("prefix-LM, prefix 5, N = Nk = 15", prefix_lm(5), 15, 15, 4, 4),
        Case("no mask, N = 7, Nk = 10 (only the ragged tiles are partial)", no_mask(), 7, 10, 4, 4),
        Case("blocks larger than the input", causal(3, 5), 3, 5, 8, 8),
        Case("N = 1 (decoding) with a window (4, 0)", sliding_window(1, 13, (4, 0), True), 1, 13, 4, 3),
    ]


# ------------------------------------------------------------------ build_block_mask: the bug models
def _classify_with(case, *, full_as_partial=False, partial_skipped=False, partial_as_full=False,
                   clip_full=False, one_more=False, corners=False, swap=False):
    """int [Tq, Tk] tile classes under one planted mistake (the defaults are right)."""
    mm, N, Nk, BM, BN = case.args
    Tq, Tk = math.ceil(N / BM), math.ceil(Nk / BN)
    cls = torch.zeros(Tq, Tk, dtype=torch.int64)
    extra = 1 if one_more else 0
    for a in range(Tq):
        qi = torch.arange(a * BM, min((a + 1) * BM + extra, N))[:, None]
        for c in range(Tk):
            kj = torch.arange(c * BN, min((c + 1) * BN + extra, Nk))[None, :]
            keep = torch.as_tensor(mm(0, 0, kj.T, qi.T) if swap else mm(0, 0, qi, kj))
            keep = (keep.T if swap else keep).expand(qi.shape[0], kj.shape[1])
            n, whole = int(keep.sum()), keep.numel() if clip_full else BM * BN
            if corners:                                   # the four corners decide (a ragged tile stays partial)
                ragged = keep.numel() < BM * BN
                keep = keep[[0, -1]][:, [0, -1]]
                n, whole = int(keep.sum()), (-1 if ragged else 4)
            k = SKIP if n == 0 else FULL if n == whole else PARTIAL
            if k == FULL and full_as_partial:
                k = PARTIAL
            elif k == PARTIAL and partial_skipped:
                k = SKIP
            elif k == PARTIAL and partial_as_full:
                k = FULL
            cls[a, c] = k
    return cls.double()


def _bm_bugs():
    def model(**kw):
        return lambda case: _classify_with(case, **kw)
    return [
        Bug("a full tile was listed as partial: a tile whose every (query, key) pair is visible goes to "
            "full_kv_indices (FlexAttention then runs it with no mask); kv_indices holds only the tiles the "
            "mask cuts", model(full_as_partial=True)),
        Bug("a partial tile was skipped: a tile with at least one visible pair must be visited (in "
            "kv_indices); only a tile with no visible pair is left out", model(partial_skipped=True)),
        Bug("a partial tile was listed as full: 'some pair visible' is not 'every pair visible'; a full tile "
            "must have all BLOCK_M x BLOCK_N pairs visible", model(partial_as_full=True)),
        Bug("the ragged last block: create_block_mask pads the mask with False to a multiple of the block "
            "(_convert_mask_to_block_mask), so a ragged tile's padding counts as masked and it is never full; "
            "you compared the visible count with the clipped tile's size", model(clip_full=True)),
        Bug("an off-by-one on the tile's bounds: the tile of Q block a is rows a*BLOCK_M .. (a+1)*BLOCK_M - 1 "
            "(Python's q_idx = arange(a*BLOCK_M, min((a+1)*BLOCK_M, N)), end excluded); you took one row and key "
            "more", model(one_more=True)),
        Bug("the tile was classified from its corners: lesson 04's two-corner test holds for causal masks only; "
            "a general mask_mod must be evaluated on every (query, key) pair of the tile (here a window's band "
            "crosses a tile between its corners)", model(corners=True)),
        Bug("mask_mod's arguments are (b, h, q_idx, kv_idx): the query index comes before the key index; you "
            "swapped them", model(swap=True)),
    ]


def _expect_index_tensor(g, t, what, shape):
    if isinstance(t, torch.Tensor) and t.dim() == len(shape) + 2 and tuple(t.shape[2:]) == tuple(shape):
        g.fail(f"`{what}` has shape {list(t.shape)}, expected {list(shape)}: this exercise is for one head",
               hint="create_block_mask's tensors are [B, H, ...]; return the one head's, [Tq] and [Tq, Tk] "
                    "(e.g. bm.kv_num_blocks[0, 0])")
    g.expect_tensor(t, what, shape=shape)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        g.fail(f"`{what}` has dtype {t.dtype}, expected an integer dtype (create_block_mask gives torch.int32)",
               hint="block counts and indices are integers: build them with dtype=torch.int32 "
                    "(or .to(torch.int32) at the end)")


def _listed(g, num, idx, what, Tk):
    """Each row's listed blocks, validated: 0 <= num <= Tk, indices in range, no block twice."""
    rows = []
    for a in range(num.shape[0]):
        n = int(num[a])
        if not 0 <= n <= Tk:
            g.fail(f"`{NAMES[0] if what == 'partial' else NAMES[2]}[{a}]` is {n}: a count of KV blocks must be "
                   f"between 0 and {Tk}", hint="the count is how many blocks the row lists, not an index")
        row = [int(x) for x in idx[a, :n]]
        bad = [x for x in row if not 0 <= x < Tk]
        if bad:
            g.fail(f"row {a} of the {what} list names KV block {bad[0]}, outside 0 .. {Tk - 1}",
                   hint=f"KV block indices count blocks, not keys: block c holds keys c*BLOCK_N .. "
                        f"(c+1)*BLOCK_N - 1, and there are ceil(Nk / BLOCK_N) = {Tk} of them")
        if len(set(row)) != len(row):
            g.fail(f"row {a} of the {what} list names a KV block twice: {row}",
                   hint="each tile is listed once: the kernel would visit it twice and count its keys twice")
        rows.append(row)
    return rows


def _check_block_mask(g, case, out):
    mm, N, Nk, BM, BN = case.args
    Tq, Tk = math.ceil(N / BM), math.ceil(Nk / BN)
    got = g.expect_tuple(out, 4, "(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)")
    for t, what in zip(got, NAMES):
        _expect_index_tensor(g, t, what, (Tq,) if "num" in what else (Tq, Tk))
    ref = flex_block_mask(mm, N, Nk, BM, BN)
    partial = _listed(g, got[0], got[1], "partial", Tk)
    full = _listed(g, got[2], got[3], "full", Tk)
    for a, (p, f) in enumerate(zip(partial, full)):
        both = sorted(set(p) & set(f))
        if both:
            g.fail(f"row {a} lists KV block {both[0]} both as partial (kv_indices) and as full (full_kv_indices)",
                   hint="the two lists are disjoint: FlexAttention visits kv_indices (with the mask) and then "
                        "full_kv_indices (without), so a tile in both is computed twice; kv_num_blocks counts "
                        "the partial tiles only, not every visited tile")
    cls = torch.full((Tq, Tk), float(SKIP), dtype=torch.float64)
    for a in range(Tq):
        cls[a, full[a]] = float(FULL)
        cls[a, partial[a]] = float(PARTIAL)
    ref_cls = torch.full((Tq, Tk), float(SKIP), dtype=torch.float64)
    for a in range(Tq):
        ref_cls[a, ref[3][a, :int(ref[2][a])].long()] = float(FULL)
        ref_cls[a, ref[1][a, :int(ref[0][a])].long()] = float(PARTIAL)
    g.compare(cls, ref_cls, "the tile classes listed (0 skip, 1 full, 2 partial) at (Q block, KV block)",
              rtol=0, atol=0, bugs=_bm_bugs(),
              hint="evaluate mask_mod(0, 0, q_idx, kv_idx) on every pair of the tile (q_idx [BLOCK_M, 1], kv_idx "
                   "[1, BLOCK_N], clipped to N and Nk): none visible -> skip, all BLOCK_M x BLOCK_N visible -> full, "
                   "else partial")
    # the same tiles: now the order, which create_block_mask defines (a stable argsort: ascending)
    for a in range(Tq):
        for what, rows, num, idx in (("kv_indices", partial, ref[0], ref[1]), ("full_kv_indices", full, ref[2], ref[3])):
            want = [int(x) for x in idx[a, :int(num[a])]]
            if rows[a] != want:
                g.fail(f"row {a} of `{what}` lists {rows[a]}, expected {want}: the same blocks in another order",
                       hint="list each row's KV blocks in ascending order, as create_block_mask does (its stable "
                            "argsort): the kernel walks K and V front to back")
    g.count()


@exercise("build_block_mask", arg_names=["mask_mod", "N", "Nk", "BLOCK_M", "BLOCK_N"],
          reference="torch's create_block_mask (CPU), index for index")
def build_block_mask(g):
    for case in _bm_cases():
        out = g.call(case, error_hint="evaluate mask_mod on indices inside the sequence only (clip the ragged last "
                                      "block to N and Nk: a document mask indexes its ids with them); call it "
                                      "as mask_mod(0, 0, q_idx, kv_idx) with integer tensors")
        _check_block_mask(g, case, out)


# ------------------------------------------------------------------ flash_attn_block_sparse
class CountingMask:
    """A mask_mod that counts the (query, key) pairs it is evaluated on (its result's elements)."""

    def __init__(self, inner):
        self.inner, self.pairs = inner, 0

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.inner(b, h, q_idx, kv_idx)
        self.pairs += torch.as_tensor(out).numel() if torch.as_tensor(out).dim() else 1
        return out

    def __repr__(self):
        return repr(self.inner)


def _case(name, N, Nk, d, mm, sm, BM, BN, rng, h=0, qmul=1.0, note=""):
    q, k, v = qkv(N, Nk, d, rng, qmul=qmul)
    bm = build_block_mask_ref(mm, N, Nk, BM, BN)
    return Case(name, q, k, v, bm, mm, sm, BLOCK_M=BM, BLOCK_N=BN, h=h, note=note)


def _bs_cases():
    rng = gen(1202)
    slopes = alibi_slopes(8)
    table = torch.randn(4, 9, generator=rng, dtype=torch.float64)
    doc, n_doc = _doc([1, 3, 1, 6, 2, 1])
    return [
        _case("causal, no score_mod, N = Nk = 10 (ragged blocks)", 10, 10, 4, causal(10, 10), None, 4, 3, rng),
        _case("softcap 1.5, one KV block per row (BLOCK_N >= Nk)", 9, 7, 4, no_mask(), softcap(1.5), 4, 8, rng,
              qmul=6.0, note="with large logits softcap changes every score: where it sits matters"),
        _case("softcap 2 on causal, logits x 8 (tanh saturates)", 11, 13, 8, causal(11, 13), softcap(2.0), 4, 3, rng,
              qmul=8.0),
        _case("ALiBi (head 3 of 8) on a sliding window (4, 0), causal, N = Nk = 17",
              17, 17, 4, sliding_window(17, 17, (4, 0), True), alibi(slopes, 17, 17), 4, 4, rng, h=3),
        _case("ALiBi (head 0) with N < Nk: bottom-right |i + Nk - N - j|", 6, 14, 4, causal(6, 14),
              alibi(slopes, 6, 14), 4, 3, rng),
        _case("sliding window (2, 0) with N > Nk: rows that see nothing, softcap 3", 13, 6, 4,
              sliding_window(13, 6, (2, 0)), softcap(3.0), 4, 3, rng, qmul=4.0,
              note="the first rows see no key: O = 0, lse = -inf, never NaN"),
        _case("a window wider than the sequence (40, 40), ALiBi head 5", 9, 9, 4, sliding_window(9, 9, (40, 40)),
              alibi(slopes, 9, 9), 4, 4, rng, h=5),
        _case("window (0, 0): one key per query, softcap 2", 10, 10, 4, sliding_window(10, 10, (0, 0)),
              softcap(2.0), 4, 3, rng, qmul=5.0),
        _case(f"document mask with length-1 documents, relative bias (head 2)", n_doc, n_doc, 4, doc,
              relative_bias(table, 4), 4, 3, rng, h=2),
        _case("prefix-LM (prefix 6), softcap 4", 15, 15, 8, prefix_lm(6), softcap(4.0), 4, 4, rng, qmul=6.0),
        _case("blocks larger than the input, ALiBi", 3, 5, 4, causal(3, 5), alibi(slopes, 3, 5), 8, 8, rng, h=1),
        _case("random, larger: causal document mask, softcap 5", 37, 37, 8,
              _doc([5, 1, 9, 3, 1, 12, 6], True)[0], softcap(5.0), 8, 4, rng, qmul=5.0),
    ]


def _model(case, bug=None):
    """(O, lse) in float64 of a tile loop over the case's block mask, with one planted mistake (the row's
    scores gathered from the visited tiles, then one softmax: the order of the tiles does not matter)."""
    q, k, v, bm, mm, sm, = case.args
    BM, BN, h = case.kwargs["BLOCK_M"], case.kwargs["BLOCK_N"], case.kwargs["h"]
    sm = sm or (lambda s, b, hh, i, j: s)
    if bug == "no_mod":
        sm = (lambda s, b, hh, i, j: s)
    q, k, v = q.double(), k.double(), v.double()
    N, d = q.shape
    scale = 1.0 / math.sqrt(d)
    hm = 0 if bug == "h0" else h
    kv_num, kv_idx, full_num, full_idx = bm
    O = torch.zeros(N, v.shape[1], dtype=torch.float64)
    lse = torch.full((N,), -math.inf, dtype=torch.float64)
    for a, i0 in enumerate(range(0, N, BM)):
        br = min(BM, N - i0)
        rows = torch.arange(i0, i0 + br)[:, None]
        tiles = [(c, True) for c in kv_idx[a, :int(kv_num[a])].tolist()] + \
                [(c, False) for c in full_idx[a, :int(full_num[a])].tolist()]
        parts, vs, raw = [], [], []
        for c, partial in tiles:
            j0 = c * BN
            cols = torch.arange(j0, min(j0 + BN, k.shape[0]))[None, :]
            qi_, kj_ = (rows - i0, cols - j0) if bug == "local_idx" else (rows, cols)
            if bug == "swap_idx":
                qi_, kj_ = cols, rows
            qk = q[i0:i0 + br] @ k[j0:j0 + BN].T
            S = qk * scale
            keep = torch.as_tensor(mm(0, h, rows, cols)).expand(br, cols.shape[1]) if partial else None
            if bug == "before_scale":
                S = sm(qk, 0, hm, qi_, kj_) * scale
            elif bug == "mask_first" and partial:
                S = sm(S.masked_fill(~keep, -math.inf), 0, hm, qi_, kj_)
            elif bug in ("after_max", "after_max_masked"):
                pass                                  # the mod comes after the max, below
            elif not (bug == "full_unmodded" and not partial):
                S = sm(S, 0, hm, qi_, kj_)
            if partial and bug not in ("no_partial_mask", "mask_first"):
                S = S.masked_fill(~keep, -math.inf)
            parts.append(S)
            vs.append(v[j0:j0 + BN])
            raw.append((qi_, kj_))
        if not parts:
            continue
        S, V = torch.cat(parts, 1), torch.cat(vs, 0)
        if bug in ("after_max", "after_max_masked"):
            if len(parts) != 1:
                raise ValueError("modelled with one KV block per row only")
            m = S.amax(1)
            m = torch.where(torch.isneginf(m), 0.0, m)
            P = torch.exp(sm(S - m[:, None], 0, hm, *raw[0]))
            if bug == "after_max_masked":
                P = torch.where(torch.isneginf(S), 0.0, P)
            l = P.sum(1)
            O[i0:i0 + br] = torch.where(l[:, None] > 0, P @ V / l.clamp_min(1e-300)[:, None], 0.0)
            lse[i0:i0 + br] = torch.where(l > 0, m + torch.log(l), -math.inf)
            continue
        row_lse = torch.logsumexp(S, 1)
        P = torch.where(torch.isneginf(row_lse)[:, None], 0.0, torch.exp(S - row_lse[:, None]))
        O[i0:i0 + br] = P @ V
        lse[i0:i0 + br] = row_lse
    return O, lse


_BS_BUGS = [
    ("full_unmodded", "the score_mod was skipped on the full tiles: only the MASK is for partial tiles; the score "
                      "modification (softcap, ALiBi, a bias) applies to every visited tile"),
    ("after_max", "the score_mod came after the running max was subtracted: softcap(S - m) is not softcap(S) - m "
                  "(tanh is not shift-invariant). Apply it to the scaled score first: S = score_mod(Qi @ Kj.T * "
                  "scale, ...), then take m = max(m, rowmax(S)) and P = exp(S - m)"),
    ("after_max_masked", "the score_mod came after the running max was subtracted: softcap(S - m) is not "
                         "softcap(S) - m. Apply it to the scaled score first, then the max and exp(S - m)"),
    ("before_scale", "the score_mod was applied before the scale: the library and FlexAttention modify the SCALED "
                     "score, S = score_mod(Qi @ Kj.T * scale, ...), i.e. cap * tanh(scale * qk / cap)"),
    ("mask_first", "the mask was applied before the score_mod: softcap turns -inf into -cap, so masked keys came "
                   "back with weight exp(-cap - m). Modify first, then set the masked scores to -inf"),
    ("local_idx", "the score_mod got the tile's own indices: pass the global ones, q_idx = i0 + arange(BLOCK_M) "
                  "and kv_idx = j0 + arange(BLOCK_N) (ALiBi and relative biases depend on i - j)"),
    ("swap_idx", "the score_mod's arguments are (score, b, h, q_idx, kv_idx): the query index before the key index"),
    ("h0", "the score_mod got head 0: pass the function's h argument (ALiBi's slope is per head)"),
    ("no_partial_mask", "a partial tile was run without its mask: mask_mod(0, h, q_idx, kv_idx) decides which of "
                        "its scores become -inf"),
    ("no_mod", "the score_mod was never applied: S = score_mod(Qi @ Kj.T * scale, 0, h, q_idx, kv_idx) on every "
               "visited tile (when score_mod is None, leave S as it is)"),
]


def _bs_bugs(which):
    return [Bug(hint, (lambda c, b=bug: _model(c, b)[which])) for bug, hint in _BS_BUGS]


_NAN = ("NaN: a row that sees no key keeps m = -inf, and exp(S - m) is exp(-inf - (-inf)); exponentiate against a "
        "safe max (0 where m is -inf) and guard l = 0 at the end (lesson 05)")


def _idea_case():
    N = Nk = 48
    rng = gen(1203)
    return _case("the work, metered: sliding window (20, 0), causal, N = Nk = 48, d = 4, 8 x 8 blocks", N, Nk, 4,
                 sliding_window(N, Nk, (20, 0), True), softcap(3.0), 8, 8, rng,
                 note="per Q block: one full tile, three partial ones, the rest skipped")


def _check_work(g):
    case = _idea_case()
    q, k, v, bm, mm, sm = case.args
    BM, BN = case.kwargs["BLOCK_M"], case.kwargs["BLOCK_N"]
    N, d = q.shape
    Nk = k.shape[0]
    counting = CountingMask(mm)
    counted = Case(case.name, q, k, v, bm, counting, sm, **case.kwargs)
    g.call(counted)
    partial_area = int(bm[0].sum()) * BM * BN
    if counting.pairs > partial_area:
        full_area = int(bm[2].sum()) * BM * BN
        g.fail(f"mask_mod was evaluated on {counting.pairs:,} (query, key) pairs; the {int(bm[0].sum())} partial "
               f"tiles hold {partial_area:,} (the {int(bm[2].sum())} full ones {full_area:,} more)",
               hint="apply the mask on the partial tiles (kv_indices) only: a full tile (full_kv_indices) needs no "
                    "mask, and a tile in neither list is not visited. Never build the N x Nk mask")
    r = g.measure(case, names=("q", "k", "v"))
    saw_no_flops(g, r, "which tiles it visits")
    need = visible_tile_flops(dense_mask(mm, N, Nk), BM, BN, d)
    if r.flops > need:
        g.fail(f"your function did {r.flops:,} matmul FLOPs; the tiles the block mask lists need {need:,} "
               f"(every tile: {4 * N * Nk * d:,})",
               hint="visit only the KV blocks in kv_indices[a, :kv_num_blocks[a]] and "
                    "full_kv_indices[a, :full_kv_num_blocks[a]] for Q block a: that is what the block mask is for")
    if r.largest.numel >= N * Nk // 2:
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}), as large as "
               f"the {N} x {Nk} score matrix", hint="one [BLOCK_M, BLOCK_N] tile of scores at a time")


@exercise("flash_attn_block_sparse",
          arg_names=["q", "k", "v", "block_mask", "mask_mod", "score_mod"],
          reference="the float64 dense reference (score_mod, then the mask, then softmax)")
def flash_attn_block_sparse(g):
    bugs_o, bugs_lse = _bs_bugs(0), _bs_bugs(1)
    for case in _bs_cases():
        q, k, v, bm, mm, sm = case.args
        out = g.call(case)
        check_o_lse(g, out, attention_mods_ref(q, k, v, mm, sm, h=case.kwargs["h"]), dtype=q.dtype,
                    o_bugs=bugs_o, lse_bugs=bugs_lse, nan_hint=_NAN,
                    o_hint="per tile: S = score_mod(Qi @ Kj.T * scale, 0, h, q_idx, kv_idx) with global indices; "
                           "on a partial tile then S[~mask_mod(0, h, q_idx, kv_idx)] = -inf; then lesson 03's update",
                    lse_hint="lse = m + log(l) of the MODIFIED scores over the visible keys; -inf when there are none")
        g.count()
    _check_work(g)


# ------------------------------------------------------------------ softcap_grad
def _sc_cases():
    rng = gen(1204)
    s = torch.randn(6, 7, generator=rng) * 20
    return [
        Case("scores of order 1, cap 5", torch.randn(4, 5, generator=rng), torch.randn(4, 5, generator=rng), 5.0),
        Case("scores well past the cap (tanh saturated), cap 2", s, torch.randn(6, 7, generator=rng), 2.0,
             note="where tanh saturates the gradient vanishes: 1 - tanh^2 -> 0"),
        Case("cap 30 (Gemma 2's attention softcap 50 scaled down), scores up to 60",
             torch.linspace(-60, 60, 13), torch.ones(13), 30.0),
        Case("a -inf score (a masked key): its gradient is 0", torch.tensor([[0.5, -math.inf, 2.0]]),
             torch.tensor([[1.0, 1.0, -2.0]]), 4.0),
    ]


def _sc_autograd(s, dT, cap):
    s64 = s.detach().double().requires_grad_()
    T = cap * torch.tanh(s64 / cap)
    T.backward(dT.double())
    return s64.grad


def _sc_bugs():
    def m(f):
        return lambda c: f(c.args[0].double(), c.args[1].double(), c.args[2])
    return [
        Bug("the chain rule stopped at dT: dS = dT * dT/dS, and d(cap * tanh(s / cap))/ds = 1 - tanh(s / cap)^2",
            m(lambda s, dT, cap: dT)),
        Bug("the derivative of tanh is 1 - tanh^2, not 1 - tanh", m(lambda s, dT, cap: dT * (1 - torch.tanh(s / cap)))),
        Bug("the cap cancels: d/ds [cap * tanh(s / cap)] = cap * (1 / cap) * (1 - tanh^2) = 1 - tanh(s / cap)^2, "
            "with no factor cap", m(lambda s, dT, cap: dT * cap * (1 - torch.tanh(s / cap) ** 2))),
        Bug("the cap cancels: d/ds [cap * tanh(s / cap)] = 1 - tanh(s / cap)^2, with no factor 1 / cap",
            m(lambda s, dT, cap: dT / cap * (1 - torch.tanh(s / cap) ** 2))),
        Bug("tanh of the raw score over the cap, tanh(s / cap), not of the capped score: T / cap = tanh(s / cap) "
            "is what you want, tanh(T / cap) is not", m(lambda s, dT, cap: dT * (1 - torch.tanh(torch.tanh(s / cap)) ** 2))),
        Bug("1 - tanh(s / cap)^2, not 1 - T^2: T = cap * tanh(s / cap) is the capped score, divide it by cap first",
            m(lambda s, dT, cap: dT * (1 - (cap * torch.tanh(s / cap)) ** 2))),
    ]


@exercise("softcap_grad", arg_names=["s", "dT", "cap"], reference="torch.autograd (float64)")
def softcap_grad(g):
    for case in _sc_cases():
        s, dT, cap = case.args
        out = g.call(case)
        g.expect_tensor(out, "dS", shape=tuple(s.shape), dtype=s.dtype)
        g.compare(out, _sc_autograd(s, dT, cap), "dS", rtol=1e-5, atol=1e-6, bugs=_sc_bugs(),
                  nan_hint="NaN: at s = -inf, tanh(s / cap) = -1 and 1 - tanh^2 = 0, so dS = 0; a NaN comes from "
                           "computing it another way (exp of inf, inf / inf)",
                  hint="dS = dT * (1 - tanh(s / cap)^2)")
        g.count()


__all__ = ["build_block_mask", "flash_attn_block_sparse", "softcap_grad", "CountingMask", "MaskMod", "ScoreMod"]
