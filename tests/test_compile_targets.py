"""Every Triton kernel the course launches compiles for the GPUs learners have, proven without a GPU.

One test per (kernel, target): tests/compile_kernels.py lists the kernels (the tuned ones of helpers/triton_*.py,
the teaching launchers', the checkers' probe, the worked notebooks' cells, the tests' planted bugs) and compiles
each with Triton's own compiler for sm_90 (H100, H200), sm_89 (RTX 40, L4), sm_86 (RTX 30, A10), sm_80 (A100)
and sm_75 (T4), in the configurations the launcher would use there. A kernel passes on a target when every
configuration compiles (TTIR to a cubin through Triton's ptxas) and takes no more shared memory than one block
may have there. The interpreter that runs the other tests on a CPU checks neither.

The compiling runs in one child process per target, with TRITON_INTERPRET off (tests/conftest.py turns it
on for this process, and Triton reads it when a kernel is decorated). Its results are kept in pytest's base
temp folder behind a file lock, so that the workers of ``pytest -n 2`` share one child per target; Triton's
cache goes there too, never into the repo. The launchers' decisions that need a GPU's capability (which
configurations fit, TMA, bf16) are plain functions, tested here for every target without compiling.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from tests.compile_kernels import TARGETS, kernels_for

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT = 900  # seconds for one target's compiles (CI: about a minute for sm_75, seconds for the others)

CASES = [(cc, k) for cc in TARGETS for k in kernels_for(cc)]


def _child_env(cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1", PYTHONUNBUFFERED="1")
    return env


def _selected_kernels(session, cc):
    """The kernels this run's selected tests need on sm_cc (all of them under ``-k`` that selects none)."""
    wanted = [item.callspec.params["kernel"] for item in session.items
              if hasattr(item, "callspec") and item.callspec.params.get("cc") == cc]
    return [k for k in kernels_for(cc) if k in wanted] or kernels_for(cc)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, request):
    """``compiled(cc) -> [result, ...]``: one dict per compile (kernel, config, ok, error, shared, seconds)."""
    shared_dir = tmp_path_factory.getbasetemp().parent  # one folder for every xdist worker of this run
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        shared_dir = tmp_path_factory.getbasetemp()
    memo = {}

    def get(cc):
        if cc not in memo:
            out = shared_dir / f"compile_sm{cc}.jsonl"
            with FileLock(str(out) + ".lock"):
                if not out.exists():
                    kernels = _selected_kernels(request.session, cc)
                    proc = subprocess.run([sys.executable, "-m", "tests.compile_kernels", str(cc), *kernels], cwd=ROOT,
                                          env=_child_env(shared_dir / "triton-cache"), capture_output=True,
                                          text=True, timeout=CHILD_TIMEOUT)
                    if proc.returncode != 0:
                        pytest.fail(f"the compile child for sm_{cc} stopped (exit {proc.returncode}):\n"
                                    f"{proc.stderr[-4000:]}", pytrace=False)
                    tmp = out.with_suffix(".tmp")
                    tmp.write_text(proc.stdout)
                    tmp.replace(out)
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
    assert not problems, "\n".join(problems)


def test_every_kernel_has_a_test(compiled):
    """A compile whose kernel name no test asks for would be checked by nobody."""
    names = {r["kernel"] for r in compiled(90)}
    assert names == set(kernels_for(90)), f"compiled but not tested: {names - set(KERNELS)}; " \
                                  f"tested but never compiled: {set(kernels_for(90)) - names}"
