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


@pytest.mark.parametrize("required, nbval_learner", [("1", False), ("", True), ("0", True)])
def test_check_runs_each_learner_copy_once_where_e2e_is_required(course, required, nbval_learner):
    """`make check` runs the learner copies by nbval only where e2e may skip (no COURSE_E2E_REQUIRED=1); e2e and
    nbval over solutions/ always."""
    _setup_done(course, CUDA_SPEC)
    dry = _make(course, "check", f"COURSE_E2E_REQUIRED={required}").stdout
    lines = dry.splitlines()
    assert any(re.search(r"pytest .*--nbval-lax.* notebooks$", ln) for ln in lines) == nbval_learner, dry
    assert any(ln.rstrip().endswith(" e2e") for ln in lines), dry                  # e2e always
    assert sum("COURSE_STRICT=1" in ln and "--nbval-lax" in ln for ln in lines) + \
        sum(ln.startswith("COURSE_STRICT=1 COURSE_TEST_HIDE") for ln in lines) == 2, dry   # nbval over solutions/


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
