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
