"""`make grade` (helpers.grade): a report of a learner's notebooks that never changes them."""
import hashlib
import shutil

import nbformat
import pytest

from helpers import grade
from conftest import ROOT

NB01 = "01_online_softmax.ipynb"


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _edit(path, old, new):
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
    assert len(cells) == 1, f"{old!r} in {len(cells)} cells"
    cells[0].source = cells[0].source.replace(old, new)
    nbformat.write(nb, path)


def _by_name(verdicts):
    return {v.exercise: v for v in verdicts}


@pytest.fixture
def learner01(tmp_path):
    shutil.copy(ROOT / "notebooks" / NB01, tmp_path / NB01)
    return tmp_path / NB01


def test_exercises_are_found_from_check_cells():
    nb = nbformat.read(ROOT / "notebooks" / NB01, as_version=4)
    assert [name for _, name in grade.exercises_in(nb)] == [
        "online_softmax_stats", "merge_ml", "blockwise_stats", "lse_from_stats"]


def _n_exercises() -> int:
    """Every check.<name>(<name>) cell of the course's notebooks (14 for lessons 01-07)."""
    return sum(len(grade.exercises_in(nbformat.read(p, as_version=4)))
               for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_learner_notebook_untouched_is_all_todo_and_unchanged(tmp_path, capsys):
    work = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", work)
    before = {p.name: _sha(p) for p in work.glob("*.ipynb")}
    assert grade.main([str(work), "--expect", "todo"]) == 0
    out = capsys.readouterr().out
    n = _n_exercises()
    assert out.count("⏳ not attempted yet") == n and f"0 ✅  0 ❌  {n} ⏳  of {n} exercises" in out
    assert {p.name: _sha(p) for p in work.glob("*.ipynb")} == before      # nothing written
    assert sorted(p.name for p in work.iterdir()) == sorted(before)       # nothing added


def test_a_copy_of_the_solutions_is_all_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")               # grade ignores it: a report, not strict
    work = tmp_path / "solutions"
    shutil.copytree(ROOT / "solutions", work)
    assert grade.main([str(work), "--expect", "pass"]) == 0
    out = capsys.readouterr().out
    n = _n_exercises()
    assert f"{n} ✅  0 ❌  0 ⏳  of {n} exercises" in out


def test_a_wrong_answer_is_a_cross_with_the_checkers_first_line(learner01):
    _edit(learner01, 'raise NotImplementedError("merge_ml: replace this line with your code")',
          "m = torch.maximum(m1, m2)\n    return m, l1 + l2")                # forgets the rescale
    got = _by_name(grade.grade_notebook(learner01))
    assert got["merge_ml"].status == "fail"
    assert got["merge_ml"].message.startswith("`l` at index (") and "values wrong" in got["merge_ml"].message
    assert got["online_softmax_stats"].status == "todo"


def test_a_cell_that_breaks_is_reported_on_the_exercise_it_stops(learner01):
    _edit(learner01, "def merge_ml(", "def merge_ml_draft(")                 # check cell: NameError
    got = _by_name(grade.grade_notebook(learner01))
    assert got["merge_ml"].status == "fail"
    assert got["merge_ml"].message == "not graded: NameError: name 'merge_ml' is not defined"
    assert got["lse_from_stats"].status == "todo"                           # later cells still ran


def test_an_unreadable_notebook_is_a_row_not_a_crash(tmp_path):
    bad = tmp_path / "01_broken.ipynb"
    bad.write_text("{ not json")
    [v] = grade.grade_notebook(bad)
    assert v.status == "fail" and v.message.startswith("cannot read the notebook")


def test_report_exits_zero_and_expect_is_a_gate(learner01, capsys):
    assert grade.main([str(learner01)]) == 0
    assert grade.main([str(learner01), "--expect", "pass"]) == 1
    assert "4 exercise(s) are not ✅" in capsys.readouterr().err


def test_a_missing_target_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="neither a folder nor a notebook"):
        grade.main([str(tmp_path / "nope")])
