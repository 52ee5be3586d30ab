"""``make grade``: a progress report of a learner's notebooks, run headless and left untouched.

    python -m helpers.grade [notebooks/ | some.ipynb ...] [--verbose] [--all] [--expect pass|todo]

Each notebook is read into memory and run top to bottom by a fresh kernel (nbclient,
errors allowed, the learner's file is never written). The checkers append their verdicts
to a temporary file (``COURSE_GRADE_LOG``, see ``helpers.checking``); an exercise whose
check cell never gave one (a ``NameError`` from a cell that did not run, a kernel that
died, a timeout) is reported with the first line of the error. The table lists every
exercise found in a ``check.<name>(<name>)`` cell, and every exercise of the worked notebook
of the same name whose check cell is gone ("check cell missing"); a notebook that cannot be
read is a row too, and the rest of the table still comes:

    notebook             exercise               result
    01_online_softmax    merge_ml               ❌ wrong: `l` at index (0,): got nan, expected 0; ...

Only what changed is run again: a notebook whose file and the course's code are as they were at the last grade
keeps its verdicts (``.course/grade-cache.json`` beside it; ``--all`` runs everything). It grades the *saved* files,
so a check that JupyterLab showed after the notebook was last saved, and that the file does not give, is named
under its row ("not saved?"): the lab records each verdict it shows (``helpers.progress``).

``--verbose`` prints the rest of each verdict under its row (the case and the hint). Graded
from several folders, a notebook is named with its folder. Exercises of a notebook that
stopped because this machine lacks something (lesson 07 without Triton) are ➖, with the reason.

It exits 0: a report, not a gate. ``--expect pass`` (every exercise ✅) or ``--expect todo``
(every exercise ⏳) turn it into a check, for the course's own tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


from .generate import META_KEY, Unreadable, exercises_in, read_notebook

__all__ = ["Verdict", "exercises_in", "expected_exercises", "grade_notebook", "grade", "format_table", "main"]

SYMBOL = {"pass": "✅", "fail": "❌", "todo": "⏳", "skip": "➖"}
ROOT = Path(__file__).resolve().parent.parent
# An exception a notebook raises on purpose to stop where this machine cannot go on (its class
# name, as the kernel reports it): the exercises after it are "skip", with its message.
STOPS = ("TritonMissing",)


@dataclass
class Verdict:
    notebook: str      # "01_online_softmax"
    exercise: str      # "merge_ml"
    status: str        # "pass" | "fail" | "todo" | "skip"
    message: str       # the first line a learner would read
    details: list = field(default_factory=list)   # the verdict's other lines: the case, the hint
    folder: str = ""   # the folder the notebook was read from
    unsaved: str = ""  # what the lab showed after the file was last saved, when it differs (see ``unsaved``)

    @property
    def symbol(self) -> str:
        return SYMBOL[self.status]




def expected_exercises(path: Path, nb=None) -> list[str]:
    """The exercises of the worked notebook this one was generated from (or of the same name), in order."""
    source = nb.metadata.get(META_KEY, {}).get("generated_from") if nb is not None else None
    worked = ROOT / source if source else ROOT / "solutions" / path.name
    try:
        return [name for _, name in exercises_in(read_notebook(worked))]
    except Unreadable:                                # not one of the course's notebooks: no expectations
        return []


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


def _stop(nb) -> tuple[int, str] | None:
    """``(cell index, message)`` of the first cell that stopped the notebook on purpose (``STOPS``)."""
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and out.get("ename") in STOPS:
                return i, _first_line(out.get("evalue", ""))
    return None


def _details(message: str) -> list[str]:
    """The lines of a verdict after its first (the case, the hint), without their indent."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", message or "").strip().splitlines()[1:]
    return [line.strip() for line in lines if line.strip()]


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
    stem, folder = path.stem, str(path.parent)
    try:
        nb = read_notebook(path)
    except Unreadable as e:                               # a learner may break the JSON by hand
        return [Verdict(stem, name, "fail", f"cannot read the notebook: {e}", folder=folder)
                for name in expected_exercises(path) or ["-"]]
    exercises = exercises_in(nb)
    missing = [name for name in expected_exercises(path, nb) if name not in {n for _, n in exercises}]
    if not exercises:
        return [_missing(stem, name, folder) for name in missing]
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
    stop = _stop(nb)
    for index, name in exercises:
        if stop and index > stop[0]:          # Run All stops there; what ran after it (grade runs on) is moot
            verdicts.append(Verdict(stem, name, "skip", f"not run here: {stop[1]}", folder=folder))
        elif name in said:
            rec = said[name]
            message = _first_line(rec["message"]).removeprefix(name).lstrip(": ").strip()
            details = _details(rec["message"])
            if rec.get("hint") and not any(d.startswith("hint:") for d in details):
                details.append(f"hint: {rec['hint']}")
            verdicts.append(Verdict(stem, name, rec["status"], message, details, folder))
        else:
            why = _cell_error(nb.cells[index]) or problem or "the check cell gave no verdict"
            verdicts.append(Verdict(stem, name, "fail", f"not graded: {why}", folder=folder))
    order = {name: k for k, name in enumerate(expected_exercises(path, nb))}
    for name in missing:                                  # in the worked notebook's order
        verdicts.append(_missing(stem, name, folder))
    verdicts.sort(key=lambda v: order.get(v.exercise, len(order)))   # exercises the course lacks go last
    return verdicts


def _missing(stem: str, name: str, folder: str) -> Verdict:
    return Verdict(stem, name, "fail", f"check cell missing: put `check.{name}({name})` back in a cell "
                                       f"below your `{name}`", folder=folder)


CACHE_NAME = "grade-cache.json"


def course_key() -> str:
    """A hash of the course's code (helpers/) and worked notebooks' sources: a cached grade is reused only while
    it is the same (a course update re-grades everything)."""
    h = hashlib.sha256()
    for p in sorted(ROOT.glob("helpers/**/*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()


def _cache_path(folder: Path) -> Path:
    from .progress import LOG_DIR
    return folder / LOG_DIR / CACHE_NAME


def _load_cache(folder: Path) -> dict:
    try:
        return json.loads(_cache_path(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _save_cache(folder: Path, cache: dict) -> None:
    try:
        _cache_path(folder).parent.mkdir(exist_ok=True)
        _cache_path(folder).write_text(json.dumps(cache, indent=1), encoding="utf-8")
    except OSError:
        pass                                           # a read-only folder: the next grade runs everything again


def unsaved(path: Path, verdicts: list[Verdict]) -> list[str]:
    """The exercises of ``path`` whose last verdict in JupyterLab (``helpers.progress``) differs from the saved
    file's, given after the file was last saved: work the lab shows that the file does not hold yet."""
    from .progress import SYMBOL as LAB, lab_verdicts
    seen, saved_at = lab_verdicts(path.parent), path.stat().st_mtime
    out = []
    for v in verdicts:
        e = seen.get((v.notebook, v.exercise))
        if e and e["status"] != v.status and e["time"] > saved_at:
            out.append(f"{v.exercise}: the lab showed {LAB.get(e['status'], '?')} at "
                       f"{time.strftime('%H:%M:%S', time.localtime(e['time']))}, after the notebook was last saved "
                       f"({time.strftime('%H:%M:%S', time.localtime(saved_at))})")
    return out


def grade(targets: list[str], timeout: int = 600, progress=None, everything: bool = False) -> list[Verdict]:
    """Grade every notebook of ``targets``; a notebook that breaks the grader is a row, never a lost table.

    A notebook whose file (and the course's code) did not change since the last grade keeps its verdicts from then
    (``.course/grade-cache.json`` beside it) unless ``everything``. Each verdict the lab showed after the file was
    last saved, and that the file does not give, is named on the verdict (``Verdict.unsaved``)."""
    verdicts = []
    key, caches = course_key(), {}
    for path in _notebook_paths(targets):
        t0 = time.perf_counter()
        folder = path.parent
        cache = caches.setdefault(folder, _load_cache(folder))
        digest = hashlib.sha256(path.read_bytes()).hexdigest() + key
        hit = cache.get(path.name)
        if hit and hit.get("key") == digest and not everything:
            found = [Verdict(**v) for v in hit["verdicts"]]
            for v in found:
                v.unsaved = ""
            if progress:
                progress(f"  kept {path} (unchanged since the last grade)")
        else:
            try:
                found = grade_notebook(path, timeout=timeout)
            except KeyboardInterrupt:
                verdicts.append(Verdict(path.stem, "-", "fail", "not graded: interrupted (Ctrl-C)",
                                        folder=str(path.parent)))
                break
            except Exception as e:  # noqa: BLE001 - one notebook must not cost the rest of the table
                found = [Verdict(path.stem, "-", "fail", f"not graded: {type(e).__name__}: {_first_line(str(e))}",
                                 folder=str(path.parent))]
            else:
                cache[path.name] = {"key": digest, "verdicts": [dataclasses.asdict(v) for v in found]}
                _save_cache(folder, cache)
            if progress:
                progress(f"  ran {path} ({time.perf_counter() - t0:.0f} s)")
        notes = dict(line.split(": ", 1) for line in unsaved(path, found))
        for v in found:
            v.unsaved = notes.get(v.exercise, "")
        verdicts += found
    return verdicts


def format_table(verdicts: list[Verdict], width: int | None = None, verbose: bool = False) -> str:
    """The table; with ``verbose`` each verdict's other lines (case, hint) follow its row, wrapped."""
    import textwrap
    if width is None:
        width = shutil.get_terminal_size((120, 24)).columns
    several = len({v.folder for v in verdicts}) > 1          # name the folder when grading several
    label = (lambda v: str(Path(v.folder) / v.notebook)) if several else (lambda v: v.notebook)
    w_nb = max([len("notebook")] + [len(label(v)) for v in verdicts])
    w_ex = max([len("exercise")] + [len(v.exercise) for v in verdicts])
    room = max(width - w_nb - w_ex - 8, 30)
    lines = [f"{'notebook':<{w_nb}}  {'exercise':<{w_ex}}  result", f"{'-' * w_nb}  {'-' * w_ex}  {'-' * 6}"]
    indent = " " * (w_nb + w_ex + 7)
    wrap = lambda text, first, rest: textwrap.wrap(  # noqa: E731
        text, width=max(width, len(indent) + 30), initial_indent=first, subsequent_indent=rest,
        break_on_hyphens=False)
    for v in verdicts:
        row = f"{label(v):<{w_nb}}  {v.exercise:<{w_ex}}  {v.symbol} "
        if verbose:                                           # the whole verdict, wrapped
            lines += wrap(v.message, row, indent + "  ") or [row]
            for d in v.details:
                lines += wrap(d, indent, indent + "  ")
        else:
            lines.append(row + (v.message if len(v.message) <= room else v.message[: room - 1] + "…"))
        if v.unsaved:
            lines += wrap(f"not saved? {v.unsaved}: save the notebook (Ctrl+S) and grade again", indent, indent + "  ")
    counts = {s: sum(v.status == s for v in verdicts) for s in SYMBOL}
    tally = f"{counts['pass']} ✅  {counts['fail']} ❌  {counts['todo']} ⏳"
    if counts["skip"]:
        tally += f"  {counts['skip']} ➖"
    lines.append(f"{tally}  of {len(verdicts)} exercises")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", default=[str(ROOT / "notebooks")],
                    help="notebook folders or files (default: notebooks/)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    ap.add_argument("--verbose", "-v", action="store_true",
                    help="under each row, the rest of its verdict: the case and the hint")
    ap.add_argument("--all", action="store_true", dest="everything",
                    help="run every notebook again, also those unchanged since the last grade")
    ap.add_argument("--expect", choices=["pass", "todo"],
                    help="exit 1 unless every exercise is ✅ (pass) or ⏳ (todo)")
    args = ap.parse_args(argv)
    print(f"grading {', '.join(args.targets)} (run headless in memory; your files are not changed)",
          file=sys.stderr)
    verdicts = grade(args.targets, timeout=args.timeout, progress=lambda s: print(s, file=sys.stderr),
                     everything=args.everything)
    print(format_table(verdicts, verbose=args.verbose))
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
