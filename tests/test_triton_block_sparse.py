"""Correctness of helpers/kernels/block_sparse.py: the block index built on the device and the block-sparse forward.

The index is compared with lesson 12's answer (``helpers.lesson12.build_block_mask_ref``, itself checked against
FlexAttention's ``create_block_mask``) entry for entry, and its transposed lists with the transposed classes. Each
forward is compared per head with lesson 12's float64 dense reference (``attention_mods_ref``: S = q k^T * scale,
then the score modification, then the mask, then softmax), O and lse; a row that sees no key must give O = 0 and
lse = -inf, never NaN; the backward (autograd) against float64 autograd of the dense reference. Lengths are not
multiples of the tiles; windows wider than the sequence, a window of 0, documents of length 1, N != Nk both ways,
GQA. Under the interpreter: fp32 (fp16 once), 16 x 16 tiles, d = 16.
"""
import math

import pytest
import torch

from kernel_env import DEVICE, DTYPES, ON_GPU, TOL  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers import lesson12 as L  # noqa: E402
from helpers.kernels import block_sparse as bs  # noqa: E402

D = 64 if ON_GPU else 16


def _tiles(dtype=torch.float32):
    return bs.block_sparse_tiles(D, dtype, DEVICE)


def _inputs(B, H, Hkv, N, Nk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, N, D, generator=g) * 3).to(DEVICE, dtype)  # harsh: large scores
    k = (torch.randn(B, Hkv, Nk, D, generator=g) * 3).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(DEVICE, dtype)
    return q, k, v


def _check(q, k, v, mask_mods, score_mods, o, lse, tol, label):
    """mask_mods[b], score_mods[b][h]: lesson 12's predicates and modifications for sequence b (head h)."""
    B, H, N, _ = q.shape
    group = H // k.shape[1]
    for b in range(B):
        for h in range(H):
            ro, rl = L.attention_mods_ref(q[b, h].cpu(), k[b, h // group].cpu(), v[b, h // group].cpu(), mask_mods[b],
                                          score_mods[b][h], h=h)
            got_o, got_l = o[b, h].double().cpu(), lse[b, h].double().cpu()
            where = f"{label}, sequence {b}, head {h}"
            assert not torch.isnan(got_o).any() and not torch.isnan(got_l).any(), f"{where}: NaN"
            empty = torch.isneginf(rl)
            assert torch.equal(torch.isneginf(got_l), empty), \
                f"{where}: rows with lse = -inf {torch.isneginf(got_l).nonzero().flatten().tolist()}, " \
                f"expected {empty.nonzero().flatten().tolist()}"
            assert (got_o[empty] == 0).all(), f"{where}: a row that sees no key must have O = 0"
            err = (got_o - ro).abs()
            i = int(err.max(1).values.argmax())
            assert err.max() <= tol, f"{where}: O max err {err.max():.3g} > {tol} at row {i}"
            lerr = (got_l[~empty] - rl[~empty]).abs()
            assert lerr.numel() == 0 or lerr.max() <= tol, f"{where}: lse max err {lerr.max():.3g} > {tol}"


def _run(spec, mask_mod, N, Nk, B=1, H=2, Hkv=2, score_mod=None, ref_mods=None, dtype=None, seed=0):
    dtype = dtype or DTYPES[0]
    q, k, v = _inputs(B, H, Hkv, N, Nk, dtype, seed)
    bm = bs.build_block_mask_triton(spec, N, Nk, *_tiles(dtype), device=DEVICE)
    o, lse = bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=score_mod)
    mask_mods = mask_mod if isinstance(mask_mod, list) else [mask_mod] * B
    _check(q, k, v, mask_mods, ref_mods or [[None] * H] * B, o, lse, TOL[dtype] * (4 if ref_mods else 1), repr(spec))
    return bm, o, lse


# ------------------------------------------------------------------ the block index
INDEX_CASES = [
    (bs.causal_mask(), lambda N, Nk: L.causal(N, Nk), 37, 37),
    (bs.causal_mask(), lambda N, Nk: L.causal(N, Nk), 20, 45),
    (bs.sliding_window_mask((5, 0), causal=True), lambda N, Nk: L.sliding_window(N, Nk, (5, 0), True), 50, 50),
    (bs.sliding_window_mask((3, 17)), lambda N, Nk: L.sliding_window(N, Nk, (3, 17)), 45, 30),
    (bs.sliding_window_mask((0, 0)), lambda N, Nk: L.sliding_window(N, Nk, (0, 0)), 33, 33),
    (bs.sliding_window_mask((500, 500)), lambda N, Nk: L.sliding_window(N, Nk, (500, 500)), 33, 40),
    (bs.prefix_lm_mask(21), lambda N, Nk: L.prefix_lm(21), 50, 50),
    (bs.full_mask(), lambda N, Nk: L.no_mask(), 20, 35),
]


@pytest.mark.parametrize("spec,ref,N,Nk", INDEX_CASES, ids=[f"{c[0]!r}-{c[2]}x{c[3]}" for c in INDEX_CASES])
def test_block_index_matches_lesson12(spec, ref, N, Nk):
    _compare_index(spec, ref(N, Nk), N, Nk)


def test_block_index_documents_and_transpose():
    docs = torch.tensor([0] * 7 + [1] * 3 + [2] * 14 + [3] + [4] * 15 + [5])  # lengths 7, 3, 14, 1, 15, 1
    for causal in (False, True):
        _compare_index(bs.document_mask(docs, causal), L.document(docs, causal), 41, 41)


def _compare_index(spec, mask_mod, N, Nk, BM=16, BN=16):
    bm = bs.build_block_mask_triton(spec, N, Nk, BM, BN)  # on the CPU: the layout, not the kernel
    want = L.build_block_mask_ref(mask_mod, N, Nk, BM, BN)
    got = (bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0], bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0])
    for name, g, w in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w), f"{spec!r} N={N} Nk={Nk}: {name}\n{g}\nexpected\n{w}"
    cls = L.tile_classes(mask_mod, N, Nk, BM, BN)
    assert torch.equal(bm.classes(), cls)
    tq_num, tq_idx = L._ordered((cls == L.PARTIAL).T)
    tf_num, tf_idx = L._ordered((cls == L.FULL).T)
    for name, g, w in (("q_num_blocks", bm.q_num_blocks, tq_num), ("q_indices", bm.q_indices, tq_idx),
                       ("full_q_num_blocks", bm.full_q_num_blocks, tf_num), ("full_q_indices", bm.full_q_indices, tf_idx)):
        assert torch.equal(g[0, 0], w), f"{spec!r}: {name}"


# ------------------------------------------------------------------ the forward, per mask
def test_causal_and_windows_ragged():
    _run(bs.causal_mask(), L.causal(37, 37), 37, 37)
    _run(bs.sliding_window_mask((7, 0), causal=True), L.sliding_window(45, 45, (7, 0), True), 45, 45, H=4, Hkv=2)
    _run(bs.sliding_window_mask((3, 9)), L.sliding_window(30, 45, (3, 9)), 30, 45)


def test_window_wider_than_the_sequence_is_full_attention():
    bm, o, lse = _run(bs.sliding_window_mask((1000, 1000)), L.no_mask(), 33, 21)
    if not ON_GPU:  # 16 x 16 tiles, 3 x 2 of them: the ragged last Q block and the ragged last KV block are never full
        assert (int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())) == (2, 4)


def test_window_of_zero_and_rows_that_see_nothing():
    _run(bs.sliding_window_mask((0, 0)), L.sliding_window(29, 29, (0, 0)), 29, 29)
    # bottom-right causal with N > Nk: the first N - Nk rows see nothing (O = 0, lse = -inf, checked in _check)
    _, o, lse = _run(bs.causal_mask(), L.causal(40, 19), 40, 19)
    assert torch.isneginf(lse[:, :, :21]).all() and torch.isfinite(lse[:, :, 21:]).all()
    # a window (2, 2) shifted by Nk - N = -30: rows 0..27 see nothing; whole Q blocks of them visit no tile
    bm, o, lse = _run(bs.sliding_window_mask((2, 2)), L.sliding_window(40, 10, (2, 2)), 40, 10)
    if not ON_GPU:  # 16-row Q blocks: the first sees nothing, and visits no tile
        assert int(bm.kv_num_blocks[0, 0, 0]) + int(bm.full_kv_num_blocks[0, 0, 0]) == 0


def test_documents_of_length_one_per_sequence():
    N = 35
    d0 = torch.tensor([0] * 5 + [1] + [2] * 12 + [3] + [4] + [5] * 15)  # lengths 5, 1, 12, 1, 1, 15
    d1 = torch.repeat_interleave(torch.arange(35), 1)  # 35 documents of length 1: each row sees itself
    docs = torch.stack([d0, d1]).to(DEVICE)
    for causal in (False, True):
        _run(bs.document_mask(docs, causal), [L.document(d0, causal), L.document(d1, causal)], N, N, B=2, seed=1)


def test_a_late_first_key_with_a_very_negative_score_in_half_precision():
    """A row whose first visited tiles are all masked (the first token of a document, late in its Q block) and whose
    one key scores very low: its running max must stay -inf until that key, or p = exp2(s - 0) underflows in the
    half-precision P V while l keeps it (O = 0 instead of v; seen natively on the H200 before the fix)."""
    N, dtype = 60, torch.float16
    q, k, v = _inputs(1, 2, 2, N, N, dtype, seed=3)
    docs = torch.tensor([0] * 20 + [1] + [2] * 39)                    # row 20 sees only key 20
    k[:, :, 20] = -q[:, :, 20]                                        # its one score: -|q_20|^2 * scale, about -70
    k[:, :, 21] = (-0.5 * q[:, :, 21]).to(dtype)                      # row 21's own key scores low too
    _check(q, k, v, [L.document(docs, True)], [[None, None]],
           *bs.flash_attn_block_sparse_triton(q, k, v, bs.build_block_mask_triton(
               bs.document_mask(docs.to(DEVICE), True), N, N, *bs.block_sparse_tiles(D, dtype, DEVICE),
               device=DEVICE)), TOL[dtype], "documents, late first key")


def test_prefix_lm():
    _run(bs.prefix_lm_mask(20), L.prefix_lm(20), 39, 39)
    _run(bs.prefix_lm_mask(0), L.prefix_lm(0), 18, 18)  # no prefix: causal


@pytest.mark.skipif(ON_GPU, reason="fp16 under the interpreter: the GPU run covers fp16 and bf16 throughout")
def test_fp16_window():
    _run(bs.sliding_window_mask((9, 0), causal=True), L.sliding_window(40, 40, (9, 0), True), 40, 40,
         dtype=torch.float16)


# ------------------------------------------------------------------ score modifications
def test_softcap_on_a_window():
    cap = 2.0  # small: the scores (q, k scaled by 3) saturate it
    mods = [[L.softcap(cap)] * 2]
    _run(bs.sliding_window_mask((11, 0), causal=True), L.sliding_window(37, 37, (11, 0), True), 37, 37,
         score_mod=bs.SoftCap(cap), ref_mods=mods)


def test_alibi_per_head_and_per_sequence():
    N, Nk, H = 26, 37, 2
    slopes = L.alibi_slopes(H).float()
    _run(bs.causal_mask(), L.causal(N, Nk), N, Nk, H=H, score_mod=bs.ALiBi(slopes.to(DEVICE)),
         ref_mods=[[L.alibi(slopes, N, Nk)] * H])
    per_b = torch.stack([slopes, slopes * 4])  # [B, H]
    _run(bs.full_mask(), L.no_mask(), N, N, B=2, H=H, Hkv=1, score_mod=bs.ALiBi(per_b.to(DEVICE)),
         ref_mods=[[L.alibi(per_b[b], N, N)] * H for b in range(2)])


def test_softcap_on_documents():
    docs = torch.tensor([0] * 9 + [1] + [2] * 20)
    _run(bs.document_mask(docs, True), L.document(docs, True), 30, 30, score_mod=bs.SoftCap(5.0),
         ref_mods=[[L.softcap(5.0)] * 2])


# ------------------------------------------------------------------ clear errors
def _small():
    q, k, v = _inputs(1, 2, 2, 20, 20, DTYPES[0], 0)
    return q, k, v, bs.build_block_mask_triton(bs.causal_mask(), 20, 20, *_tiles(), device=DEVICE)


@pytest.mark.parametrize("call,err,match", [
    (lambda: bs.sliding_window_mask((3,)), TypeError, "window_size must be a pair"),
    (lambda: bs.sliding_window_mask((-2, 0)), ValueError, "-1 for unbounded"),
    (lambda: bs.document_mask(torch.zeros(5)), TypeError, "integer torch.Tensor"),
    (lambda: bs.document_mask(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError, r"\[N\] or \[B, N\]"),
    (lambda: bs.prefix_lm_mask(-1), ValueError, "prefix must be an int >= 0"),
    (lambda: bs.build_block_mask_triton("causal", 8, 8, 16, 16), TypeError, "mask must be a MaskSpec"),
    (lambda: bs.build_block_mask_triton(bs.prefix_lm_mask(2), 8, 9, 16, 16), ValueError, "N must equal Nk"),
    (lambda: bs.build_block_mask_triton(bs.document_mask(torch.zeros(7, dtype=torch.long)), 8, 8, 16, 16),
     ValueError, "doc_ids has 7 tokens"),
    (lambda: bs.build_block_mask_triton(bs.causal_mask(), 8, 8, 12, 16), ValueError, "power of two"),
    (lambda: bs.build_block_mask_triton(bs.causal_mask(), 0, 8, 16, 16), ValueError, "N must be an int >= 1"),
])
def test_bad_mask_arguments(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_bad_kernel_arguments():
    q, k, v, bm = _small()
    with pytest.raises(TypeError, match="block_mask must be a BlockSparseMask"):
        bs.flash_attn_block_sparse_triton(q, k, v, L.build_block_mask_ref(L.causal(20, 20), 20, 20, 16, 16))
    other = bs.build_block_mask_triton(bs.causal_mask(), 20, 24, *_tiles(), device=DEVICE)
    with pytest.raises(ValueError, match="built for N = 20, Nk = 24"):
        bs.flash_attn_block_sparse_triton(q, k, v, other)
    with pytest.raises(TypeError, match="score_mod must be None, SoftCap"):
        bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="cap must be a finite number > 0"):
        bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=bs.SoftCap(0.0))
    with pytest.raises(ValueError, match=r"slopes must be \[H\] = \[2\]"):
        bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=bs.ALiBi(torch.ones(3, device=DEVICE)))
    with pytest.raises(TypeError, match="float32"):
        bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=bs.ALiBi(torch.ones(2, dtype=torch.float64)))
    docs = bs.build_block_mask_triton(bs.document_mask(torch.zeros(3, 20, dtype=torch.long, device=DEVICE)),
                                      20, 20, *_tiles(), device=DEVICE)
    with pytest.raises(ValueError, match="block_mask is for a batch of 3"):
        bs.flash_attn_block_sparse_triton(q, k, v, docs)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        bs.flash_attn_block_sparse_triton(q, k[:, :1].repeat(1, 3, 1, 1).contiguous(), v[:, :1].repeat(1, 3, 1, 1).contiguous(), bm)


# ------------------------------------------------------------------ lesson 12's "On a GPU" section
def test_lesson12_gpu_section_checks_every_mask(capsys):
    """helpers.lesson12.run_on_gpu, the notebook's GPU cell: natively on a GPU; here the same under the interpreter."""
    rows = L.run_on_gpu(N=40, d=16, H=2, device=DEVICE, dtype=DTYPES[0])
    out = capsys.readouterr().out
    assert len(rows) == 6 and out.count("✅") == 6 and "❌" not in out, out
    for name, spec, mod, mask_mod, score_mod in L.gpu_cases(200, "cpu"):  # one mask, written twice alike
        bm = bs.build_block_mask_triton(spec, 200, 200, 32, 32)
        assert torch.equal(bm.classes(), L.tile_classes(mask_mod, 200, 200, 32, 32)), name


@pytest.mark.skipif(ON_GPU, reason="the message for a machine without a CUDA GPU")
def test_lesson12_gpu_section_without_a_gpu_says_so(capsys, tmp_path):
    assert L.run_on_gpu() == []
    assert capsys.readouterr().out.startswith("No CUDA GPU here")
    L.show_masks_results(tmp_path / "none.json")
    assert "No figures are recorded yet" in capsys.readouterr().out
    rec = tmp_path / "masks_h200.json"
    rec.write_text('{"meta": {"gpu": "NVIDIA H200", "dtype": "bfloat16", "d": 128}, "rows": [{"mask": "causal", '
                   '"N": 4096, "course_ms": 1.0, "flex_ms": 1.5, "sdpa_dense_ms": null}]}')
    L.show_masks_results(rec)
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "1.50" in out


# ------------------------------------------------------------------ the backward (autograd), against float64 autograd
def _dense_ref_o(q, k, v, mask_mod, score_mod):
    """float64 O [B, H, N, d], differentiable: rows that see nothing give O = 0 without a NaN in any gradient."""
    B, H, N, d = q.shape
    Nk, group = k.shape[2], H // k.shape[1]
    i, j = torch.arange(N)[:, None], torch.arange(Nk)[None, :]
    keep = torch.as_tensor(mask_mod(0, 0, i, j)).expand(N, Nk)  # [N, Nk]
    empty = ~keep.any(1)
    out = []
    for h in range(H):
        s = q[0, h] @ k[0, h // group].T / math.sqrt(d)  # [N, Nk]
        if score_mod is not None:
            s = score_mod(s, 0, h, i, j)
        s = s.masked_fill(~keep, -math.inf).masked_fill(empty[:, None], 0.0)
        out.append(torch.softmax(s, 1) * (~empty)[:, None].double() @ v[0, h // group])
    return torch.stack(out)[None]


BWD_CASES = [
    ("causal, N > Nk (rows that see nothing)", bs.causal_mask(), L.causal(40, 19), None, None, 40, 19, 2, 2),
    ("window (5, 0) + softcap 2, GQA", bs.sliding_window_mask((5, 0), True), L.sliding_window(37, 37, (5, 0), True),
     bs.SoftCap(2.0), L.softcap(2.0), 37, 37, 4, 2),
    ("documents + ALiBi", bs.document_mask(torch.tensor([0] * 9 + [1] + [2] * 20)),
     L.document(torch.tensor([0] * 9 + [1] + [2] * 20)), bs.ALiBi(L.alibi_slopes(2).float()),
     L.alibi(L.alibi_slopes(2), 30, 30), 30, 30, 2, 1),
    ("prefix-LM", bs.prefix_lm_mask(11), L.prefix_lm(11), None, None, 33, 33, 2, 2),
]


@pytest.mark.parametrize("name,spec,mask_mod,mod,score_mod,N,Nk,H,Hkv", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_backward_matches_float64_autograd(name, spec, mask_mod, mod, score_mod, N, Nk, H, Hkv):
    dtype = DTYPES[0]
    q, k, v = (t.requires_grad_() for t in _inputs(1, H, Hkv, N, Nk, dtype, 3))
    if isinstance(mod, bs.ALiBi):
        mod = bs.ALiBi(mod.slopes.to(DEVICE))
    if spec.kind == "document":
        spec = bs.document_mask(spec.doc_ids.to(DEVICE))
    bm = bs.build_block_mask_triton(spec, N, Nk, *bs.block_sparse_tiles(D, dtype, DEVICE, backward=True), device=DEVICE)
    o, lse = bs.flash_attn_block_sparse(q, k, v, bm, mod)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ro = _dense_ref_o(qd, kd, vd, mask_mod, score_mod)
    want = torch.autograd.grad(ro, (qd, kd, vd), do.double().cpu())
    tol = TOL[dtype] * 10 if ON_GPU else TOL[dtype]
    for gname, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert g.dtype == dtype and not torch.isnan(g).any(), f"{name}: {gname} NaN or dtype {g.dtype}"
        err = (g.double().cpu() - w).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), f"{name}: {gname} max err {err:.3g}"
