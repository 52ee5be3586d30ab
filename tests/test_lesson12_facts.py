"""Facts lesson 12 states, held by tests: each pins a statement to something computed here or to its record."""
from __future__ import annotations

import pytest
import torch

from conftest import cells as _cells, flat as _flat, interview as _interview, markdown as _markdown, outputs as _outputs  # noqa: F401


def test_lesson12_mask_figures_match_their_record():
    """Lesson 12's and the README's sentences on the recorded mask figures carry bench/results/masks_h200.json's
    ratios (recomputed here from its rows, not copied from its summary)."""
    import json
    import math
    from conftest import ROOT
    rec = json.loads((ROOT / "bench" / "results" / "masks_h200.json").read_text())
    rows = [r for r in rec["rows"] if "scaling" not in r["mask"]]
    assert len(rows) == 24 and all(r["pass"] for r in rows)
    ratio = lambda r, key: r[f"flex{key}"] / r[f"course{key}"]  # noqa: E731
    span = lambda xs: f"{min(xs):.2f}–{max(xs):.2f}×"  # noqa: E731
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    groups = {"windows": "window (", "documents": "documents", "softcap": "softcap", "ALiBi": "ALiBi"}
    fwd = {g: [ratio(r, "_ms") for r in rows if key in r["mask"]] for g, key in groups.items()}
    bwd = {g: [ratio(r, "_bwd_ms") for r in rows if key in r["mask"]] for g, key in groups.items()}
    assert all(len(v) == 8 if g in ("windows", "documents") else len(v) == 4 for g, v in fwd.items())
    sdpa = {r["d"]: r["sdpa_dense_ms"] / r["course_ms"] for r in rows if r["mask"] == "window (1024, 0)" and r["N"] == 32768}
    scale = {r["d"]: r for r in rec["rows"] if "scaling" in r["mask"]}
    grow = {d: next(r["course_ms"] for r in rec["rows"] if "scaling" in r["mask"] and r["d"] == d and r["N"] == 65536)
            / next(r["course_ms"] for r in rec["rows"] if "scaling" in r["mask"] and r["d"] == d and r["N"] == 8192)
            for d in scale}
    bs = [r["flex_ms"] / r["block_sparse_ms"] for r in rows if r.get("block_sparse_ms")]
    text = _flat(_markdown("12_masks_and_score_mods"))
    fwd_all = [x for v in fwd.values() for x in v]
    bwd_all = [x for v in bwd.values() for x in v]
    expected = [
        f"{sdpa[128]:.0f}× (d = 128) to {sdpa[64]:.0f}× (d = 64) faster",
        f"({grow[128]:.1f}× and {grow[64]:.1f}× from N = 8192 to 65536)",
        f"runs the forward {geo(fwd_all):.2f}× faster in geometric mean over 24 rows",
        f"(windows {span(fwd['windows'])}, documents {span(fwd['documents'])}, softcap {span(fwd['softcap'])}, "
        f"ALiBi {span(fwd['ALiBi'])})",
        f"runs at {geo(bwd_all):.2f}× FlexAttention's speed in geometric mean",
        f"softcap and ALiBi ({span(bwd['windows'] + bwd['softcap'] + bwd['ALiBi'])})",
        f"slower on packed documents ({span(bwd['documents'])})",
        f"runs the forward at {span(bs)} FlexAttention's speed",
    ]
    for sentence in expected:
        assert sentence in text, f"lesson 12 should say: {sentence}"
    # the interview: "faster than FlexAttention on every window, softcap and ALiBi row we timed"
    assert "on every window, softcap and ALiBi row we timed" in _interview("12_masks_and_score_mods")
    assert min(fwd["windows"] + fwd["softcap"] + fwd["ALiBi"]) > 1
    readme = _flat((ROOT / "README.md").read_text())
    for sentence in (f"{geo(fwd_all):.2f}× in geometric mean over the 24 rows", f"{geo(bwd_all):.2f}× in geometric mean",
                     f"ran {sdpa[128]:.0f}× (d = 128) and {sdpa[64]:.0f}× (d = 64) faster than SDPA",
                     f"grew {grow[128]:.1f}× and {grow[64]:.1f}× from N = 8192 to 65536"):
        assert sentence in readme, f"the README should say: {sentence}"
