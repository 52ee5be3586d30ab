"""A learner's progress: the verdicts the checkers gave in JupyterLab, and the course map the start notebook shows.

Every verdict a checker gives inside a notebook that JupyterLab opened is appended to ``.course/progress.jsonl``
beside that notebook (the lab tells its kernel the notebook's path, ``JPY_SESSION_NAME``). So:

- the start notebook (``00_start_here``) shows, without running anything, the last verdict of each exercise of
  each lesson (``show``), and the course map with each lesson's time estimate (``course_map``);
- ``make grade``, which runs the *saved* notebooks, can tell a notebook whose saved file does not give what the
  lab last showed: work not saved yet (``helpers.grade``).

Nothing here runs a notebook or imports Triton; a run outside the lab (nbval, ``make grade``, pytest) records
nothing.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

__all__ = ["LOG_DIR", "notebook_path", "record", "lab_verdicts", "lessons", "course_map", "show"]

LOG_DIR = ".course"                 # beside the notebooks: JupyterLab's file browser hides dot-folders
LOG_NAME = "progress.jsonl"
SYMBOL = {"pass": "✅", "fail": "❌", "todo": "⏳"}
WORDS = {"pass": "passed", "fail": "wrong", "todo": "not attempted"}
ROOT = Path(__file__).resolve().parent.parent
TIME = re.compile(r"About (\d+) minutes")


def notebook_path() -> Path | None:
    """The notebook this kernel runs, as JupyterLab told it (``JPY_SESSION_NAME``); None outside the lab."""
    name = os.environ.get("JPY_SESSION_NAME", "")
    return Path(name) if name.endswith(".ipynb") else None


def record(exercise: str, status: str, message: str) -> None:
    """Append one verdict to the progress log beside the notebook the lab is running; nothing outside the lab.

    Never raises: a read-only folder costs the learner the progress view, not the check."""
    nb = notebook_path()
    if nb is None or os.environ.get("COURSE_GRADE_LOG"):        # make grade runs saved files: not the lab's view
        return
    entry = {"notebook": nb.stem, "exercise": exercise, "status": status, "time": time.time(),
             "message": (message.strip().splitlines() or [""])[0]}
    try:
        folder = nb.parent / LOG_DIR
        folder.mkdir(exist_ok=True)
        with open(folder / LOG_NAME, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError:
        pass


def lab_verdicts(folder) -> dict:
    """``{(notebook, exercise): entry}``: the last verdict the lab showed for each exercise of the notebooks in
    ``folder`` (``entry`` has ``status``, ``time``, ``message``). {} when the lab has shown none."""
    path = Path(folder) / LOG_DIR / LOG_NAME
    out = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            e = json.loads(line)
            out[(e["notebook"], e["exercise"])] = e
        except (ValueError, KeyError, TypeError):
            continue                                      # a line cut short by a killed kernel
    return out


def lessons(folder=None) -> list[dict]:
    """The course's lessons, in order: ``{"name", "number", "title", "minutes", "exercises"}`` read from the worked
    notebooks (their title cell and its *About N minutes*, their check cells), so that the map is never typed.
    The notebooks are read as the JSON they are (nbformat 4): importing nbformat takes seconds on a small machine
    (its schema validator loads a grammar), and the start notebook calls this first."""
    from .generate import exercises_in
    out = []
    for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        if p.name.startswith("00_"):
            continue
        nb = json.loads(p.read_text(encoding="utf-8"))
        first = nb["cells"][0] if nb["cells"] else None
        head = "".join(first["source"]) if first and first["cell_type"] == "markdown" else ""
        title = head.splitlines()[0].lstrip("# ").split("·", 1)[-1].strip() if head else p.stem
        m = TIME.search(head)
        out.append({"name": p.stem, "number": p.stem[:2], "title": title, "minutes": int(m.group(1)) if m else None,
                    "exercises": [name for _, name in exercises_in(nb)]})
    return out


def course_map() -> str:
    """A text table of the lessons: number, title, time estimate, exercises; and the total time."""
    rows = lessons()
    w = max(len(r["title"]) for r in rows)
    lines = [f"{'#':>2}  {'lesson':<{w}}  {'time':>7}  exercises"]
    for r in rows:
        t = f"{r['minutes']} min" if r["minutes"] else "?"
        lines.append(f"{r['number']:>2}  {r['title']:<{w}}  {t:>7}  {len(r['exercises'])}")
    total = sum(r["minutes"] or 0 for r in rows)
    lines.append(f"about {total // 60} h {total % 60:02d} min in all, {sum(len(r['exercises']) for r in rows)} exercises")
    return "\n".join(lines)


def show(folder=None) -> str:
    """The learner's progress, from the verdicts the lab showed (no notebook is run): a line per lesson with each
    exercise's last verdict. ``folder``: the learner's notebooks (default: the folder of the notebook running this,
    else notebooks/). Returns the text and prints it."""
    nb = notebook_path()
    folder = Path(folder) if folder else (nb.parent if nb else ROOT / "notebooks")
    seen = lab_verdicts(folder)
    lines, done, total = [], 0, 0
    for r in lessons():
        marks = []
        for ex in r["exercises"]:
            e = seen.get((r["name"], ex))
            status = e["status"] if e else None
            done += status == "pass"
            total += 1
            marks.append(f"{SYMBOL.get(status, '·')} {ex}")
        passed = sum(seen.get((r["name"], ex), {}).get("status") == "pass" for ex in r["exercises"])
        lines.append(f"{r['number']} {r['title'][:44]:<44} {passed}/{len(r['exercises'])}  " + "  ".join(marks))
    head = (f"your progress in {folder} (the last verdict each check cell gave in JupyterLab; "
            f"✅ passed, ❌ wrong, ⏳ not attempted, · not run yet): {done} of {total} exercises passed")
    text = "\n".join([head, *lines])
    print(text)
    return text
