"""Checker of lesson 08's GPU exercise: ``dkdv_inner``, the inner loop of the dK/dV kernel in Triton.

The learner's ``@triton.jit`` function is called by the course's launcher
(``helpers.lesson08.dkdv.dkdv_teaching``: forward, preprocess D = rowsum(dO * O) and the base-2
lse, then one program per BLOCK_N keys calling the inner loop over query blocks). Its (dK, dV) are
compared with float64 autograd (``helpers.lesson08.gpu_section.reference_grads``). The rule is FlashAttention's
test rule: error at most twice SDPA's own backward error in the same dtype, plus the rounding of the
answer to that dtype. Runs under ``TRITON_INTERPRET=1`` on a CPU (fp32, fp16) or natively on a CUDA GPU
(fp16, bf16). This module must not import triton at module level: every notebook imports it.
"""
from __future__ import annotations

import inspect
import math
import re

import torch

from . import gpu_section
from ..checking import Bug, Case, exercise
from ..cases import over_bound_hint, device_dtypes as _dtypes, device_randn as _randn, jit_with_globals, stubbed

LOG2E = gpu_section.LOG2E


def _launcher(inner):
    """``f(q, k, v, do, causal=False) -> (dk, dv)`` through the course's kernel; stubs raise NotImplementedError."""
    def run(q, k, v, do, causal=False):
        from .dkdv import dkdv_teaching
        return dkdv_teaching(q, k, v, do, inner, causal=causal)
    run.__name__ = getattr(inner, "__name__", "dkdv_inner")
    return stubbed(run)


# ------------------------------------------------------------------ float64 pieces and bug models
def _pieces(case):
    """float64 S, P, dP, D, lse (causal top-left) for a case's q, k, v, do: each [B, H, N, Nk] or [B, H, N]."""
    q, k, v, do = (t.double().cpu() for t in case.args[:4])
    causal = case.kwargs.get("causal", False)
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale
    N, Nk = s.shape[-2:]
    keep = torch.ones(N, Nk, dtype=torch.bool)
    if causal:
        keep = torch.arange(Nk)[None, :] <= torch.arange(N)[:, None]
    lse = torch.logsumexp(s.masked_fill(~keep, -math.inf), -1)               # [B, H, N]
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse)
    p = torch.exp(s - lse_safe[..., None]).masked_fill(~keep, 0.0)           # [B, H, N, Nk]
    dp = do @ v.transpose(-1, -2)                                             # [B, H, N, Nk]
    delta = (p * dp).sum(-1)                                                  # [B, H, N] = rowsum(dO * O)
    return dict(q=q, k=k, v=v, do=do, s=s, p=p, dp=dp, delta=delta, lse=lse_safe, keep=keep, scale=scale,
                causal=causal)


def _tiles():
    """(BLOCK_M, BLOCK_N) of the course's launcher (``dkdv_teaching``): 16 x 16 interpreted, 64 x 64 on a GPU."""
    return (64, 64) if torch.cuda.is_available() else (16, 16)


def _bugs():
    def no_delta_dk(c):
        x = _pieces(c)
        return (x["p"] * x["dp"]).transpose(-1, -2) @ x["q"] * x["scale"]

    def exp_p(x):  # tl.exp on base-2 scores: exp(log2(e) * (s - lse))
        return torch.exp(LOG2E * (x["s"] - x["lse"][..., None])).masked_fill(~x["keep"], 0.0)

    def exp_dv(c):
        x = _pieces(c)
        return exp_p(x).transpose(-1, -2) @ x["do"]

    def exp_dk(c):
        x = _pieces(c)
        p = exp_p(x)
        return (p * (x["dp"] - x["delta"][..., None])).transpose(-1, -2) @ x["q"] * x["scale"]

    def unmasked_p(x):  # no causal mask: keys after the row get exp(s - lse) too, in every visited block
        N, Nk = x["s"].shape[-2:]
        bm, bn = _tiles()
        first_row = (torch.arange(Nk) // bn * bn) // bm * bm              # [Nk] the launcher's lo per key
        visited = torch.arange(N)[:, None] >= first_row[None, :]           # [N, Nk]
        p = torch.exp(x["s"] - x["lse"][..., None]).nan_to_num(0.0, 0.0, 0.0)
        return p.masked_fill(~visited, 0.0) if x["causal"] else p

    def nomask_dv(c):
        x = _pieces(c)
        return unmasked_p(x).transpose(-1, -2) @ x["do"]

    def nomask_dk(c):
        x = _pieces(c)
        p = unmasked_p(x)
        return (p * (x["dp"] - x["delta"][..., None])).transpose(-1, -2) @ x["q"] * x["scale"]

    def ds_dv(c):
        x = _pieces(c)
        return (x["p"] * (x["dp"] - x["delta"][..., None])).transpose(-1, -2) @ x["do"]

    exp_hint = ("tl.exp on base-2 quantities: qk_scale holds log2(e) and the launcher's lse is in base 2 "
                "(lse * log2(e)), so P^T = tl.math.exp2(qk^T * qk_scale - lse2[None, :])")
    mask_hint = ("keys after the row were counted: with CAUSAL, zero P^T where offs_n[:, None] > rows[None, :] "
                 "(tl.where(keep, pT, 0.0)); those keys were not in the forward's softmax")
    dv = [Bug(exp_hint, exp_dv), Bug(mask_hint, nomask_dv),
          Bug("dV = P^T dO uses P, not dS: dv += tl.dot(pT.to(do.dtype), do, dv)", ds_dv)]
    dk = [Bug("dS = P * (dP - D): subtract D = rowsum(dO * O) (the `delta` the launcher gives you) before "
              "multiplying by P; without it dK is the gradient of an unnormalised softmax", no_delta_dk),
          Bug(exp_hint, exp_dk), Bug(mask_hint, nomask_dk)]
    return dv, dk


def _cases():
    rng = torch.Generator().manual_seed(808)
    f32, f16 = _dtypes()

    def mk(B, H, N, Nk, d, dt, s=1.0):
        return (_randn(rng, B, H, N, d, dtype=dt, scale=s), _randn(rng, B, H, Nk, d, dtype=dt),
                _randn(rng, B, H, Nk, d, dtype=dt), _randn(rng, B, H, N, d, dtype=dt))

    name16 = str(f16).replace("torch.", "")
    return [
        # 128: whole tiles under the interpreter (16 x 16) and on a GPU (64 x 64), several query blocks per program
        Case("whole tiles, N = Nk = 128", *mk(1, 1, 128, 128, 16, f32)),
        Case("ragged: N = Nk = 37 (not a multiple of the tile)", *mk(1, 1, 37, 37, 32, f32)),
        Case("N != Nk: N = 21, Nk = 40", *mk(2, 1, 21, 40, 16, f32)),
        Case("causal, N = Nk = 40", *mk(1, 2, 40, 40, 16, f32), causal=True),
        Case("causal, N > Nk: N = 45, Nk = 20", *mk(1, 1, 45, 20, 16, f32), causal=True),
        Case("causal, N < Nk: N = 20, Nk = 45 (keys past the last row get dK = dV = 0)",
             *mk(1, 1, 20, 45, 16, f32), causal=True),
        Case("large logits (q x 8), causal", *mk(1, 1, 33, 33, 16, f32, 8.0), causal=True,
             note="scores in the tens: exp without the saved lse overflows"),
        Case(f"{name16}, causal, N = Nk = 37", *mk(1, 2, 37, 37, 32, f16), causal=True),
    ]


def _poisoned(gen, dtype, N=21, Nk=19, d=16, pad=128):   # pad: a load past N up to any BLOCK_M <= 128 reads NaN
    """q, do views whose storage goes on past row N with NaN: a row load without a mask reads the NaN."""
    qb = _randn(gen, 1, 1, N + pad, d, dtype=dtype)
    dob = _randn(gen, 1, 1, N + pad, d, dtype=dtype)
    qb[:, :, N:] = float("nan")
    dob[:, :, N:] = float("nan")
    k, v = _randn(gen, 1, 1, Nk, d, dtype=dtype), _randn(gen, 1, 1, Nk, d, dtype=dtype)
    return qb[:, :, :N], k, v, dob[:, :, :N]


def _bound(case, dk_ref, dv_ref):
    """Per output: 2 x SDPA's own error in this dtype + 2 x the rounding of the answer + a float32 floor."""
    q, k, v, do = case.args[:4]
    causal = case.kwargs.get("causal", False)
    a = [t.detach().clone().contiguous().requires_grad_() for t in (q, k, v)]
    try:
        mask = None
        if causal:
            N, Nk = q.shape[-2], k.shape[-2]
            mask = (torch.arange(Nk)[None, :] <= torch.arange(N)[:, None]).to(q.device)
        o = torch.nn.functional.scaled_dot_product_attention(*a, attn_mask=mask)
        o.backward(do.contiguous())
        errs = [(a[1].grad.double().cpu().nan_to_num() - dk_ref).abs().max().item(),
                (a[2].grad.double().cpu().nan_to_num() - dv_ref).abs().max().item()]
    except RuntimeError:  # SDPA without a backward in this dtype on this device
        errs = [0.0, 0.0]
    out = []
    for err, ref in zip(errs, (dk_ref, dv_ref)):
        rounding = (ref.to(q.dtype).double() - ref).abs().max().item()
        floor = 4e-6 * (ref.abs().max().item() + 1) * math.sqrt(q.shape[-2])
        out.append((2 * err + 2 * rounding + floor, err))
    return out


def _compare(g, out, case, bugs_dv, bugs_dk):
    k = case.args[1]
    dk, dv = g.expect_tuple(out, 2, "(dk, dv)")
    g.expect_tensor(dk, "dk", shape=tuple(k.shape), dtype=k.dtype)
    g.expect_tensor(dv, "dv", shape=tuple(k.shape), dtype=k.dtype)
    _, _, dk_ref, dv_ref = gpu_section.reference_grads(*case.args[:4], causal=case.kwargs.get("causal", False))
    (tol_k, sd_k), (tol_v, sd_v) = _bound(case, dk_ref, dv_ref)
    nan_hint = ("NaN: a load read past row N (mask the query-row loads: mask=rows[:, None] < N, other=0.0, and "
                "give lse2 other=float('inf') so padded rows get P = 0), or exp2(inf - inf)")
    rounding = ("Accumulate dk and dv in float32 (tl.dot(a, b, acc) or acc += tl.dot(a, b)) and cast only what "
                "goes into tl.dot")
    g.compare(dv, dv_ref, "dv", rtol=0.0, atol=tol_v, bugs=bugs_dv, nan_hint=nan_hint,
              hint=over_bound_hint(
                  dv, dv_ref, tol_v, sd_v, rounding_fix=rounding,
                  logic_fix="dV = P^T dO, with P^T = exp2(k q^T * qk_scale - lse2) recomputed per query block, "
                            "masked, and every query block from lo to hi visited once"))
    g.compare(dk, dk_ref, "dk", rtol=0.0, atol=tol_k, bugs=bugs_dk, nan_hint=nan_hint,
              hint=over_bound_hint(
                  dk, dk_ref, tol_k, sd_k, rounding_fix=rounding,
                  logic_fix="dS^T = P^T * (v dO^T - delta[None, :]), dk += dS^T q (the launcher multiplies by "
                            "sm_scale); dV passed, so P^T is right"))


# ------------------------------------------------------------------ what the numbers cannot show
def _lo_probe_kernel(Q, K, V, DO, LSE2, DELTA, DK, DV, LO, N, Nk, qk_scale,
                     INNER: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,  # noqa: F821
                     BLOCK_N: tl.constexpr):  # noqa: F821
    """One program of BLOCK_N keys calling the learner's inner loop on query rows LO..N-1, not causal; rows
    before LO hold NaN in q, dO, lse2 and delta, so a loop that starts anywhere but lo reads NaN. jit-compiled
    lazily with ``tl`` in its globals (``_lo_probe``)."""
    offs_n = tl.arange(0, BLOCK_N)                                                 # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)                                                # [D]
    kv = offs_n[:, None] * HEAD_DIM + offs_d[None, :]                              # [BLOCK_N, D]
    k = tl.load(K + kv)
    v = tl.load(V + kv)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dk, dv = INNER(dk, dv, k, v, Q, DO, LSE2, DELTA, LO, N, offs_n, N, Nk, qk_scale, HEAD_DIM, BLOCK_M, False)
    tl.store(DK + kv, dk)
    tl.store(DV + kv, dv)


def _lo_probe():
    import triton
    import triton.language as tl
    return jit_with_globals(_lo_probe_kernel, tl=tl, triton=triton)


def _check_lo(g, inner):
    """The launcher skips query blocks a key block cannot see (causal: lo > 0); the loop must start at lo."""
    BLOCK_M = BLOCK_N = D = 16
    N, LO = 48, 16
    dtype = _dtypes()[0]
    gen = torch.Generator().manual_seed(810)
    q, do = _randn(gen, N, D, dtype=dtype), _randn(gen, N, D, dtype=dtype)
    k, v = _randn(gen, BLOCK_N, D, dtype=dtype), _randn(gen, BLOCK_N, D, dtype=dtype)
    scale = 1 / math.sqrt(D)
    s = (q.double().cpu() @ k.double().cpu().T) * scale                              # [N, BLOCK_N]
    lse = torch.logsumexp(s, 1)                                                       # [N]
    p = torch.exp(s - lse[:, None])                                                   # [N, BLOCK_N]
    dp = do.double().cpu() @ v.double().cpu().T
    delta = (p * dp).sum(1)                                                           # [N] = rowsum(dO * O)
    rows = slice(LO, N)
    dv_ref = p[rows].T @ do.double().cpu()[rows]
    dk_ref = (p[rows] * (dp[rows] - delta[rows, None])).T @ q.double().cpu()[rows]    # unscaled: the launcher scales
    lse2, delta32 = (lse * LOG2E).float(), delta.float()
    for t in (q, do):
        t[:LO] = float("nan")
    lse2[:LO], delta32[:LO] = float("nan"), float("nan")
    dk = torch.empty(BLOCK_N, D, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    g.case = Case(f"the loop starts at lo: keys 0..15 against query rows lo = {LO} .. N - 1 = {N - 1}, not causal",
                  q, k, v, do, note=f"rows 0..{LO - 1} hold NaN (q, dO, lse2, delta): the launcher skips them, "
                                    "as it skips the blocks a causal key block cannot see")
    try:
        _lo_probe()[(1,)](q, k, v, do, lse2.to(q.device), delta32.to(q.device), dk, dv, LO, N, BLOCK_N,
                          scale * LOG2E, INNER=inner, HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    except Exception as e:  # noqa: BLE001 - the learner's loop, called as the course's kernel calls it
        g.fail(f"your dkdv_inner raised {type(e).__name__} when called with lo = {LO}: {e}",
               hint="dkdv_inner must work for any lo (a multiple of BLOCK_M) and hi")
    tol = 2e-2 * (1 + max(dk_ref.abs().max().item(), dv_ref.abs().max().item()))
    lo_hint = ("your loop visited query rows before lo: the launcher passes lo so that a key block skips the "
               "query blocks that cannot see it (causal); loop `for start_m in range(lo, hi, BLOCK_M)`")
    g.compare(dv.cpu(), dv_ref, "dv", rtol=0.0, atol=tol, nan_hint=lo_hint,
              hint="dV over query rows lo..hi - 1 only: " + lo_hint)
    g.compare(dk.cpu(), dk_ref, "dk", rtol=0.0, atol=tol, nan_hint=lo_hint,
              hint="dK over query rows lo..hi - 1 only: " + lo_hint)
    g.count()


def _check_exp2(g, inner):
    """The lesson's kernel exponentiates in base 2; tl.exp with ln 2 folded back gives the same numbers."""
    src = getattr(inner, "src", None)       # a JITFunction's; under the interpreter, the Python function's
    if not isinstance(src, str):
        try:
            src = inspect.getsource(getattr(inner, "fn", inner))
        except (OSError, TypeError):
            return
    code = "\n".join(line.split("#")[0] for line in src.splitlines())
    if re.search(r"\btl\s*\.\s*(math\s*\.\s*)?exp\s*\(", code):
        g.fail("your dkdv_inner calls tl.exp: the right numbers, the wrong instruction",
               hint="qk_scale and the launcher's lse2 are in base 2 so that P^T = tl.math.exp2(qk^T * qk_scale - "
                    "lse2[None, :]) is one exp2 per score (the GPU's native exponential); tl.exp with the ln 2 "
                    "folded back multiplies every score once more to undo what the launcher folded in")


@exercise("dkdv_inner", arg_names=["q", "k", "v", "do"],
          reference="float64 autograd (error <= 2 x SDPA's own + rounding)")
def dkdv_inner(g):
    run = _launcher(g.learner_fn)
    bugs_dv, bugs_dk = _bugs()
    for i, case in enumerate(_cases()):
        out = g.call(case, fn=run)
        _compare(g, out, case, bugs_dv, bugs_dk)
        g.count()
        if i == 1:  # the ragged row tail, with NaN where a mask must stop the reads
            gen = torch.Generator().manual_seed(809)
            for causal in (False, True):
                q, k, v, do = _poisoned(gen, _dtypes()[0])
                pcase = Case(f"ragged rows with NaN past N in memory{', causal' if causal else ''}", q, k, v, do,
                             causal=causal, note="q and dO are views of longer buffers full of NaN after row N - 1")
                out = g.call(pcase, fn=lambda *a, _x=(q, k, v, do), **kw: run(*_x, **kw))
                _compare(g, out, pcase, bugs_dv, bugs_dk)
                g.count()
    _check_lo(g, g.learner_fn)
    _check_exp2(g, g.learner_fn)
    return None
