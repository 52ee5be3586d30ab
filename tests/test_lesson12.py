"""Lesson 12: the references agree with torch's FlexAttention, planted bugs are named, other right ways pass."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import check, lesson12 as L
from helpers.lesson12 import check as C
from conftest import rejects


# ------------------------------------------------------------------ the references against torch's own
MASKS = [
    (L.causal(11, 13), 11, 13, 4, 3),
    (L.causal(13, 7), 13, 7, 4, 3),
    (L.sliding_window(17, 17, (3, 0), True), 17, 17, 4, 4),
    (L.sliding_window(9, 20, (2, 1)), 9, 20, 4, 3),
    (L.sliding_window(20, 9, (2, 0)), 20, 9, 4, 3),
    (L.sliding_window(10, 10, (0, 0)), 10, 10, 4, 3),
    (L.document(torch.tensor([0, 1, 1, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4, 5])), 14, 14, 4, 3),
    (L.prefix_lm(5), 15, 15, 4, 4),
]


@pytest.mark.parametrize("mm, N, Nk, BM, BN", MASKS, ids=[repr(m[0]) for m in MASKS])
def test_block_mask_ref_is_create_block_masks_layout(mm, N, Nk, BM, BN):
    """Index for index, the padding after each row's count included."""
    for a, b in zip(L.build_block_mask_ref(mm, N, Nk, BM, BN), L.flex_block_mask(mm, N, Nk, BM, BN)):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)


def test_window_follows_the_library_docstring():
    """flash_attn_func's docstring: causal with seqlen_q = 2, seqlen_k = 5 keeps [[1 1 1 1 0], [1 1 1 1 1]];
    with 5 and 2, [[0 0] x 3, [1 0], [1 1]]; a window keeps [i + Nk - N - left, i + Nk - N + right]."""
    assert L.dense_mask(L.causal(2, 5), 2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert L.dense_mask(L.causal(5, 2), 5, 2).int().tolist() == [[0, 0]] * 3 + [[1, 0], [1, 1]]
    assert torch.equal(L.dense_mask(L.sliding_window(5, 2, (-1, -1), True), 5, 2), L.dense_mask(L.causal(5, 2), 5, 2))
    m = L.dense_mask(L.sliding_window(4, 9, (2, 1)), 4, 9)
    for i in range(4):
        assert m[i].nonzero().flatten().tolist() == [j for j in range(9) if i + 5 - 2 <= j <= i + 5 + 1]
    assert L.dense_mask(L.sliding_window(6, 6, (0, 0)), 6, 6).equal(torch.eye(6, dtype=torch.bool))
    assert L.dense_mask(L.sliding_window(6, 6, (60, 60)), 6, 6).all()


def test_dense_reference_matches_flex_attention():
    """The checker's float64 reference against FlexAttention's own eager path, with each score_mod."""
    import warnings
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    g = torch.Generator().manual_seed(0)
    N, Nk, d = 9, 12, 8
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) for n in (N, Nk, Nk))
    q = q * 6
    mm = L.sliding_window(N, Nk, (3, 1))
    bm = create_block_mask(mm.fn, 1, 1, N, Nk, device="cpu", BLOCK_SIZE=128)
    for h, sm in [(0, L.softcap(2.0)), (2, L.alibi(L.alibi_slopes(4), N, Nk)),
                  (1, L.relative_bias(torch.randn(4, 7, generator=g, dtype=torch.float64), 3))]:
        O, lse = L.attention_mods_ref(q, k, v, mm, sm, h=h)
        qh, kh, vh = (x[None, None].expand(1, 4, -1, -1).contiguous() for x in (q, k, v))
        with warnings.catch_warnings():          # "eager flex_attention is slow: compile it" (once per process)
            warnings.simplefilter("ignore")
            Of, aux = flex_attention(qh, kh, vh, score_mod=sm.fn, block_mask=bm, return_aux=AuxRequest(lse=True))
        lsef = aux.lse
        assert torch.allclose(O, Of[0, h], atol=1e-12) and torch.allclose(lse, lsef[0, h], atol=1e-12)


def test_alibi_matches_sdpa_with_a_bias():
    N, Nk, d = 5, 8, 4
    q, k, v = torch.randn(N, d).double(), torch.randn(Nk, d).double(), torch.randn(Nk, d).double()
    slopes = L.alibi_slopes(2)
    bias = -slopes[1] * (torch.arange(N)[:, None] + Nk - N - torch.arange(Nk)[None, :]).abs()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert torch.allclose(L.attention_mods_ref(q, k, v, None, L.alibi(slopes, N, Nk), h=1)[0], want)


def test_tile_loop_reference_and_every_tile_agree():
    q, k, v = torch.randn(13, 4), torch.randn(13, 4), torch.randn(13, 4)
    mm = L.document(torch.tensor([0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 3, 4, 5]), is_causal=True)
    a = L.flash_attn_block_sparse_ref(q, k, v, L.build_block_mask_ref(mm, 13, 13, 4, 3), mm, L.softcap(1.0), 4, 3)
    b = L.every_tile_attention(q, k, v, mm, L.softcap(1.0), 4, 3)
    ref = L.attention_mods_ref(q, k, v, mm, L.softcap(1.0))
    for x, y, z in zip(a, b, ref):
        assert torch.allclose(x.double(), z, atol=1e-5) and torch.allclose(y.double(), z, atol=1e-5)


def test_tile_counts_and_pictures():
    import matplotlib.pyplot as plt
    n = L.tile_counts(L.sliding_window(64, 64, (8, 0), True), 64, 64, 8, 8)
    assert (n["skip"], n["full"], n["partial"]) == (49, 0, 15)           # the diagonal tile and the one before it
    assert n["computed"] == pytest.approx(15 / 64)
    n = L.tile_counts(L.no_mask(), 10, 10, 4, 4)
    assert (n["full"], n["partial"], n["skip"]) == (4, 5, 0)      # ragged tiles are partial, never full
    L.plot_masks({"causal": L.causal(12, 12), "doc": L.document(torch.tensor([0] * 5 + [1] * 7))}, 12, 12, 4, 4)
    plt.close("all")


def test_course_references_pass(strict, capsys):
    check.build_block_mask(L.build_block_mask_ref)
    check.flash_attn_block_sparse(L.flash_attn_block_sparse_ref)
    check.softcap_grad(L.softcap_grad_ref)
    out = capsys.readouterr().out
    assert out.count("✅") == 3 and "course's reference" in out


# ------------------------------------------------------------------ build_block_mask, written another way and with bugs
def block_mask_vectorised(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
    """Right, another way: the whole mask, padded with False, summed per tile by a reshape; lists by sorting."""
    Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
    keep = torch.zeros(Tq * BLOCK_M, Tk * BLOCK_N, dtype=torch.bool)
    keep[:N, :Nk] = mask_mod(0, 0, torch.arange(N)[:, None], torch.arange(Nk)[None, :])
    count = keep.reshape(Tq, BLOCK_M, Tk, BLOCK_N).sum((1, 3))
    full, partial = count == BLOCK_M * BLOCK_N, (count > 0) & (count < BLOCK_M * BLOCK_N)

    def ordered(d):
        return d.sum(1).to(torch.int32), torch.sort(d.int(), dim=1, descending=True, stable=True)[1].to(torch.int32)
    return (*ordered(partial), *ordered(full))


def block_mask_with(full_as_partial=False, partial_skipped=False, partial_as_full=False, clip=False, one_more=False,
                    corners=False, descending=False, no_clip=False, both=False, as_float=False, swap=False, sample=None):
    def build_block_mask(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
        part, full = [], []
        e = 1 if one_more else 0
        for a in range(Tq):
            p, f = [], []
            hi_q = (a + 1) * BLOCK_M + e if no_clip else min((a + 1) * BLOCK_M + e, N)
            qi = torch.arange(a * BLOCK_M, hi_q)[:, None]
            for c in range(Tk):
                kj = torch.arange(c * BLOCK_N, min((c + 1) * BLOCK_N + e, Nk))[None, :]
                keep = (mask_mod(0, 0, kj.T, qi.T).T if swap else mask_mod(0, 0, qi, kj)).expand(qi.shape[0], kj.shape[1])
                whole = keep.numel() if clip else BLOCK_M * BLOCK_N
                if corners:                   # the four corners decide, ragged tiles kept partial
                    ragged = keep.numel() < BLOCK_M * BLOCK_N
                    keep = keep[[0, -1]][:, [0, -1]]
                    whole = -1 if ragged else 4
                if sample:                    # some of the tile's pairs decide: its border, or its first and last rows
                    ragged = keep.numel() < BLOCK_M * BLOCK_N
                    keep = torch.cat([keep[0], keep[-1], keep[:, 0], keep[:, -1]]) if sample == "border" else \
                        keep[[0, -1]].flatten() if sample == "rows" else keep[:, [0, -1]].flatten()
                    whole = -1 if ragged else keep.numel()
                n = int(keep.sum())
                if n == 0:
                    continue
                if n == whole and not full_as_partial or (partial_as_full and n < whole):
                    f.append(c)
                    if both:
                        p.append(c)
                elif not partial_skipped:
                    p.append(c)
            part.append(p[::-1] if descending else p)
            full.append(f)

        def pack(rows):
            num = torch.tensor([len(r) for r in rows], dtype=torch.float32 if as_float else torch.int32)
            idx = torch.tensor([r + [c for c in range(Tk) if c not in r] for r in rows], dtype=torch.int32)
            return num, idx.reshape(Tq, Tk)
        return (*pack(part), *pack(full))
    return build_block_mask


def test_block_mask_written_another_way_passes(strict, capsys):
    check.build_block_mask(block_mask_vectorised)
    check.build_block_mask(block_mask_with())
    assert capsys.readouterr().out.count("✅ build_block_mask") == 2


@pytest.mark.parametrize("knobs, words", [
    (dict(full_as_partial=True), ["a full tile was listed as partial"]),
    (dict(partial_skipped=True), ["a partial tile was skipped"]),
    (dict(partial_as_full=True), ["a partial tile was listed as full"]),
    (dict(clip=True), ["the ragged last block", "never full"]),
    (dict(one_more=True), ["off-by-one on the tile's bounds"]),
    (dict(corners=True), ["classified from its corners"]),
    (dict(swap=True), ["you swapped them"]),
    (dict(descending=True), ["ascending order", "the same blocks in another order"]),
    (dict(both=True), ["both as partial", "disjoint"]),
    (dict(as_float=True), ["expected an integer dtype"]),
    (dict(no_clip=True), ["the ragged last block"]),
])
def test_block_mask_bugs_are_named(knobs, words):
    rejects(check.build_block_mask, block_mask_with(**knobs), *words)


def block_mask_intervals(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
    """Wrong in general: each row's visible keys taken as one interval [first, last], vectorised."""
    keep = mask_mod(0, 0, torch.arange(N)[:, None], torch.arange(Nk)[None, :]).expand(N, Nk)
    cols = torch.arange(Nk)[None, :].expand(N, Nk)
    lo, hi = torch.where(keep, cols, Nk).amin(1), torch.where(keep, cols, -1).amax(1)
    Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
    part, full = [], []
    for a in range(Tq):
        r = slice(a * BLOCK_M, min((a + 1) * BLOCK_M, N))
        p, f = [], []
        for c in range(Tk):
            c0, c1 = c * BLOCK_N, min((c + 1) * BLOCK_N, Nk) - 1
            whole = (r.stop - r.start, c1 - c0 + 1) == (BLOCK_M, BLOCK_N)
            if whole and bool(((lo[r] <= c0) & (hi[r] >= c1)).all()):
                f.append(c)
            elif bool(((lo[r] <= c1) & (hi[r] >= c0)).any()):
                p.append(c)
        part.append(p)
        full.append(f)

    def pack(rows):
        return (torch.tensor([len(x) for x in rows], dtype=torch.int32),
                torch.tensor([x + [c for c in range(Tk) if c not in x] for x in rows], dtype=torch.int32))
    return (*pack(part), *pack(full))


def block_mask_numpy(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
    """Right, in numpy: per-tile counts with np.add.reduceat over the mask, lists with a stable argsort."""
    import numpy as np
    keep = mask_mod(0, 0, torch.arange(N)[:, None], torch.arange(Nk)[None, :]).expand(N, Nk).numpy()
    counts = np.add.reduceat(np.add.reduceat(keep.astype(np.int64), np.arange(0, N, BLOCK_M), axis=0),
                             np.arange(0, Nk, BLOCK_N), axis=1)
    full = counts == BLOCK_M * BLOCK_N
    out = []
    for d in ((counts > 0) & ~full, full):
        out += [torch.from_numpy(d.sum(1).astype(np.int32)), torch.from_numpy(np.argsort(~d, axis=1, kind="stable")
                                                                             .astype(np.int32))]
    return tuple(out)


def block_mask_python_pairs(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
    """Right, pair by pair on Python ints (the cases' masks take ints too)."""
    Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
    seen = [[0] * Tk for _ in range(Tq)]
    for i in range(N):
        for j in range(Nk):
            seen[i // BLOCK_M][j // BLOCK_N] += bool(mask_mod(0, 0, i, j))
    cls = torch.tensor([[0 if n == 0 else 1 if n == BLOCK_M * BLOCK_N else 2 for n in row] for row in seen])
    out = []
    for want in (2, 1):
        d = cls == want
        out += [d.sum(1).int(), torch.sort(d.int(), dim=1, descending=True, stable=True)[1].int()]
    return tuple(out)


def test_block_mask_multi_run_masks_written_other_ways_pass(strict, capsys):
    """Issue 37's cases (a row sees several runs of keys) take every correct style: numpy, Python ints."""
    check.build_block_mask(block_mask_numpy)
    check.build_block_mask(block_mask_python_pairs)
    assert capsys.readouterr().out.count("✅ build_block_mask") == 2


@pytest.mark.parametrize("fn, words", [
    (block_mask_with(sample="border"), ["classified from some of its pairs (its border", "several runs of keys"]),
    (block_mask_with(sample="rows"), ["classified from some of its pairs (its first and last rows)"]),
    (block_mask_with(sample="columns"), ["classified from some of its pairs (its first and last key columns)"]),
    (block_mask_intervals, ["each row's first and last visible key, as one interval"]),
])
def test_block_mask_shortcuts_that_hold_for_one_interval_masks_only_are_named(fn, words):
    """Issue 37: tile tests right while each row sees one interval of keys (every case before) are caught by the
    masks where a row sees several runs, each with its own hint; the exact count in the fix."""
    msg = rejects(check.build_block_mask, fn, *words)
    assert "runs of keys" in msg or "several runs" in msg
    from helpers import checking
    assert "int(keep.sum())" in checking._LAST_FIX["build_block_mask"][1]


def test_block_mask_raising_gets_the_hint_of_what_it_raised():
    """Issue 37: the clip hint for an index past the sequence only; the learner's own ValueError and an empty
    torch.stack are told what they are."""
    def refuses(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        if N % BLOCK_M or Nk % BLOCK_N:
            raise ValueError("N must be a multiple of BLOCK_M")
        return L.build_block_mask_ref(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
    msg = rejects(check.build_block_mask, refuses, "raised ValueError", "your function raised it itself",
                  "need not be multiples")
    assert "clip the ragged" not in msg

    def stacks(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        a, b, c, d = L.build_block_mask_ref(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
        rows = [torch.stack([x for x in r[:int(n)]]) for r, n in zip(d, c)]
        return a, b, c, torch.stack([torch.cat([r, x[int(n):]]) for r, x, n in zip(rows, d, c)])
    rejects(check.build_block_mask, stacks, "stack expects a non-empty TensorList", "torch.stack of an empty list")


def test_block_mask_block_sizes_swapped_or_one_too_many():
    def swapped(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        return L.build_block_mask_ref(mask_mod, N, Nk, BLOCK_N, BLOCK_M)
    rejects(check.build_block_mask, swapped, "counted with BLOCK_N", "the two are swapped")

    def floor_plus_one(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        Tk = Nk // BLOCK_N + 1
        a, b, c, d = L.build_block_mask_ref(mask_mod, N, Tk * BLOCK_N, BLOCK_M, BLOCK_N)
        return a, b, c, d
    rejects(check.build_block_mask, floor_plus_one, "one block too many", "ceil(Nk / BLOCK_N) = 3")


def test_block_mask_dropping_the_ragged_block():
    def floor_blocks(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        return tuple(t[:N // BLOCK_M] for t in L.build_block_mask_ref(mask_mod, N, Nk, BLOCK_M, BLOCK_N))
    rejects(check.build_block_mask, floor_blocks, "kv_num_blocks", "has shape", "ragged")


def test_block_mask_raising_names_the_line():
    def past_the_end(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        return torch.arange(N)[N]
    rejects(check.build_block_mask, past_the_end, "raised IndexError", "line", "clip the ragged last block")


def test_block_mask_returning_none_or_a_blockmask_object():
    rejects(check.build_block_mask, lambda mm, N, Nk, BM, BN: None, "returned None")
    rejects(check.build_block_mask, lambda mm, N, Nk, BM, BN: L.build_block_mask_ref(mm, N, Nk, BM, BN)[:2],
            "expected (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)")


def test_block_mask_with_batch_and_head_dimensions():
    def four_d(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        return tuple(t[None, None] for t in L.build_block_mask_ref(mask_mod, N, Nk, BLOCK_M, BLOCK_N))
    rejects(check.build_block_mask, four_d, "for one head", "[B, H, ...]")


def test_block_mask_index_out_of_range():
    def by_key(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
        a, b, c, d = L.build_block_mask_ref(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
        return a, b * BLOCK_N, c, d * BLOCK_N                         # key offsets, not block indices
    rejects(check.build_block_mask, by_key, "outside", "count blocks, not keys")


# ------------------------------------------------------------------ flash_attn_block_sparse with knobs for bugs
def block_sparse_with(bug=None):  # noqa: C901 - one loop, one switch per planted bug
    """The tile loop written with merged, ascending tiles (another order than the reference), with one bug."""
    def flash_attn_block_sparse(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        kv_num, kv_idx, full_num, full_idx = block_mask
        sm = score_mod if (score_mod is not None and bug != "no_mod") else (lambda s, b, hh, i, j: s)
        N, d = q.shape
        Nk = k.shape[0]
        scale = 1 / math.sqrt(d)
        hm = 0 if bug == "h0" else h
        O, lse = torch.zeros(N, v.shape[1], dtype=q.dtype), torch.zeros(N, dtype=q.dtype)
        if bug == "no_scale":
            scale = 1.0
        dense = (q @ k.T if bug == "dense_s" else torch.from_numpy(q.numpy() @ k.numpy().T) if bug == "dense_np"
                 else None)
        for a in range(-(-N // BLOCK_M)):
            i0 = a * BLOCK_M
            Qi = q[i0:i0 + BLOCK_M]
            br = Qi.shape[0]
            rows = torch.arange(i0, i0 + br)[:, None]
            m, l, acc = torch.full((br,), -math.inf), torch.zeros(br), torch.zeros(br, v.shape[1])
            partial = set(kv_idx[a, :int(kv_num[a])].tolist())
            visit = sorted(partial | set(full_idx[a, :int(full_num[a])].tolist()))
            if bug in ("partial_only", "full_only"):
                visit = [c for c in visit if (c in partial) == (bug == "partial_only")]
            if bug == "every_tile":
                visit, partial = list(range(-(-Nk // BLOCK_N))), set(range(-(-Nk // BLOCK_N)))
            for c in visit:
                j0 = c * BLOCK_N
                Kj = k[j0:j0 + BLOCK_N]
                cols = torch.arange(j0, j0 + Kj.shape[0])[None, :]
                qi_, kj_ = (rows - i0, cols - j0) if bug == "local_idx" else (rows, cols)
                qk = Qi @ Kj.T if dense is None else dense[i0:i0 + br, j0:j0 + Kj.shape[0]]
                S = qk * scale
                is_partial = c in partial or bug == "mask_full"
                if bug == "before_scale":
                    S = sm(qk, 0, hm, qi_, kj_) * scale
                elif bug == "mask_first" and is_partial:
                    S = sm(S.masked_fill(~mask_mod(0, h, rows, cols), -math.inf), 0, hm, qi_, kj_)
                elif bug == "after_max":
                    pass
                elif not (bug == "full_unmodded" and not is_partial):
                    S = sm(S, 0, hm, qi_, kj_)
                    if bug == "twice" and is_partial:
                        S = sm(S, 0, hm, qi_, kj_)
                if is_partial and bug not in ("no_partial_mask", "mask_first"):
                    keep = mask_mod(0, h, cols, rows) if bug == "mask_swapped" else mask_mod(0, h, rows, cols)
                    S = S.masked_fill(~keep, -math.inf)
                m_new = torch.maximum(m, S.amax(1))
                ms = torch.where(torch.isneginf(m_new), 0.0, m_new) if bug != "unsafe" else m_new
                P = torch.exp(sm(S - ms[:, None], 0, hm, qi_, kj_)) if bug == "after_max" else torch.exp(S - ms[:, None])
                alpha = torch.exp(m - ms) if bug != "tile_softmax" else torch.zeros_like(m)
                l, acc, m = alpha * l + P.sum(1), alpha[:, None] * acc + P @ v[j0:j0 + BLOCK_N], m_new
            if bug == "unsafe":
                O[i0:i0 + br], lse[i0:i0 + br] = acc / l[:, None], m + torch.log(l)
            else:
                O[i0:i0 + br] = acc if bug == "no_divide" else \
                    torch.where(l[:, None] > 0, acc / l.clamp_min(1e-30)[:, None], 0.0)
                lse[i0:i0 + br] = torch.where(l > 0, m + torch.log(l), -math.inf)
                if bug == "lse_base2":
                    lse[i0:i0 + br] = lse[i0:i0 + br] / math.log(2)
                if bug == "lse_is_m":
                    lse[i0:i0 + br] = m
                if bug == "lse_log_l":
                    lse[i0:i0 + br] = torch.where(l > 0, torch.log(l), -math.inf)
        return O, lse
    return flash_attn_block_sparse


def test_block_sparse_written_another_way_passes(strict, capsys):
    check.flash_attn_block_sparse(block_sparse_with())
    assert "✅ flash_attn_block_sparse" in capsys.readouterr().out


@pytest.mark.parametrize("bug, words", [
    ("full_unmodded", ["skipped on the full tiles"]),
    ("after_max", ["after the running max was subtracted", "tanh is not shift-invariant"]),
    ("before_scale", ["before the scale", "SCALED"]),
    ("mask_first", ["mask was applied before the score_mod", "-cap"]),
    ("local_idx", ["the tile's own indices"]),
    ("h0", ["got head 0"]),
    ("no_partial_mask", ["without its mask"]),
    ("no_mod", ["never applied"]),
    ("unsafe", ["NaN", "safe max"]),
    ("every_tile", ["mask_mod was evaluated on", "partial tiles hold"]),
    ("mask_full", ["mask_mod was evaluated on", "a full tile"]),
    # issue 37: the dense scores named as such, and a bug model for each recipe hint
    ("dense_s", ["as large as the 48 x 48 score matrix", "you computed the 48 x 48 scores"]),
    ("dense_np", ["np.matmul", "you computed the 48 x 48 scores"]),
    ("partial_only", ["the full tiles were not visited"]),
    ("full_only", ["the partial tiles were not visited"]),
    ("no_scale", ["the scores were not scaled"]),
    ("twice", ["applied twice on the partial tiles"]),
    ("mask_swapped", ["on the partial tiles you swapped them"]),
    ("tile_softmax", ["each tile's softmax replaced the running state"]),
    ("no_divide", ["O was never divided by l"]),
    ("lse_base2", ["lse is in base 2"]),
    ("lse_is_m", ["lse is the running max alone"]),
    ("lse_log_l", ["lse is log(l) alone"]),
])
def test_block_sparse_bugs_are_named(bug, words):
    rejects(check.flash_attn_block_sparse, block_sparse_with(bug), *words)


def test_block_sparse_visiting_every_tile_unmasked_is_counted():
    """Every tile computed, the mask applied only where the block mask says 'partial': right numbers
    (the skipped tiles get the mask too), too many FLOPs."""
    def visit_all(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        N, Nk = q.shape[0], k.shape[0]
        Tq, Tk = -(-N // BLOCK_M), -(-Nk // BLOCK_N)
        num, idx = block_mask[0].clone(), block_mask[1].clone()
        full = L.classes_from_block_mask(*block_mask, Tk=Tk) == L.FULL
        for a in range(Tq):                       # list every non-full tile as partial
            row = [c for c in range(Tk) if not full[a, c]]
            num[a] = len(row)
            idx[a] = torch.tensor(row + [c for c in range(Tk) if c not in row], dtype=idx.dtype)
        return L.flash_attn_block_sparse_ref(q, k, v, (num, idx, block_mask[2], block_mask[3]), mask_mod,
                                             score_mod, BLOCK_M, BLOCK_N, h)
    rejects(check.flash_attn_block_sparse, visit_all, "mask_mod was evaluated on")


def test_block_sparse_dense_scores_rejected():
    def dense(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        O, lse = L.attention_mods_ref(q, k, v, mask_mod, score_mod, h=h)
        return O.to(q.dtype), lse.to(q.dtype)
    rejects(check.flash_attn_block_sparse, dense, "mask_mod was evaluated on")


def test_block_sparse_idea_comes_before_the_values():
    """Wrong in both (the dense scores, and a missing scale): the verdict is about the idea."""
    def dense_and_unscaled(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        O, lse = L.attention_mods_ref(q * math.sqrt(q.shape[1]), k, v, mask_mod, score_mod, h=h)
        return O.to(q.dtype), lse.to(q.dtype)
    rejects(check.flash_attn_block_sparse, dense_and_unscaled, "the work, metered")


def test_block_sparse_filler_and_transposed_o_named():
    def filler(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        kv_num, kv_idx, full_num, full_idx = block_mask
        Tk = kv_idx.shape[1]
        full = L.classes_from_block_mask(*block_mask, Tk=Tk) == L.FULL
        every = torch.tensor([Tk - int(full[a].sum()) for a in range(kv_idx.shape[0])], dtype=kv_num.dtype)
        idx = torch.stack([torch.tensor([c for c in range(Tk) if not full[a, c]] + [c for c in range(Tk) if full[a, c]],
                                        dtype=kv_idx.dtype) for a in range(kv_idx.shape[0])])
        return L.flash_attn_block_sparse_ref(q, k, v, (every, idx, full_num, full_idx), mask_mod, score_mod, BLOCK_M,
                                             BLOCK_N, h)
    rejects(check.flash_attn_block_sparse, filler, "every tile but the full ones", "the rest of the row is filler")

    def both_counts(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        kv_num, kv_idx, full_num, full_idx = block_mask
        every = kv_num + full_num                        # kv_indices read up to both counts, full list unread
        return L.flash_attn_block_sparse_ref(q, k, v, (every, kv_idx, torch.zeros_like(full_num), full_idx), mask_mod,
                                             score_mod, BLOCK_M, BLOCK_N, h)
    rejects(check.flash_attn_block_sparse, both_counts, "as many as the 13 partial and the 5 full tiles hold",
            "read past kv_num_blocks[a]")

    def transposed(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        O, lse = L.flash_attn_block_sparse_ref(q, k, v, block_mask, mask_mod, score_mod, BLOCK_M, BLOCK_N, h)
        return O.T.contiguous(), lse
    rejects(check.flash_attn_block_sparse, transposed, "transposed", "a row per query")


def test_block_sparse_changing_inputs_or_none():
    def scales_q(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        q.mul_(1.5)
        return L.flash_attn_block_sparse_ref(q / 1.5, k, v, block_mask, mask_mod, score_mod, BLOCK_M, BLOCK_N, h)
    rejects(check.flash_attn_block_sparse, scales_q, "changed its input `q` in place")

    def sorts_the_list(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        block_mask[1].zero_()
        return L.flash_attn_block_sparse_ref(q, k, v, block_mask, mask_mod, score_mod, BLOCK_M, BLOCK_N, h)
    rejects(check.flash_attn_block_sparse, sorts_the_list, "changed its input `block_mask` in place")
    rejects(check.flash_attn_block_sparse, lambda *a, **kw: None, "returned None")


def test_block_sparse_nan_output():
    def nan(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        O, lse = L.flash_attn_block_sparse_ref(q, k, v, block_mask, mask_mod, score_mod, BLOCK_M, BLOCK_N, h)
        return O * float("nan"), lse
    rejects(check.flash_attn_block_sparse, nan, "NaN")


# ------------------------------------------------------------------ softcap_grad
def test_softcap_grad_another_way_passes(strict, capsys):
    check.softcap_grad(lambda s, dT, cap: dT / torch.cosh(s / cap) ** 2)     # sech^2 = 1 - tanh^2
    check.softcap_grad(lambda s, dT, cap: dT * 4 / (torch.exp((s / cap).abs()) + torch.exp(-(s / cap).abs())) ** 2)
    check.softcap_grad(lambda s, dT, cap: dT * 4 * torch.sigmoid(2 * s / cap) * torch.sigmoid(-2 * s / cap))
    assert capsys.readouterr().out.count("✅ softcap_grad") == 3


@pytest.mark.parametrize("fn, words", [
    (lambda s, dT, cap: dT.clone(), ["chain rule stopped"]),
    (lambda s, dT, cap: dT * (1 - torch.tanh(s / cap)), ["1 - tanh^2, not 1 - tanh"]),
    (lambda s, dT, cap: dT * cap * (1 - torch.tanh(s / cap) ** 2), ["no factor cap"]),
    (lambda s, dT, cap: dT / cap * (1 - torch.tanh(s / cap) ** 2), ["no factor 1 / cap"]),
    (lambda s, dT, cap: dT * (1 - (cap * torch.tanh(s / cap)) ** 2), ["not 1 - T^2"]),
    (lambda s, dT, cap: dT * (1 - torch.tanh(torch.tanh(s / cap)) ** 2), ["tanh(T / cap) is not"]),
    (lambda s, dT, cap: None, ["returned None"]),
    (lambda s, dT, cap: dT * (1 - torch.tanh(s / cap) ** 2) * (s - s + 1), ["NaN", "s = -inf"]),   # -inf - -inf
    # issue 37: forms that overflow float32 where s / cap is large, and a model for each formula hint
    (lambda s, dT, cap: dT * 4 * torch.exp(2 * s / cap) / (torch.exp(2 * s / cap) + 1) ** 2,
     ["scores up to 100 times the cap", "NaN where s / cap is large", "overflows float32"]),
    (lambda s, dT, cap: dT * (1 - ((torch.exp(2 * s / cap) - 1) / (torch.exp(2 * s / cap) + 1)) ** 2),
     ["NaN where s / cap is large", "inf / inf"]),
    (lambda s, dT, cap: dT * (1 - torch.tanh(s) ** 2), ["tanh(s) without the cap"]),
    (lambda s, dT, cap: dT * (1 - torch.tanh(s * cap) ** 2), ["tanh(s * cap)"]),
    (lambda s, dT, cap: dT * (1 + torch.tanh(s / cap) ** 2), ["1 + tanh^2", "a sign"]),
    (lambda s, dT, cap: dT / torch.cosh(s / cap), ["sech, not sech^2"]),
    (lambda s, dT, cap: dT * torch.sqrt(1 - torch.tanh(s / cap) ** 2), ["sech, not sech^2", "a square root"]),
    (lambda s, dT, cap: s * (1 - torch.tanh(s / cap) ** 2), ["by dT, the upstream gradient, not by s"]),
    (lambda s, dT, cap: cap * torch.tanh(s / cap), ["that is the forward"]),
    (lambda s, dT, cap: dT / (1 + (s / cap) ** 2), ["arctan's derivative"]),
    (lambda s, dT, cap: torch.where(s > 0, dT * (1 - torch.tanh(s / cap) ** 2), 0.0), ["every negative score"]),
    (lambda s, dT, cap: (dT * (1 - torch.tanh(s / cap) ** 2)).flatten(), ["expected s's", "elementwise"]),
])
def test_softcap_grad_bugs_are_named(fn, words):
    rejects(check.softcap_grad, fn, *words)


def test_softcap_grad_in_place():
    def inplace(s, dT, cap):
        return dT.mul_(1 - torch.tanh(s / cap) ** 2)
    rejects(check.softcap_grad, inplace, "changed its input `dT` in place")


def test_block_sparse_without_a_running_max_overflows_and_is_named():
    """exp(S) with no max subtracted: right on small scores, inf / inf once a score passes 88 (the no-cap case)."""
    def no_max(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
        kv_num, kv_idx, full_num, full_idx = block_mask
        N, d = q.shape
        O, lse = torch.empty(N, v.shape[1]), torch.empty(N)
        for a, i0 in enumerate(range(0, N, BLOCK_M)):
            Qi = q[i0:i0 + BLOCK_M]
            qi = torch.arange(i0, i0 + Qi.shape[0])[:, None]
            acc, l = torch.zeros(Qi.shape[0], v.shape[1]), torch.zeros(Qi.shape[0])
            tiles = [(int(c), True) for c in kv_idx[a][:int(kv_num[a])]] + \
                [(int(c), False) for c in full_idx[a][:int(full_num[a])]]
            for c, partial in tiles:
                j0 = c * BLOCK_N
                Kj, Vj = k[j0:j0 + BLOCK_N], v[j0:j0 + BLOCK_N]
                kj = torch.arange(j0, j0 + Kj.shape[0])[None, :]
                S = Qi @ Kj.T / math.sqrt(d)
                S = score_mod(S, 0, h, qi, kj) if score_mod is not None else S
                P = torch.where(mask_mod(0, h, qi, kj), torch.exp(S), 0.0) if partial else torch.exp(S)
                acc, l = acc + P @ Vj, l + P.sum(1)
            O[i0:i0 + Qi.shape[0]] = torch.where(l[:, None] > 0, acc / l.clamp_min(1e-30)[:, None], 0.0)
            lse[i0:i0 + Qi.shape[0]] = torch.where(l > 0, torch.log(l), -math.inf)
        return O, lse
    rejects(check.flash_attn_block_sparse, no_max, "large logits, no cap", "exp(S) overflows float32",
            "keep a running max")
