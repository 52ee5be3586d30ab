"""Correctness of helpers/kernels/forward.py and helpers/kernels/decode.py.

On a machine without CUDA the kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set below before Triton is imported): small shapes, fp32
and fp16. On a CUDA machine the same checks run on the GPU in fp16 and bf16.
Inputs are harsh on purpose: large-magnitude scores, lengths that are not a
multiple of any block, a causal mask with N != Nk, empty decode splits.
"""

import math

import pytest
import torch

from kernel_env import DEVICE, DTYPES, ON_GPU  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers.kernels.common import TensorDescriptor  # noqa: E402
from helpers.kernels.decode import flash_decode_triton  # noqa: E402
from helpers.kernels.forward import flash_attn_triton  # noqa: E402



def _inputs(shape_q, shape_kv, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape_q, generator=g) * scale).to(DEVICE, dtype)
    k = (torch.randn(shape_kv, generator=g) * scale).to(DEVICE, dtype)
    v = torch.randn(shape_kv, generator=g).to(DEVICE, dtype)
    return q, k, v


def _reference(q, k, v, causal, diag, sm_scale):
    """float64 attention with an explicit mask; (O, lse), O = 0 and lse = -inf on empty rows."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * sm_scale  # [B, H, N, Nk]
    N, Nk = s.shape[-2:]
    if causal:
        i = torch.arange(N)[:, None]
        j = torch.arange(Nk)[None, :]
        s = s.masked_fill(j > i + diag, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, N]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def _tol(dtype):
    return {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def _report(name, got, want, tol):
    err = (got.double().cpu() - want).abs()
    finite = torch.isfinite(want)
    bad = (err > tol) & finite
    if bad.any() or torch.isnan(got).any():
        idx = bad.nonzero()[:5].tolist()
        pairs = [(i, float(want[tuple(i)]), float(got.double().cpu()[tuple(i)])) for i in idx]
        pytest.fail(f"{name}: max err {err[finite].max():.3g} > {tol}; first (index, ref, got): {pairs}")


CASES = [
    # B, H, N, Nk, d, causal, align
    (1, 2, 37, 37, 16, False, "top_left"),
    (2, 1, 50, 50, 32, True, "top_left"),
    (1, 2, 33, 70, 16, True, "bottom_right"),  # N < Nk: a cache plus new queries
    (1, 1, 45, 20, 16, True, "bottom_right"),  # N > Nk: the first 25 rows see nothing
    (1, 1, 40, 29, 32, True, "top_left"),
    (1, 1, 24, 61, 64, False, "top_left"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,N,Nk,d,causal,align", CASES)
def test_forward_matches_reference(B, H, N, Nk, d, causal, align, dtype):
    q, k, v = _inputs((B, H, N, d), (B, H, Nk, d), dtype, seed=N * 31 + Nk)
    sm_scale = 1.0 / math.sqrt(d)
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, H, N) and lse.dtype == torch.float32
    diag = (Nk - N) if align == "bottom_right" else 0
    o_ref, lse_ref = _reference(q, k, v, causal, diag, sm_scale)
    _report("O", o, o_ref, _tol(dtype))
    lse_c = lse.double().cpu()
    assert torch.equal(torch.isinf(lse_c), torch.isinf(lse_ref)), "lse is -inf on exactly the empty rows"
    _report("lse", lse, lse_ref, _tol(dtype) * 5)
    empty = torch.isinf(lse_ref)
    if empty.any():
        assert (o.cpu()[empty] == 0).all(), "an empty row must give O = 0"


def test_forward_matches_sdpa_causal():
    q, k, v = _inputs((1, 2, 48, 16), (1, 2, 48, 16), DTYPES[0], seed=3)
    o, _ = flash_attn_triton(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (o.float() - ref).abs().max() < _tol(DTYPES[0])


GQA_CASES = [
    # B, H, Hkv, N, Nk, d, causal, align
    (2, 4, 1, 21, 37, 16, False, "top_left"),  # multi-query: every head reads KV head 0
    (1, 4, 2, 30, 45, 32, True, "bottom_right"),  # two groups of two, ragged tiles
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,N,Nk,d,causal,align", GQA_CASES)
def test_forward_gqa_matches_sdpa(B, H, Hkv, N, Nk, d, causal, align, dtype):
    q, k, v = _inputs((B, H, N, d), (B, Hkv, Nk, d), dtype, seed=7 * H + Hkv)
    # fp16 takes the load path the default does not: TMA descriptors over [B*Hkv*Nk, d] under the
    # interpreter (where it works), plain pointers on a Hopper GPU
    other = dtype == torch.float16 and TensorDescriptor is not None
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align, use_tma=(not ON_GPU) if other else None)
    assert o.shape == q.shape and lse.shape == (B, H, N)
    mask = None
    if causal:  # SDPA's is_causal is top-left; bottom-right as an explicit boolean mask (True = keep)
        diag = (Nk - N) if align == "bottom_right" else 0
        mask = torch.arange(Nk)[None, :] <= torch.arange(N)[:, None] + diag  # [N, Nk]
    qd, kd, vd = (t.double().cpu() for t in (q, k, v))
    o_ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
    _report("O", o, o_ref, _tol(dtype))
    # lse through the same grouping, done by hand: query head h reads KV head h // (H // Hkv)
    kd_full = kd.repeat_interleave(H // Hkv, dim=1)  # [B, H, Nk, d]
    s = (qd @ kd_full.transpose(-1, -2)) / math.sqrt(d)  # [B, H, N, Nk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    _report("lse", lse, torch.logsumexp(s, -1), _tol(dtype) * 5)


HEAD_DIM_CASES = [
    # B, H, Hkv, N, Nk, d, causal, align: head dims that are not a power of two run in padded tiles, masked along d
    (1, 2, 1, 19, 23, 8, True, "top_left"),  # d = 8: computed 16 wide
    (1, 2, 2, 21, 17, 40, True, "bottom_right"),  # d = 40: 64 wide; N > Nk: rows that see nothing
    (1, 4, 2, 17, 33, 96, False, "top_left"),  # d = 96: 128 wide, GQA
    (1, 2, 1, 18, 21, 1, True, "bottom_right"),  # any d from 1 to 256, as the library: d = 1 computes 16 wide
    (2, 2, 2, 19, 17, 59, False, "top_left"),  # d = 59: rows not 16-byte aligned, loads unvectorised
    (1, 3, 1, 17, 20, 111, True, "top_left"),  # d = 111: 128 wide, MQA
]


@pytest.mark.parametrize("B,H,Hkv,N,Nk,d,causal,align", HEAD_DIM_CASES)
def test_forward_any_head_dim(B, H, Hkv, N, Nk, d, causal, align):
    """Any head dim (the library's 1 to 256): O and lse against float64, and the decode kernel on the same keys
    where it takes the d (multiples of 8). The inputs are not copied: q, k, v keep their d columns, the kernel pads
    in registers."""
    dtype = DTYPES[0]
    q, k, v = _inputs((B, H, N, d), (B, Hkv, Nk, d), dtype, seed=d + N)
    o, lse = flash_attn_triton(q, k, v, causal=causal, align=align)
    assert o.shape == q.shape
    kf, vf = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # [B, H, Nk, d]
    o_ref, lse_ref = _reference(q, kf, vf, causal, (Nk - N) if align == "bottom_right" else 0, 1.0 / math.sqrt(d))
    _report("O", o, o_ref, _tol(dtype))
    _report("lse", lse, lse_ref, _tol(dtype) * 5)
    if d % 8:
        return
    od = flash_decode_triton(q[:, :, -1].contiguous(), k, v, num_splits=2)  # the last row sees every key
    o_last, _ = _reference(q[:, :, -1:], kf, vf, False, 0, 1.0 / math.sqrt(d))
    _report("decode O", od, o_last[:, :, 0], _tol(dtype))


def test_head_dim_messages():
    q, k, v = _inputs((1, 1, 4, 264), (1, 1, 4, 264), DTYPES[0], seed=0)
    with pytest.raises(ValueError, match="head dimension d must be from 1 to 256, got 264"):
        flash_attn_triton(q, k, v)
    for d in (12, 4, 264):  # the decode kernel: multiples of 8
        q, k, v = _inputs((1, 1, 4, d), (1, 1, 4, d), DTYPES[0], seed=0)
        with pytest.raises(ValueError, match=f"head dimension d must be a multiple of 8 from 8 to 256.*got {d}"):
            flash_decode_triton(q[:, :, 0].contiguous(), k, v)
    q, k, v = _inputs((1, 1, 4, 40), (1, 1, 4, 40), DTYPES[0], seed=0)
    with pytest.raises(ValueError, match="use_tma=True needs a head dim that is a power of two"):
        flash_attn_triton(q, k, v, use_tma=True)


@pytest.mark.parametrize("layout", ["bnhd", "kvpacked", "qkvpacked"])
def test_forward_reads_strided_views_in_place(layout):
    """The library's layouts as views, nothing copied: [B, N, H, d] transposed, and the packed kv[:, :, 0] and
    qkv[:, :, 1] (a token's heads side by side in a row, rows 2 or 3 heads' widths apart). The same O and lse as on
    contiguous copies; O comes out in q's layout where q is dense."""
    B, H, Hkv, N, Nk, d = 2, 4, 2, 21, 21, 16
    g = torch.Generator().manual_seed(7)
    if layout == "qkvpacked":
        qkv = torch.randn(B, N, 3, H, d, generator=g).to(DEVICE, DTYPES[0])
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, N, d] views of [B, N, 3, H, d]
    else:
        q = torch.randn(B, N, H, d, generator=g).to(DEVICE, DTYPES[0]).transpose(1, 2)  # [B, H, N, d] view
        if layout == "kvpacked":
            kv = torch.randn(B, Nk, 2, Hkv, d, generator=g).to(DEVICE, DTYPES[0])
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        else:
            k, v = (torch.randn(B, Nk, Hkv, d, generator=g).to(DEVICE, DTYPES[0]).transpose(1, 2) for _ in range(2))
    assert not q.is_contiguous() and not k.is_contiguous()
    o, lse = flash_attn_triton(q, k, v, causal=True, align="bottom_right", softcap=10.0)
    oc, lsec = flash_attn_triton(*(t.contiguous() for t in (q, k, v)), causal=True, align="bottom_right",
                                 softcap=10.0)
    assert (o - oc).abs().max() <= 1e-6 * max(1.0, oc.abs().max().item()) and torch.allclose(lse, lsec, atol=1e-5)
    if layout != "qkvpacked":
        assert o.stride() == q.stride()


DECODE_CASES = [
    # B, H, Hkv, Nk, d, num_splits
    (2, 4, 4, 100, 32, None),  # MHA
    (1, 8, 2, 77, 16, 3),  # GQA, ragged last tile
    (2, 6, 3, 40, 32, 8),  # more splits than tiles: some splits see no key
    (1, 4, 1, 19, 64, 1),  # MQA, one split
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,Nk,d,num_splits", DECODE_CASES)
def test_decode_matches_reference(B, H, Hkv, Nk, d, num_splits, dtype):
    q, k, v = _inputs((B, H, d), (B, Hkv, Nk, d), dtype, seed=Nk + H)
    o = flash_decode_triton(q, k, v, num_splits=num_splits)
    assert o.shape == q.shape and o.dtype == q.dtype
    group = H // Hkv
    k_full = k.repeat_interleave(group, dim=1)  # [B, H, Nk, d]
    v_full = v.repeat_interleave(group, dim=1)
    o_ref, _ = _reference(q[:, :, None, :], k_full, v_full, False, 0, 1.0 / math.sqrt(d))
    _report("O", o, o_ref[:, :, 0, :], _tol(dtype))


def _ok():
    return _inputs((1, 2, 8, 16), (1, 2, 8, 16), DTYPES[0], seed=0)


def test_validation_messages():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="4 dimensions"):
        flash_attn_triton(q[0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_triton(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="contiguous"):
        flash_attn_triton(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)
    with pytest.raises(ValueError, match="k must be"):
        flash_attn_triton(q, k[..., :8].contiguous(), v[..., :8].contiguous())
    with pytest.raises(ValueError, match="multiple of Hkv"):  # 2 query heads cannot share 3 KV heads
        flash_attn_triton(q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1))
    with pytest.raises(ValueError, match="align"):
        flash_attn_triton(q, k, v, causal=True, align="middle")
    with pytest.raises(TypeError, match="torch.Tensor"):
        flash_attn_triton(q.tolist(), k, v)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        flash_decode_triton(q[:, :1, 0, :].repeat(1, 3, 1).contiguous(), k, v)
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode_triton(q[:, :, 0, :].contiguous(), k, v, num_splits=0)
