"""How the course's notebooks and browser tests run, in one pytest session or several (``-p e2e.notebook_runs``).

`make check-solutions`, `make check-notebooks` and `make e2e` run their part through this plugin; `make check` runs all
of them as one session, so that pytest-xdist balances the notebooks under nbval and the browser tests together.

- A notebook under nbval keeps its cells on one worker, in order; every other test goes out on its own
  (``--dist loadscope``, a notebook being the one scope that holds more than one test).
- A worked notebook's kernel runs strict (``COURSE_STRICT=1``: every exercise must pass) and, but for the lessons named
  by ``--triton-lessons`` (those whose GPU part needs Triton), with ``import triton`` failing (``tests/hide_modules``),
  as on macOS and Windows: one run proves both that it passes and that it needs no Triton. The variables are given to
  the kernel as nbval starts it (the first cell's setup), so one session holds both kinds; a learner copy's kernel,
  and everything else, gets neither.
- The work goes out longest first (with ``--no-loadscope-reorder``, xdist keeps this order): the notebook runs by an
  estimate of their seconds on a 2-core machine (``SECONDS``: weights, only their order matters), the site's build
  with its first test, then the short tests. A long run started last would leave the other worker idle to the end;
  a weight gone stale costs balance, never a test.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HIDE = ROOT / "tests" / "hide_modules"

# Scheduling weights: about how many seconds each notebook's run takes, by lesson, on a 2-core machine running two
# workers (only their order matters; not a record: bench/results/check_times.json has what make check took): under
# nbval (its cells summed), and in JupyterLab (e2e/test_notebooks_in_lab.py; lesson 01's learner copy runs in the
# first-exercise test instead).
SECONDS = {
    "solutions": {"00": 8, "01": 11, "02": 21, "03": 15, "04": 15, "05": 13, "06": 13, "07": 24, "08": 45,
                  "09": 16, "10": 17, "11": 11, "12": 28},
    "notebooks": {"00": 4, "01": 4, "02": 7, "03": 7, "04": 9, "05": 7, "06": 6, "07": 7, "08": 24, "09": 9,
                  "10": 10, "11": 28, "12": 11},
    "lab": {"00": 10, "02": 16, "03": 17, "04": 20, "05": 14, "06": 18, "07": 17, "08": 32, "09": 16,
            "10": 18, "11": 40, "12": 24},
}
FIRST_EXERCISE_SECONDS = 33     # lesson 01 in the lab, the answer typed in, two runs of `make grade`
INSPECTOR_SECONDS = 8           # the planted notebook in the lab
SITE_BUILD_SECONDS = 25         # site/build.py, run by the first test that needs the built site
OTHER_SECONDS = 1


def pytest_addoption(parser):
    parser.addoption("--triton-lessons", default="", metavar="NN NN ...",
                     help="the lessons whose worked notebook runs with Triton; every other one runs without")


def _lesson(path: Path) -> str:
    return path.name[:2]


def kernel_env(path: Path, triton_lessons: set[str]) -> dict[str, str]:
    """The variables the kernel of the notebook at ``path`` gets on top of the session's."""
    if path.parent.name != "solutions":
        return {}
    env = {"COURSE_STRICT": "1"}
    if _lesson(path) not in triton_lessons:
        env["COURSE_TEST_HIDE"] = "triton"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HIDE), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _is_notebook_cell(item) -> bool:
    return item.path.suffix == ".ipynb"


def _unit_of(nodeid: str) -> str:
    """What goes to one worker as one: a notebook's cells, else the test."""
    path = nodeid.split("::", 1)[0]
    return path if path.endswith(".ipynb") else nodeid


def _unit(item) -> str:
    return _unit_of(item.nodeid)


def _seconds(item, site_build: list) -> float:
    if _is_notebook_cell(item):
        return SECONDS.get(item.path.parent.name, {}).get(_lesson(item.path), OTHER_SECONDS)
    name = getattr(item, "originalname", item.name)
    if name == "test_notebook_runs_in_jupyterlab":
        return SECONDS["lab"].get(_lesson(Path(item.callspec.params["notebook"])), OTHER_SECONDS)
    if name.startswith("test_the_first_exercise"):
        return FIRST_EXERCISE_SECONDS
    if name == "test_the_inspector_sees_each_planted_problem":
        return INSPECTOR_SECONDS
    if "site" in getattr(item, "fixturenames", ()) and not site_build:
        site_build.append(item)
        return SITE_BUILD_SECONDS
    return OTHER_SECONDS


def pytest_collection_modifyitems(config, items):
    site_build: list = []
    seconds, first, key = {}, {}, {}
    for index, item in enumerate(items):
        unit = _unit(item)
        if unit not in seconds:
            seconds[unit], first[unit] = _seconds(item, site_build), index
        key[id(item)] = (-seconds[unit], first[unit], index)
    items.sort(key=lambda item: key[id(item)])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    env = kernel_env(item.path, set(item.config.getoption("triton_lessons").split())) \
        if _is_notebook_cell(item) else {}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return (yield)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScheduling(LoadScopeScheduling):
        """xdist's loadscope, with a notebook as the one scope of several tests (xdist_group marks would do it,
        but xdist 3.8 cannot rename pytest 9's node ids to mark the group)."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    return NotebookScheduling(config, log)
