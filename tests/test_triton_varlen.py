"""Correctness of helpers/kernels/varlen.py: packed variable-length attention and its grid map.

Every sequence of the packed batch is compared with SDPA in float64 run on that sequence alone
(GQA through enable_gqa, the bottom-right causal mask built explicitly) and with torch.logsumexp for
lse; rows that see no key must give O = 0 and lse = -inf, never NaN. Lengths include 0 and 1, a
long-tailed mix and n != nk in both directions. Under the interpreter (no CUDA): fp32 and fp16 on the
CPU with 16 x 16 tiles; on a CUDA machine the same checks run on the GPU in fp16 and bf16.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kernel_env import DEVICE, DTYPES, ON_GPU, TOL  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers.kernels.common import TensorDescriptor  # noqa: E402
from helpers.kernels.varlen import flash_attn_varlen_triton, varlen_block_m, varlen_block_map  # noqa: E402



def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(DEVICE, torch.int32)  # [B + 1]


def _packed(lens_q, lens_k, H, Hkv, d, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sum(lens_q), H, d, generator=g) * scale).to(DEVICE, dtype)  # [total_q, H, d]
    k = (torch.randn(sum(lens_k), Hkv, d, generator=g) * scale).to(DEVICE, dtype)  # [total_k, Hkv, d]
    v = torch.randn(sum(lens_k), Hkv, d, generator=g).to(DEVICE, dtype)  # [total_k, Hkv, d]
    return q, k, v


def _reference_one(q, k, v, causal):
    """One sequence, float64: q [n, H, d], k, v [nk, Hkv, d] -> O [n, H, d], lse [H, n], O = 0 on empty rows."""
    n, H, d = q.shape
    nk, Hkv, _ = k.shape
    qd, kd, vd = (t.double().cpu().transpose(0, 1) for t in (q, k, v))  # [H, n, d], [Hkv, nk, d]
    keep = torch.ones(n, nk, dtype=torch.bool)  # [n, nk]
    if causal:  # bottom-right: row i sees key j when j <= i + nk - n
        keep = torch.arange(nk)[None, :] <= torch.arange(n)[:, None] + (nk - n)
    s = (qd @ kd.repeat_interleave(H // Hkv, dim=0).transpose(-1, -2)) / math.sqrt(d)  # [H, n, nk]
    lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), dim=-1)  # [H, n]; -inf on empty rows
    o = torch.zeros(H, n, d, dtype=torch.float64)  # [H, n, d]
    sees = keep.any(1)  # [n] rows with at least one key
    if nk > 0 and sees.any():
        o[:, sees] = F.scaled_dot_product_attention(qd[:, sees], kd, vd, attn_mask=keep[sees], enable_gqa=True)
    return o.transpose(0, 1), lse  # [n, H, d], [H, n]


def _worst(name, b, got, want, tol):
    err = (got.double().cpu() - want).abs()
    if torch.isnan(got).any():
        pytest.fail(f"{name} of sequence {b}: NaN at {torch.isnan(got).nonzero()[0].tolist()}")
    finite = torch.isfinite(want)
    if err[finite].numel() and err[finite].max() > tol:
        idx = tuple((err * finite).flatten().argmax().item() // s % n for s, n in zip(_strides(err.shape), err.shape))
        pytest.fail(f"{name} of sequence {b}: max err {err[finite].max():.3g} > {tol} at {idx} "
                    f"(ref {want[idx].item():.5g}, got {got.double().cpu()[idx].item():.5g})")


def _strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return list(reversed(out))


def _check_all(lens_q, lens_k, H, Hkv, d, causal, dtype, seed, **kw):
    q, k, v = _packed(lens_q, lens_k, H, Hkv, d, dtype, seed)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    o, lse = flash_attn_varlen_triton(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        o_ref, lse_ref = _reference_one(q[rq], k[rk], v[rk], causal)
        _worst("O", b, o[rq], o_ref, TOL[dtype])
        got_lse = lse[:, rq].double().cpu()
        empty = torch.isinf(lse_ref)
        assert torch.equal(torch.isneginf(got_lse), empty), f"sequence {b}: lse must be -inf on exactly the empty rows"
        _worst("lse", b, got_lse, lse_ref, TOL[dtype] * 5)
        assert (o[rq].cpu()[empty.T] == 0).all(), f"sequence {b}: a row that sees no key must give O = 0"


CASES = {
    # lens_q, lens_k, H, Hkv, d
    "empty and single rows, n = nk": ([5, 0, 1, 40, 17], [5, 0, 1, 40, 17], 2, 2, 16),
    "n != nk both ways, GQA 4/2": ([5, 0, 1, 33, 12, 3], [9, 3, 0, 40, 4, 3], 4, 2, 16),
    "long-tailed, MQA 4/1": ([3, 2, 7, 1, 4, 61, 2, 5, 1], [3, 2, 7, 1, 4, 61, 2, 5, 20], 4, 1, 32),
}


# Each case full and causal, in the two dtypes by turns: every case in both dtypes, every dtype full and causal
PER_SEQUENCE = [(case, causal, DTYPES[(i + causal) % 2]) for i, case in enumerate(CASES) for causal in (False, True)]


@pytest.mark.parametrize("case, causal, dtype", PER_SEQUENCE,
                         ids=[f"{c}-{'causal' if m else 'full'}-{t}" for c, m, t in PER_SEQUENCE])
def test_varlen_matches_sdpa_per_sequence(case, causal, dtype):
    lens_q, lens_k, H, Hkv, d = CASES[case]
    _check_all(lens_q, lens_k, H, Hkv, d, causal, dtype, seed=len(case))


def test_varlen_head_dim_80():
    """d = 80: computed 128 wide and masked along d; with Hkv = 2 a padded column must not read the next KV
    head's values (they sit right after this head's 80 columns in the packed rows)."""
    _check_all([5, 0, 1, 21], [9, 2, 0, 21], 4, 2, 80, True, DTYPES[0], seed=80)


@pytest.mark.skipif(TensorDescriptor is None, reason="this Triton has no host tensor descriptors")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_other_load_path(causal):
    """The path the default does not take here: TMA descriptors over [total_k, Hkv * d] (a column offset per
    KV head, tiles running into the next sequence) under the interpreter; plain pointers on a Hopper GPU."""
    lens_q, lens_k, H, Hkv, d = CASES["n != nk both ways, GQA 4/2"]
    _check_all(lens_q, lens_k, H, Hkv, d, causal, torch.float16, seed=5, use_tma=not ON_GPU)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_a_nan_in_one_request_does_not_reach_another(use_tma):
    """Serving isolation: the masked last tile of request 0 runs into request 1's rows (TMA reads them; the
    pointer path masks them). With NaN in request 1's values, request 0's output stays exactly what it was."""
    if use_tma and (TensorDescriptor is None or ON_GPU):
        pytest.skip("TMA under the interpreter only (on a GPU the default path is checked elsewhere)")
    lens = [20, 30]  # request 0's 20 keys end inside a 16-key tile
    q, k, v = _packed(lens, lens, 2, 1, 16, DTYPES[0], seed=3)
    kw = dict(causal=False, use_tma=use_tma)
    o, lse = flash_attn_varlen_triton(q, k, v, _cu(lens), _cu(lens), 30, 30, **kw)
    v_bad = v.clone()
    v_bad[20:] = float("nan")  # request 1's values
    o_bad, lse_bad = flash_attn_varlen_triton(q, k, v_bad, _cu(lens), _cu(lens), 30, 30, **kw)
    assert torch.equal(o_bad[:20], o[:20]) and torch.equal(lse_bad[:, :20], lse[:, :20])
    assert torch.isnan(o_bad[20:]).all()  # request 1 does see its own NaN


def test_varlen_other_tiles_and_int64_cu_seqlens():
    """BLOCK_M != BLOCK_N (the map is built for BLOCK_M), int64 cu_seqlens, validate off, a custom scale."""
    lens_q, lens_k = [40, 1, 0, 23], [50, 7, 2, 23]
    q, k, v = _packed(lens_q, lens_k, 2, 1, 32, DTYPES[0], seed=11)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    o, lse = flash_attn_varlen_triton(q, k, v, _cu(lens_q).long(), _cu(lens_k).long(), 40, 50, causal=True,
                                      sm_scale=0.1, validate=False, config=cfg)
    o2, lse2 = flash_attn_varlen_triton(q, k, v, _cu(lens_q), _cu(lens_k), 40, 50, causal=True, sm_scale=0.1)
    assert torch.allclose(o.float(), o2.float(), atol=TOL[DTYPES[0]])
    premade = varlen_block_map(_cu(lens_q), varlen_block_m(32), total_q=q.shape[0])  # built once per batch
    o3, lse3 = flash_attn_varlen_triton(q, k, v, _cu(lens_q), _cu(lens_k), 40, 50, causal=True, sm_scale=0.1,
                                        block_map=premade)
    if ON_GPU:  # the given map fixes BLOCK_M: the two calls may time different tiles there
        assert torch.allclose(o3.float(), o2.float(), atol=TOL[DTYPES[0]]) and torch.allclose(lse3, lse2, atol=1e-3)
    else:
        assert torch.equal(o3, o2) and torch.equal(lse3, lse2)
    with pytest.raises(ValueError, match="block_map must be"):
        flash_attn_varlen_triton(q, k, v, _cu(lens_q), _cu(lens_k), 40, 50, block_map=premade[0])
    cu = _cu(lens_q)
    qd = q[:40].double().cpu().transpose(0, 1)  # sequence 0: [H, 40, d]
    kd, vd = (t[:50].double().cpu().transpose(0, 1) for t in (k, v))  # [Hkv, 50, d]
    keep = torch.arange(50)[None, :] <= torch.arange(40)[:, None] + 10  # [40, 50]
    ref = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=keep, scale=0.1, enable_gqa=True).transpose(0, 1)
    _worst("O", 0, o[:int(cu[1])], ref, TOL[DTYPES[0]])


def test_varlen_no_queries_or_no_keys():
    q, k, v = _packed([0, 0], [3, 4], 2, 2, 16, DTYPES[0], seed=1)
    o, lse = flash_attn_varlen_triton(q, k, v, _cu([0, 0]), _cu([3, 4]), 0, 4)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)
    q, k, v = _packed([3, 2], [0, 0], 2, 1, 16, DTYPES[0], seed=2)
    o, lse = flash_attn_varlen_triton(q, k, v, _cu([3, 2]), _cu([0, 0]), 3, 0, causal=True)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_varlen_strided_views_give_the_contiguous_result():
    """q, k, v as views of one packed qkv [total, 3, H, d] (token stride 3 * H * d, d = 24: rows not 16-byte
    aligned), forward and backward through flash_attention_varlen on a prepared batch: the same O and gradients as
    on contiguous copies, bit for bit under the interpreter (the same tiles; only the addresses differ), within
    the dtype's tolerance natively (each layout its own plan, TMA or not)."""
    from helpers.kernels.varlen import prepare_varlen
    from helpers.kernels.varlen_backward import flash_attention_varlen
    lens, H, d = [7, 1, 30], 2, 24
    g = torch.Generator().manual_seed(31)
    qkv = torch.randn(sum(lens), 3, H, d, generator=g).to(DEVICE, DTYPES[0])
    do = torch.randn(sum(lens), H, d, generator=g).to(DEVICE, DTYPES[0])
    batch = prepare_varlen(_cu(lens))
    results = []
    for views in (True, False):
        x = qkv.clone().requires_grad_()
        q, k, v = x.unbind(1) if views else (t.contiguous() for t in x.unbind(1))
        o = flash_attention_varlen(q, k, v, batch, causal=True, window_size=(9, -1))
        results.append((o, *torch.autograd.grad(o, x, do)))
    if ON_GPU:
        assert all(torch.allclose(a.float(), b.float(), atol=TOL[DTYPES[0]]) for a, b in zip(*results))
    else:
        assert all(torch.equal(a, b) for a, b in zip(*results))


def _pages(k, lens_k, page, seed):
    """The packed keys k [total_k, Hkv, d] as shuffled pages [num_pages, page, Hkv, d] (the rows past a sequence's
    end and a spare page NaN) and the int32 table [B, max_pages] that names sequence b's pages."""
    counts = [-(-n // page) for n in lens_k]
    order = torch.randperm(sum(counts) + 1, generator=torch.Generator().manual_seed(seed)).tolist()
    pages = torch.full((sum(counts) + 1, page, *k.shape[1:]), float("nan"), dtype=k.dtype, device=k.device)
    table = torch.zeros(len(lens_k), max(max(counts), 1), dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(lens_k):
        for j in range(counts[b]):
            rows = k[start + j * page:start + min((j + 1) * page, n)]
            pages[order[used], :rows.shape[0]] = rows
            table[b, j] = order[used]
            used += 1
        start += n
    return pages, table.to(k.device)


def test_varlen_paged_kv_is_the_packed_result(page=5):
    """block_table (the library's paged varlen forward): K/V in shuffled pages of 5 rows (a page boundary inside
    every tile), NaN in every row no table names, gives the packed call's O and lse (to rounding: the paged loop
    masks every tile), on a prepared batch and with validate=False; lengths 0 and 1 and n != nk; a table too short
    for a sequence is refused."""
    from helpers.kernels.varlen import prepare_varlen
    lens_q, lens_k = [5, 0, 1, 33, 12], [9, 3, 0, 40, 4]
    q, k, v = _packed(lens_q, lens_k, 4, 2, 16, DTYPES[0], seed=21)
    kp, table = _pages(k, lens_k, page, seed=1)
    vp, _ = _pages(v, lens_k, page, seed=1)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    o, lse = flash_attn_varlen_triton(q, k, v, cu_q, cu_k, 33, 40, causal=True, window_size=(6, -1))
    batch = prepare_varlen(cu_q, cu_k)
    for layout, kw in ((batch, {}), (cu_q, dict(cu_seqlens_k=cu_k, max_seqlen_q=33, max_seqlen_k=40, validate=False))):
        o2, lse2 = flash_attn_varlen_triton(q, kp, vp, layout, causal=True, window_size=(6, -1), block_table=table,
                                            **kw)
        tol = TOL[DTYPES[0]] if ON_GPU else 1e-6  # natively the paged key class may time other tiles
        assert torch.allclose(o2.float(), o.float(), atol=tol) and torch.allclose(lse2, lse, atol=tol)
    with pytest.raises(ValueError, match="block_table's"):
        flash_attn_varlen_triton(q, kp, vp, batch, block_table=table[:, :7])
    with pytest.raises(ValueError, match="a row per sequence"):
        flash_attn_varlen_triton(q, kp, vp, batch, block_table=table[:2])


# ---------------------------------------------------------------------------- the map


@pytest.mark.parametrize("lengths,BLOCK_M", [([0, 1, 16, 17, 40, 0, 33], 16), ([130, 5, 0, 64, 1], 32), ([0], 16)])
def test_block_map_covers_every_row_once_heaviest_first(lengths, BLOCK_M):
    cu = _cu(lengths)
    total = sum(lengths)
    seq_idx, q_start = varlen_block_map(cu, BLOCK_M, total_q=total)
    B = len(lengths)
    assert seq_idx.dtype == torch.int32 and q_start.dtype == torch.int32
    assert seq_idx.shape == q_start.shape == ((total + B * (BLOCK_M - 1)) // BLOCK_M,)
    s, r0, cu_l = seq_idx.tolist(), q_start.tolist(), cu.tolist()
    n_real = sum(-(-n // BLOCK_M) for n in lengths)
    assert all(x == -1 for x in s[n_real:]) and all(x == -1 for x in r0[n_real:]), "spare programs last, marked -1"
    hits = [0] * total
    for b, row in zip(s[:n_real], r0[:n_real]):
        assert 0 <= b < B and cu_l[b] <= row < cu_l[b + 1] and (row - cu_l[b]) % BLOCK_M == 0
        for i in range(row, min(row + BLOCK_M, cu_l[b + 1])):
            hits[i] += 1
    assert hits == [1] * total, "every packed row belongs to exactly one program"
    key = [(-((row - cu_l[b]) // BLOCK_M), b) for b, row in zip(s[:n_real], r0[:n_real])]
    assert key == sorted(key), "largest block index first, equal indices in sequence order"
    again = varlen_block_map(cu, BLOCK_M)  # total read from cu_seqlens
    assert torch.equal(again[0], seq_idx) and torch.equal(again[1], q_start)


# ---------------------------------------------------------------------------- bad inputs


def test_varlen_bad_inputs():
    lens = [3, 5]
    q, k, v = _packed(lens, lens, 2, 1, 16, DTYPES[0], seed=0)
    cu = _cu(lens)

    def call(q=q, k=k, v=v, cu_q=cu, cu_k=cu, mq=5, mk=5, **kw):
        return flash_attn_varlen_triton(q, k, v, cu_q, cu_k, mq, mk, **kw)

    bad = [
        (ValueError, "3 dimensions", dict(q=q[None])),
        (TypeError, "share a dtype", dict(k=k.to(DTYPES[1]), v=v.to(DTYPES[1]))),
        (ValueError, "multiple of Hkv", dict(k=k.repeat(1, 3, 1), v=v.repeat(1, 3, 1))),
        (ValueError, "k must be", dict(k=k[..., :8].contiguous(), v=v[..., :8].contiguous())),
        (ValueError, "v must have", dict(v=v[:4].contiguous())),
        (ValueError, "1-D", dict(cu_q=cu[None])),
        (TypeError, "int32", dict(cu_q=cu.float())),
        (ValueError, "q's device", dict(cu_k=cu.to("meta"))),
        (ValueError, "at least one sequence", dict(cu_q=cu[:1], cu_k=cu[:1])),
        (ValueError, "must start at 0", dict(cu_q=cu + 1)),
        (ValueError, "must not decrease", dict(cu_k=torch.tensor([0, 9, 8], dtype=torch.int32, device=DEVICE),
                                               mk=100)),
        (ValueError, r"cu_seqlens_q\[-1\] = 7 must equal total_q", dict(cu_q=_cu([3, 4]))),
        (ValueError, "same B sequences", dict(cu_k=_cu([3, 2, 3]))),
        (ValueError, "max_seqlen_q = 4 is smaller than sequence 1's length 5", dict(mq=4)),
        (TypeError, "max_seqlen_k must be an int", dict(mk=5.0)),
        (TypeError, "causal must be", dict(causal="yes")),
        (TypeError, "torch.Tensor", dict(cu_q=cu.tolist())),
    ]
    for exc, msg, kw in bad:
        with pytest.raises(exc, match=msg):
            call(**kw)
    call()  # and the good call runs


# ----------------------------------------------------------------------------- the backward (autograd)

from helpers import reference  # noqa: E402
from helpers.kernels.varlen_backward import flash_attention_varlen, flash_attn_varlen_bwd_triton  # noqa: E402


def _reference_grads(q, k, v, do, cu_q, cu_k, causal):
    """float64 (dq, dk, dv) by autograd, sequence by sequence (``helpers.reference.attention_grads``, k and v
    repeated to the query heads and their gradients summed back over each group)."""
    H, Hkv, d = q.shape[1], k.shape[1], q.shape[2]
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b in range(cu_q.numel() - 1):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        n, nk = rq.stop - rq.start, rk.stop - rk.start
        if n == 0 or nk == 0:
            continue  # nothing seen: gradients 0
        qq, dd = (t[rq].detach().double().cpu().transpose(0, 1)[None] for t in (q, do))  # [1, H, n, d]
        kk, vv = (t[rk].detach().double().cpu().transpose(0, 1)[None].repeat_interleave(H // Hkv, 1) for t in (k, v))
        mask = reference.causal_mask(n, nk, "bottom_right") if causal else None  # [n, nk]
        _, _, dq, dk, dv = reference.attention_grads(qq, kk, vv, dd, mask=mask, scale=1.0 / math.sqrt(d))
        grads[0][rq] = dq[0].transpose(0, 1)
        grads[1][rk] = dk[0].view(Hkv, H // Hkv, nk, d).sum(1).transpose(0, 1)
        grads[2][rk] = dv[0].view(Hkv, H // Hkv, nk, d).sum(1).transpose(0, 1)
    return grads


BWD_CASES = {
    # lens_q, lens_k, H, Hkv, d, causal
    "empty and length-1 documents, GQA 4/2": ([5, 0, 1, 33, 12, 3], [9, 3, 0, 40, 4, 3], 4, 2, 16, True),
    "packed self-attention, full, MHA": ([7, 1, 0, 20], [7, 1, 0, 20], 2, 2, 32, False),
    "MQA 8/1, d = 80, n > nk: rows that see nothing": ([17, 1, 6], [9, 1, 6], 8, 1, 80, True),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_varlen_autograd_matches_float64(case):
    """flash_attention_varlen through torch.autograd: O and dq, dk, dv of every packed sequence against float64
    autograd on that sequence alone; documents of length 0 and 1, n != nk, GQA and MQA, a padded head dim."""
    lens_q, lens_k, H, Hkv, d, causal = BWD_CASES[case]
    dtype = DTYPES[0]
    q, k, v = (t.requires_grad_() for t in _packed(lens_q, lens_k, H, Hkv, d, dtype, seed=len(lens_q) + d, scale=2.0))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    o.backward(do)
    want = _reference_grads(q, k, v, do, cu_q, cu_k, causal)
    for name, t, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert t.shape == ref.shape and t.dtype == dtype, name
        scale = ref.abs().max().item() + 1e-6
        _worst(name, "all", t / scale, ref / scale, 3 * TOL[dtype])


def test_varlen_gradcheck_tiny():
    """torch.autograd.gradcheck through flash_attention_varlen: three documents (one empty), GQA 2/1, d = 8."""
    if ON_GPU:
        pytest.skip("fp32 gradcheck runs under the interpreter")
    import warnings
    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, 2, 8, generator=g).requires_grad_()
    k, v = (torch.randn(6, 1, 8, generator=g).requires_grad_() for _ in range(2))
    cu_q, cu_k = _cu([3, 0, 2]), _cu([2, 1, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert torch.autograd.gradcheck(
            lambda a, b, c: flash_attention_varlen(a, b, c, cu_q, cu_k, 3, 3, causal=True), (q, k, v),
            eps=1e-2, atol=5e-3, rtol=5e-2, nondet_tol=1e-5, fast_mode=True)


def test_varlen_backward_bad_input():
    """The backward's own checks, and cu_seqlens that cannot disagree with the forward's: the forward's batch keeps
    its own copy of them, so changing the caller's tensor in place between forward and backward changes nothing."""
    lens = [3, 4]
    q, k, v = _packed(lens, lens, 2, 1, 16, DTYPES[0], seed=0)
    cu = _cu(lens)
    o, lse = flash_attn_varlen_triton(q, k, v, cu, cu, 4, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 8 must equal total_q"):
        flash_attn_varlen_bwd_triton(o, q, k, v, o, lse, _cu([3, 5]), cu, 5, 4)
    with pytest.raises(ValueError, match="lse must be a float32 tensor of shape"):
        flash_attn_varlen_bwd_triton(o, q, k, v, o, lse.T.contiguous(), cu, cu, 4, 4)
    with pytest.raises(ValueError, match="do must be a tensor of q's shape"):
        flash_attn_varlen_bwd_triton(o[:3], q, k, v, o, lse, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        flash_attention_varlen(q, torch.cat([k, k, k], 1), torch.cat([v, v, v], 1), cu, cu, 4, 4)
    grads = []
    for change in (False, True):
        qg = q.clone().requires_grad_()
        cu_q = cu.clone()
        out = flash_attention_varlen(qg, k, v, cu_q, cu, 4, 4, causal=True)
        if change:
            cu_q[1] = 2  # the packing changed after the forward: the backward still uses the forward's
        out.sum().backward()
        grads.append(qg.grad)
    assert torch.equal(grads[0], grads[1])


def test_train_llama_tiny(tmp_path):
    """bench/train_llama.py --cpu --tiny: the Llama-style model trained on packed documents with the varlen kernels
    (one prepared batch per step) and with SDPA under a document mask gives the same losses in fp32 (same seed,
    same batches); FlexAttention's document mask gives SDPA's forward loss (it has no backward on a CPU); record
    and figure."""
    if ON_GPU:
        pytest.skip("the tiny run is the CPU/interpreter configuration")
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "train_llama.py"), "--cpu", "--tiny",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "train_llama.json").read_text())
    a, b = rec["runs"]["course"]["loss"], rec["runs"]["sdpa"]["loss"]
    assert len(a) == len(b) == rec["config"]["steps"] and all(math.isfinite(x) for x in a)
    assert rec["max_loss_diff"] < 1e-4, (a, b)
    assert rec["flex_forward_loss_diff_vs_sdpa"] < 1e-4 and "flex" not in rec["runs"]
    assert rec["runs"]["course"]["documents_per_step"] > rec["config"]["batch"]   # rows hold several documents
    assert rec["document_lengths"]["min"] == 1                                    # and some of length 1
    assert (tmp_path / "train_llama.png").stat().st_size > 1000
