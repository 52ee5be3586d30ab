"""Checkers of lesson 02, FlashAttention V1: ``flash_attn_v1(q, k, v, Br, Bc) -> O``.

Reference: SDPA in float64 (``helpers.reference.attention``). The cases, the tiled bug model and
the O bugs (shared with lesson 03, V2) live in ``helpers.check._common``.
"""
from __future__ import annotations

import math

import torch

from .. import reference
from ..checking import Case, exercise
from ._common import ATOL, RTOL, attention_cases, gen, o_bugs, qkv, tiled_model  # noqa: F401 - re-exported

_gen, _qkv = gen, qkv

# ------------------------------------------------------------------ the idea, measured
IDEA_N, IDEA_NK, IDEA_D, IDEA_BR, IDEA_BC = 32, 40, 4, 8, 8


def idea_case():
    q, k, v = _qkv(IDEA_N, IDEA_NK, IDEA_D, _gen(21))
    return Case(f"the idea, metered: N = {IDEA_N}, Nk = {IDEA_NK}, d = {IDEA_D}, Br = {IDEA_BR}, Bc = {IDEA_BC}",
                q, k, v, Br=IDEA_BR, Bc=IDEA_BC)


def measure_case(g, case):
    """Meter one call of the learner's function on copies of ``case``'s inputs (``Grader.measure``)."""
    return g.measure(case, names=("q", "k", "v"))


def check_tiles_only(g, r, case):
    """No N x Nk score matrix (nor a score strip wider than a tile), and no call to SDPA."""
    q, k, _ = case.args
    N, d = q.shape
    Nk = k.shape[0]
    Br, Bc = case.kwargs["Br"], case.kwargs["Bc"]
    sdpa = sorted(op for op in r.ops if "scaled_dot_product" in op or "softmax" in op)
    if sdpa:
        g.fail(f"your function calls {', '.join('aten.' + s for s in sdpa)}",
               hint="the exercise is to build attention from tiles: matmuls, exp, max and sums on "
                    "[Br, Bc] blocks; SDPA or softmax on the whole row is what FlashAttention replaces")
    limit = max(Br * Bc, Br * d, Bc * d, N * d, Nk * d, N, Nk)
    if r.largest.numel > limit:
        big = r.largest.numel >= N * Nk
        what = "the whole N x Nk score matrix" if big else "a score block larger than a tile"
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}): {what}; "
               f"with Br = {Br}, Bc = {Bc}, d = {d} nothing larger than [{Br}, {Bc}] tiles and [N, d] rows is needed",
               hint="the right output from a materialised score matrix defeats FlashAttention: its point is "
                    "never writing the N x Nk matrix to HBM. Compute S_ij = Qi @ Kj.T * scale one [Br, Bc] "
                    "tile at a time and fold it into (m, l, O)")


# ------------------------------------------------------------------ flash_attn_v1
@exercise("flash_attn_v1", arg_names=["q", "k", "v"], reference="SDPA (float64)")
def flash_attn_v1(g):
    bugs = o_bugs()
    for case in attention_cases():
        q, k, v = case.args
        out = g.call(case)
        O = g.expect_tensor(out, "O", shape=(q.shape[0], v.shape[1]), dtype=q.dtype)
        O_ref, _ = reference.attention(q, k, v)
        g.compare(O, O_ref, "O", rtol=RTOL, atol=ATOL, bugs=bugs,
                  nan_hint="NaN in O: the first step has m_old = -inf and l_old = 0; exp(m_old - m_new) is 0 "
                           "there, fine, but -inf - -inf is NaN: start m at -inf and take m_new from the tile",
                  hint="O_new = (alpha * l_old * O_old + exp(m_blk - m_new) * P_ij @ V_j) / l_new, "
                       "with P_ij = exp(S_ij - m_blk)")
        g.count()
    case = idea_case()
    r = measure_case(g, case)
    check_tiles_only(g, r, case)
    k_bytes = IDEA_NK * IDEA_D * case.args[1].element_size()
    for name in ("k", "v"):
        got = r.reads.get(name, 0)
        if got > k_bytes:
            g.fail(f"`{name}` was read {got / k_bytes:g} times from HBM (once is V1's order; a copy such as "
                   f"{name}.double() still counts as {name})",
                   hint="V1 puts the KV loop outside: load Kj = k[j:j+Bc] and Vj = v[j:j+Bc] once, before the "
                        "loop over Q blocks, and use them for every Qi; the Q blocks are read again for each "
                        "KV block (V2 is the other way round)")
    g.count()
