"""Checkers of lesson 02, FlashAttention V1: ``flash_attn_v1(q, k, v, Br, Bc) -> O``.

Reference: SDPA in float64 (``helpers.reference.attention``). The cases and the bug
models here are shared with lesson 03 (V2), which imports them.
"""
from __future__ import annotations

import math

import torch

from .. import meter, reference
from ..checking import Bug, Case, exercise

# float32 tiles against a float64 reference: a few rounding steps per KV block.
RTOL, ATOL = 1e-4, 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qkv(N, Nk, d, gen, qmul=1.0):
    q = torch.randn(N, d, generator=gen) * qmul
    k = torch.randn(Nk, d, generator=gen)
    v = torch.randn(Nk, d, generator=gen)
    return q, k, v


def attention_cases():
    """Random and adversarial (q, k, v, Br, Bc) cases for the per-head CPU kernels (no mask)."""
    g = _gen(20)
    cases = [
        Case("the lesson's walk-through: N = Nk = 6, d = 4, Br = 4, Bc = 3 (ragged last Q block)",
             *_qkv(6, 6, 4, g), Br=4, Bc=3),
        Case("N = 1 (one query, decoding)", *_qkv(1, 9, 8, g), Br=4, Bc=3),
        Case("Nk = 1 (one key)", *_qkv(5, 1, 4, g), Br=2, Bc=3),
        Case("Nk != N, neither a multiple of its tile", *_qkv(7, 11, 4, g), Br=4, Bc=3),
        Case("tiles larger than the input", *_qkv(5, 3, 4, g), Br=16, Bc=16),
        Case("odd head dim d = 5", *_qkv(9, 10, 5, g), Br=4, Bc=3),
        Case("Br = Bc = 1 (every tile a single score)", *_qkv(4, 5, 3, g), Br=1, Bc=1),
        Case("large logits (q scaled by 40)", *_qkv(10, 13, 8, g, qmul=40.0), Br=4, Bc=3,
             note="exp overflows unless each tile subtracts its running max"),
        Case("random, larger", *_qkv(45, 67, 8, g), Br=8, Bc=16),
    ]
    # the max moves at every KV block: scores grow with the key index, so every step rescales
    N, Nk, d = 6, 12, 4
    q = torch.rand(N, d, generator=g) + 0.5
    k = (torch.arange(float(Nk))[:, None] * 0.9).expand(Nk, d).contiguous()
    v = torch.randn(Nk, d, generator=g)
    cases.append(Case("the max grows at every KV block (alpha < 1 at each step)", q, k, v, Br=4, Bc=3,
                      note="scores rise with the key index, so each new block holds a larger max"))
    cases.append(Case("the max is in the first KV block", q, k.flip(0).contiguous(), v, Br=4, Bc=3))
    return cases


# ------------------------------------------------------------------ bug models (float64)
def tiled_model(q, k, v, Br, Bc, *, scale=None, bug=None):
    """The tiled loop in float64 with one planted mistake; returns (O, lse).

    bug: None, "no_l_back" (V1: forgot to multiply the old O by the old l), "no_alpha" (the old
    O not rescaled by alpha), "no_alpha_l" (l not rescaled), "no_divide" (O never divided by l),
    "drop_ragged" (the last, partial tiles skipped).
    """
    q, k, v = q.double(), k.double(), v.double()
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    O = torch.zeros(N, v.shape[1], dtype=torch.float64)
    lse = torch.full((N,), -math.inf, dtype=torch.float64)
    n_rows = N - N % Br if bug == "drop_ragged" else N
    n_cols = Nk - Nk % Bc if bug == "drop_ragged" else Nk
    for i in range(0, n_rows, Br):
        Qi = q[i:i + Br]
        acc = torch.zeros(Qi.shape[0], v.shape[1], dtype=torch.float64)
        m = torch.full((Qi.shape[0],), -math.inf, dtype=torch.float64)
        l = torch.zeros(Qi.shape[0], dtype=torch.float64)
        for j in range(0, n_cols, Bc):
            S = Qi @ k[j:j + Bc].T * scale
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            l_new = (l if bug == "no_alpha_l" else alpha * l) + P.sum(1)
            if bug == "no_l_back":      # V1's normalised O without the old l: (alpha O + P V) / l_new
                acc = (alpha[:, None] * acc + P @ v[j:j + Bc]) / l_new[:, None]
            elif bug == "no_alpha":     # keep acc normalised like V1, forgetting alpha
                acc = ((l)[:, None] * acc + P @ v[j:j + Bc]) / l_new[:, None]
            elif bug == "no_divide":
                acc = alpha[:, None] * acc + P @ v[j:j + Bc]
            else:                       # normalised running O (V1's form)
                acc = ((alpha * l)[:, None] * acc + P @ v[j:j + Bc]) / l_new[:, None]
            m, l = m_new, l_new
        O[i:i + Br] = acc
        lse[i:i + Br] = m + torch.log(l)
    return O, lse


def o_bugs():
    """The Bug models of the output O (shared by V1 and V2)."""
    def kw(c):
        return c.kwargs.get("Br", 4), c.kwargs.get("Bc", 3)

    def model(bug=None, scale=None):
        return lambda c: tiled_model(*c.args, *kw(c), bug=bug,
                                     scale=None if scale is None else scale(c.args[0].shape[1]))[0]
    return [
        Bug("the old O was not multiplied back by the old l: O is stored normalised (divided by l), so "
            "O_new = (alpha * l_old * O_old + exp(m_blk - m_new) * P_ij @ V_j) / l_new", model("no_l_back")),
        Bug("the old O (or acc) was not rescaled when the max grew: multiply it by alpha = exp(m_old - m_new) "
            "(V2: acc = alpha * acc + P_ij @ V_j)",
            model("no_alpha")),
        Bug("the running l was not rescaled when the max grew: l_new = alpha * l_old + rowsum(P_ij)",
            model("no_alpha_l")),
        Bug("O was never divided by l: the sum of exp(S - m) @ V is unnormalised; divide by l "
            "(V1: at each step; V2: once, after the KV loop)", model("no_divide")),
        Bug("the scores are not scaled by 1/sqrt(d): S_ij = Qi @ Kj.T * (1 / sqrt(d))", model(scale=lambda d: 1.0)),
        Bug("the scale is 1/sqrt(d), not 1/d", model(scale=lambda d: 1.0 / d)),
        Bug("the scale is 1/sqrt(d), not sqrt(d)", model(scale=lambda d: math.sqrt(d))),
        Bug("the last, ragged tiles were skipped: range(0, N, Br) with q[i:i+Br] (and range(0, Nk, Bc)) "
            "covers them", model("drop_ragged")),
    ]


# ------------------------------------------------------------------ the idea, measured
IDEA_N, IDEA_NK, IDEA_D, IDEA_BR, IDEA_BC = 32, 40, 4, 8, 8


def idea_case():
    q, k, v = _qkv(IDEA_N, IDEA_NK, IDEA_D, _gen(21))
    return Case(f"the idea, metered: N = {IDEA_N}, Nk = {IDEA_NK}, d = {IDEA_D}, Br = {IDEA_BR}, Bc = {IDEA_BC}",
                q, k, v, Br=IDEA_BR, Bc=IDEA_BC)


def measure_case(g, case):
    """Meter one call of the learner's function on copies of ``case``'s inputs."""
    g.case = case
    q, k, v = (a.clone() for a in case.args)
    try:
        return meter.measure(g.fn, q, k, v, names=("q", "k", "v"), **case.kwargs)
    except Exception as e:  # noqa: BLE001 - the same function passed the cases; say what broke here
        g.fail(f"your function raised {type(e).__name__} while metered: {e}",
               hint="the meter calls your function once more on this case; it must run on any shapes")


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
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} (aten.{r.largest.op}): {what}; "
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
            g.fail(f"`{name}` was read {got / k_bytes:g} times from HBM (once is V1's order)",
                   hint="V1 puts the KV loop outside: load Kj = k[j:j+Bc] and Vj = v[j:j+Bc] once, before the "
                        "loop over Q blocks, and use them for every Qi; the Q blocks are read again for each "
                        "KV block (V2 is the other way round)")
    g.count()
