"""The learner's progress (helpers.progress) and `make grade` agreeing with the lab (helpers.grade): the lab records
each verdict it shows; grade re-runs only what changed and names a verdict the saved file does not give."""
from __future__ import annotations

import json
import os
import time

import nbformat
import pytest

from helpers import grade, progress

TINY = "99_tiny.ipynb"      # no worked notebook of this name: grade expects no other exercise from it


def _tiny(folder, answer="m, l = reference.merge_ml(m1, l1, m2, l2)\n    return m.to(m1.dtype), l.to(l1.dtype)"):
    """A notebook with one exercise (merge_ml) answered by ``answer``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from helpers import check, reference"),
                nbformat.v4.new_code_cell(f"def merge_ml(m1, l1, m2, l2):\n    {answer}"),
                nbformat.v4.new_code_cell("check.merge_ml(merge_ml)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / TINY
    nbformat.write(nb, path)
    return path


def _run_as_the_lab(path, monkeypatch):
    """Run the notebook as JupyterLab does: its kernel is told the notebook's path (JPY_SESSION_NAME)."""
    from nbclient import NotebookClient
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))
    monkeypatch.delenv("COURSE_GRADE_LOG", raising=False)
    monkeypatch.delenv("COURSE_STRICT", raising=False)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def test_the_lab_records_each_verdict_beside_the_notebook(tmp_path, monkeypatch):
    path = _tiny(tmp_path)
    _run_as_the_lab(path, monkeypatch)
    seen = progress.lab_verdicts(tmp_path)
    assert seen[("99_tiny", "merge_ml")]["status"] == "pass"
    assert "merge_ml passed" in seen[("99_tiny", "merge_ml")]["message"]


def test_nothing_is_recorded_outside_the_lab(tmp_path, monkeypatch):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    progress.record("merge_ml", "pass", "✅ merge_ml passed: ...")
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / TINY))
    monkeypatch.setenv("COURSE_GRADE_LOG", str(tmp_path / "log"))          # make grade's runs: not the lab's view
    progress.record("merge_ml", "pass", "✅ merge_ml passed: ...")
    assert not (tmp_path / progress.LOG_DIR).exists()


def test_a_broken_line_in_the_log_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / TINY))
    monkeypatch.delenv("COURSE_GRADE_LOG", raising=False)
    progress.record("merge_ml", "fail", "❌ merge_ml wrong: ...")
    with open(tmp_path / progress.LOG_DIR / progress.LOG_NAME, "a") as f:
        f.write('{"notebook": "99_tiny", "exerc')                           # a kernel killed mid-write
    assert progress.lab_verdicts(tmp_path)[("99_tiny", "merge_ml")]["status"] == "fail"


def _graded_by_a_stub(monkeypatch, status):
    """grade.grade_notebook replaced by one that returns ``status`` for merge_ml without a kernel: for grade's own
    bookkeeping around it (its cache, the lab's log), which reads only the verdicts. Returns the paths it ran."""
    ran = []

    def stub(path, timeout=600):
        ran.append(path)
        return [grade.Verdict(path.stem, "merge_ml", status, f"merge_ml {status}", folder=str(path.parent))]
    monkeypatch.setattr(grade, "grade_notebook", stub)
    return ran


def test_grade_names_a_verdict_the_saved_file_does_not_give(tmp_path, monkeypatch, capsys):
    """The learner saw ✅ in the lab, then graded before the file was saved: the row says so."""
    path = _tiny(tmp_path, answer='raise NotImplementedError("merge_ml: replace this line with your code")')
    log = tmp_path / progress.LOG_DIR
    log.mkdir()
    (log / progress.LOG_NAME).write_text(json.dumps({"notebook": "99_tiny", "exercise": "merge_ml", "status": "pass",
                                                    "time": time.time() + 5, "message": "✅ merge_ml passed"}) + "\n")
    ran = _graded_by_a_stub(monkeypatch, "todo")   # a stub graded for real: test_grade.py, an untouched learner copy
    [v] = grade.grade([str(path)])
    assert v.status == "todo" and "the lab showed ✅" in v.unsaved and "after the notebook was last saved" in v.unsaved
    assert "not saved?" in grade.format_table([v], width=200)
    os.utime(path, (time.time() + 60, time.time() + 60))                  # saved after the lab's verdict: agreed
    [v] = grade.grade([str(path)])                                         # (the same file: its cached verdict)
    assert v.unsaved == "" and len(ran) == 1


def test_grade_runs_again_only_what_changed(tmp_path, monkeypatch):
    path = _tiny(tmp_path)
    said = []
    [first] = grade.grade([str(path)], progress=said.append)
    [again] = grade.grade([str(path)], progress=said.append)
    assert first.status == again.status == "pass" and first.message == again.message
    assert said[0].startswith("  ran") and said[1].startswith("  kept") and "unchanged since the last grade" in said[1]
    _tiny(tmp_path, answer="return m1, l1")                                # the learner changed the notebook
    [changed] = grade.grade([str(path)], progress=said.append)
    assert changed.status == "fail" and said[2].startswith("  ran")
    ran = _graded_by_a_stub(monkeypatch, "fail")
    grade.grade([str(path)], progress=said.append, everything=True)        # --all runs it anyway
    assert said[3].startswith("  ran") and ran == [path]


def test_a_course_update_grades_everything_again(tmp_path, monkeypatch):
    path = _tiny(tmp_path)
    ran, said = _graded_by_a_stub(monkeypatch, "pass"), []
    grade.grade([str(path)], progress=said.append)
    grade.grade([str(path)], progress=said.append)
    assert said[1].startswith("  kept")
    monkeypatch.setattr(grade, "course_key", lambda: "another version of the course")
    grade.grade([str(path)], progress=said.append)
    assert said[2].startswith("  ran") and len(ran) == 2


def test_the_course_map_reads_every_lesson_and_its_time():
    rows = progress.lessons()
    assert [r["number"] for r in rows] == [f"{n:02d}" for n in range(1, len(rows) + 1)] and len(rows) >= 12
    assert all(r["minutes"] for r in rows), [r["name"] for r in rows if not r["minutes"]]
    text = progress.course_map()
    assert all(r["title"] in text for r in rows) and "in all" in text


def test_the_progress_view_shows_the_labs_last_verdicts(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("COURSE_GRADE_LOG", raising=False)
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "01_online_softmax.ipynb"))
    progress.record("merge_ml", "fail", "❌ merge_ml wrong: ...")
    progress.record("merge_ml", "pass", "✅ merge_ml passed: ...")           # the last one counts
    progress.record("blockwise_stats", "todo", "⏳ blockwise_stats not attempted yet")
    text = progress.show(tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("01 "))
    assert "✅ merge_ml" in line and "⏳ blockwise_stats" in line and "· lse_from_stats" in line and "1/4" in line


def test_the_check_times_table_reads_its_record():
    from helpers.results import check_times_table
    rec = {"meta": {"cores": 2, "memory_gib": 24, "python": "3.11.7", "torch": "2.13.0+cpu", "triton": "3.9.0",
                    "chromium": "Chromium 156", "commit": "abc1234", "date": "2026-12-02 01:00 UTC", "how": "a fresh clone"},
           "steps": {"setup": {"seconds": 90, "returncode": 0}, "test": {"seconds": 400, "returncode": 0},
                     "e2e": {"seconds": 200, "returncode": 1}},
           "make_check_seconds": 600, "passed": False}
    text = check_times_table(rec)
    assert "2 cores" in text and "abc1234" in text and "make test" in text and "6.7 min" in text
    assert "make e2e" in text and "FAILED" in text and "make check, in all" in text and "10.0 min" in text
    assert "not measured yet" in check_times_table({})
