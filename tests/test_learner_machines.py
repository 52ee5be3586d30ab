"""The course on learners' machines: without Triton (macOS, Windows), and opened outside the course.

Notebooks run in a real Jupyter kernel (nbclient) started with ``tests/hide_modules`` on PYTHONPATH:
its ``sitecustomize`` makes ``import triton`` (or ``import helpers``) fail as where it is not installed.
Lessons 01-06 and 09 must pass strict without Triton; lesson 07 must say so in one sentence, show the
recorded H200 results and stop, with no traceback; lessons 08 and 10 likewise at their GPU sections, after
their CPU exercises passed.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from packaging.requirements import Requirement

from conftest import ROOT
from helpers.lesson07 import NO_TRITON
from helpers.lesson08.gpu_section import NO_TRITON as NO_TRITON_08
from helpers.lesson10 import NO_TRITON as NO_TRITON_10

HIDE = ROOT / "tests" / "hide_modules"
WORKED = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
NOT_A_TRACEBACK = ("Traceback", "File \"", "----> ", "Cell In[")


@pytest.fixture
def hide(monkeypatch):
    """hide("triton"): kernels started from now on cannot import triton."""
    def hide(*names):
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HIDE), str(ROOT)]))
        monkeypatch.setenv("COURSE_TEST_HIDE", ",".join(names))
    return hide


def _run(path: Path, timeout=600):
    """Execute a copy of the notebook in memory; return it and the CellExecutionError that stopped it."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                        # a worked notebook carries its outputs: start clean
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        return nb, e
    return nb, None


def _outputs(cell, kind):
    return [o for o in cell.get("outputs", []) if o.get("output_type") == kind]


# ------------------------------------------------------------------ the dependency list
def test_triton_is_a_linux_only_dependency():
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    [triton] = [r for r in deps if r.name == "triton"]
    env = lambda platform: {"sys_platform": platform}  # noqa: E731
    assert triton.marker is not None, "triton must carry an environment marker: PyPI has no macOS/Windows wheels"
    assert triton.marker.evaluate(env("linux"))
    assert not triton.marker.evaluate(env("darwin")) and not triton.marker.evaluate(env("win32"))


def test_the_hiding_works(hide):
    hide("triton")
    code = ("import importlib.util, torch, helpers.check\n"
            "assert importlib.util.find_spec('triton') is None\n"
            "try:\n    import triton\nexcept ModuleNotFoundError as e:\n    print('hidden', e.name)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=os.environ.copy())
    assert r.returncode == 0 and r.stdout.strip() == "hidden triton", r.stderr


# ------------------------------------------------------------------ TRITON_INTERPRET
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "on", "ON", "yes", "Y", "y",
                                   "0", "false", "off", "no", "", " 1", "2", "enable"])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value):
    pytest.importorskip("triton")
    from triton._C.libtriton import getenv_bool      # what Triton itself decides
    from helpers.triton_mode import interpreting
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == getenv_bool("TRITON_INTERPRET", False), value


# ------------------------------------------------------------------ every worked notebook without Triton
def test_make_check_runs_every_lesson_without_a_gpu_part_with_triton_hidden():
    """`make check-solutions` runs each worked notebook but 07, 08, 10 with `import triton` failing
    (strict: every exercise must pass), so that one nbval run is also the no-Triton run. The kernels get their
    variables from e2e/notebook_runs.py, given the Makefile's TRITON_LESSONS."""
    if shutil.which("make") is None:
        pytest.skip("needs GNU make")
    dry = subprocess.run(["make", "-n", "--no-print-directory", "check-solutions", f"BIN={Path(sys.executable).parent}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.replace("\\\n", " ")
    [run] = [line for line in dry.splitlines() if "nbval" in line]
    assert "-p e2e.notebook_runs " in run, run
    lessons = set(run.split('--triton-lessons="', 1)[1].split('"', 1)[0].split())
    spec = importlib.util.spec_from_file_location("notebook_runs", ROOT / "e2e" / "notebook_runs.py")
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    envs = {p.name: runs.kernel_env(ROOT / p, lessons) for p in map(Path, run.split()) if p.suffix == ".ipynb"}
    assert set(envs) == {p.name for p in WORKED}, run
    assert all(env["COURSE_STRICT"] == "1" for env in envs.values()), envs
    hidden = {name for name, env in envs.items()
              if env.get("COURSE_TEST_HIDE") == "triton" and env["PYTHONPATH"].split(os.pathsep)[0] == str(HIDE)}
    gpu = {p.name for p in WORKED if p.name.startswith(("07_", "08_", "10_"))}
    assert hidden == {p.name for p in WORKED} - gpu
    assert not any("COURSE_TEST_HIDE" in envs[name] for name in gpu), envs


def test_lesson_08_without_triton_runs_its_cpu_part_then_shows_the_h200_results_and_stops(hide, monkeypatch):
    hide("triton")
    monkeypatch.setenv("COURSE_STRICT", "1")
    nb, error = _run(ROOT / "solutions" / "08_backward_pass.ipynb")
    assert error is not None and error.ename == "TritonMissing", error
    code = [c for c in nb.cells if c.cell_type == "code"]
    [stop] = [i for i, c in enumerate(code) if _outputs(c, "error")]
    assert "require_triton()" in code[stop].source and "check.dkdv_inner" not in code[stop].source
    before = "".join(o.get("text", "") for c in code[:stop] for o in _outputs(c, "stream"))
    for name in ("attn_bwd_preprocess", "flash_attn_bwd", "FlashAttentionFunction"):   # the CPU exercises ran
        assert f"✅ {name} passed:" in before, name
    text = "".join(o["text"] for o in _outputs(code[stop], "stream") if o["name"] == "stdout")
    assert text.startswith(NO_TRITON_08 + "\n") and "NVIDIA H200" in text
    [err] = _outputs(code[stop], "error")
    assert not any(s in line for line in err["traceback"] for s in NOT_A_TRACEBACK)
    assert all(not c.get("outputs") for c in code[stop + 1:]), "Run All must stop at the GPU section"


def test_lesson_10_without_triton_runs_its_exercises_then_shows_the_recorded_figures_and_stops(hide, monkeypatch):
    hide("triton")
    monkeypatch.setenv("COURSE_STRICT", "1")
    nb, error = _run(ROOT / "solutions" / "10_serving.ipynb")
    assert error is not None and error.ename == "TritonMissing", error
    code = [c for c in nb.cells if c.cell_type == "code"]
    [stop] = [i for i, c in enumerate(code) if _outputs(c, "error")]
    assert "require_triton()" in code[stop].source
    before = "".join(o.get("text", "") for c in code[:stop] for o in _outputs(c, "stream"))
    for name in ("varlen_block_map", "gather_kv"):                         # the CPU exercises ran
        assert f"✅ {name} passed:" in before, name
    text = "".join(o["text"] for o in _outputs(code[stop], "stream") if o["name"] == "stdout")
    assert text.startswith(NO_TRITON_10 + "\n") and "NVIDIA H200" in text and "decode" in text
    [err] = _outputs(code[stop], "error")
    assert not any(s in line for line in err["traceback"] for s in NOT_A_TRACEBACK)
    assert all(not c.get("outputs") for c in code[stop + 1:]), "Run All must stop at the serving step"


@pytest.mark.parametrize("folder", ["notebooks"])      # the worked copy stops at the same cell
def test_lesson_07_without_triton_says_so_shows_the_h200_results_and_stops(folder, hide):
    hide("triton")
    nb, error = _run(ROOT / folder / "07_triton_gpu.ipynb")
    assert error is not None and error.ename == "TritonMissing", error
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "course-setup" in code[0].metadata.get("tags", []) and not _outputs(code[0], "error")
    first = code[1]                                                           # the lesson's imports
    assert "lesson07.require_triton()" in first.source
    text = "".join(o["text"] for o in _outputs(first, "stream") if o["name"] == "stdout")
    assert text.startswith(NO_TRITON + "\n")                                  # the one sentence, first
    assert "NVIDIA H200" in text and "prefill, geomean over N >= 2048" in text and "Triton / SDPA flash:" in text
    assert "decode, GB/s" in text and "median" in text
    assert len([o for o in _outputs(first, "display_data") if "image/png" in o["data"]]) == 2   # both plots
    assert not [o for o in _outputs(first, "stream") if o["name"] == "stderr"]
    [err] = _outputs(first, "error")
    assert err["traceback"] == ["Run All stops here: the rest of this notebook needs Triton, which this "
                                "Python does not have."]
    assert not any(s in line for line in err["traceback"] for s in NOT_A_TRACEBACK)
    assert all(not c.get("outputs") for c in code[2:]), "Run All must stop at the imports cell"
    # `make grade` reads this stop as its own (tests/test_grade.py: exercises after a deliberate stop are ➖ with its
    # reason): both exercises come after it
    from helpers import grade
    at, why = grade._stop(nb)
    assert nb.cells[at] is first and "needs Triton" in why                     # grade: "not run here: <why>"
    assert [name for i, name in grade.exercises_in(nb) if i > at] == ["flash_attn_triton", "flash_decode_triton"]


# ------------------------------------------------------------------ opened outside the course
def test_a_notebook_that_cannot_fetch_the_course_stops_in_one_line(hide, tmp_path, monkeypatch):
    """Opened on its own where the course cannot be fetched (no network, a wrong COURSE_URL), the set-up cell stops
    with one line naming the step that failed, not a traceback (tests/test_hosted.py fetches it for real)."""
    hide("helpers")
    monkeypatch.setenv("COURSE_URL", str(tmp_path / "no-such-repository"))
    shutil.copy(ROOT / "notebooks" / "01_online_softmax.ipynb", tmp_path)   # a copy on its own
    nb, error = _run(tmp_path / "01_online_softmax.ipynb")
    assert error is not None and error.ename == "SystemExit"
    assert "set-up stopped: `git clone --quiet --depth 1" in error.evalue
    first = next(c for c in nb.cells if c.cell_type == "code")
    shown = "".join(o.get("text", "") for o in first.outputs)
    assert "`helpers` is not in this Python: fetching the course from" in shown
