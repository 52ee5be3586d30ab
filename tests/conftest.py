"""Shared test tools: the functions a worked (or generated learner) notebook defines.

The worked notebook is the one source of each solution, so the tests take the
solutions from it: every top-level ``import``, ``def`` and constant assignment of its
code cells, executed in one namespace (plots, widgets and check calls are skipped).
"""
from __future__ import annotations

import ast
import linecache
import os
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)


def _is_constant_assign(node) -> bool:
    """``N, heads = 8192, 32`` or ``MiB = 2**20``: literals and arithmetic on them only."""
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and all(
        isinstance(n, (ast.Constant, ast.UnaryOp, ast.BinOp, ast.Tuple, ast.operator, ast.unaryop, ast.Load))
        for n in ast.walk(node.value))


def notebook_namespace(name: str, learner: bool = False) -> dict:
    """Definitions of ``solutions/<name>.ipynb`` (or its generated learner version)."""
    import nbformat  # here, not at the top: the GPU machine runs the kernel tests without Jupyter's packages
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    ns: dict = {"__name__": f"notebook_{name}"}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "solution-only" in cell.metadata.get("tags", []) and learner:
            continue
        from helpers.generate import stub_source
        src = stub_source(cell.source) if learner else cell.source
        src = "\n".join(l for l in src.split("\n") if not l.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        keep = [n for n in tree.body if isinstance(n, _KEEP) or _is_constant_assign(n)]
        filename = f"<{name}{' learner' if learner else ''} cell {i}>"   # in linecache, as IPython does: inspect.getsource works
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(ast.Module(body=keep, type_ignores=[]), filename, "exec"), ns)  # noqa: S102
    return ns


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")


@pytest.fixture
def not_strict(monkeypatch):
    monkeypatch.delenv("COURSE_STRICT", raising=False)


class LaunchRecorder:
    """A kernel's stand-in for its launcher's tests on the CPU: ``kernel[grid](*args, **kwargs)`` binds the arguments
    to the kernel's own signature (TypeError for one missing or extra) and appends (name, grid, bound arguments) to
    ``calls``."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        import inspect

        def launch(*args, **kwargs):
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
            self.calls.append((self.fn.__name__, grid, bound.arguments))
        return launch


def notebook(name: str, folder: str = "solutions"):
    """The notebook ``<folder>/<name>.ipynb`` (a NotebookNode)."""
    import nbformat
    return nbformat.read(ROOT / folder / f"{name}.ipynb", as_version=4)


def cells(name: str, kind: str | None = None) -> list:
    """The cells of a worked notebook, of one kind (``"markdown"``, ``"code"``) or all."""
    return [c for c in notebook(name).cells if kind is None or c.cell_type == kind]


def markdown(name: str) -> str:
    """Every cell's source of a worked notebook, joined."""
    return "\n".join(c.source for c in notebook(name).cells)


def flat(text: str) -> str:
    """Markdown with its line breaks (and blockquote marks) folded into single spaces."""
    import re
    return re.sub(r"\s+", " ", text.replace("\n>", "\n"))


def interview(name: str) -> str:
    """The worked notebook's one "Say it in the interview" section, flattened."""
    found = [c.source for c in cells(name, "markdown") if "Say it in the interview" in c.source]
    assert len(found) == 1, f"{name}: one interview section expected"
    return flat(found[0])


def outputs(name: str, needle: str) -> str:
    """The text output of the one code cell of a worked notebook whose source contains ``needle``."""
    found = [c for c in cells(name, "code") if needle in c.source]
    assert len(found) == 1, (name, needle, len(found))
    return "".join(o.get("text", "") for o in found[0].get("outputs", []))


def rejects(checker, fn, *hint_words):
    """Assert that ``checker(fn)`` fails and that its message holds every one of ``hint_words``."""
    from helpers.checking import CheckFailure
    with pytest.raises(CheckFailure) as info:
        checker(fn)
    msg = str(info.value)
    for w in hint_words:
        assert w in msg, f"expected {w!r} in the verdict:\n{msg}"
    return msg


os.environ.setdefault("MPLBACKEND", "Agg")
# Without a GPU, Triton kernels run under its interpreter; the flag must be set before any @triton.jit runs.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # One intra-op thread: every tensor here is small, and with torch's default (a thread per core) pytest-xdist's
        # workers and the compile jobs beside them oversubscribe the cores; a tiny op then waits on a descheduled
        # sibling thread (the checkers' small float64 SDPA reference ran tens of times slower on a busy 2-core
        # machine). Kernels and scripts the tests start inherit the variable.
        if "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)          # this process: torch read the variable when it was imported
except ImportError:
    pass

# PyPI has Triton for Linux only: elsewhere the two files of Triton kernel tests cannot be collected.
# Said in pytest's header, not hidden (tests/test_learner_machines.py runs the notebooks without Triton).
import importlib.util  # noqa: E402

NEEDS_TRITON = ["test_lesson07.py", "test_triton_kernels.py"]
collect_ignore = [] if importlib.util.find_spec("triton") else NEEDS_TRITON


def pytest_report_header(config):
    if collect_ignore:
        return f"triton is not installed (Linux only): not collecting {', '.join(collect_ignore)}"
