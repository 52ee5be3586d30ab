"""Correctness of helpers/kernels/backward.py (the backward kernels and ``flash_attention``).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported) on small shapes in fp32 and fp16; on a CUDA machine the same checks run natively in fp16 and
bf16. The reference is float64 autograd through an explicit masked softmax (a row that sees no key has
O = 0 and zero gradients). Inputs are harsh: scores of a few units to tens, N and Nk not multiples of any
block, N != Nk with both causal alignments, rows that see nothing.
"""

import math
import os
import warnings

import pytest
import torch

from kernel_env import DEVICE, DTYPES, ON_GPU  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers import reference  # noqa: E402
from helpers.kernels.forward import flash_attn_triton  # noqa: E402
from helpers.kernels.backward import flash_attention, flash_attn_bwd_triton  # noqa: E402



def _inputs(B, H, N, Nk, d, dtype, seed, scale=2.0, Hkv=None):
    Hkv = H if Hkv is None else Hkv
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, N, d, generator=g) * scale).to(DEVICE, dtype)
    k = (torch.randn(B, Hkv, Nk, d, generator=g) * scale).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g).to(DEVICE, dtype)
    do = torch.randn(B, H, N, d, generator=g).to(DEVICE, dtype)
    return q, k, v, do


def reference_grads(q, k, v, do, causal, align, sm_scale):
    """(O, dq, dk, dv) in float64 on the CPU by autograd (``helpers.reference.attention_grads``); a row with no
    visible key gives O = 0 and no gradient. Grouped-query attention: k, v repeated to q's heads for the
    reference, and dk, dv summed back over each KV head's group."""
    group = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(group, dim=1) for t in (k, v))  # [B, H, Nk, d]
    mask = reference.causal_mask(q.shape[-2], k.shape[-2], align) if causal else None  # [N, Nk]
    o, _, dq, dk, dv = reference.attention_grads(*(t.cpu() for t in (q, kr, vr, do)), mask=mask, scale=sm_scale)
    B, Hkv, Nk, d = k.shape
    dk, dv = (t.view(B, Hkv, group, Nk, d).sum(2) for t in (dk, dv))  # [B, Hkv, Nk, d]
    return o, dq, dk, dv


def _tol(dtype):
    return {torch.float32: 3e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]


def _report(name, got, want, tol):
    got = got.double().cpu()
    err = (got - want).abs()
    scale = want.abs().max().item() + 1e-6
    if torch.isnan(got).any():
        idx = torch.isnan(got).nonzero()[:5].tolist()
        pytest.fail(f"{name}: NaN at {idx}")
    if err.max() > tol * scale:
        idx = (err > tol * scale).nonzero()[:5].tolist()
        pairs = [(i, round(float(want[tuple(i)]), 5), round(float(got[tuple(i)]), 5)) for i in idx]
        pytest.fail(f"{name}: max err {err.max():.3g} > {tol} x {scale:.3g}; first (index, ref, got): {pairs}")


CASES = [
    # B, H, N, Nk, d, causal, align
    (1, 2, 37, 37, 16, False, "top_left"),  # ragged, not causal
    (2, 1, 50, 50, 32, True, "top_left"),  # causal, ragged diagonal
    (1, 1, 33, 70, 16, True, "bottom_right"),  # N < Nk: new queries after a cache
    (1, 1, 45, 20, 16, True, "bottom_right"),  # N > Nk: the first 25 rows see nothing
    (1, 1, 40, 29, 32, True, "top_left"),  # N > Nk top-left: key tail, rows past Nk see all
    (1, 1, 24, 61, 64, False, "top_left"),  # N < Nk, d = 64
    (1, 1, 20, 45, 16, True, "top_left"),  # N < Nk top-left: keys past row i + 0 never seen
]


@pytest.mark.parametrize("B,H,N,Nk,d,causal,align,dq_mode",
                         [c + ("separate",) for c in CASES] + [c + ("atomic",) for c in CASES[1:4]])
def test_backward_matches_float64_autograd(B, H, N, Nk, d, causal, align, dq_mode):
    dtype = DTYPES[0]
    q, k, v, do = _inputs(B, H, N, Nk, d, dtype, seed=N * 7 + Nk)
    sm_scale = 1.0 / math.sqrt(d)
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align)
    dq, dk, dv = flash_attn_bwd_triton(do, q, k, v, o, lse, causal=causal, align=align, dq_mode=dq_mode)
    for name, t, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), (q, k, v)):
        assert t.shape == ref.shape and t.dtype == ref.dtype, name
    _, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, do, causal, align, sm_scale)
    _report("dv", dv, dv_ref, _tol(dtype))
    _report("dk", dk, dk_ref, _tol(dtype))
    _report("dq", dq, dq_ref, _tol(dtype))


GQA_CASES = [
    # B, H, Hkv, N, Nk, d, causal, align, dq_mode
    (1, 2, 1, 21, 37, 16, True, "bottom_right", "separate"),  # group 2, N < Nk
    (2, 4, 1, 19, 19, 16, True, "top_left", "separate"),  # group 4 (multi-query), B = 2
    (1, 8, 1, 17, 13, 16, True, "bottom_right", "atomic"),  # group 8, N > Nk: rows that see nothing; atomic dQ
    (1, 8, 2, 16, 32, 16, False, "top_left", "separate"),  # group 4, two KV heads, even tiles
    (1, 4, 2, 23, 9, 32, True, "top_left", "atomic"),  # group 2, atomic dQ, key tail
]


@pytest.mark.parametrize("B,H,Hkv,N,Nk,d,causal,align,dq_mode", GQA_CASES)
def test_backward_gqa_matches_float64_autograd(B, H, Hkv, N, Nk, d, causal, align, dq_mode):
    """Grouped-query attention: dk, dv of each KV head are the sums over its H // Hkv query heads (the reference
    repeats k and v and sums back); groups 1 (above), 2, 4 and 8; both dQ modes."""
    dtype = DTYPES[0]
    q, k, v, do = _inputs(B, H, N, Nk, d, dtype, seed=H * 11 + Hkv + N, Hkv=Hkv)
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align)
    dq, dk, dv = flash_attn_bwd_triton(do, q, k, v, o, lse, causal=causal, align=align, dq_mode=dq_mode)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    _, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, do, causal, align, 1.0 / math.sqrt(d))
    _report("dv", dv, dv_ref, _tol(dtype))
    _report("dk", dk, dk_ref, _tol(dtype))
    _report("dq", dq, dq_ref, _tol(dtype))


HEAD_DIM_CASES = [
    # B, H, Hkv, N, Nk, d, causal, align, dq_mode: head dims computed in padded tiles, masked along d
    (1, 2, 1, 19, 23, 8, True, "top_left", "separate"),  # d = 8 (16 wide), GQA
    (1, 2, 2, 21, 17, 40, True, "bottom_right", "separate"),  # d = 40 (64 wide), rows that see nothing
    (1, 2, 1, 17, 20, 80, False, "top_left", "atomic"),  # d = 80 (128 wide), GQA, atomic dQ (masked along d)
    (1, 1, 1, 16, 16, 96, True, "top_left", "separate"),  # d = 96, even tiles: the unmasked loops masked along d
    (1, 2, 1, 9, 11, 256, True, "bottom_right", "separate"),  # d = 256: the widest, one tiny case
    (1, 2, 2, 13, 18, 3, True, "bottom_right", "separate"),  # any d, as the library: d = 3 (16 wide)
    (1, 2, 1, 17, 16, 59, False, "top_left", "atomic"),  # d = 59, GQA, atomic dQ
    (1, 1, 1, 16, 16, 111, True, "top_left", "separate"),  # d = 111, even tiles
]


@pytest.mark.parametrize("B,H,Hkv,N,Nk,d,causal,align,dq_mode", HEAD_DIM_CASES)
def test_backward_any_head_dim(B, H, Hkv, N, Nk, d, causal, align, dq_mode):
    dtype = DTYPES[0]
    q, k, v, do = _inputs(B, H, N, Nk, d, dtype, seed=d + N, Hkv=Hkv)
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align)
    dq, dk, dv = flash_attn_bwd_triton(do, q, k, v, o, lse, causal=causal, align=align, dq_mode=dq_mode)
    _, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, do, causal, align, 1.0 / math.sqrt(d))
    _report("dv", dv, dv_ref, _tol(dtype))
    _report("dk", dk, dk_ref, _tol(dtype))
    _report("dq", dq, dq_ref, _tol(dtype))


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_backward_strided_views(dq_mode):
    """q, k, v as views of the library's packed qkv [B, N, 3, H, d], gradients written into views of one packed
    gradient (nothing concatenated), dO in another layout again: the gradients of contiguous copies."""
    from helpers.kernels.backward import _flash_bwd
    from helpers.kernels.forward import _check_mods
    B, H, N, d = 1, 2, 19, 16
    g = torch.Generator().manual_seed(2)
    qkv = (torch.randn(B, N, 3, H, d, generator=g) * 2).to(DEVICE, DTYPES[0])
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, N, d] views
    do = torch.randn(B, N, H, d, generator=g).to(DEVICE, DTYPES[0]).transpose(1, 2)
    o, lse = flash_attn_triton(q, k, v, causal=True)
    dqkv = torch.empty_like(qkv)
    mods = _check_mods(True, (-1, -1), 0.0, None, H, B, q.device)
    out = _flash_bwd(do, q, k, v, o, lse, mods, None, 0, dq_mode=dq_mode,
                     dq=dqkv[:, :, 0].transpose(1, 2), dk=dqkv[:, :, 1].transpose(1, 2), dv=dqkv[:, :, 2].transpose(1, 2))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    oc, lsec = flash_attn_triton(qc, kc, vc, causal=True)
    want = flash_attn_bwd_triton(do.contiguous(), qc, kc, vc, oc, lsec, causal=True, dq_mode=dq_mode)
    for i, (name, w) in enumerate(zip(("dq", "dk", "dv"), want)):
        got = dqkv[:, :, i].transpose(1, 2)
        assert out[i].data_ptr() == got.data_ptr()
        _report(name, got, w.double().cpu(), 1e-5)


def test_gqa_separate_mode_is_deterministic():
    """dk, dv summed over the group in registers (no atomics): two runs give the same bits."""
    q, k, v, do = _inputs(1, 4, 20, 20, 16, DTYPES[0], seed=3, Hkv=1)
    o, lse = flash_attn_triton(q, k, v, causal=True)
    a = flash_attn_bwd_triton(do, q, k, v, o, lse, causal=True, dq_mode="separate")
    b = flash_attn_bwd_triton(do, q, k, v, o, lse, causal=True, dq_mode="separate")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_autograd_function_low_precision(dtype):
    """flash_attention through torch.autograd in the second dtype, causal, with a custom sm_scale."""
    q, k, v, do = _inputs(1, 2, 29, 29, 16, dtype, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, v, causal=True, sm_scale=0.3)
    o.backward(do)
    o_ref, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, do, True, "top_left", 0.3)
    _report("O", o.detach(), o_ref, _tol(dtype))
    for name, t, ref in (("dq", q.grad, dq_ref), ("dk", k.grad, dk_ref), ("dv", v.grad, dv_ref)):
        _report(name, t, ref, _tol(dtype))


def test_autograd_matches_sdpa_autograd():
    """The same gradients as SDPA's own backward (fp32 under the interpreter, fp16 on a GPU)."""
    q, k, v, do = _inputs(2, 2, 21, 21, 32, DTYPES[0], seed=9, scale=1.0)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    b = [t.clone().float().requires_grad_() for t in (q, k, v)]
    flash_attention(*a, causal=True).backward(do)
    torch.nn.functional.scaled_dot_product_attention(*b, is_causal=True).backward(do.float())
    for x, y in zip(a, b):
        assert (x.grad.float() - y.grad).abs().max() < 5 * _tol(DTYPES[0])


def test_gradcheck_float64_logic():
    """torch.autograd.gradcheck on a tiny fp32 case, loose tolerances: the Function's wiring (argument order,
    which grad goes where, the None for the non-tensor arguments) is right."""
    if ON_GPU:
        pytest.skip("fp32 gradcheck runs under the interpreter")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 5, 16, generator=g).requires_grad_() for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp32 inputs: the tolerances below account for it
        assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, causal=True), (q, k, v),
                                        eps=1e-2, atol=5e-3, rtol=5e-2, nondet_tol=1e-5, fast_mode=True)
        q2 = torch.randn(1, 2, 5, 16, generator=g).requires_grad_()  # grouped-query: 2 query heads, 1 KV head
        assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, causal=True), (q2, k, v),
                                        eps=1e-2, atol=5e-3, rtol=5e-2, nondet_tol=1e-5, fast_mode=True)


def test_validation_messages():
    q, k, v, do = _inputs(1, 2, 8, 8, 16, DTYPES[0], seed=0)
    with pytest.raises(ValueError, match="4 dimensions"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="align"):
        flash_attention(q, k, v, causal=True, align="middle")
    with pytest.raises(TypeError, match="causal"):
        flash_attention(q, k, v, causal="yes")
    o, lse = flash_attn_triton(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        flash_attn_bwd_triton(do, q, k, v, o, lse.double())
    with pytest.raises(ValueError, match="do must be"):
        flash_attn_bwd_triton(do[:, :, :3], q, k, v, o, lse)
    with pytest.raises(ValueError, match="dq_mode"):
        flash_attn_bwd_triton(do, q, k, v, o, lse, dq_mode="fast")
    q3, k3, v3, _ = _inputs(1, 4, 8, 8, 16, DTYPES[0], seed=0, Hkv=3)
    with pytest.raises(ValueError, match="H = 4 query heads must be a multiple of Hkv = 3"):
        flash_attention(q3, k3, v3)
    with pytest.raises(ValueError, match="must be a multiple of Hkv = 3"):
        flash_attn_bwd_triton(do, q3[:, :2], k3, v3, o, lse)
    q12, k12, v12, _ = _inputs(1, 1, 4, 4, 264, DTYPES[0], seed=0)
    with pytest.raises(ValueError, match="head dimension d must be from 1 to 256, got 264"):
        flash_attention(q12, k12, v12)
    with pytest.raises(ValueError, match=r"k must be \[B, Hkv, Nk, d\]"):
        flash_attention(q, k[:, :, :, :8].contiguous(), v[:, :, :, :8].contiguous())


def test_train_gpt_tiny(tmp_path):
    """bench/train_gpt.py --cpu --tiny: the same GPT trained with flash_attention and with SDPA gives the same
    losses in fp32 (same seed, same batches), and the record and its figure are written."""
    if ON_GPU:
        pytest.skip("the tiny run is the CPU/interpreter configuration")
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "train_gpt.py"), "--cpu", "--tiny",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "train_gpt.json").read_text())
    a, b = rec["runs"]["flash"]["loss"], rec["runs"]["sdpa"]["loss"]
    assert len(a) == len(b) == rec["config"]["steps"] and all(math.isfinite(x) for x in a)
    assert rec["max_loss_diff"] < 1e-4, (a, b)
    assert a[-1] < a[0] + 0.5 and rec["runs"]["flash"]["tokens_per_s"] > 0
    assert (tmp_path / "train_gpt.png").stat().st_size > 1000
