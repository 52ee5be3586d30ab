"""Lesson 11's Gluon part: the Gluon forward compiled for sm_90 where Triton has Gluon, its waits against the
simulator's rule, its input checks on the CPU, and the producer-warp exercise (planted bugs, other correct producers,
the trace, the native run in a child on Hopper). The simulator and the schedule checker: tests/test_lesson11.py."""
import importlib.util
import re

import pytest

from conftest import ROOT, LaunchRecorder, rejects
from helpers import check, checking
from helpers import lesson11 as L
from helpers.lesson11 import compute, load, release, wait_empty, wait_full
from helpers.lesson11 import hopper as H, pipeline as P, producer as T


def _fix(name):
    """The exact fix of ``name``'s last ❌ (what ``check.hint(name)`` prints)."""
    return checking._LAST_FIX[name][1]

# ------------------------------------------------------------------ Part B: the Gluon forward compiles for sm_90
# What the installed Gluon calls things (Triton 3.6 and 3.7: expect(..., bytes), tma.async_copy_global_to_shared, no
# descriptor.nbytes_per_cta; 3.8 on: bytes_per_cta, tma.async_load, nbytes_per_cta): a producer "as Gluon takes it"
# is written for the Triton that is here (the GPU box has 3.6, this machine's CPU wheel a newer one).
_SIGS = T.gluon_signatures()
_BYTES = list(_SIGS["expect"].parameters)[1]
_ASYNC_LOAD = "tma.async_load" if "async_load" in _SIGS else "tma.async_copy_global_to_shared"
_BLOCK_BYTES = "nbytes_per_cta" if T.descriptor_has_nbytes_per_cta() else "block_type.nbytes"


def _gluon_hopper_api():
    """'' when this Triton has the Gluon Hopper API the kernel uses, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "no triton in this Python"
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared  # noqa: F401
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError as e:
        return f"this triton's Gluon lacks the Hopper API the kernel uses ({e})"
    if not (hasattr(tma, "async_load") or hasattr(tma, "async_copy_global_to_shared")):
        return "this triton's Gluon has no TMA load"
    return ""


_COMPILE = """
import json
from helpers.kernels.gluon_forward import compile_for_sm90
out = {}
# Each kernel at both head dims and dtypes, causal and not, each PINGPONG and tile table, once ("ws" without a mask
# at d = 64 is compiled below, with a learner's producer; "ppp" is "pp" launched on fewer programs: the same code)
for d, dt, var, causal in ((64, "bf16", "one", False), (128, "fp16", "one", True), (128, "fp16", "ws", True),
                           (64, "bf16", "pp", False), (128, "bf16", "ppp", True), (64, "fp16", "overlap", True),
                           (128, "bf16", "pp128", True)):
    ptx = compile_for_sm90(d=d, dtype=dt, variant=var, causal=causal)
    out[f"{d} {dt} {var}{' causal' if causal else ''}"] = [
        k for k in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity", "ex2.approx",
                    "wgmma.wait_group.sync.aligned 1", "div.s32", "%nctaid.x") if k in ptx]
print(json.dumps(out))
"""


@pytest.mark.skipif(bool(_gluon_hopper_api()), reason=_gluon_hopper_api() or "ok")
def test_gluon_forward_compiles_for_sm90():
    """Triton's compiler, no GPU: TTGIR, PTX and a cubin for sm_90, in a child process with the interpreter off
    (Triton decides between its interpreter and its compiler when a kernel is decorated). Every kernel, non-causal
    and causal (the list above says which variant stands for which); GQA is a runtime argument (the KV head is (b*H + h) // group: one integer division in every
    variant)."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    want = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity", "ex2.approx", "div.s32"]
    heavy_first = ["%nctaid.x"]                           # causal: the query block is counted from the grid's end
    # waits for S_j while P_{j-1} V_{j-1} runs; a grid-stride loop over work items (the grid's size: %nctaid.x)
    overlap = want[:4] + ["wgmma.wait_group.sync.aligned 1", "div.s32"] + heavy_first
    assert found == {"64 bf16 one": want, "128 fp16 one causal": want + heavy_first,
                     "128 fp16 ws causal": want + heavy_first, "64 bf16 pp": overlap, "128 bf16 ppp causal": overlap,
                     "64 fp16 overlap causal": overlap, "128 bf16 pp128 causal": overlap}, found


def _kernel_waits(fn_name):
    """The parity expressions of the ``mbarrier.wait(<bar>.index(s), <parity>)`` calls in one of the Gluon kernel's
    functions, read from its source with ``ast`` (no triton needed): {bar: callable(j, NUM_STAGES) -> parity}."""
    import ast
    src = (ROOT / "helpers" / "kernels" / "gluon_forward.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == fn_name)
    waits = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "mbarrier.wait" and \
                isinstance(node.args[0], ast.Call) and ast.unparse(node.args[0].func).endswith(".index"):
            bar = ast.unparse(node.args[0].func).split(".")[0]
            expr = ast.unparse(node.args[1])
            waits[bar] = eval(f"lambda j, NUM_STAGES: {expr}")  # noqa: S307 - the course's own source
    return waits


def test_the_warp_specialised_kernels_waits_follow_the_simulated_rule():
    """The Gluon kernel cannot run here, but its barrier schedule can: its producer's and consumer's parity
    expressions, as written in the kernel, run through the simulator for many ring sizes and tile counts."""
    prod, cons = _kernel_waits("_ws_producer"), _kernel_waits("_tiles_sync")   # "ws"'s consumer runs _tiles_sync
    assert set(prod) == {"empty"} and set(cons) == {"full"}
    single = _kernel_waits("_tiles_sync")                 # so does "one" (REFILL: it refills the stages itself)
    assert set(single) == {"full"} and not _kernel_waits("_attn_fwd") and not _kernel_waits("_ws_consumer")

    def kernel_schedule(num_tiles, num_stages, num_consumers):
        producer = []
        for j in range(num_tiles):
            s = j % num_stages
            producer += [wait_empty(s, prod["empty"](j, num_stages)), load(s, j)]
        out = {"producer": producer}
        for c in range(num_consumers):
            out[f"consumer{c}"] = [op for j in range(num_tiles) for op in
                                   (wait_full(j % num_stages, cons["full"](j, num_stages)), compute(j % num_stages, j),
                                    release(j % num_stages))]
        return out
    for n, s, c in L.random_cases(7, 40) + [(9, 2, 1), (1, 2, 1)]:
        assert L.first_violation(kernel_schedule, n, s, 1) is None, (n, s)
    for j in range(20):                                   # the one-partition kernel waits on full as the consumer does
        assert single["full"](j, 2) == cons["full"](j, 2) == L.expected_parity("full", j // 2)


def test_the_pingpong_kernels_waits_follow_the_simulated_rule():
    """_attn_fwd_pp: its producer and both consumer warpgroups wait with the rule's parities (two consumers, a
    stage freed only after both released it), and each warpgroup's k-th turn waits parity k % 2."""
    prod, cons = _kernel_waits("_pp_producer"), _kernel_waits("_pp_tiles")        # tiles 1.. in _pp_tiles
    assert set(prod) == {"empty"} and set(cons) == {"full", "turn"}
    tile0 = _kernel_waits("_pp_item")                     # an item's tile 0, peeled (no P V before it): the same rule
    assert set(tile0) == {"full", "turn"} and all(tile0["full"](j, 3) == cons["full"](j, 3) and
                                                  tile0["turn"](j, 3) == cons["turn"](j, 3) for j in range(12))

    def kernel_schedule(num_tiles, num_stages, num_consumers):
        out = {"producer": [op for j in range(num_tiles) for op in
                            (wait_empty(j % num_stages, prod["empty"](j, num_stages)), load(j % num_stages, j))]}
        for c in range(num_consumers):
            out[f"consumer{c}"] = [op for j in range(num_tiles) for op in
                                   (wait_full(j % num_stages, cons["full"](j, num_stages)),
                                    compute(j % num_stages, j), release(j % num_stages))]
        return out
    for n, s, _ in L.random_cases(11, 40) + [(9, 3, 2), (1, 3, 2)]:
        assert L.first_violation(kernel_schedule, n, s, 2) is None, (n, s)
    for j in range(8):
        assert cons["turn"](j, 3) == j % 2


# ------------------------------------------------------------------ gluon_forward's input checks, on the CPU
def _gluon_module():
    why = _gluon_hopper_api()
    if why:
        pytest.skip(why)
    from helpers.kernels import gluon_forward
    return gluon_forward


@pytest.mark.parametrize("args, kwargs, err, words", [
    ("list q", {}, TypeError, "q must be a torch.Tensor"),
    ("3d q", {}, ValueError, "q must be [B, H, N, d]"),
    ("float32", {}, TypeError, "bfloat16 or float16"),
    ("mixed dtypes", {}, TypeError, "must share a dtype"),
    ("3 KV heads for 2", {}, ValueError, "H = 2 query heads must be a multiple of Hkv = 3 KV heads"),
    ("other batch", {}, ValueError, "k must be [B, Hkv, Nk, d] = [1, Hkv, Nk, 64]"),
    ("v shape", {}, ValueError, "v must have k's shape"),
    ("d = 32", {}, ValueError, "must be one of 64, 128"),
    ("Nk = 0", {}, ValueError, "at least one query and one key"),
    ("cpu", {}, ValueError, "needs an sm_90 GPU"),
    ("cpu", {"variant": "pingpong"}, ValueError, "variant must be one of auto, one, ws, overlap, pp, pp128"),
    ("cpu", {"sm_scale": "0.1"}, TypeError, "sm_scale must be a Python number"),
    ("cpu", {"blocks": (64, 96, 2)}, ValueError, "BLOCK_N a power of two from 16 to 256"),
    ("cpu", {"blocks": (64, 128)}, ValueError, "blocks must be (BLOCK_M, BLOCK_N, NUM_STAGES)"),
    ("cpu", {"causal": True, "align": "bottom-right"}, ValueError, "align must be 'top_left' or 'bottom_right'"),
    ("3 KV heads for 2", {"causal": True}, ValueError, "must be a multiple of Hkv"),
])
def test_gluon_forward_says_what_is_wrong_before_any_gpu_work(args, kwargs, err, words):
    import torch
    G = _gluon_module()
    bf = dict(dtype=torch.bfloat16)
    q, k, v = (torch.zeros(1, 2, 8, 64, **bf) for _ in range(3))
    inputs = {"list q": ([[0.0]], k, v), "3d q": (q[0], k, v), "float32": (q.float(), k.float(), v.float()),
              "mixed dtypes": (q, k.half(), v),
              "3 KV heads for 2": (q, torch.zeros(1, 3, 8, 64, **bf), torch.zeros(1, 3, 8, 64, **bf)),
              "other batch": (q, torch.zeros(2, 2, 8, 64, **bf), torch.zeros(2, 2, 8, 64, **bf)),
              "v shape": (q, k, torch.zeros(1, 2, 9, 64, **bf)),
              "d = 32": tuple(torch.zeros(1, 2, 8, 32, **bf) for _ in range(3)),
              "Nk = 0": (q, torch.zeros(1, 2, 0, 64, **bf), torch.zeros(1, 2, 0, 64, **bf)), "cpu": (q, k, v)}[args]
    with pytest.raises(err, match=re.escape(words)):
        G.gluon_forward(*inputs, **kwargs)


def test_gluon_forward_uses_the_kernels_shared_constants():
    """qk_scale and the lse's base change come from helpers.kernels.common, not from copies."""
    G = _gluon_module()
    from helpers.kernels import common
    assert G.LOG2E is common.LOG2E and G.LN2 is common.LN2
    src = (ROOT / "helpers" / "kernels" / "gluon_forward.py").read_text()
    assert "1.4426950408889634" not in src and "0.6931471805599453" not in src


# ------------------------------------------------------------------ the Gluon exercise: the producer warp
# Each producer is written to a module file (``@gluon.jit`` reads its source from a file), from the course's own
# lines with one of them replaced: a planted bug, or a correct answer written another way.
_PRODUCER_LINES = {
    "q": "mbarrier.expect(q_bar, q_desc.block_type.nbytes)\n    tma_load(q_desc, [q_row, 0], q_bar, q_smem)",
    "loop": "for j in range(n_tiles):",
    "stage": "s = j % NUM_STAGES",
    "wait": "mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)",
    "expect": "mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)",
    "k": "tma_load(k_desc, [kv_row + j * BLOCK_N, 0], full.index(s), k_smem.index(s))",
    "v": "tma_load(v_desc, [kv_row + j * BLOCK_N, 0], full.index(s), v_smem.index(s))",
}
_PRODUCER_FILE = """from helpers.lesson11.gluon import gluon, gl, mbarrier, tma, tma_load


@gluon.jit
def producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row, kv_row, n_tiles,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    {q}
    {loop}
        {stage}
        {wait}
        {expect}
        {k}
        {v}
"""


def _producer(tmp_path, body=None, stand_ins=False, **lines):
    """A ``@gluon.jit`` producer in its own module: the course's lines, ``lines`` replaced (or a whole ``body``);
    ``stand_ins``: written with the names a machine without Triton gets."""
    import importlib.util as iu
    import uuid
    src = _PRODUCER_FILE.format(**{**_PRODUCER_LINES, **lines}) if body is None else \
        _PRODUCER_FILE.split("    {q}")[0] + body
    if stand_ins:
        src = src.replace("from helpers.lesson11.gluon import gluon, gl, mbarrier, tma, tma_load",
                          "from helpers.lesson11.producer import _STAND_INS\ngluon, gl, mbarrier, tma, tma_load = _STAND_INS")
    path = tmp_path / f"producer_{uuid.uuid4().hex[:8]}.py"
    path.write_text(src)
    spec = iu.spec_from_file_location(path.stem, path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.producer


@pytest.fixture
def no_compile(monkeypatch):
    """The trace's verdicts without the sm_90 compile (one test below runs it for real)."""
    calls = []
    monkeypatch.setattr(T, "compile_producer_for_sm90", lambda p, **kw: calls.append(p) or {"ok": True, "ptx": []})
    monkeypatch.setattr(H, "hopper_here", lambda: "no sm_90 GPU in this test")   # the same verdicts on an H200
    return calls


_LOOP_WAIT = "mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1"
_Q_LINES = _PRODUCER_LINES["q"].replace("\n    ", "\n" + " " * 8)


@pytest.mark.parametrize("lines, words, fix", [
    ({"wait": "mbarrier.wait(empty.index(s), (j // NUM_STAGES) & 1)"}, ["deadlock", "inverted parity"],
     "mbarrier.wait(empty.index(s), (j // NUM_STAGES + 1) % 2)"),
    ({"wait": "mbarrier.wait(empty.index(s), 1)"}, ["overwrite", "parity not flipped on wrap"], ""),
    ({"wait": "mbarrier.wait(empty.index(s), (j & 1) ^ 1)"}, ["flips every tile instead of every lap"], ""),
    ({"wait": "pass"}, ["overwrite", "without waiting for the consumers to release it"],
     "mbarrier.wait(empty.index(s), parity) before the loads into stage s"),
    ({"stage": "s = (j + 1) % NUM_STAGES"}, ["the producer loads tile 0 into stage 1", "s = j % NUM_STAGES"], ""),
    ({"k": "tma_load(k_desc, [j * BLOCK_N, 0], full.index(s), k_smem.index(s))"},
     ["k_desc copied from row", "kv_row is missing", "every head reads the first head's keys"], ""),
    ({"expect": "mbarrier.expect(full.index(s), k_desc.block_type.nbytes)"}, ["expects one tile's bytes"],
     "k_desc.block_type.nbytes + v_desc.block_type.nbytes"),
    ({"expect": "mbarrier.expect(full.index(s), 2 * k_desc.block_type.nbytes + v_desc.block_type.nbytes)"},
     ["more than the two copies bring", "never completes"], ""),
    ({"expect": "pass"}, ["no mbarrier.expect on full.index", "waits forever"], ""),
    ({"expect": "mbarrier.expect(full.index(s), 2 * BLOCK_N * 64 * 2)"},     # right at d = 64 only
     ["two tiles at d = 64", "this case's head dim is d = 128", "read them from the descriptors"], ""),
    ({"k": "tma_load(k_desc, [(kv_row // BLOCK_N + j) * BLOCK_N, 0], full.index(s), k_smem.index(s))",
      "v": "tma_load(v_desc, [(kv_row // BLOCK_N + j) * BLOCK_N, 0], full.index(s), v_smem.index(s))"},
     ["no tile of this head starts there", "kv_row + j * BLOCK_N"], ""),       # kv_row is (b, KV head) * Nk, any row
    ({"v": "tma_load(v_desc, [kv_row + j * BLOCK_N, 0], full.index(s), k_smem.index(s))"},
     ["v_desc's tile lands in k_smem", "V_j to v_smem.index(s)"], ""),
    ({"v": "tma_load(v_desc, [kv_row + j * BLOCK_N, 0], full.index(0), v_smem.index(s))"},
     ["completes full.index(0)", "full.index(s) with k_smem.index(s)"], ""),
    ({"v": "tma_load(v_desc, [kv_row + (j + 1) * BLOCK_N, 0], full.index(s), v_smem.index(s))"},
     ["stage 0 got K_0 and V_1", "one tile index j for both copies"], ""),
    ({"v": "pass"}, ["but not its V", "both completing full.index(s)"], ""),
    ({"q": "tma_load(q_desc, [q_row, 0], q_bar, q_smem)"}, ["q_bar expects 0 bytes"], "mbarrier.expect(q_bar"),
    ({"q": "pass", "stage": "s = j % NUM_STAGES\n        " + _Q_LINES}, ["Q was loaded", "once, before the loop"], ""),
    ({"q": "mbarrier.expect(q_bar, q_desc.block_type.nbytes)\n    tma_load(q_desc, [0, 0], q_bar, q_smem)"},
     ["Q's TMA copy", "q_row is missing"], "tma_load(q_desc, [q_row, 0], q_bar, q_smem)"),
    ({"wait": "mbarrier.wait(full.index(s), 0)"}, ["the producer waits on full.index", "waits only on empty"], ""),
    ({"wait": "mbarrier.arrive(empty.index(s))"}, ["the producer arrives on empty.index", "never arrives"], ""),
    ({"loop": "for j in range(n_tiles + 1):"}, ["copied from row", "one tile past the last"], "range(n_tiles)"),
    ({"stage": "s = j % (NUM_STAGES + 1)"}, ["index(", "the stages are 0.."], ""),
    ({"loop": "for j in gl.program_id(0):"}, ["the trace stopped", "gl.program_id"], ""),
    ({"loop": "for j in gl.range(0, n_tiles):"}, ["the trace stopped", "gl.range: "], ""),    # tl's, not Gluon's
    # issue 37: Q's barrier, pred=, the learner's own order
    ({"q": "pass", "v": _PRODUCER_LINES["v"] + "\n    " + _PRODUCER_LINES["q"]},
     ["deadlock", "waits for Q (q_bar) before its first tile", "Copy Q first, before the loop"], "q_bar, q_smem"),
    ({"wait": _LOOP_WAIT + ", pred=j > NUM_STAGES)"}, ["overwrite", "pred= was False for j = 2", "a race"], ""),
    ({"wait": _LOOP_WAIT + ", pred=j < NUM_STAGES)"}, ["overwrite", "pred= was False for j = 2"], ""),
    ({"v": _PRODUCER_LINES["v"][:-1] + ", pred=j < n_tiles - 1)"},
     ["but not its V: its copy's pred= was False for tile 6", "never completes"], ""),
    ({"expect": _PRODUCER_LINES["expect"][:-1] + ", pred=j > 0)"}, ["no mbarrier.expect", "pred= was False"], ""),
    ({"k": "tma_load(k_desc, [kv_row + s * BLOCK_N, 0], full.index(s), k_smem.index(s))",
      "v": "tma_load(v_desc, [kv_row + s * BLOCK_N, 0], full.index(s), v_smem.index(s))"},
     ["the row uses the stage index s = 0, not the tile's j = 2"], "row = kv_row + j * BLOCK_N"),
    ({"expect": "mbarrier.expect(full.index(s), k_desc.block_type.nbytes)",
      "k": _PRODUCER_LINES["k"] + "\n        mbarrier.expect(full.index(s), v_desc.block_type.nbytes)"},
     ["two expects on full.index(0) for tile 0", "one arrival"], "k_desc.block_type.nbytes + v_desc.block_type.nbytes"),
    ({"expect": "mbarrier.expect(full.index(s), q_desc.block_type.nbytes)"}, ["expects q_desc's bytes"], ""),
    ({"k": "tma_load(k_desc, [kv_row + j * BLOCK_N], full.index(s), k_smem.index(s))"},
     ["the trace stopped", "coordinate [3072] has 1 number", "2-D"], "[row, 0]"),
    ({"k": "tma_load(k_desc, [q_row + j * BLOCK_N, 0], full.index(s), k_smem.index(s))"},
     ["the query block's row, not the KV head's"], "kv_row + j * BLOCK_N"),
    ({"wait": "mbarrier.wait(empty.index(s), (j // NUM_STAGES) % 2 == 0)"}, ["phase is True", "must be an integer"], ""),
    ({"q": "mbarrier.expect(q_bar, q_desc.block_type.nbytes, pred=q_row > 0)\n    "          # the first program
           "tma_load(q_desc, [q_row, 0], q_bar, q_smem, pred=q_row > 0)"}, ["Q was loaded 0 times", "pred= was False"],
     ""),
    ({"loop": "for j in range(gl.cdiv(n_tiles, NUM_STAGES) * NUM_STAGES):", "wait": _LOOP_WAIT + ", pred=j < n_tiles)",
      "k": _PRODUCER_LINES["k"][:-1] + ", pred=j < n_tiles)", "v": _PRODUCER_LINES["v"][:-1] + ", pred=j < n_tiles)"},
     ["bytes that no copy brings", "the copies' pred= was False, the expect's was not"], "one predicate"),
    ({"v": "tma_load(k_desc, [kv_row + j * BLOCK_N, 0], full.index(s), v_smem.index(s))"},
     ["k_desc's tile lands in v_smem"], "tma_load(v_desc, [row, 0], full.index(s), v_smem.index(s))"),
])
def test_producer_planted_bug_rejected(tmp_path, no_compile, lines, words, fix):
    rejects(check.fa3_producer, _producer(tmp_path, **lines), *words)
    assert fix in _fix("fa3_producer")
    assert not no_compile                                  # a producer the trace rejects is never compiled


@pytest.mark.skipif(bool(_gluon_hopper_api()), reason=_gluon_hopper_api() or "ok")
def test_producer_with_triton_36s_tma_name_rejected_where_it_was_removed(tmp_path, no_compile):
    from triton.experimental.gluon.language.nvidia.hopper import tma as real_tma
    if "async_copy_global_to_shared" in T.gluon_signatures():
        pytest.skip("this Triton still has tma.async_copy_global_to_shared")
    assert hasattr(real_tma, "async_load")
    old = "tma_load(k_desc,"
    rejects(check.fa3_producer, _producer(tmp_path, k=_PRODUCER_LINES["k"].replace(old, "tma.async_copy_global_to_shared(k_desc,")),
            "the trace stopped", "this Triton removed it", "tma.async_load")


def _module(tmp_path, src, name="producer"):
    """``name`` from a module of its own written from ``src`` (``@gluon.jit`` reads its source from the file)."""
    import importlib.util as iu
    import uuid
    path = tmp_path / f"producer_{uuid.uuid4().hex[:8]}.py"
    path.write_text(src)
    spec = iu.spec_from_file_location(path.stem, path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def test_producer_not_a_gluon_function_or_another_signature_rejected(tmp_path, no_compile):
    rejects(check.fa3_producer, _producer(tmp_path).fn, "is a plain Python function", "decorate it with @gluon.jit")
    src = _PRODUCER_FILE.format(**_PRODUCER_LINES).replace("q_bar, full, empty, q_row, kv_row", "q_bar, full, empty, kv_row")
    rejects(check.fa3_producer, _module(tmp_path, src.replace("[q_row, 0]", "[0, 0]")), "takes 13 arguments",
            "missing: q_row")


@pytest.mark.parametrize("lines", [
    {},                                                    # the course's
    {"stage": "s = j % NUM_STAGES\n        r = j // NUM_STAGES",
     "wait": "mbarrier.wait(empty.index(s), (r + 1) % 2)"},
    {"k": _PRODUCER_LINES["v"], "v": _PRODUCER_LINES["k"]},          # V before K
    {"expect": "pass", "v": _PRODUCER_LINES["v"] + "\n        " + _PRODUCER_LINES["expect"]},   # expect last
    {"expect": "mbarrier.expect(full.index(s), 2 * k_desc.block_type.nbytes)"},               # K and V alike
    {"wait": "if j >= NUM_STAGES:                                # the ring starts empty: no wait on lap 0\n"
             "            mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)"},
    {"q": "pass", "loop": "tma_load(q_desc, [q_row, 0], q_bar, q_smem)\n    "
                          "mbarrier.expect(q_bar, q_desc.block_type.nbytes)\n    for j in range(n_tiles):"},
    # issue 37: what Gluon takes as written
    {"q": f"mbarrier.expect(q_bar, {_BYTES}=q_desc.block_type.nbytes)\n    "           # Gluon's keyword names
          f"{_ASYNC_LOAD}(tensor_desc=q_desc, coord=[q_row, 0], barrier=q_bar, result=q_smem)",
     "wait": "mbarrier.wait(empty.index(s), phase=((j // NUM_STAGES) & 1) ^ 1)",
     "expect": f"mbarrier.expect(full.index(s), {_BYTES}=k_desc.block_type.nbytes + v_desc.block_type.nbytes)",
     "k": f"{_ASYNC_LOAD}(k_desc, [kv_row + j * BLOCK_N, 0], barrier=full.index(s), result=k_smem.index(s))"},
    {"q": "mbarrier.expect(q_bar, q_desc.block_shape[0] * q_desc.block_shape[1] * q_desc.dtype.primitive_bitwidth "
          "// 8)\n    " + _PRODUCER_LINES["q"].split("\n    ")[1],                           # bytes from the dtype
     "expect": f"mbarrier.expect(full.index(s), k_desc.{_BLOCK_BYTES} + v_desc.{_BLOCK_BYTES})"},
    {"q": _PRODUCER_LINES["q"].replace("mbarrier.", "gl.nvidia.hopper.mbarrier.").replace("tma_load", "gl.nvidia.hopper." + _ASYNC_LOAD),
     "wait": "gl.nvidia.hopper." + _PRODUCER_LINES["wait"]},                                     # the full module path
    {"wait": _LOOP_WAIT.replace("((j // NUM_STAGES) & 1) ^ 1", "(j // NUM_STAGES - 1) & 1") + ", pred=j >= NUM_STAGES)"},
    {"loop": "for j in range(gl.cdiv(n_tiles, NUM_STAGES) * NUM_STAGES):",            # whole laps, pred=
     "stage": "s = j % NUM_STAGES\n        live = j < n_tiles", "wait": _LOOP_WAIT + ", pred=live)",
     "expect": _PRODUCER_LINES["expect"][:-1] + ", pred=live)", "k": _PRODUCER_LINES["k"][:-1] + ", pred=live)",
     "v": _PRODUCER_LINES["v"][:-1] + ", pred=live)"},
    {"q": "pass", "v": _PRODUCER_LINES["v"] + "\n        if j == 0:\n            " +              # Q with tile 0
                       _PRODUCER_LINES["q"].replace("\n    ", "\n            ")},
    {"k": "tma_load(k_desc, (kv_row + j * k_desc.block_type.shape[0], 0), full.index(s), k_smem.index(s))"},
])
def test_producer_written_another_way_passes(tmp_path, no_compile, strict, capsys, lines):
    check.fa3_producer(_producer(tmp_path, **lines))
    out = capsys.readouterr().out
    assert "✅ fa3_producer" in out and "compiles for sm_90" in out and len(no_compile) == 1


_OWN_HELPER_TEMPLATE = """from helpers.lesson11.gluon import gluon, gl, mbarrier, tma, tma_load
import triton.experimental.gluon.language.nvidia.hopper as hopper

TILES_PER_STAGE: gl.constexpr = gl.constexpr(1)


@gluon.jit
def _copy_tile(k_desc, v_desc, row, bar, k_dest, v_dest):
    mbarrier.expect(bar, BYTES=k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [row, 0], bar, k_dest)
    hopper.ASYNC_LOAD(v_desc, [row, 0], barrier=bar, result=v_dest)


@gluon.jit
def producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row, kv_row, n_tiles,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    gl.nvidia.hopper.mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for j in range(n_tiles):
        s = j % NUM_STAGES
        mbarrier.wait(empty.index(s), ((j // (NUM_STAGES * TILES_PER_STAGE)) & 1) ^ 1)
        _copy_tile(k_desc, v_desc, kv_row + j * BLOCK_N, full.index(s), k_smem.index(s), v_smem.index(s))
"""
_OWN_HELPER = _OWN_HELPER_TEMPLATE.replace("BYTES=", _BYTES + "=").replace("ASYNC_LOAD", _ASYNC_LOAD)


@pytest.mark.skipif(bool(_gluon_hopper_api()), reason=_gluon_hopper_api() or "ok")
def test_producer_with_its_own_jit_helper_and_the_hopper_module_passes(tmp_path, no_compile, strict, capsys):
    """A @gluon.jit helper of the learner's own, the Hopper module under its own name, Gluon's keyword names, a
    constexpr global: traced as Gluon runs them; the module the compile rebuilds carries each of them."""
    p = _module(tmp_path, _OWN_HELPER)
    check.fa3_producer(p)
    assert "✅ fa3_producer" in capsys.readouterr().out
    src = T.producer_module_source(p)
    for line in ("import triton.experimental.gluon.language.nvidia.hopper as hopper",
                 "TILES_PER_STAGE = _gl_.constexpr(1)", "@_gluon_.jit\ndef _copy_tile(",
                 "@_gluon_.jit\ndef producer(", "import triton.experimental.gluon.language as gl"):
        assert line in src, (line, src)
    assert src.index("def _copy_tile(") < src.index("def producer(")


def test_producer_trace_binds_gluons_own_signatures():
    """The trace's copies of Gluon's signatures (Triton 3.9's, for a machine without Triton) are that Triton's; an
    older Triton's own are bound where it is installed (the GPU box's 3.6: test_worked_producer_passes there)."""
    if _gluon_hopper_api():
        pytest.skip(_gluon_hopper_api())
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"the copies are Triton 3.9's; this is {triton.__version__}")
    here = T.gluon_signatures()
    for name, sig in T._SIGNATURES.items():
        assert str(here[name]) == str(sig), (name, here[name], sig)


def test_producer_with_a_running_stage_and_phase_passes(tmp_path, no_compile, strict):
    """CUTLASS's style: a (stage, phase) pair carried through the loop, the phase flipped when the stage wraps."""
    body = """    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    s = 0
    phase = 1
    for j in range(n_tiles):
        mbarrier.wait(empty.index(s), phase)
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        row = kv_row + j * BLOCK_N
        tma_load(k_desc, [row, 0], full.index(s), k_smem.index(s))
        tma_load(v_desc, [row, 0], full.index(s), v_smem.index(s))
        s += 1
        if s == NUM_STAGES:
            s = 0
            phase ^= 1
"""
    check.fa3_producer(_producer(tmp_path, body=body))


def test_producer_stub_is_not_attempted(tmp_path, no_compile, not_strict, capsys):
    check.fa3_producer(_producer(tmp_path, body="    raise NotImplementedError('fa3_producer: replace this line')\n"))
    assert "⏳ fa3_producer not attempted yet" in capsys.readouterr().out


def test_producer_traces_without_triton(tmp_path, monkeypatch, strict, capsys):
    """macOS, Windows: the exercise's names are stand-ins; the trace and the simulator still judge it."""
    monkeypatch.setattr(T, "gluon_api", lambda: T._STAND_INS)
    monkeypatch.setattr(H, "hopper_here", lambda: "no Triton, so no Gluon kernel runs")
    producer = _producer(tmp_path, stand_ins=True)
    assert isinstance(producer, T._StandInJit)
    check.fa3_producer(producer)
    out = capsys.readouterr().out
    assert "✅ fa3_producer" in out and "no Triton with Gluon here" in out
    with pytest.raises(RuntimeError, match="runs inside a kernel"):
        producer()
    rejects(check.fa3_producer, _producer(tmp_path, stand_ins=True, wait="mbarrier.wait(empty.index(s), 0)"),
            "inverted parity")


# The native run's child, replaced by stand-ins (no GPU needed): "rows" cases, then "then": done, hang or crash.
_STAND_IN_CHILD = """
import json, os, subprocess, sys, time
open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])     # the group goes too
open(os.environ["PID_FILE"] + ".2", "w").write(str(grandchild.pid))
print("START " + json.dumps({"gpu": "NVIDIA H200"}), flush=True)
rows = json.loads(os.environ["ROWS"])
for row in rows:
    print("ROW " + json.dumps(row), flush=True)
then = os.environ["THEN"]
if then == "hang":
    time.sleep(120)
if then == "crash":
    sys.exit("RuntimeError: CUDA error: an illegal memory access was encountered")
print("DONE " + json.dumps({"cases": len(rows), "worst": 3e-3, "ok": all(r["ok"] for r in rows)}), flush=True)
"""


def _native_stand_in(monkeypatch, tmp_path, rows, then="done", timeout="2"):
    import json
    monkeypatch.setattr(H, "hopper_here", lambda: "")
    monkeypatch.setattr(T, "_NATIVE_CHILD", _STAND_IN_CHILD)
    for k, v in (("PID_FILE", str(tmp_path / "child.pid")), ("ROWS", json.dumps(rows)), ("THEN", then),
                 ("COURSE_NATIVE_TIMEOUT", timeout)):
        monkeypatch.setenv(k, v)
    return tmp_path / "child.pid"


def _wait_gone(pid_file):
    """True once the stand-in child's grandchild is gone (within 5 s)."""
    import time
    pid = int((pid_file.parent / (pid_file.name + ".2")).read_text())
    for _ in range(50):
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def _gone(pid):
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_producer_on_hopper_runs_natively_in_a_child(tmp_path, monkeypatch, strict, capsys):
    """On an sm_90 GPU the checker runs the kernel with the producer in a child process (here a stand-in that
    reports its rows); a failing case is a verdict naming it."""
    ok = {"ok": True, "d": 64, "shape": [1, 2, 2, 9, 9], "causal": False, "err": 1e-3, "bound": 1e-2}
    _native_stand_in(monkeypatch, tmp_path, [ok, ok])
    p = _producer(tmp_path)
    check.fa3_producer(p)
    assert "on this NVIDIA H200 the 'ws' kernel with your producer matches float64 in 2 cases" in \
        capsys.readouterr().out
    bad = {"ok": False, "d": 128, "shape": [1, 8, 2, 300, 333], "causal": "top_left", "err": 0.5, "bound": 0.01}
    _native_stand_in(monkeypatch, tmp_path, [ok, bad])
    rejects(check.fa3_producer, p, "fails 1 of 2 cases", "(1, 8, 2, 300, 333)", "5.00e-01 > bound")
    pid_file = _native_stand_in(monkeypatch, tmp_path, [ok], then="crash")
    rejects(check.fa3_producer, p, "stopped its process after 1 case", "illegal memory access")
    assert _wait_gone(pid_file)


def test_producer_native_run_that_hangs_is_killed_with_a_verdict(tmp_path, monkeypatch):
    """Issue 37: a kernel that never finishes must not freeze the notebook. The child (and its process group) is
    killed once a case runs past COURSE_NATIVE_TIMEOUT, and the verdict says it did not finish."""
    import time
    ok = {"ok": True, "d": 64, "shape": [1, 2, 2, 9, 9], "causal": False, "err": 1e-3, "bound": 1e-2}
    pid_file = _native_stand_in(monkeypatch, tmp_path, [ok], then="hang", timeout="2")
    t0 = time.monotonic()
    rejects(check.fa3_producer, _producer(tmp_path), "did not finish", "after 1 case", "past 2 s",
            "killed its process", "likely deadlock")
    assert time.monotonic() - t0 < 2 + 20                  # the limit, plus the trace's own time
    child, grandchild = int(pid_file.read_text()), int((tmp_path / "child.pid.2").read_text())
    for _ in range(50):
        if _gone(child) and _gone(grandchild):
            break
        time.sleep(0.1)
    assert _gone(child) and _gone(grandchild)


def _on_hopper():
    return H.hopper_here()


@pytest.mark.skipif(bool(_on_hopper()), reason="needs an sm_90 GPU (bench/check_gpu.py runs this file on one)")
def test_producer_runs_natively_on_hopper_and_a_deadlock_is_killed(tmp_path, strict, capsys, monkeypatch):
    """On an H100/H200, for real: the course's producer passes; a producer that deadlocks (an inverted parity,
    given to the native run directly: the trace would reject it) is killed after the limit; the next run passes."""
    import time
    monkeypatch.setenv("COURSE_NATIVE_TIMEOUT", "120")
    good = _producer(tmp_path)
    check.fa3_producer(good)
    assert "matches float64" in capsys.readouterr().out
    t0 = time.monotonic()
    hung = T.run_producer_natively(_producer(tmp_path, wait="mbarrier.wait(empty.index(s), (j // NUM_STAGES) & 1)"),
                                   timeout=30)
    assert hung.get("timeout") == 30 and time.monotonic() - t0 < 30 + 150, hung
    again = T.run_producer_natively(good)
    assert again.get("ok") and "timeout" not in again and len(again["rows"]) == again["cases"], again


@pytest.mark.skipif(bool(_gluon_hopper_api()), reason=_gluon_hopper_api() or "ok")
def test_producer_compiles_for_sm90_or_says_why_not(tmp_path):
    """The compile in a child process, for real: a producer with its own @gluon.jit helper, the Hopper module under
    its own name, Gluon's keyword names and a constexpr global compiles as written (the child rebuilds its module
    from the sources); a name the notebook had but the child does not is the compiler's one-line reason."""
    from helpers.lesson11 import check as C
    good = L.compile_producer_for_sm90(_module(tmp_path, _OWN_HELPER))
    assert good == {"ok": True, "ptx": ["cp.async.bulk.tensor", "mbarrier.try_wait.parity",
                                        "mbarrier.arrive.expect_tx"]}, good
    bad = L.compile_producer_for_sm90(_producer(tmp_path, stage="s = j % STAGES_FROM_THE_NOTEBOOK"))
    assert not bad["ok"] and "STAGES_FROM_THE_NOTEBOOK" in bad["error"], bad
    assert "not in the module the compile rebuilds" in C._compile_hint(bad["error"])
    assert "tma.async_load" in C._compile_hint("RuntimeError: async_copy_global_to_shared has been removed; call "
                                               "async_load instead")


def test_gluon_forward_takes_only_a_gluon_producer_for_ws():
    G = _gluon_module()
    import torch
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="producer must be a @gluon.jit function"):
        G.gluon_forward(q, q, q, producer=lambda *a: None)
    with pytest.raises(ValueError, match="replaces the 'ws' kernel's producer warp; variant is 'pp'"):
        G.gluon_forward(q, q, q, variant="pp", producer=G._ws_producer)


@pytest.mark.parametrize("variant, N, want_grid", [("pp", 4096, (32 * 16,)), ("ppp", 4096, (132,)),
                                                   ("ppp", 200, (2 * 16,)), ("one", 4096, (32, 16))])
def test_forward_launch_binds_every_argument_and_sizes_the_grid(monkeypatch, variant, N, want_grid):
    """gluon_forward's launch on the CPU, the kernels replaced by recorders and the device checks skipped: every
    parameter is bound once; the two-warpgroup kernel gets B*H and a 1-D grid of work items (2 x 64 query rows of
    one head each), one program per item, or ("ppp") one per SM, never more than there are items; the others keep
    the (query blocks, B*H) grid."""
    import torch
    G = _gluon_module()
    calls = []
    monkeypatch.setattr(G, "_check_inputs", lambda *a: None)
    monkeypatch.setattr(G, "_sm_count", lambda device: 132)
    for name in ("_attn_fwd_pp", "_attn_fwd"):
        monkeypatch.setattr(G, name, LaunchRecorder(getattr(G, name).fn, calls))
    B, H, d = 2, 8, 128
    q, k, v = (torch.zeros(B, H, N, d, dtype=torch.bfloat16) for _ in range(3))
    G.gluon_forward(q, k, v, variant=variant, causal=True)
    (_, grid, args), = calls
    assert grid == want_grid
    assert ("BH" in args) == (variant != "one") and args.get("BH", B * H) == B * H and args["CAUSAL"] is True


def test_producer_stage_by_bitmask_is_named_as_the_stage(tmp_path, no_compile):
    """j & (NUM_STAGES - 1) is j % NUM_STAGES only for powers of two: with 3 or 5 stages the first thing wrong is the
    stage both the wait and the load use, not their parity."""
    rejects(check.fa3_producer, _producer(tmp_path, stage="s = j & (NUM_STAGES - 1)"),
            "the consumers read it from stage", "s = j % NUM_STAGES")


def test_ptxas_report_is_kept_and_read_back_not_compiled_again(tmp_path, monkeypatch):
    """The notebook's ptxas report: the first call compiles (a child process, faked here), the next call with the same
    Triton, sources and arguments reads the kept report; other arguments compile again; an error is not kept."""
    import subprocess
    import types
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(T, "gluon_here", lambda: True)
    calls = []
    child_out = "\n".join(['{"triton": "t", "ptxas": "V1"}', "<<pp", "ptxas info : Used 168 registers",
                           "8 bytes spill stores, 8 bytes spill loads", '>>{"variant": "pp", "shared": 1}'])

    def fake_run(args, **kw):
        calls.append(args[3:])
        return types.SimpleNamespace(returncode=0, stdout=child_out, stderr="")
    monkeypatch.setattr(subprocess, "run", fake_run)
    first = H.ptxas_report(variants=("pp",))
    assert len(calls) == 1 and first["rows"][0]["registers"] == 168 and not first.get("cached")
    again = H.ptxas_report(variants=("pp",))
    assert len(calls) == 1 and again["cached"] and again["rows"] == first["rows"]
    assert "earlier" in H.ptxas_lines(again) and "now" in H.ptxas_lines(first)
    H.ptxas_report(variants=("pp",), d=64)
    assert len(calls) == 2, "other arguments: compiled again"
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: types.SimpleNamespace(returncode=1, stdout="",
                                                                                    stderr="boom"))
    assert H.ptxas_report(variants=("one",))["error"] == "boom"
    assert "error" in H.ptxas_report(variants=("one",)), "an error is not kept"
