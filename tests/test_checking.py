"""The grading framework: verdict lines, strict mode, clear errors, time limits, in-place changes,
"Run All" that goes on past a ❌ in a notebook, and no traceback in Jupyter."""
import math
import time

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import check, checking, reference
from helpers.checking import Bug, Case, CheckFailure, Grader, yours_or_reference
from conftest import ROOT, notebook_namespace, rejects


def _merge(m1, l1, m2, l2):
    """A right merge_ml, written here (not the notebook's)."""
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    return m, l1 * torch.exp(m1 - m_safe) + l2 * torch.exp(m2 - m_safe)


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


def test_jupyter_shows_the_verdict_without_a_traceback(tmp_path, monkeypatch):
    """Strict (solutions/): a ❌ raises CheckFailure, which stops Run All (nbclient's CellExecutionError), shown as its
    message, not a traceback."""
    monkeypatch.setenv("COURSE_STRICT", "1")
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


# ------------------------------------------------------------------ a ❌ does not stop "Run All" in a notebook
RUN_ALL = [
    "import math, torch\nfrom helpers import check, reference\nfrom helpers.checking import yours_or_reference",
    "def merge_ml(m1, l1, m2, l2):\n    m = torch.maximum(m1, m2)\n    return m, l1 + l2   # wrong: no rescale",
    "check.merge_ml(merge_ml)",
    "merge = yours_or_reference(merge_ml, reference.merge_ml)\n"
    "m, l = merge(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0]))\n"
    "assert abs((m + torch.log(l)).item() - math.log(math.e ** 0 + math.e ** 1)) < 1e-5\nprint('demo ran')",
]


def _run_all(monkeypatch, log):
    monkeypatch.delenv("COURSE_STRICT", raising=False)
    monkeypatch.setenv("COURSE_GRADE_LOG", str(log))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in RUN_ALL])
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def _text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_learner_notebook_goes_on_past_a_failed_check(tmp_path, monkeypatch):
    log = tmp_path / "grade.jsonl"
    nb = _run_all(monkeypatch, log=log)
    assert not [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
    check_out = _text(nb.cells[2])
    assert check_out.startswith("❌ merge_ml wrong:") and "hint:" in check_out           # the verdict is shown
    assert '"status": "fail"' in log.read_text()                                     # and reaches make grade
    demo = _text(nb.cells[3])
    assert "uses the course's reference: your merge_ml did not pass its check" in demo and "demo ran" in demo


def test_yours_or_reference_follows_this_sessions_verdict(capsys):
    def ref(*a):
        return "reference"

    def merge_ml(m1, l1, m2, l2):
        return _merge(m1, l1, m2, l2)
    assert yours_or_reference(merge_ml, ref) is ref                   # never checked
    assert "has not passed its check" in capsys.readouterr().out
    check.merge_ml(merge_ml)
    assert yours_or_reference(merge_ml, ref) is merge_ml
    assert "uses your merge_ml: its check passed" in capsys.readouterr().out

    def merge_ml(m1, l1, m2, l2):                                     # redefined after its check  # noqa: F811
        return m1, l1
    assert yours_or_reference(merge_ml, ref) is ref
    with pytest.raises(CheckFailure):
        check.merge_ml(merge_ml)
    assert yours_or_reference(merge_ml, ref) is ref
    assert "did not pass its check" in capsys.readouterr().out

    stub = notebook_namespace("01_online_softmax", learner=True)["merge_ml"]
    check.merge_ml(stub)
    assert yours_or_reference(stub, ref) is ref
    assert "is not written yet" in capsys.readouterr().out


# ------------------------------------------------------------------ NotImplementedError on some cases only
def test_partly_written_function_is_attempted_and_names_the_case(not_strict):
    def merge_ml(m1, l1, m2, l2):
        if m1.dim() == 0:
            raise NotImplementedError("scalars: later")
        return _merge(m1, l1, m2, l2)
    msg = rejects(check.merge_ml, merge_ml, "❌ merge_ml", "NotImplementedError on this case", "scalars (0-d tensors)",
                  "after returning on 7 earlier cases")
    assert "⏳" not in msg


# ------------------------------------------------------------------ in-place changes, bit for bit
def test_nan_to_num_in_place_is_a_change():
    def merge_ml(m1, l1, m2, l2):
        m1.nan_to_num_()                 # -inf -> -3.4e38: "the same" to nan_to_num, not bit for bit
        m2.nan_to_num_()
        return _merge(m1, l1, m2, l2)
    rejects(check.merge_ml, merge_ml, "changed its input `m1` in place", "nan_to_num_")


def test_same_is_bit_for_bit():
    a = torch.tensor([-math.inf, 0.0, float("nan")])
    assert checking._same(a, a.clone())
    assert not checking._same(a, a.nan_to_num())
    assert not checking._same(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not checking._same([a], [a.nan_to_num()]) and checking._same({"x": a}, {"x": a.clone()})


# ------------------------------------------------------------------ the per-case time limit
def _hang(m1, l1, m2, l2):
    j, n = 0, m1.numel()
    while j < n:                          # j never advances
        try:
            m = torch.maximum(m1, m2)
        except Exception:                 # noqa: BLE001 - a learner's catch-all must not swallow the limit
            pass
    return m, l1


def test_a_hanging_function_gets_a_verdict_after_the_limit(monkeypatch):
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0.5")
    t0 = time.perf_counter()
    rejects(check.merge_ml, _hang, "❌ merge_ml", "still running after 0.5 s", "case 'random'", "COURSE_CASE_TIMEOUT",
            "never ends")
    assert time.perf_counter() - t0 < 10
    time.sleep(0.7)                       # nothing left pending: the next Python code runs undisturbed
    assert sum(range(10)) == 45


def test_a_hang_in_a_metered_call_gets_a_verdict_too(monkeypatch):
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0.5")
    from helpers import meter

    @checking.exercise("demo_metered_hang", arg_names=["x"])
    def demo(g):
        g.case = Case("metered", torch.zeros(3))
        meter.measure(g.fn, torch.zeros(3), names=["x"])   # not through g.call
    checking.REGISTRY.pop("demo_metered_hang")

    def spin(x):
        while True:
            x = x + 0
    with pytest.raises(CheckFailure, match="still running after 0.5 s"):
        demo(spin)


def test_a_swallowed_time_limit_fires_again(monkeypatch):
    """A raise that lands where Python swallows it (a weakref callback, a __del__: the meter has finalizers) must not
    leave the spin running: the limit fires again until the call ends (a one-shot alarm hung CI's worker)."""
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0.5")

    @checking.exercise("demo_swallowed", arg_names=["x"])
    def demo(g):
        g.call(Case("swallowed once", torch.zeros(3)))
    checking.REGISTRY.pop("demo_swallowed")

    def spin(x):
        try:
            while True:
                pass
        except BaseException:       # noqa: BLE001 - what a finalizer does to an exception raised inside it
            pass
        while True:
            pass
    with pytest.raises(CheckFailure, match="still running after 0.5 s"):
        demo(spin)


def test_the_limit_is_configurable_and_checked(monkeypatch):
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0")
    assert checking.case_timeout() is None
    monkeypatch.delenv("COURSE_CASE_TIMEOUT")
    assert checking.case_timeout() == 60.0
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="COURSE_CASE_TIMEOUT='soon': expected a number of seconds"):
        checking.case_timeout()


def test_a_fast_function_is_not_disturbed_by_the_limit():
    assert checking.call_with_limit(lambda: 3, limit=0.05) == 3
    time.sleep(0.1)
    assert sum(range(4)) == 6


# ------------------------------------------------------------------ errors get a hint about their cause
def test_reduction_over_an_empty_slice_is_named():
    hint = checking._hint_for_exception(IndexError("amax(): Expected reduction dim 1 to have non-zero size."))
    assert "empty slice" in hint and "ragged" not in hint


def test_one_name_for_using_the_learners_function():
    """Every cell after an exercise picks the learner's function through yours_or_reference, and only that."""
    import importlib
    import re
    old = re.compile(r"\b(attempted|works|try_run|ready|implemented)\(")
    used = 0
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not old.search(cell.source), f"{path.name}: {old.search(cell.source).group(0)}"
                used += "yours_or_reference(" in cell.source
    assert used >= 8
    for mod in ("lesson02", "lesson06", "lesson07"):
        m = importlib.import_module(f"helpers.{mod}")
        assert not {"works", "try_run", "ready"} & set(vars(m)), mod


# ------------------------------------------------------------------ one framework
def test_every_name_in_helpers_all_imports():
    import importlib
    import helpers
    for name in helpers.__all__:
        assert importlib.import_module(f"helpers.{name}") is getattr(helpers, name)




def test_one_meaning_for_g_in_the_checkers():
    """In helpers/check, `g` is the Grader and nothing else (generators are `rng` or `gen`)."""
    import ast
    for path in sorted((ROOT / "helpers" / "check").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                assert not any(isinstance(t, ast.Name) and t.id == "g" for t in node.targets), \
                    f"{path.name}:{node.lineno} assigns g"
            if isinstance(node, ast.Lambda):
                assert "g" not in {a.arg for a in node.args.args}, f"{path.name}:{node.lineno}"


def test_check_o_lse_is_the_one_o_lse_tail():
    """The (O, lse) expect/compare tail lives once, in helpers/check/_common.py."""
    for path in sorted((ROOT / "helpers" / "check").glob("lesson0[3-6].py")):
        src = path.read_text()
        assert 'g.expect_tuple(out, 2, "(O, lse)")' not in src, path.name


# ------------------------------------------------------------------ issue 21: verdicts, limits, crashes
def test_relative_error_has_a_floor_when_the_reference_is_zero():
    g = Grader("demo", fn=None)
    g.case = Case("Nk = 1")
    g.compare(torch.tensor([3e-8, 1e-9]), torch.tensor([0.0, 0.0]), "O", rtol=1e-4, atol=1e-5)
    assert g.max_rel_err < 1e-2, g.max_rel_err            # was 3e+22: 3e-8 over a scale of 1e-30


@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_a_sparse_or_meta_output_gets_a_verdict_not_a_traceback(kind):
    def odd(m1, l1, m2, l2):
        m, l = _merge(m1, l1, m2, l2)
        return (m.to_sparse(), l.to_sparse()) if kind == "sparse" else (m.to("meta"), l.to("meta"))
    msg = rejects(check.merge_ml, odd, "❌ merge_ml", "`m` is", "hint:")
    assert ("sparse" in msg) if kind == "sparse" else ("meta device" in msg)
    assert "Traceback" not in msg


def test_a_blocking_c_call_is_stopped_by_the_limit(monkeypatch):
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0.5")

    def sleeps(m1, l1, m2, l2):
        time.sleep(30)                       # one long C call: the timer thread alone never stopped it
    t0 = time.monotonic()
    rejects(check.merge_ml, sleeps, "still running after 0.5 s")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("limit", [1.0])   # 0.2 s broke sympy, 1.0 s torch._dynamo, on a 2-core machine
def test_the_limit_never_interrupts_an_import(tmp_path, limit):
    """A fresh process: the limit fires while `import torch._dynamo` runs (it pulls in sympy, seconds on a busy
    machine). Interrupted, either module stayed half loaded ("torch._dynamo has no attribute 'utils'",
    "sympy has no attribute 'core'") for the rest of the session; now the import finishes first."""
    import os
    import subprocess
    import sys
    script = tmp_path / "import_under_limit.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "from helpers.checking import CaseTimeout, call_with_limit\n"
        "assert 'torch._dynamo' not in sys.modules and 'sympy' not in sys.modules\n"
        "def slow():\n"
        "    import torch._dynamo\n"
        "    while True:\n"
        "        pass\n"
        "try:\n"
        f"    call_with_limit(slow, limit={limit})\n"
        "except CaseTimeout:\n"
        "    print('stopped')\n"
        "import sympy\n"
        "import torch._dynamo\n"
        "torch._dynamo.reset()\n"
        "print(sympy.core.Symbol('x'), torch._dynamo.utils.__name__)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["stopped", "x", "torch._dynamo.utils"]


def test_the_timer_thread_also_waits_for_an_import(monkeypatch):
    """Off the main thread (and on Windows) the limit is a timer thread; it too holds back during an import."""
    import threading

    from helpers import timelimit
    monkeypatch.setattr(timelimit, "_use_signal", lambda: False)
    seen = {}
    calls = iter([True, True, False])
    monkeypatch.setattr(timelimit, "_importing", lambda frame, limit_code: next(calls, False))

    def spin():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            pass
    def run():
        try:
            checking.call_with_limit(spin, limit=0.05)
        except checking.CaseTimeout:
            seen["after"] = True
    th = threading.Thread(target=run)
    t0 = time.monotonic()
    th.start()
    th.join()
    assert seen.get("after") and 0.1 <= time.monotonic() - t0 < 4     # two retries of 0.05 s, then stopped


def test_another_threads_import_does_not_hold_the_limit_back(tmp_path, monkeypatch):
    """Only the limited call's own imports hold the limit back: an import running in another thread for seconds
    (or an import lock an old traceback keeps alive) once kept a spinning answer going until it filled memory."""
    import sys
    import threading
    (tmp_path / "slow_import_elsewhere.py").write_text("import time\ntime.sleep(6)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    th = threading.Thread(target=lambda: __import__("slow_import_elsewhere"), daemon=True)

    def spin():
        th.start()                                           # an import elsewhere, begun after the limit was armed
        while True:
            pass
    t0 = time.monotonic()
    with pytest.raises(checking.CaseTimeout):
        checking.call_with_limit(spin, limit=0.3)
    assert time.monotonic() - t0 < 3
    th.join()
    sys.modules.pop("slow_import_elsewhere", None)


def test_a_check_run_by_an_import_is_still_stopped(tmp_path, monkeypatch):
    """The limit waits for imports that start during the call, not for the one under way when it was armed."""
    import sys
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0.3")
    (tmp_path / "learner_module_under_import.py").write_text(
        "import time\n"
        "from helpers.checking import CaseTimeout, call_with_limit\n"
        "def spin():\n"
        "    t0 = time.monotonic()\n"
        "    while time.monotonic() - t0 < 20:\n"
        "        pass\n"
        "try:\n"
        "    call_with_limit(spin)\n"
        "    STOPPED = False\n"
        "except CaseTimeout:\n"
        "    STOPPED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    t0 = time.monotonic()
    import learner_module_under_import as mod
    sys.modules.pop("learner_module_under_import", None)
    assert mod.STOPPED and time.monotonic() - t0 < 10


def test_the_course_reference_is_named_in_the_verdict(capsys):
    from helpers.lesson06 import combine_splits_ref    # a quick checker: the framework's note, not the lesson's cases
    check.combine_splits(combine_splits_ref)
    assert "this is the course's reference, helpers.lesson06.combine_splits_ref" in capsys.readouterr().out


def _score_matrix_checker():
    """An exercise with one metered case and the default budget: nothing as large as the N x Nk scores."""
    from helpers.checking import exercise
    rng = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 2, generator=rng), torch.randn(64, 2, generator=rng)

    @exercise("_demo_budget", arg_names=["q", "k"])
    def grade(g):
        g.measure(Case("metered", q, k))
        return "ok"
    return grade


def test_every_measure_holds_the_default_budget_in_any_form():
    demo = _score_matrix_checker()
    try:
        def lists(q, k):                       # the scores as Python lists: invisible to the meter's FLOPs
            Q, K = ([[float(t) for t in row] for row in a] for a in (q, k))
            S = [[a[0] * b[0] + a[1] * b[1] for b in K] for a in Q]
            return torch.tensor([max(r) for r in S])
        rejects(demo, lists, "Python objects and numpy arrays", "N x Nk scores (4,096 elements)")

        def kept_tiles(q, k):                  # every tile kept alive in a list: no one tensor is large
            tiles = [q[i:i + 8] @ k.T for i in range(0, 64, 8)] + [q @ k.T]
            return torch.stack([t.amax() for t in tiles])
        rejects(demo, kept_tiles, "elements in torch tensors at once")

        def tiled(q, k):
            return torch.cat([(q[i:i + 8] @ k.T).amax(1) for i in range(0, 64, 8)])
        demo(tiled)
    finally:
        checking.REGISTRY.pop("_demo_budget", None)


def test_a_hang_in_the_memory_call_gets_a_verdict_and_leaves_torch_as_it_was(monkeypatch):
    monkeypatch.setenv("COURSE_CASE_TIMEOUT", "0.5")
    tolist, iterate = torch.Tensor.tolist, torch.Tensor.__iter__

    def hangs_on_long_rows(x):
        while len(x) > 1000:
            pass
        m, l = -math.inf, 0.0
        for xi in x.tolist():
            m_new = max(m, xi)
            if m_new > -math.inf:
                l, m = l * math.exp(m - m_new) + math.exp(xi - m_new), m_new
        return m, l
    rejects(check.online_softmax_stats, hangs_on_long_rows, "still running after 0.5 s", "O(1) memory (metered)")
    assert torch.Tensor.tolist is tolist and torch.Tensor.__iter__ is iterate
