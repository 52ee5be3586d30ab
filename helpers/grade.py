"""``make grade``: a progress report of a learner's notebooks, run headless and left untouched.

    python -m helpers.grade [notebooks/ | some.ipynb ...] [--expect pass|todo]

Each notebook is read into memory and run top to bottom by a fresh kernel (nbclient,
errors allowed, the learner's file is never written). The checkers append their verdicts
to a temporary file (``COURSE_GRADE_LOG``, see ``helpers.checking``); an exercise whose
check cell never gave one (a ``NameError`` from a cell that did not run, a kernel that
died, a timeout) is reported with the first line of the error. The table lists every
exercise found in a ``check.<name>(<name>)`` cell:

    notebook             exercise               result
    01_online_softmax    merge_ml               ❌ `l` at index (0,): got nan, expected 0; ...

It exits 0: a report, not a gate. ``--expect pass`` (every exercise ✅) or ``--expect todo``
(every exercise ⏳) turn it into a check, for the course's own tests.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

__all__ = ["Verdict", "exercises_in", "grade_notebook", "grade", "format_table", "main"]

CHECK_CALL = re.compile(r"^check\.(\w+)\((\w+)\)", re.M)
SYMBOL = {"pass": "✅", "fail": "❌", "todo": "⏳"}
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Verdict:
    notebook: str      # "01_online_softmax"
    exercise: str      # "merge_ml"
    status: str        # "pass" | "fail" | "todo"
    message: str       # the first line a learner would read

    @property
    def symbol(self) -> str:
        return SYMBOL[self.status]


def exercises_in(nb) -> list[tuple[int, str]]:
    """``(cell index, exercise name)`` for every ``check.<name>(<name>)`` call in the notebook."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            found += [(i, name) for name, arg in CHECK_CALL.findall(cell.source) if name == arg]
    return found


def _first_line(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text or "").strip()
    line = text.splitlines()[0] if text else ""
    for symbol in SYMBOL.values():                   # the table shows the symbol in its own column
        line = line.removeprefix(symbol).strip()
    return line


def _cell_error(cell) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename', 'Error')}: {_first_line(out.get('evalue', ''))}"
    return ""


def _notebook_paths(targets: list[str]) -> list[Path]:
    paths = []
    for t in targets:
        p = Path(t)
        if p.is_dir():
            paths += sorted(q for q in p.glob("[0-9][0-9]_*.ipynb") if ".backup-" not in q.name)
        elif p.suffix == ".ipynb" and p.exists():
            paths.append(p)
        else:
            raise SystemExit(f"grade: {t} is neither a folder nor a notebook")
    return paths


def grade_notebook(path: Path, timeout: int = 600, kernel_name: str = "python3") -> list[Verdict]:
    """Run one notebook in memory and return one verdict per exercise; the file is not written."""
    from nbclient import NotebookClient
    stem = path.stem
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:                                # a learner may break the JSON by hand
        return [Verdict(stem, "-", "fail", f"cannot read the notebook: {_first_line(str(e))}")]
    exercises = exercises_in(nb)
    if not exercises:
        return []
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        log = Path(tmp) / "verdicts.jsonl"
        env_before = {k: os.environ.get(k) for k in ("COURSE_GRADE_LOG", "COURSE_STRICT")}
        os.environ["COURSE_GRADE_LOG"] = str(log)          # the kernel inherits this environment
        os.environ.pop("COURSE_STRICT", None)              # a report shows ⏳, not a failure
        problem = ""
        try:
            client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, allow_errors=True,
                                    resources={"metadata": {"path": str(path.parent.resolve())}})
            with open(Path(tmp) / "kernel.log", "w") as kernel_log:   # keep the kernel's chatter
                client.execute(stderr=kernel_log, stdout=kernel_log)
        except Exception as e:                               # timeout, dead kernel, no kernel
            problem = f"{type(e).__name__}: {_first_line(str(e))}"
        finally:
            for k, v in env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        said = {}
        if log.exists():
            for line in log.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                said[rec["exercise"]] = rec                    # the last verdict for a name wins
    verdicts = []
    for index, name in exercises:
        if name in said:
            rec = said[name]
            message = _first_line(rec["message"]).removeprefix(f"{name}:").strip()
            verdicts.append(Verdict(stem, name, rec["status"], message))
        else:
            why = _cell_error(nb.cells[index]) or problem or "the check cell gave no verdict"
            verdicts.append(Verdict(stem, name, "fail", f"not graded: {why}"))
    return verdicts


def grade(targets: list[str], timeout: int = 600, progress=None) -> list[Verdict]:
    verdicts = []
    for path in _notebook_paths(targets):
        t0 = time.perf_counter()
        found = grade_notebook(path, timeout=timeout)
        if progress:
            progress(f"  ran {path.name} ({time.perf_counter() - t0:.0f} s)")
        verdicts += found
    return verdicts


def format_table(verdicts: list[Verdict], width: int | None = None) -> str:
    if width is None:
        width = shutil.get_terminal_size((120, 24)).columns
    w_nb = max([len("notebook")] + [len(v.notebook) for v in verdicts])
    w_ex = max([len("exercise")] + [len(v.exercise) for v in verdicts])
    room = max(width - w_nb - w_ex - 8, 30)
    lines = [f"{'notebook':<{w_nb}}  {'exercise':<{w_ex}}  result", f"{'-' * w_nb}  {'-' * w_ex}  {'-' * 6}"]
    for v in verdicts:
        msg = v.message if len(v.message) <= room else v.message[: room - 1] + "…"
        lines.append(f"{v.notebook:<{w_nb}}  {v.exercise:<{w_ex}}  {v.symbol} {msg}")
    counts = {s: sum(v.status == s for v in verdicts) for s in SYMBOL}
    lines.append(f"{counts['pass']} ✅  {counts['fail']} ❌  {counts['todo']} ⏳  of {len(verdicts)} exercises")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", default=[str(ROOT / "notebooks")],
                    help="notebook folders or files (default: notebooks/)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    ap.add_argument("--expect", choices=["pass", "todo"],
                    help="exit 1 unless every exercise is ✅ (pass) or ⏳ (todo)")
    args = ap.parse_args(argv)
    print(f"grading {', '.join(args.targets)} (run headless in memory; your files are not changed)",
          file=sys.stderr)
    verdicts = grade(args.targets, timeout=args.timeout, progress=lambda s: print(s, file=sys.stderr))
    print(format_table(verdicts))
    if args.expect:
        if not verdicts:
            print(f"--expect {args.expect}: no exercises found", file=sys.stderr)
            return 1
        off = [v for v in verdicts if v.status != args.expect]
        if off:
            print(f"--expect {args.expect}: {len(off)} exercise(s) are not {SYMBOL[args.expect]}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
