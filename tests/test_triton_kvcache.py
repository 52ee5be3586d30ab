"""Correctness of helpers/kernels/kvcache.py (and the one-launch decode it shares with flash_decode_triton).

Without CUDA the kernel runs under Triton's interpreter on the CPU (fp32, fp16, tiny shapes).
Each sequence's output is compared with float64 SDPA run on that sequence alone, with the
bottom-right causal mask written out; lengths include 0, 1 and a full cache; the paged cache's
pages are shuffled; the page size is smaller than, equal to and larger than the key tile.
"""


import pytest
import torch
import torch.nn.functional as F

from kernel_env import DEVICE, DTYPES, ON_GPU, TOL  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers.kernels import decode as decode_module  # noqa: E402
from helpers.kernels.decode import flash_decode_triton  # noqa: E402
from helpers.kernels.kvcache import flash_attn_with_kvcache_triton  # noqa: E402



def make_cache(B, Nq, H, Hkv, d, Nmax, dtype, seed, scale=3.0):
    """q [B, Nq, H, d] and a contiguous cache [B, Nmax, Hkv, d]; large scores on purpose."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Nq, H, d, generator=g) * scale).to(DEVICE, dtype)
    k = (torch.randn(B, Nmax, Hkv, d, generator=g) * scale).to(DEVICE, dtype)
    v = torch.randn(B, Nmax, Hkv, d, generator=g).to(DEVICE, dtype)
    return q, k, v


def to_pages(k, v, block_size, seed, spare=3):
    """The same cache in shuffled pages: ([num_blocks, block_size, Hkv, d] x 2, block_table int32 [B, max_blocks]).

    Pages are a random permutation of num_blocks = B * max_blocks + spare (spare pages hold
    noise that no sequence may read)."""
    B, Nmax, Hkv, d = k.shape
    max_blocks = -(-Nmax // block_size)
    g = torch.Generator().manual_seed(seed)
    num_blocks = B * max_blocks + spare
    perm = torch.randperm(num_blocks, generator=g)[: B * max_blocks]
    table = perm.view(B, max_blocks).to(torch.int32)  # [B, max_blocks]
    kp = (torch.randn(num_blocks, block_size, Hkv, d, generator=g) * 100).to(k.dtype)  # noise
    vp = (torch.randn(num_blocks, block_size, Hkv, d, generator=g) * 100).to(k.dtype)
    pad = max_blocks * block_size - Nmax
    kf = F.pad(k.cpu(), (0, 0, 0, 0, 0, pad)).view(B, max_blocks, block_size, Hkv, d)
    vf = F.pad(v.cpu(), (0, 0, 0, 0, 0, pad)).view(B, max_blocks, block_size, Hkv, d)
    kp[table.long()] = kf
    vp[table.long()] = vf
    return kp.to(DEVICE), vp.to(DEVICE), table.to(DEVICE)


def visible(Nq, L, causal):
    """[Nq, L] bool: new token i sees key j (bottom-right: j <= L - Nq + i)."""
    i = torch.arange(Nq)[:, None]
    j = torch.arange(L)[None, :]
    return (j <= L - Nq + i) if causal else torch.ones(Nq, L, dtype=torch.bool)


def reference(q, k, v, lens, causal, align="bottom_right"):
    """float64 SDPA on each sequence alone; a row that sees no key: 0. [B, Nq, H, d]."""
    B, Nq, H, d = q.shape
    out = torch.zeros(B, Nq, H, d, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        mask = visible(Nq, L, causal) if align == "bottom_right" else torch.ones(Nq, L, dtype=torch.bool).tril()
        qb = q[b].double().cpu().transpose(0, 1)  # [H, Nq, d]
        kb = k[b, :L].double().cpu().transpose(0, 1)  # [Hkv, L, d]
        vb = v[b, :L].double().cpu().transpose(0, 1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)  # [H, Nq, d]
        out[b] = torch.where(mask.any(1)[None, :, None], ob, 0.0).transpose(0, 1)  # NaN rows -> 0
    return out


def assert_close(name, got, want, tol):
    assert not torch.isnan(got).any(), f"{name}: NaN in the output"
    err = (got.double().cpu() - want).abs()
    if err.max() > tol:
        idx = (err > tol).nonzero()[:4].tolist()
        pairs = [(i, round(float(want[tuple(i)]), 5), round(float(got.double().cpu()[tuple(i)]), 5)) for i in idx]
        pytest.fail(f"{name}: max err {err.max():.3g} > {tol} at {idx[0]}; first (index [b, i, h, c], ref, got): {pairs}")


# B = 4 sequences: empty, one token, ragged, full (Nmax)
CASES = [
    # Nq, H, Hkv, d, Nmax, lens, causal, block_size (0: contiguous), num_splits
    (1, 4, 2, 16, 70, (0, 1, 37, 70), True, 0, None),  # decode, GQA, contiguous
    (1, 4, 4, 32, 64, (0, 1, 33, 64), False, 16, 3),  # MHA, paged 16
    (4, 8, 2, 16, 96, (0, 1, 50, 96), True, 32, 1),  # a chunk of 4 new tokens, paged 32, one split
    (4, 8, 2, 16, 96, (0, 3, 50, 96), True, 16, 3),  # rows 0..2 of sequence 1 see 0..2 keys
    (4, 4, 1, 32, 80, (2, 1, 41, 80), True, 0, 3),  # MQA, Nq > length: whole rows see nothing
    (4, 8, 4, 16, 64, (0, 1, 29, 64), False, 32, None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Nq,H,Hkv,d,Nmax,lens,causal,block_size,num_splits", CASES)
def test_matches_sdpa_per_sequence(Nq, H, Hkv, d, Nmax, lens, causal, block_size, num_splits, dtype):
    B = len(lens)
    q, k, v = make_cache(B, Nq, H, Hkv, d, Nmax, dtype, seed=Nmax + 7 * Nq + H)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    if block_size:
        kc, vc, table = to_pages(k, v, block_size, seed=block_size)
    else:
        kc, vc, table = k, v, None
    o = flash_attn_with_kvcache_triton(q, kc, vc, seqlens, block_table=table, causal=causal, num_splits=num_splits)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert_close("O", o, reference(q, k, v, lens, causal), TOL[dtype])


def test_head_dim_not_a_power_of_two():
    """d = 40 (computed 64 wide, masked along d): paged cache, a chunk of new tokens, GQA, splits merged."""
    lens = (0, 1, 37)
    q, k, v = make_cache(3, 2, 4, 2, 40, 48, DTYPES[0], seed=40)
    kc, vc, table = to_pages(k, v, 16, seed=3)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    o = flash_attn_with_kvcache_triton(q, kc, vc, seqlens, block_table=table, causal=True, num_splits=2)
    assert_close("O", o, reference(q, k, v, lens, True), TOL[DTYPES[0]])


@pytest.mark.parametrize("block_size,block_n,num_splits", [(16, 32, 3), (16, 64, 1), (32, 16, 3), (32, 32, 2)])
def test_paged_equals_contiguous(block_size, block_n, num_splits):
    """Shuffled pages give the contiguous cache's O bit for bit: pages smaller than the key tile
    (gathered row by row) and pages holding whole tiles (one table load per tile)."""
    lens = (0, 17, 45, 96)
    q, k, v = make_cache(4, 2, 4, 2, 16, 96, DTYPES[0], seed=5)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kp, vp, table = to_pages(k, v, block_size, seed=block_n)
    cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=1 if not ON_GPU else 3)
    o_c = flash_attn_with_kvcache_triton(q, k, v, seqlens, causal=True, num_splits=num_splits, config=cfg)
    o_p = flash_attn_with_kvcache_triton(q, kp, vp, seqlens, block_table=table, causal=True, num_splits=num_splits,
                                         config=cfg)
    assert torch.equal(o_c, o_p), f"paged != contiguous: max diff {(o_c - o_p).abs().max():.3g}"
    assert_close("O", o_p, reference(q, k, v, lens, True), TOL[DTYPES[0]])


def test_row_blocks_causal(monkeypatch):
    """More query rows (Nq x H/Hkv = 4 x 8) than one program holds: each row block has its own causal band."""
    monkeypatch.setattr(decode_module, "_MAX_BLOCK_H", 16)
    assert decode_module._decode_rows(8, 4) == (16, 2)
    lens = (3, 40, 64)
    q, k, v = make_cache(3, 4, 8, 1, 16, 64, DTYPES[0], seed=11)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for S in (1, 3):
        o = flash_attn_with_kvcache_triton(q, k, v, seqlens, causal=True, num_splits=S)
        assert_close(f"O (num_splits={S})", o, reference(q, k, v, lens, True), TOL[DTYPES[0]])


def test_reference_tells_the_causal_alignments_apart():
    """The test's reference is not fooled by a top-left mask (SDPA's is_causal), the likeliest bug."""
    lens = (40,)
    q, k, v = make_cache(1, 4, 2, 2, 16, 40, torch.float32, seed=2)
    o = flash_attn_with_kvcache_triton(q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE), causal=True,
                                       num_splits=2)
    top_left = reference(q, k, v, lens, True, align="top_left")
    assert (o.double().cpu() - top_left).abs().max() > 0.1


class _CountLaunches:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_one_launch_and_counters_reset(monkeypatch):
    """Several splits merge inside the one launch; the counters are back to 0 after it, so a
    second call on the cached workspace gives the same O."""
    if ON_GPU:      # autotune's own timing launches first, outside the count
        q, k, v = make_cache(3, 1, 4, 2, 16, 64, DTYPES[0], seed=3)
        flash_attn_with_kvcache_triton(q, k, v, torch.tensor((5, 64, 33), dtype=torch.int32, device=DEVICE),
                                       num_splits=4)
        flash_decode_triton(q[:, 0].contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                            num_splits=4)
    counting = _CountLaunches(decode_module._decode_kernel)
    monkeypatch.setattr(decode_module, "_decode_kernel", counting)
    lens = (5, 64, 33)
    q, k, v = make_cache(3, 1, 4, 2, 16, 64, DTYPES[0], seed=3)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    o1 = flash_attn_with_kvcache_triton(q, k, v, seqlens, num_splits=4)
    assert counting.launches == 1
    assert int(decode_module._workspace[q.device][2].abs().sum()) == 0, "a split counter was left non-zero"
    o2 = flash_attn_with_kvcache_triton(q, k, v, seqlens, num_splits=4)
    assert torch.equal(o1, o2)
    assert_close("O", o2, reference(q, k, v, lens, True), TOL[DTYPES[0]])
    # flash_decode_triton goes through the same single launch
    qd, kd, vd = q[:, 0].contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    od = flash_decode_triton(qd, kd, vd, num_splits=4)
    assert counting.launches == 3
    full = torch.full((3,), 64, dtype=torch.int32, device=DEVICE)
    assert_close("flash_decode O", od[:, None], reference(q, k, v, full.tolist(), False), TOL[DTYPES[0]])


def _good():
    q, k, v = make_cache(2, 1, 4, 2, 16, 32, DTYPES[0], seed=0)
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=torch.tensor([3, 32], dtype=torch.int32, device=DEVICE))


def _paged():
    args = _good()
    kp, vp, table = to_pages(args["k_cache"], args["v_cache"], 16, seed=0)
    args.update(k_cache=kp, v_cache=vp, block_table=table)
    return args


BAD = [
    (lambda a: a.update(q=a["q"][0]), ValueError, "q must have 4 dimensions"),
    (lambda a: a.update(q=a["q"].double()), TypeError, "dtype"),
    (lambda a: a.update(k_cache=a["k_cache"].half() if a["q"].dtype != torch.float16 else a["k_cache"].float()),
     TypeError, "share a dtype"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :16].contiguous()), ValueError, "v_cache must have k_cache's shape"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :8].contiguous(), v_cache=a["v_cache"][..., :8].contiguous()),
     ValueError, "head dimension"),
    (lambda a: a.update(q=a["q"][:, :, :3].contiguous()), ValueError, "multiple of Hkv"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous"),
    (lambda a: a.update(k_cache=a["k_cache"][:1].contiguous(), v_cache=a["v_cache"][:1].contiguous()),
     ValueError, "contiguous cache must be"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError, "cache_seqlens must be int32"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), ValueError, r"cache_seqlens must be \[B\]"),
    (lambda a: a.update(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] = 33"),
    (lambda a: a.update(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, r"cache_seqlens\[0\] = -1"),
    (lambda a: a.update(cache_seqlens=[3, 32]), TypeError, "cache_seqlens must be a torch.Tensor"),
    (lambda a: a.update(num_splits=0), ValueError, "num_splits must be >= 1"),
    (lambda a: a.update(num_splits=2.0), TypeError, "num_splits must be an int"),
    (lambda a: a.update(causal="yes"), TypeError, "causal must be"),
]
BAD_PAGED = [
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table must be int32"),
    (lambda a: a.update(block_table=a["block_table"][0]), ValueError, "block_table must have 2 dimensions"),
    (lambda a: a.update(block_table=a["block_table"][:1].contiguous()), ValueError, r"block_table must be \[B, max_blocks\]"),
    (lambda a: a.update(block_table=a["block_table"][:, :1].contiguous()), ValueError, r"cache_seqlens\[1\] = 32 is outside"),
    (lambda a: a["block_table"].__setitem__((1, 1), 99), ValueError, r"block_table\[1, 1\] = 99 is not a page"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :12].contiguous(), v_cache=a["v_cache"][:, :12].contiguous()),
     ValueError, "power of two >= 16"),
]


def test_good_inputs_of_the_bad_input_tests_run():
    """The unspoiled inputs of the bad-input tests give the right O, contiguous and paged."""
    good = _good()
    want = reference(good["q"], good["k_cache"], good["v_cache"], good["cache_seqlens"].tolist(), False)
    assert_close("O (contiguous)", flash_attn_with_kvcache_triton(**good), want, TOL[DTYPES[0]])
    assert_close("O (paged)", flash_attn_with_kvcache_triton(**_paged()), want, TOL[DTYPES[0]])


@pytest.mark.parametrize("layout,spoil,exc,match", [("contiguous", *b) for b in BAD] + [("paged", *b) for b in BAD_PAGED])
def test_bad_input_messages(layout, spoil, exc, match):
    args = _good() if layout == "contiguous" else _paged()
    value_check = match.replace("\\", "").startswith(("cache_seqlens[", "block_table[1, 1]"))
    if ON_GPU and value_check:     # lengths and page indices: read on the host, so checked on the CPU only
        pytest.skip("checked on the CPU only (on a GPU it would cost a device sync)")
    spoil(args)
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache_triton(**args)
