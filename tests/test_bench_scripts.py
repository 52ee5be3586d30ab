"""The GPU benchmark scripts run end to end on tiny sizes under Triton's interpreter (--smoke), and
their shared pieces (bench/common.py) do what the scripts rely on.

Not a measurement: it proves the script's paths (lengths, the float64 check, the three timed calls,
the JSON merge that keeps every other key) run and write rows with the keys `make bench` promises.
"""

import importlib.util
import json
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARLEN_KEYS = {"dtype", "d", "causal", "H", "Hkv", "total_tokens", "lengths", "triton_tflops",
               "dense_triton_tflops", "sdpa_padded_tflops", "mix", "err_ratio"}


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PACKED_KEYS = {"mix", "T", "d", "H", "Hkv", "causal", "fwd_course_ms", "fwd_flex_ms", "bwd_course_ms", "bwd_flex_ms",
               "pass", "fwd_sdpa_ms", "bwd_sdpa_ms", "lengths"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU interpreter run")
def test_bench_varlen_smoke_merges_rows(tmp_path, monkeypatch):
    """bench/bench_varlen.py --smoke, both sections in one run (neither --serving nor --packed): the serving rows and
    the packed documents' (the batch, FlexAttention's document mask, SDPA's dense mask, the float64 checks, the
    timing, the record after every row), on tiny sizes. The packed rows: two of the smoke list, causal and not, MHA
    and GQA (every mix's lengths: tests/test_packed_documents.py's test_bench_document_mixes_sum_to_the_row)."""
    bench = _load("bench_varlen")
    smoke_rows = bench.packed_cases(False, True)
    two = [c for c in smoke_rows if (c[0], c[3], c[4]) in {("one longer than the rest", 2, True), ("2 x 32", 1, False)}]
    assert len(two) == 2
    monkeypatch.setattr(bench, "packed_cases", lambda quick, smoke: two)
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"prefill": [{"N": 1}], "gpu": "kept"}))
    rows = bench.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["prefill"] == [{"N": 1}] and data["gpu"] == "kept", "other keys must be left as they were"
    assert data["varlen"] == rows and len(rows) >= 2
    meta = data["varlen_meta"]
    assert {"gpu", "torch", "triton", "date"} <= set(meta) and len(meta["details"]) == len(rows)
    for row, detail in zip(rows, meta["details"]):
        assert set(row) == VARLEN_KEYS
        assert detail["pass"] and row["err_ratio"] <= 2 + 1e-5 / detail["sdpa_err"], (row, detail)
        for key in ("triton_tflops", "dense_triton_tflops", "sdpa_padded_tflops"):
            assert row[key] is not None and row[key] >= 0
    assert {r["Hkv"] < r["H"] for r in rows} == {True, False}, "GQA and MHA rows"
    assert {r["causal"] for r in rows} == {True, False}

    packed = data["packed_documents"]
    assert len(packed) == 2
    meta = data["packed_documents_meta"]
    assert len(meta["details"]) == len(packed) and {"gpu", "torch", "triton", "date", "summary"} <= set(meta)
    assert meta["host_us_per_call"]["python"]["forward"] > 0
    for row, detail in zip(packed, meta["details"]):
        assert set(row) == PACKED_KEYS and row["pass"] and detail["pass"], (row, detail)
        assert all(row[key] > 0 for key in ("fwd_course_ms", "fwd_flex_ms", "bwd_course_ms", "fwd_sdpa_ms"))
        assert detail["flex_vs_course_max_diff"] < 1e-4  # FlexAttention's document mask is the same function
    assert {r["causal"] for r in packed} == {True, False} and {r["Hkv"] < r["H"] for r in packed} == {True, False}


def test_varlen_useful_flops_count_visible_pairs():
    bench = _load("bench_varlen")
    for n, nk in ((5, 5), (3, 7), (7, 3), (1, 1), (4, 0)):
        brute = sum(1 for i in range(n) for j in range(nk) if j <= i + nk - n)
        assert bench.visible_pairs(n, nk, True) == brute
        assert bench.visible_pairs(n, nk, False) == n * nk
    assert bench.useful_flops([4, 2], H=3, d=8, causal=True) == 4 * 3 * 8 * (10 + 3)
    import random
    for mix in ("uniform", "long-tailed", "equal"):
        lens = bench.make_lengths(mix, 32768, random.Random(0))
        assert sum(lens) == 32768 and min(lens) >= 1, mix


PAGED_KEYS = {"dtype", "B", "H", "Hkv", "d", "block_size", "mean_len", "triton_gbs", "contig_triton_gbs",
              "sdpa_cudnn_gbs"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU interpreter run")
def test_bench_kvcache_smoke_merges_rows(tmp_path):
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"decode": [{"kept": 1}], "paged": [{"stale": 1}]}))
    rows = _load("bench_kvcache").main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["decode"] == [{"kept": 1}], "other keys must be left as they were"
    assert data["paged"] == json.loads(json.dumps(rows)) and len(rows) == 2
    for r in rows:
        assert PAGED_KEYS <= set(r), PAGED_KEYS - set(r)
        assert r["pass"] and r["contig_pass"], r
        assert r["err"] <= 2 * r["sdpa_err"] + 1e-5
        assert sum(r["lengths"]) == r["B"] * r["mean_len"]
    assert {"gpu", "torch", "triton", "date"} <= set(data["paged_meta"])


# ----------------------------------------------------------------------------- bench/common.py


def test_write_section_keeps_every_other_section_and_its_meta(tmp_path):
    common = _load("common")
    path = tmp_path / "gpu.json"
    before = {"gpu": "top", "prefill": [{"N": 1}], "backward": [{"N": 2}], "backward_meta": {"gpu": "B", "date": "1"}}
    path.write_text(json.dumps(before))
    data = common.write_section("paged", [{"x": 1}], {"gpu": "P", "date": "2"}, str(path), extra={"paged_note": 3})
    on_disk = json.loads(path.read_text())
    assert on_disk == data == {**before, "paged": [{"x": 1}], "paged_meta": {"gpu": "P", "date": "2"}, "paged_note": 3}
    common.write_section("backward", [{"N": 4}], {"gpu": "B2"}, str(path))
    on_disk = json.loads(path.read_text())
    assert on_disk["backward"] == [{"N": 4}] and on_disk["backward_meta"] == {"gpu": "B2"}
    assert on_disk["paged_meta"] == {"gpu": "P", "date": "2"} and on_disk["gpu"] == "top", "another run's label changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json"], "a temporary file was left behind"


def test_write_section_refuses_a_file_that_is_not_an_object(tmp_path):
    common = _load("common")
    path = tmp_path / "gpu.json"
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        common.write_section("paged", [], {}, str(path))
    assert path.read_text() == "[1, 2]"


def test_the_2x_sdpa_rule_and_the_results_file_name():
    common = _load("common")
    assert common.within_sdpa_error(2e-3, 1e-3) and common.within_sdpa_error(2e-3 + 1e-5, 1e-3)
    assert not common.within_sdpa_error(2.1e-3, 1e-3)
    assert common.within_sdpa_error(1e-5, 0.0) and not common.within_sdpa_error(2e-5, 0.0)
    assert os.path.basename(common.results_path("NVIDIA H200")) == "h200.json"
    assert os.path.basename(common.results_path("NVIDIA H200", prefix="paths_")) == "paths_h200.json"


def test_check_prefill_passes_sdpa_itself_and_rejects_an_offset():
    common = _load("common")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 16, generator=g) for _ in range(3))
    for causal in (False, True):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        s = q @ k.transpose(-1, -2) / 4
        if causal:
            s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        assert common.check_prefill(q, k, v, causal, o, lse)["pass"]
        assert not common.check_prefill(q, k, v, causal, o + 1e-2, lse)["pass"]
        assert not common.check_prefill(q, k, v, causal, o, lse + 1e-2)["pass"]


BENCH = os.path.join(ROOT, "bench")
# compile_decode_sm90.py only compiles and prints what the compiler made: no timing, no results file
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and f not in ("common.py", "compile_decode_sm90.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_takes_the_shared_pieces_from_common(name):
    """One copy of each: log, the timing helper, the 2x-SDPA rule, the results writer (issue 22)."""
    src = open(os.path.join(BENCH, name), encoding="utf-8").read()
    assert "from common import" in src, f"{name} does not use bench/common.py"
    # (ring_gpu.py's time_ms is another mechanism: wall clock of the slowest of several ranks, not do_bench)
    for pattern, what in ((r"^def (log|bench_ms|graph_ms|sdpa_ms)\(", "a timing or log helper of its own"),
                          (r"2 \* \w*sdpa_err\w* \+", "its own copy of the 2x-SDPA rule"),
                          (r"json\.dump\(", "its own JSON writer (write_json / write_section are atomic)"),
                          (r"from bench import|import bench\b", "bench.py imported as a module (it shadows bench/)")):
        found = re.findall(pattern, src, flags=re.M)
        assert not found, f"{name}: {what}: {found}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_bench_masks_needs_cuda_and_says_so():
    bench = _load("bench_masks")
    with pytest.raises(SystemExit, match="needs|CUDA GPU") as e:
        bench.main([])
    assert str(e.value) == bench.NEEDS_CUDA


def test_bench_masks_writes_each_mask_twice_alike():
    """Each row's mask for the course's kernel (a MaskSpec) and for FlexAttention and the reference (lesson 12's
    predicate) is one mask: the same tile classes, the same visible pairs."""
    from helpers import lesson12 as L
    from helpers.kernels import block_sparse as bs
    bench = _load("bench_masks")
    N = 256
    rows = bench.cases(N, "cpu")
    assert len(rows) == 6 and len({r[0] for r in rows}) == 6  # no window as wide as N = 256
    for name, spec, mod, mask_mod, score_mod, route in rows:
        bm = bs.build_block_mask_triton(spec, N, N, 32, 32)
        assert torch.equal(bm.classes(), L.tile_classes(mask_mod, N, N, 32, 32)), name
        assert (mod is None) == (score_mod is None), name
        if route == "varlen":  # packed documents: the same runs as cu_seqlens
            cu, longest = bench.doc_cu_seqlens(spec.doc_ids, 2)
            runs = torch.unique_consecutive(spec.doc_ids, return_counts=True)[1]
            assert cu.tolist() == [0] + torch.cumsum(runs.repeat(2), 0).tolist() and longest == int(runs.max()), name
            continue
        if route is not None:  # the dense kernels' arguments say the same mask: the library's window, causal
            w = route.get("window_size", (-1, -1))
            assert spec.kind == "window" and (spec.left, spec.right) == (w[0], 0) and route["causal"], name
            assert (("softcap" in route) == isinstance(mod, bs.SoftCap)
                    and ("alibi_slopes" in route) == isinstance(mod, bs.ALiBi)), name


# ----------------------------------------------------------------------------- bench_gluon.py --bwd (no GPU needed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_bench_gluon_bwd_parses_its_options_and_needs_hopper():
    bench = _load("bench_gluon")
    with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
        bench.main(["--bwd", "--N", "16384", "--dtype", "bfloat16", "--causal", "--group", "1", "4",
                    "--bwd-config", '{"dkdv": {"NUM_STAGES": 3}}'])
    with pytest.raises(SystemExit, match="--bwd-config needs --bwd"):
        bench.main(["--bwd-config", "{}"])
    with pytest.raises(SystemExit) as e:                                  # not JSON: argparse's usage error
        bench.main(["--bwd", "--bwd-config", "{dkdv: 3}"])
    assert e.value.code == 2


def test_bench_gluon_bwd_reference_is_float64_autograd_in_row_chunks():
    """ref_group_grads (the --bwd check's float64 gradients, by formula, a few rows at a time) equals torch.autograd
    on K, V repeated over the group, causal or not."""
    from helpers import reference
    bench = _load("bench_gluon")
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, N, d = 2, 4, 2, 37, 16
    q, do = (torch.randn(B, H, N, d, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, d, generator=g) for _ in range(2))
    for causal in (False, True):
        mask = reference.causal_mask(N, N, "top_left") if causal else None
        kr, vr = (x.repeat_interleave(2, 1) for x in (k, v))
        _, _, dq, dk, dv = reference.attention_grads(q, kr, vr, do, mask=mask)
        for b, kh in ((0, 0), (1, 1)):
            mine = bench.ref_group_grads(q, k, v, do, causal, b, kh, chunk=8)
            hs = slice(2 * kh, 2 * kh + 2)
            for m, r in zip(mine, (dq[b, hs], dk[b, hs].sum(0), dv[b, hs].sum(0))):
                assert torch.allclose(m, r, atol=1e-10), (causal, b, kh)


def test_bench_gluon_bwd_check_passes_sdpa_itself_and_rejects_an_offset():
    bench = _load("bench_gluon")
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(1, 4, 32, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, 32, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    for causal in (False, True):
        a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(a[0], a[1].repeat_interleave(2, 1),
                                                         a[2].repeat_interleave(2, 1), is_causal=causal).backward(do)
        grads = [t.grad for t in a]
        chk = bench.check_backward(q, k, v, do, causal, grads)
        assert chk["pass"] and set(chk["grad_err"]) == {"dq", "dk", "dv"}, chk
        for i in range(3):
            bad = [x + 0.05 if j == i else x for j, x in enumerate(grads)]
            assert not bench.check_backward(q, k, v, do, causal, bad)["pass"], (causal, i)
        nan = [grads[0], grads[1], grads[2].clone().fill_(float("nan"))]
        assert not bench.check_backward(q, k, v, do, causal, nan)["pass"]


def test_profile_gluon_reads_ncu_csv_kernel_by_kernel():
    """bench/profile_gluon.py: ncu's --csv lines (one per kernel and metric, after ncu's own lines) become one row
    per kernel in launch order, with the record's keys; results.gluon_profile_table prints them and each Gluon
    call over its cuDNN twin."""
    P = _load("profile_gluon")
    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'

    def line(i, kernel, metric, value):
        return f'"{i}","1","python3","h","{kernel}","1","7","(384,1,1)","(8,1,1)","0","9.0","Command line profiler ' \
               f'metrics","{metric}","","{value}"'
    text = "\n".join(["==PROF== Connected to process 1", head,
                      line(0, "_bwd_dkdv", "gpu__time_duration.sum", "2,000,000"),
                      line(0, "_bwd_dkdv", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                           "63.2"),
                      line(1, "void cudnn::convert_dq_to_16bits<1>(const void *)", "gpu__time_duration.sum", "1,000"),
                      line(1, "void cudnn::convert_dq_to_16bits<1>(const void *)", "launch__grid_size", "32,768"),
                      "==PROF== Disconnected from process 1"])
    rows = P.parse(text)
    assert rows == [{"kernel": "_bwd_dkdv", "ns": 2e6, "tensor_pct": 63.2},
                    {"kernel": "cudnn::convert_dq_to_16bits<1>", "ns": 1000.0, "grid": 32768.0}]
    from helpers.lesson11 import records as results
    rec = {"meta": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "date": "2026-12-01", "tool": "ncu"},
           "rows": [{"case": "bwd-gluon-d128-N16384", "kernels": rows[:1], "ms": 2.0},
                    {"case": "bwd-cudnn-d128-N16384", "kernels": [dict(rows[0], ns=1e6)], "ms": 1.0}]}
    table = results.gluon_profile_table(rec)
    assert "NVIDIA H200" in table and "63.2%" in table and "bwd-d128-N16384: the Gluon call takes 2.00x" in table
    assert "not" in results.gluon_profile_table({"rows": []}).lower()


def test_check_gpu_merges_a_part_of_the_kernel_tests():
    """`check_gpu.py --tests FILE ...` replaces those files' rows; the record passes only once every file has run."""
    cg = _load("check_gpu")
    names = [os.path.basename(f) for f in cg.KERNEL_TESTS]
    one = {"returncode": 1, "seconds": 3.0, "files": {names[0]: {"passed": 1, "failed": 1, "skipped": 0}},
           "failures": [f"tests.{names[0][:-3]}::test_a"]}
    whole_run = {"files": {"test_gone.py": {"passed": 4, "failed": 0, "skipped": 0}}, "failures": []}
    rec = cg.merge_tests(whole_run, one, [cg.KERNEL_TESTS[0]])
    assert "test_gone.py" not in rec["files"], "a whole run's rows are not merged into"
    assert rec["returncode"] == 1 and rec["not_run"] == names[1:]
    rest = {"returncode": 0, "seconds": 5.0, "files": {n: {"passed": 2, "failed": 0, "skipped": 0} for n in names[1:]},
            "failures": []}
    rec = cg.merge_tests(rec, rest, cg.KERNEL_TESTS[1:])
    assert rec["returncode"] == 1 and rec["failures"] == one["failures"], "the first part's failure stays"
    again = {"returncode": 0, "seconds": 2.0, "files": {names[0]: {"passed": 2, "failed": 0, "skipped": 0}},
             "failures": []}
    rec = cg.merge_tests(rec, again, [cg.KERNEL_TESTS[0]])
    assert rec["returncode"] == 0 and rec["failures"] == [] and rec["not_run"] == []
    assert [p["files"] for p in rec["parts"]] == [sorted(names[1:]), [names[0]]] and rec["seconds"] == 7.0
