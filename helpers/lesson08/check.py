"""Checkers of lesson 08, the backward pass: ``attn_bwd_preprocess``, ``flash_attn_bwd`` and
``FlashAttentionFunction``.

Reference: ``torch.autograd`` through SDPA in float64 (``helpers.reference.attention``, whose
empty rows give O = 0 and zero gradients), and ``torch.autograd.gradcheck`` in float64 for
the Function. Beyond the numbers, each checker meters the learner's call (``_meter``, the
one place that does): nothing ``N x Nk``, K and V read once, O read once (D computed once), P
recomputed from lse (no max, no softmax), 2.5x the forward's FLOPs as matmuls (causal: only the
visible tiles, matmul and elementwise), and for the Function, only q, k, v, o, lse saved (tensors
on ctx are found in lists, tuples and dicts too). What the meter cannot see is watched in one
more, unmetered call (``_Watch``): calls into autograd, how many score tiles are alive at once,
and the writes into dq, dk, dv element by element (dK, dV once; dQ once per KV block).
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from .. import reference
from ..checking import Bug, Case, _where_in_learner_code, exercise
from ..cases import visible_tile_flops, GRAD_ATOL as ATOL, GRAD_RTOL as RTOL, NEG_INF, gen

BWD_NAMES = ("q", "k", "v", "o", "lse", "do")


def _mask(N, Nk, causal, align):
    return reference.causal_mask(N, Nk, align) if causal else None


def reference_grads(q, k, v, do, causal=False, align="top_left"):
    """float64 (O, lse, dq, dk, dv) by torch.autograd through SDPA (``helpers.reference.attention_grads``)."""
    return reference.attention_grads(q, k, v, do, mask=_mask(q.shape[0], k.shape[0], causal, align))


class _Watch:
    """What the meter does not see, watched during one call (unmetered: the meter keeps every tensor alive):
    calls into autograd, the most ``[Br, Bc]`` score tiles (S, P, dP, dS) alive at once (tiles kept
    for a second sweep), and the order in which the score tiles S_ij were made.

    The order is read from the tiles' values, not from where dQ is kept: every tile-shaped tensor a torch op
    makes is compared, after the call, with the tiles of ``q @ k.T`` (up to a positive factor: the scale, or
    log2(e) with it; transposed too). So a dQ accumulated in HBM, in a float64 copy, in a numpy array or in a
    list of tiles reads the same: KV blocks outside make S_00, S_10, S_20, ..., Q blocks outside S_00, S_01,
    ... (``tile_order``; empty when no score tile was made by torch, e.g. all in numpy)."""

    def __init__(self, tile_shapes=(), q=None, k=None, Br=None, Bc=None):
        self.autograd, self.live, self.peak_tiles, self.tile_shapes = [], 0, 0, set(tile_shapes)
        self.written = {}       # storage -> elements written into it in place (results, not zero fills)
        self.out_writes = []    # per returned tensor: elements written in place / its elements
        self.kept = []          # the tensors written into (their storages keyed by address)
        self.scores = None if q is None else (q.double() @ k.double().T, Br, Bc)   # [N, Nk] in float64
        self.made_tiles = []    # tile-shaped tensors made, in order (float64 copies), matched after the call
        self.tile_order = []    # (Q block, KV block) of each run of S tiles, in the order they were made

    def wrote(self, func, args):
        """Elements an in-place op writes: a slice's elements, or an index_add_'s rows (not the whole tensor);
        the store that ends ``x[s] += y`` (a copy of the slice onto itself) and zero fills are not results."""
        name = func.overloadpacket.__name__
        if name in ("zero_", "fill_") or not args or not isinstance(args[0], torch.Tensor):
            return
        dst = args[0]
        if not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments[:1]):
            return
        if name == "copy_" and isinstance(args[1], torch.Tensor) and args[1].data_ptr() == dst.data_ptr() \
                and args[1].shape == dst.shape and args[1].stride() == dst.stride():
            return
        n = dst.numel()
        if name in ("index_add_", "index_copy_", "index_fill_") and len(args) > 2 and dst.dim():
            n = args[2].numel() * (dst.numel() // max(dst.shape[args[1]], 1))
        elif name in ("index_put_", "_index_put_impl_") and len(args) > 2 and isinstance(args[2], torch.Tensor):
            n = args[2].numel()
        key = dst.untyped_storage().data_ptr()
        self.written[key] = self.written.get(key, 0) + n
        self.kept.append(dst)     # alive till the call ends: a freed buffer's address is not a new tensor's

    def _gone(self):
        self.live -= 1

    def made(self, out):
        import weakref
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor) and tuple(t.shape) in self.tile_shapes:
                self.live += 1
                self.peak_tiles = max(self.peak_tiles, self.live)
                weakref.finalize(t, self._gone)
                if self.scores is not None and t.dtype.is_floating_point:
                    self.made_tiles.append(t.detach().double().clone())

    def _order(self):
        """Match each made tile with a tile of S = q k^T (cosine above 1 - 1e-6, a positive factor); the runs of
        equal (Q block, KV block) in the order made: one run per tile for one pass, two for two passes."""
        S, Br, Bc = self.scores
        N, Nk = S.shape
        units = {}  # tile shape -> ([(Q block, KV block)], [tiles, Br * Bc] the unit-norm tiles of S of that shape)
        for bi, i in enumerate(range(0, N, Br)):
            for bj, j in enumerate(range(0, Nk, Bc)):
                ref = S[i:i + Br, j:j + Bc]
                norm = ref.norm()
                if norm > 0:
                    at, vecs = units.setdefault(tuple(ref.shape), ([], []))
                    at.append((bi, bj))
                    vecs.append(ref.flatten() / norm)
        units = {shape: (at, torch.stack(vecs)) for shape, (at, vecs) in units.items()}
        order = []
        for t in self.made_tiles:
            hits = []
            for cand in (t, t.T):
                at, vecs = units.get(tuple(cand.shape), (None, None))
                norm = cand.norm()
                if at is not None and norm > 0:
                    cos = (vecs @ cand.flatten() / norm).tolist()  # [tiles]: the cosine with each tile of S
                    hits += [ij for ij, c in zip(at, cos) if c > 1 - 1e-6]
            # the first Q block with a match, its last KV block
            hit = max(ij for ij in hits if ij[0] == min(h[0] for h in hits)) if hits else None
            if hit and (not order or order[-1] != hit):
                order.append(hit)
        return order

    def run(self, fn, *args, **kwargs):
        from torch.utils._python_dispatch import TorchDispatchMode
        watch = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view:
                    watch.made(out)
                    watch.wrote(func, args)
                return out

        grad, backward = torch.autograd.grad, torch.autograd.backward

        def spy(name, orig):
            def call(*a, **kw):
                watch.autograd.append(name)
                return orig(*a, **kw)
            return call
        torch.autograd.grad, torch.autograd.backward = spy("grad", grad), spy("backward", backward)
        try:
            with Mode():
                out = fn(*args, **kwargs)
        finally:
            torch.autograd.grad, torch.autograd.backward = grad, backward
        self.out_writes = [self.written.get(t.untyped_storage().data_ptr(), 0) / max(t.numel(), 1)
                           if isinstance(t, torch.Tensor) else 0.0
                           for t in (out if isinstance(out, (tuple, list)) else (out,))]
        if self.scores is not None:
            self.tile_order, self.made_tiles = self._order(), []
        self.kept = []
        return out


def _meter(g, fn, case, names):
    """Meter one call of ``fn`` on copies of ``case``'s inputs: the framework's one step, ``g.measure``.

    A ``NotImplementedError`` raised only here, after the cases above returned, is a branch left
    unwritten (❌ naming it), not an untouched stub.
    """
    def metered(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            if g.returned == 0:
                raise
            g.fail(f"your function raised NotImplementedError when metered (called once more, on this case), "
                   f"after returning on {g.returned} cases{_where_in_learner_code(e.__traceback__)}",
                   hint="a branch of your function is not written yet (or still raises NotImplementedError): "
                        "this case takes it; the exercise must handle every case")
    return g.measure(case, fn=metered, names=names)


# ------------------------------------------------------------------ attn_bwd_preprocess
def _pre_cases():
    rng = gen(80)
    cases = [
        Case("N = 6, d = 4", torch.randn(6, 4, generator=rng), torch.randn(6, 4, generator=rng)),
        Case("N = 1", torch.randn(1, 8, generator=rng), torch.randn(1, 8, generator=rng)),
        Case("N = d = 5 (a square O: summing over the wrong dimension keeps the shape)",
             torch.randn(5, 5, generator=rng), torch.randn(5, 5, generator=rng)),
        Case("large values (O * 100, dO * 1000)", torch.randn(9, 16, generator=rng) * 100,
             torch.randn(9, 16, generator=rng) * 1000),
    ]
    o = torch.randn(7, 4, generator=rng)
    o[[0, 3]] = 0.0
    cases.append(Case("rows of O that are 0 (rows that saw no key)", o, torch.randn(7, 4, generator=rng),
                      note="D = 0 there"))
    return cases


@exercise("attn_bwd_preprocess", arg_names=["o", "do"], reference="rowsum(dO * O) in float64")
def attn_bwd_preprocess(g):
    def d64(c):
        return c.args[0].double(), c.args[1].double()
    bugs = [
        Bug("that is a sum over the rows (dim 0): D has one number per query row, D = (do * o).sum(dim=1)",
            lambda c: (d64(c)[0] * d64(c)[1]).sum(0)),
        Bug("that is a mean, not a sum: D = (do * o).sum(dim=1)", lambda c: (d64(c)[0] * d64(c)[1]).mean(1)),
        Bug("that is rowsum(O) alone: D = rowsum(dO * O), the elementwise product first",
            lambda c: d64(c)[0].sum(1)),
        Bug("that is rowsum(dO) alone: D = rowsum(dO * O), the elementwise product first",
            lambda c: d64(c)[1].sum(1)),
    ]
    for case in _pre_cases():
        o, do = case.args
        D = g.expect_tensor(g.call(case), "D", shape=(o.shape[0],), dtype=o.dtype)
        g.compare(D, (o.double() * do.double()).sum(1), "D", rtol=1e-5, atol=1e-4, bugs=bugs,
                  hint="D_i = sum_c dO[i, c] * O[i, c], one number per row")
        g.count()
    N, d = 32, 4
    case = Case(f"the idea, metered: N = {N}, d = {d}", torch.randn(N, d, generator=gen(81)),
                torch.randn(N, d, generator=gen(82)))
    r = _meter(g, g.fn, case, ("o", "do"))
    if r.largest.numel > N * d:
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} (aten.{r.largest.op}); "
               f"D needs nothing larger than [N, d] = [{N}, {d}]",
               hint="dO @ O.T builds an N x N matrix to keep only its diagonal: D = (do * o).sum(dim=1) "
                    "is N * d multiplications, not N * N * d")
    g.count()


# ------------------------------------------------------------------ flash_attn_bwd
def _bwd_case(name, q, k, v, do, note="", **kw):
    """A Case holding (q, k, v, o, lse, do): O and lse from the float64 reference, in the inputs' dtype."""
    causal, align = kw.get("causal", False), kw.get("align", "top_left")
    O, lse = reference.attention(q, k, v, mask=_mask(q.shape[0], k.shape[0], causal, align))
    return Case(name, q, k, v, O.to(q.dtype), lse.to(q.dtype), do, note=note, **kw)


def bwd_cases():
    """Random and adversarial cases: ragged tiles, N != Nk, one row, large logits, causal both alignments."""
    rng = gen(83)

    def qkvd(N, Nk, d, qmul=1.0):
        return (torch.randn(N, d, generator=rng) * qmul, torch.randn(Nk, d, generator=rng),
                torch.randn(Nk, d, generator=rng), torch.randn(N, d, generator=rng))

    empty = "bottom-right with N > Nk: the first N - Nk rows see no key; lse = -inf there, gradients 0"
    return [
        _bwd_case("the walk-through: N = Nk = 6, d = 4, Br = 4, Bc = 3 (ragged)", *qkvd(6, 6, 4), Br=4, Bc=3),
        _bwd_case("N = 1 (one query)", *qkvd(1, 9, 8), Br=4, Bc=3),
        _bwd_case("Nk = 1 (one key)", *qkvd(5, 1, 4), Br=2, Bc=3),
        _bwd_case("N != Nk, neither a multiple of its tile", *qkvd(7, 11, 4), Br=4, Bc=3),
        _bwd_case("tiles larger than the input", *qkvd(5, 3, 4), Br=16, Bc=16),
        _bwd_case("odd head dim d = 5, Br != Bc", *qkvd(9, 10, 5), Br=2, Bc=4),
        _bwd_case("Br = Bc = 1", *qkvd(4, 5, 3), Br=1, Bc=1),
        _bwd_case("large logits (q * 30)", *qkvd(10, 13, 8, qmul=30.0), Br=4, Bc=3,
                  note="a few keys take all the weight: P from a tile's own max is far from exp(S - lse)"),
        _bwd_case("random, larger", *qkvd(29, 37, 8), Br=8, Bc=16),
        _bwd_case("causal, square, ragged tiles", *qkvd(11, 11, 8), Br=4, Bc=3, causal=True),
        _bwd_case("causal, Nk > N", *qkvd(7, 19, 8), Br=4, Bc=3, causal=True),
        _bwd_case("causal, N > Nk", *qkvd(13, 6, 8), Br=4, Bc=3, causal=True),
        _bwd_case("causal, large logits (q * 30)", *qkvd(12, 16, 8, qmul=30.0), Br=4, Bc=3, causal=True),
        _bwd_case("causal bottom-right, Nk > N", *qkvd(7, 19, 8), Br=4, Bc=3, causal=True, align="bottom_right"),
        _bwd_case("causal bottom-right, N > Nk (rows that see no key)", *qkvd(13, 6, 8), Br=4, Bc=3,
                  causal=True, align="bottom_right", note=empty),
        _bwd_case("causal bottom-right, 1 x 1 tiles, N > Nk", *qkvd(7, 5, 4), Br=1, Bc=1, causal=True,
                  align="bottom_right", note=empty),
    ]


def bwd_model(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left", bug=None):
    """(dq, dk, dv) in float64 with one planted mistake (None: the right answer), tile by tile where
    the mistake depends on the tiles. ``o`` and ``lse`` are ignored: the exact ones are recomputed."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    vis = _mask(N, Nk, causal, align)
    vis = torch.ones(N, Nk, dtype=torch.bool) if vis is None else vis
    O, lse = reference.attention(q, k, v, mask=vis)
    S = q @ k.T * scale                                                  # [N, Nk]
    lse_safe = torch.where(torch.isneginf(lse), math.inf, lse)
    P = torch.where(vis, torch.exp(S - lse_safe[:, None]), 0.0)          # [N, Nk]
    if bug == "other_align":                            # the backward masks with the other alignment
        other = _mask(N, Nk, True, "bottom_right" if align == "top_left" else "top_left") if causal else vis
        P = torch.where(other, torch.exp(S - lse[:, None]), 0.0)
        vis = other
    elif bug == "no_mask":                                # every tile with a visible key, unmasked
        tiles = torch.zeros(N, Nk, dtype=torch.bool)
        for i in range(0, N, Br):
            for j in range(0, Nk, Bc):
                tiles[i:i + Br, j:j + Bc] = vis[i:i + Br, j:j + Bc].any()
        P = torch.where(tiles, torch.exp(S - lse[:, None]), 0.0)
    elif bug in ("tile_max", "tile_softmax"):
        P = torch.zeros_like(S)
        for j in range(0, Nk, Bc):
            s = S[:, j:j + Bc].masked_fill(~vis[:, j:j + Bc], NEG_INF)
            p = torch.exp(s - s.amax(1, keepdim=True))
            P[:, j:j + Bc] = p / p.sum(1, keepdim=True) if bug == "tile_softmax" else p
    elif bug == "no_lse":
        P = torch.where(vis, torch.exp(S), 0.0)
    dP = do @ v.T                                                        # [N, Nk]
    D = (do * O).sum(1)                                                  # [N]
    dV = P.T @ do
    if bug == "no_D":
        dS = P * dP
    elif bug == "D_tile":
        dS = torch.zeros_like(S)
        for j in range(0, Nk, Bc):
            Pj, dPj = P[:, j:j + Bc], dP[:, j:j + Bc]
            dS[:, j:j + Bc] = Pj * (dPj - (Pj * dPj).sum(1, keepdim=True))
    else:
        dS = P * (dP - D[:, None])                                       # [N, Nk]
    dQ = dS @ k * (1.0 if bug == "dq_no_scale" else scale)
    dK = dS.T @ q * (1.0 if bug == "dk_no_scale" else scale)
    if bug == "dv_from_dS":
        dV = dS.T @ do
    if bug == "dq_last_block":              # dq[i] = ... instead of +=: only the last KV block with work
        dQ = torch.zeros_like(q)
        for i in range(0, N, Br):
            for j in range(0, Nk, Bc):
                if vis[i:i + Br, j:j + Bc].any() or not causal:
                    dQ[i:i + Br] = dS[i:i + Br, j:j + Bc] @ k[j:j + Bc] * scale
    if bug in ("dkv_last_block", "dkv_last_block_k"):   # dKj = ... instead of +=: only the last Q block
        dK, dV = torch.zeros_like(k), torch.zeros_like(v)
        for j in range(0, Nk, Bc):
            for i in range(0, N, Br):
                if vis[i:i + Br, j:j + Bc].any() or not causal:
                    dK[j:j + Bc] = dS[i:i + Br, j:j + Bc].T @ q[i:i + Br] * scale
                    dV[j:j + Bc] = P[i:i + Br, j:j + Bc].T @ do[i:i + Br]
    return dQ, dK, dV


_P_HINT = ("P is recomputed from the saved lse: P = exp(S - lse_i) with S = Qi @ Kj.T * scale. A tile's own max "
           "(or sum) sees only Bc keys, so its P is not the softmax the forward used; lse holds the whole row's "
           "max and sum at once")
_NAN_HINT = ("NaN on a row that sees no key (bottom-right, N > Nk): its lse is -inf and its masked scores are -inf, "
             "so exp(S - lse) = exp(-inf + inf) = NaN; make P = 0 wherever the mask hides the key, e.g. "
             "P = torch.where(mask, torch.exp(S - lse_i[:, None]), 0.0): that row's gradients are then 0")


def _bwd_bugs(which):
    """Bug models of output ``which`` (0: dq, 1: dk, 2: dv)."""
    def model(bug):
        return lambda c: bwd_model(*c.args, **c.kwargs, bug=bug)[which]
    bugs = [
        Bug(_P_HINT, model("tile_max")),
        Bug(_P_HINT, model("tile_softmax")),
        Bug("P = exp(S) was not normalised: P = exp(S - lse_i), the lse the forward saved", model("no_lse")),
        Bug("that is the other alignment's mask: top-left sees j <= i, bottom-right j <= i + Nk - N",
            model("other_align")),
        Bug("no causal mask in the backward: P = exp(S - lse) is not 0 above the diagonal by itself; in a "
            "partial tile set P = 0 where key j > i + offset, as the forward masked S", model("no_mask")),
    ]
    if which == 2:
        bugs += [
            Bug("dV was built from dS: O = P V, so dV = P.T @ dO (dS is the gradient of the scores S, "
                "it goes into dQ and dK)", model("dv_from_dS")),
            Bug("dV_j was overwritten at every Q block: accumulate in SRAM, dVj += P.T @ dOi, and write it "
                "once after the Q loop", model("dkv_last_block")),
        ]
    else:
        bugs += [
            Bug("D is missing: dS = P * (dP - D) with D = rowsum(dO * O) ([N], attn_bwd_preprocess), computed "
                "once before the loops; without it dS is P * dP", model("no_D")),
            Bug("D was summed over one tile: rowsum(P * dP) over Bc keys is not D; D = rowsum(dO * O) over the "
                "whole row (attn_bwd_preprocess), once before the loops", model("D_tile")),
        ]
    if which == 0:
        bugs += [
            Bug("the scale is missing on dQ: S = Q K^T * scale, so dQ = dS @ K * scale", model("dq_no_scale")),
            Bug("dQ was overwritten at every KV block: dQ_i collects one term per KV block, "
                "dq[i:i+Br] += dS @ Kj * scale", model("dq_last_block")),
        ]
    if which == 1:
        bugs += [
            Bug("the scale is missing on dK: S = Q K^T * scale, so dK = dS.T @ Q * scale", model("dk_no_scale")),
            Bug("dK_j was overwritten at every Q block: accumulate in SRAM, dKj += dS.T @ Qi * scale, and write "
                "it once after the Q loop", model("dkv_last_block")),
        ]
    return bugs


# Elementwise work a visible tile of the backward may cost besides its five matmuls: per score (scale, mask,
# exp, dP - D, * P, casts), per element of the [Br, d] and [Bc, d] partials (scales, adds), per row; and per
# input element, once (D = rowsum(dO * O), copies).
_PER_SCORE, _PER_ACC, _PER_ROW, _PER_INPUT = 16, 6, 16, 8


def _largest_hint(shape, N, Nk, Br, Bc):
    """What a tensor larger than a tile most likely is, from its shape."""
    if len(shape) == 3 and shape[:2] in ((Br, Bc), (Bc, Br)):
        return ("a broadcast product (Qi[:, None] * Kj[None]).sum(-1) makes [Br, Bc, d]: write the five products "
                "per tile as matmuls, S = Qi @ Kj.T, dP = dOi @ Vj.T, ...")
    if shape == (N, N) and N != Nk:
        return ("an N x N matrix: dO @ O.T keeps only its diagonal; D = (do * o).sum(dim=1) is N * d "
                "multiplications (attn_bwd_preprocess)")
    if shape in ((N, Bc), (Bc, N), (Br, Nk), (Nk, Br)) and N * Nk > max(shape[0], shape[1]) * min(Br, Bc):
        return ("a strip of scores, every query row against one KV block (or one Q block against every key): "
                "tile both loops, Q blocks of Br rows inside KV blocks of Bc keys, so each S, P, dP, dS is [Br, Bc]")
    return ("the full P (or S, dP, dS) materialised: the backward exists so that P is never stored. Recompute it "
            "one [Br, Bc] tile at a time, P = exp(Qi @ Kj.T * scale - lse_i)")


def _bwd_idea(g):
    """The idea, metered: K, V read once; dK, dV written once; nothing N x Nk; no max, no softmax;
    D once; 10 N Nk d matmul FLOPs (2.5x the forward), only visible tiles when causal."""
    rng = gen(84)
    N, Nk, d, Br, Bc = 32, 40, 4, 8, 8
    q, k, v, do = (torch.randn(n, d, generator=rng) for n in (N, Nk, Nk, N))
    case = _bwd_case(f"the idea, metered: N = {N}, Nk = {Nk}, d = {d}, Br = {Br}, Bc = {Bc}", q, k, v, do,
                     Br=Br, Bc=Bc)
    r = _meter(g, g.fn, case, BWD_NAMES)
    watch = _Watch({(Br, Bc), (Bc, Br)}, q, k, Br, Bc)   # one more call, unmetered: the meter keeps every tensor alive
    g.call(case, fn=lambda *a, **kw: watch.run(g.fn, *a, **kw))
    banned = sorted(op for op in r.ops if "scaled_dot_product" in op or "softmax" in op)
    if banned:
        g.fail(f"your function calls {', '.join('aten.' + s for s in banned)}",
               hint="the exercise is the backward from tiles: recompute P = exp(S - lse) per [Br, Bc] tile; "
                    "autograd through SDPA or softmax is what it replaces")
    if watch.autograd:
        g.fail(f"your function calls torch.autograd.{watch.autograd[0]} ({len(watch.autograd)} time(s))",
               hint="the exercise is the backward written by hand: per tile, dV += P.T @ dO, dP = dO @ V.T, "
                    "dS = P * (dP - D), dQ += dS @ K * scale, dK += dS.T @ Q * scale. Autograd on a tile "
                    "records the forward's graph and replays it, which is the memory the backward avoids")
    limit = max(Br * Bc, N * d, Nk * d, N, Nk)
    if r.largest.numel > limit:
        full = r.largest.numel >= N * Nk
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} (aten.{r.largest.op})"
               + (f": as large as the {N} x {Nk} matrix P" if full else ", larger than a [Br, Bc] tile"),
               hint=_largest_hint(tuple(r.largest.shape), N, Nk, Br, Bc))
    need = 10 * N * Nk * d
    if r.flops < need // 2:
        g.fail(f"your function did {r.flops:,} FLOPs in matmuls (and {r.elementwise_flops:,} elementwise); the "
               f"five products per tile are {need:,} = 2.5x the forward's",
               hint="the products were written elementwise (a broadcast * then .sum(), or Python loops): write "
                    "them as matmuls, S = Qi @ Kj.T, dVj += P.T @ dOi, dP = dOi @ Vj.T, dq_i += dS @ Kj, "
                    "dKj += dS.T @ Qi; on a GPU these are tl.dot on tensor cores")
    n_q, n_kv = math.ceil(N / Br), math.ceil(Nk / Bc)
    if watch.peak_tiles > n_q * n_kv // 2:
        g.fail(f"your function kept {watch.peak_tiles} [{Br}, {Bc}] score tiles alive at once ({n_q} x {n_kv} "
               "tiles in all): tiles of P (or S, dP, dS) stored for a second sweep",
               hint="that is the whole P, a tile at a time: SRAM holds one tile. Use each P tile where it is "
                    "made (dV, dP, dS, dQ, dK in the same step) and recompute it rather than keep it")
    esize = q.element_size()                  # bytes per element of the inputs (float32: 4)
    kv = Nk * d * esize
    read_k, read_v = r.reads.get("k", 0) / kv, r.reads.get("v", 0) / kv
    # writes into the outputs, element by element, from the watched call: `dk[j:j+Bc] += dKj` (the add, then
    # the store of the slice onto itself) and dk.index_add_(0, rows, dKj) write Bc rows once, not the whole dk
    wrote_q, wrote_k, wrote_v = (watch.out_writes + [0.0] * 3)[:3]
    # The loop order, from the order the score tiles were made (wherever dQ is kept); when torch made no score
    # tile (all in numpy), from dQ's writes into the returned tensor: once means summed in SRAM, Q blocks outside.
    order = watch.tile_order
    runs = Counter(order)
    two_sweeps = bool(runs) and max(runs.values()) >= 2           # S_ij made again after other tiles
    q_outer = len(order) >= 2 and not two_sweeps and all(a[0] <= b[0] for a, b in zip(order, order[1:])) \
        and any(a[0] == b[0] for a, b in zip(order, order[1:]))
    if not order:
        two_sweeps, q_outer = wrote_q <= 1, wrote_q == 1
    if (read_k > 1 or read_v > 1) and wrote_k <= 1 and two_sweeps:
        g.fail(f"k and v were read {read_k:g} times and dQ written once: that is the deterministic two-pass "
               "variant (a dK/dV pass, then a dQ pass with Q blocks outside)",
               hint="correct, but it recomputes S and dP in the second pass (3.5x the forward's FLOPs, not 2.5x). "
                    "The exercise is FlashAttention-2's one pass: KV blocks outside, and dq[i:i+Br] += dS @ Kj * "
                    "scale accumulated in HBM across KV blocks (atomic adds on a GPU)")
    if read_k > 1 or read_v > 1:
        g.fail(f"k was read {read_k:g} times and v {read_v:g} times from HBM; FlashAttention-2's backward "
               "reads each once",
               hint="KV blocks outside: load Kj = k[j:j+Bc] and Vj = v[j:j+Bc] once per outer step, before the "
                    "loop over Q blocks, and keep them (slicing k again inside the Q loop is a new load)")
    if wrote_k > 1 or wrote_v > 1:
        g.fail(f"dK went to HBM {wrote_k:g} times its size and dV {wrote_v:g} times ({n_q} Q blocks); each is "
               "written once, a KV block at a time",
               hint="dK/dV accumulated in HBM per tile: keep dKj, dVj as local [Bc, d] tensors (SRAM) for the "
                    "whole Q loop, += into them, and write dk[j:j+Bc] = dKj once after it")
    if n_kv > 1 and q_outer:
        seen = ", ".join(f"S{i}{j}" for i, j in order[:4])
        g.fail((f"your function made the score tiles Q block by Q block ({seen}, ...): " if watch.tile_order else
                f"dQ went to HBM {wrote_q:g} times its size with {n_kv} KV blocks: ") +
               "each dQ_i was summed in SRAM, so the Q blocks were the outer loop (and the K/V tiles, or dK/dV, "
               "were kept across it)",
               hint="with Q blocks outside, every K/V tile and its dK/dV partial must stay alive for the whole "
                    "run: a list of tiles is all of K, V, dK, dV in SRAM, which no GPU has. FlashAttention-2 "
                    "puts KV blocks outside (dKj, dVj in SRAM) and adds each tile's dQ into HBM: "
                    "dq[i:i+Br] += dS @ Kj * scale")
    if r.passes("o") > 1:
        g.fail(f"o was read {r.passes('o')} times: D = rowsum(dO * O) was recomputed inside the tile loops",
               hint="D = rowsum(dO * O) is computed once, before the loops (attn_bwd_preprocess), and read per "
                    "Q block as D[i:i+Br]; recomputing it per tile rereads O from HBM every time")
    stats = sorted(op for op in r.ops if op in ("amax", "max", "logsumexp", "_softmax", "softmax"))
    if stats:
        g.fail(f"your function calls {', '.join('aten.' + s for s in stats)}: a max over scores",
               hint="P is recomputed from lse alone, P = exp(S - lse_i): no max and no sum, lse already "
                    "holds the whole row's")
    if r.ops.get("sum", 0) > n_q:
        g.fail(f"your function called sum {r.ops['sum']} times (there are {n_q} Q blocks): a row sum inside "
               "the tile loops",
               hint="D = rowsum(dO * O) is computed once, before the loops (attn_bwd_preprocess), and P needs no "
                    "sum; a sum per tile recomputes D or normalises P, work the backward does not need")
    need = 10 * N * Nk * d
    if r.flops > need + 2 * N * d:         # (D written as a batched dot product counts 2 N d)
        g.fail(f"your function did {r.flops:,} matmul FLOPs; five [Br, Bc] matmuls per tile (S, dV, dP, dQ, "
               f"dK) make {need:,} = 2.5x the forward's {4 * N * Nk * d:,}",
               hint="a product computed twice: S = Qi @ Kj.T and dP = dOi @ Vj.T once per tile, then "
                    "dVj += P.T @ dOi, dq_i += dS @ Kj * scale, dKj += dS.T @ Qi * scale")
    ratio = r.flops / (4 * N * Nk * d)
    # causal: only the tiles with a visible key
    N = Nk = 24
    d, Br, Bc = 8, 4, 3
    q, k, v, do = (torch.randn(n, d, generator=rng) for n in (N, Nk, Nk, N))
    case = _bwd_case(f"the causal work, metered: N = Nk = {N}, d = {d}, Br = {Br}, Bc = {Bc}", q, k, v, do,
                     Br=Br, Bc=Bc, causal=True)
    r = _meter(g, g.fn, case, BWD_NAMES)
    vis = reference.causal_mask(N, Nk, "top_left")
    watch = _Watch({(Br, Bc), (Bc, Br)}, q, k, Br, Bc)     # which score tiles were made, however they were made
    g.call(case, fn=lambda *a, **kw: watch.run(g.fn, *a, **kw))
    hidden = sorted({(bi, bj) for bi, bj in watch.tile_order
                     if not vis[bi * Br:(bi + 1) * Br, bj * Bc:(bj + 1) * Bc].any()})
    if hidden:
        g.fail(f"your function made the scores of {len(hidden)} tiles that see no key "
               f"({', '.join(f'S{i}{j}' for i, j in hidden[:4])}{', ...' if len(hidden) > 4 else ''}; "
               f"N = Nk = {N}, Br = {Br}, Bc = {Bc}): the invisible causal tiles were computed",
               hint="skip them before any work, in the backward too (lesson 04's tile_class(i, j, Br, Bc, N, Nk, "
                    "align) == 'skip'): their P is 0, so they add nothing to dQ, dK or dV, and computing S there "
                    "(by a matmul or elementwise) is work a kernel never does")
    need = visible_tile_flops(vis, Br, Bc, d) * 10 // 4
    visible = [(min(Br, N - i0), min(Bc, Nk - j0)) for i0 in range(0, N, Br) for j0 in range(0, Nk, Bc)
               if vis[i0:i0 + Br, j0:j0 + Bc].any()]
    allowed = need + 2 * N * d + sum(_PER_SCORE * br * bc + _PER_ACC * (br + bc) * d + _PER_ROW * br
                                     for br, bc in visible) + _PER_INPUT * (N + Nk) * d
    if r.flops > need + 2 * N * d or r.total_flops > allowed:
        g.fail(f"your function did {r.flops:,} matmul FLOPs and {r.elementwise_flops:,} elementwise; the tiles "
               f"with a visible key need {need:,} in matmuls and at most {allowed:,} in all (every tile: "
               f"{10 * N * Nk * d:,} in matmuls)",
               hint="the invisible causal tiles were computed: skip them in the backward too (lesson 04's "
                    "tile_class(i, j, Br, Bc, N, Nk, align) == 'skip'): their P is 0, so they add nothing "
                    "to dQ, dK or dV")
    g.count(2)
    return ratio, r.flops / (4 * N * Nk * d)


@exercise("flash_attn_bwd", arg_names=list(BWD_NAMES), reference="torch.autograd (float64)")
def flash_attn_bwd(g):
    bugs = [_bwd_bugs(w) for w in range(3)]
    for case in bwd_cases():
        q, k, v, o, lse, do = case.args
        causal, align = case.kwargs.get("causal", False), case.kwargs.get("align", "top_left")
        out = g.call(case)
        dq, dk, dv = g.expect_tuple(out, 3, "(dq, dk, dv)")
        for t, name, like in ((dq, "dq", q), (dk, "dk", k), (dv, "dv", v)):
            g.expect_tensor(t, name, shape=like.shape, dtype=like.dtype)
        _, _, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, do, causal, align)
        for t, ref, name, b in ((dv, dv_ref, "dv", bugs[2]), (dk, dk_ref, "dk", bugs[1]), (dq, dq_ref, "dq", bugs[0])):
            g.compare(t, ref, name, rtol=RTOL, atol=ATOL, bugs=b, nan_hint=_NAN_HINT,
                      hint="go one line at a time: P = exp(S - lse), dV += P.T dO, dP = dO V.T, "
                           "dS = P * (dP - D), dQ += dS K * scale, dK += dS.T Q * scale")
        g.count()
    ratio, causal_ratio = _bwd_idea(g)
    return (f"{g.cases} cases match torch.autograd (float64), max rel err {g.max_rel_err:.0e}; "
            f"matmul FLOPs {ratio:.2f}x the forward's ({causal_ratio:.2f}x when causal)")


# ------------------------------------------------------------------ FlashAttentionFunction
def _fn_cases():
    rng = gen(85)

    def qkvd(N, Nk, d):
        return tuple(torch.randn(n, d, generator=rng) for n in (N, Nk, Nk, N))
    return [
        Case("not causal, N != Nk, ragged tiles", *qkvd(7, 11, 4), causal=False, Br=4, Bc=3),
        Case("causal, square", *qkvd(9, 9, 8), causal=True, Br=4, Bc=4),
        Case("causal, Nk > N", *qkvd(6, 10, 4), causal=True, Br=4, Bc=3),
        Case("causal, N > Nk, one big tile", *qkvd(10, 6, 8), causal=True, Br=16, Bc=16),
    ]


def _saved(grad_fn):
    """The tensors an autograd Function kept: save_for_backward's and any set on ctx as attributes."""
    saved = list(grad_fn.saved_tensors)
    extra = []

    def walk(name, val, depth=0):           # tensors in lists, tuples, dicts and sets on ctx, at any depth
        if isinstance(val, torch.Tensor):
            extra.append((name, val))
        elif depth < 4 and isinstance(val, (list, tuple, set, frozenset)):
            for x in val:
                walk(name, x, depth + 1)
        elif depth < 4 and isinstance(val, dict):
            for key, x in val.items():
                walk(f"{name}[{key!r}]", x, depth + 1)
    for name, val in vars(grad_fn).items():
        walk(name, val)
    return saved, extra


def _run_function(F, g):
    """A function of (q, k, v, dO, causal, Br, Bc) that applies F, reads what it saved, and backprops."""
    def run(q, k, v, do, causal=False, Br=16, Bc=16):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = F.apply(q, k, v, causal, Br, Bc)
        if not isinstance(o, torch.Tensor) or o.grad_fn is None:
            return ("not a tensor with a grad_fn", o)
        saved, extra = _saved(o.grad_fn)
        saved = [t.detach().clone() for t in saved]
        try:
            o.backward(do)
        except RuntimeError as e:
            if "incorrect number of gradients" in str(e):
                g.fail(f"autograd says: {e}",
                       hint="backward returns one gradient per forward input, in order: dq, dk, dv, and None for "
                            "causal, Br, Bc (six values)")
            if "invalid gradient" in str(e):
                g.fail(f"autograd says: {str(e).splitlines()[0]}",
                       hint="backward returns dq, dk, dv with the shapes of q, k, v (then None, None, None), in "
                            "that order: a gradient in another input's place, or a transposed one, has the "
                            "wrong shape")
            raise
        return o.detach(), q.grad, k.grad, v.grad, saved, extra
    run.__name__ = getattr(F, "__name__", "FlashAttentionFunction")
    return run


def _check_saved(g, saved, extra, N, Nk, d, lse_ref):
    allowed = {(N, d), (Nk, d), (N,)}
    big = [list(t.shape) for t in saved + [t for _, t in extra]
           if tuple(t.shape) not in allowed and t.numel() >= N * Nk]
    if big:
        g.fail(f"your Function kept a tensor of shape {big[0]} for the backward: P (or S), {N} x {Nk}",
               hint="the point of the backward is not to store P: save only q, k, v, o, lse "
                    "(ctx.save_for_backward(q, k, v, o, lse)) and recompute P tile by tile from lse")
    if extra:
        names = ", ".join(f"ctx.{n} {list(t.shape)}" for n, t in extra)
        g.fail(f"your Function keeps tensors as ctx attributes ({names})",
               hint="tensors go through ctx.save_for_backward(q, k, v, o, lse) (autograd checks them for "
                    "in-place changes and frees them after the backward); plain ctx attributes are for "
                    "numbers and flags such as causal, Br, Bc")
    want = sorted([(N, d), (Nk, d), (Nk, d), (N, d), (N,)])
    got = sorted(tuple(t.shape) for t in saved)
    if got != want:
        g.fail(f"your Function saved tensors of shapes {[list(s) for s in got]}; q, k, v, o, lse are "
               f"{[list(s) for s in want]}",
               hint="save exactly q, k, v, o and lse: the forward's lse ([N], natural log) replaces the row "
                    "max m and sum l (one number per row, not two)")
    lse = next(t for t in saved if t.dim() == 1)
    w = lse_ref.double()
    finite = torch.isfinite(w)
    if not (torch.equal(torch.isneginf(lse), torch.isneginf(w))
            and torch.allclose(lse.double()[finite], w[finite], rtol=1e-4, atol=1e-4)):
        g.fail("the [N] tensor your Function saved is not the natural-log lse of the scores",
               hint="save the lse the forward returns, logsumexp(q @ k.T * scale, dim=1) (natural log, -inf on "
                    "rows that see nothing): the backward recomputes P = exp(S - lse) from it")


@exercise("FlashAttentionFunction", arg_names=["q", "k", "v", "dO"],
          reference="torch.autograd through SDPA (float64) and gradcheck")
def FlashAttentionFunction(g):
    F = g.learner_fn                      # the class itself (g.fn wraps it with the time limit)
    if not hasattr(F, "apply"):
        g.fail(f"pass the class itself, a torch.autograd.Function; got {type(F).__name__}",
               hint="check.FlashAttentionFunction(FlashAttentionFunction)")
    run = _run_function(F, g)
    for case in _fn_cases():
        q, k, v, do = case.args
        N, Nk, d = q.shape[0], k.shape[0], q.shape[1]
        causal = case.kwargs["causal"]
        out = g.call(case, fn=run)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str):
            g.fail(f"FlashAttentionFunction.apply returned {type(out[1]).__name__} without a grad_fn",
                   hint="forward returns o (a tensor); call it as FlashAttentionFunction.apply(q, k, v, causal, Br, Bc)")
        o, dq, dk, dv, saved, extra = out
        O_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, do, causal)
        g.expect_tensor(o, "o", shape=(N, d), dtype=q.dtype)
        g.compare(o, O_ref, "o", rtol=RTOL, atol=ATOL,
                  hint="forward returns o = the attention output (the first of the forward's (o, lse))")
        _check_saved(g, saved, extra, N, Nk, d, lse_ref)
        for t, ref, name, other in ((dv, dv_ref, "dv", dk_ref), (dk, dk_ref, "dk", dv_ref), (dq, dq_ref, "dq", None)):
            if t is None:
                g.fail(f"no gradient reached `{name[1]}`",
                       hint="backward returns one gradient per forward input, in order: dq, dk, dv, None, None, None")
            bugs = [Bug("the gradients are returned in the wrong order: backward returns dq, dk, dv (then None for "
                        "causal, Br, Bc), the order of forward's inputs", lambda c, o_=other: o_)] if other is not None else []
            g.compare(t, ref, name, rtol=RTOL, atol=ATOL, bugs=bugs,
                      hint="if check.flash_attn_bwd passes, look at what backward hands it: the saved q, k, v, o, "
                           "lse, the incoming dO, and causal, Br, Bc from ctx")
        g.count()
    # gradcheck in float64 on small shapes
    rng = gen(86)
    for causal in (False, True):
        q, k, v = (torch.randn(n, 3, generator=rng, dtype=torch.float64) for n in (5, 7, 7))
        g.case = Case(f"torch.autograd.gradcheck, float64, causal={causal}", q, k, v, causal=causal, Br=2, Bc=3)
        inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
        # float64 in, float64 accuracy out: first the gradients against autograd, which says what is wrong
        do = torch.randn(5, 3, generator=rng, dtype=torch.float64)
        got = g.call(Case(g.case.name, q, k, v, do, causal=causal, Br=2, Bc=3), fn=run)
        ref = reference_grads(q, k, v, do, causal)
        err = max(((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300)).nan_to_num(math.inf).item()
                  for a, b in zip(got[1:4], ref[2:]))
        if err > 1e-3:
            g.fail(f"in float64 your gradients are off by a relative {err:.1e}: wrong, not rounding",
                   hint="the float32 cases above passed, so look at what differs here: float64 inputs, "
                        "causal=" + str(causal) + ", Br = 2, Bc = 3 (ragged tiles), and what backward hands "
                        "flash_attn_bwd (the saved tensors, dO, ctx.causal, ctx.Br, ctx.Bc)")
        try:
            ok = torch.autograd.gradcheck(lambda a, b, c: F.apply(a, b, c, causal, 2, 3), inputs,
                                          eps=1e-6, atol=1e-6, rtol=1e-4, raise_exception=True)
        except Exception as e:  # noqa: BLE001 - gradcheck's message says which input and where
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            float32 = "Jacobian mismatch" in str(e) and err >= 1e-9
            g.fail(f"torch.autograd.gradcheck failed: {first}",
                   hint="gradcheck runs in float64: allocate every tensor with dtype=q.dtype (torch.zeros_like(q), "
                        "torch.empty(..., dtype=q.dtype)), never a float32 default" if float32 else
                   "gradcheck compares backward with finite differences of forward, in float64: "
                   + ("forward and backward disagree (forward, or what backward hands flash_attn_bwd)"
                      if "Jacobian mismatch" in str(e) else
                      "its message says what it met (a non-tensor output, an input changed in place, "
                      "a gradient of the wrong shape or dtype)"))
        if not ok:
            g.fail("torch.autograd.gradcheck returned False", hint="compare backward with finite differences")
        if not err < 1e-9:
            g.fail(f"in float64 your gradients are off by a relative {err:.1e} (float64 arithmetic gives about 1e-15)",
                   hint="something computes in float32: allocate every tensor with dtype=q.dtype "
                        "(torch.zeros_like(q), torch.empty(..., dtype=q.dtype)), never a float32 default, and "
                        "don't cast with .float()")
        g.count()
    # the idea: nothing N x Nk during forward and backward
    N, Nk, d, Br, Bc = 32, 40, 4, 8, 8
    case = Case(f"the idea, metered: N = {N}, Nk = {Nk}, d = {d}, Br = {Br}, Bc = {Bc}",
                *(torch.randn(n, d, generator=rng) for n in (N, Nk, Nk, N)), causal=False, Br=Br, Bc=Bc)
    r = _meter(g, run, case, ("q", "k", "v", "do"))
    if r.largest.numel >= N * Nk:
        g.fail(f"forward and backward made a tensor of shape {list(r.largest.shape)} (aten.{r.largest.op}): "
               f"the {N} x {Nk} matrix",
               hint="use the tiled forward (lesson08.flash_attn_fwd) and your flash_attn_bwd; autograd through "
                    "a dense softmax stores P")
    g.count()
