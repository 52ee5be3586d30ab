"""CI runs the README's configuration, and the browser tests start JupyterLab as `make lab` does.

A green CI run proves only the configuration CI gives it, so `.ci/run` may set nothing that changes what
the course computes (no TRITON_INTERPRET, no PYTHONPATH, no course variable), and the e2e lab gets the
environment `make lab` would give it.
"""
import importlib.util
import re
import sys

from conftest import ROOT

# Allowed in .ci/run: how to install the browser, and being stricter about a missing one.
CI_MAY_SET = {"SUDO", "DEBIAN_FRONTEND", "COURSE_E2E_REQUIRED"}


def _assignments(script: str) -> set:
    """Every variable a shell script sets: `export X=`, `X=... cmd`, `X=$(...)`, `env X=`."""
    names = set()
    for line in script.splitlines():
        line = line.split("#", 1)[0]
        names |= set(re.findall(r"(?:^|[\s;(&|])(?:export\s+|env\s+)?([A-Za-z_][A-Za-z0-9_]*)=", line))
    return names


def test_ci_sets_nothing_the_readme_does_not():
    script = (ROOT / ".ci" / "run").read_text()
    assert "make setup" in script and "make check" in script
    extra = _assignments(script) - CI_MAY_SET
    assert not extra, f".ci/run sets {sorted(extra)}: the course must set what it needs itself"


def test_the_assignment_finder_sees_each_form():
    assert _assignments("export TRITON_INTERPRET=1\nPYTHONPATH=. make check\nA=$(x) ; env COURSE_X=1 make") == \
        {"TRITON_INTERPRET", "PYTHONPATH", "A", "COURSE_X"}


def test_the_makefile_exports_only_pythonpath():
    exports = re.findall(r"^export\s+([A-Za-z_]+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert exports == ["PYTHONPATH"], exports


def test_the_e2e_lab_gets_make_labs_environment():
    spec = importlib.util.spec_from_file_location("e2e_conftest", ROOT / "e2e" / "conftest.py")
    e2e = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = e2e                    # its dataclasses look their module up there
    spec.loader.exec_module(e2e)
    outer = {"HOME": "/h", "PATH": "/bin", "TRITON_INTERPRET": "1", "COURSE_STRICT": "1",
             "COURSE_E2E_REQUIRED": "1", "PYTEST_XDIST_WORKER": "gw0", "PYTHONPATH": "/elsewhere"}
    assert e2e.lab_env(outer) == {"HOME": "/h", "PATH": "/bin", "PYTHONPATH": str(ROOT)}
