"""The idea checks see all the work: answers with the right output that break the lesson's idea.

Each planted answer below was accepted with ✅ before the meter followed inputs through
copies, numpy arrays and Python lists, counted elementwise FLOPs and divisions: each must
now fail with a hint that names its actual mistake. Correct answers written another way
(einsum, a tile at a time in float64, a one-pass loop over ``x.tolist()``) must still pass.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import check
from conftest import notebook_namespace, rejects

NEG_INF = -math.inf


@pytest.fixture(scope="module")
def ns01():
    return notebook_namespace("01_online_softmax")


@pytest.fixture(scope="module")
def ns06():
    return notebook_namespace("06_flash_decoding")


# ------------------------------------------------------------------ 01: online_softmax_stats
def stats_two_pass_tolist(x):
    xs = x.tolist()
    m = max(xs)                                   # pass 1
    if m == NEG_INF:
        return m, 0.0
    return m, sum(math.exp(v - m) for v in xs)    # pass 2


def stats_two_pass_numpy(x):
    a = x.numpy()
    m = float(a.max())
    return m, (float(np.exp(a.astype(np.float64) - m).sum()) if m > NEG_INF else 0.0)


def stats_amax_logsumexp(x):
    m = x.amax()
    lse = torch.logsumexp(x.double(), 0)
    return float(m), (float(torch.exp(lse - float(m))) if m > NEG_INF else 0.0)


def stats_two_pass_on_a_copy(x):
    x = x.double()                                # a copy is still x
    m = NEG_INF
    for xi in x:
        m = max(m, float(xi))
    if m == NEG_INF:
        return m, 0.0
    return m, sum(math.exp(float(xi) - m) for xi in x)


def stats_one_pass_tolist(x):                     # correct, another way: one pass over a Python list
    m, l = NEG_INF, 0.0
    for xi in x.double().tolist():
        m_new = max(m, xi)
        if m_new == NEG_INF:
            continue
        l = l * math.exp(m - m_new) + math.exp(xi - m_new)
        m = m_new
    return m, l


def stats_one_pass_numpy(x):                      # correct, another way: one pass over a numpy array
    m, l = NEG_INF, 0.0
    for xi in np.asarray(x):
        xi = float(xi)
        m_new = max(m, xi)
        if m_new == NEG_INF:
            continue
        l = l * math.exp(m - m_new) + math.exp(xi - m_new)
        m = m_new
    return m, l


def test_stats_two_pass_over_tolist():
    rejects(check.online_softmax_stats, stats_two_pass_tolist, "2 times", "x.tolist()", "2-pass softmax",
            "one pass (metered)")


def test_stats_two_pass_over_numpy():
    rejects(check.online_softmax_stats, stats_two_pass_numpy, "12 elements of x in one operation", "numpy",
            "2- or 3-pass")


def test_stats_amax_and_logsumexp():
    rejects(check.online_softmax_stats, stats_amax_logsumexp, "12 elements of x in one operation", "2- or 3-pass")


def stats_one_pass_numpy_tolist(x):               # correct, another way: x.numpy().tolist() is x.tolist()
    m, l = NEG_INF, 0.0
    for xi in x.numpy().tolist():
        m_new = max(m, xi)
        if m_new == NEG_INF:
            continue
        l = l * math.exp(m - m_new) + math.exp(xi - m_new)
        m = m_new
    return m, l


def test_stats_two_pass_on_a_copy():
    rejects(check.online_softmax_stats, stats_two_pass_on_a_copy, "2 times", "2-pass softmax")


@pytest.mark.parametrize("fn", [stats_one_pass_tolist, stats_one_pass_numpy, stats_one_pass_numpy_tolist])
def test_stats_one_pass_written_another_way_passes(fn):
    check.online_softmax_stats(fn)


# ------------------------------------------------------------------ 01: blockwise_stats
def blockwise_two_pass(x, Bc):
    R, n = x.shape
    m = torch.full((R,), NEG_INF)
    for j in range(0, n, Bc):                     # pass 1: the max
        m = torch.maximum(m, x[:, j:j + Bc].amax(1))
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    l = torch.zeros(R)
    for j in range(0, n, Bc):                     # pass 2: the sum against it
        l = l + torch.exp(x[:, j:j + Bc] - m_safe[:, None]).sum(1)
    return m, l


def blockwise_whole_row(x, Bc):
    m = x.amax(1)                                 # [R], but it reads the whole row
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    return m, torch.where(m == NEG_INF, 0.0, torch.exp(torch.logsumexp(x.double(), 1) - m_safe).float())


def blockwise_numpy_row(x, Bc):
    a = x.double().numpy()
    m = a.max(1)                                  # the whole row, in numpy
    m_safe = np.where(m == NEG_INF, 0.0, m)
    l = np.exp(a - m_safe[:, None]).sum(1)
    return torch.from_numpy(m).float(), torch.from_numpy(l).float()


def blockwise_einsum_style(x, Bc):                # correct, another way: float64 blocks, torch.logsumexp per block
    R, n = x.shape
    lse = torch.full((R,), NEG_INF, dtype=torch.float64)
    m = torch.full((R,), NEG_INF, dtype=torch.float64)
    for j in range(0, n, Bc):
        block = x[:, j:j + Bc].double()           # [R, <=Bc], a load of one block
        m = torch.maximum(m, block.amax(1))
        lse = torch.logaddexp(lse, torch.logsumexp(block, 1))
    m_safe = torch.where(m == NEG_INF, 0.0, m)
    return m.float(), torch.where(m == NEG_INF, 0.0, torch.exp(lse - m_safe)).float()


def test_blockwise_two_pass():
    rejects(check.blockwise_stats, blockwise_two_pass, "2 times", "2-pass version", "blocks only (metered)")


def test_blockwise_amax_and_logsumexp_of_the_row():
    rejects(check.blockwise_stats, blockwise_whole_row, "one operation read 192 elements", "whole row at once")


def test_blockwise_row_in_numpy():
    rejects(check.blockwise_stats, blockwise_numpy_row, "made a tensor of shape [4, 48] (np.", "never holds")


def test_blockwise_written_another_way_passes(ns01):
    check.blockwise_stats(blockwise_einsum_style)


# ------------------------------------------------------------------ 02 / 03: V1 and V2
def _v2_loop(q, k, v, Br, Bc, normalise_every_step=False, dtype=None):
    """V2's loop order (Q blocks outside); optionally V1's normalised update inside it."""
    N, d = q.shape
    scale = 1.0 / math.sqrt(d)
    dt = dtype or q.dtype
    O, lse = torch.empty(N, v.shape[1], dtype=dt), torch.empty(N, dtype=dt)
    for i in range(0, N, Br):
        Qi = q[i:i + Br]
        br = Qi.shape[0]
        m, l = torch.full((br,), NEG_INF, dtype=dt), torch.zeros(br, dtype=dt)
        acc = torch.zeros(br, v.shape[1], dtype=dt)
        for j in range(0, k.shape[0], Bc):
            S = Qi @ k[j:j + Bc].T * scale                       # [br, bc]
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            l_new = alpha * l + P.sum(1)
            if normalise_every_step:                             # V1's O, divided at every KV block
                acc = ((alpha * l)[:, None] * acc + P @ v[j:j + Bc]) / l_new[:, None]
            else:
                acc = alpha[:, None] * acc + P @ v[j:j + Bc]
            m, l = m_new, l_new
        O[i:i + Br] = acc if normalise_every_step else acc / l[:, None]
        lse[i:i + Br] = m + torch.log(l)
    return O, lse


def v2_divides_every_step(q, k, v, Br=4, Bc=3):
    return _v2_loop(q, k, v, Br, Bc, normalise_every_step=True)


def v2_reciprocal_every_step(q, k, v, Br=4, Bc=3):
    N, d = q.shape
    O, lse = torch.empty(N, d), torch.empty(N)
    for i in range(0, N, Br):
        Qi = q[i:i + Br]
        br = Qi.shape[0]
        m, l, o = torch.full((br,), NEG_INF), torch.zeros(br), torch.zeros(br, d)
        for j in range(0, k.shape[0], Bc):
            S = Qi @ k[j:j + Bc].T / math.sqrt(d)
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            l_new = alpha * l + P.sum(1)
            inv = 1 / l_new                                      # a division per row, every KV block
            o = (alpha * l * inv)[:, None] * o + inv[:, None] * (P @ v[j:j + Bc])
            m, l = m_new, l_new
        O[i:i + Br], lse[i:i + Br] = o, m + torch.log(l)
    return O, lse


def v2_scores_in_numpy(q, k, v, Br=4, Bc=3):
    S = q.double().numpy() @ k.double().numpy().T / math.sqrt(q.shape[1])     # [N, Nk] in numpy
    m = S.max(1)
    lse = np.log(np.exp(S - m[:, None]).sum(1)) + m
    return torch.from_numpy(np.exp(S - lse[:, None]) @ v.double().numpy()).float(), torch.from_numpy(lse).float()


def v1_scores_in_numpy(q, k, v, Br=4, Bc=3):
    return v2_scores_in_numpy(q, k, v)[0]


def v1_wrong_order_on_copies(q, k, v, Br=4, Bc=3):
    """V2's loop order on float64 copies: k and v are read once per Q block, not once."""
    q, k, v = q.double(), k.double(), v.double()
    return _v2_loop(q, k, v, Br, Bc, normalise_every_step=True)[0].float()


def v2_einsum(q, k, v, Br=4, Bc=3):               # correct, another way: einsum and float64 tiles
    N, d = q.shape
    O, lse = torch.empty(N, d), torch.empty(N)
    for i in range(0, N, Br):
        Qi = q[i:i + Br].double()                  # a load of one Q tile (a copy of a piece is a load)
        m = torch.full((Qi.shape[0],), NEG_INF, dtype=torch.float64)
        l = torch.zeros(Qi.shape[0], dtype=torch.float64)
        acc = torch.zeros(Qi.shape[0], d, dtype=torch.float64)
        for j in range(0, k.shape[0], Bc):
            S = torch.einsum("id,jd->ij", Qi, k[j:j + Bc].double()) / math.sqrt(d)
            m_new = torch.maximum(m, S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + P.sum(1)
            acc = alpha[:, None] * acc + torch.einsum("ij,jd->id", P, v[j:j + Bc].double())
            m = m_new
        O[i:i + Br] = (acc / l[:, None]).float()
        lse[i:i + Br] = (m + torch.log(l)).float()
    return O, lse


def test_v2_divides_every_step():
    rejects(check.flash_attn_v2, v2_divides_every_step, "divided", "divide once (metered)", "V1's update",
            "once after it")


def test_v2_reciprocal_every_step():
    rejects(check.flash_attn_v2, v2_reciprocal_every_step, "divided", "divides each row of O once", "V1's update")


def test_v2_scores_in_numpy():
    rejects(check.flash_attn_v2, v2_scores_in_numpy, "shape [32, 40] (np.matmul)", "whole N x Nk score matrix")


def test_v1_scores_in_numpy():
    rejects(check.flash_attn_v1, v1_scores_in_numpy, "shape [32, 40] (np.matmul)", "whole N x Nk score matrix")


def test_v1_wrong_loop_order_on_float64_copies():
    rejects(check.flash_attn_v1, v1_wrong_order_on_copies, "`k` was read 4 times", "k.double() still counts",
            "V1 puts the KV loop outside")


def test_v2_einsum_and_float64_tiles_pass():
    check.flash_attn_v2(v2_einsum)


# ------------------------------------------------------------------ 04 / 05: causal and masked tiles
def _tiled(q, k, v, Br, Bc, visible, *, compute, products):
    """V2 loop; ``visible(i0, j0, br, bc)`` -> bool [br, bc]; ``compute(tile_vis)`` says whether a tile is
    computed; ``products``: scores and P V as elementwise products and sums instead of @."""
    N, d = q.shape
    Nk = k.shape[0]
    O, lse = torch.empty(N, v.shape[1]), torch.empty(N)
    for i0 in range(0, N, Br):
        Qi = q[i0:i0 + Br]
        br = Qi.shape[0]
        m, l, acc = torch.full((br,), NEG_INF), torch.zeros(br), torch.zeros(br, v.shape[1])
        for j0 in range(0, Nk, Bc):
            Kj, Vj = k[j0:j0 + Bc], v[j0:j0 + Bc]
            vis = visible(i0, j0, br, Kj.shape[0])                       # [br, bc] bool
            if not compute(vis):
                continue
            if products:
                S = (Qi[:, None, :] * Kj[None, :, :]).sum(-1) / math.sqrt(d)   # [br, bc, d] -> [br, bc]
            else:
                S = torch.einsum("id,jd->ij", Qi, Kj) / math.sqrt(d)
            if not vis.all():                                            # only tiles with a hidden score
                S = S.masked_fill(~vis, NEG_INF)
            m_new = torch.maximum(m, S.amax(1))
            m_safe = torch.where(m_new == NEG_INF, 0.0, m_new)
            P = torch.exp(S - m_safe[:, None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + P.sum(1)
            pv = (P[:, :, None] * Vj[None]).sum(1) if products else torch.einsum("ij,jd->id", P, Vj)
            acc = alpha[:, None] * acc + pv
            m = m_new
        l_safe = torch.where(l == 0, 1.0, l)
        O[i0:i0 + br] = acc / l_safe[:, None]
        lse[i0:i0 + br] = torch.where(l == 0, NEG_INF, m + torch.log(l_safe))
    return O, lse


def _causal(products, every_tile):
    def flash_attn_causal(q, k, v, Br=4, Bc=3, align="top_left"):
        N, Nk = q.shape[0], k.shape[0]
        off = 0 if align == "top_left" else Nk - N

        def visible(i0, j0, br, bc):
            return torch.arange(j0, j0 + bc)[None, :] <= torch.arange(i0, i0 + br)[:, None] + off
        return _tiled(q, k, v, Br, Bc, visible, products=products,
                      compute=(lambda t: True) if every_tile else (lambda t: bool(t.any())))
    return flash_attn_causal


def _masked(products, every_tile):
    def flash_attn_masked(q, k, v, mask, Br=4, Bc=3):
        def visible(i0, j0, br, bc):
            return mask[i0:i0 + br, j0:j0 + bc]
        return _tiled(q, k, v, Br, Bc, visible, products=products,
                      compute=(lambda t: True) if every_tile else (lambda t: bool(t.any())))
    return flash_attn_masked


def test_causal_every_tile_by_elementwise_products():
    msg = rejects(check.flash_attn_causal, _causal(products=True, every_tile=True), "elementwise",
                  "0 in matmuls", "entirely above the diagonal", "the work done (metered)")
    assert "full tile" not in msg            # it masks only tiles with a hidden score: the FLOPs catch it


def test_masked_every_tile_by_elementwise_products():
    rejects(check.flash_attn_masked, _masked(products=True, every_tile=True), "elementwise", "0 in matmuls",
            "no key is visible")


@pytest.mark.parametrize("products", [False, True], ids=["einsum", "elementwise products"])
def test_causal_skipping_written_another_way_passes(products):
    check.flash_attn_causal(_causal(products=products, every_tile=False))


@pytest.mark.parametrize("products", [False, True], ids=["einsum", "elementwise products"])
def test_masked_skipping_written_another_way_passes(products):
    check.flash_attn_masked(_masked(products=products, every_tile=False))


def test_causal_every_tile_by_einsum():
    rejects(check.flash_attn_causal, _causal(products=False, every_tile=True), "matmul FLOPs",
            "entirely above the diagonal")


# ------------------------------------------------------------------ 06: the paged cache, split over pages
def _paged_token_split(ns06):
    partial_attention, combine_splits = ns06["partial_attention"], ns06["combine_splits"]

    def flash_decode_paged(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        H, d = q.shape
        _, ps, Hkv, _ = k_pages.shape
        chunk = max(1, math.ceil(seqlen / num_splits))                 # tokens per split: boundaries mid-page
        o_parts, lse_parts = torch.zeros(num_splits, H, d), torch.full((num_splits, H), NEG_INF)
        for s in range(num_splits):
            t, t1 = min(s * chunk, seqlen), min((s + 1) * chunk, seqlen)
            ks, vs = [], []
            while t < t1:
                p, off = divmod(t, ps)
                n = min(ps - off, t1 - t)
                phys = int(block_table[p])
                ks.append(k_pages[phys, off:off + n])
                vs.append(v_pages[phys, off:off + n])
                t += n
            if not ks:
                continue
            o_s, lse_s = partial_attention(q.reshape(Hkv, H // Hkv, d), torch.cat(ks).transpose(0, 1),
                                           torch.cat(vs).transpose(0, 1), 1.0 / math.sqrt(d))
            o_parts[s], lse_parts[s] = o_s.reshape(H, d), lse_s.reshape(H)
        return combine_splits(o_parts, lse_parts)
    return flash_decode_paged


def _paged_per_head(ns06):                        # correct, another way: pages split, each page read per KV head
    partial_attention, combine_splits = ns06["partial_attention"], ns06["combine_splits"]

    def flash_decode_paged(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        H, d = q.shape
        _, ps, Hkv, _ = k_pages.shape
        G = H // Hkv
        n_pages = math.ceil(seqlen / ps)
        per_split = max(1, math.ceil(n_pages / num_splits))
        o_parts, lse_parts = torch.zeros(num_splits, H, d), torch.full((num_splits, H), NEG_INF)
        for s in range(num_splits):
            pages = range(min(s * per_split, n_pages), min((s + 1) * per_split, n_pages))
            if not pages:
                continue
            for h in range(Hkv):
                ks = [k_pages[int(block_table[p]), :min(ps, seqlen - p * ps), h] for p in pages]   # [n, d] each
                vs = [v_pages[int(block_table[p]), :min(ps, seqlen - p * ps), h] for p in pages]
                o_s, lse_s = partial_attention(q[h * G:(h + 1) * G], torch.cat(ks), torch.cat(vs), 1 / math.sqrt(d))
                o_parts[s, h * G:(h + 1) * G], lse_parts[s, h * G:(h + 1) * G] = o_s, lse_s
        return combine_splits(o_parts, lse_parts)
    return flash_decode_paged


def test_paged_split_over_tokens(ns06):
    rejects(check.flash_decode_paged, _paged_token_split(ns06), "inside a page", "split over tokens",
            "ceil(n_pages / num_splits) pages per split")


def test_paged_split_over_pages_read_per_head_passes(ns06):
    check.flash_decode_paged(_paged_per_head(ns06))


# ------------------------------------------------------------------ 07: attn_inner without a safe max
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def inner_no_safe_max(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, hi, offs_m, offs_n, qk_scale, Nk,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=cols[:, None] < Nk, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])              # no safe max: -inf - (-inf) for a row with no key yet
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i


def test_triton_inner_without_safe_max():
    ns = notebook_namespace("07_triton_gpu")
    ns["attn_inner"] = inner_no_safe_max
    msg = rejects(check.flash_attn_triton, ns["flash_attn_triton"], "a row that has seen no key yet", "NaN",
                  'check.hint("flash_attn_triton")')
    assert "m_safe = tl.where" not in msg                     # the exact line only when asked


def test_triton_worked_inner_passes_the_safe_max_case(capsys):
    ns = notebook_namespace("07_triton_gpu")
    check.flash_attn_triton(ns["flash_attn_triton"])
    assert "not checked" not in capsys.readouterr().out


# ------------------------------------------------------------------ more correct answers written another way
def v1_on_float64_copies(q, k, v, Br=4, Bc=3):    # V1's order on whole float64 copies: still k, v read once
    q, k, v = q.double(), k.double(), v.double()
    N, d = q.shape
    O, l, m = torch.zeros(N, d, dtype=q.dtype), torch.zeros(N, dtype=q.dtype), torch.full((N,), NEG_INF, dtype=q.dtype)
    for j in range(0, k.shape[0], Bc):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]
        for i in range(0, N, Br):
            S = q[i:i + Br] @ Kj.T / math.sqrt(d)
            m_new = torch.maximum(m[i:i + Br], S.amax(1))
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m[i:i + Br] - m_new)
            l_new = alpha * l[i:i + Br] + P.sum(1)
            O[i:i + Br] = ((alpha * l[i:i + Br])[:, None] * O[i:i + Br] + P @ Vj) / l_new[:, None]
            l[i:i + Br], m[i:i + Br] = l_new, m_new
    return O.float()


def v2_in_numpy_tiles(q, k, v, Br=4, Bc=3):       # V2 in numpy, one tile at a time
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    N, d = qn.shape
    O, lse = np.empty((N, d), dtype=np.float32), np.empty(N, dtype=np.float32)
    for i in range(0, N, Br):
        Qi = qn[i:i + Br]
        m, l = np.full(Qi.shape[0], NEG_INF, dtype=np.float32), np.zeros(Qi.shape[0], dtype=np.float32)
        acc = np.zeros((Qi.shape[0], d), dtype=np.float32)
        for j in range(0, kn.shape[0], Bc):
            S = Qi @ kn[j:j + Bc].T / np.float32(math.sqrt(d))
            m_new = np.maximum(m, S.max(1))
            P = np.exp(S - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = alpha * l + P.sum(1)
            acc = alpha[:, None] * acc + P @ vn[j:j + Bc]
            m = m_new
        O[i:i + Br] = acc / l[:, None]
        lse[i:i + Br] = m + np.log(l)
    return torch.from_numpy(O), torch.from_numpy(lse)


def test_v1_on_float64_copies_in_v1_order_passes():
    check.flash_attn_v1(v1_on_float64_copies)


def test_v2_in_numpy_tiles_passes():
    check.flash_attn_v2(v2_in_numpy_tiles)
