"""flash_attn_triton's ``backend``: "auto" runs lesson 11's Gluon forward where it can take the call and was measured
faster (an sm_90 GPU, bf16/fp16, ``GLUON_ROUTES``: d = 128 full or causal, d = 64 full; no window, softcap, ALiBi or
fixed Triton tiles), the Triton kernel everywhere else; "gluon" says why it cannot; "triton" is always the Triton
kernel.

Here (CPU, the interpreter) every call takes the Triton kernel and "gluon" is a clear error. On an sm_90 GPU
(``make check-gpu``) the routed calls are checked against float64 and against ``gluon_forward`` itself, and the
autograd Function's gradients through the Gluon forward against float64 autograd.
"""
import math

import pytest
import torch

from kernel_env import DEVICE, ON_GPU  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers.kernels.backward import flash_attention  # noqa: E402
from helpers.kernels.forward import (BACKENDS, GLUON_ROUTES, _check_mods, _why_not_gluon,  # noqa: E402
                                     flash_attn_triton)

ON_SM90 = ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def _qkv(B, H, Hkv, N, Nk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, N, d, generator=g) * 2).to(DEVICE, dtype)
    k = (torch.randn(B, Hkv, Nk, d, generator=g) * 2).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g).to(DEVICE, dtype)
    return q, k, v


def _reference(q, k, v, causal, diag):
    """float64 (O, lse); K, V repeated to q's heads; a row that sees no key: O = 0, lse = -inf."""
    H, Hkv = q.shape[1], k.shape[1]
    q, k, v = (t.double().cpu() for t in (q, k, v))
    k, v = (t.repeat_interleave(H // Hkv, 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])           # [B, H, N, Nk]
    if causal:
        rows, cols = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
        s = s.masked_fill(cols > rows + diag, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None]) @ v, lse


def test_unknown_backend_is_a_clear_error():
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'gluon', got 'cuda'"):
        flash_attn_triton(q, k, v, backend="cuda")
    assert BACKENDS == ("auto", "triton", "gluon")


@pytest.mark.skipif(ON_SM90, reason="here the Gluon forward can run")
def test_gluon_backend_says_why_not_here():
    """No sm_90 GPU: "gluon" names the reason; "auto" and "triton" agree (both the Triton kernel)."""
    q, k, v = _qkv(1, 2, 2, 40, 40, 64, torch.float16)
    with pytest.raises(ValueError, match=r"backend='gluon': the Gluon kernels (run only natively|need sm_90)"):
        flash_attn_triton(q, k, v, backend="gluon")
    o_auto, lse_auto = flash_attn_triton(q, k, v, causal=True)
    o_tl, lse_tl = flash_attn_triton(q, k, v, causal=True, backend="triton")
    assert torch.equal(o_auto, o_tl) and torch.equal(lse_auto, lse_tl)


def test_why_not_gluon_names_each_reason():
    """The reasons, each on the one thing that rules the Gluon forward out (checked in the order the function
    checks, so on a CPU the first reason is always the device)."""
    q, k, v = _qkv(1, 2, 2, 8, 8, 64, torch.float16)
    plain = _check_mods(False, (-1, -1), 0.0, None, 2, 1, q.device)
    if not ON_SM90:
        assert "sm_90" in _why_not_gluon(q, plain, None, None)
        return
    assert _why_not_gluon(q, plain, None, None) == ""
    assert "bfloat16 or float16" in _why_not_gluon(q.float(), plain, None, None)
    q96 = torch.zeros(1, 2, 8, 96, device=DEVICE, dtype=torch.float16)
    assert "d = 64 or 128" in _why_not_gluon(q96, plain, None, None)
    for mods in (_check_mods(False, (4, 0), 0.0, None, 2, 1, q.device), _check_mods(False, (-1, -1), 30.0, None, 2, 1,
                                                                                     q.device)):
        assert "window_size, softcap or alibi_slopes" in _why_not_gluon(q, mods, None, None)
    assert "Triton kernel's tiles" in _why_not_gluon(q, plain, True, None)
    assert GLUON_ROUTES == {(64, False), (128, False), (128, True)}    # d = 64 causal: "auto" keeps the Triton kernel


@pytest.mark.skipif(not ON_SM90, reason="the Gluon forward runs only on an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,H,Hkv,N,Nk,d,causal,align", [
    (2, 4, 4, 333, 333, 64, False, "top_left"), (1, 4, 4, 1000, 300, 128, True, "bottom_right"),
    (1, 8, 2, 257, 700, 64, True, "top_left"), (2, 4, 1, 130, 1, 128, False, "top_left")])
def test_auto_runs_gluon_on_sm90_and_is_correct(B, H, Hkv, N, Nk, d, causal, align, dtype):
    from helpers.kernels.gluon_forward import gluon_forward
    q, k, v = _qkv(B, H, Hkv, N, Nk, d, dtype)
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align)
    routed = (d, causal) in GLUON_ROUTES
    o_g, lse_g = (gluon_forward(q, k, v, variant="auto", causal=causal, align=align) if routed else
                  flash_attn_triton(q, k, v, causal=causal, align=align, backend="triton"))
    assert torch.equal(o, o_g) and torch.equal(lse, lse_g), \
        f"backend='auto' did not run the {'Gluon' if routed else 'Triton'} forward"
    if not routed:                                       # the Gluon kernel takes the call when asked
        o, lse = flash_attn_triton(q, k, v, causal=causal, align=align, backend="gluon")
    o64, lse64 = _reference(q, k, v, causal, (Nk - N) if align == "bottom_right" else 0)
    seen = torch.isfinite(lse64)
    err = (o.double().cpu() - o64)[seen].abs().max().item()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert err <= tol, f"|O - float64| {err:.2e} > {tol}"
    assert torch.equal(lse.cpu()[~seen], lse64[~seen].float()) and (o.cpu()[~seen] == 0).all()
    assert (lse.double().cpu() - lse64)[seen].abs().max().item() <= 1e-3 * max(1.0, lse64[seen].abs().max().item())


@pytest.mark.skipif(not ON_SM90, reason="the Gluon forward runs only on an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_through_the_gluon_forward(causal):
    """flash_attention's forward goes through the Gluon kernel on sm_90; its lse feeds the Triton backward, whose
    gradients must match float64 autograd as they do with the Triton forward."""
    q, k, v = _qkv(1, 4, 2, 300, 300, 64, torch.bfloat16, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    flash_attention(q, k, v, causal=causal).backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kr, vr = (t.repeat_interleave(2, 1) for t in (k64, v64))
    mask = torch.ones(300, 300, dtype=torch.bool, device=DEVICE).tril() if causal else None
    torch.nn.functional.scaled_dot_product_attention(q64, kr, vr, attn_mask=mask).backward(do.double())
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 5e-2 * max(1.0, want.abs().max().item()), f"{name}: |grad - float64| {err:.2e}"
