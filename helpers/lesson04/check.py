"""Checkers of lesson 04, causal tile classes: ``classify_tile`` and ``flash_attn_causal``.

References: ``helpers.reference.causal_mask`` (the element-level truth) and
``helpers.reference.attention`` (SDPA and ``torch.logsumexp`` in float64). The meter's
FLOP count (matmul and elementwise) rejects a kernel that computes invisible tiles, and
its count of no-op masks one that masks tiles with nothing to mask.
"""
from __future__ import annotations

import torch

from .. import reference
from ..checking import Bug, Case, exercise
from ..lesson04 import CLASSES
from ..cases import (NEG_INF, check_o_lse, check_tiled_memory, check_visible_work, gen,  # noqa: F401
                      masked_tiled_model, memory_case, qkv, tiled_budget, tiles)

ALIGNS = ("top_left", "bottom_right")
tiled_model = masked_tiled_model      # the name lesson 04's tests use
_gen = gen


def _other(align):
    return "bottom_right" if align == "top_left" else "top_left"


# ------------------------------------------------------------------ classify_tile
def _classify_with(i0, j0, Br, Bc, N, Nk, align, *, shift=0, clip=True, skip_row="last", skip_key="first",
                   full_row="first", full_key="last", minus_one=True, offset_sign=1):
    """A classifier with knobs for the usual mistakes (the defaults are right).

    shift: visibility j <= i + offset + shift; clip=False: ragged tiles not clipped; skip_row / skip_key:
    the corner tested for "skip" (right: the last row and the first key); full_row / full_key: the corner
    tested for "full" (right: the first row and the last key); minus_one=False: the tile's last row and key
    taken as min(i0 + Br, N) (one past it); offset_sign=-1: the bottom-right offset as N - Nk.
    """
    off = (0 if align == "top_left" else offset_sign * (Nk - N)) + shift
    one = 1 if minus_one else 0
    i1 = (min(i0 + Br, N) if clip else i0 + Br) - one
    j1 = (min(j0 + Bc, Nk) if clip else j0 + Bc) - one
    rows = {"first": i0, "last": i1}
    keys = {"first": j0, "last": j1}
    if keys[skip_key] > rows[skip_row] + off:
        return "skip"
    if keys[full_key] <= rows[full_row] + off:
        return "full"
    return "partial"


_CLASSIFY_MODELS = [
    ("an off-by-one on the diagonal: query i sees key j when j <= i + offset (the diagonal itself "
     "is visible), not j < i + offset", dict(shift=-1)),
    ("an off-by-one on the diagonal: query i sees keys j <= i + offset, not j <= i + offset + 1",
     dict(shift=1)),
    ("the tile's last row is min(i0 + Br, N) - 1 and its last key min(j0 + Bc, Nk) - 1: without the - 1 "
     "you test one row (key) past the tile", dict(minus_one=False)),
    ("the last tile is ragged: clip its last row and column to N - 1 and Nk - 1 "
     "(min(i0 + Br, N) - 1)", dict(clip=False)),
    ("the wrong corner for skip: a tile is skipped when even its LAST row cannot see its FIRST key "
     "(j0 > i_last + offset); you tested its first row, so tiles the diagonal cuts were skipped",
     dict(skip_row="first")),
    ("the wrong corner for skip: a tile is skipped when even its last row cannot see its FIRST key "
     "(j0 > i_last + offset); you tested its last key, so tiles the diagonal cuts were skipped",
     dict(skip_key="last")),
    ("the wrong corner for skip: test the tile's bottom-left corner (last row, first key): j0 > i_last + offset",
     dict(skip_row="first", skip_key="last")),
    ("the wrong corner for full: a tile is full when even its FIRST row sees its LAST key "
     "(j_last <= i0 + offset); you tested its last row, so tiles the diagonal cuts were called full",
     dict(full_row="last")),
    ("the wrong corner for full: a tile is full when even its first row sees its LAST key "
     "(j_last <= i0 + offset); you tested its first key, so tiles the diagonal cuts were called full",
     dict(full_key="first")),
    ("the wrong corner for full: test the tile's top-right corner (first row, last key): j_last <= i0 + offset",
     dict(full_row="last", full_key="first")),
    ("the bottom-right offset is Nk - N (the last query sees every key), not N - Nk", dict(offset_sign=-1)),
]


def _classify_tiles():
    """Every tile of every configuration: (note, i0, j0, Br, Bc, N, Nk, align)."""
    for N, Nk, Br, Bc, align, note in _classify_configs():
        for i0 in range(0, N, Br):
            for j0 in range(0, Nk, Bc):
                yield note, i0, j0, Br, Bc, N, Nk, align


def _diagnose_classify(g, failing):
    """The hint of the known mistake that explains the learner's classes best, over every tile.

    ``failing`` is the tile that was wrong; only models that give the learner's answer there are
    candidates, and the one that agrees with the learner on the most tiles wins.
    """
    answers = {}
    for _note, *tile in _classify_tiles():
        i0, j0, Br, Bc, N, Nk, align = tile
        try:
            answers[tuple(tile)] = g.fn(i0, j0, Br, Bc, N, Nk, align=align)
        except Exception:  # noqa: BLE001 - a tile the learner's function cannot classify says nothing
            answers[tuple(tile)] = None
    i0, j0, Br, Bc, N, Nk, align = failing
    got = answers.get(tuple(failing))
    candidates = [(h, kw) for h, kw in _CLASSIFY_MODELS
                  if _classify_with(i0, j0, Br, Bc, N, Nk, align, **kw) == got]
    scored = [(sum(_classify_with(*t[:6], t[6], **kw) == a for t, a in answers.items()), h)
              for h, kw in candidates]
    if scored:
        return max(scored, key=lambda sh: sh[0])[1]
    if _classify_with(i0, j0, Br, Bc, N, Nk, _other(align)) == got:
        return (f"that is the class under {_other(align)} alignment: with N != Nk the two "
                f"differ; for {align} the offset is {'0' if align == 'top_left' else 'Nk - N'}")
    return ""


def _classify_configs():
    return [  # (N, Nk, Br, Bc, align, note)
        (12, 12, 4, 4, "top_left", "square tiles on a square matrix"),
        (12, 12, 4, 3, "top_left", "Br != Bc: the diagonal crosses tiles at an angle"),
        (10, 10, 4, 3, "top_left", "N not a multiple of Br or Bc (ragged last tiles)"),
        (1, 1, 4, 3, "top_left", "N = Nk = 1, tiles larger than the input"),
        (1, 9, 4, 3, "bottom_right", "one query (decoding): it sees every key"),
        (1, 9, 4, 3, "top_left", "one query, top-left: it sees key 0 only"),
        (6, 14, 4, 3, "top_left", "Nk > N, top-left"),
        (6, 14, 4, 3, "bottom_right", "Nk > N, bottom-right (prefill after a KV cache)"),
        (14, 6, 4, 3, "top_left", "N > Nk, top-left"),
        (14, 6, 4, 3, "bottom_right", "N > Nk, bottom-right: the first N - Nk rows see nothing"),
        (9, 9, 1, 1, "bottom_right", "1 x 1 tiles: classes are the mask itself"),
        (7, 20, 16, 16, "top_left", "one tile larger than the input"),
        (13, 29, 5, 7, "bottom_right", "odd sizes everywhere"),
    ]


@exercise("classify_tile", arg_names=["i0", "j0", "Br", "Bc", "N", "Nk"], reference="causal_mask")
def classify_tile(g):
    masks = {}
    for note, i0, j0, Br, Bc, N, Nk, align in _classify_tiles():
        vis = masks.setdefault((N, Nk, align), reference.causal_mask(N, Nk, align))
        case = Case(f"{note}: tile at rows {i0}.., keys {j0}..", i0, j0, Br, Bc, N, Nk, align=align,
                    note=f"rows {i0}..{min(i0 + Br, N) - 1}, keys {j0}..{min(j0 + Bc, Nk) - 1}")
        got = g.call(case)
        if got not in CLASSES:
            g.fail(f"returned {got!r}; expected one of 'skip', 'full', 'partial'",
                   hint="return the class as one of the three strings")
        t = vis[i0:i0 + Br, j0:j0 + Bc]
        want = "skip" if not t.any() else ("full" if t.all() else "partial")
        if got != want:
            hint = _diagnose_classify(g, (i0, j0, Br, Bc, N, Nk, align))
            g.fail(f"got {got!r}, expected {want!r} (this tile has {int(t.sum())} visible scores "
                   f"of {t.numel()})",
                   hint=hint or "skip: even the last row cannot see the first key; full: even the "
                                "first row sees the last key; partial: anything else")
        g.count()
    return f"{g.cases} tiles classified as causal_mask says"


# ------------------------------------------------------------------ flash_attn_causal
def _causal_cases():
    rng = gen(40)
    cases = []
    for align in ALIGNS:
        cases += [
            Case(f"{align}, square, ragged tiles", *qkv(11, 11, 8, rng), Br=4, Bc=3, align=align),
            Case(f"{align}, Nk > N (prefill with a KV cache)", *qkv(7, 19, 8, rng), Br=4, Bc=3, align=align),
            Case(f"{align}, N > Nk", *qkv(13, 6, 8, rng), Br=4, Bc=3, align=align,
                 note="bottom-right: the first N - Nk = 7 rows see no key, so O = 0 and lse = -inf there"
                 if align == "bottom_right" else ""),
            Case(f"{align}, N = 1", *qkv(1, 9, 8, rng), Br=4, Bc=3, align=align),
            Case(f"{align}, d = 5, Br != Bc", *qkv(17, 23, 5, rng), Br=5, Bc=2, align=align),
            Case(f"{align}, tiles larger than the input", *qkv(6, 9, 8, rng), Br=16, Bc=16, align=align),
            Case(f"{align}, 1 x 1 tiles", *qkv(5, 7, 4, rng), Br=1, Bc=1, align=align),
            Case(f"{align}, large logits (q * 30)", *qkv(12, 16, 8, rng, qmul=30.0), Br=4, Bc=3, align=align),
            Case(f"{align}, default tiles", *qkv(20, 26, 16, rng), align=align),
        ]
    return cases


def _vis(case):
    q, k, _ = case.args
    return reference.causal_mask(q.shape[0], k.shape[0], case.kwargs.get("align", "top_left"))


def _causal_models(which):
    """Bug models of flash_attn_causal for output ``which`` (0: O, 1: lse)."""
    def ref_with(vis_fn):
        return lambda c: reference.attention(*c.args, mask=vis_fn(c))[which]

    def tiled(**kw):
        return lambda c: tiled_model(*c.args, _vis(c), *tiles(c), **kw)[which]

    def shifted(s):
        def vis(c):
            q, k, _ = c.args
            N, Nk = q.shape[0], k.shape[0]
            off = 0 if c.kwargs.get("align", "top_left") == "top_left" else Nk - N
            return torch.arange(Nk)[None, :] <= torch.arange(N)[:, None] + off + s
        return vis

    def other_align(c):
        q, k, _ = c.args
        return reference.causal_mask(q.shape[0], k.shape[0], _other(c.kwargs.get("align", "top_left")))

    def partial(s, local=False):
        """Partial tiles masked with visibility j <= i + offset + s (in the tile's own indices if local)."""
        def model(c):
            q, k, _ = c.args
            N, Nk = q.shape[0], k.shape[0]
            off = (0 if c.kwargs.get("align", "top_left") == "top_left" else Nk - N) + s

            def mask(i0, j0, br, bc):
                r0, c0 = (0, 0) if local else (i0, j0)
                return torch.arange(c0, c0 + bc)[None, :] <= torch.arange(r0, r0 + br)[:, None] + off
            return tiled_model(*c.args, _vis(c), *tiles(c), partial_mask=mask)[which]
        return model

    return [
        Bug("an off-by-one on the diagonal: the diagonal is visible (j <= i + offset), you masked it "
            "(j < i + offset)", ref_with(shifted(-1))),
        Bug("an off-by-one on the diagonal: query i sees keys j <= i + offset, you let it see one more",
            ref_with(shifted(1))),
        Bug("that is the answer for the other alignment: you ignored `align` (top-left: j <= i; bottom-right: "
            "j <= i + Nk - N, so the last query sees every key)", ref_with(other_align)),
        Bug("the mask of the partial tiles is off by one: it hides the diagonal; query i sees keys "
            "j <= i + offset, so mask cols > rows + offset (not cols >= rows + offset)", partial(-1)),
        Bug("the mask of the partial tiles is off by one: it lets query i see key i + offset + 1; mask "
            "cols > rows + offset", partial(1)),
        Bug("the mask of a partial tile was built from the tile's own indices (0..Br-1, 0..Bc-1): use the "
            "global ones, rows = i0 + arange(Br), cols = j0 + arange(Bc)", partial(0, local=True)),
        Bug("a tile cut by the diagonal (partial) was skipped: only tiles where no key is visible may be "
            "skipped; a partial tile is computed, then masked", tiled(computed=lambda t: bool(t.all()))),
        Bug("a tile cut by the diagonal (partial) was computed without its mask: the keys above the "
            "diagonal leaked in; mask the scores of partial tiles (full tiles need none)",
            tiled(applied=lambda t: torch.ones_like(t))),
        Bug("a fully masked row was filled with -1e6, not -inf: its softmax became a uniform average of V "
            "(O should be 0, lse -inf)", tiled(fill=-1e6)),
    ]


_NAN = ("NaN on a row with nothing visible (bottom-right with N > Nk: the first N - Nk rows): "
        "exp(-inf - (-inf)) is NaN and so is 0 / 0; use a safe max (0 where m is -inf) and guard l = 0 "
        "at the end (O = 0, lse = -inf)")


def _idea(g):
    """FLOPs only for visible tiles, however they are computed; no N x Nk tensor; no mask on full tiles."""
    gen = _gen(41)
    for N, Nk, align in ((24, 24, "top_left"), (30, 18, "bottom_right")):
        Br, Bc, d = 4, 3, 16
        q, k, v = (torch.randn(n, d, generator=gen) for n in (N, Nk, Nk))
        r = g.measure(Case(f"the work done (metered), {align}, N = {N}, Nk = {Nk}, d = {d}", q, k, v,
                           Br=Br, Bc=Bc, align=align), names=("q", "k", "v"))
        check_visible_work(
            g, r, reference.causal_mask(N, Nk, align), Br, Bc, d,
            skip_hint="you computed tiles that are entirely above the diagonal and masked them afterwards: the "
                      "result is right but causal attention saves nothing; skip those tiles (never compute "
                      "their Q K^T or P V, with @ or with elementwise products), that is where the 2x comes from",
            tile_hint="FlashAttention never holds anything N x Nk, not even the mask: build each partial "
                      "tile's mask from its row and column indices, [Br, Bc] at a time")
        if r.noop_masks:
            g.fail(f"your function applied a mask {r.noop_masks} times to a tile in which every score is "
                   "visible (a full tile), e.g. masked_fill with an all-False mask, or adding torch.log(keep.float()) "
                   "where keep is all True (it adds 0 everywhere)",
                   hint="full tiles need no mask at all, only tiles cut by the diagonal do; in the Triton kernel "
                        "this is the off-band loop (no mask) and the on-band loop (mask): most tiles are full, "
                        "so the mask's cost should be paid only on the band")


@exercise("flash_attn_causal", arg_names=["q", "k", "v"], reference="SDPA (float64, both alignments)",
          budget=tiled_budget)
def flash_attn_causal(g):
    bugs_o, bugs_lse = _causal_models(0), _causal_models(1)
    for case in _causal_cases():
        q, k, v = case.args
        out = g.call(case)
        check_o_lse(g, out, reference.attention(q, k, v, mask=_vis(case)), dtype=q.dtype,
                    o_bugs=bugs_o, lse_bugs=bugs_lse, nan_hint=_NAN,
                    o_hint="compare one row by hand: which keys should query i see under this alignment?",
                    lse_hint="lse = m + log(l) over the visible keys of the row; -inf when there are none")
        g.count()
    _idea(g)
    check_tiled_memory(g, memory_case(42, align="bottom_right"))
