"""`make grade` (helpers.grade): a report of a learner's notebooks that never changes them."""
import hashlib
import json
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


def _learner01_cut(path):
    """Lesson 01's learner copy cut to what grading reads: its set-up and imports, each exercise and its check cell
    (the figures and demos are left out: they cost a kernel's time and grade nothing)."""
    nb = nbformat.read(ROOT / "notebooks" / NB01, as_version=4)
    names = [n for _, n in grade.exercises_in(nb)]
    code = [c for c in nb.cells if c.cell_type == "code"]
    nb.cells = code[:2] + [c for c in code[2:] if any(f"def {n}(" in c.source or f"check.{n}(" in c.source
                                                      for n in names)]
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def edited01(tmp_path_factory):
    """The cut learner copy with a learner's three kinds of trouble, one exercise each, graded once (a Jupyter
    kernel's run) for the tests below: online_softmax_stats's check cell deleted, merge_ml a wrong answer (forgets
    the rescale), blockwise_stats renamed so that its check cell breaks (NameError); lse_from_stats left untouched,
    after all of them. Returns (path, verdicts by exercise, verdicts in order); grade's cache beside it then holds
    them (test_report_exits_zero_and_expect_is_a_gate reads them from there)."""
    path = _learner01_cut(tmp_path_factory.mktemp("edited01") / NB01)
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if "check.online_softmax_stats(online_softmax_stats)" not in c.source]
    nbformat.write(nb, path)
    _edit(path, 'raise NotImplementedError("merge_ml: replace this line with your code")',
          "m = torch.maximum(m1, m2)\n    return m, l1 + l2")                # forgets the rescale
    _edit(path, "def blockwise_stats(", "def blockwise_stats_draft(")       # its check cell: NameError
    verdicts = grade.grade([str(path)])
    return path, _by_name(verdicts), verdicts


def test_exercises_are_found_from_check_cells():
    nb = nbformat.read(ROOT / "notebooks" / NB01, as_version=4)
    assert [name for _, name in grade.exercises_in(nb)] == [
        "online_softmax_stats", "merge_ml", "blockwise_stats", "lse_from_stats"]


# Grade is run on whole notebooks of two kinds: plain CPU (01, a learner's untouched copy) and worker processes (09,
# a worked copy). Whole folders would repeat nbval's runs (make check-solutions runs every worked notebook strict, the
# Triton ones included; make e2e every learner copy); the grading of Triton lessons on a machine without Triton is
# tests/test_learner_machines.py's.
LEARNER, WORKED = "01_online_softmax", "09_ring_attention"


def test_untouched_learner_notebooks_are_all_todo_and_unchanged(tmp_path, capsys, monkeypatch):
    """Grade reads an untouched learner notebook (LEARNER, above) as all ⏳ and writes nothing.
    Every learner notebook running with its exercises ⏳ is e2e's job (and nbval's where e2e may skip).
    As `make grade` runs: no TRITON_INTERPRET in the environment (the course chooses the mode itself)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    work = tmp_path / "notebooks"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / f"{LEARNER}.ipynb", work)
    before = {p.name: _sha(p) for p in work.glob("*.ipynb")}
    assert grade.main([str(work), "--expect", "todo"]) == 0
    out = capsys.readouterr().out
    n = sum(len(grade.exercises_in(nbformat.read(p, as_version=4))) for p in work.glob("*.ipynb"))
    assert n == 4
    assert out.count("⏳ not attempted yet") == n and f"0 ✅  0 ❌  {n} ⏳  of {n} exercises" in out
    assert {p.name: _sha(p) for p in work.glob("*.ipynb")} == before      # nothing written
    assert sorted(p.name for p in work.iterdir()) == sorted([*before, ".course"])   # only the grade's cache beside




def test_a_copy_of_worked_notebooks_is_all_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")               # grade ignores it: a report, not strict
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as `make grade` runs: the course chooses it
    work = tmp_path / "solutions"
    work.mkdir()
    shutil.copy(ROOT / "solutions" / f"{WORKED}.ipynb", work)
    assert grade.main([str(work), "--expect", "pass"]) == 0
    out = capsys.readouterr().out
    n = sum(len(grade.exercises_in(nbformat.read(p, as_version=4))) for p in work.glob("*.ipynb"))
    assert n == 2 and f"{n} ✅  0 ❌  0 ⏳  of {n} exercises" in out


def test_a_wrong_answer_is_a_cross_with_the_checkers_first_line(edited01):
    got = edited01[1]
    assert got["merge_ml"].status == "fail"
    assert got["merge_ml"].message.startswith("wrong: `l` at index (") and "values wrong" in got["merge_ml"].message
    # VERBOSE=1: the checker's other lines (the case, the hint) under the row, as the notebook shows them
    hint = next(d for d in got["merge_ml"].details if d.startswith("hint: "))
    assert got["merge_ml"].details[0].startswith("case '")
    quiet, loud = (grade.format_table(list(got.values()), width=100, verbose=b) for b in (False, True))
    assert "hint: " not in quiet and hint[:40] in loud
    lines = loud.splitlines()
    row = lines.index(next(l for l in lines if "merge_ml" in l and "❌" in l))
    under = [l for l in lines[row + 1:] if l.startswith(" ")]                    # up to the next row
    assert "values wrong" in " ".join(under[:2]) and any(l.lstrip().startswith("case '") for l in under)


def test_a_cell_that_breaks_is_reported_on_the_exercise_it_stops(edited01):
    got = edited01[1]
    assert got["blockwise_stats"].status == "fail"
    assert got["blockwise_stats"].message == "not graded: NameError: name 'blockwise_stats' is not defined"
    assert got["lse_from_stats"].status == "todo"                           # later cells still ran


def test_an_unreadable_notebook_is_a_row_not_a_crash(tmp_path):
    bad = tmp_path / "01_broken.ipynb"
    bad.write_text("{ not json")
    [v] = grade.grade_notebook(bad)
    assert v.status == "fail" and v.message.startswith("cannot read the notebook")


def test_report_exits_zero_and_expect_is_a_gate(edited01, capsys):
    path = edited01[0]
    assert grade.main([str(path)]) == 0
    assert grade.main([str(path), "--expect", "pass"]) == 1
    assert "4 exercise(s) are not ✅" in capsys.readouterr().err


def test_a_missing_target_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="neither a folder nor a notebook"):
        grade.main([str(tmp_path / "nope")])


def _tiny(path, *cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)
    return path


def test_several_folders_name_the_folder():
    vs = [grade.Verdict("01_online_softmax", "merge_ml", "todo", "not attempted yet", folder=f)
          for f in ("notebooks", "tmp/copy")]
    table = grade.format_table(vs, width=100)
    assert "notebooks/01_online_softmax" in table and "tmp/copy/01_online_softmax" in table
    assert "notebooks/" not in grade.format_table(vs[:1], width=100)           # one folder: just the name


def test_a_deleted_check_cell_is_listed_not_dropped(edited01):
    _, got, verdicts = edited01
    assert [v.exercise for v in verdicts] == ["online_softmax_stats", "merge_ml", "blockwise_stats",
                                              "lse_from_stats"]                  # the course's order
    assert got["online_softmax_stats"].status == "fail"
    assert got["online_softmax_stats"].message.startswith("check cell missing")
    assert "check.online_softmax_stats(online_softmax_stats)" in got["online_softmax_stats"].message
    assert got["merge_ml"].status == "fail" and got["lse_from_stats"].status == "todo"   # the others still graded


def test_a_folder_with_a_malformed_notebook_keeps_the_rest_of_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")                           # rows are cut to the terminal's width
    nb = json.loads((ROOT / "notebooks" / NB01).read_text())
    del nb["cells"][1]["source"]                                   # a cell without `source`
    (tmp_path / NB01).write_text(json.dumps(nb))
    _tiny(tmp_path / "02_tiny.ipynb", "from helpers import check\n"
          "def merge_ml(m1, l1, m2, l2):\n    raise NotImplementedError", "check.merge_ml(merge_ml)")
    assert grade.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("cannot read the notebook: cell 1 has no `source`") == 4   # one row per exercise
    assert "02_tiny" in out and "⏳ not attempted yet" in out
    assert "0 ✅  4 ❌  1 ⏳  of 5 exercises" in out


def test_exercises_after_a_deliberate_stop_are_skipped_with_its_reason(tmp_path, capsys):
    nb = _tiny(tmp_path / "07_stops.ipynb",
               "class TritonMissing(Exception):\n    pass\n"
               "raise TritonMissing('this notebook needs Triton, which this Python does not have')",
               "check.flash_attn_triton(flash_attn_triton)")
    [v] = grade.grade_notebook(nb)
    assert v.status == "skip" and v.symbol == "➖"
    assert v.message == "not run here: this notebook needs Triton, which this Python does not have"
    assert grade.format_table([v]).endswith("0 ✅  0 ❌  0 ⏳  1 ➖  of 1 exercises")
