"""Lesson 04: the worked solutions pass, the stubs fail strict, planted bugs are named."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import check, lesson04, reference
from helpers.lesson04.check import tiled_model
from conftest import rejects

NB = "04_causal_tile_classes"


# ------------------------------------------------------------------ a causal kernel with knobs for bugs
def make_causal(shift=0, ignore_align=False, compute_all=False, skip_partial=False, mask_partial=True,
                mask_full=False, fill=-math.inf, safe=True):
    """flash_attn_causal written Triton-style (off-band loop, then on-band loop), with planted bugs."""
    def fn(q, k, v, Br=4, Bc=3, align="top_left"):
        N, d = q.shape
        Nk = k.shape[0]
        off = 0 if (align == "top_left" or ignore_align) else Nk - N
        O, lse = torch.zeros(N, v.shape[1]), torch.full((N,), -math.inf)
        for i0 in range(0, N, Br):
            qi = q[i0:i0 + Br] / math.sqrt(d)
            br = qi.shape[0]
            m, l, acc = torch.full((br,), -math.inf), torch.zeros(br), torch.zeros(br, v.shape[1])
            rows = torch.arange(i0, i0 + br)[:, None]
            # keys < lo are visible to every row (off-band); keys < hi to at least the last row
            lo = max(0, min(Nk, i0 + off + 1 + shift))
            hi = max(0, min(Nk, i0 + br + off + shift))
            if compute_all:
                lo, hi = 0, Nk
            j_full_end = (lo // Bc) * Bc            # whole tiles below lo are full
            for j0 in range(0, Nk, Bc):
                Kj = k[j0:j0 + Bc]
                cols = torch.arange(j0, j0 + Kj.shape[0])[None, :]
                is_full = j0 + Kj.shape[0] <= lo and j0 < j_full_end
                if not compute_all and j0 >= hi:
                    continue
                if skip_partial and not is_full:
                    continue
                s = qi @ Kj.T
                if (mask_partial and not is_full) or compute_all or mask_full:
                    s = s.masked_fill(cols > rows + off + shift, fill)
                m_new = torch.maximum(m, s.amax(1))
                ms = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new) if safe else m_new
                p = torch.exp(s - ms[:, None])
                a = torch.exp(m - ms)
                l = a * l + p.sum(1)
                acc = a[:, None] * acc + p @ v[j0:j0 + Bc]
                m = m_new
            if safe:
                O[i0:i0 + br] = torch.where(l[:, None] > 0, acc / l.clamp_min(1e-38)[:, None], 0.0)
                lse[i0:i0 + br] = torch.where(l > 0, m + torch.log(l), -math.inf)
            else:
                O[i0:i0 + br] = acc / l[:, None]
                lse[i0:i0 + br] = m + torch.log(l)
        return O, lse
    return fn


def classify_with(shift=0, ignore_align=False, clip=True):
    def fn(i0, j0, Br, Bc, N, Nk, align="top_left"):
        off = (0 if align == "top_left" or ignore_align else Nk - N) + shift
        i1 = (min(i0 + Br, N) if clip else i0 + Br) - 1
        j1 = (min(j0 + Bc, Nk) if clip else j0 + Bc) - 1
        return "skip" if j0 > i1 + off else ("full" if j1 <= i0 + off else "partial")
    return fn


# ------------------------------------------------------------------ solutions and stubs
def test_other_correct_ways_pass(strict):
    check.classify_tile(classify_with())
    check.flash_attn_causal(make_causal())


# ------------------------------------------------------------------ planted bugs: classify_tile
def test_classify_off_by_one():
    rejects(check.classify_tile, classify_with(shift=-1), "off-by-one")
    rejects(check.classify_tile, classify_with(shift=1), "off-by-one")


def test_classify_ignores_alignment():
    rejects(check.classify_tile, classify_with(ignore_align=True), "alignment")


def test_classify_ragged():
    rejects(check.classify_tile, classify_with(clip=False), "ragged")


# ------------------------------------------------------------------ planted bugs: flash_attn_causal
def test_off_by_one_diagonal():
    rejects(check.flash_attn_causal, make_causal(shift=-1), "off-by-one", "j < i + offset")
    rejects(check.flash_attn_causal, make_causal(shift=1), "off-by-one")


def test_ignoring_alignment():
    rejects(check.flash_attn_causal, make_causal(ignore_align=True), "other alignment", "align")


def test_every_tile_then_mask():
    msg = rejects(check.flash_attn_causal, make_causal(compute_all=True), "FLOPs", "skip those tiles")
    assert "saves nothing" in msg


def test_score_matrix_then_mask():
    def dense(q, k, v, Br=4, Bc=3, align="top_left"):
        vis = reference.causal_mask(q.shape[0], k.shape[0], align)
        s = (q @ k.T / math.sqrt(q.shape[1])).masked_fill(~vis, -math.inf)
        lse = torch.logsumexp(s, 1)
        p = torch.where(torch.isneginf(lse)[:, None], 0.0, torch.exp(s - lse[:, None]))
        return p @ v, lse
    rejects(check.flash_attn_causal, dense, "FLOPs")


def test_mask_on_full_tiles():
    rejects(check.flash_attn_causal, make_causal(mask_full=True), "full tiles need no mask")


def test_skipping_a_partial_tile():
    rejects(check.flash_attn_causal, make_causal(skip_partial=True), "partial", "skipped")


def test_partial_tile_unmasked():
    rejects(check.flash_attn_causal, make_causal(mask_partial=False), "without its mask")


def test_nan_on_fully_masked_rows():
    rejects(check.flash_attn_causal, make_causal(safe=False), "NaN", "safe max")


def test_minus_1e6():
    rejects(check.flash_attn_causal, make_causal(fill=-1e6), "-1e6", "average of V")


# ------------------------------------------------------------------ the plain functions behind the pictures
def test_tile_class_agrees_with_the_mask():
    for N, Nk, Br, Bc in [(1, 1, 4, 3), (7, 13, 4, 3), (13, 7, 2, 5), (16, 16, 4, 4), (9, 4, 16, 1)]:
        for align in ("top_left", "bottom_right"):
            vis = reference.causal_mask(N, Nk, align)
            cls = lesson04.tile_classes(N, Nk, Br, Bc, align)
            assert cls.shape == (math.ceil(N / Br), math.ceil(Nk / Bc))
            for a, i0 in enumerate(range(0, N, Br)):
                for b, j0 in enumerate(range(0, Nk, Bc)):
                    t = vis[i0:i0 + Br, j0:j0 + Bc]
                    want = lesson04.SKIP if not t.any() else lesson04.FULL if t.all() else lesson04.PARTIAL
                    assert cls[a, b] == want


def test_alignments_match_sdpa():
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = torch.randn(5, 4).double(), torch.randn(9, 4).double(), torch.randn(9, 4).double()
    F = torch.nn.functional
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          reference.attention(q, k, v, mask=reference.causal_mask(5, 9, "top_left"))[0])
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 9)),
                          reference.attention(q, k, v, mask=reference.causal_mask(5, 9, "bottom_right"))[0])


def test_work_fraction():
    f = lesson04.work_fraction(1024, 1024, 64, 64)
    assert abs(f["skip"] + f["full"] + f["partial"] - 1) < 1e-12
    assert f["skip"] == pytest.approx((16 * 15 / 2) / 256)           # 120 of 256 tiles
    assert 0.45 < f["skip"] < 0.5 and f["visible"] > 0.5
    small = lesson04.work_fraction(64, 64, 64, 64)
    assert small["skip"] == 0 and small["partial"] == 1               # one tile: nothing saved
    assert lesson04.work_fraction(8, 8, 1, 1)["skip"] == pytest.approx(28 / 64)


def test_tiled_model_is_the_reference_when_right():
    q, k, v = torch.randn(9, 5), torch.randn(11, 5), torch.randn(11, 5)
    vis = reference.causal_mask(9, 11, "bottom_right")
    O, lse = tiled_model(q, k, v, vis, 4, 3)
    O_ref, lse_ref = reference.attention(q, k, v, mask=vis)
    assert torch.allclose(O, O_ref) and torch.allclose(lse, lse_ref)


def test_pictures_draw():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = lesson04.render_tile_classes(13, 21, 4, 3, "bottom_right")
    assert "bottom_right" in ax.get_title()
    lesson04.plot_work_saved(Ns=[16, 64, 256])
    plt.close("all")


# ------------------------------------------------------------------ hints that name the mistake
def _classifier(skip_row="last", skip_key="first", full_row="first", full_key="last", minus_one=1,
                offset=lambda N, Nk: Nk - N):
    """classify_tile written by a learner, with the corners and the offset as knobs."""
    def classify_tile(i0, j0, Br, Bc, N, Nk, align="top_left"):
        off = 0 if align == "top_left" else offset(N, Nk)
        i1, j1 = min(i0 + Br, N) - minus_one, min(j0 + Bc, Nk) - minus_one
        rows, keys = {"first": i0, "last": i1}, {"first": j0, "last": j1}
        if keys[skip_key] > rows[skip_row] + off:
            return "skip"
        if keys[full_key] <= rows[full_row] + off:
            return "full"
        return "partial"
    return classify_tile


def test_classifier_written_here_passes(strict, capsys):
    check.classify_tile(_classifier())
    assert "✅ classify_tile" in capsys.readouterr().out


@pytest.mark.parametrize("knobs, words", [
    (dict(skip_row="first"), ["wrong corner for skip", "you tested its first row"]),
    (dict(skip_key="last"), ["wrong corner for skip", "you tested its last key"]),
    (dict(full_row="last"), ["wrong corner for full", "you tested its last row"]),
    (dict(full_key="first"), ["wrong corner for full", "you tested its first key"]),
    (dict(minus_one=0), ["min(i0 + Br, N) - 1", "without the - 1"]),
    (dict(offset=lambda N, Nk: N - Nk), ["bottom-right offset is Nk - N", "not N - Nk"]),
    (dict(offset=lambda N, Nk: Nk - N - 1), ["off-by-one on the diagonal", "the diagonal itself is visible"]),
])
def test_classify_mistakes_are_named(knobs, words):
    msg = rejects(check.classify_tile, _classifier(**knobs), *words)
    assert "partial: anything else" not in msg           # not the generic hint


def _causal_with_partial_mask(mask_of):
    """The worked flash_attn_causal with the partial tiles' mask given by mask_of(rows, cols, offset, i0, j0)."""
    def flash_attn_causal(q, k, v, Br=4, Bc=3, align="top_left"):
        N, d = q.shape
        Nk = k.shape[0]
        off = 0 if align == "top_left" else Nk - N
        O, lse = torch.empty(N, d), torch.empty(N)
        for i0 in range(0, N, Br):
            Qi = q[i0:i0 + Br]
            br = Qi.shape[0]
            m, l, acc = torch.full((br,), -math.inf), torch.zeros(br), torch.zeros(br, d)
            for j0 in range(0, Nk, Bc):
                kind = _classifier()(i0, j0, Br, Bc, N, Nk, align)
                if kind == "skip":
                    continue
                Kj, Vj = k[j0:j0 + Bc], v[j0:j0 + Bc]
                S = Qi @ Kj.T / math.sqrt(d)
                if kind == "partial":
                    rows = torch.arange(i0, i0 + br)[:, None]
                    cols = torch.arange(j0, j0 + Kj.shape[0])[None, :]
                    S = S.masked_fill(mask_of(rows, cols, off, i0, j0), -math.inf)
                m_new = torch.maximum(m, S.amax(1))
                m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
                P, alpha = torch.exp(S - m_safe[:, None]), torch.exp(m - m_safe)
                l, acc, m = alpha * l + P.sum(1), alpha[:, None] * acc + P @ Vj, m_new
            l_safe = torch.where(l == 0, 1.0, l)
            O[i0:i0 + br] = acc / l_safe[:, None]
            lse[i0:i0 + br] = torch.where(l == 0, -math.inf, m + torch.log(l_safe))
        return O, lse
    return flash_attn_causal


def test_partial_mask_off_by_one_is_named():
    fn = _causal_with_partial_mask(lambda rows, cols, off, i0, j0: cols >= rows + off)   # hides the diagonal
    rejects(check.flash_attn_causal, fn, "mask of the partial tiles is off by one", "hides the diagonal")


def test_partial_mask_in_local_indices_is_named():
    fn = _causal_with_partial_mask(lambda rows, cols, off, i0, j0: (cols - j0) > (rows - i0) + off)
    rejects(check.flash_attn_causal, fn, "the tile's own indices", "i0 + arange(Br)")


def test_partial_mask_written_here_passes(strict, capsys):
    check.flash_attn_causal(_causal_with_partial_mask(lambda rows, cols, off, i0, j0: cols > rows + off))
    assert "✅ flash_attn_causal" in capsys.readouterr().out


def test_course_reference_kernel_passes_the_checker(strict, capsys):
    """The reference the notebook falls back on (yours_or_reference) is itself a right answer."""
    check.flash_attn_causal(lesson04.flash_attn_causal_ref)
    assert "✅ flash_attn_causal" in capsys.readouterr().out


# ------------------------------------------------------------------ issue 21
def causal_log_mask_everywhere(q, k, v, Br=4, Bc=3, align="top_left"):
    """Skips the invisible tiles, but 'masks' every computed tile, full ones too, by adding log(keep)."""
    N, d = q.shape
    Nk = k.shape[0]
    scale, off = 1 / math.sqrt(d), (0 if align == "top_left" else Nk - N)
    O, lse = torch.empty(N, v.shape[1], dtype=q.dtype), torch.empty(N, dtype=q.dtype)
    for i0 in range(0, N, Br):
        Qi = q[i0:i0 + Br]
        br = Qi.shape[0]
        m, l, acc = torch.full((br,), -math.inf), torch.zeros(br), torch.zeros(br, v.shape[1])
        for j0 in range(0, Nk, Bc):
            if j0 > min(i0 + Br, N) - 1 + off:
                continue
            Kj = k[j0:j0 + Bc]
            keep = torch.arange(j0, j0 + Kj.shape[0])[None, :] <= torch.arange(i0, i0 + br)[:, None] + off
            S = Qi @ Kj.T * scale + torch.log(keep.float())          # [Br, Bc]: + 0 on a full tile
            m_new = torch.maximum(m, S.amax(1))
            safe = torch.where(m_new == -math.inf, 0.0, m_new)
            P, alpha = torch.exp(S - safe[:, None]), torch.exp(m - safe)
            l, acc, m = alpha * l + P.sum(1), alpha[:, None] * acc + P @ v[j0:j0 + Bc], m_new
        l_safe = torch.where(l == 0, 1.0, l)
        O[i0:i0 + br] = acc / l_safe[:, None]
        lse[i0:i0 + br] = torch.where(l == 0, -math.inf, m + torch.log(l_safe))
    return O, lse


def test_full_tiles_masked_by_adding_log_keep_rejected():
    rejects(check.flash_attn_causal, causal_log_mask_everywhere, "a full tile", "torch.log(keep.float())",
            "full tiles need no mask")
