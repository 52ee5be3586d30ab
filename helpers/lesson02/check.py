"""Checkers of lesson 02, FlashAttention V1: ``flash_attn_v1(q, k, v, Br, Bc) -> O``.

Reference: SDPA in float64 (``helpers.reference.attention``). The cases, the tiled bug model and
the O bugs (shared with lesson 03, V2) live in ``helpers.cases``.
"""
from __future__ import annotations

from .. import reference
from ..checking import exercise
from ..cases import (ATOL, IDEA_D, IDEA_NK, RTOL, attention_cases, check_tiled_memory,  # noqa: F401
                      check_tiles_only, idea_case, measure_case, memory_case, o_bugs, tiled_budget,
                      tiled_model)  # tiled_model: tests import it from here


# ------------------------------------------------------------------ flash_attn_v1
@exercise("flash_attn_v1", arg_names=["q", "k", "v"], reference="SDPA (float64)", budget=tiled_budget)
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
    check_tiled_memory(g, memory_case(22))
    g.count()
