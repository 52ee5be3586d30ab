"""The house's layout, held by a test: who may import whom (CONTRIBUTING.md, "Layout").

Imports are read with ``ast`` (module level and inside functions alike), never run. From the bottom up:

- ``helpers/__init__.py`` and ``helpers/triton_mode.py``: the bottom; the package imports only
  ``triton_mode``, which imports nothing of the course;
- shared modules (``reference``, ``results``, ``meter``, ``meter_python``, ``checking``, ``ring_launcher``,
  ``widgets``, ``generate``, ``grade``): import only the bottom and each other;
- kernels (the ``helpers/kernels/`` package): nothing from ``check/``, a lesson module or ``checking``;
- the old kernel paths (``helpers/triton_attention.py``, ``_bwd``, ``_varlen``, ``_kvcache``): re-exports kept for
  notebooks saved before the kernels moved; nothing in the course imports them;
- lesson modules (``helpers/lessonNN*.py``): no checker; another lesson's module only where it is listed
  in ``LESSON_TO_LESSON`` (a list that may only shrink: a new shared piece goes to a shared module);
- checkers (``helpers/check/``): never another lesson's checker; a lesson module of their own lesson or an
  earlier one;
- ``bench/`` and ``tests/`` on top: nothing in ``helpers/`` imports them;
- no import cycles among the modules of ``helpers/``.
"""
from __future__ import annotations

import ast
import re

import pytest

from conftest import ROOT

HELPERS = ROOT / "helpers"
BOTTOM = {"helpers", "helpers.triton_mode"}
SHARED = {f"helpers.{m}" for m in ("reference", "results", "meter", "meter_python", "checking", "ring_launcher",
                                   "widgets", "generate", "grade")}
COMPAT = {f"helpers.{m}" for m in ("triton_attention", "triton_attention_bwd", "triton_varlen", "triton_kvcache")}
ABOVE_HELPERS = {"bench", "tests", "conftest", "common"}      # bench/ scripts import bench/common.py as `common`
# Lessons that import another lesson's module today. Move a shared piece to a shared module instead of adding here.
LESSON_TO_LESSON = {
    ("helpers.lesson05", "helpers.lesson04"),      # tiled_masked_attention, behind a figure
    ("helpers.lesson08", "helpers.lesson04"),      # the tile grid and its visibility
    ("helpers.lesson08", "helpers.lesson06"),      # the H200's datasheet FLOP/s and bytes/s
}


def _name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(HELPERS.rglob("*.py"))}


def _imports(mod: str) -> dict[str, int]:
    """{imported name: line} for one module: ``from .x import y`` gives ``helpers.x.y`` when that is a module,
    else ``helpers.x``; absolute imports as written."""
    path = MODULES[mod]
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.setdefault(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            for name in subs or [target]:
                out.setdefault(name, node.lineno)
    return out


def _course(mod: str) -> dict[str, int]:
    """The course modules (under helpers/) that ``mod`` imports, other than itself."""
    return {m: line for m, line in _imports(mod).items() if m in MODULES and m != mod}


def _kind(mod: str) -> str:
    last = mod.rpartition(".")[2]
    if mod in BOTTOM:
        return "bottom"
    if mod in SHARED:
        return "shared"
    if mod.startswith("helpers.kernels"):
        return "kernel"
    if mod in COMPAT:
        return "compat"
    if mod.startswith("helpers.check"):
        return "check"
    if mod.count(".") == 1 and re.fullmatch(r"lesson\d\d\w*", last):
        return "lesson"
    return "unknown"


def _lesson(mod: str) -> int | None:
    m = re.fullmatch(r"lesson(\d\d)\w*", mod.rpartition(".")[2])
    return int(m.group(1)) if m else None


def _by_kind(kind):
    return [m for m in MODULES if _kind(m) == kind]


def test_every_module_has_a_place():
    """A new module under helpers/ is given a layer here (and in CONTRIBUTING's picture) before it is used."""
    assert not [m for m in MODULES if _kind(m) == "unknown"]
    assert _by_kind("kernel") and _by_kind("lesson") and _by_kind("check")     # the globs still find them


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_helpers_never_import_bench_or_tests(mod):
    bad = {m: line for m, line in _imports(mod).items() if m.split(".")[0] in ABOVE_HELPERS}
    assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: bench/ and tests/ import helpers, never the reverse"


def test_the_bottom_imports_nothing_above_it():
    assert set(_course("helpers")) <= {"helpers.triton_mode"}, _course("helpers")
    assert not _course("helpers.triton_mode"), _course("helpers.triton_mode")


@pytest.mark.parametrize("mod", sorted(SHARED & set(MODULES)))
def test_shared_modules_import_only_shared_ones(mod):
    bad = {m: line for m, line in _course(mod).items() if _kind(m) not in ("bottom", "shared")}
    assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: a shared module sits below lessons, checkers, kernels"


def test_kernels_import_no_checker_lesson_or_grading():
    for mod in _by_kind("kernel"):
        bad = {m: line for m, line in _course(mod).items()
               if _kind(m) in ("check", "lesson") or m == "helpers.checking"}
        assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: a kernel stands on its own"


def test_old_kernel_paths_only_re_export_and_nothing_imports_them():
    """helpers/triton_*.py (but triton_mode) re-export the kernels' public names for learners' older notebooks;
    the course itself imports from helpers.kernels (tests/test_kernels_moved.py checks the re-exports)."""
    assert COMPAT <= set(MODULES)
    for mod in COMPAT:
        tree = ast.parse(MODULES[mod].read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert all(isinstance(n, (ast.ImportFrom, ast.Assign)) for n in body), f"{mod} does more than re-export"
    for mod in MODULES:
        bad = {m: line for m, line in _course(mod).items() if m in COMPAT}
        assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: import from helpers.kernels"
    old = re.compile(r"helpers[./](triton_attention|triton_varlen|triton_kvcache)\b")
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("solutions/*.ipynb")]:
        if path.name not in ("test_layout.py", "test_kernels_moved.py"):
            hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if old.search(line)]
            assert not hits, f"{path.relative_to(ROOT)} lines {hits} name an old kernel path: use helpers/kernels/"


def test_lessons_import_no_checker_and_no_other_lesson():
    for mod in _by_kind("lesson"):
        for m, line in _course(mod).items():
            where = f"{MODULES[mod].relative_to(ROOT)}:{line} imports {m}"
            assert _kind(m) != "check", f"{where}: checkers sit above the lessons"
            if _kind(m) == "lesson" and _lesson(m) != _lesson(mod):
                assert (mod, m) in LESSON_TO_LESSON, f"{where}: a piece two lessons share goes to a shared module"
                assert _lesson(m) < _lesson(mod), f"{where}: a lesson builds on earlier lessons only"
    for mod, m in LESSON_TO_LESSON:          # the list only shrinks: an entry nobody needs goes
        assert m in _course(mod), f"{mod} no longer imports {m}: remove it from LESSON_TO_LESSON"


def test_no_checker_imports_another_lessons_checker():
    for mod in _by_kind("check"):
        n = _lesson(mod)
        for m, line in _course(mod).items():
            where = f"{MODULES[mod].relative_to(ROOT)}:{line} imports {m}"
            if _kind(m) == "check":
                assert m == "helpers.check._common", f"{where}: shared pieces live in _common"
            if _kind(m) == "lesson" and n is not None:
                assert _lesson(m) <= n, f"{where}: a checker uses its own lesson's module or an earlier one"


def test_no_import_cycles():
    graph = {m: set(_course(m)) for m in MODULES}
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycle = path[path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
