"""Pieces shared by the lessons' checkers (one copy each): tolerances, ``NEG_INF``, the seeded
inputs, the attention cases, the tiled bug models, the ``(O, lse)`` comparison, the FLOPs of the visible
tiles, and the hints and inputs of the checkers that launch Triton kernels.

A lesson's checker (``helpers/lessonNN/check.py``) imports from here and from its own lesson's folder,
never from another lesson's checker. Part of the framework: it registers no exercise and imports no
Triton at module level.
"""
from __future__ import annotations

import math

import torch

from .checking import Budget, Bug, Case

__all__ = ["NEG_INF", "RTOL", "ATOL", "gen", "qkv", "tiles", "attention_cases", "tiled_model", "o_bugs",
           "masked_tiled_model", "check_o_lse", "tiled_budget", "memory_case", "check_tiled_memory"]

NEG_INF = -math.inf

# float32 tiles against a float64 reference: a few rounding steps per KV block.
RTOL, ATOL = 1e-4, 1e-5
# gradients (lesson 08), float32 tiles against float64 autograd: a few rounding steps per tile, on
# gradients of order 1.
GRAD_RTOL, GRAD_ATOL = 2e-4, 2e-5


def gen(seed: int) -> torch.Generator:
    """A seeded CPU generator: every checker's cases are the same on every run."""
    return torch.Generator().manual_seed(seed)


def qkv(N, Nk, d, generator, qmul=1.0):
    """Seeded per-head inputs in the default dtype: q [N, d] (times ``qmul``), k and v [Nk, d]."""
    q = torch.randn(N, d, generator=generator) * qmul
    k = torch.randn(Nk, d, generator=generator)
    v = torch.randn(Nk, d, generator=generator)
    return q, k, v


def tiles(case, Br=4, Bc=3):
    """A case's (Br, Bc), with the exercises' defaults."""
    return case.kwargs.get("Br", Br), case.kwargs.get("Bc", Bc)


def attention_cases():
    """Random and adversarial (q, k, v, Br, Bc) cases for the per-head CPU kernels (no mask)."""
    rng = gen(20)
    cases = [
        Case("the lesson's walk-through: N = Nk = 6, d = 4, Br = 4, Bc = 3 (ragged last Q block)",
             *qkv(6, 6, 4, rng), Br=4, Bc=3),
        Case("N = 1 (one query, decoding)", *qkv(1, 9, 8, rng), Br=4, Bc=3),
        Case("Nk = 1 (one key)", *qkv(5, 1, 4, rng), Br=2, Bc=3),
        Case("Nk != N, neither a multiple of its tile", *qkv(7, 11, 4, rng), Br=4, Bc=3),
        Case("tiles larger than the input", *qkv(5, 3, 4, rng), Br=16, Bc=16),
        Case("odd head dim d = 5", *qkv(9, 10, 5, rng), Br=4, Bc=3),
        Case("Br = Bc = 1 (every tile a single score)", *qkv(4, 5, 3, rng), Br=1, Bc=1),
        Case("large logits (q scaled by 40)", *qkv(10, 13, 8, rng, qmul=40.0), Br=4, Bc=3,
             note="exp overflows unless each tile subtracts its running max"),
        Case("random, larger", *qkv(45, 67, 8, rng), Br=8, Bc=16),
    ]
    # the max moves at every KV block: scores grow with the key index, so every step rescales
    N, Nk, d = 6, 12, 4
    q = torch.rand(N, d, generator=rng) + 0.5
    k = (torch.arange(float(Nk))[:, None] * 0.9).expand(Nk, d).contiguous()
    v = torch.randn(Nk, d, generator=rng)
    cases.append(Case("the max grows at every KV block (alpha < 1 at each step)", q, k, v, Br=4, Bc=3,
                      note="scores rise with the key index, so each new block holds a larger max"))
    cases.append(Case("the max is in the first KV block", q, k.flip(0).contiguous(), v, Br=4, Bc=3))
    return cases


# ------------------------------------------------------------------ the online-softmax tiled model (float64)
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


# ------------------------------------------------------------------ a tiled model, with knobs for bugs
def masked_tiled_model(q, k, v, vis, Br, Bc, *, computed=None, applied=None, fill=NEG_INF, partial_mask=None):
    """What a tiled kernel outputs, in float64: (O, lse).

    ``vis`` bool [N, Nk] is the truth; for each tile, ``computed(tile_vis)`` says whether the
    kernel computes it (default: it has a visible key) and ``applied(tile_vis)`` is the mask
    it applies (default: the truth), with masked scores set to ``fill``. ``partial_mask(i0, j0,
    br, bc)``, if given, is the mask a kernel builds for a tile that is partial (some, not all,
    of its keys visible); full tiles then get no mask. A row with no finite score left gets
    O = 0, lse = -inf, as the course's convention says.
    """
    computed = computed or (lambda t: bool(t.any()))
    applied = applied or (lambda t: t)
    q, k, v = q.double(), k.double(), v.double()
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    O = torch.zeros(N, v.shape[1], dtype=torch.float64)
    lse = torch.full((N,), NEG_INF, dtype=torch.float64)
    for i0 in range(0, N, Br):
        s_parts, v_parts = [], []
        for j0 in range(0, Nk, Bc):
            tv = vis[i0:i0 + Br, j0:j0 + Bc]
            if not computed(tv):
                continue
            s = q[i0:i0 + Br] @ k[j0:j0 + Bc].T * scale
            if partial_mask is not None:
                keep = torch.ones_like(tv) if tv.all() else partial_mask(i0, j0, *tv.shape)
            else:
                keep = applied(tv)
            s_parts.append(s.masked_fill(~keep, fill))
            v_parts.append(v[j0:j0 + Bc])
        if not s_parts:
            continue
        S, V = torch.cat(s_parts, 1), torch.cat(v_parts, 0)
        row_lse = torch.logsumexp(S, 1)
        P = torch.where(torch.isneginf(row_lse)[:, None], torch.zeros_like(S), torch.exp(S - row_lse[:, None]))
        O[i0:i0 + Br] = P @ V
        lse[i0:i0 + Br] = row_lse
    return O, lse


# ------------------------------------------------------------------ the (O, lse) comparison
def check_o_lse(g, out, ref, *, dtype, o_tol=(RTOL, ATOL), lse_tol=(1e-5, 1e-4), o_bugs=(), lse_bugs=(),
                nan_hint="", o_hint="", lse_hint="", o_nan_hint=None, lse_nan_hint=None, lse_first=False):
    """The tail every (O, lse) checker shares: a 2-tuple, shapes and dtype as the reference's, then
    ``g.compare`` of each output (lse first when ``lse_first``). Returns (O, lse)."""
    O_ref, lse_ref = ref
    O, lse = g.expect_tuple(out, 2, "(O, lse)")
    g.expect_tensor(O, "O", shape=tuple(O_ref.shape), dtype=dtype)
    g.expect_tensor(lse, "lse", shape=tuple(lse_ref.shape), dtype=dtype)
    steps = [
        lambda: g.compare(O, O_ref, "O", rtol=o_tol[0], atol=o_tol[1], bugs=o_bugs, hint=o_hint,
                          nan_hint=nan_hint if o_nan_hint is None else o_nan_hint),
        lambda: g.compare(lse, lse_ref, "lse", rtol=lse_tol[0], atol=lse_tol[1], bugs=lse_bugs, hint=lse_hint,
                          nan_hint=nan_hint if lse_nan_hint is None else lse_nan_hint),
    ]
    for step in (steps[::-1] if lse_first else steps):
        step()
    return O, lse


# ------------------------------------------------------------------ the idea, measured
IDEA_N, IDEA_NK, IDEA_D, IDEA_BR, IDEA_BC = 32, 40, 4, 8, 8


def idea_case():
    q, k, v = qkv(IDEA_N, IDEA_NK, IDEA_D, gen(21))
    return Case(f"the idea, metered: N = {IDEA_N}, Nk = {IDEA_NK}, d = {IDEA_D}, Br = {IDEA_BR}, Bc = {IDEA_BC}",
                q, k, v, Br=IDEA_BR, Bc=IDEA_BC)


# ------------------------------------------------------------------ the working-memory budget of a tiled kernel
def tiled_budget(case):
    """O(N·d + Br·Bc): what a tiled kernel (02-05) may hold beyond a copy of its inputs, in elements.

    Its output (O, lse and V1's m, l) twice over, a few [Br, Bc] tiles and a few [N] or [Nk] vectors;
    the N x Nk scores, in any form (a tensor, a numpy array, lists of floats), are orders of magnitude more
    on ``memory_case``'s sizes.
    """
    q, k = case.args[0], case.args[1]
    N, d = q.shape
    Nk = k.shape[0]
    Br, Bc = tiles(case)
    return Budget(2 * (N + Nk) * d + 4 * Br * Bc + 4 * (N + Nk), f"O(N·d + Br·Bc) (N = {N}, Nk = {Nk}, d = {d}, "
                  f"Br = {Br}, Bc = {Bc})", full=N * Nk,
                  hint="that is the N x Nk score matrix (or the scores of many tiles kept alive), in a tensor, a "
                       "numpy array or Python lists: FlashAttention never holds it. Compute one [Br, Bc] tile of "
                       "scores at a time, fold it into the running (m, l, acc), and let it go")


MEM_N, MEM_D, MEM_B = 256, 2, 16


def memory_case(seed, *extra, N=MEM_N, Nk=MEM_N, **kwargs):
    """A case large enough that the N x Nk scores (65,536 elements) and the tiled budget (~5,000) differ by
    more than an order of magnitude, whatever holds them; small d and 16 x 16 tiles keep it quick."""
    q, k, v = qkv(N, Nk, MEM_D, gen(seed))
    extra = tuple(e(N, Nk) if callable(e) else e for e in extra)
    return Case(f"working memory (metered): N = {N}, Nk = {Nk}, d = {MEM_D}, Br = Bc = {MEM_B}", q, k, v, *extra,
                Br=MEM_B, Bc=MEM_B, **kwargs)


def check_tiled_memory(g, case):
    """Hold one call on ``memory_case`` to ``tiled_budget``: no N x Nk in any form."""
    g.check_memory(case, budget=tiled_budget)


def saw_no_flops(g, r, what):
    """0 FLOPs is a finding, not a pass: the verdict says what the meter could not check."""
    if r.total_flops == 0:
        g.notes.append(f"the meter saw no FLOPs: your function computes outside torch and numpy, so {what} was "
                       "not checked, only its output and its working memory")


def measure_case(g, case):
    """Meter one call of the learner's function on copies of ``case``'s inputs (``Grader.measure``)."""
    return g.measure(case, names=("q", "k", "v"))


def check_tiles_only(g, r, case):
    """No N x Nk score matrix (nor a score strip wider than a tile), and no call to SDPA."""
    q, k, _ = case.args
    N, d = q.shape
    Nk = k.shape[0]
    Br, Bc = case.kwargs["Br"], case.kwargs["Bc"]
    saw_no_flops(g, r, "its tiling and loop order")
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


# ------------------------------------------------------------------ the visible-tile work (04, 05)
# Elementwise work a visible tile may cost besides its two matmuls (4 Br Bc d FLOPs): scaling, masking,
# max, exp, sum of the scores (per score), rescaling and adding acc (per element of acc), m, l, alpha (per row).
PER_SCORE, PER_ACC, PER_ROW = 12, 4, 16


def visible_tile_flops(mask: torch.Tensor, Br: int, Bc: int, d: int) -> int:
    """Matmul FLOPs (Q K^T and P V) of the tiles of bool ``mask`` [N, Nk] that hold a visible key."""
    N, Nk = mask.shape
    return sum(4 * min(Br, N - i0) * min(Bc, Nk - j0) * d
               for i0 in range(0, N, Br) for j0 in range(0, Nk, Bc) if mask[i0:i0 + Br, j0:j0 + Bc].any())


def check_visible_work(g, r, vis, Br, Bc, d, skip_hint, tile_hint):
    """Fail unless the metered run ``r`` computed only the tiles of bool ``vis`` [N, Nk] with a visible key.

    Two counts: the matmul FLOPs must not exceed those of the visible tiles, and all FLOPs
    (matmul + elementwise, so a tile computed as ``(Qi[:, None] * Kj[None]).sum(-1)`` counts
    too) must stay within the visible tiles' matmuls plus their elementwise allowance. And no
    tensor half the size of the ``N x Nk`` score matrix. Used by 04 and 05.
    """
    N, Nk = vis.shape
    saw_no_flops(g, r, "which tiles it skips")
    need = visible_tile_flops(vis, Br, Bc, d)
    visible = [(min(Br, N - i0), min(Bc, Nk - j0)) for i0 in range(0, N, Br) for j0 in range(0, Nk, Bc)
               if vis[i0:i0 + Br, j0:j0 + Bc].any()]
    allowed = need + sum(PER_SCORE * br * bc + PER_ACC * br * d + PER_ROW * br for br, bc in visible)
    every = 4 * N * Nk * d
    if r.flops > need:
        g.fail(f"your function did {r.flops:,} matmul FLOPs; the tiles with a visible key need {need:,} "
               f"(computing every tile costs {every:,})", hint=skip_hint)
    if r.total_flops > allowed:
        g.fail(f"your function did {r.total_flops:,} FLOPs ({r.flops:,} in matmuls, {r.elementwise_flops:,} "
               f"elementwise); the {len(visible)} tiles with a visible key need {need:,} in matmuls and at most "
               f"{allowed:,} in all (computing every tile costs {every:,} in matmuls alone)", hint=skip_hint)
    if r.largest.numel >= N * Nk // 2:
        g.fail(f"your function made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by}), "
               f"as large as the {N} x {Nk} score matrix", hint=tile_hint)


# ------------------------------------------------------------------ Triton exercises (07, 08)
def over_bound_hint(got, want, atol, sdpa, *, rounding_fix, logic_fix, what="bound") -> str:
    """What an error over FlashAttention's bound (``atol`` = 2 x SDPA's own error ``sdpa`` + rounding) is:
    rounding when a little over (at most 10 x the bound: ``rounding_fix``), a wrong answer when far over
    (``logic_fix``). The checkers of the Triton kernels (lessons 07 and 08) use it."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return ""
    err = (got.detach().double().cpu() - want).abs().nan_to_num(0.0)
    worst = err.max().item()
    if worst <= 10 * atol:
        return (f"a little over the {what} ({worst:.2g} against {atol:.2g} = 2 x SDPA's own error {sdpa:.2g} + "
                f"rounding): rounding, not logic. {rounding_fix}")
    rows = int((err.reshape(-1, err.shape[-1]).amax(-1) > atol).sum())
    return (f"the error is {worst:.3g}, {worst / atol:.0f} x the {what} ({atol:.2g}): not rounding, a wrong answer "
            f"({rows} rows over it). {logic_fix}")


def device():
    """Where the Triton exercises run: a CUDA GPU, else the CPU (Triton's interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_dtypes():
    """(first, second) dtypes the Triton exercises are checked in: fp32 and fp16 under the interpreter (no bf16
    there); fp16 and bf16 on a GPU; fp16 and fp32 before sm_80 (a T4 has no bf16, and the kernels refuse it)."""
    if not torch.cuda.is_available():
        return torch.float32, torch.float16
    if torch.cuda.get_device_capability() < (8, 0):
        return torch.float16, torch.float32
    return torch.float16, torch.bfloat16


def device_randn(gen, *shape, dtype, scale=1.0):
    """Seeded normal inputs (drawn on the CPU, so the same on every machine), cast to ``dtype`` on ``device()``."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device())


def stubbed(fn):
    """Call ``fn``; turn a NotImplementedError wrapped by the Triton interpreter or compiler back into one."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as e:
            # The interpreter wraps the stub's NotImplementedError; the compiler (a GPU) raises a
            # CompilationError whose cause is "unsupported AST node type: Raise" at the stub's line.
            cause = e
            while cause is not None:
                if "NotImplementedError" in f"{cause!r} {cause}":
                    raise NotImplementedError(str(cause)) from None
                cause = cause.__cause__ or cause.__context__
            raise
    call.__name__ = getattr(fn, "__name__", "fn")
    return call


def jit_with_globals(template, **names):
    """``template`` (a plain function written as a Triton kernel) jitted with ``names`` added to its globals.

    Triton's interpreter and compiler read a kernel's globals, not a closure, so a probe that calls the
    learner's ``@triton.jit`` function (or a planted bug's switch) gets a fresh globals dict. The annotations
    are kept (``functools.update_wrapper``): the compiler, unlike the interpreter, reads ``tl.constexpr`` there.
    Imports Triton: call it only from a checker's function body."""
    import functools
    import types

    import triton
    fn = types.FunctionType(template.__code__, {**template.__globals__, **names}, template.__name__,
                            template.__defaults__)
    return triton.jit(functools.update_wrapper(fn, template, updated=()))
