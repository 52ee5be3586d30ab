"""The grading framework: verdict lines, strict mode, clear errors, and no traceback in Jupyter."""
import nbformat
import pytest
import torch
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import check
from helpers.checking import Bug, Case, CheckFailure, Grader, attempted
from conftest import ROOT, rejects


def test_check_failure_is_an_assertion_error():
    assert issubclass(CheckFailure, AssertionError)


def test_passing_something_not_callable():
    rejects(check.merge_ml, 3.0, "pass your function itself")


def test_learner_exception_names_their_line():
    def broken(m1, l1, m2, l2):
        return m1[:, None] @ l1[None, :] @ torch.ones(7)
    msg = rejects(check.merge_ml, broken, "your function raised RuntimeError", "in broken")
    assert "helpers/checking.py" not in msg


def test_compare_reports_worst_index_and_bug_hint():
    g = Grader("demo", fn=None)
    g.case = Case("c", torch.zeros(3))
    want = torch.tensor([1.0, 2.0, 3.0])
    got = torch.tensor([1.0, 2.5, 3.0])
    with pytest.raises(CheckFailure) as info:
        g.compare(got, want, "y", bugs=[Bug("you added 0.5 to the middle", lambda c: got)])
    msg = str(info.value)
    assert "index (1,)" in msg and "got 2.5, expected 2" in msg and "you added 0.5" in msg


def test_compare_never_accepts_nan_or_a_wrong_inf():
    g = Grader("demo", fn=None)
    g.case = Case("c")
    with pytest.raises(CheckFailure, match="NaN"):
        g.compare(torch.tensor([float("nan")]), torch.tensor([0.0]), "y")
    with pytest.raises(CheckFailure):
        g.compare(torch.tensor([0.0]), torch.tensor([float("-inf")]), "lse")
    assert g.compare(torch.tensor([float("-inf"), 1.0]), torch.tensor([float("-inf"), 1.0]), "lse") == 0.0


def test_attempted():
    def stub(x):
        raise NotImplementedError
    assert not attempted(stub, 1) and attempted(lambda x: x, 1) and not attempted(lambda x: 1 / 0, 1)


def test_jupyter_shows_the_verdict_without_a_traceback(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch\nfrom helpers import check"),
                nbformat.v4.new_code_cell("check.merge_ml(lambda m1, l1, m2, l2: (m1, l1 + l2))")]
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    with pytest.raises(CellExecutionError):
        client.execute()
    err = [o for o in nb.cells[1].outputs if o.output_type == "error"][0]
    shown = "\n".join(err.traceback)
    assert err.ename == "CheckFailure" and shown.startswith("❌ merge_ml")
    assert "checking.py" not in shown and "Traceback" not in shown
