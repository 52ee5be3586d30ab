"""The house's layout, held by a test: one folder per lesson, the framework and the kernels apart, and who may
import whom (CONTRIBUTING.md, "The house").

Imports are read with ``ast`` (module level and inside functions alike), never run. From the bottom up:

- the bottom, ``helpers/__init__.py`` and ``helpers/triton_mode.py``: the package imports only ``triton_mode``,
  which imports nothing of the course;
- the framework (``FRAMEWORK``: grading, the time limit, the checkers' shared cases, the meter, the references,
  the record readers, widgets, the generator, ``make grade``): the bottom and each other only;
- the kernels (``helpers/kernels/``): the bottom, ``reference`` and each other; never a lesson or the grading;
- a lesson (``helpers/lessonNN/``: its plain functions in ``__init__``, its checker in ``check.py``, its other
  pieces beside them): the bottom, the framework, the kernels and its own folder; an earlier lesson's plain
  functions only where ``LESSON_TO_LESSON`` lists it (a list that may only shrink); a lesson's plain modules never
  import a checker, and no checker imports another lesson's checker;
- ``helpers/check.py`` on top of ``helpers/``: it only gathers the lessons' checkers; beside it the tools that use
  the whole course (``TOOLS``: ``make check-setup``), which nothing imports;
- ``bench/`` and ``tests/`` above it all: nothing in ``helpers/`` imports them;
- no import cycles, no module outside ``helpers/kernels/`` over ``MAX_LINES`` lines.
"""
from __future__ import annotations

import ast
import re

import pytest

from conftest import ROOT

HELPERS = ROOT / "helpers"
MAX_LINES = 800
BOTTOM = {"helpers", "helpers.triton_mode"}
FRAMEWORK = {f"helpers.{m}" for m in ("checking", "timelimit", "cases", "meter", "meter_python", "reference",
                                      "results", "widgets", "generate", "grade", "progress")}
GATHER = "helpers.check"
TOOLS = {"helpers.setup_check"}        # on top, beside helpers.check: they use the whole course
ABOVE_HELPERS = {"bench", "tests", "conftest", "common"}      # bench/ scripts import bench/common.py as `common`
# A lesson that builds on an earlier lesson's plain functions. Move a piece two lessons share to the framework
# instead of adding here.
LESSON_TO_LESSON = {
    ("helpers.lesson05", "helpers.lesson04"),      # tiled_masked_attention, behind a figure
    ("helpers.lesson08", "helpers.lesson04"),      # the tile grid and its visibility
    ("helpers.lesson08", "helpers.lesson06"),      # the H200's datasheet FLOP/s and bytes/s
}
LESSON = re.compile(r"helpers\.lesson(\d\d)(\.\w+)?")


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


def _lesson(mod: str) -> int | None:
    m = LESSON.fullmatch(mod)
    return int(m.group(1)) if m else None


def _is_checker(mod: str) -> bool:
    return _lesson(mod) is not None and mod.rpartition(".")[2].startswith("check")


def _kind(mod: str) -> str:
    if mod in BOTTOM:
        return "bottom"
    if mod in FRAMEWORK:
        return "framework"
    if mod == GATHER:
        return "gather"
    if mod in TOOLS:
        return "tool"
    if mod == "helpers.kernels" or mod.startswith("helpers.kernels."):
        return "kernel"
    if _lesson(mod) is not None:
        return "checker" if _is_checker(mod) else "lesson"
    return "unknown"


def _by_kind(kind):
    return [m for m in MODULES if _kind(m) == kind]


def _where(mod, m, line):
    return f"{MODULES[mod].relative_to(ROOT)}:{line} imports {m}"


def test_every_module_has_a_place():
    """A new module under helpers/ is given a layer here (and in CONTRIBUTING's picture) before it is used."""
    assert not [m for m in MODULES if _kind(m) == "unknown"]
    assert _by_kind("kernel") and _by_kind("lesson") and _by_kind("checker")     # the globs still find them


def test_one_folder_per_lesson():
    """Every lesson of solutions/ has its folder helpers/lessonNN/ with its plain functions and its checker; no
    lesson code stands outside it (no helpers/lessonNN_*.py, no checker folder of its own)."""
    numbers = sorted(p.name[:2] for p in ROOT.glob("solutions/[0-9][0-9]_*.ipynb") if not p.name.startswith("00_"))
    assert numbers
    for nn in numbers:
        folder = HELPERS / f"lesson{nn}"
        assert (folder / "__init__.py").is_file() and (folder / "check.py").is_file(), folder
    stray = [p.relative_to(ROOT) for p in HELPERS.glob("*.py") if re.match(r"lesson\d\d", p.name)]
    assert not stray, f"lesson code outside its folder: {stray}"
    assert not (HELPERS / "check").exists(), "helpers/check/ is gone: a lesson's checker is helpers/lessonNN/check.py"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_helpers_never_import_bench_or_tests(mod):
    bad = {m: line for m, line in _imports(mod).items() if m.split(".")[0] in ABOVE_HELPERS}
    assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: bench/ and tests/ import helpers, never the reverse"


def test_the_bottom_imports_nothing_above_it():
    assert set(_course("helpers")) <= {"helpers.triton_mode"}, _course("helpers")
    assert not _course("helpers.triton_mode"), _course("helpers.triton_mode")


@pytest.mark.parametrize("mod", sorted(FRAMEWORK & set(MODULES)))
def test_the_framework_imports_only_the_framework(mod):
    bad = {m: line for m, line in _course(mod).items() if _kind(m) not in ("bottom", "framework")}
    assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: the framework sits below lessons and kernels"


def test_kernels_import_no_lesson_and_no_grading():
    for mod in _by_kind("kernel"):
        for m, line in _course(mod).items():
            assert _kind(m) in ("bottom", "kernel") or m == "helpers.reference", \
                f"{_where(mod, m, line)}: a kernel stands on its own (the bottom, reference and other kernels)"


def test_lessons_import_their_own_folder_and_earlier_lessons_only_where_listed():
    for mod in _by_kind("lesson") + _by_kind("checker"):
        n = _lesson(mod)
        for m, line in _course(mod).items():
            assert _kind(m) != "gather", f"{_where(mod, m, line)}: helpers.check sits above the lessons"
            if _kind(m) == "checker":
                assert _is_checker(mod) and _lesson(m) == n, \
                    f"{_where(mod, m, line)}: a lesson's plain functions never import a checker, no checker another lesson's"
            elif _kind(m) == "lesson" and _lesson(m) != n:
                top = f"helpers.lesson{n:02d}"
                assert (top, f"helpers.lesson{_lesson(m):02d}") in LESSON_TO_LESSON, \
                    f"{_where(mod, m, line)}: a piece two lessons share goes to the framework"
                assert _lesson(m) < n, f"{_where(mod, m, line)}: a lesson builds on earlier lessons only"
    for mod, m in LESSON_TO_LESSON:          # the list only shrinks: an entry nobody needs goes
        users = [u for u in MODULES if _lesson(u) == _lesson(mod) and any(_lesson(x) == _lesson(m)
                                                                         for x in _course(u))]
        assert users, f"lesson {mod} no longer imports {m}: remove it from LESSON_TO_LESSON"


def test_helpers_check_only_gathers_the_checkers():
    assert set(_course(GATHER)) <= {"helpers.checking"}, _course(GATHER)
    text = MODULES[GATHER].read_text()
    assert "lesson[0-9][0-9]" in text and 'startswith("check")' in text   # it finds them by folder and name


def test_nothing_imports_the_tools():
    for mod in MODULES:
        bad = {m: line for m, line in _course(mod).items() if _kind(m) == "tool"}
        assert not bad, f"{MODULES[mod].relative_to(ROOT)} imports {bad}: the tools sit on top"


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


def test_no_module_outside_the_kernels_is_over_the_size_limit():
    big = {str(p.relative_to(ROOT)): n for m, p in MODULES.items() if _kind(m) != "kernel"
           for n in [len(p.read_text().splitlines())] if n > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines (split it by job): {big}"


def test_docstrings_and_comments_keep_the_reasons_not_the_measurements():
    """A measured figure lives in its record (bench/results/), its history in git and bench/NOTES.md: no date and
    no measured rate, time or ratio in the docstrings and comments under helpers/ (a FLOP count is arithmetic,
    a figure from a cited paper or datasheet is the source's)."""
    import io
    import tokenize

    from test_lesson_form import CITED, MEASURED
    found = []
    for mod, path in MODULES.items():
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            prose = tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                                     and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")))
            if not prose:
                continue
            for m in MEASURED.finditer(tok.string):
                around = tok.string[max(0, m.start() - 80):m.end() + 30]
                if CITED.search(around) or re.search(r"FLOPs\b|x the forward", around):
                    continue
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: …{around.strip()!r}…")
    assert not found, "measured figures in docstrings or comments:\n" + "\n".join(found)


def test_no_python_file_outside_the_kernels_is_over_the_size_limit():
    """The same limit for the tests, the GPU scripts, the browser tests and the site's build (the kernels alone may
    be longer: a kernel family's variants are one file)."""
    files = [p for folder in ("tests", "bench", "e2e", "site") for p in (ROOT / folder).rglob("*.py")]
    big = {str(p.relative_to(ROOT)): n for p in files for n in [len(p.read_text().splitlines())] if n > MAX_LINES}
    assert files and not big, f"over {MAX_LINES} lines (split it by job): {big}"


def test_every_kept_log_is_named_where_a_reader_meets_it():
    """A log under bench/results/logs/ stays only while something cites it (NOTES, a record, a lesson's table, a
    comment, a notebook); history is git's."""
    logs = ROOT / "bench" / "results" / "logs"
    texts = [p.read_text(errors="replace") for p in ROOT.rglob("*")
             if p.is_file() and p.suffix in (".py", ".md", ".json", ".ipynb") and logs not in p.parents
             and not any(part in (".git", ".venv", "build", "artifacts") for part in p.relative_to(ROOT).parts)]
    unnamed = [p.name for p in sorted(logs.glob("*")) if not any(p.name in t for t in texts)]
    assert not unnamed, f"logs nothing names (remove them, or cite them where they are evidence): {unnamed}"
