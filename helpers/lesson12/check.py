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

from ..checking import Bug, Case, _hint_for_exception, _where_in_learner_code, exercise
from ..lesson12 import (FULL, PARTIAL, SKIP, MaskMod, ScoreMod, alibi, alibi_slopes, attention_mods_ref,
                        build_block_mask_ref, causal, dense_mask, document, flex_block_mask, no_mask, prefix_lm,
                        relative_bias, sliding_window, softcap)
from ..cases import ATOL, RTOL, visible_tile_flops, gen, qkv, saw_no_flops

NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


# ------------------------------------------------------------------ build_block_mask: the cases
def _doc(lengths, is_causal=False):
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return document(ids, is_causal), len(ids)


# Masks where a row sees several runs of keys: a tile's visible pairs need not touch its border, its first or last
# rows, or lie between a row's first and last visible key. Comparisons only (no .abs()): they take Python ints and
# run under create_block_mask's vmap, as every case's mask_mod must.
def _global_window(G, w):
    return MaskMod(lambda b, h, q, k: (q < G) | (k < G) | ((q - k <= w) & (k - q <= w)),
                   f"global tokens [0, {G}) + window {w}")


def _global_queries(S, w):
    return MaskMod(lambda b, h, q, k: (k <= q) & ((q % S == 1) | (q - k <= w)),
                   f"every {S}th query global (causal) + window {w}")


def _landmarks(S, w):
    return MaskMod(lambda b, h, q, k: (k <= q) & (((q % S == S // 2) & (k % S == S // 2)) | (q - k <= w)),
                   f"landmark tokens every {S} + window {w} (causal)")


def _dilated(stride):
    return MaskMod(lambda b, h, q, k: (k <= q) & ((q - k) % stride == 0), f"dilated, stride {stride} (causal)")


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
        Case("global tokens + sliding window: a row sees two runs of keys", _global_window(2, 2), 24, 24, 4, 4,
             note="row q sees keys [0, 2) and [q - 2, q + 2]: the keys between are hidden"),
        Case("strided global queries: every 4th query sees every key before it", _global_queries(4, 1), 22, 22, 4, 3,
             note="a tile's first and last rows can see nothing while a row inside it sees every key"),
        Case("landmark tokens every 4 (they see each other) + window", _landmarks(4, 1), 24, 24, 4, 4,
             note="one visible pair inside a tile whose border is masked"),
        Case("dilated attention, stride 3", _dilated(3), 20, 20, 4, 3, note="every third key: runs of length 1"),
    ]


# ------------------------------------------------------------------ build_block_mask: the bug models
def _sampled(keep, how, BM, BN, lo=None, hi=None):
    """A tile classified from some of its pairs only (``how``: border, rows, columns, intervals, centre), a ragged
    tile never full; None for the right count."""
    whole = tuple(keep.shape) == (BM, BN)
    if how == "border":
        seen = torch.cat([keep[0], keep[-1], keep[:, 0], keep[:, -1]])
    elif how == "rows":
        seen = keep[[0, -1]].flatten()
    elif how == "columns":
        seen = keep[:, [0, -1]].flatten()
    elif how == "centre":
        mid, corner = bool(keep[keep.shape[0] // 2, keep.shape[1] // 2]), keep[[0, -1]][:, [0, -1]]
        if (corner.any() and not corner.all()) or (not whole and mid):
            return PARTIAL
        return FULL if mid else SKIP
    else:                                                 # each row's [first, last] visible key, as one interval
        c0, c1 = lo[1], hi[1]
        first, last = lo[0], hi[0]
        covers, touches = (first <= c0) & (last >= c1), (first <= c1) & (last >= c0)
        return FULL if whole and bool(covers.all()) else PARTIAL if bool(touches.any()) else SKIP
    return FULL if whole and bool(seen.all()) else PARTIAL if bool(seen.any()) else SKIP


def _classify_with(case, *, full_as_partial=False, partial_skipped=False, partial_as_full=False,
                   clip_full=False, one_more=False, corners=False, swap=False, sample=None):
    """int [Tq, Tk] tile classes under one planted mistake (the defaults are right)."""
    mm, N, Nk, BM, BN = case.args
    Tq, Tk = math.ceil(N / BM), math.ceil(Nk / BN)
    cls = torch.zeros(Tq, Tk, dtype=torch.int64)
    if sample == "intervals":
        dense = dense_mask(mm, N, Nk)
        cols = torch.arange(Nk)[None, :].expand(N, Nk)
        first = torch.where(dense, cols, Nk).amin(1)
        last = torch.where(dense, cols, -1).amax(1)
    extra = 1 if one_more else 0
    for a in range(Tq):
        qi = torch.arange(a * BM, min((a + 1) * BM + extra, N))[:, None]
        for c in range(Tk):
            kj = torch.arange(c * BN, min((c + 1) * BN + extra, Nk))[None, :]
            keep = torch.as_tensor(mm(0, 0, kj.T, qi.T) if swap else mm(0, 0, qi, kj))
            keep = (keep.T if swap else keep).expand(qi.shape[0], kj.shape[1])
            if sample is not None:
                r = slice(a * BM, min((a + 1) * BM, N))
                bounds = ((first[r], c * BN), (last[r], min((c + 1) * BN, Nk) - 1)) if sample == "intervals" else \
                    (None, None)
                cls[a, c] = _sampled(keep, sample, BM, BN, *bounds)
                continue
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


_EVERY_PAIR = ("keep = mask_mod(0, 0, q_idx, kv_idx).expand(br, bc) with q_idx [br, 1], kv_idx [1, bc]; n = "
               "int(keep.sum()): 0 skip, BLOCK_M * BLOCK_N full, else partial")


def _some_pairs(which, why):
    return (f"the tile was classified from some of its pairs ({which}), not all: that holds while each row sees one "
            f"interval of keys, and fails on a mask where a row sees several runs of keys ({why}). A general mask_mod "
            "must be evaluated on every (query, key) pair of the tile")


def _bm_bugs():
    def model(**kw):
        return lambda case: _classify_with(case, **kw)
    family = [Bug(_some_pairs(which, why), model(sample=how), fix=_EVERY_PAIR) for how, which, why in (
        ("border", "its border: first and last row and column", "a visible pair inside a tile whose border is masked"),
        ("rows", "its first and last rows", "a row inside the tile sees keys its first and last rows do not"),
        ("columns", "its first and last key columns", "a key inside the tile is seen where its edges are not"),
        ("intervals", "each row's first and last visible key, as one interval", "the keys between two runs are "
                                                                                "hidden"))]
    centre = Bug(_some_pairs("its centre pair and corners", "the pairs between them decide"), model(sample="centre"),
                 fix=_EVERY_PAIR)
    return family + [
        Bug("a full tile was listed as partial: a tile whose every (query, key) pair is visible goes to "
            "full_kv_indices (FlexAttention then runs it with no mask); kv_indices holds only the tiles the "
            "mask cuts", model(full_as_partial=True)),
        Bug("a partial tile was skipped: a tile with at least one visible pair must be visited (in "
            "kv_indices); only a tile with no visible pair is left out", model(partial_skipped=True)),
        Bug("a partial tile was listed as full: 'some pair visible' is not 'every pair visible'; a full tile "
            "must have all BLOCK_M x BLOCK_N pairs visible (does the test look at every pair, or at some: a diagonal, "
            "a corner, one pair per tile?)", model(partial_as_full=True), fix=_EVERY_PAIR),
        Bug("the ragged last block: create_block_mask pads the mask with False to a multiple of the block "
            "(_convert_mask_to_block_mask), so a ragged tile's padding counts as masked and it is never full; "
            "you compared the visible count with the clipped tile's size", model(clip_full=True)),
        Bug("an off-by-one on the tile's bounds: the tile of Q block a is rows a*BLOCK_M .. (a+1)*BLOCK_M - 1 "
            "(Python's q_idx = arange(a*BLOCK_M, min((a+1)*BLOCK_M, N)), end excluded); you took one row and key "
            "more", model(one_more=True)),
        Bug("the tile was classified from its corners (or a few pairs sampled from it): lesson 04's two-corner test "
            "holds for causal masks only; "
            "a general mask_mod must be evaluated on every (query, key) pair of the tile (a window's band crosses a "
            "tile between its corners; a row can see several runs of keys)", model(corners=True), fix=_EVERY_PAIR),
        Bug("mask_mod's arguments are (b, h, q_idx, kv_idx): the query index comes before the key index; you "
            "swapped them", model(swap=True), fix="mask_mod(0, 0, q_idx, kv_idx), q_idx [BLOCK_M, 1], kv_idx [1, BLOCK_N]"),
        centre,
    ]


def _expect_index_tensor(g, t, what, shape, case=None):
    if isinstance(t, torch.Tensor) and case is not None and tuple(t.shape) != tuple(shape) and t.dim() == len(shape):
        _, N, Nk, BM, BN = case.args
        swapped = (math.ceil(N / BN), math.ceil(Nk / BM))[:len(shape)]
        fix = "Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)"
        if tuple(t.shape) == swapped:
            g.fail(f"`{what}` has shape {list(t.shape)}, expected {list(shape)}: the query blocks counted with BLOCK_N "
                   "and the key blocks with BLOCK_M", hint="BLOCK_M tiles the queries (Tq = ceil(N / BLOCK_M) rows of "
                   "the block mask), BLOCK_N the keys (Tk = ceil(Nk / BLOCK_N) columns): the two are swapped", fix=fix)
        floors = (N // BM, Nk // BN)[:len(shape)]
        if any(x == f + 1 and f * b == n for x, f, b, n in zip(t.shape, floors, (BM, BN), (N, Nk))):
            g.fail(f"`{what}` has shape {list(t.shape)}, expected {list(shape)}: one block too many",
                   hint=f"floor + 1 is one block too many where the size is a multiple of the block: there are "
                        f"ceil(N / BLOCK_M) = {math.ceil(N / BM)} query blocks and ceil(Nk / BLOCK_N) = "
                        f"{math.ceil(Nk / BN)} key blocks", fix=fix)
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
        _expect_index_tensor(g, t, what, (Tq,) if "num" in what else (Tq, Tk), case)
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
              hint="a tile is classified by every (query, key) pair in it, the rows and keys clipped to N and Nk: "
                   "none visible -> skip, all BLOCK_M x BLOCK_N visible -> full, else partial", fix=_EVERY_PAIR)
    # the same tiles: now the order, which create_block_mask defines (a stable argsort: ascending)
    for a in range(Tq):
        for what, rows, num, idx in (("kv_indices", partial, ref[0], ref[1]), ("full_kv_indices", full, ref[2], ref[3])):
            want = [int(x) for x in idx[a, :int(num[a])]]
            if rows[a] != want:
                g.fail(f"row {a} of `{what}` lists {rows[a]}, expected {want}: the same blocks in another order",
                       hint="list each row's KV blocks in ascending order, as create_block_mask does (its stable "
                            "argsort): the kernel walks K and V front to back")
    g.count()


class _Raised:
    """What the learner's function raised, handed back by ``_catching`` so that the checker picks its hint."""

    def __init__(self, e):
        self.e = e


def _catching(fn):
    """``fn`` returning a ``_Raised`` for its exception (the stub's NotImplementedError and the time limit go on)."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - the verdict names it
            return _Raised(e)
    return call


def _raised_hint(e, case):
    """(hint, fix) for what build_block_mask raised on ``case``: by the exception, not one hint for all."""
    import traceback
    mm = case.args[0]
    inner = getattr(getattr(mm, "fn", mm), "__code__", None)
    frames = traceback.extract_tb(e.__traceback__)
    in_mask = inner is not None and any(f.filename == inner.co_filename and f.name == inner.co_name for f in frames)
    msg = str(e)
    if isinstance(e, IndexError) or in_mask:
        return ("mask_mod was called on indices past the sequence: clip the ragged last block to N and Nk (a document "
                "mask indexes its ids with them), and call it as mask_mod(0, 0, q_idx, kv_idx) with integer tensors",
                "q_idx = torch.arange(a * BLOCK_M, min((a + 1) * BLOCK_M, N))[:, None], kv_idx likewise with Nk")
    if "stack expects a non-empty TensorList" in msg:
        return ("torch.stack of an empty list: a row that lists no block (no partial or no full tile) is an empty "
                "list, which torch.stack cannot take",
                "torch.tensor(listed + rest, dtype=torch.int32) for each row (an empty list is fine)")
    if isinstance(e, (ValueError, AssertionError)):
        return ("your function raised it itself on this case: N and Nk need not be multiples of the blocks (the last "
                "block is ragged), and every case must be handled", "Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)")
    return _hint_for_exception(e), ""


@exercise("build_block_mask", arg_names=["mask_mod", "N", "Nk", "BLOCK_M", "BLOCK_N"],
          reference="torch's create_block_mask (CPU), index for index")
def build_block_mask(g):
    for case in _bm_cases():
        out = g.call(case, fn=_catching(g.fn))
        if isinstance(out, _Raised):
            hint, fix = _raised_hint(out.e, case)
            g.fail(f"your function raised {type(out.e).__name__}: {out.e}{_where_in_learner_code(out.e.__traceback__)}",
                   hint=hint, fix=fix)
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
        _case("document mask with length-1 documents, relative bias (head 2)", n_doc, n_doc, 4, doc,
              relative_bias(table, 4), 4, 3, rng, h=2),
        _case("prefix-LM (prefix 6), softcap 4", 15, 15, 8, prefix_lm(6), softcap(4.0), 4, 4, rng, qmul=6.0),
        _case("blocks larger than the input, ALiBi", 3, 5, 4, causal(3, 5), alibi(slopes, 3, 5), 8, 8, rng, h=1),
        _case("random, larger: causal document mask, softcap 5", 37, 37, 8,
              _doc([5, 1, 9, 3, 1, 12, 6], True)[0], softcap(5.0), 8, 4, rng, qmul=5.0),
        _case("large logits, no cap (q x 40): scores past 88, where exp overflows float32", 12, 12, 8,
              causal(12, 12), None, 4, 3, rng, qmul=40.0,
              note="only a running max keeps exp(S - m) <= 1; exp(S) alone is inf here"),
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
    scale = 1.0 if bug == "no_scale" else 1.0 / math.sqrt(d)
    hm = 0 if bug == "h0" else h
    kv_num, kv_idx, full_num, full_idx = bm
    O = torch.zeros(N, v.shape[1], dtype=torch.float64)
    lse = torch.full((N,), -math.inf, dtype=torch.float64)
    for a, i0 in enumerate(range(0, N, BM)):
        br = min(BM, N - i0)
        rows = torch.arange(i0, i0 + br)[:, None]
        tiles = [(c, True) for c in kv_idx[a, :int(kv_num[a])].tolist()] + \
                [(c, False) for c in full_idx[a, :int(full_num[a])].tolist()]
        if bug in ("partial_only", "full_only"):
            tiles = [t for t in tiles if t[1] == (bug == "partial_only")]
        if bug == "tile_softmax":                     # each tile's softmax replaced the running state: the last counts
            tiles = tiles[-1:]
        elif bug == "tile_softmax_sorted":            # the same, the tiles visited in ascending order
            tiles = sorted(tiles)[-1:]
        parts, vs, raw = [], [], []
        for c, partial in tiles:
            j0 = c * BN
            cols = torch.arange(j0, min(j0 + BN, k.shape[0]))[None, :]
            qi_, kj_ = (rows - i0, cols - j0) if bug == "local_idx" else (rows, cols)
            if bug == "swap_idx":
                qi_, kj_ = cols, rows
            qk = q[i0:i0 + br] @ k[j0:j0 + BN].T
            S = qk * scale
            keep = torch.as_tensor(mm(0, h, cols, rows) if bug == "mask_swapped" else mm(0, h, rows, cols)).expand(
                br, cols.shape[1]) if partial else None
            if bug == "before_scale":
                S = sm(qk, 0, hm, qi_, kj_) * scale
            elif bug == "mask_first" and partial:
                S = sm(S.masked_fill(~keep, -math.inf), 0, hm, qi_, kj_)
            elif bug in ("after_max", "after_max_masked"):
                pass                                  # the mod comes after the max, below
            elif not (bug == "full_unmodded" and not partial):
                S = sm(S, 0, hm, qi_, kj_)
                if bug == "twice" and partial:
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
        m = S.amax(1)
        if bug == "no_divide":                        # acc = sum exp(S - m) V, never divided by l
            O[i0:i0 + br] = torch.where(torch.isneginf(m)[:, None], 0.0, torch.exp(S - m[:, None]).nan_to_num(0.0)) @ V
        elif bug == "lse_base2":
            lse[i0:i0 + br] = row_lse * (1 / math.log(2))
        elif bug == "lse_is_m":
            lse[i0:i0 + br] = m
        elif bug == "lse_log_l":                      # log(l) without the max it was taken against
            lse[i0:i0 + br] = row_lse - torch.where(torch.isneginf(m), 0.0, m)
    return O, lse


_MOD = "S = score_mod(Qi @ Kj.T * scale, 0, h, q_idx, kv_idx), q_idx = i0 + arange(br)[:, None], kv_idx = j0 + arange(bc)[None, :]"
_MASK = "on a partial tile: S = S.masked_fill(~mask_mod(0, h, q_idx, kv_idx), -inf), after the score_mod"
_BS_FIX = {"full_unmodded": _MOD, "after_max": _MOD, "after_max_masked": _MOD, "before_scale": _MOD,
           "mask_first": _MASK, "local_idx": _MOD, "swap_idx": _MOD, "h0": _MOD, "no_partial_mask": _MASK,
           "no_mod": _MOD, "partial_only": "for c in kv_indices[a, :kv_num_blocks[a]] (masked), then full_kv_indices[a, "
                                           ":full_kv_num_blocks[a]] (unmasked)",
           "full_only": "for c in kv_indices[a, :kv_num_blocks[a]] (masked), then full_kv_indices[a, "
                        ":full_kv_num_blocks[a]] (unmasked)",
           "no_scale": "scale = 1 / math.sqrt(d); S = Qi @ Kj.T * scale", "twice": _MOD + ", once per tile",
           "mask_swapped": _MASK, "tile_softmax_sorted": "m_new = max(m, rowmax(S)); alpha = exp(m - m_new)",
           "tile_softmax": "m_new = max(m, rowmax(S)); alpha = exp(m - m_new); l = alpha * l + "
                                                  "rowsum(P); acc = alpha * acc + P @ Vj",
           "no_divide": "O = acc / l (0 where l = 0)", "lse_base2": "lse = m + log(l), natural log",
           "lse_is_m": "lse = m + log(l)", "lse_log_l": "lse = m + log(l)"}
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
    ("partial_only", "the full tiles were not visited: full_kv_indices[a, :full_kv_num_blocks[a]] lists the tiles "
                     "every pair of which is visible; they are visited too, without the mask"),
    ("full_only", "the partial tiles were not visited: kv_indices[a, :kv_num_blocks[a]] lists the tiles the mask "
                  "cuts; they are visited with the mask, then the full ones"),
    ("no_scale", "the scores were not scaled: S = Qi @ Kj.T * scale with scale = 1 / sqrt(d), before the score_mod"),
    ("twice", "the score_mod was applied twice on the partial tiles (once before the branch and once in it): once "
              "per tile, then the mask"),
    ("mask_swapped", "mask_mod's arguments are (b, h, q_idx, kv_idx): the query index before the key index; on the "
                     "partial tiles you swapped them"),
    ("tile_softmax", "each tile's softmax replaced the running state: only the last tile counts. Keep (m, l, acc) "
                     "across the tiles and rescale them by alpha = exp(m_old - m_new) (lesson 03)"),
    ("tile_softmax_sorted", "each tile's softmax replaced the running state: only the last tile counts. Keep (m, l, "
                            "acc) across the tiles and rescale them by alpha = exp(m_old - m_new) (lesson 03)"),
    ("no_divide", "O was never divided by l: the running acc holds sum exp(S - m) V, and O = acc / l at the end"),
    ("lse_base2", "lse is in base 2: lse = m + log(l) with the natural log (from base-2 exponentials, divide by "
                  "log2(e))"),
    ("lse_is_m", "lse is the running max alone: lse = m + log(l)"),
    ("lse_log_l", "lse is log(l) alone: l is the sum of exp(S - m), so lse = m + log(l)"),
]


def _bs_bugs(which):
    return [Bug(hint, (lambda c, b=bug: _model(c, b)[which]), fix=_BS_FIX[bug]) for bug, hint in _BS_BUGS]


_NAN = ("NaN: a row that sees no key keeps m = -inf, and exp(S - m) is exp(-inf - (-inf)); exponentiate against a "
        "safe max (0 where m is -inf) and guard l = 0 at the end (lesson 05)")
_NAN_FIX = "m_safe = torch.where(m_new == -inf, 0, m_new); P = exp(S - m_safe); O = where(l > 0, acc / l, 0)"
_OVERFLOW = ("NaN or inf with scores past 88: exp(S) overflows float32 (inf / inf is NaN); keep a running max m, "
             "exponentiate exp(S - m) (at most 1) and rescale acc and l by alpha = exp(m_old - m_new) when it grows "
             "(lesson 03's update)")
_OVERFLOW_FIX = "m_new = maximum(m, S.amax(1)); alpha = exp(m - m_new); P = exp(S - m_new[:, None]); l = alpha * l + P.sum(1)"


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
    full_area = int(bm[2].sum()) * BM * BN
    every = math.ceil(N / BM) * BM * math.ceil(Nk / BN) * BN
    if counting.pairs > partial_area and counting.pairs == every - full_area:
        g.fail(f"mask_mod was evaluated on {counting.pairs:,} (query, key) pairs: every tile but the full ones, with the "
               f"mask; the {int(bm[0].sum())} partial tiles hold {partial_area:,}",
               hint="every tile the full list does not hold was masked: was every entry of kv_indices[a] visited? Only "
                    "its first kv_num_blocks[a] are tiles to visit; the rest of the row is filler (the other blocks, so "
                    "that each row is a permutation)",
               fix="for c in kv_indices[a, :kv_num_blocks[a]].tolist(): ...")
    if counting.pairs > partial_area and counting.pairs == partial_area + full_area:
        g.fail(f"mask_mod was evaluated on {counting.pairs:,} (query, key) pairs, as many as the {int(bm[0].sum())} "
               f"partial and the {int(bm[2].sum())} full tiles hold; the partial ones alone hold {partial_area:,}",
               hint="the full tiles were masked too (a full tile needs no mask: every pair is visible), or kv_indices "
                    "was read past kv_num_blocks[a] (its rest is filler; the full tiles are full_kv_indices')",
               fix="mask only for c in kv_indices[a, :kv_num_blocks[a]]; no mask for c in "
                   "full_kv_indices[a, :full_kv_num_blocks[a]]")
    if counting.pairs >= N * Nk:
        g.fail(f"mask_mod was evaluated on {counting.pairs:,} (query, key) pairs, every pair of the {N} x {Nk} scores; "
               f"the {int(bm[0].sum())} partial tiles hold {partial_area:,}",
               hint="the N x Nk mask was built (or every tile masked): mask_mod is for the partial tiles only, one "
                    "[BLOCK_M, BLOCK_N] tile at a time", fix="mask only for c in kv_indices[a, :kv_num_blocks[a]]")
    if counting.pairs > partial_area:
        g.fail(f"mask_mod was evaluated on {counting.pairs:,} (query, key) pairs; the {int(bm[0].sum())} partial "
               f"tiles hold {partial_area:,} (the {int(bm[2].sum())} full ones {full_area:,} more)",
               hint="apply the mask on the partial tiles (kv_indices) only: a full tile (full_kv_indices) needs no "
                    "mask, and a tile in neither list is not visited. Never build the N x Nk mask")
    r = g.measure(case, names=("q", "k", "v"))
    saw_no_flops(g, r, "which tiles it visits")
    if r.largest.numel >= N * Nk // 2:                # the dense scores first: their FLOPs are not extra tiles
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}), as large as "
               f"the {N} x {Nk} score matrix",
               hint=f"you computed the {N} x {Nk} scores (or as large a tensor) and then worked on tiles of them: the "
                    "block mask is there so that only the listed tiles' scores are ever computed, one [BLOCK_M, "
                    "BLOCK_N] tile at a time", fix="S = Qi @ Kj.T * scale inside the loop over the listed c")
    need = visible_tile_flops(dense_mask(mm, N, Nk), BM, BN, d)
    if r.flops > need:
        g.fail(f"your function did {r.flops:,} matmul FLOPs; the tiles the block mask lists need {need:,} "
               f"(every tile: {4 * N * Nk * d:,})",
               hint="tiles the block mask does not list were computed: for Q block a, only the KV blocks in "
                    "kv_indices and full_kv_indices, up to their counts; that is what the block mask is for",
               fix="for c in kv_indices[a, :kv_num_blocks[a]], then full_kv_indices[a, :full_kv_num_blocks[a]]")


@exercise("flash_attn_block_sparse",
          arg_names=["q", "k", "v", "block_mask", "mask_mod", "score_mod"],
          reference="the float64 dense reference (score_mod, then the mask, then softmax)")
def flash_attn_block_sparse(g):
    bugs_o, bugs_lse = _bs_bugs(0), _bs_bugs(1)
    _check_work(g)                                     # the idea first: wrong in both, the learner hears of the idea
    for case in _bs_cases():
        q, k, v, bm, mm, sm = case.args
        out = g.call(case)
        O_ref, lse_ref = attention_mods_ref(q, k, v, mm, sm, h=case.kwargs["h"])
        O, lse = g.expect_tuple(out, 2, "(O, lse)")
        if isinstance(O, torch.Tensor) and O.dim() == 2 and tuple(O.shape) == tuple(O_ref.shape)[::-1] != \
                tuple(O_ref.shape):
            g.fail(f"`O` has shape {list(O.shape)}, expected {list(O_ref.shape)}: transposed",
                   hint="O has a row per query, [N, d] as q; the transpose is of K in S = Qi @ Kj.T, not of O",
                   fix="O[i0:i0 + br] = acc / l[:, None]")
        g.expect_tensor(O, "O", shape=tuple(O_ref.shape), dtype=q.dtype)
        g.expect_tensor(lse, "lse", shape=tuple(lse_ref.shape), dtype=q.dtype)
        big = float((q.double() @ k.double().T).abs().max()) / q.shape[-1] ** 0.5 > 80   # exp(80) nears fp32's top
        nan_hint, nan_fix = (_OVERFLOW, _OVERFLOW_FIX) if big else (_NAN, _NAN_FIX)
        g.compare(O, O_ref, "O", rtol=RTOL, atol=ATOL, bugs=bugs_o, nan_hint=nan_hint, nan_fix=nan_fix,
                  hint="the tile loop's output differs: per tile, the score_mod on the scaled scores with global "
                       "indices, on a partial tile then the mask, then lesson 03's update", fix=_MOD + "; " + _MASK)
        g.compare(lse, lse_ref, "lse", rtol=1e-5, atol=1e-4, bugs=bugs_lse, nan_hint=nan_hint, nan_fix=nan_fix,
                  hint="lse = m + log(l) of the MODIFIED scores over the visible keys; -inf when there are none",
                  fix="lse = where(l > 0, m + log(l), -inf)")
        g.count()


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
        Case("scores up to 100 times the cap (raw logits before a cap of 2)", torch.linspace(-200, 200, 41)[None],
             torch.ones(1, 41), 2.0, note="exp(2 s / cap) overflows float32 once s / cap > 44"),
    ]


_SC_FIX = "dS = dT * (1 - torch.tanh(s / cap) ** 2)"
_SC_NAN = {"a -inf score": "NaN: at s = -inf, tanh(s / cap) = -1 and 1 - tanh^2 = 0, so dS = 0; a NaN comes from "
                           "computing it another way (exp of inf, 0 * inf, inf / inf)",
           "scores up to 100": "NaN where s / cap is large: exp(2 s / cap) overflows float32 once s / cap > 44, and "
                               "inf / inf is NaN; torch.tanh saturates instead (or write the form in e^{-|x|}, which "
                               "only underflows to 0)"}


def _sc_autograd(s, dT, cap):
    s64 = s.detach().double().requires_grad_()
    T = cap * torch.tanh(s64 / cap)
    T.backward(dT.double())
    return s64.grad


def _sc_bugs():
    def m(f):
        return lambda c: f(c.args[0].double(), c.args[1].double(), c.args[2])

    def bug(hint, f):
        return Bug(hint, m(f), fix=_SC_FIX)
    return [
        bug("the chain rule stopped at dT: dS = dT * dT/dS, and d(cap * tanh(s / cap))/ds = 1 - tanh(s / cap)^2",
            lambda s, dT, cap: dT),
        bug("the derivative of tanh is 1 - tanh^2, not 1 - tanh", lambda s, dT, cap: dT * (1 - torch.tanh(s / cap))),
        bug("the cap cancels: d/ds [cap * tanh(s / cap)] = cap * (1 / cap) * (1 - tanh^2) = 1 - tanh(s / cap)^2, "
            "with no factor cap", lambda s, dT, cap: dT * cap * (1 - torch.tanh(s / cap) ** 2)),
        bug("the cap cancels: d/ds [cap * tanh(s / cap)] = 1 - tanh(s / cap)^2, with no factor 1 / cap",
            lambda s, dT, cap: dT / cap * (1 - torch.tanh(s / cap) ** 2)),
        bug("tanh of the raw score over the cap, tanh(s / cap), not of the capped score: T / cap = tanh(s / cap) "
            "is what you want, tanh(T / cap) is not", lambda s, dT, cap: dT * (1 - torch.tanh(torch.tanh(s / cap)) ** 2)),
        bug("1 - tanh(s / cap)^2, not 1 - T^2: T = cap * tanh(s / cap) is the capped score, divide it by cap first",
            lambda s, dT, cap: dT * (1 - (cap * torch.tanh(s / cap)) ** 2)),
        bug("tanh(s) without the cap: the softcap is cap * tanh(s / cap), so its derivative has tanh(s / cap)",
            lambda s, dT, cap: dT * (1 - torch.tanh(s) ** 2)),
        bug("tanh(s * cap): the softcap divides the score by the cap, tanh(s / cap)",
            lambda s, dT, cap: dT * (1 - torch.tanh(s * cap) ** 2)),
        bug("1 + tanh^2: the derivative of tanh is 1 - tanh^2 (a sign)", lambda s, dT, cap: dT * (1 + torch.tanh(s / cap) ** 2)),
        bug("sech, not sech^2: 1 - tanh(x)^2 = 1 / cosh(x)^2, squared (a missing square, or a square root)",
            lambda s, dT, cap: dT / torch.cosh(s / cap)),
        bug("the chain rule multiplies the derivative by dT, the upstream gradient, not by s",
            lambda s, dT, cap: s * (1 - torch.tanh(s / cap) ** 2)),
        bug("that is the forward, T = cap * tanh(s / cap): the exercise asks for its gradient, dT * dT/ds",
            lambda s, dT, cap: cap * torch.tanh(s / cap)),
        bug("1 / (1 + x^2) is arctan's derivative; tanh's is 1 - tanh(x)^2", lambda s, dT, cap: dT / (1 + (s / cap) ** 2)),
        bug("every negative score got a gradient of 0: only s = -inf (a masked key) has dS = 0, and the formula gives "
            "it already", lambda s, dT, cap: torch.where(s > 0, dT * (1 - torch.tanh(s / cap) ** 2), 0.0)),
    ]


@exercise("softcap_grad", arg_names=["s", "dT", "cap"], reference="torch.autograd (float64)")
def softcap_grad(g):
    for case in _sc_cases():
        s, dT, cap = case.args
        out = g.call(case)
        if isinstance(out, torch.Tensor) and tuple(out.shape) != tuple(s.shape) and out.numel() == s.numel():
            g.fail(f"`dS` has shape {list(out.shape)}, expected s's {list(s.shape)}",
                   hint="the gradient is elementwise: dS has the scores' shape (no flatten, no reshape)", fix=_SC_FIX)
        g.expect_tensor(out, "dS", shape=tuple(s.shape), dtype=s.dtype)
        nan = next((h for name, h in _SC_NAN.items() if case.name.startswith(name)), _SC_NAN["a -inf score"])
        g.compare(out, _sc_autograd(s, dT, cap), "dS", rtol=1e-5, atol=1e-6, bugs=_sc_bugs(), nan_hint=nan,
                  nan_fix=_SC_FIX, hint="dS = dT * (1 - tanh(s / cap)^2), elementwise", fix=_SC_FIX)
        g.count()


__all__ = ["build_block_mask", "flash_attn_block_sparse", "softcap_grad", "CountingMask", "MaskMod", "ScoreMod"]
