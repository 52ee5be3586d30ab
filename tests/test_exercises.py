"""Every exercise of every lesson, found in its worked notebook's `check.<name>(<name>)` cells: the generated stub
fails strict and shows ⏳ otherwise; the worked answer passes with float64 as the default dtype. (The worked answer
passing strict as the notebook runs it: `make check-solutions`, every worked notebook with COURSE_STRICT=1.)"""
import nbformat
import pytest

from helpers import check
from helpers.grade import exercises_in
from helpers.checking import REGISTRY
from conftest import ROOT, notebook_namespace, rejects


def _exercises():
    found = []
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        found += [(path.stem, name) for _, name in exercises_in(nbformat.read(path, as_version=4))]
    return found


EXERCISES = _exercises()
_namespaces = {}


def _ns(nb, learner):
    if (nb, learner) not in _namespaces:
        _namespaces[nb, learner] = notebook_namespace(nb, learner=learner)
    return _namespaces[nb, learner]


def test_every_checker_is_an_exercise_of_some_notebook():
    assert sorted(REGISTRY) == sorted(name for _, name in EXERCISES)


@pytest.mark.parametrize("nb, name", EXERCISES)
def test_stub_fails_strict(nb, name, strict):
    rejects(getattr(check, name), _ns(nb, learner=True)[name], "not attempted")


@pytest.mark.parametrize("nb, name", EXERCISES)
def test_stub_not_attempted(nb, name, not_strict, capsys):
    getattr(check, name)(_ns(nb, learner=True)[name])
    assert f"⏳ {name} not attempted yet" in capsys.readouterr().out


CPU_EXERCISES = [(nb, name) for nb, name in EXERCISES if not nb.startswith("07")]


@pytest.mark.parametrize("nb, name", CPU_EXERCISES)
def test_worked_answer_passes_with_float64_default(nb, name, strict, capsys):
    """``torch.set_default_dtype(torch.float64)`` before a right answer: the cases are then float64,
    and the expected dtype follows the inputs (never a fixed float32)."""
    import torch
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        getattr(check, name)(_ns(nb, learner=False)[name])
    finally:
        torch.set_default_dtype(before)
    assert f"✅ {name}" in capsys.readouterr().out
