"""Every Triton kernel the course launches compiles for the GPUs learners have, proven without a GPU.

One test per (kernel, target): tests/compile_kernels.py lists the kernels (the tuned ones of helpers/kernels/,
the teaching launchers', the checkers' probes, the worked notebooks' cells) and compiles
each with Triton's own compiler for sm_90 (H100, H200), sm_89 (RTX 40, L4), sm_86 (RTX 30, A10), sm_80 (A100)
and sm_75 (T4): every kernel in its base form on every target, the configurations its launcher keeps where
shared memory prunes them, every constexpr branch once (its docstring says which job proves what). A kernel
passes on a target when every job compiles (TTIR to a cubin through Triton's ptxas) and takes no more shared
memory than one block may have there nor than the launcher's estimate that prunes its configurations. The
interpreter that runs the other tests on a CPU checks none of this.

The compiling runs in two worker processes (tests/compile_kernels.py --drive) with TRITON_INTERPRET off
(tests/conftest.py turns it on for this process, and Triton reads it when a kernel is decorated). They share
every target's jobs, the slowest target (sm_75) first, and each target's results land in pytest's base temp
folder when its last job is done; the workers of ``pytest -n 2`` share that folder, and so does Triton's cache:
nothing is written into the repo. The first test to need a result starts them. The launchers' decisions that
need a GPU's capability (which configurations fit, TMA, bf16) are plain functions, tested at the end for every
target without compiling.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock

pytest.importorskip("triton")  # Linux only (PyPI): nothing to compile with elsewhere

from tests.compile_kernels import MMA_V2, TARGETS, kernels_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT = 900  # seconds to wait for one target's compiles
PARALLEL = 2  # compile workers (CI has two cores)

CASES = [(cc, k) for cc in TARGETS for k in kernels_for(cc)]
MMA_V2_KERNELS = [k for k in kernels_for(MMA_V2[0]) if all(k in kernels_for(cc) for cc in MMA_V2)]
MMA_V2_TEST = "test_mma_v2_targets_take_the_same_shared_memory"  # needs those kernels on sm_80, sm_86, sm_89


def _child_env(cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1", PYTHONUNBUFFERED="1")
    return env


def _selected_kernels(session, cc):
    """The kernels this run's selected tests need on sm_cc (``-k`` may select a few)."""
    wanted = set()
    for item in session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if params.get("cc") == cc or (cc in MMA_V2 and getattr(item, "originalname", None) == MMA_V2_TEST):
            wanted.add(params.get("kernel"))
    return [k for k in kernels_for(cc) if k in wanted]


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, request):
    """``compiled(cc) -> [result, ...]``: one dict per compile (kernel, config, ok, error, shared, seconds).

    The first test to ask starts one driver (tests/compile_kernels.py --drive) for every target at once, with
    two workers; every test, in whichever xdist worker, waits for its target's file."""
    shared_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        shared_dir = shared_dir.parent  # one folder for every xdist worker of this run
    with FileLock(str(shared_dir / "compile.lock")):
        if not (shared_dir / "compile.started").exists():
            plan = {cc: _selected_kernels(request.session, cc) for cc in TARGETS}
            plan = {cc: kernels for cc, kernels in plan.items() if kernels}
            subprocess.Popen([sys.executable, "-m", "tests.compile_kernels", "--drive", str(shared_dir),
                              str(PARALLEL), json.dumps(plan)], cwd=ROOT, env=_child_env(shared_dir / "triton-cache"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            (shared_dir / "compile.started").touch()
    memo = {}

    def get(cc):
        if cc not in memo:
            out, failed = shared_dir / f"compile_sm{cc}.jsonl", shared_dir / f"compile_sm{cc}.failed"
            deadline = time.monotonic() + CHILD_TIMEOUT
            while not (out.exists() or failed.exists()):
                if time.monotonic() > deadline:
                    pytest.fail(f"no compile results for sm_{cc} after {CHILD_TIMEOUT} s", pytrace=False)
                time.sleep(0.5)
            if failed.exists():
                pytest.fail(f"the compile child for sm_{cc} stopped: {failed.read_text()}", pytrace=False)
            memo[cc] = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
        return memo[cc]
    return get


@pytest.mark.parametrize("cc,kernel", CASES, ids=[f"sm_{cc}-{k}" for cc, k in CASES])
def test_kernel_compiles_and_fits(compiled, cc, kernel):
    target = TARGETS[cc]
    results = [r for r in compiled(cc) if r["kernel"] == kernel]
    assert results, f"{kernel}: nothing was compiled for sm_{cc}"
    problems = []
    for r in results:
        where = f"{kernel} [{r['config']}] for sm_{cc} ({target['gpus']})"
        if not r["ok"]:
            problems.append(f"{where} does not compile:\n    {r['error']}")
        elif r["shared"] > target["smem"]:
            problems.append(f"{where} needs {r['shared']} bytes of shared memory; a block may have "
                            f"{target['smem']} there")
        elif r.get("estimate") is not None and r["shared"] > r["estimate"]:
            problems.append(f"{where} needs {r['shared']} bytes of shared memory, more than the launcher's estimate "
                            f"{r['estimate']} (helpers.kernels.common.smem_estimate) that prunes configurations")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kernel", MMA_V2_KERNELS)
def test_mma_v2_targets_take_the_same_shared_memory(compiled, kernel):
    """Triton lowers sm_80, sm_86 and sm_89 alike (mma.sync, cp.async; the targets differ in ptxas and in LLVM's
    SLP vectoriser, which runs after shared memory is allocated): a compile of one configuration gives its shared
    memory on all three. That is what lets tests/compile_kernels.py compile the configurations the 99 KB GPUs keep
    on sm_86 alone and those only sm_80 keeps on sm_80. Every job compiled for several of them (the base forms, the
    same configuration) takes the same shared memory on each."""
    by_job = {}
    for cc in MMA_V2:
        for r in compiled(cc):
            if r["kernel"] == kernel and r["ok"]:
                by_job.setdefault(r["config"], {})[cc] = r["shared"]
    shared = {config: on for config, on in by_job.items() if len(on) > 1}
    assert shared, f"{kernel}: no job compiled for two of sm_80, sm_86, sm_89"
    differ = {config: on for config, on in shared.items() if len(set(on.values())) > 1}
    assert not differ, f"{kernel}: shared memory (bytes) by target differs: {differ}"


# ------------------------------------------------------------------ the launchers' decisions, per target
from helpers.kernels import common as kc, decode as kd, forward as kf  # noqa: E402
import helpers.kernels.backward as tb  # noqa: E402
import helpers.kernels.varlen as tv  # noqa: E402
import helpers.kernels.varlen_backward as tvb  # noqa: E402

# kind -> head dim -> (the autotuner, what its launcher passes besides the tensors)
TUNED = {"fwd": lambda d: (kf._attn_fwd_tuned, {}), "dkdv": lambda d: (tb._bwd_dkdv_tuned[tb._d_class(d)], {}),
         "dq": lambda d: (tb._bwd_dq_tuned[tb._d_class(d)], {})}


def _capability(cc):
    return cc // 10, cc % 10


@pytest.fixture
def on_gpu(monkeypatch):
    """``on_gpu(cc)``: the launchers see a CUDA GPU of compute capability cc with that target's shared memory."""
    def set_target(cc):
        for module in (kc, kd, kf):  # each module's launch decisions read its own names
            monkeypatch.setattr(module, "interpreting", lambda: False)
            monkeypatch.setattr(module, "_device_limits", lambda device: (_capability(cc), TARGETS[cc]["smem"]))
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16)  # what the hooks read of q
    return set_target


@pytest.mark.parametrize("cc", TARGETS, ids=[f"sm_{cc}" for cc in TARGETS])
def test_autotuners_keep_the_configs_that_fit(on_gpu, cc):
    """Each autotuned launcher prunes by the GPU's shared memory: something is left, all of it estimated to fit;
    on sm_90 nothing is pruned (the H200's tuned sets stay as measured); before sm_80 one configuration."""
    q = on_gpu(cc)
    smem = TARGETS[cc]["smem"]
    for kind, tuned in TUNED.items():
        for d in (64, 128, 80) + ((256,) if kind in ("dkdv", "dq") else ()):
            tuner, fixed = tuned(d)
            every = [{**fixed, **kc._config_dict(c)} for c in tuner.configs]
            if cc < 80 and d >= 80 and kind in ("dkdv", "dq"):  # no configuration fits a T4 there
                with pytest.raises(ValueError, match=f"no configuration of the {kind} kernel fits .* 64 KB"):
                    tuner.early_config_prune(tuner.configs, {"Q": q}, HEAD_DIM=d, **fixed)
                continue
            kept = [{**fixed, **kc._config_dict(c)} for c in tuner.early_config_prune(tuner.configs, {"Q": q},
                                                                                     HEAD_DIM=d, **fixed)]
            assert kept, f"{kind}, d={d}: every configuration pruned on sm_{cc}"
            assert kept == kc.launch_configs(kind, d, torch.float16, _capability(cc), smem)
            _check_pruning(kind, d, cc, every, kept)


@pytest.mark.parametrize("cc", TARGETS, ids=[f"sm_{cc}" for cc in TARGETS])
def test_varlen_launchers_time_the_configs_that_fit(monkeypatch, cc):
    """The packed kernels' candidates (``varlen.candidates``, timed once per shape class) are their sets pruned by
    the GPU's shared memory, as the autotuners above: the forward's, the dK/dV and dQ kernels'."""
    monkeypatch.setattr(tv, "interpreting", lambda: False)
    monkeypatch.setattr(tv, "_device_limits", lambda device: (_capability(cc), TARGETS[cc]["smem"]))
    gpu = torch.device("cuda", 0)
    for kind, smem_kind in (("varlen", "varlen"), ("varlen_dkdv", "dkdv"), ("varlen_dq", "dq")):
        for d in (64, 128, 80):
            every = kc.SHAPES[kind](d)
            if cc < 80 and d >= 80 and kind != "varlen":  # no configuration of the backward fits a T4 there
                for length_class in ("long", "short"):
                    with pytest.raises(ValueError, match=f"no configuration of the {smem_kind} kernel fits .* 64 KB"):
                        tv.class_candidates(kind, smem_kind, d, torch.float16, gpu, length_class)
                continue
            kept = tv.candidates(smem_kind, every, d, torch.float16, gpu)
            assert kept, f"{kind}, d={d}: every configuration pruned on sm_{cc}"
            _check_pruning(smem_kind, d, cc, every, kept)
            # a batch of short documents: the same, then on sm_90 its short set, every configuration of it
            assert tv.class_candidates(kind, smem_kind, d, torch.float16, gpu, "long") == kept
            short = tv.class_candidates(kind, smem_kind, d, torch.float16, gpu, "short")
            assert short == kept + (kc.SHAPES[kind + "_short"](d) if cc >= 90 else []), f"{kind}, d={d}, short"
    q = SimpleNamespace(dtype=torch.float16, device=gpu)
    for length_class in ("long", "short"):
        assert cc < 80 or tvb.varlen_bwd_configs(128, q, length_class) == tuple(
            tv.class_candidates(f"varlen_{kind}", kind, 128, q.dtype, gpu, length_class) for kind in ("dkdv", "dq"))


def _check_pruning(kind, d, cc, every, kept):
    smem = TARGETS[cc]["smem"]
    size = {str(c): kc.smem_estimate(kind, c, d, 2, _capability(cc)) for c in every}
    if cc == 90:
        assert kept == every, f"{kind}, d={d}: pruned on sm_90 (the H200's sets must stay as measured)"
    elif cc < 80:
        assert len(kept) == 1, f"{kind}, d={d}: sm_{cc} compiles without tensor cores, one configuration is enough"
        assert size[str(kept[0])] <= smem and all(size[str(c)] > smem for c in every[:every.index(kept[0])])
    else:
        assert all(size[str(c)] <= smem for c in kept), f"{kind}, d={d}: kept one that does not fit sm_{cc}"
        assert all(size[str(c)] > smem for c in every if c not in kept), f"{kind}, d={d}: dropped one that fits"


@pytest.mark.parametrize("cc", TARGETS, ids=[f"sm_{cc}" for cc in TARGETS])
def test_decode_tunes_over_the_configs_that_fit(on_gpu, cc):
    q = on_gpu(cc)
    for d in (64, 128):
        every = kc.launch_configs("decode", d, torch.float16)
        kept = kd._decode_configs(q, d, 64)
        assert kept and all(c in every for c in kept)
        _check_pruning("decode", d, cc, every, kept)


def test_no_config_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="no configuration of the fwd kernel fits .* 48 KB .* head dim 256"):
        kc.fitting_configs("fwd", kc._shapes("fwd", 256), 256, torch.float16, (8, 6), 48 * 1024)


@pytest.mark.parametrize("cc", TARGETS, ids=[f"sm_{cc}" for cc in TARGETS])
def test_tma_only_from_sm90(cc):
    for dtype in (torch.float16, torch.bfloat16):
        assert kc.use_tma_for(_capability(cc), dtype) == (cc >= 90 and kc.TensorDescriptor is not None)
    assert not kc.use_tma_for(_capability(cc), torch.float32)


@pytest.mark.parametrize("cc", TARGETS, ids=[f"sm_{cc}" for cc in TARGETS])
def test_bf16_refused_where_the_gpu_has_none(cc):
    kc.check_dtype_for(_capability(cc), torch.float16)
    if TARGETS[cc]["bf16"]:
        kc.check_dtype_for(_capability(cc), torch.bfloat16)
    else:
        with pytest.raises(ValueError, match=f"bfloat16 needs .* 8.0 .* sm_{cc} .* use torch.float16"):
            kc.check_dtype_for(_capability(cc), torch.bfloat16)


@pytest.mark.parametrize("cc", [cc for cc in TARGETS if cc < 90], ids=[f"sm_{cc}" for cc in TARGETS if cc < 90])
def test_use_tma_true_before_sm90_is_a_clear_error(on_gpu, cc):
    q = on_gpu(cc)
    with pytest.raises(ValueError, match=f"use_tma=True needs TMA .* sm_{cc}"):
        kf._check_use_tma(True, q)
    kf._check_use_tma(False, q)
    assert not kf._use_tma_default(q)


@pytest.mark.parametrize("cc", TARGETS, ids=[f"sm_{cc}" for cc in TARGETS])
def test_block_sparse_launcher_keeps_the_configs_that_fit(monkeypatch, cc):
    """Lesson 12's block-sparse forward: the block mask fixes its tile (``block_sparse_tiles`` picks the first
    configuration that fits), the forward autotunes num_warps and num_stages over the configurations of that tile
    that fit, the backward starts from the first. Its configurations are pruned with the dense forward's estimate
    (``block_sparse.SMEM_KIND``), which its compile jobs check."""
    import helpers.kernels.block_sparse as kb
    monkeypatch.setattr(kb, "interpreting", lambda: False)
    monkeypatch.setattr(kb, "_device_limits", lambda device: (_capability(cc), TARGETS[cc]["smem"]))
    for d in (64, 128):
        every = kb.launch_configs_block_sparse(d, torch.float16)
        kept = kb.launch_configs_block_sparse(d, torch.float16, _capability(cc), TARGETS[cc]["smem"])
        _check_pruning(kb.SMEM_KIND, d, cc, every, kept)
        tiles = kb.block_sparse_tiles(d, torch.float16, "cuda")
        assert tiles == (kept[0]["BLOCK_M"], kept[0]["BLOCK_N"])
        same_tile = [c for c in kept if (c["BLOCK_M"], c["BLOCK_N"]) == tiles]
        assert kb._tile_configs(*tiles, d, torch.float16, torch.device("cuda", 0)) == same_tile
        tuned = [c for c in kb._attn_fwd_block_sparse_tuned.configs]
        q = SimpleNamespace(dtype=torch.float16, device=torch.device("cuda", 0))  # what the pruner reads
        pruned = kb._prune_to_tile(tuned, dict(Q=q), BLOCK_M=tiles[0], BLOCK_N=tiles[1], HEAD_DIM=d)
        assert sorted((c.num_warps, c.num_stages) for c in pruned) == \
            sorted((c["num_warps"], c["num_stages"]) for c in same_tile)
        if cc < 80:  # the backward fits no tile on a T4: a clear error, not a compile failure
            with pytest.raises(ValueError, match="no tile of the block-sparse backward fits .* 64 KB"):
                kb.block_sparse_tiles(d, torch.float16, "cuda", backward=True)
            continue
        bm, bn = kb.block_sparse_tiles(d, torch.float16, "cuda", backward=True)
        cfg = kb._tile_configs(bm, bn, d, torch.float16, torch.device("cuda", 0))[0]
        bwd = kb.bwd_configs(cfg, d, torch.float16, _capability(cc), TARGETS[cc]["smem"])
        assert max(kc.smem_estimate(k, bwd, d, 2, _capability(cc)) for k in ("dkdv", "dq")) <= TARGETS[cc]["smem"]
