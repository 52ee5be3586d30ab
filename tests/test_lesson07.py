"""Lesson 07 (the Triton port): checkers, planted bugs, and the plain functions behind the pictures.

Runs under the Triton interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton). Each planted bug is a variant of the notebook's own Triton code,
swapped into a fresh copy of the notebook's namespace: the outer kernel looks ``attn_inner`` /
``decode_combine`` up by name when it runs.
"""
from __future__ import annotations

import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import triton  # noqa: E402 - after conftest set TRITON_INTERPRET
import triton.language as tl  # noqa: E402

from helpers import check, lesson07, reference  # noqa: E402
from helpers.cases import jit_with_globals  # noqa: E402
from tests.conftest import notebook_namespace, rejects  # noqa: E402

NB = "07_triton_gpu"


def _ns(**swap):
    ns = notebook_namespace(NB)
    ns.update(swap)
    return ns


# ------------------------------------------------------------------ the solution, the stub
# ------------------------------------------------------------------ planted bugs: the inner loop
# One inner loop; BUG (a tl.constexpr) plants one mistake at a time. `inner_with(bug)` binds it and has the
# notebook's signature, so it can be swapped in for the notebook's attn_inner.
OK = tl.constexpr(0)
NO_ALPHA = tl.constexpr(1)          # acc not rescaled by alpha
EXP = tl.constexpr(2)               # tl.exp with the log2(e)-folded scale
NO_LOAD_MASK = tl.constexpr(3)      # no mask on the ragged last tile's loads (reads past Nk)
NO_SCORE_MASK = tl.constexpr(4)     # loads masked, but the padding keeps its score (0, not -inf)
CAUSAL_OFF_BY_ONE = tl.constexpr(5)  # causal mask j < i: the diagonal hidden


@triton.jit
def planted_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, hi, offs_m, offs_n, qk_scale, Nk,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BUG: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                   # [BLOCK_N]
        if BUG == NO_LOAD_MASK:
            k = tl.load(k_ptrs + start_n * stride_kn)                             # [BLOCK_N, D]
            v = tl.load(v_ptrs + start_n * stride_vn)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=cols[:, None] < Nk, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale                                    # [BLOCK_M, BLOCK_N]
        if BUG == NO_LOAD_MASK or BUG == NO_SCORE_MASK:
            keep = cols[None, :] >= 0                                             # every key kept
        else:
            keep = cols[None, :] < Nk
        if CAUSAL:
            if BUG == CAUSAL_OFF_BY_ONE:
                keep = keep & (cols[None, :] < offs_m[:, None])
            else:
                keep = keep & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(keep, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))                                     # [BLOCK_M]
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        if BUG == EXP:
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
        else:
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if BUG == NO_ALPHA:
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i


def _with_bug(template, bug):
    """``template`` jitted with its global ``BUG`` bound to ``bug`` (a fresh globals dict: the Triton
    interpreter and compiler both read a kernel's globals, not a closure)."""
    return jit_with_globals(template, BUG=tl.constexpr(bug))


def _attn_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, hi, offs_m, offs_n, qk_scale, Nk,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    return planted_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, hi, offs_m, offs_n,
                         qk_scale, Nk, BLOCK_N, MASKED, CAUSAL, BUG)  # noqa: F821 - bound by _with_bug


def inner_with(bug):
    """The notebook's attn_inner (same signature) with one planted bug (a BUG value above)."""
    return _with_bug(_attn_inner, bug)


@triton.jit
def inner_other_way(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, hi, offs_m, offs_n, qk_scale, Nk,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    # correct, written another way: always masked, max taken on raw scores, scale applied inside exp2,
    # acc rescaled and P @ V added as two steps
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        ok = cols < Nk
        k = tl.load(k_ptrs + start_n * stride_kn, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        vis = ok[None, :] & ((cols[None, :] <= offs_m[:, None]) | (not CAUSAL))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.where(vis, tl.math.exp2(s * qk_scale - m_use[:, None]), 0.0)
        scale_old = tl.where(m_i > float("-inf"), tl.math.exp2(m_i - m_use), 0.0)
        l_i = l_i * scale_old + tl.sum(p, 1)
        acc = acc * scale_old[:, None]
        acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


def test_planted_switch_off_passes(capsys, strict):
    check.flash_attn_triton(_ns(attn_inner=inner_with(OK))["flash_attn_triton"])
    assert "✅" in capsys.readouterr().out


def test_bug_no_alpha_rescale():
    ns = _ns(attn_inner=inner_with(NO_ALPHA))
    rejects(check.flash_attn_triton, ns["flash_attn_triton"], "acc was not rescaled", "alpha")


def test_bug_exp_with_folded_scale():
    ns = _ns(attn_inner=inner_with(EXP))
    rejects(check.flash_attn_triton, ns["flash_attn_triton"], "tl.exp with qk_scale", "exp2")


def test_bug_exp2_without_folding():
    ns = _ns(LOG2E=1.0)   # the launcher's qk_scale = sm_scale * LOG2E becomes sm_scale alone
    rejects(check.flash_attn_triton, ns["flash_attn_triton"], "without log2(e) folded")


def test_bug_missing_mask_reads_past_n():
    ns = _ns(attn_inner=inner_with(NO_LOAD_MASK))
    msg = rejects(check.flash_attn_triton, ns["flash_attn_triton"], "NaN past Nk", "read past the end")
    assert "mask=cols[:, None] < Nk" in msg


def test_bug_padding_scored_as_keys():
    ns = _ns(attn_inner=inner_with(NO_SCORE_MASK))
    rejects(check.flash_attn_triton, ns["flash_attn_triton"], "padding was scored", "-inf")


def test_bug_causal_off_by_one_is_named():
    ns = _ns(attn_inner=inner_with(CAUSAL_OFF_BY_ONE))
    msg = rejects(check.flash_attn_triton, ns["flash_attn_triton"], "causal mask is off by one", "j <= i")
    assert "over the bound" not in msg


def test_forward_another_correct_way(capsys, strict):
    check.flash_attn_triton(_ns(attn_inner=inner_other_way)["flash_attn_triton"])
    assert "✅" in capsys.readouterr().out


def test_forward_computed_with_torch_is_rejected():
    def torch_attention(q, k, v, causal=False, sm_scale=None):
        o, lse = lesson07.reference_bhnd(q, k, v, causal, sm_scale)
        return o.to(q.dtype), lse.float()
    rejects(check.flash_attn_triton, torch_attention, "torch ops on the host", "inside the Triton kernel")


def test_forward_on_the_host_with_in_place_ops_is_rejected():
    """Host-side attention without a matmul op or an op of the old list: mul and sum, amax, exp_, cumsum."""
    def host_attention(q, k, v, causal=False, sm_scale=None):
        sm_scale = sm_scale or q.shape[-1] ** -0.5
        s = (q.float()[..., :, None, :] * k.float()[..., None, :, :]).sum(-1) * sm_scale   # [B, H, N, Nk]
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = (s - m).exp_()
        l = p.cumsum(-1)[..., -1:]
        o = (p[..., None] * v.float()[..., None, :, :]).sum(-2) / l
        return o.to(q.dtype), (m + l.log())[..., 0]
    rejects(check.flash_attn_triton, host_attention, "torch ops on the host", "aten.amax", "aten.exp")


# ------------------------------------------------------------------ planted bugs: the combine
MEAN = tl.constexpr(1)              # a plain mean of the splits
NO_MAX = tl.constexpr(2)            # exp(lse_s) with no max subtracted: overflows


@triton.jit
def planted_combine(O_part, LSE_part, O, num_splits, BLOCK_S: tl.constexpr, D: tl.constexpr, BUG: tl.constexpr):
    off_bh = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LSE_part + off_bh * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    o_s = tl.load(O_part + (off_bh * num_splits + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    if BUG == MEAN:
        o = tl.sum(o_s, 0) / num_splits
    else:
        if BUG == NO_MAX:
            lse_max = 0.0
        else:
            lse_max = tl.max(lse_s, 0)
            lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        w = tl.exp(lse_s - lse_max)
        o = tl.sum(w[:, None] * o_s, 0) / tl.sum(w, 0)
    tl.store(O + off_bh * D + offs_d, o.to(O.dtype.element_ty))


def _decode_combine(O_part, LSE_part, O, num_splits, BLOCK_S: tl.constexpr, D: tl.constexpr):
    planted_combine(O_part, LSE_part, O, num_splits, BLOCK_S, D, BUG)  # noqa: F821 - bound by _with_bug


def combine_with(bug):
    """The notebook's decode_combine (same signature) with one planted bug."""
    return _with_bug(_decode_combine, bug)


@triton.jit
def combine_other_way(O_part, LSE_part, O, num_splits, BLOCK_S: tl.constexpr, D: tl.constexpr):
    # correct, written another way: the total lse first, then weights exp(lse_s - lse) that sum to 1
    off_bh = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LSE_part + off_bh * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    o_s = tl.load(O_part + (off_bh * num_splits + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    mx = tl.max(lse_s, 0)
    lse = mx + tl.log(tl.sum(tl.exp(lse_s - mx), 0))
    w = tl.exp(lse_s - lse)
    tl.store(O + off_bh * D + offs_d, tl.sum(w[:, None] * o_s, 0).to(O.dtype.element_ty))


def test_bug_combine_plain_mean():
    ns = _ns(decode_combine=combine_with(MEAN))
    rejects(check.flash_decode_triton, ns["flash_decode_triton"], "plain mean", "exp(lse_s - lse)")


def test_bug_combine_without_max():
    ns = _ns(decode_combine=combine_with(NO_MAX))
    rejects(check.flash_decode_triton, ns["flash_decode_triton"], "large logits", "overflowed")


def test_decode_another_correct_way(capsys, strict):
    check.flash_decode_triton(_ns(decode_combine=combine_other_way)["flash_decode_triton"])
    assert "✅" in capsys.readouterr().out


def test_decode_combined_with_torch_is_rejected():
    def torch_decode(q, k, v, num_splits=None):
        return lesson07.reference_decode(q, k, v).to(q.dtype)
    rejects(check.flash_decode_triton, torch_decode, "torch ops on the host")


def test_notebook_v0_matches_reference():
    ns = _ns()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 16, generator=g) for n in (23, 30, 30))
    for causal in (False, True):
        o, lse = ns["attn_v0"](q, k, v, BLOCK_M=8, BLOCK_N=7, causal=causal)
        o_ref, lse_ref = reference.attention(q, k, v, mask=reference.causal_mask(23, 30) if causal else None)
        assert torch.allclose(o.double(), o_ref, atol=1e-5) and torch.allclose(lse.double(), lse_ref, atol=1e-5)


# ------------------------------------------------------------------ plain functions
def _brute_classes(N, Nk, BM, BN, causal):
    out = torch.zeros(-(-N // BM), -(-Nk // BN), dtype=torch.int64)
    for i in range(out.shape[0]):
        rows = range(i * BM, min(i * BM + BM, N))
        for j in range(out.shape[1]):
            cols = range(j * BN, min(j * BN + BN, Nk))
            seen = [[(c <= r) or not causal for c in cols] for r in rows]
            whole = len(cols) == BN and all(all(s) for s in seen)
            out[i, j] = 1 if whole else 2 if any(any(s) for s in seen) else 0
    return out


@pytest.mark.parametrize("N,Nk,BM,BN,causal", [(64, 64, 16, 16, True), (70, 45, 32, 16, True),
                                               (20, 90, 16, 32, True), (33, 33, 16, 16, False), (5, 5, 16, 16, True)])
def test_tile_classes_match_brute_force(N, Nk, BM, BN, causal):
    got = lesson07.tile_classes(N, Nk, BM, BN, causal)
    want = _brute_classes(N, Nk, BM, BN, causal)
    # the kernel may mask a tile a brute force would call whole (harmless), never skip a visible one
    assert ((want > 0) <= (got > 0)).all() and ((got == 1) <= (want == 1)).all()
    assert ((got == 0) == (want == 0)).all()


def test_plot_tile_classes():
    ax = lesson07.plot_tile_classes(N=100, Nk=80, BLOCK_M=32, BLOCK_N=16, causal=True)
    assert "BLOCK_M=32" in ax.get_title()


def test_split_bounds():
    assert lesson07.split_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert lesson07.split_bounds(5, 8)[-1] == (5, 5)          # empty split
    b = lesson07.split_bounds(37, 5)
    assert b[0][0] == 0 and b[-1][1] == 37 and all(x[1] == y[0] for x, y in zip(b, b[1:]))


def test_reference_decode_gqa():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    o = lesson07.reference_decode(q, k, v)
    want, _ = reference.attention(q[1, 3][None], k[1, 1], v[1, 1])   # head 3 reads KV head 3 // 2 = 1
    assert torch.allclose(o[1, 3], want[0])


SYNTH = {"gpu": "TestGPU", "torch": "9.9", "triton": "9.9", "date": "2000-01-01",
         "prefill": [{"dtype": "float16", "d": 64, "causal": c, "N": n, "B": 16384 // n, "H": 16,
                      "triton_tflops": 400.0 + n / 100, "sdpa_flash_tflops": 300.0, "sdpa_cudnn_tflops": 450.0,
                      "sdpa_efficient_tflops": None}
                     for c in (False, True) for n in (1024, 2048, 4096)],
         "decode": [{"dtype": "bfloat16", "B": 8, "H": h, "Hkv": 8, "Nk": nk, "d": 128, "num_splits": 4,
                     "triton_gbs": 3000.0, "sdpa_flash_gbs": 2500.0, "sdpa_cudnn_gbs": 3500.0}
                    for h in (8, 32) for nk in (4096, 65536)]}


def test_results_tables_and_ratios():
    assert lesson07.results_label(SYNTH).startswith("TestGPU · torch 9.9")
    t = lesson07.prefill_table(SYNTH)
    assert "1024" in t and "—" in t                       # the efficient backend is missing: a dash
    d = lesson07.decode_table(SYNTH)
    assert "65536" in d and "0.86" in d                   # 3000 / 3500
    r = lesson07.geomean_ratio(SYNTH, "sdpa_flash_tflops", causal=False)
    assert r == pytest.approx(math.sqrt((420.48 / 300) * (440.96 / 300)))
    assert lesson07.geomean_ratio(SYNTH, "sdpa_efficient_tflops") is None


def test_results_plots():
    fig = lesson07.plot_prefill(SYNTH, ceilings={"tflops": 800})
    assert "TestGPU" in fig._suptitle.get_text()
    fig = lesson07.plot_decode(SYNTH, ceilings={"gbs": 4000})
    assert len(fig.axes) == 2 and fig.axes[0].lines and fig.axes[1].lines


def test_load_results_missing(tmp_path):
    assert lesson07.load_results(tmp_path / "nope.json") is None
    p = tmp_path / "r.json"
    import json
    p.write_text(json.dumps(SYNTH))
    assert lesson07.load_results(p)["gpu"] == "TestGPU"
