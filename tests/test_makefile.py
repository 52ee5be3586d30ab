"""The Makefile's switches, read with `make -n` (print the commands, run nothing) on a throwaway copy.

A copy of the Makefile, pyproject.toml and the JupyterLab overrides sits in a temporary folder with a
pretend `.venv/`: what a `make setup` left behind is simulated by writing its torch spec and its stamp.
"""
import json
import re
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

CUDA_SPEC = "torch>=2.11,<2.15"


def _make(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=folder, capture_output=True,
                          text=True, timeout=60)


def _setup_done(folder: Path, torch: str, index: str = ""):
    """Leave behind what `make setup TORCH=torch TORCH_INDEX=index` leaves: its spec and its stamp."""
    dry = _make(folder, "setup", f"TORCH={torch}", f"TORCH_INDEX={index}").stdout
    stamps = re.findall(r"^touch (\S+)$", dry, re.M)
    assert len(stamps) == 1, dry
    (folder / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    for old in (folder / ".venv" / "bin").glob(".installed*"):
        old.unlink()
    (folder / ".venv" / "torch-spec").write_text(f"{torch}\n{index}\n")
    (folder / stamps[0]).touch()
    overrides = folder / ".venv/share/jupyter/lab/settings/overrides.d/flash-attention-course.json"
    overrides.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "jupyterlab-overrides.json", overrides)


@pytest.fixture
def course(tmp_path):
    for name in ("Makefile", "pyproject.toml", "jupyterlab-overrides.json"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_a_fresh_setup_installs_the_default_torch_and_the_lab_settings(course):
    out = _make(course, "setup").stdout
    assert 'pip install --quiet "torch==2.13.0"' in out
    assert "jupyterlab-overrides.json .venv/share/jupyter/lab/settings/overrides.d/" in out


def test_setup_again_with_the_same_torch_has_nothing_to_do(course):
    _setup_done(course, "torch==2.13.0")
    for args in ([], ["TORCH=torch==2.13.0"]):
        r = _make(course, "setup", *args)
        assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr, (args, r.stdout)


def test_setup_with_another_torch_installs_it_in_place_of_the_old_one(course):
    _setup_done(course, "torch==2.13.0")
    out = _make(course, "setup", f"TORCH={CUDA_SPEC}").stdout
    assert f'pip install --quiet "{CUDA_SPEC}"' in out                 # before: "Nothing to be done"
    assert "pip uninstall --yes --quiet torch" in out                   # else pip keeps the CPU torch
    out = _make(course, "setup", "TORCH_INDEX=https://download.pytorch.org/whl/cpu").stdout
    assert '--index-url "https://download.pytorch.org/whl/cpu"' in out


def test_later_targets_keep_the_torch_the_last_setup_installed(course):
    _setup_done(course, CUDA_SPEC)                     # the learner's GPU setup
    r = _make(course, "setup")                         # e.g. `make lab` later, without TORCH=
    assert "Nothing to be done" in r.stdout + r.stderr, r.stdout
    assert "pip install" not in _make(course, "lab").stdout


@pytest.mark.parametrize("value, forced", [("0", False), ("no", False), ("false", False), ("", False),
                                           ("1", True), ("yes", True), ("TRUE", True), ("on", True)])
def test_force_means_what_it_says(course, value, forced):
    _setup_done(course, "torch==2.13.0")
    out = _make(course, "notebooks", f"FORCE={value}").stdout
    assert "helpers.generate" in out and ("--force" in out) == forced, out


def test_an_unknown_force_value_is_an_error(course):
    _setup_done(course, "torch==2.13.0")
    r = _make(course, "notebooks", "FORCE=maybe")
    assert r.returncode != 0 and "FORCE=maybe: use FORCE=1 or FORCE=0" in r.stderr
    assert "helpers.generate" not in r.stdout


def test_grade_verbose_asks_for_the_hints(course):
    _setup_done(course, "torch==2.13.0")
    assert "--verbose" in _make(course, "grade", "VERBOSE=1").stdout
    assert "--verbose" not in _make(course, "grade", "VERBOSE=0").stdout


def test_the_lab_settings_turn_off_the_news_popup():
    settings = json.loads((ROOT / "jupyterlab-overrides.json").read_text())
    assert settings["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false",
                                                                       "checkForUpdates": False}


def test_this_venvs_jupyterlab_starts_without_the_news_popup(tmp_path):
    """The defaults the venv's JupyterLab serves to a user with no settings of their own (`tmp_path`)."""
    from jupyterlab.commands import get_app_dir
    from jupyterlab_server.settings_utils import get_settings
    app_dir = Path(get_app_dir())
    assert app_dir.resolve().is_relative_to(Path(sys.prefix).resolve()), f"{app_dir}: not this venv's lab"
    setting, _ = get_settings(str(app_dir / "settings"), str(app_dir / "schemas"), str(tmp_path),
                              schema_name="@jupyterlab/apputils-extension:notification")
    defaults = {k: v["default"] for k, v in setting["schema"]["properties"].items()}
    # "none" (JupyterLab's own default) pops up "Would you like to get notified about official Jupyter news?"
    assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, \
        "this venv's JupyterLab lacks the course's overrides: run `make setup`"


@pytest.mark.parametrize("required, lab_here, nbval_learner", [("1", False, False), ("", False, True),
                                                                ("0", False, True), ("", True, False)])
def test_check_runs_each_learner_copy_once(course, required, lab_here, nbval_learner):
    """`make check` runs the learner copies by nbval only where e2e cannot run them: not with COURSE_E2E_REQUIRED=1,
    nor where e2e/conftest.py's look-up (a pretend venv Python here) finds the lab can run, after which e2e is required
    (a browser found then is not skipped later). nbval over solutions/ and e2e always, in the same pytest session."""
    _setup_done(course, CUDA_SPEC)
    worked = {p.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")}
    (course / "solutions").mkdir()
    for name in worked:
        (course / "solutions" / name).touch()
    if lab_here:
        python = course / ".venv" / "bin" / "python"
        python.write_text('#!/bin/sh\n[ "$1" = e2e/conftest.py ] && echo 1\n')
        python.chmod(0o755)
    dry = _make(course, "check", f"COURSE_E2E_REQUIRED={required}").stdout
    [run] = [ln for ln in dry.splitlines() if " e2e.notebook_runs " in ln]
    assert run.endswith(" notebooks e2e" if nbval_learner else ".ipynb e2e"), run      # e2e always
    assert run.startswith("COURSE_E2E_REQUIRED=1 ") != nbval_learner, run
    assert "--nbval-lax" in run and '--triton-lessons="07 08 10"' in run, run
    assert {p.split("/")[-1] for p in run.split() if p.startswith("solutions/")} == worked, run  # nbval over solutions/


def test_the_notebook_plugin_gives_each_kernel_its_variables(tmp_path):
    """e2e/notebook_runs.py (the plugin of `make check-solutions` and `make check`) starts a worked notebook's kernel
    with COURSE_STRICT=1 and, but for the --triton-lessons, `import triton` failing; a learner copy's with neither."""
    import nbformat
    from importlib.util import find_spec
    no_triton_here = find_spec("triton") is None
    for path, strict, hidden in [("solutions/01_a.ipynb", True, True), ("solutions/07_a.ipynb", True, False),
                                 ("notebooks/01_a.ipynb", False, False)]:
        (tmp_path / path).parent.mkdir(exist_ok=True)
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
            "import os, importlib.util\n"
            f"assert (os.environ.get('COURSE_STRICT') == '1') == {strict}, os.environ.get('COURSE_STRICT')\n"
            f"assert (importlib.util.find_spec('triton') is None) == {hidden or no_triton_here}")]), tmp_path / path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-p", "e2e.notebook_runs", "--triton-lessons=07 08 10", "--nbval-lax", "--nbval-current-env",
                        "solutions", "notebooks"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("uid, root", [("0", True), ("1000", False)])
def test_lab_starts_as_root_too_and_opens_the_start_notebook(course, tmp_path, uid, root):
    """As root (a container, a cloud GPU box) JupyterLab refuses to start without --allow-root: `make lab` adds it
    for root only (`id -u` is faked here), and opens the lab at the start notebook; LAB_ARGS reach the lab."""
    _setup_done(course, "torch==2.13.0")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (fake / "id").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["make", "-n", "--no-print-directory", "lab", "LAB_ARGS=--no-browser --port 8888"],
                         cwd=course, capture_output=True, text=True, timeout=60, env=env).stdout
    [line] = [ln for ln in out.splitlines() if "jupyter lab" in ln]
    assert ("--allow-root" in line) == root, line
    assert line.endswith("--no-browser --port 8888 notebooks/00_start_here.ipynb"), line


def test_the_course_lab_saves_every_15_seconds():
    settings = json.loads((ROOT / "jupyterlab-overrides.json").read_text())
    assert settings["@jupyterlab/docmanager-extension:plugin"] == {"autosave": True, "autosaveInterval": 15}
