"""The one-source rule: learner notebooks are generated from the worked ones, and never clobber edits."""
import json
import shutil

import nbformat
import pytest

from helpers import generate
from helpers.generate import GenerateError, drift, stub_source
from conftest import ROOT


def test_learner_notebooks_have_not_drifted(tmp_path):
    problems = drift(ROOT / "solutions", ROOT / "notebooks")
    assert not problems, "notebooks/ drifted from solutions/ (run `make notebooks`):\n" + "\n".join(problems)


def test_regenerating_into_a_fresh_folder_gives_the_committed_files(tmp_path):
    generate.generate(ROOT / "solutions", tmp_path, log=lambda *_: None)
    for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        assert (tmp_path / p.name).read_text() == (ROOT / "notebooks" / p.name).read_text(), p.name


def test_learner_notebooks_have_no_outputs_and_no_answers():
    for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, p.name
                assert "BEGIN SOLUTION" not in cell.source, p.name


def test_same_names_in_both_folders():
    names = lambda d: sorted(p.name for p in (ROOT / d).glob("*.ipynb") if ".backup-" not in p.name)
    assert names("notebooks") == names("solutions")


def test_stub_names_the_exercise_and_keeps_indentation():
    src = "def merge_ml(a, b):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION\n"
    out = stub_source(src)
    assert "return a + b" not in out
    assert '    raise NotImplementedError("merge_ml: replace this line with your code")' in out
    assert out.startswith("def merge_ml(a, b):\n    '''doc'''\n    # YOUR CODE HERE")


def test_stub_takes_an_explicit_name():
    out = stub_source("x = 1\n### BEGIN SOLUTION tile_grid\ny = 2\n### END SOLUTION")
    assert 'NotImplementedError("tile_grid:' in out


@pytest.mark.parametrize("bad", ["### BEGIN SOLUTION\nx = 1", "x = 1\n### END SOLUTION",
                                 "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION"])
def test_unbalanced_markers_are_errors(bad):
    with pytest.raises(GenerateError):
        stub_source(bad)


def _fixture(tmp_path):
    sol, out = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    shutil.copy(ROOT / "solutions" / "01_online_softmax.ipynb", sol)
    generate.generate(sol, out, log=lambda *_: None)
    return sol, out, out / "01_online_softmax.ipynb"


def _edit(path, text):
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source += text
    nbformat.write(nb, path)


def test_never_overwrites_a_learner_edit(tmp_path):
    sol, out, target = _fixture(tmp_path)
    _edit(target, "\n# my work")
    nb = nbformat.read(sol / target.name, as_version=4)   # the course changes too
    nb.cells[0].source += "\nA new sentence."
    nbformat.write(nb, sol / target.name)
    with pytest.raises(GenerateError, match="01_online_softmax.ipynb"):
        generate.generate(sol, out, log=lambda *_: None)
    assert "# my work" in target.read_text()


def test_force_backs_up_first(tmp_path):
    sol, out, target = _fixture(tmp_path)
    _edit(target, "\n# my work")
    nb = nbformat.read(sol / target.name, as_version=4)
    nb.cells[0].source += "\nA new sentence."
    nbformat.write(nb, sol / target.name)
    generate.generate(sol, out, force=True, log=lambda *_: None)
    backups = list(out.glob("01_online_softmax.backup-*.ipynb"))
    assert len(backups) == 1 and "# my work" in backups[0].read_text()
    assert "A new sentence." in target.read_text() and "# my work" not in target.read_text()


def test_outputs_alone_are_not_an_edit(tmp_path):
    sol, out, target = _fixture(tmp_path)
    nb = json.loads(target.read_text())
    nb["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran"}]
    nb["cells"][1]["execution_count"] = 1
    target.write_text(json.dumps(nb))
    assert not generate.learner_edited(target)


def test_cli_check_reports_drift(tmp_path, capsys):
    sol, out, target = _fixture(tmp_path)
    assert generate.main(["--solutions", str(sol), "--out", str(out), "--check"]) == 0
    _edit(target, "\n# drift")
    assert generate.main(["--solutions", str(sol), "--out", str(out), "--check"]) == 1
    assert "differs" in capsys.readouterr().out


# ---------------------------------------------------------------- nothing lost: unreadable notebooks, backups
NB = "01_online_softmax.ipynb"


def _not_utf8(target):
    target.write_bytes(target.read_bytes().replace(b"online softmax", b"online softmax \xe9t\xe9", 1))


def _no_source(target):
    nb = json.loads(target.read_text())
    del nb["cells"][1]["source"]
    target.write_text(json.dumps(nb))


@pytest.mark.parametrize("breakage, why", [(_not_utf8, "not UTF-8 text (byte 0xe9"),
                                           (_no_source, "cell 1 has no `source`"),
                                           (lambda t: t.write_text("{ not json"), "not a notebook")])
def test_an_unreadable_learner_notebook_is_refused_by_name(tmp_path, capsys, breakage, why):
    sol, out, target = _fixture(tmp_path)
    breakage(target)
    before = target.read_bytes()
    nb = nbformat.read(sol / NB, as_version=4)                 # the course changes
    nb.cells[0].source += "\nA new sentence."
    nbformat.write(nb, sol / NB)
    assert generate.main(["--solutions", str(sol), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and why in err and "FORCE=1" in err
    assert target.read_bytes() == before
    assert not list(out.glob("*.backup-*"))


@pytest.mark.parametrize("breakage", [_not_utf8, _no_source])
def test_force_backs_an_unreadable_notebook_up_byte_for_byte(tmp_path, capsys, breakage):
    sol, out, target = _fixture(tmp_path)
    breakage(target)
    before = target.read_bytes()
    assert generate.main(["--solutions", str(sol), "--out", str(out), "--force"]) == 0
    [backup] = out.glob("01_online_softmax.backup-*.ipynb")
    assert backup.read_bytes() == before
    assert generate.read_notebook(target).cells[1].source      # a fresh, readable learner notebook
    assert "unreadable" in capsys.readouterr().out


def test_the_cli_names_the_file_with_no_traceback(tmp_path):
    import subprocess
    import sys
    sol, out, target = _fixture(tmp_path)
    _not_utf8(target)
    nb = nbformat.read(sol / NB, as_version=4)
    nb.cells[0].source += "\nA new sentence."
    nbformat.write(nb, sol / NB)
    r = subprocess.run([sys.executable, "-m", "helpers.generate", "--solutions", str(sol), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and str(target) in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_drift_reports_an_unreadable_notebook(tmp_path):
    sol, out, target = _fixture(tmp_path)
    _no_source(target)
    assert drift(sol, out) == [f"{NB}: cannot read it: cell 1 has no `source`"]


def test_backups_never_overwrite_each_other_whatever_the_clock(tmp_path, monkeypatch):
    sol, out, target = _fixture(tmp_path)
    monkeypatch.setattr(generate.time, "strftime", lambda *_: "20260101-000000")   # a clock that stands still
    texts = []
    for k in range(3):
        _edit(target, f"\n# my work {k}")
        texts.append(target.read_bytes())
        nb = nbformat.read(sol / NB, as_version=4)
        nb.cells[0].source += f"\nCourse update {k}."
        nbformat.write(nb, sol / NB)
        generate.generate(sol, out, force=True, log=lambda *_: None)
    backups = sorted(out.glob("01_online_softmax.backup-*.ipynb"))
    assert [b.name for b in backups] == ["01_online_softmax.backup-20260101-000000-2.ipynb",
                                         "01_online_softmax.backup-20260101-000000-3.ipynb",
                                         "01_online_softmax.backup-20260101-000000.ipynb"]
    assert sorted(b.read_bytes() for b in backups) == sorted(texts)


@pytest.mark.parametrize("folder", ["solutions", "notebooks"])
def test_every_notebook_starts_with_the_setup_cell(folder):
    """The first code cell of every notebook is helpers.generate.SETUP_CELL, its source hidden in JupyterLab and a
    form in Colab (what a notebook opened outside the course needs: tests/test_hosted.py runs it)."""
    for p in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
        if ".backup-" in p.name:
            continue
        first = next(c for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code")
        assert first.source == generate.SETUP_CELL.rstrip("\n"), (
            f"{folder}/{p.name}: its first code cell must be helpers.generate.SETUP_CELL (copy it from any notebook)")
        assert first.metadata.get("jupyter", {}).get("source_hidden") is True, f"{folder}/{p.name}"
        assert first.metadata.get("cellView") == "form", f"{folder}/{p.name}"


def test_the_setup_cell_names_the_course_once():
    """The address a hosted notebook fetches from is one constant, COURSE_URL, and COURSE_URL at run time wins."""
    assert generate.COURSE_URL in generate.SETUP_CELL and generate.SETUP_CELL.count("https://") == 1
    assert 'os.environ.get("COURSE_URL"' in generate.SETUP_CELL
