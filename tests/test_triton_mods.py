"""The FlashAttention library's ``window_size``, ``softcap`` and ``alibi_slopes`` in the course's dense and packed
Triton kernels (helpers/kernels/forward.py, backward.py, varlen.py, varlen_backward.py); softcap with ALiBi
together in both.

Every result is compared, per head, with a float64 dense reference written here (``_ref``: S = q k^T * scale, the
softcap or the ALiBi bias, then the window as a mask on the diagonal of ``align``, then softmax; a row that sees
no key has O = 0 and lse = -inf), itself tied once to lesson 12's ``attention_mods_ref`` (bottom-right). Gradients
against float64 autograd through the same reference. Inputs are harsh (scores x3), lengths are not multiples of
the 16 x 16 tiles, windows are narrower than a tile, 0, wider than the sequence, and one-sided; N != Nk both ways
with both alignments; rows that see nothing. Under the interpreter: fp32 (fp16 twice), d = 16 (d = 40 once).
"""
import math

import pytest
import torch

from kernel_env import DEVICE, DTYPES, ON_GPU, TOL  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers import lesson12 as L  # noqa: E402
from helpers.kernels.backward import flash_attention, flash_attn_bwd_triton  # noqa: E402
from helpers.kernels.forward import flash_attn_triton  # noqa: E402
from helpers.kernels.varlen import flash_attn_varlen_triton  # noqa: E402
from helpers.kernels.varlen_backward import flash_attention_varlen, flash_attn_varlen_bwd_triton  # noqa: E402

D = 64 if ON_GPU else 16
F32 = DTYPES[0]  # fp32 under the interpreter, fp16 on a GPU
LOW = torch.float16


def _inputs(B, H, Hkv, N, Nk, dtype=F32, seed=0, d=D, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, N, d, generator=g) * scale).to(DEVICE, dtype)  # harsh: scores of tens
    k = (torch.randn(B, Hkv, Nk, d, generator=g) * scale).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g).to(DEVICE, dtype)
    do = torch.randn(B, H, N, d, generator=g).to(DEVICE, dtype)
    return q, k, v, do


def _ref(q, k, v, diag=0, window=(-1, -1), causal=False, softcap=0.0, slopes=None):
    """float64 (O, lse) of q [B, H, N, d] against k, v [B, Hkv, Nk, d] (GQA by repeating): row i sees key j when
    i + diag - left <= j <= i + diag + right (-1 unbounded; causal sets right = 0); softcap on the scaled score;
    ALiBi slopes [H] or [B, H]: s - slope * |i + diag - j|. Differentiable (q, k, v may require grad)."""
    B, H, N, d = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    q, k, v = q.double().cpu(), k.double().cpu().repeat_interleave(group, 1), v.double().cpu().repeat_interleave(group, 1)
    left, right = window
    right = 0 if causal else right
    i, j = torch.arange(N)[:, None], torch.arange(Nk)[None, :]  # [N, 1], [1, Nk]
    s = q @ k.transpose(-1, -2) / math.sqrt(d)  # [B, H, N, Nk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        sl = slopes.double().cpu().expand(B, H)[:, :, None, None]  # [B, H, 1, 1]
        s = s - sl * (i + diag - j).abs().double()
    keep = torch.ones(N, Nk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i + diag - left
    if right >= 0:
        keep &= j <= i + diag + right
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)  # [B, H, N]
    empty = torch.isneginf(lse)
    p = torch.where(empty[..., None], 0.0, torch.exp(s - torch.where(empty, 0.0, lse)[..., None]))
    return p @ v, lse


def _close(name, got, want, tol, rel=False):
    """Max abs error (relative to want's largest entry if rel) within tol; else the first few pairs, with index."""
    got = got.double().cpu()
    assert not torch.isnan(got).any(), f"{name}: NaN at {torch.isnan(got).nonzero()[:5].tolist()}"
    bound = tol * (want.abs().max().item() + 1e-6 if rel else 1.0)
    err = (got - want).abs()
    if err.max() > bound:
        idx = (err > bound).nonzero()[:5].tolist()
        pairs = [(ix, round(float(want[tuple(ix)]), 5), round(float(got[tuple(ix)]), 5)) for ix in idx]
        pytest.fail(f"{name}: max err {err.max():.3g} > {bound:.3g}; (index, reference, kernel): {pairs}")


def _check_fwd(o, lse, ro, rl, tol, label):
    """O and lse against the reference; rows that see no key: lse = -inf and O = 0 exactly, no NaN."""
    lse = lse.cpu()
    empty = torch.isneginf(rl)
    assert not torch.isnan(lse).any(), f"{label}: NaN in lse"
    assert torch.equal(torch.isneginf(lse), empty), \
        f"{label}: rows with lse = -inf {torch.isneginf(lse).nonzero().tolist()[:8]}, " \
        f"expected {empty.nonzero().tolist()[:8]}"
    assert (o.cpu()[empty] == 0).all(), f"{label}: a row that sees no key must have O = 0"
    _close(f"{label} O", o, ro, tol)
    _close(f"{label} lse", torch.where(empty, 0.0, lse.double()), torch.where(empty, 0.0, rl), tol)


def _diag(N, Nk, align):
    return Nk - N if align == "bottom_right" else 0


def _run_fwd(N, Nk, window=(-1, -1), causal=False, align="top_left", softcap=0.0, slopes=None, B=1, H=2, Hkv=2,
             dtype=F32, d=D, seed=0):
    q, k, v, _ = _inputs(B, H, Hkv, N, Nk, dtype, seed, d)
    o, lse = flash_attn_triton(q, k, v, causal, align=align, window_size=window, softcap=softcap, alibi_slopes=slopes)
    ro, rl = _ref(q.cpu(), k.cpu(), v.cpu(), _diag(N, Nk, align), window, causal, softcap, slopes)
    tol = TOL[dtype] * (4 if (softcap or slopes is not None) and dtype != torch.float32 else 1)
    _check_fwd(o, lse, ro, rl, tol, f"N={N} Nk={Nk} window={window} causal={causal} {align} softcap={softcap} "
                                    f"alibi={slopes is not None} {dtype}")
    return o, lse, rl


# ------------------------------------------------------------------ the reference itself
def test_reference_agrees_with_lesson12():
    """The reference here (both alignments) is lesson 12's on its bottom-right cases, window and softcap, ALiBi."""
    q, k, v, _ = _inputs(1, 2, 2, 30, 45, torch.float32)
    slopes = torch.tensor([0.5, 0.25])
    for window, causal, mod, lmod in (((3, 17), False, {}, None), ((5, -1), True, dict(softcap=5.0), L.softcap(5.0)),
                                      ((-1, 2), False, dict(slopes=slopes), L.alibi(slopes, 30, 45))):
        ro, rl = _ref(q, k, v, 15, window, causal, **mod)
        for h in range(2):
            lo, ll = L.attention_mods_ref(q[0, h].cpu(), k[0, h].cpu(), v[0, h].cpu(),  # lesson 12's: on the CPU
                                          L.sliding_window(30, 45, window, causal), lmod,
                                          h=h)
            assert torch.allclose(ro[0, h], lo) and torch.equal(torch.isneginf(rl[0, h]), torch.isneginf(ll))


# ------------------------------------------------------------------ forward: windows
WINDOWS = [  # (N, Nk, window, causal, align)
    (37, 37, (0, 0), False, "top_left"),
    (50, 50, (5, 0), True, "top_left"),
    (45, 45, (3, 17), False, "top_left"),
    (37, 45, (500, 500), False, "top_left"),  # wider than the sequence: full attention
    (45, 37, (-1, 4), False, "bottom_right"),
    (45, 30, (3, 17), False, "bottom_right"),
    (30, 45, (3, 17), False, "top_left"),
    (45, 30, (7, 2), False, "top_left"),
    (30, 45, (7, 2), True, "bottom_right"),
    (50, 20, (2, 0), False, "bottom_right"),  # rows 0..29 see nothing (below the diagonal's start)
    (50, 20, (2, 0), False, "top_left"),  # rows 22..49 see nothing (their lower bound is past the last key)
]


@pytest.mark.parametrize("N, Nk, window, causal, align", WINDOWS)
def test_forward_windows(N, Nk, window, causal, align):
    _run_fwd(N, Nk, window, causal, align)


def test_rows_that_see_nothing_give_zero_and_minus_inf():
    o, lse, rl = _run_fwd(50, 20, (2, 0), align="top_left")
    assert torch.isneginf(lse[:, :, 22:]).all() and (o[:, :, 22:] == 0).all()
    assert torch.isfinite(lse[:, :, :22]).all()


def test_window_sweep_around_tile_edges():
    """Windows narrower than, equal to and just wider than a 16-wide tile, one side at a time and both, against
    ragged lengths: a tile visited twice or skipped changes O."""
    for left, right in ((1, -1), (15, 0), (16, 1), (17, 15), (-1, 16), (31, 33), (0, 17)):
        _run_fwd(40, 41, (left, right), align="bottom_right", seed=left + 7)


def test_one_sided_window_is_causal_and_no_window_is_full():
    q, k, v, _ = _inputs(1, 2, 2, 37, 45)
    for align in ("top_left", "bottom_right"):
        o1, l1 = flash_attn_triton(q, k, v, True, align=align)
        o2, l2 = flash_attn_triton(q, k, v, False, align=align, window_size=(-1, 0))
        assert torch.equal(o1, o2) and torch.equal(l1, l2), f"(-1, 0) is causal ({align})"
    o1, l1 = flash_attn_triton(q, k, v)
    o2, l2 = flash_attn_triton(q, k, v, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# ------------------------------------------------------------------ forward: score modifications
@pytest.mark.parametrize("softcap, window, causal", [(5.0, (-1, -1), False), (50.0, (-1, -1), True),
                                                     (5.0, (6, 3), False)])   # a hard cap and a light one
def test_forward_softcap(softcap, window, causal):
    _run_fwd(45, 37, window, causal, "bottom_right", softcap=softcap)


@pytest.mark.parametrize("shape, window, causal, align", [("H", (-1, -1), True, "top_left"),
                                                          ("BH", (-1, -1), False, "bottom_right"),
                                                          ("H", (9, 0), False, "bottom_right")])
def test_forward_alibi_gqa(shape, window, causal, align):
    """Slopes [H] and [B, H] by turns (the [B, H] form also with softcap below and in the backward, both there)."""
    slopes = torch.rand(4) if shape == "H" else torch.rand(2, 4)
    _run_fwd(37, 45, window, causal, align, slopes=slopes.to(DEVICE), B=2, H=4, Hkv=2)


@pytest.mark.parametrize("window, causal, align", [((-1, -1), False, "top_left"), ((-1, -1), True, "bottom_right"),
                                                   ((7, 2), False, "bottom_right")])
def test_forward_softcap_with_alibi(window, causal, align):
    """Both at once (SCORE_MOD 3), the library's order: the softcap on the scaled score, then the ALiBi bias."""
    slopes = torch.rand(2, 4).to(DEVICE)
    _run_fwd(37, 45, window, causal, align, softcap=5.0, slopes=slopes, B=2, H=4, Hkv=2)


def test_forward_head_dim_not_a_power_of_two():
    _run_fwd(37, 37, (5, 0), softcap=20.0, d=40)
    _run_fwd(30, 37, (4, 2), causal=True, align="bottom_right", slopes=torch.rand(2).to(DEVICE), d=40)


def test_forward_fp16():
    _run_fwd(45, 45, (9, 0), slopes=torch.rand(2).to(DEVICE), dtype=LOW)
    _run_fwd(37, 50, (3, 17), align="bottom_right", softcap=30.0, dtype=LOW)


def test_a_late_first_key_with_a_very_negative_score_in_half_precision():
    """Row 20 of the block of rows 16..31 sees keys 17..20 only (window (3, 0)); the block's first tile (keys
    0..15) is all masked for it. Its running max must stay -inf until its keys come, or p = exp2(s - 0) of their very
    negative scores underflows in the half-precision P V while l keeps it (O = 0 instead of a mean of v)."""
    q, k, v, _ = _inputs(1, 2, 2, 40, 40, LOW, seed=3)
    k[:, :, 17:21] = -q[:, :, 20:21]  # row 20's four scores: -|q_20|^2 / 4, about -36 (-52 in base 2)
    o, lse = flash_attn_triton(q, k, v, window_size=(3, 0))
    ro, rl = _ref(q.cpu(), k.cpu(), v.cpu(), 0, (3, 0))
    _check_fwd(o, lse, ro, rl, TOL[LOW], "window (3, 0), late first key")


# ------------------------------------------------------------------ backward
BWD = [  # (N, Nk, window, causal, align, softcap, alibi, dq_mode)
    (45, 45, (3, 17), False, "top_left", 0.0, None, "separate"),
    (37, 50, (5, 0), True, "bottom_right", 0.0, None, "atomic"),
    (50, 20, (2, 1), False, "top_left", 0.0, None, "separate"),  # rows that see nothing
    (32, 48, (-1, -1), True, "top_left", 5.0, None, "separate"),  # even: no ragged loop
    (37, 45, (6, 3), False, "bottom_right", 5.0, None, "atomic"),
    (45, 37, (7, 0), False, "bottom_right", 0.0, "BH", "separate"),
    (32, 32, (-1, -1), True, "top_left", 0.0, "H", "atomic"),
    (37, 45, (9, 2), False, "bottom_right", 5.0, "BH", "separate"),  # softcap with ALiBi
    (40, 29, (-1, -1), True, "top_left", 20.0, "H", "atomic"),
]


@pytest.mark.parametrize("N, Nk, window, causal, align, softcap, alibi, dq_mode", BWD)
def test_backward_matches_float64_autograd(N, Nk, window, causal, align, softcap, alibi, dq_mode):
    B, H, Hkv = (2, 4, 2) if alibi else (1, 2, 2)
    slopes = None if alibi is None else (torch.rand(H) if alibi == "H" else torch.rand(B, H)).to(DEVICE)
    q, k, v, do = _inputs(B, H, Hkv, N, Nk, seed=N + Nk)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mods = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    o = flash_attention(q, k, v, causal, align=align, dq_mode=dq_mode, **mods)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ro, _ = _ref(qd, kd, vd, _diag(N, Nk, align), window, causal, softcap, slopes)
    rq, rk, rv = torch.autograd.grad(ro, (qd, kd, vd), do.cpu().double())
    label = f"N={N} Nk={Nk} window={window} causal={causal} {align} softcap={softcap} alibi={alibi} {dq_mode}"
    _close(f"{label} O", o.detach(), ro.detach(), TOL[F32])
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _close(f"{label} {name}", got, want, 3e-3 if F32 == torch.float32 else 2e-2, rel=True)


def test_backward_direct_call_takes_the_forward_arguments():
    """flash_attn_bwd_triton with the forward's (O, lse) equals the autograd path."""
    q, k, v, do = _inputs(1, 2, 2, 37, 37)
    mods = dict(window_size=(4, 0), softcap=20.0)
    o, lse = flash_attn_triton(q, k, v, **mods)
    got = flash_attn_bwd_triton(do, q, k, v, o, lse, dq_mode="separate", **mods)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(flash_attention(q2, k2, v2, dq_mode="separate", **mods), (q2, k2, v2), do)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ packed variable-length
def _packed(lens_q, lens_k, H, Hkv, seed, d=D):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = (torch.randn(tq, H, d, generator=g) * 3).to(DEVICE, F32)
    k = (torch.randn(tk, Hkv, d, generator=g) * 3).to(DEVICE, F32)
    v = torch.randn(tk, Hkv, d, generator=g).to(DEVICE, F32)
    do = torch.randn(tq, H, d, generator=g).to(DEVICE, F32)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
          for lens in (lens_q, lens_k)]
    return q, k, v, do, cu


@pytest.mark.parametrize("window, causal, softcap, alibi", [((5, 0), False, 5.0, False), ((3, 17), False, 0.0, True),
                                                            ((4, -1), True, 50.0, False), ((6, 2), True, 5.0, True)])
def test_varlen_forward_and_backward(window, causal, softcap, alibi):
    """Three sequences, one of length 1, q and k lengths differing both ways (bottom-right per sequence)."""
    lens_q, lens_k, H, Hkv = [37, 1, 20], [30, 3, 24], 4, 2
    q, k, v, do, (cu_q, cu_k) = _packed(lens_q, lens_k, H, Hkv, seed=len(window) + int(softcap))
    slopes = torch.rand(3, H).to(DEVICE) if alibi else None
    mods = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    o, lse = flash_attn_varlen_triton(q, k, v, cu_q, cu_k, 37, 30, causal, **mods)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    og = flash_attention_varlen(qg, kg, vg, cu_q, cu_k, 37, 30, causal, **mods)
    assert torch.equal(og.detach(), o)
    dq, dk, dv = torch.autograd.grad(og, (qg, kg, vg), do)
    qd, kd, vd = (t.cpu().double().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        sb = None if slopes is None else slopes[b].cpu()
        ro, rl = _ref(qd[qs].transpose(0, 1)[None], kd[ks].transpose(0, 1)[None], vd[ks].transpose(0, 1)[None],
                      lens_k[b] - lens_q[b], window, causal, softcap, sb)
        outs.append(ro[0].transpose(0, 1))
        lses.append(rl[0])
    ro, rl = torch.cat(outs), torch.cat(lses, 1)  # [total_q, H, d], [H, total_q]
    label = f"varlen window={window} causal={causal} softcap={softcap} alibi={alibi}"
    _check_fwd(o.transpose(0, 1), lse, ro.detach().transpose(0, 1), rl.detach(), TOL[F32], label)
    rq, rk, rv = torch.autograd.grad(ro, (qd, kd, vd), do.cpu().double())
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _close(f"{label} {name}", got, want, 3e-3 if F32 == torch.float32 else 2e-2, rel=True)


# ------------------------------------------------------------------ bad arguments
def _qkv():
    q, k, v, _ = _inputs(2, 4, 2, 20, 20)
    return q, k, v


BAD = [
    (dict(window_size=(3,)), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(True, 0)), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(2.0, 0)), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size="ab"), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(-2, 0)), ValueError, r"each side is >= 0, or -1"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap="5"), TypeError, r"softcap must be a number"),
    (dict(softcap=True), TypeError, r"softcap must be a number"),
    (dict(alibi_slopes=torch.rand(4, dtype=torch.float64)), TypeError, r"alibi_slopes must be a float32"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes must be a float32"),
    (dict(alibi_slopes=torch.rand(3)), ValueError, r"alibi_slopes must be \[H\] = \[4\] or \[B, H\] = \[2, 4\]"),
    (dict(alibi_slopes=torch.rand(4, 2)), ValueError, r"got \(4, 2\)"),
]


@pytest.mark.parametrize("kwargs, err, match", BAD)
def test_bad_arguments(kwargs, err, match):
    q, k, v = _qkv()
    kwargs = {n: (a.to(DEVICE) if isinstance(a, torch.Tensor) else a) for n, a in kwargs.items()}
    with pytest.raises(err, match=match):
        flash_attn_triton(q, k, v, **kwargs)
    with pytest.raises(err, match=match):
        flash_attention(q, k, v, **kwargs)


def test_bad_arguments_elsewhere():
    q, k, v = _qkv()
    o, lse = flash_attn_triton(q, k, v)
    with pytest.raises(ValueError, match=r"each side is >= 0"):
        flash_attn_bwd_triton(o, q, k, v, o, lse, window_size=(0, -5))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"alibi_slopes is on meta, q on cpu"):
            flash_attn_triton(q, k, v, alibi_slopes=torch.rand(4, device="meta"))
    qp, kp, vp, _, (cu_q, cu_k) = _packed([5, 7], [5, 7], 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"\[num_seqs, H\] = \[2, 4\]"):
        flash_attn_varlen_triton(qp, kp, vp, cu_q, cu_k, 7, 7, alibi_slopes=torch.rand(3, 4).to(DEVICE))
    with pytest.raises(ValueError, match=r"softcap must be a finite number"):
        flash_attention_varlen(qp, kp, vp, cu_q, cu_k, 7, 7, softcap=-2.0)
    o, lse = flash_attn_varlen_triton(qp, kp, vp, cu_q, cu_k, 7, 7, dropout_p=0.5, rng_state=(3, 1))
    with pytest.raises(ValueError, match=r"needs the forward's rng_state"):  # the mask is the forward's, not a new one
        flash_attn_varlen_bwd_triton(o, qp, kp, vp, o, lse, cu_q, cu_k, 7, 7, dropout_p=0.5)
