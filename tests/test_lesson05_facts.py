"""Facts lesson 05 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


def test_a_merge_must_map_the_plus_inf_sentinel_first():
    from helpers import lesson05
    from helpers.reference import attention

    q, k, v = torch.randn(1, 4), torch.randn(6, 4), torch.randn(6, 4)
    o_ref, lse_ref = attention(q, k, v)                          # all 6 keys
    o1, lse1 = attention(q, k[:6], v[:6])                        # part 1: every key
    o2 = torch.zeros(1, 4, dtype=torch.float64)                  # part 2: no key (a padded split)
    fa2_lse2, course_lse2 = torch.tensor([float("inf")]), torch.tensor([-float("inf")])

    def merge(lses, outs):                                       # the course's safe LSE merge
        lses = torch.stack([l.double() for l in lses])           # [S, 1]
        m = lses.amax(0)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        w = torch.exp(lses - m)
        return (w[..., None] * torch.stack(outs)).sum(0) / w.sum(0)[..., None]

    assert merge([lse1, course_lse2], [o1, o2]).sub(o_ref).abs().max() < 1e-12
    assert merge([lse1, fa2_lse2], [o1, o2]).isnan().all()        # +inf as it comes from FA2: NaN
    mapped = lesson05.lse_empty_to_neg_inf(fa2_lse2)
    assert torch.isneginf(mapped).all() and torch.isposinf(fa2_lse2).all()   # a new tensor
    assert merge([lse1, mapped], [o1, o2]).sub(o_ref).abs().max() < 1e-12
    finite = torch.tensor([0.5, -3.0])
    assert torch.equal(lesson05.lse_empty_to_neg_inf(finite), finite)
    with pytest.raises(TypeError):
        lesson05.lse_empty_to_neg_inf(torch.tensor([1, 2]))
