"""Facts lesson 12 states, held by tests: its recorded figures come from bench/results/masks_h200.json through
helpers/lesson12/records.py, labelled (GPU, versions, date, batch sizes, FlexAttention's configuration, statistic),
and each claim its prose makes in words follows from the record's rows."""
from __future__ import annotations

import math

from conftest import ROOT, cells as _cells, flat as _flat, interview as _interview, markdown as _markdown  # noqa: F401
from helpers.lesson12 import records as R
from helpers.results import load_json

NB = "12_masks_and_score_mods"


def _rec():
    return load_json(R.MASKS_RESULTS)


def test_the_label_names_the_batch_sizes_and_flexattentions_configuration():
    res = _rec()
    label = R.masks_label(res)
    for word in ("NVIDIA H200", "torch 2.11.0+cu130", "triton 3.6.0", "2026-12-01", "bfloat16", "H = 16", "median",
                 "B = 2 at N = 8192", "B = 1 at N = 32768", "float64"):
        assert word in label, word
    assert {(r["N"], r["B"]) for r in res["rows"] if "scaling" not in r["mask"]} == {(8192, 2), (32768, 1)}
    # FlexAttention's configuration, said from the bench script the record came from
    script = (ROOT / "bench" / "bench_masks.py").read_text()
    assert "torch.compile(flex_attention, dynamic=False)" in script and "torch.compile(flex_attention, dynamic=False)" in label
    assert 'create_block_mask(mask_mod.fn, None, None, N, N, device="cuda", BLOCK_SIZE=128)' in script
    assert res["meta"]["flex_block"] == 128 and "B=None, H=None" in label and "BLOCK_SIZE=128" in label
    assert "kernel_options" not in script.split("def main")[1]            # "default kernel options"


def test_the_table_shows_every_row_of_its_record():
    res = _rec()
    table = R.masks_table(res)
    body = [ln for ln in table.splitlines() if ln.strip().startswith(("window", "8 doc", "64 doc", "softcap", "ALiBi"))]
    assert len(body) == len(res["rows"]) == 28
    for r, ln in zip([r for r in res["rows"] if "scaling" not in r["mask"]] +
                     [r for r in res["rows"] if "scaling" in r["mask"]], body):
        assert r["mask"] in ln and f" {r['d']} " in ln and f" {r['N']} " in ln and f" {r['B']} " in ln
    assert "No figures" in R.masks_table({})


def test_what_the_lesson_says_follows_from_the_rows():
    """Recomputed from the rows: forward faster than FlexAttention in geomean, on every window, softcap and ALiBi row
    and on all packed-documents rows but one; the backward a little slower in geomean, level or faster on windows,
    softcap and ALiBi and slower on most documents rows; SDPA with a dense mask about two orders of magnitude slower;
    the window's time about linear in N in its own B = 1 rows; the block-sparse kernel from somewhat slower to
    somewhat faster than FlexAttention and level with or slower than the course's path; partial tiles waste work on
    short documents."""
    s = R.masks_summary()
    assert s["rows"] == 24
    fw, bw = s["fwd"], s["bwd"]
    assert {g: len(v) for g, v in fw.items()} == {"windows": 8, "documents": 8, "softcap": 4, "ALiBi": 4}
    assert s["fwd_geomean"] > 1
    assert min(fw["windows"] + fw["softcap"] + fw["ALiBi"]) > 1
    assert sum(x < 1 for x in fw["documents"]) == 1
    assert 0.9 < s["bwd_geomean"] < 1
    assert min(bw["windows"] + bw["softcap"] + bw["ALiBi"]) > 0.97
    assert sum(x < 1 for x in bw["documents"]) > len(bw["documents"]) / 2
    assert s["sdpa"] and all(30 < x < 300 for x in s["sdpa"].values())
    assert {k[1] for k in s["sdpa"]} == {64, 128} and {k[2] for k in s["sdpa"]} == {32768}
    for d, (x, n, B, lo, hi) in s["scaling"].items():
        assert B == 1 and n == 8 and 0.75 * n < x < 1.25 * n
    assert min(s["block_sparse"]) < 1 < max(s["block_sparse"]) and len(s["block_sparse"]) == 16
    assert min(s["block_sparse_vs_course"]) > 0.98
    docs = [x for k, x in s["tiles_over_visible"].items() if k[0] == "64 documents"]
    assert docs and min(docs) > 1.3
    # the record's own stored summary agrees with the recomputation
    stored = _rec()["summary"]
    assert math.isclose(stored["fwd_x_flex"], s["fwd_geomean"], rel_tol=1e-9)
    assert math.isclose(stored["bwd_x_flex"], s["bwd_geomean"], rel_tol=1e-9)
    assert sorted(stored["sdpa_x_at_32k_w1024"]) == sorted(round(x, 2) for x in s["sdpa"].values())
    assert stored["scaling_64k_over_8k_d64"] == round(s["scaling"][64][0], 2)
    lines = R.summary_lines()
    assert "NVIDIA H200" in lines and "B = 1" in lines and "FlexAttention:" in lines


def test_the_notebook_shows_the_summary_and_folds_the_table():
    summary = [c for c in _cells(NB, "code") if "records.summary_lines()" in c.source]
    table = [c for c in _cells(NB, "code") if "records.masks_table()" in c.source]
    assert len(summary) == len(table) == 1
    assert table[0].metadata.get("jupyter", {}).get("outputs_hidden") is True
    for c in summary + table:
        out = "".join(o.get("text", "") for o in c.get("outputs", []))
        assert "NVIDIA H200" in out and "B = 2 at N = 8192" in out
    gpu = [c for c in _cells(NB, "code") if "L.run_on_gpu()" in c.source]
    out = "".join(o.get("text", "") for o in gpu[0].get("outputs", []))
    assert out.count("\n") <= 2                                            # one line without a GPU, no table


def test_issue_36_corrections_stay():
    text = _flat(_markdown(NB))
    for wrong in ("Mistral's layers", "# T5-like, learned", "and not again in the kernel",
                  "the factor would be `1 − (−inf)² = NaN`", "evaluates the predicate once, per tile, in"):
        assert wrong not in text, wrong
    interview = _interview(NB)
    for right in ("calls `mask_mod` again on each partial tile", "kv_num_blocks", "full_kv_indices",
                  "never read from HBM", "O(N · w)", "cap · tanh(scale · qk / cap)", "1 − tanh²"):
        assert right in interview, right


def test_the_packed_documents_table_shows_its_record():
    """Every packed-documents row of h200.json is a line of the table, with its label; the summary is recomputed
    from the rows and agrees with what the bench script stored beside them."""
    from helpers.lesson12 import records
    from helpers.results import load_results
    res = load_results()
    rows, meta = res["packed_documents"], res["packed_documents_meta"]
    table = records.packed_documents_table(res)
    assert meta["gpu"] in table and meta["date"] in table and "FlexAttention:" in table and "median" in table
    body = [ln for ln in table.splitlines() if ln.endswith(("✓", "✗"))]
    assert len(body) == len(rows)
    s = records.packed_documents_summary(res)
    stored = meta["summary"]
    assert s["rows"] == stored["rows"]
    assert round(s["fwd"][0], 3) == stored["fwd_x_flex"] and round(s["bwd"][0], 3) == stored["bwd_x_flex"]
    assert round(s["fwd"][1], 3) == stored["fwd_min"] and round(s["bwd"][1], 3) == stored["bwd_min"]
    assert "not measured yet" in records.packed_documents_table({})
