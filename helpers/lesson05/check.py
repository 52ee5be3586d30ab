"""Checkers of lesson 05, fully masked rows: ``flash_attn_masked``.

Reference: ``helpers.reference.attention`` (SDPA and ``torch.logsumexp`` in float64) with
the course's convention for a row with nothing to attend to: O = 0, lse = -inf. The
meter's FLOP count (matmul and elementwise) rejects a kernel that computes tiles with no visible key.
"""
from __future__ import annotations

import torch

from .. import reference
from ..checking import Bug, Case, exercise
from ..lesson05 import make_mask
from ..cases import (NEG_INF, check_o_lse, check_tiled_memory, check_visible_work, gen, memory_case, qkv,
                      tiled_budget, tiles)
from ..cases import masked_tiled_model as tiled_model

_gen = gen


def _masked_cases():
    rng = gen(50)

    def rand_mask(N, Nk, p):
        return torch.rand(N, Nk, generator=rng) < p

    holes = rand_mask(11, 13, 0.6)
    holes[[0, 5, 10]] = False                          # fully masked rows, first, middle, last
    first_tile_empty = torch.ones(9, 10, dtype=torch.bool)
    first_tile_empty[:, :3] = False                    # every row: the first KV tile has nothing visible
    first_tile_empty[1, :3] = True                     # ... except row 1: one tile, some rows empty in it
    last_key_only = torch.zeros(6, 11, dtype=torch.bool)
    last_key_only[:, -1] = True                        # the only visible key is in the last, ragged tile
    blocks = torch.zeros(16, 15, dtype=torch.bool)
    blocks[:8, :6] = True
    blocks[8:, 9:] = True                              # whole tiles with no visible key in visible rows
    return [
        Case("no mask at all (all True)", *qkv(10, 12, 8, rng), torch.ones(10, 12, dtype=torch.bool), Br=4, Bc=3),
        Case("random mask with fully masked rows", *qkv(11, 13, 8, rng), holes, Br=4, Bc=3,
             note="rows 0, 5 and 10 attend to nothing: O = 0, lse = -inf there"),
        Case("the whole matrix masked", *qkv(7, 9, 8, rng), torch.zeros(7, 9, dtype=torch.bool), Br=4, Bc=3,
             note="every row is fully masked: O = 0 and lse = -inf everywhere, no NaN"),
        Case("bottom-right causal, N > Nk", *qkv(14, 6, 8, rng), make_mask("bottom_right causal", 14, 6), Br=4, Bc=3,
             note="the first 8 rows see nothing"),
        Case("padding (padded queries see nothing)", *qkv(12, 12, 8, rng), make_mask("padding", 12, 12), Br=4, Bc=3),
        Case("sliding window (tiles with no visible key)", *qkv(17, 17, 8, rng), make_mask("sliding window", 17, 17),
             Br=4, Bc=3),
        Case("packed documents (block diagonal)", *qkv(15, 15, 8, rng), make_mask("packed documents", 15, 15),
             Br=4, Bc=3),
        Case("a first tile with nothing visible in most rows", *qkv(9, 10, 8, rng), first_tile_empty, Br=4, Bc=3,
             note="rows meet an empty tile first: the running max is still -inf when the next tile comes"),
        Case("the only visible key is in the last, ragged tile", *qkv(6, 11, 8, rng), last_key_only, Br=4, Bc=3),
        Case("whole empty tiles inside visible rows", *qkv(16, 15, 8, rng), blocks, Br=4, Bc=3),
        Case("N = 1, fully masked", *qkv(1, 5, 8, rng), torch.zeros(1, 5, dtype=torch.bool), Br=4, Bc=3),
        Case("N = 1, one visible key", *qkv(1, 5, 8, rng), torch.tensor([[False, False, True, False, False]]),
             Br=4, Bc=3),
        Case("d = 5, Br != Bc, random", *qkv(13, 17, 5, rng), rand_mask(13, 17, 0.3), Br=5, Bc=2),
        Case("tiles larger than the input", *qkv(5, 7, 8, rng), make_mask("random", 5, 7, seed=3), Br=16, Bc=16),
        Case("1 x 1 tiles", *qkv(5, 6, 4, rng), make_mask("random", 5, 6, seed=4), Br=1, Bc=1),
        Case("large logits (q * 30), fully masked rows", *qkv(12, 14, 8, rng, qmul=30.0),
             make_mask("random", 12, 14, seed=5), Br=4, Bc=3),
        Case("default tiles", *qkv(20, 22, 16, rng), make_mask("random", 20, 22, seed=6)),
    ]


def _nan_hidden(c):
    """No safe max, NaN hidden by a final guard: rows empty in their block's first computed tile give 0, -inf."""
    q, k, v, mask = c.args
    Br, Bc = tiles(c)
    O, lse = reference.attention(q, k, v, mask=mask)
    for i0 in range(0, q.shape[0], Br):
        for j0 in range(0, k.shape[0], Bc):
            t = mask[i0:i0 + Br, j0:j0 + Bc]
            if t.any():
                lost = (~t.any(1)).nonzero().flatten() + i0
                O[lost], lse[lost] = 0.0, NEG_INF
                break
    return O, lse


def _models(which):
    def tiled(**kw):
        return lambda c: tiled_model(*c.args[:3], c.args[3], *tiles(c), **kw)[which]

    return [
        Bug("masked scores were set to -1e6, not -inf: on a fully masked row every score is then -1e6, and the "
            "softmax of equal numbers is a plain average of V (O should be 0 and lse -inf)", tiled(fill=-1e6)),
        Bug("masked scores were set to -1e6, not -inf (and every tile computed): a fully masked row became the "
            "plain average of V (O should be 0 and lse -inf)",
            tiled(fill=-1e6, computed=lambda t: True)),
        Bug("a tile with some visible keys was skipped: skip a tile only when *no* key in it is visible "
            "(not mask_tile.any()), a partly masked tile is computed and masked",
            tiled(computed=lambda t: bool(t.all()))),
        Bug("the mask was not applied: the masked keys were attended to (mask the scores of each computed tile "
            "with -inf where mask is False)", tiled(applied=lambda t: torch.ones_like(t))),
        Bug("the mask is upside down: True means *may attend* (as in SDPA's bool attn_mask); "
            "nn.MultiheadAttention's key_padding_mask uses True for *ignore*",
            lambda c: reference.attention(*c.args[:3], mask=~c.args[3])[which]),
        Bug("rows with no visible key in the first tile their block computes came out as O = 0, lse = -inf: "
            "exp(-inf - (-inf)) made NaN in their m, l and acc, and your final guard hid it; use a safe max "
            "(m_safe = 0 where m_new is -inf) so a row can start empty and still add later keys",
            lambda c: _nan_hidden(c)[which]),
    ]


_NAN = ("NaN on a fully masked row (or in a tile where a row has no visible key yet): exp(-inf - (-inf)) is NaN "
        "and so is 0 / 0. Exponentiate against a safe max (m_safe = 0 where m is -inf, so exp(-inf - 0) = 0 "
        "and alpha = 0), guard l = 0 at the final division (O = 0 there), and set lse = -inf where l = 0")


def _idea(g):
    """FLOPs (matmul and elementwise) only for tiles with a visible key; nothing N x Nk made."""
    gen = _gen(51)
    N, Nk, d, Br, Bc = 24, 27, 16, 4, 3
    for kind in ("sliding window", "padding"):
        q, k, v = (torch.randn(n, d, generator=gen) for n in (N, Nk, Nk))
        mask = make_mask(kind, N, Nk)
        r = g.measure(Case(f"the work done (metered), {kind}, d = {d}", q, k, v, mask, Br=Br, Bc=Bc),
                      names=("q", "k", "v", "mask"))
        check_visible_work(
            g, r, mask, Br, Bc, d,
            skip_hint="you computed tiles in which no key is visible: their scores are all -inf and add "
                      "nothing; skip them (`if not mask_tile.any(): continue`), so a sparse mask (a window, "
                      "padding, packed documents) costs only its visible tiles",
            tile_hint="work one [Br, Bc] tile at a time: slice the mask tile by tile as you slice K and V")


@exercise("flash_attn_masked", arg_names=["q", "k", "v", "mask"], reference="SDPA (float64, O = 0 and "
          "lse = -inf on fully masked rows)", budget=tiled_budget)
def flash_attn_masked(g):
    bugs_o, bugs_lse = _models(0), _models(1)
    for case in _masked_cases():
        q, k, v, mask = case.args
        out = g.call(case)
        check_o_lse(g, out, reference.attention(q, k, v, mask=mask), dtype=q.dtype,
                    o_bugs=bugs_o, lse_bugs=bugs_lse, nan_hint=_NAN,
                    o_hint="a fully masked row has O = 0; other rows are softmax over their visible keys only",
                    lse_hint="lse = m + log(l) where l > 0, and -inf where the row saw no key")
        g.count()
    _idea(g)
    check_tiled_memory(g, memory_case(52, lambda N, Nk: make_mask("sliding window", N, Nk)))
