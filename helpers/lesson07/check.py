"""Checkers of lesson 07, the Triton port: ``flash_attn_triton`` and ``flash_decode_triton``.

References: ``helpers.reference.attention`` in float64, per batch and head. The error rule is
FlashAttention's own test rule: the kernel's max error against float64 may be at most twice
SDPA's max error in the same dtype, plus a floor (twice the rounding of the answer to that dtype).
The kernels run natively on a CUDA GPU (fp16, bf16) or under ``TRITON_INTERPRET=1`` on a CPU
(fp32, fp16). This module must not import triton at module level: every notebook imports it.
"""
from __future__ import annotations

import math

import torch

from .. import lesson07, reference
from ..checking import Bug, Case, exercise
from ..cases import over_bound_hint, device_dtypes as _dtypes, device_randn as _randn, jit_with_globals, stubbed as _stubbed

# torch ops that mean the answer was computed with torch, not in the kernel
_TORCH_MATH = {"mm", "bmm", "matmul", "addmm", "baddbmm", "_softmax", "softmax", "logsumexp", "exp", "exp2",
               "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
               "scaled_dot_product_attention", "einsum"}
_TORCH_MATH |= {"amax", "amin", "max", "min", "sum", "mean", "cumsum", "cumprod", "logcumsumexp", "log", "log2",
                "logaddexp", "logaddexp2", "tensordot", "mv", "dot", "softmax", "_log_softmax"}
_BLOCK_NS = (16, 32, 64, 128)  # tile widths a bug model tries (the notebook's launcher picks one)


def _host_math(r, extra=frozenset()):
    """The torch math ops a metered launcher ran on the host (in-place forms count: ``exp_`` is ``exp``)."""
    return sorted({op.rstrip("_") for op in r.ops} & (_TORCH_MATH | extra))


def _check_host(g, r, q, hint):
    """No attention math in torch on the host: no math op by name, no matmul FLOPs, and no more elementwise
    work than one pass over q (a host-side prescale); the course's launchers do none."""
    used = _host_math(r)
    if used or r.flops or r.elementwise_flops > q.numel():
        what = ", ".join("aten." + u for u in used) or f"{r.flops + r.elementwise_flops:,} FLOPs of torch ops"
        g.fail(f"your launcher ran torch ops on the host: {what}", hint=hint)


def _bound(o_ref, q, k, v, dtype, causal=False, sm_scale=None, sdpa_args=None):
    """FlashAttention's rule: 2 x SDPA's own error in this dtype + 2 x the rounding of the answer to it.

    Plus the float32 rounding of the largest logit, carried into O (4 eps |s|max |v|max): with scores in
    the hundreds, a kernel that keeps an fp32 lse of ~200 (exact to 1e-5) is right, whatever SDPA got.
    """
    qq, kk, vv = sdpa_args or (q, k, v)
    sdpa = lesson07.sdpa_error(qq, kk, vv, o_ref, causal=causal, sm_scale=sm_scale)
    rounding = (o_ref.to(dtype).double() - o_ref).abs().max().item()
    scale = 1 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s_max = (qq.double() @ kk.double().transpose(-1, -2)).abs().max().item() * scale
    logits = 4 * torch.finfo(torch.float32).eps * s_max * vv.double().abs().max().item()
    return 2 * sdpa + 2 * rounding + logits + 1e-6, sdpa


# ------------------------------------------------------------------ bug models (float64, per row)
def _sim_fwd(q, k, v, causal, sm_scale, block_n, bug):
    """The kernel's tile loop in float64 with one planted bug, on [B, H, N, d] inputs -> O."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    N, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    sm_scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    qk_scale = sm_scale * lesson07.LOG2E
    if bug == "no_key_mask":                    # the ragged last tile's padding (zeros) is scored as keys
        pad = -(-Nk // block_n) * block_n - Nk
        k = torch.cat([k, k.new_zeros(*k.shape[:-2], pad, d)], -2)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], pad, d)], -2)
        s = (q @ k.transpose(-1, -2)) * sm_scale
        if causal:
            s = s.masked_fill(~reference.causal_mask(N, k.shape[-2]), -math.inf)
        return torch.softmax(s, -1) @ v
    s = (q @ k.transpose(-1, -2)) * qk_scale                                   # [B, H, N, Nk] base 2
    if causal:
        s = s.masked_fill(~reference.causal_mask(N, Nk), -math.inf)
    m = torch.full(s.shape[:-1], -math.inf, dtype=torch.float64)
    l = torch.zeros_like(m)
    acc = torch.zeros(*s.shape[:-1], v.shape[-1], dtype=torch.float64)
    for j in range(0, Nk, block_n):
        sj = s[..., j:j + block_n]                                              # [B, H, N, BLOCK_N]
        m_new = torch.maximum(m, sj.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp2(sj - m_safe[..., None])
        alpha = torch.exp2(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = (acc if bug == "no_alpha" else acc * alpha[..., None]) + p @ v[..., j:j + block_n, :]
        m = m_new
    return acc / torch.where(l == 0, torch.ones_like(l), l)[..., None]


def _fwd_bugs():
    def scaled(factor):
        def model(c):
            q, k, v = c.args
            sm = c.kwargs.get("sm_scale") or 1 / math.sqrt(q.shape[-1])
            return lesson07.reference_bhnd(q.cpu(), k.cpu(), v.cpu(), c.kwargs.get("causal", False), sm * factor)[0]
        return model

    def sim(bug, bn):
        return lambda c: _sim_fwd(*c.args, c.kwargs.get("causal", False), c.kwargs.get("sm_scale"), bn, bug)

    bugs = [Bug("acc was not rescaled: when m_i grows, multiply acc by alpha = exp2(m_i - m_ij) "
                "(l_i gets the same factor) before adding p @ v", sim("no_alpha", bn)) for bn in _BLOCK_NS]
    bugs += [
        Bug("tl.exp with qk_scale: qk_scale already holds log2(e) (it is sm_scale * log2(e)), so the exponential "
            "must be tl.exp2 (exp(x) = exp2(x * log2 e)); tl.exp gives a softmax of scores scaled by 1.44",
            scaled(lesson07.LOG2E)),
        Bug("tl.exp2 without log2(e) folded in: exp2(s * sm_scale) = exp(s * sm_scale * ln 2); fold it in once, "
            "qk_scale = sm_scale * log2(e), and the lse back to natural log (* ln 2)", scaled(lesson07.LN2)),
    ]
    bugs += [Bug("the ragged last tile's padding was scored as keys: the keys >= Nk of the last tile must score "
                 "-inf in the masked loop", sim("no_key_mask", bn), fix="qk = tl.where(cols[None, :] < Nk, qk, -inf)")
             for bn in _BLOCK_NS]

    def causal_shift(s):
        def model(c):
            if not c.kwargs.get("causal", False):
                raise ValueError("not causal")
            q, k, v = c.args
            N, Nk = q.shape[-2], k.shape[-2]
            vis = torch.arange(Nk)[None, :] <= torch.arange(N)[:, None] + s            # [N, Nk]
            return reference.attention(q.cpu(), k.cpu(), v.cpu(), mask=vis, scale=c.kwargs.get("sm_scale"))[0]
        return model
    bugs += [
        Bug("the causal mask is off by one: it hides the diagonal; query i sees keys j <= i, not j < i",
            causal_shift(-1), fix="qk = tl.where(cols[None, :] <= offs_m[:, None], qk, -inf)"),
        Bug("the causal mask is off by one: it lets query i see key i + 1; query i sees keys j <= i",
            causal_shift(1)),
    ]
    return bugs


# ------------------------------------------------------------------ flash_attn_triton
def _fwd_cases():
    rng = torch.Generator().manual_seed(7)
    f32, f16 = _dtypes()
    mk = lambda B, H, N, Nk, d, dt, s=1.0: (_randn(rng, B, H, N, d, dtype=dt, scale=s),   # noqa: E731
                                            _randn(rng, B, H, Nk, d, dtype=dt), _randn(rng, B, H, Nk, d, dtype=dt))
    return [
        # 128: whole tiles for every BLOCK_M, BLOCK_N up to 128, and several KV tiles per row for each, so the
        # rescale by alpha is exercised on a GPU (BLOCK_N = 64) as under the interpreter (16)
        Case("whole tiles, N = Nk = 128", *mk(1, 1, 128, 128, 32, f32)),
        Case("ragged: N = Nk = 40 (not a multiple of the tile)", *mk(1, 2, 40, 40, 16, f32)),
        Case("N = 1 (one query)", *mk(1, 2, 1, 37, 16, f32)),
        Case("Nk != N: N = 33, Nk = 21", *mk(2, 1, 33, 21, 16, f32)),
        Case("tiles larger than the input: N = Nk = 5", *mk(1, 2, 5, 5, 16, f32)),
        Case("causal, N = Nk = 40", *mk(1, 2, 40, 40, 32, f32), causal=True),
        Case("causal, Nk > N: N = 20, Nk = 45 (top-left: row i sees keys j <= i)", *mk(1, 1, 20, 45, 16, f32),
             causal=True),
        Case("causal, N > Nk: N = 45, Nk = 20", *mk(1, 1, 45, 20, 16, f32), causal=True),
        Case("large logits (q x 30)", *mk(1, 2, 24, 29, 16, f32, 30.0),
             note="scores in the hundreds: exp overflows unless the running max is subtracted"),
        Case("sm_scale = 0.3", *mk(1, 1, 17, 17, 16, f32), sm_scale=0.3),
        Case(f"{str(f16).replace('torch.', '')}, N = Nk = 40", *mk(1, 2, 40, 40, 32, f16)),
        Case(f"{str(f16).replace('torch.', '')}, causal, N = 37, large logits", *mk(1, 2, 37, 37, 16, f16, 8.0),
             causal=True),
    ]


def _poisoned(g, dtype, N=20, Nk=19, d=16, pad=128):   # pad: a load past Nk up to any BLOCK_N <= 128 reads NaN
    """k, v views whose storage goes on past Nk with NaN: a load without a mask reads the NaN."""
    q = _randn(g, 1, 1, N, d, dtype=dtype)
    kb = _randn(g, 1, 1, Nk + pad, d, dtype=dtype)
    vb = _randn(g, 1, 1, Nk + pad, d, dtype=dtype)
    kb[:, :, Nk:] = float("nan")
    vb[:, :, Nk:] = float("nan")
    return q, kb[:, :, :Nk], vb[:, :, :Nk]   # contiguous views (B = H = 1) over longer buffers


def _check_fwd_out(g, out, q, k, v, causal, sm_scale, bugs, sdpa_args=None):
    B, H, N, d = q.shape
    o, lse = g.expect_tuple(out, 2, "(O, lse)")
    g.expect_tensor(o, "O", shape=(B, H, N, d), dtype=q.dtype)
    g.expect_tensor(lse, "lse", shape=(B, H, N), dtype=torch.float32)
    o_ref, lse_ref = lesson07.reference_bhnd(q.cpu(), k.cpu(), v.cpu(), causal, sm_scale)
    atol, sdpa = _bound(o_ref, q, k, v, q.dtype, causal, sm_scale, sdpa_args)
    g.compare(o, o_ref, "O", rtol=0.0, atol=atol, bugs=bugs,
              hint=_over_bound_hint(o, o_ref, atol, sdpa, causal),
              nan_hint="NaN: either a load read past the end of K or V (mask the ragged last tile's loads: "
                       "mask=cols[:, None] < Nk, other=0.0) or exp2(-inf - -inf) for a row with no key yet "
                       "(subtract 0 where m_ij is -inf)")
    g.compare(lse, lse_ref, "lse", rtol=2e-5, atol=2e-4,
              bugs=[Bug("that lse is in base 2: multiply by ln 2 (lse = (m_i + log2(l_i)) * ln 2)",
                        lambda c: lse_ref / lesson07.LN2)],
              hint="lse = (m_i + log2(l_i)) * ln(2): m_i and l_i are in base 2 (exp2 with log2(e) in qk_scale)")


def _over_bound_hint(o, o_ref, atol, sdpa, causal):
    """Say what an error over the bound is: rounding (a little over) or a wrong answer (far over)."""
    where = (" Which rows are wrong tells which: only rows near the diagonal point at the causal mask "
             "(query i sees keys j <= i)" if causal else "")
    return over_bound_hint(
        o, o_ref, atol, sdpa, what="bound",
        rounding_fix="Keep m_i, l_i and acc in float32 and cast only the stored O",
        logic_fix=f"Check the online softmax update (m_i, alpha, l_i, acc) and the masks.{where}")


@exercise("flash_attn_triton", arg_names=["q", "k", "v"], reference="float64 SDPA (error <= 2 x SDPA's own + "
          "rounding)")
def flash_attn_triton(g):
    fn = _stubbed(g.fn)
    bugs = _fwd_bugs()
    cases = _fwd_cases()
    for i, case in enumerate(cases):
        out = g.call(case, fn=fn)
        q, k, v = case.args
        _check_fwd_out(g, out, q, k, v, case.kwargs.get("causal", False), case.kwargs.get("sm_scale"), bugs)
        g.count()
        if i == 0:  # right after a plain case passes: the ragged tail, with NaN where a mask must stop the reads
            gen = torch.Generator().manual_seed(70)
            for causal in (False, True):
                q, k, v = _poisoned(gen, _dtypes()[0])
                pcase = Case(f"ragged tail with NaN past Nk in memory{', causal' if causal else ''}",
                             q, k, v, causal=causal, note="K and V are views of longer buffers full of NaN "
                             "after key Nk - 1: a kernel that loads past Nk without a mask reads them")
                out = g.call(pcase, fn=lambda *a, _q=q, _k=k, _v=v, **kw: fn(_q, _k, _v, **kw))
                _check_fwd_out(g, out, q, k, v, causal, None, bugs,
                               sdpa_args=(q.contiguous(), k.contiguous(), v.contiguous()))
                g.count()
    checked = _safe_max(g)
    _fwd_idea(g, fn)
    if not checked:
        return (f"{g.cases} cases match float64 SDPA, max rel err {g.max_rel_err:.0e} (the rule for a row that has "
                "seen no key yet was not checked: no `attn_inner` next to your launcher)")
    return None


# ------------------------------------------------------------------ a row that sees no key yet
def _probe_kernel(Q, K, V, O, LSE, ROW0, Nk, qk_scale, LO,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # noqa: F821
    """Calls the learner's ``attn_inner`` on the band first (keys LO..Nk-1), then on keys 0..LO-1, both
    masked and causal, with query positions ROW0[pid] + 0..BLOCK_M-1: rows before LO meet a first tile
    in which they see no key (and rows < 0 never see one). jit-compiled lazily, with ``attn_inner``
    and ``tl`` in its globals (``_probe``)."""
    pid = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_M)                                                # [BLOCK_M]
    offs_m = tl.load(ROW0 + pid) + offs_r                                         # positions: row i sees j <= i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (pid * BLOCK_M + offs_r)[:, None] * D + offs_d[None, :])      # [BLOCK_M, D]
    k_ptrs = K + offs_n[:, None] * D + offs_d[None, :]                            # [BLOCK_N, D]
    v_ptrs = V + offs_n[:, None] * D + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    acc, l_i, m_i = attn_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, D, D, LO, Nk, offs_m, offs_n, qk_scale, Nk,
                               BLOCK_N, True, True)
    acc, l_i, m_i = attn_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, D, D, 0, LO, offs_m, offs_n, qk_scale, Nk,
                               BLOCK_N, True, True)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    tl.store(LSE + pid * BLOCK_M + offs_r, tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453))
    tl.store(O + (pid * BLOCK_M + offs_r)[:, None] * D + offs_d[None, :], acc / l_safe[:, None])


def _probe(inner):
    """``_probe_kernel`` jitted with ``attn_inner`` bound to the learner's function.

    The rebuilt function keeps the kernel's annotations: Triton reads ``tl.constexpr`` from them when it
    compiles (the interpreter does not), so without them BLOCK_M would reach ``tl.arange`` as a run-time int.
    """
    import triton
    import triton.language as tl
    return jit_with_globals(_probe_kernel, attn_inner=inner, tl=tl, triton=triton)


def _safe_max(g) -> bool:
    """The notebook's rule for ``attn_inner``: a row with no key yet exponentiates against 0, not -inf.

    The course's launcher never meets such a row (top-left causal: every row sees key 0 in its first
    tile), so this launches ``attn_inner`` in a small kernel that visits the band first. Returns False
    when the learner's launcher has no ``attn_inner`` to test.
    """
    inner = getattr(g.learner_fn, "__globals__", {}).get("attn_inner")
    if inner is None or not hasattr(inner, "fn"):      # not a @triton.jit function
        return False
    BLOCK_M = BLOCK_N = D = 16
    Nk, LO = 40, 16
    dtype = _dtypes()[0] if not torch.cuda.is_available() else torch.float16
    gen = torch.Generator().manual_seed(72)
    q = _randn(gen, 2 * BLOCK_M, D, dtype=dtype)
    k, v = _randn(gen, Nk, D, dtype=dtype), _randn(gen, Nk, D, dtype=dtype)
    row0 = torch.tensor([-4, 8], dtype=torch.int32, device=q.device)
    pos = torch.cat([torch.arange(-4, -4 + BLOCK_M), torch.arange(8, 8 + BLOCK_M)])          # [2 BLOCK_M]
    vis = torch.arange(Nk)[None, :] <= pos[:, None]                                          # [2 BLOCK_M, Nk]
    g.case = Case("a row that has seen no key yet: attn_inner over the band first (keys 16..39), then keys 0..15, "
                  "causal, query positions -4..11 and 8..23", q, k, v,
                  note="rows 8..15 see no key in their first tile, rows -4..-1 never see one: m_i is -inf there, "
                       "so exp2(m_i - m_ij) and exp2(qk - m_ij) must not become exp2(-inf - (-inf)) = NaN")
    o = torch.empty(2 * BLOCK_M, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(2 * BLOCK_M, dtype=torch.float32, device=q.device)
    try:
        _probe(inner)[(2,)](q, k, v, o, lse, row0, Nk, (1 / math.sqrt(D)) * lesson07.LOG2E, LO,
                            D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    except Exception as e:  # noqa: BLE001 - the learner's attn_inner, called as the notebook's kernel calls it
        g.fail(f"your attn_inner raised {type(e).__name__} when called on keys 16..39 before keys 0..15: {e}",
               hint="attn_inner must work for any lo, hi (multiples of BLOCK_N) and any query rows offs_m")
    o_ref, lse_ref = reference.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask=vis)
    nan = ("NaN for a row that has seen no key yet (its m_i is -inf): without a safe max, exp2(qk - m_ij) and "
           "exp2(m_i - m_ij) are exp2(-inf - (-inf)) = NaN. Subtract 0 where m_ij is -inf")
    nan_fix = "m_safe = tl.where(m_ij == float('-inf'), 0.0, m_ij), then exp2(qk - m_safe) and exp2(m_i - m_safe)"
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    g.compare(lse.cpu(), lse_ref, "lse", rtol=0.0, atol=atol, nan_hint=nan, nan_fix=nan_fix,
              hint="a row that sees no key at all has l_i = 0: lse = -inf there")
    g.compare(o.cpu(), o_ref, "O", rtol=0.0, atol=atol, nan_hint=nan, nan_fix=nan_fix,
              hint="a row that sees no key at all has O = 0; the others attend to keys j <= their position")
    g.count()
    return True


def _fwd_idea(g, fn):
    """The work must happen in the kernel: no torch matmul/softmax on the host, no N x Nk tensor."""
    gen = torch.Generator().manual_seed(71)       # the meter sees host-side torch ops on a GPU's tensors too
    q, k, v = (_randn(gen, 1, 1, 48, 16, dtype=_dtypes()[0]) for _ in range(3))
    r = g.measure(Case("the work happens in the kernel (metered)", q, k, v, causal=True), fn=fn,
                  names=["q", "k", "v"])
    _check_host(g, r, q, hint="the scores, the softmax and P @ V all belong inside the Triton kernel (tl.dot, "
                              "tl.exp2, tl.sum): torch math around it materialises tiles in HBM, which is what "
                              "FlashAttention avoids")
    if r.largest.numel >= 48 * 48:
        g.fail(f"your launcher made a tensor of shape {list(r.largest.shape)} ({r.largest.made_by})",
               hint="an N x Nk score matrix in HBM is what FlashAttention removes: the kernel allocates only "
                    "O [B, H, N, d] and lse [B, H, N]")


# ------------------------------------------------------------------ flash_decode_triton
def _split_parts(q, k, v, num_splits):
    """Per-split (O_s, lse_s) in float64: [B, H, S, d], [B, H, S]; an empty split is (0, -inf)."""
    B, H, d = q.shape
    group = H // k.shape[1]
    kk, vv = k.double().cpu().repeat_interleave(group, 1), v.double().cpu().repeat_interleave(group, 1)
    qq = q.double().cpu()[:, :, None, :]
    o_parts, lse_parts = [], []
    for lo, hi in lesson07.split_bounds(k.shape[2], num_splits):
        if hi <= lo:
            o_parts.append(torch.zeros(B, H, d, dtype=torch.float64))
            lse_parts.append(torch.full((B, H), -math.inf, dtype=torch.float64))
            continue
        o, lse = reference.attention(qq, kk[:, :, lo:hi], vv[:, :, lo:hi])
        o_parts.append(o[:, :, 0])
        lse_parts.append(lse[:, :, 0])
    return torch.stack(o_parts, 2), torch.stack(lse_parts, 2)


def _decode_bugs():
    def mean_all(c):
        o_s, _ = _split_parts(*c.args[:3], c.kwargs["num_splits"])
        return o_s.mean(2)

    def mean_nonempty(c):
        o_s, lse_s = _split_parts(*c.args[:3], c.kwargs["num_splits"])
        w = (~torch.isneginf(lse_s)).double()
        return (o_s * w[..., None]).sum(2) / w.sum(2)[..., None]

    def unnormalised(c):
        o_s, lse_s = _split_parts(*c.args[:3], c.kwargs["num_splits"])
        w = torch.exp(lse_s - lse_s.amax(2, keepdim=True))
        return (o_s * w[..., None]).sum(2)

    def natural_vs_2(c):
        o_s, lse_s = _split_parts(*c.args[:3], c.kwargs["num_splits"])
        w = torch.exp2(lse_s - lse_s.amax(2, keepdim=True))
        return (o_s * w[..., None]).sum(2) / w.sum(2)[..., None]

    mean = ("a plain mean of the splits' O_s gives every split the same say: weigh each by its share of the "
            "softmax mass, w_s = exp(lse_s - lse), lse = logsumexp over s of lse_s")
    return [Bug(mean, mean_all), Bug(mean, mean_nonempty),
            Bug("the weights exp(lse_s - max) were not divided by their sum: O = sum_s w_s O_s / sum_s w_s",
                unnormalised),
            Bug("the splits' lse is in natural log: weigh with exp(lse_s - lse), not exp2", natural_vs_2)]


def _decode_cases():
    rng = torch.Generator().manual_seed(77)
    f32, f16 = _dtypes()
    mk = lambda B, H, Hkv, Nk, d, dt, s=1.0: (_randn(rng, B, H, d, dtype=dt, scale=s),   # noqa: E731
                                              _randn(rng, B, Hkv, Nk, d, dtype=dt), _randn(rng, B, Hkv, Nk, d, dtype=dt))
    return [
        Case("MHA, Nk = 64, 4 splits", *mk(2, 2, 2, 64, 32, f32), num_splits=4),
        Case("GQA: H = 4 query heads on Hkv = 2 KV heads, ragged Nk = 37", *mk(1, 4, 2, 37, 16, f32), num_splits=3),
        Case("more splits than keys: Nk = 5, 8 splits (some empty)", *mk(1, 2, 1, 5, 16, f32), num_splits=8,
             note="an empty split has lse_s = -inf and O_s = 0: its weight must be 0, never NaN"),
        Case("Nk = 1", *mk(1, 2, 2, 1, 16, f32), num_splits=4),
        Case("one split", *mk(1, 2, 1, 33, 16, f32), num_splits=1),
        Case("large logits (q x 100), 5 splits", *mk(1, 4, 1, 50, 16, f32, 100.0), num_splits=5,
             note="the splits' lse differ by hundreds: exp(lse_s) overflows, exp(lse_s - max) does not"),
        Case("num_splits = None (the launcher picks)", *mk(1, 2, 2, 40, 16, f32), num_splits=None),
        Case(f"{str(f16).replace('torch.', '')}, GQA 8 on 2, Nk = 45", *mk(1, 8, 2, 45, 32, f16), num_splits=3),
    ]


@exercise("flash_decode_triton", arg_names=["q", "k", "v"], reference="float64 SDPA (error <= 2 x SDPA's own + "
          "rounding)")
def flash_decode_triton(g):
    fn = _stubbed(g.fn)
    bugs = _decode_bugs()
    for case in _decode_cases():
        q, k, v = case.args
        out = g.call(case, fn=fn)
        o = g.expect_tensor(out, "O", shape=tuple(q.shape), dtype=q.dtype)
        o_ref = lesson07.reference_decode(q.cpu(), k.cpu(), v.cpu())
        group = q.shape[1] // k.shape[1]
        sdpa_args = (q[:, :, None], k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        atol, sdpa = _bound(o_ref[:, :, None], q, k, v, q.dtype, sdpa_args=sdpa_args)
        large = "large" in case.name
        g.compare(o, o_ref, "O", rtol=0.0, atol=atol, bugs=bugs if case.kwargs["num_splits"] else (),
                  hint=(f"the error is over the bound ({atol:.2g}: 2 x SDPA's own error {sdpa:.2g} + rounding): "
                        "the combine is O = sum_s exp(lse_s - lse) O_s with lse = logsumexp_s lse_s"),
                  nan_hint=("exp(lse_s) overflowed: subtract the largest lse_s before exponentiating" if large else
                            "NaN: an empty split has lse_s = -inf; with the max subtracted its weight is "
                            "exp(-inf - lse_max) = 0. If every split were empty, use 0 for lse_max"))
        g.count()
    # the work must happen in the kernels (the meter sees host-side torch ops on a GPU too)
    gen = torch.Generator().manual_seed(78)
    q, k, v = _randn(gen, 1, 2, 16, dtype=_dtypes()[0]), *(_randn(gen, 1, 2, 64, 16, dtype=_dtypes()[0])
                                                           for _ in range(2))
    r = g.measure(Case("the work happens in the kernels (metered)", q, k, v, num_splits=4), fn=fn,
                  names=["q", "k", "v"])
    _check_host(g, r, q, hint="the split kernel and the combine kernel do all the math; a host-side combine "
                              "reads the partial results back and launches a kernel per op, which is what "
                              "Flash-Decoding avoids")
    return None
