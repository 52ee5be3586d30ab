"""Lesson 05: the worked solution passes, the stub fails strict, planted bugs are named."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import check, lesson05, reference
from conftest import rejects

NB = "05_fully_masked_rows"


def make_masked(fill=-math.inf, skip="empty", safe_max=True, guard_l=True, invert=False, apply=True):
    """flash_attn_masked written another way (running stats as one [Br, 2] pair), with planted bugs.

    skip: "empty" (right), "partly" (skip tiles with any masked key), "none" (compute every tile).
    """
    def fn(q, k, v, mask, Br=4, Bc=3):
        if invert:
            mask = ~mask
        N, d = q.shape
        O, lse = torch.zeros(N, v.shape[1]), torch.full((N,), -math.inf)
        for i0 in range(0, N, Br):
            qi = q[i0:i0 + Br] * (1.0 / math.sqrt(d))
            br = qi.shape[0]
            m, l, acc = torch.full((br,), -math.inf), torch.zeros(br), torch.zeros(br, v.shape[1])
            for j0 in range(0, k.shape[0], Bc):
                t = mask[i0:i0 + Br, j0:j0 + Bc]
                if (skip == "empty" and not t.any()) or (skip == "partly" and not t.all()):
                    continue
                s = qi @ k[j0:j0 + Bc].T
                if apply:
                    s = torch.where(t, s, torch.tensor(fill))
                m_new = torch.maximum(m, s.max(1).values)
                ref = m_new.nan_to_num(neginf=0.0) if safe_max else m_new
                p = (s - ref[:, None]).exp()
                a = (m - ref).exp()
                l, acc, m = l * a + p.sum(1), acc * a[:, None] + p @ v[j0:j0 + Bc], m_new
            if guard_l:
                ok = l > 0
                O[i0:i0 + br] = torch.where(ok[:, None], acc / torch.where(ok, l, 1.0)[:, None], 0.0)
                lse[i0:i0 + br] = torch.where(ok, m + torch.where(ok, l, 1.0).log(), -math.inf)
            else:
                O[i0:i0 + br] = acc / l[:, None]
                lse[i0:i0 + br] = m + l.log()
        return O, lse
    return fn


def test_another_correct_way_passes(strict):
    check.flash_attn_masked(make_masked())


def test_minus_1e6_trick():
    rejects(check.flash_attn_masked, make_masked(fill=-1e6), "-1e6", "average of V")
    rejects(check.flash_attn_masked, make_masked(fill=-1e6, skip="none"), "-1e6", "average of V")


def test_nan_on_fully_masked_rows():
    rejects(check.flash_attn_masked, make_masked(safe_max=False, guard_l=False), "NaN", "safe max")


def test_nan_hidden_by_a_final_guard():
    rejects(check.flash_attn_masked, make_masked(safe_max=False), "final guard hid it", "safe max")


def test_nan_from_unguarded_division():
    rejects(check.flash_attn_masked, make_masked(guard_l=False), "NaN", "guard l = 0")


def test_skipping_a_partly_masked_tile():
    rejects(check.flash_attn_masked, make_masked(skip="partly"), "some visible keys was skipped")


def test_computing_every_tile():
    rejects(check.flash_attn_masked, make_masked(skip="none"), "FLOPs", "no key is visible")


def test_mask_ignored_or_inverted():
    rejects(check.flash_attn_masked, make_masked(apply=False), "not applied")
    rejects(check.flash_attn_masked, make_masked(invert=True), "upside down")


def test_dense_score_matrix_rejected():
    def dense(q, k, v, mask, Br=4, Bc=3):
        return reference.attention(q, k, v, mask=mask)[0].float(), reference.attention(q, k, v, mask=mask)[1].float()
    rejects(check.flash_attn_masked, dense, "FLOPs")


# ------------------------------------------------------------------ the plain functions behind the pictures
@pytest.mark.parametrize("kind", lesson05.KINDS)
def test_make_mask(kind):
    for N, Nk in [(1, 1), (16, 12), (12, 20)]:
        m = lesson05.make_mask(kind, N, Nk)
        assert m.shape == (N, Nk) and m.dtype == torch.bool


def test_mask_sources_of_empty_rows():
    assert lesson05.mask_summary(lesson05.make_mask("bottom_right causal", 16, 12), 4, 4)["empty_rows"] == 4
    assert lesson05.mask_summary(lesson05.make_mask("padding", 12, 12), 4, 4)["empty_rows"] == 4
    assert torch.equal(lesson05.make_mask("bottom_right causal", 7, 9), reference.causal_mask(7, 9, "bottom_right"))
    s = lesson05.mask_summary(lesson05.make_mask("sliding window", 12, 20), 4, 4)
    assert s["empty_rows"] == 0 and s["empty_tiles"] == 9 and s["tiles"] == 15


def test_render_mask():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = lesson05.render_mask("padding", 12, 10, 4, 3)
    assert "fully masked rows" in ax.get_title()
    plt.close("all")


def test_course_reference_kernel_passes_the_checker(strict, capsys):
    """The reference the notebook falls back on (yours_or_reference) is itself a right answer."""
    from helpers import lesson05
    check.flash_attn_masked(lesson05.flash_attn_masked_ref)
    assert "✅ flash_attn_masked" in capsys.readouterr().out
