"""Lesson 08 (the backward pass): every planted bug is rejected with a hint naming it, correct answers
written another way pass, and the plain functions behind the pictures and the training run work."""
from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
import torch
from conftest import rejects

from helpers import check, lesson03, lesson04, meter, reference, widgets
from helpers import lesson08 as L
from helpers.lesson08.check import bwd_cases, bwd_model, reference_grads

matplotlib.use("Agg")
NB = "08_backward_pass"
LOG2E = 1.0 / math.log(2.0)


# ------------------------------------------------------------------ one backward, with knobs for bugs
def make_bwd(bug=None):
    """flash_attn_bwd with one planted mistake (None: correct)."""
    def fn(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
        N, d = q.shape
        Nk = k.shape[0]
        scale = 1.0 / math.sqrt(d)
        if bug == "ignores_align":                  # the backward always masks top-left
            align = "top_left"
        off = lesson04.offset(N, Nk, align)
        if bug == "lse_in_place":
            lse[torch.isneginf(lse)] = 0.0          # a "fix" for empty rows, written into the caller's lse
        if bug == "q_in_place":
            q *= scale
        D = (do * o).sum(1) if bug != "D_diag" else torch.diag(do @ o.T)   # D_diag: an N x N matrix for N numbers
        if bug == "strip":                          # Br ignored: every query row against a KV block
            return L.flash_attn_bwd_ref(q, k, v, o, lse, do, N, Bc, causal, align)
        if bug == "full_P":                         # right numbers, from the whole P
            S = q @ k.T * (1.0 if bug == "q_in_place" else scale)
            vis = reference.causal_mask(N, Nk, align) if causal else torch.ones(N, Nk, dtype=torch.bool)
            P = torch.where(vis, torch.exp(S - lse[:, None]), 0.0)
            dS = P * (do @ v.T - D[:, None])
            return dS @ k * scale, dS.T @ q * scale, P.T @ do
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j in range(0, Nk, Bc):
            Kj, Vj = k[j:j + Bc], v[j:j + Bc]
            dKj, dVj = torch.zeros_like(Kj), torch.zeros_like(Vj)
            for i in range(0, N, Br):
                cls = lesson04.tile_class(i, j, Br, Bc, N, Nk, align) if causal else "full"
                if cls == "skip" and bug not in ("all_tiles", "skip_times_zero"):
                    continue
                if bug == "reslice_k":
                    Kj, Vj = k[j:j + Bc], v[j:j + Bc]
                Qi, dOi, lse_i = q[i:i + Br], do[i:i + Br], lse[i:i + Br]
                D_i = (dOi * o[i:i + Br]).sum(1) if bug == "D_per_tile" else D[i:i + Br]
                if bug == "D_mean":                 # the same D per tile, without a sum
                    D_i = (dOi * o[i:i + Br]).mean(1) * d
                elif bug == "D_einsum":
                    D_i = torch.einsum("nd,nd->n", dOi, o[i:i + Br])
                if bug == "not_implemented" and N == 32 and Nk == 40:
                    raise NotImplementedError("the larger inputs: not written yet")
                if cls == "skip" or bug == "broadcast":   # "skip_times_zero": an invisible tile, elementwise, x 0
                    S = (Qi[:, None, :] * Kj[None, :, :]).sum(-1) * scale
                    seen = torch.arange(j, j + Kj.shape[0])[None, :] <= torch.arange(i, i + Qi.shape[0])[:, None] + off
                    P = S * 0.0 if cls == "skip" else torch.where(seen | (not causal), torch.exp(S - lse_i[:, None]), 0.0)
                    dS = P * ((dOi[:, None, :] * Vj[None, :, :]).sum(-1) - D_i[:, None])
                    dq[i:i + Br] += (dS[:, :, None] * Kj[None]).sum(1) * scale
                    dKj += (dS[:, :, None] * Qi[:, None]).sum(0) * scale
                    dVj += (P[:, :, None] * dOi[:, None]).sum(0)
                    continue
                if bug == "elementwise":            # every product a column at a time, * and sum: no matmul
                    def mm(a, b):                   # a [m, c] @ b [c, n], one output column at a time
                        return torch.stack([(a * b[:, c]).sum(1) for c in range(b.shape[1])], 1)
                    S = mm(Qi, Kj.T) * scale
                    mask = torch.arange(j, j + Kj.shape[0])[None, :] <= torch.arange(i, i + Qi.shape[0])[:, None] + off
                    P = torch.where(mask | (not causal), torch.exp(S - lse_i[:, None]), 0.0)
                    dS = P * (mm(dOi, Vj.T) - D_i[:, None])
                    dq[i:i + Br] += mm(dS, Kj) * scale
                    dKj += mm(dS.T, Qi) * scale
                    dVj += mm(P.T, dOi)
                    continue
                S = Qi @ Kj.T * (1.0 if bug == "q_in_place" else scale)
                mask = (torch.arange(j, j + Kj.shape[0])[None, :] <= torch.arange(i, i + Qi.shape[0])[:, None] + off)
                if not causal:
                    mask = torch.ones_like(mask)
                if bug == "nan_empty":
                    P = torch.exp(S.masked_fill(~mask, -math.inf) - lse_i[:, None])
                elif bug in ("tile_max", "tile_softmax"):
                    Sm = S.masked_fill(~mask, -math.inf)
                    P = torch.exp(Sm - Sm.amax(1, keepdim=True)).nan_to_num(0.0)
                    if bug == "tile_softmax":
                        P = P / P.sum(1, keepdim=True)
                elif bug == "max_in_loop":          # right numbers, through a max
                    m = S.amax(1, keepdim=True)
                    P = torch.where(mask, torch.exp(S - m) * torch.exp(m - lse_i[:, None]), 0.0)
                elif bug == "no_mask":
                    P = torch.exp(S - lse_i[:, None])
                else:
                    P = torch.where(mask, torch.exp(S - lse_i[:, None]), 0.0)
                dP = dOi @ Vj.T
                dS = P * dP if bug == "no_D" else P * (dP - D_i[:, None])
                if bug == "D_tile":
                    dS = P * (dP - (P * dP).sum(1, keepdim=True))
                dq_tile = dS @ Kj * (1.0 if bug == "dq_no_scale" else scale)
                if bug == "autograd_tile":          # dQ and dK of the tile by autograd through S = Qi @ Kj.T
                    Qg, Kg = Qi.detach().requires_grad_(), Kj.detach().requires_grad_()
                    with torch.enable_grad():
                        dq_tile, dk_auto = torch.autograd.grad(Qg @ Kg.T * scale, (Qg, Kg), dS)
                if bug == "dq_overwrite":
                    dq[i:i + Br] = dq_tile
                else:
                    dq[i:i + Br] += dq_tile
                dk_tile = dS.T @ Qi * (1.0 if bug == "dk_no_scale" else scale)
                if bug == "autograd_tile":
                    dk_tile = dk_auto
                dv_tile = (dS if bug == "dv_from_dS" else P).T @ dOi
                if bug == "dkv_hbm":
                    dk[j:j + Bc] += dk_tile
                    dv[j:j + Bc] += dv_tile
                elif bug == "dkv_overwrite":
                    dKj, dVj = dk_tile, dv_tile
                else:
                    dKj += dk_tile
                    dVj += dv_tile
            if bug == "dkv_add_once":               # correct: dk = zeros, one += per KV block
                dk[j:j + Bc] += dKj
                dv[j:j + Bc] += dVj
            elif bug == "dkv_index_add":            # correct: one index_add_ of the block's rows
                rows = torch.arange(j, j + Kj.shape[0])
                dk.index_add_(0, rows, dKj)
                dv.index_add_(0, rows, dVj)
            elif bug != "dkv_hbm":
                dk[j:j + Bc], dv[j:j + Bc] = dKj, dVj
        return dq, dk, dv
    fn.__name__ = f"flash_attn_bwd_{bug}"
    return fn


def bwd_exp2_lists(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
    """Correct, another way: exp2 with log2(e) folded into the scale, the tile classes from a table,
    empty rows made safe by an lse of +inf, dK and dV collected in lists and concatenated once."""
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    qk_scale = scale * LOG2E
    cls = lesson04.tile_classes(N, Nk, Br, Bc, align) if causal else None
    lse2 = torch.where(torch.isneginf(lse), math.inf, lse) * LOG2E      # base 2; +inf makes P = 0
    D = torch.einsum("nd,nd->n", o, do)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for bj, (Kj, Vj) in enumerate(zip(k.split(Bc), v.split(Bc))):
        j = bj * Bc
        dKj, dVj = torch.zeros_like(Kj), torch.zeros_like(Vj)
        for bi, i in enumerate(range(0, N, Br)):
            c = lesson04.FULL if cls is None else int(cls[bi, bj])
            if c == lesson04.SKIP:
                continue
            Qi, dOi = q[i:i + Br], do[i:i + Br]
            S2 = Qi @ Kj.T * qk_scale
            if c == lesson04.PARTIAL:
                hidden = torch.arange(j, j + Kj.shape[0])[None, :] > \
                    torch.arange(i, i + Qi.shape[0])[:, None] + lesson04.offset(N, Nk, align)
                S2 = S2.masked_fill(hidden, -math.inf)
            P = torch.exp2(S2 - lse2[i:i + Br, None])
            dVj = dVj + P.T @ dOi
            dS = P * (dOi @ Vj.T - D[i:i + Br, None])
            dq[i:i + Br] += (dS @ Kj) * scale
            dKj = dKj + (dS.T @ Qi) * scale
        dks.append(dKj)
        dvs.append(dVj)
    return dq, torch.cat(dks), torch.cat(dvs)



def bwd_tiles_kept(kept="kv"):
    """Right gradients, tile by tile, with whole inputs' worth of tiles kept alive (not SRAM):
    kept="kv": Q blocks outside, the K/V tiles and dK/dV partials kept in lists across the Q loop;
    kept="P": every P (and dS) tile kept in a dict by a first sweep and used by a second."""
    def fn(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
        N, d = q.shape
        Nk = k.shape[0]
        scale = 1.0 / math.sqrt(d)
        off = lesson04.offset(N, Nk, align)
        D = (do * o).sum(1)
        Ks, Vs = k.split(Bc), v.split(Bc)                            # every K/V tile, loaded once
        dKs, dVs = [torch.zeros_like(t) for t in Ks], [torch.zeros_like(t) for t in Vs]
        dq = torch.zeros_like(q)
        tiles = {}

        def tile(i, bj):
            Qi, dOi, Kj, Vj = q[i:i + Br], do[i:i + Br], Ks[bj], Vs[bj]
            j = bj * Bc
            mask = torch.arange(j, j + Kj.shape[0])[None, :] <= torch.arange(i, i + Qi.shape[0])[:, None] + off
            P = torch.where(mask | (not causal), torch.exp(Qi @ Kj.T * scale - lse[i:i + Br, None]), 0.0)
            return Qi, dOi, P, P * (dOi @ Vj.T - D[i:i + Br, None])
        for i in range(0, N, Br):
            dQi = torch.zeros_like(q[i:i + Br])
            for bj in range(len(Ks)):
                if causal and lesson04.tile_class(i, bj * Bc, Br, Bc, N, Nk, align) == "skip":
                    continue
                Qi, dOi, P, dS = tile(i, bj)
                if kept == "P":
                    tiles[i, bj] = (Qi, dOi, P, dS)
                    continue
                dQi += dS @ Ks[bj] * scale
                dKs[bj] += dS.T @ Qi * scale
                dVs[bj] += P.T @ dOi
            dq[i:i + Br] = dQi
        if kept == "P":                                              # the second sweep, from the kept tiles
            dq = torch.zeros_like(q)
            for (i, bj), (Qi, dOi, P, dS) in tiles.items():
                dq[i:i + Br] += dS @ Ks[bj] * scale
                dKs[bj] += dS.T @ Qi * scale
                dVs[bj] += P.T @ dOi
        return dq, torch.cat(dKs), torch.cat(dVs)
    fn.__name__ = f"flash_attn_bwd_kept_{kept}"
    return fn


def bwd_dq_kept(where, q_outer=False):
    """Right gradients with dQ accumulated outside the returned tensor: in a numpy array, a float64 copy, or a
    list of [Br, d] tiles; KV blocks outside (correct) or, with ``q_outer``, Q blocks outside and dK/dV in lists."""
    def fn(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
        N, d = q.shape
        Nk = k.shape[0]
        scale, off = 1.0 / math.sqrt(d), lesson04.offset(N, Nk, align)
        D = (do * o).sum(1)
        dq = {"numpy": lambda: np.zeros((N, d)), "float64": lambda: torch.zeros(N, d, dtype=torch.float64),
              "list": lambda: [torch.zeros(min(Br, N - i), d) for i in range(0, N, Br)]}[where]()

        def tile(i, j, Kj, Vj):
            Qi, dOi = q[i:i + Br], do[i:i + Br]
            seen = torch.arange(j, j + Kj.shape[0])[None, :] <= torch.arange(i, i + Qi.shape[0])[:, None] + off
            P = torch.where(seen | (not causal), torch.exp(Qi @ Kj.T * scale - lse[i:i + Br, None]), 0.0)
            dS = P * (dOi @ Vj.T - D[i:i + Br, None])
            dqi = dS @ Kj * scale
            if where == "numpy":
                dq[i:i + Br] += dqi.numpy()
            elif where == "float64":
                dq[i:i + Br] += dqi.double()
            else:
                dq[i // Br] = dq[i // Br] + dqi
            return dS.T @ Qi * scale, P.T @ dOi

        def skip(i, j):
            return causal and lesson04.tile_class(i, j, Br, Bc, N, Nk, align) == "skip"
        Ks, Vs = k.split(Bc), v.split(Bc)
        dKs, dVs = [torch.zeros_like(t) for t in Ks], [torch.zeros_like(t) for t in Vs]
        pairs = [(i, j) for i in range(0, N, Br) for j in range(0, Nk, Bc)] if q_outer else \
            [(i, j) for j in range(0, Nk, Bc) for i in range(0, N, Br)]
        for i, j in pairs:
            if not skip(i, j):
                dK, dV = tile(i, j, Ks[j // Bc], Vs[j // Bc])
                dKs[j // Bc] += dK
                dVs[j // Bc] += dV
        dq = torch.from_numpy(dq).to(q.dtype) if where == "numpy" else \
            dq.to(q.dtype) if where == "float64" else torch.cat(dq)
        return dq, torch.cat(dKs), torch.cat(dVs)
    fn.__name__ = f"flash_attn_bwd_dq_in_{where}{'_q_outer' if q_outer else ''}"
    return fn


def bwd_invisible_scores_elementwise(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
    """An honest mistake: every invisible tile's S computed elementwise, found all masked, then skipped."""
    N, d = q.shape
    Nk = k.shape[0]
    off = lesson04.offset(N, Nk, align)
    for j in range(0, Nk, Bc):
        for i in range(0, N, Br):
            if causal and lesson04.tile_class(i, j, Br, Bc, N, Nk, align) == "skip":
                S = (q[i:i + Br, None, :] * k[None, j:j + Bc, :]).sum(-1) / math.sqrt(d)
                seen = torch.arange(j, j + S.shape[1])[None, :] <= torch.arange(i, i + S.shape[0])[:, None] + off
                assert not seen.any()
    return L.flash_attn_bwd_ref(q, k, v, o, lse, do, Br, Bc, causal, align)


@pytest.mark.parametrize("where", ["numpy", "float64", "list"])
def test_bwd_dq_kept_anywhere_is_counted_by_the_loop_order(where, strict, capsys):
    """The loop order is read from the order the score tiles were made, not from writes into the returned dQ:
    dQ in a numpy array, a float64 copy or a list passes with KV blocks outside and is named with Q outside."""
    check.flash_attn_bwd(bwd_dq_kept(where))
    assert "✅ flash_attn_bwd" in capsys.readouterr().out
    rejects(check.flash_attn_bwd, bwd_dq_kept(where, q_outer=True), "Q block by Q block (S00, S01",
            "Q blocks were the outer loop")


def test_bwd_invisible_tiles_computed_elementwise_are_rejected():
    rejects(check.flash_attn_bwd, bwd_invisible_scores_elementwise, "tiles that see no key",
            "the invisible causal tiles were computed", "skip them before any work")


# ------------------------------------------------------------------ flash_attn_bwd
@pytest.mark.parametrize("fn", [L.flash_attn_bwd_ref, make_bwd(None), bwd_exp2_lists, make_bwd("dkv_add_once"),
                                make_bwd("dkv_index_add")])
def test_bwd_other_correct_ways_pass(fn, strict, capsys):
    """...and 08's later cells take it (checking.yours_or_reference) once its check passed, not before."""
    from helpers.checking import yours_or_reference
    ref = lambda *a: None  # noqa: E731  (a stand-in reference: fn may be the course's own)
    assert yours_or_reference(fn, ref) is ref                                           # never checked
    check.flash_attn_bwd(fn)
    out = capsys.readouterr().out
    assert "✅ flash_attn_bwd" in out and "x the forward's" in out
    assert yours_or_reference(fn, ref) is fn and "its check passed" in capsys.readouterr().out


@pytest.mark.parametrize("bug, words", [
    ("no_D", ["`dk`", "D is missing"]),
    ("D_tile", ["D was summed over one tile"]),
    ("tile_max", ["`dv`", "recomputed from the saved lse"]),
    ("tile_softmax", ["recomputed from the saved lse"]),
    ("dq_no_scale", ["`dq`", "scale is missing on dQ"]),
    ("dk_no_scale", ["`dk`", "scale is missing on dK"]),
    ("dv_from_dS", ["`dv`", "dV was built from dS"]),
    ("no_mask", ["no causal mask in the backward"]),
    ("ignores_align", ["other alignment"]),
    ("dq_overwrite", ["dQ was overwritten"]),
    ("dkv_overwrite", ["overwritten at every Q block"]),
    ("nan_empty", ["got nan", "NaN on a row that sees no key"]),
    ("lse_in_place", ["changed its input `lse` in place"]),
    ("q_in_place", ["changed its input `q` in place"]),
    ("full_P", ["[32, 40]", "full P", "never stored"]),
    ("dkv_hbm", ["dK went to HBM 4 times its size", "dK/dV accumulated in HBM per tile"]),
    ("reslice_k", ["k was read 4 times", "once per outer step"]),
    ("all_tiles", ["tiles that see no key (S02", "invisible causal tiles were computed"]),
    ("D_per_tile", ["o was read 6 times", "D = rowsum(dO * O) is computed once"]),
    ("D_mean", ["o was read 6 times", "D = rowsum(dO * O) is computed once"]),
    ("D_einsum", ["o was read 6 times", "D = rowsum(dO * O) is computed once"]),
    ("autograd_tile", ["torch.autograd.grad", "written by hand"]),
    ("D_diag", ["[32, 32]", "dO @ O.T keeps only its diagonal"]),
    ("strip", ["[32, 8]", "a strip of scores"]),
    ("skip_times_zero", ["elementwise", "invisible causal tiles were computed"]),
    ("elementwise", ["FLOPs in matmuls", "written elementwise"]),
    ("broadcast", ["[8, 8, 4]", "a broadcast product", "as matmuls"]),
    ("not_implemented", ["❌", "raised NotImplementedError when metered", "not written yet"]),
    ("max_in_loop", ["aten.amax", "recomputed from lse alone"]),
])
def test_bwd_planted_bugs_rejected(bug, words, capsys):
    from helpers.checking import yours_or_reference
    fn = make_bwd(bug)
    rejects(check.flash_attn_bwd, fn, *words)
    assert yours_or_reference(fn, L.flash_attn_bwd_ref) is L.flash_attn_bwd_ref, "checked, failed: the reference"
    assert "uses the course's reference" in capsys.readouterr().out


@pytest.mark.parametrize("kept, words", [
    ("kv", ["Q block by Q block (S00, S01, S02, S03", "Q blocks were the outer loop", "a list of tiles"]),
    ("P", ["score tiles alive at once", "stored for a second sweep"]),
])
def test_bwd_whole_inputs_of_tiles_kept_are_rejected(kept, words):
    rejects(check.flash_attn_bwd, bwd_tiles_kept(kept), *words)


def test_bwd_two_pass_is_named_as_the_deterministic_variant():
    rejects(check.flash_attn_bwd, L.flash_attn_bwd_two_pass, "deterministic two-pass", "3.5x")


def test_bwd_through_autograd_is_rejected():
    """Right gradients from autograd through SDPA: not the exercise."""
    def autograd_bwd(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            mask = reference.causal_mask(q.shape[0], k.shape[0], align) if causal else None
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out = torch.where(out.isnan(), 0.0, out)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        return dq, dk, dv
    rejects(check.flash_attn_bwd, autograd_bwd, "softmax", "autograd through SDPA or softmax")


def test_bwd_every_bug_model_differs_from_the_answer_somewhere():
    """Each bug model is wrong on some case, so a hint can never be given for a right answer."""
    bugs = ["no_D", "D_tile", "tile_max", "tile_softmax", "no_lse", "dq_no_scale", "dk_no_scale", "dv_from_dS",
            "no_mask", "other_align", "dq_last_block", "dkv_last_block"]
    cases = bwd_cases()
    for bug in bugs:
        differs = False
        for c in cases:
            right = bwd_model(*c.args, **c.kwargs)
            wrong = bwd_model(*c.args, **c.kwargs, bug=bug)
            if any(not torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True) for a, b in zip(right, wrong)):
                differs = True
                break
        assert differs, bug


def test_bwd_model_is_autograd_when_right():
    for c in bwd_cases():
        q, k, v, o, lse, do = c.args
        want = reference_grads(q, k, v, do, c.kwargs.get("causal", False), c.kwargs.get("align", "top_left"))[2:]
        got = bwd_model(*c.args, **c.kwargs)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-10), c.name


# ------------------------------------------------------------------ attn_bwd_preprocess
@pytest.mark.parametrize("fn", [
    L.attn_bwd_preprocess_ref,
    lambda o, do: torch.einsum("nd,nd->n", o, do),
    lambda o, do: (o[:, None, :] @ do[:, :, None]).reshape(-1),
])
def test_preprocess_other_correct_ways_pass(fn, strict, capsys):
    check.attn_bwd_preprocess(fn)
    assert "✅ attn_bwd_preprocess" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (lambda o, do: (o * do).sum(0), ["has shape", "which dimension you reduced over"]),
    (lambda o, do: (o * do).mean(1), ["a mean, not a sum"]),
    (lambda o, do: o.sum(1), ["rowsum(O) alone"]),
    (lambda o, do: do.sum(1), ["rowsum(dO) alone"]),
    (lambda o, do: torch.diagonal(do @ o.T).clone(), ["N x N matrix", "(do * o).sum(dim=1)"]),
    (lambda o, do: do.mul_(o).sum(1), ["changed its input `do` in place"]),
    (lambda o, do: (o * do).sum(1).double(), ["dtype"]),
])
def test_preprocess_planted_bugs_rejected(fn, words):
    rejects(check.attn_bwd_preprocess, fn, *words)


def test_preprocess_sum_over_rows_on_a_square_case_is_named():
    """On a case where N == d the shape is right: the bug model names it."""
    def sum_rows_if_square(o, do):
        return (o * do).sum(0) if o.shape[0] == o.shape[1] else (o * do).sum(1)
    rejects(check.attn_bwd_preprocess, sum_rows_if_square, "sum over the rows (dim 0)")


# ------------------------------------------------------------------ FlashAttentionFunction
def make_function(bug=None, bwd=L.flash_attn_bwd_ref):
    """An autograd Function over the course's forward, with one planted mistake."""
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal=False, Br=16, Bc=16):
            o, lse = L.flash_attn_fwd(q, k, v, Br, Bc, causal)
            ctx.causal, ctx.Br, ctx.Bc = causal, Br, Bc
            if bug == "save_P":
                P = torch.softmax(q @ k.T / math.sqrt(q.shape[1]), 1)
                ctx.save_for_backward(q, k, v, o, lse, P)
            elif bug == "ctx_P":
                ctx.save_for_backward(q, k, v, o, lse)
                ctx.P = torch.softmax(q @ k.T / math.sqrt(q.shape[1]), 1)
            elif bug == "ctx_dict":                 # P tiles kept in a dict on ctx for the backward
                ctx.save_for_backward(q, k, v, o, lse)
                S = q @ k.T / math.sqrt(q.shape[1])
                ctx.tiles = {(i, j): torch.exp(S[i:i + Br, j:j + Bc] - lse[i:i + Br, None])
                             for i in range(0, q.shape[0], Br) for j in range(0, k.shape[0], Bc)}
            elif bug == "m_and_l":
                ctx.save_for_backward(q, k, v, o, lse, torch.exp(lse))
            elif bug == "lse_log2":
                ctx.save_for_backward(q, k, v, o, lse * LOG2E)
            else:
                ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors[:5]
            if bug == "float32":
                q, k, v, o, lse, do = (t.float() for t in (q, k, v, o, lse, do))
            causal = ctx.causal and not (bug == "f64_no_causal" and q.dtype == torch.float64)
            dq, dk, dv = bwd(q, k, v, o, lse, do, ctx.Br, ctx.Bc, causal)
            if bug == "dq_dk_swapped":
                return dk, dq, dv, None, None, None
            if bug == "three":
                return dq, dk, dv
            if bug == "swapped":
                return dq, dv, dk, None, None, None
            return dq, dk, dv, None, None, None
    Fn.__name__ = f"Fn_{bug}"
    return Fn


class DenseBackward(torch.autograd.Function):
    """Right gradients, saving only q, k, v, o, lse, but through the whole P in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, Br=16, Bc=16):
        o, lse = L.flash_attn_fwd(q, k, v, Br, Bc, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        N, Nk = q.shape[0], k.shape[0]
        S = q @ k.T / math.sqrt(q.shape[1])
        if ctx.causal:
            S = S.masked_fill(~reference.causal_mask(N, Nk), -math.inf)
        P = torch.softmax(S, 1)
        dS = P * (do @ v.T - (do * o).sum(1, keepdim=True))
        return dS @ k / math.sqrt(q.shape[1]), dS.T @ q / math.sqrt(q.shape[1]), P.T @ do, None, None, None


@pytest.mark.parametrize("fn", [L.FlashAttentionRef, make_function(None), make_function(None, bwd_exp2_lists),
                                make_function(None, L.flash_attn_bwd_two_pass)])
def test_function_other_correct_ways_pass(fn, strict, capsys):
    from helpers.checking import yours_or_reference
    check.FlashAttentionFunction(fn)
    assert "✅ FlashAttentionFunction" in capsys.readouterr().out
    assert yours_or_reference(fn, None) is fn, "08's later cells take the class once its check passed"


@pytest.mark.parametrize("fn, words", [
    (make_function("save_P"), ["kept a tensor of shape [7, 11]", "not to store P"]),
    (make_function("ctx_P"), ["kept a tensor of shape [7, 11]", "not to store P"]),
    (make_function("ctx_dict"), ["ctx.tiles[(0, 0)]", "ctx.save_for_backward"]),
    (make_function("dq_dk_swapped"), ["invalid gradient", "shapes of q, k, v"]),
    (make_function("f64_no_causal"), ["wrong, not rounding", "causal=True"]),
    (make_function("m_and_l"), ["saved tensors of shapes", "replaces the row max m and sum l"]),
    (make_function("lse_log2"), ["not the natural-log lse"]),
    (make_function("swapped"), ["wrong order"]),
    (make_function("three"), ["incorrect number of gradients", "one gradient per forward input"]),
    (make_function("float32"), ["in float64 your gradients are off", "dtype=q.dtype"]),
    (make_function(None, make_bwd("no_D")), ["`dk`", "if check.flash_attn_bwd passes"]),
    (DenseBackward, ["[32, 40]", "the 32 x 40 matrix"]),
])
def test_function_planted_bugs_rejected(fn, words):
    rejects(check.FlashAttentionFunction, fn, *words)


def test_function_not_a_class_is_a_clear_error():
    rejects(check.FlashAttentionFunction, lambda q, k, v: q, "pass the class itself")


def test_function_stub_is_not_attempted(not_strict, capsys):
    class Stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal=False, Br=16, Bc=16):
            raise NotImplementedError("FlashAttentionFunction: replace this line with your code")
    check.FlashAttentionFunction(Stub)
    assert "⏳ FlashAttentionFunction not attempted yet" in capsys.readouterr().out


# ------------------------------------------------------------------ the course's functions
@pytest.mark.parametrize("N, Nk, causal, align", [(7, 11, False, "top_left"), (11, 11, True, "top_left"),
                                                  (13, 6, True, "bottom_right"), (6, 13, True, "top_left"),
                                                  (1, 9, True, "bottom_right")])
def test_reference_forward_and_backwards_match_autograd(N, Nk, causal, align):
    g = torch.Generator().manual_seed(N * 100 + Nk)
    q, k, v, do = (torch.randn(n, 5, generator=g) for n in (N, Nk, Nk, N))
    O, lse, dq, dk, dv = reference_grads(q, k, v, do, causal, align)
    o, lse_ = L.flash_attn_fwd(q, k, v, 4, 3, causal, align)
    assert torch.allclose(o.double(), O, atol=1e-5)
    assert torch.equal(torch.isneginf(lse_), torch.isneginf(lse))
    for fn in (L.flash_attn_bwd_ref, L.flash_attn_bwd_two_pass):
        got = fn(q, k, v, o, lse_, do, 4, 3, causal, align)
        for a, b in zip(got, (dq, dk, dv)):
            assert not a.isnan().any() and torch.allclose(a.double(), b, atol=1e-5)
    if not causal:
        O3, lse3 = lesson03.flash_attn_v2_ref(q, k, v, 4, 3)
        assert torch.allclose(o, O3, atol=1e-6) and torch.allclose(lse_, lse3, atol=1e-6)


def test_empty_rows_get_zero_gradients_and_no_nan():
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(n, 4, generator=g) for n in (6, 3, 3, 6))
    o, lse = L.flash_attn_fwd(q, k, v, 4, 3, causal=True, align="bottom_right")
    assert torch.isneginf(lse[:3]).all() and (o[:3] == 0).all()
    dq, dk, dv = L.flash_attn_bwd_ref(q, k, v, o, lse, do, 4, 3, causal=True, align="bottom_right")
    assert (dq[:3] == 0).all() and not any(t.isnan().any() for t in (dq, dk, dv))


def test_kv_order_changes_dq_bits_only():
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(64, 16, generator=g) for _ in range(4))
    o, lse = L.flash_attn_fwd(q, k, v, 16, 16)
    a = L.flash_attn_bwd_ref(q, k, v, o, lse, do, 16, 16)
    b = L.flash_attn_bwd_ref(q, k, v, o, lse, do, 16, 16, kv_order=[1, 3, 2, 0])
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[0], b[0]) and torch.allclose(a[0], b[0], atol=1e-6)


def test_backward_costs_as_the_lesson_says():
    g = torch.Generator().manual_seed(4)
    N, Nk, d, B = 64, 48, 8, 16
    q, k, v, do = (torch.randn(n, d, generator=g) for n in (N, Nk, Nk, N))
    o, lse = L.flash_attn_fwd(q, k, v, B, B)
    names = ("q", "k", "v", "o", "lse", "do")
    fwd = meter.measure(L.flash_attn_fwd, q, k, v, B, B, names=("q", "k", "v"))
    one = meter.measure(L.flash_attn_bwd_ref, q, k, v, o, lse, do, B, B, names=names)
    two = meter.measure(L.flash_attn_bwd_two_pass, q, k, v, o, lse, do, B, B, names=names)
    assert fwd.flops == 4 * N * Nk * d and one.flops == 10 * N * Nk * d and two.flops == 14 * N * Nk * d
    assert one.reads["k"] == one.writes["out1"] == Nk * d * 4 and two.writes["out0"] == N * d * 4
    assert one.largest.numel <= N * d


def test_schedule_counts_agree_with_the_meter():
    for N, Nk, Br, Bc, causal, align in [(10, 10, 4, 3, True, "top_left"), (7, 11, 4, 3, False, "top_left"),
                                         (13, 6, 4, 3, True, "bottom_right")]:
        d = 4
        steps = L.bwd_schedule(N, Nk, d, Br, Bc, causal, align)
        cls = lesson04.tile_classes(N, Nk, Br, Bc, align) if causal else None
        n_tiles = (cls != lesson04.SKIP).sum().item() if causal else math.ceil(N / Br) * math.ceil(Nk / Bc)
        assert len(steps) == n_tiles
        assert all(s.cls in ("full", "partial") for s in steps)
        assert sum(s.first for s in steps) == sum(s.last for s in steps)
        last = steps[-1]
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(n, d, generator=g) for n in (N, Nk, Nk, N))
        o, lse = L.flash_attn_fwd(q, k, v, Br, Bc, causal, align)
        r = meter.measure(L.flash_attn_bwd_ref, q, k, v, o, lse, do, Br, Bc, causal, align,
                          names=("q", "k", "v", "o", "lse", "do"))
        assert last.reads["q"] * 4 == r.reads["q"] and last.reads["k"] * 4 == r.reads["k"]
        assert last.reads["lse"] * 4 == r.reads["lse"]
        assert last.writes["dk"] == Nk * d and last.writes["dv"] == Nk * d


def test_stepper_frames_draw_and_differ():
    import matplotlib.pyplot as plt
    n = len(L.bwd_schedule(10, 10, 4, 4, 3, causal=True))
    assert n == 9
    first = widgets.still_png(L.render_bwd_step, step=0)
    assert first != widgets.still_png(L.render_bwd_step, step=n - 1)
    fig = L.render_bwd_step(99)                                   # clamped to the last step
    assert fig.axes[0].get_title().startswith(f"backward step {n}/{n}")
    plt.close(fig)
    view = widgets.stepper(lambda step: L.render_bwd_step(step), n)
    assert view.png == first
    plt.close("all")


def test_p_memory():
    m = L.p_memory(32768, 32, 128)
    assert m["P"] == 64 * 2**30 and m["O"] == 256 * 2**20 and m["lse"] == 4 * 2**20


def test_text_and_batches_are_seeded():
    assert L.make_text(50, seed=1) == L.make_text(50, seed=1) != L.make_text(50, seed=2)
    data = L.CharData(L.make_text(200))
    (x1, y1), = list(data.batches(1, 3, 8, seed=0))
    (x2, _), = list(data.batches(1, 3, 8, seed=0))
    assert torch.equal(x1, x2) and x1.shape == (3, 8)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_training_with_the_function_matches_sdpa():
    data = L.CharData(L.make_text(200))

    def flash(q, k, v):
        return L.attention_bhtd(L.FlashAttentionRef, q, k, v, causal=True, Br=4, Bc=4)
    a = L.train(L.sdpa_causal, data, steps=4, B=2, T=8)
    b = L.train(flash, data, steps=4, B=2, T=8)
    assert len(a) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert a[0] == pytest.approx(math.log(data.vocab), abs=0.5)
    import matplotlib.pyplot as plt
    plt.close(L.plot_losses(b, a))


def test_learner_notebook_is_generated_from_the_worked_one():
    from helpers.generate import ROOT, drift
    assert not [p for p in drift(ROOT / "solutions", ROOT / "notebooks") if p.startswith(NB)]
