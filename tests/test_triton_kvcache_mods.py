"""flash_attn_with_kvcache_triton's window_size, softcap and alibi_slopes (helpers/kernels/kvcache.py).

The library's meaning, bottom-right per sequence: new token i of sequence b sits at position
p = cache_seqlens[b] - Nq + i and sees cached key j when p - left <= j <= p + right (-1:
unbounded; causal sets right = 0); softcap turns the scaled score s into cap * tanh(s / cap),
ALiBi subtracts slope[h] * |p - j|, both before the mask. Each case is compared with a float64
reference written densely below (one sequence, one head at a time); a row that sees no key: O = 0.
Contiguous and paged caches (built as in tests/test_triton_kvcache.py); interpreter on the CPU.
"""

import math

import pytest
import torch

from kernel_env import DEVICE, DTYPES, ON_GPU, TOL  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers.kernels import decode as decode_module  # noqa: E402
from helpers.kernels.kvcache import flash_attn_with_kvcache_triton  # noqa: E402
from test_triton_kvcache import assert_close, make_cache, reference, to_pages  # noqa: E402

# fp32 inputs: exact fp32 under the interpreter; on a GPU the kernel's dot products run in tf32 (a 10-bit mantissa,
# fp16's), so the fp32 cases there get fp16's tolerance (measured on an H200: up to 7.7e-3 with values near 2)
F32_TOL = TOL[torch.float16] if ON_GPU else TOL[torch.float32]


def reference_mods(q, k, v, lens, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """float64, densely: S = q k^T / sqrt(d), softcap, ALiBi, the window mask (-inf), softmax; a row that
    sees no key: 0. q [B, Nq, H, d], k, v [B, Nmax, Hkv, d] (contiguous); returns [B, Nq, H, d]."""
    B, Nq, H, d = q.shape
    group = H // k.shape[2]
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros(B, Nq, H, d, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        p = torch.arange(Nq)[:, None] + L - Nq  # [Nq, 1] each new token's position
        j = torch.arange(L)[None, :]  # [1, L]
        seen = torch.ones(Nq, L, dtype=torch.bool)
        if left >= 0:
            seen &= j >= p - left
        if right >= 0:
            seen &= j <= p + right
        for h in range(H):
            qh = q[b, :, h].double().cpu()  # [Nq, d]
            kh = k[b, :L, h // group].double().cpu()  # [L, d]
            vh = v[b, :L, h // group].double().cpu()
            s = qh @ kh.T / math.sqrt(d)  # [Nq, L]
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                s = s - float(slope) * (p - j).abs().double()
            s = s.masked_fill(~seen, -math.inf)
            empty = ~seen.any(1, keepdim=True)  # [Nq, 1]
            P = torch.softmax(torch.where(empty, 0.0, s), 1).masked_fill(~seen, 0.0)
            out[b, :, h] = torch.where(empty, 0.0, P @ vh)
    return out


def test_reference_agrees_with_the_plain_one():
    """With no window and no score modification, reference_mods is test_triton_kvcache's SDPA reference."""
    q, k, v = make_cache(3, 3, 4, 2, 16, 20, torch.float32, seed=1)
    for causal in (False, True):
        want = reference(q, k, v, (0, 2, 20), causal)
        assert torch.allclose(reference_mods(q, k, v, (0, 2, 20), causal), want, atol=1e-12)


def _slopes(B, H, per_batch, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (B, H) if per_batch else (H,)
    return (torch.rand(shape, generator=g) * 0.9 + 0.1).to(DEVICE)  # float32, 0.1 .. 1: visible on short caches


# lens: 1, a length not a multiple of the 16-key tile, a full cache (Nmax), and (Nq = 3) 2 < Nq: rows before the cache
CASES = [
    # id, Nq, causal, window_size, block_size (0: contiguous), num_splits, mod
    ("w00", 1, False, (0, 0), 0, 1, None),
    ("w40-causal-nq3", 3, True, (4, 0), 0, 3, None),
    ("w72-nq3-paged16", 3, False, (7, 2), 16, 3, None),
    ("w72-causal-paged32", 1, True, (7, 2), 32, 1, None),
    ("wide-nq3-paged16", 3, False, (200, 100), 16, 3, None),
    ("left-only-nq3", 3, False, (9, -1), 0, 3, None),
    ("right-only-nq3", 3, False, (-1, 1), 0, 1, None),
    ("w00-nq3-paged16", 3, True, (0, 0), 16, 3, None),
    # left = 35 at length 70: key 32 is seen by token 0 only, tile 48 by every row (no mask), tile 64 is ragged
    ("w35-nq3-one-split", 3, False, (35, -1), 0, 1, None),
    ("w35-causal-nq3-paged32", 3, True, (35, 0), 32, 1, "alibi"),
    ("w35-nq3-paged16", 3, False, (35, 3), 16, 1, "softcap"),  # tiles 32 and 48 on two pages
    ("w35-nq3-paged16-splits", 3, False, (35, 3), 16, 3, None),
    ("softcap-causal-nq3", 3, True, (-1, -1), 0, 3, "softcap"),
    ("softcap-w40-paged16", 1, False, (4, 0), 16, 1, "softcap"),
    ("alibi-H-nq3-paged16", 3, True, (-1, -1), 16, 3, "alibi"),
    ("alibi-BH-w72", 3, False, (7, 2), 0, 1, "alibi_bh"),
    ("alibi-BH-full", 1, False, (-1, -1), 32, 3, "alibi_bh"),
    ("softcap+alibi-w40-nq3", 3, True, (4, 0), 0, 3, "both"),
]
LENS = (1, 2, 37, 70)
NMAX = 70


def _run(Nq, causal, window_size, block_size, num_splits, mod, dtype, lens=LENS, Nmax=NMAX, H=4, Hkv=2, d=16, seed=0):
    B = len(lens)
    q, k, v = make_cache(B, Nq, H, Hkv, d, Nmax, dtype, seed=seed)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(causal=causal, window_size=window_size, num_splits=num_splits)
    if mod in ("softcap", "both"):
        kw["softcap"] = 5.0  # scores up to ~36 with make_cache's x3 inputs: tanh saturates
    if mod in ("alibi", "alibi_bh", "both"):
        kw["alibi_slopes"] = _slopes(B, H, mod == "alibi_bh", seed)
    kc, vc, table = (*to_pages(k, v, block_size, seed=block_size), ) if block_size else (k, v, None)
    o = flash_attn_with_kvcache_triton(q, kc, vc, seqlens, block_table=table, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    kw.pop("num_splits")
    return o, reference_mods(q, k, v, lens, **kw)


@pytest.mark.parametrize("name,Nq,causal,window_size,block_size,num_splits,mod", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(name, Nq, causal, window_size, block_size, num_splits, mod):
    o, want = _run(Nq, causal, window_size, block_size, num_splits, mod, torch.float32)
    assert_close(name, o, want, F32_TOL)


@pytest.mark.parametrize("mod", [None, "both"])
def test_fp16(mod):
    dtype = torch.float16 if torch.float16 in DTYPES else DTYPES[0]
    o, want = _run(3, True, (7, 2), 16, 3, mod, dtype)
    assert_close(f"fp16 {mod}", o, want, TOL[dtype])


def test_rows_that_see_nothing():
    """Window (0, 0) with Nq = 3 over a 1-key cache: tokens at positions -2 and -1 see no key: O = 0, no NaN;
    a right-only window (-1, 0) shifted past the cache, i.e. causal with Nq > length, the same."""
    o, want = _run(3, False, (0, 0), 0, 3, None, torch.float32, lens=(1, 2), Nmax=16)
    assert_close("w00", o, want, F32_TOL)
    assert (o[0, :2] == 0).all() and (o[1, :1] == 0).all()
    o, want = _run(3, False, (0, 0), 16, 1, "both", torch.float32, lens=(1, 2), Nmax=16)
    assert_close("w00 softcap+alibi", o, want, F32_TOL)
    assert (o[0, :2] == 0).all()


def test_short_window_reads_only_the_window(monkeypatch):
    """A (4, 0) window at the end of a 200-key cache: every split's keys lie in the window's tiles. Keys
    below the tile that holds the window's first key are poisoned with NaN (a read of one would show in O), and
    the result matches anyway. (That tile itself is read whole, the keys below the window masked: like every
    cached key, they must be finite. Its size is the launcher's BLOCK_N: 16 under the interpreter, up to 128 on
    a GPU, where the autotuner picks it; an H200 run that poisoned below 176 failed whenever it picked 128.)
    num_splits=None picks the splits for the 4 + Nq keys a row block can see, not for the 200 cached."""
    lens = (200, 5)
    q, k, v = make_cache(2, 1, 4, 2, 16, 200, torch.float32, seed=4)
    want = reference_mods(q, k, v, lens, window_size=(4, 0))
    k, v = k.clone(), v.clone()
    widest = max(c["BLOCK_N"] for c in decode_module._decode_configs(q, 16, 16)) if ON_GPU else 16
    below = (195 // widest) * widest  # the first key of the tile holding key 195 = 199 - 4
    k[0, :below] = float("nan")
    v[0, :below] = float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    picked = []
    pick = decode_module._pick_num_splits
    monkeypatch.setattr(decode_module, "_pick_num_splits", lambda *a: picked.append(a[1]) or pick(*a))
    for S in (1, 3, None):
        o = flash_attn_with_kvcache_triton(q, k, v, seqlens, window_size=(4, 0), num_splits=S)
        assert_close(f"num_splits={S}", o, want, F32_TOL)
    assert picked == [5]


@pytest.mark.parametrize("block_size,block_n", [(16, 32), (32, 16), (64, 32)])
def test_paged_equals_contiguous_with_a_window(block_size, block_n):
    """Window (50, -1) at length 70, Nq = 3: the first tile is masked, the unmasked ones start at key 32 (their
    page numbers loaded ahead from there); pages smaller than the tile (gathered row by row) and larger."""
    lens = (70, 45, 1)
    q, k, v = make_cache(3, 3, 4, 2, 16, 70, torch.float32, seed=9)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kp, vp, table = to_pages(k, v, block_size, seed=block_n)
    cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=1 if not ON_GPU else 3)
    kw = dict(window_size=(50, -1), num_splits=1, config=cfg)
    o_c = flash_attn_with_kvcache_triton(q, k, v, seqlens, **kw)
    o_p = flash_attn_with_kvcache_triton(q, kp, vp, seqlens, block_table=table, **kw)
    assert torch.equal(o_c, o_p), f"paged != contiguous: max diff {(o_c - o_p).abs().max():.3g}"
    assert_close("O", o_p, reference_mods(q, k, v, lens, window_size=(50, -1)), F32_TOL)


def test_window_covering_everything_is_the_plain_path():
    """A window wider than every cache, and causal with window (-1, -1), give what the unwindowed call gives."""
    q, k, v = make_cache(2, 3, 4, 2, 16, 40, torch.float32, seed=6)
    seqlens = torch.tensor((40, 17), dtype=torch.int32, device=DEVICE)
    plain = flash_attn_with_kvcache_triton(q, k, v, seqlens, causal=True, num_splits=3)
    wide = flash_attn_with_kvcache_triton(q, k, v, seqlens, causal=True, window_size=(100, 5), num_splits=3)
    assert_close("wide window", wide, reference(q, k, v, (40, 17), True), F32_TOL)
    assert torch.allclose(plain, wide, atol=1e-5)


def test_key_tells_the_variants_apart():
    """The tuned-config cache is keyed by the window and the score modification too."""
    q = torch.empty(1, device=DEVICE)
    base = decode_module._decode_key(q, 1, 2, 64, 1, 2, 1, 16, 0, False)
    keys = {base, decode_module._decode_key(q, 1, 2, 64, 1, 2, 1, 16, 0, False, True, 0),
            decode_module._decode_key(q, 1, 2, 64, 1, 2, 1, 16, 0, False, False, 1),
            decode_module._decode_key(q, 1, 2, 64, 1, 2, 1, 16, 0, False, False, 2)}
    assert len(keys) == 4 and base == decode_module._decode_key(q, 1, 2, 64, 1, 2, 1, 16, 0, False, False, 0)


def _good():
    q, k, v = make_cache(2, 1, 4, 2, 16, 32, DTYPES[0], seed=0)
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=torch.tensor([3, 32], dtype=torch.int32, device=DEVICE))


BAD = [
    (dict(window_size=4), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(4, 0, 1)), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(4.0, 0)), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size=\(-2, 0\): each side is >= 0, or -1"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap="30"), TypeError, r"softcap must be a number"),
    (dict(softcap=True), TypeError, r"softcap must be a number"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes must be a float32 torch.Tensor"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, r"alibi_slopes must be a float32.*float64"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must be \[H\] = \[4\] or \[B, H\] = \[2, 4\], got \(3,\)"),
    (dict(alibi_slopes=torch.ones(4, 2)), ValueError, r"alibi_slopes must be \[H\] = \[4\]"),
]


@pytest.mark.parametrize("bad,exc,match", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_argument_messages(bad, exc, match):
    args = _good()
    bad = {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in bad.items()}
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache_triton(**args, **bad)


@pytest.mark.skipif(not ON_GPU, reason="q and the slopes on two devices needs a GPU")
def test_slopes_on_another_device():
    with pytest.raises(ValueError, match="alibi_slopes must be on q's device"):
        flash_attn_with_kvcache_triton(**_good(), alibi_slopes=torch.ones(4))
