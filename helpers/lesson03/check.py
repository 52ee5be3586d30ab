"""Checkers of lesson 03, FlashAttention V2: ``flash_attn_v2(q, k, v, Br, Bc) -> (O, lse)``.

References: SDPA and ``torch.logsumexp`` of the scaled scores, in float64
(``helpers.reference.attention``). Beyond the output, the checker meters the idea:
Q read once, O written once, no N x Nk intermediate.
"""
from __future__ import annotations

import math

import torch

from .. import reference
from ..checking import Bug, Case, exercise
from ..cases import (ATOL, IDEA_BC, IDEA_D, IDEA_N, RTOL, attention_cases, check_o_lse, check_tiled_memory,
                      check_tiles_only, idea_case, measure_case, memory_case, o_bugs, tiled_budget, tiled_model)


def _scores(c):
    q, k, _ = (a.double() for a in c.args)
    return q @ k.T / math.sqrt(q.shape[1])


def lse_bugs():
    def kw(c):
        return c.kwargs.get("Br", 4), c.kwargs.get("Bc", 3)
    return [
        Bug("that is the row max m, not the LSE: lse = m + log(l)", lambda c: _scores(c).amax(1)),
        Bug("that is log2 of the sum: the course's lse is the natural log. With exp2 and log2(e) folded into "
            "qk_scale, convert back: lse = (m2 + log2(l)) * ln(2)", lambda c: torch.logsumexp(_scores(c), 1) / math.log(2)),
        Bug("that is log(l) alone: add the max back, lse = m + log(l)",
            lambda c: torch.logsumexp(_scores(c), 1) - _scores(c).amax(1)),
        Bug("that is l (the sum), not its log: lse = m + log(l)",
            lambda c: torch.exp(torch.logsumexp(_scores(c), 1) - _scores(c).amax(1))),
        Bug("the scores behind lse are not scaled by 1/sqrt(d): lse is logsumexp of Qi @ Kj.T * scale",
            lambda c: tiled_model(*c.args, *kw(c), scale=1.0)[1]),
        Bug("the scale is 1/sqrt(d), not 1/d",
            lambda c: tiled_model(*c.args, *kw(c), scale=1.0 / c.args[0].shape[1])[1]),
        Bug("the last, ragged tiles were skipped: range(0, N, Br) and range(0, Nk, Bc) cover them",
            lambda c: tiled_model(*c.args, *kw(c), bug="drop_ragged")[1]),
        Bug("l was not rescaled when the max grew: l_new = alpha * l_old + rowsum(P_ij)",
            lambda c: tiled_model(*c.args, *kw(c), bug="no_alpha_l")[1]),
    ]


@exercise("flash_attn_v2", arg_names=["q", "k", "v"], reference="SDPA and torch.logsumexp (float64)",
          budget=tiled_budget)
def flash_attn_v2(g):
    bugs_o, bugs_lse = o_bugs(), lse_bugs()
    for case in attention_cases():
        q, k, v = case.args
        out = g.call(case)
        check_o_lse(g, out, reference.attention(q, k, v), dtype=q.dtype, o_tol=(RTOL, ATOL), lse_tol=(RTOL, ATOL),
                    o_bugs=bugs_o, lse_bugs=bugs_lse, lse_nan_hint="",
                    o_nan_hint="NaN in O: at the first KV block m_old = -inf; take m_new from the tile before "
                               "computing exp(m_old - m_new), and divide by l only after the KV loop",
                    o_hint="acc = alpha * acc + P_ij @ V_j with P_ij = exp(S_ij - m_new), then O_i = acc / l "
                           "after the KV loop",
                    lse_hint="lse = m + log(l) per row, natural log, after the KV loop")
        g.count()

    # the idea: Q read once, O written once, tiles only
    case = idea_case()
    r = measure_case(g, case)
    check_tiles_only(g, r, case)
    esize = case.args[0].element_size()
    q_bytes = o_bytes = IDEA_N * IDEA_D * esize
    n_kv = math.ceil(case.args[1].shape[0] / IDEA_BC)
    read_q = r.reads.get("q", 0)
    written_o = r.writes.get("out0", 0)
    # everything written except lse (and at most an m and an l of N each): O once
    written_rest = r.hbm_write_bytes - r.writes.get("out1", 0)
    o_times = max(written_o, written_rest - 2 * IDEA_N * esize) / o_bytes
    q_times = read_q / q_bytes
    if q_times > 1 and o_times > 1:
        g.fail(f"q was read {q_times:g} times from HBM and O written {o_times:g} times ({n_kv} KV blocks); "
               "V2 reads q once and writes O once",
               hint="that is V1's loop order renamed: O, m, l make a round trip to HBM for every KV block. "
                    "V2 swaps the loops, Q blocks outside, KV blocks inside: load Qi = q[i:i+Br] once, keep acc, "
                    "m, l in SRAM (local tensors) for the whole KV loop, write O_i = acc / l once at the end")
    if q_times > 1:
        g.fail(f"q was read {q_times:g} times from HBM; V2 reads it once",
               hint="load Qi = q[i:i+Br] once, before the KV loop, and reuse it; slicing q again inside the "
                    "KV loop is a new load from HBM each time")
    if o_times > 1:
        g.fail(f"O was written {o_times:g} times to HBM; V2 writes it once",
               hint="keep acc in SRAM (a local tensor) during the KV loop and write O[i:i+Br] = acc / l once, "
                    "after it: each extra write is a round trip to HBM that V2 exists to remove")
    g.count()
    _divide_once(g)
    g.count()
    check_tiled_memory(g, memory_case(32))
    g.count()


def _divide_once(g):
    """The lesson's title: O is divided by l once per row, after the KV loop (V1 divides at every KV block).

    The meter counts elements divided by a tensor of more than one element (``acc / l[:, None]``,
    ``1 / l``); dividing the scores by a constant (``S / math.sqrt(d)``) is not counted.
    """
    N, Nk, d, Br, Bc = 16, 64, 4, 4, 4
    gen = torch.Generator().manual_seed(23)
    q, k, v = torch.randn(N, d, generator=gen), torch.randn(Nk, d, generator=gen), torch.randn(Nk, d, generator=gen)
    n_kv = math.ceil(Nk / Bc)
    r = g.measure(Case(f"divide once (metered): N = {N}, Nk = {Nk} in {n_kv} KV blocks, d = {d}, Br = Bc = {Br}",
                       q, k, v, Br=Br, Bc=Bc), names=("q", "k", "v"))
    once = N * d
    if r.divisions > N * (d + 1):
        g.fail(f"your function divided {r.divisions:,} elements by a tensor such as l, over {n_kv} KV blocks; V2 "
               f"divides each row of O once, after the KV loop: the {once} elements of O = acc / l",
               hint="that is V1's update (O kept normalised: divide by l_new at every KV block). V2 keeps acc "
                    "unnormalised during the KV loop, acc = alpha * acc + P_ij @ V_j, and divides once after it, "
                    "O_i = acc / l: one division per element of O instead of one per KV block")
