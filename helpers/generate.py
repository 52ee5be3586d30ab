"""Generate the learner notebooks (``notebooks/``) from the worked ones (``solutions/``).

The worked notebook is the one source. In its code cells, each answer sits between

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

and becomes, at the same indentation,

    # YOUR CODE HERE
    raise NotImplementedError("merge_ml: replace this line with your code")

naming the exercise (the function the region is in, or the name written after
``BEGIN SOLUTION``). Outputs and execution counts are dropped. A cell tagged
``solution-only`` is left out of the learner notebook.

Each generated notebook records a hash of its cell sources in its metadata. A later
run overwrites a learner notebook only when its sources still have that hash (the
learner has not edited it); otherwise it refuses and names the file (exit code 2), or,
with ``--force``, first copies it byte for byte to ``NN_name.backup-<time>.ipynb``
(``-2``, ``-3``, ... when that name is taken: a backup never replaces another). A
notebook it cannot read (not UTF-8, not JSON, a cell without ``source``) counts as
edited: refused, or backed up with ``--force``.

    python -m helpers.generate                 # solutions/ -> notebooks/
    python -m helpers.generate --out DIR       # somewhere else (the drift test)
    python -m helpers.generate --check         # exit 1 if notebooks/ drifted
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from pathlib import Path

# nbformat is imported in the functions that read, write or validate notebooks, not here: helpers.progress uses
# exercises_in from this module in the start notebook, and importing nbformat takes seconds on a small machine.

ROOT = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION[ \t]*(?P<name>\w+)?[ \t]*$")
END = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(")
META_KEY = "course"


# Where the course is published: the set-up cell of a notebook opened outside the course fetches it from here
# (a hosted notebook service such as Colab or Kaggle). A fork sets its own address here (or COURSE_URL at run time)
# and runs `make notebooks`; tests/test_generate.py checks every notebook's first cell against SETUP_CELL.
COURSE_URL = "https://github.com/flash-attention-course/flash-attention-course"

# Every notebook's first code cell, the same in all of them, its source hidden (JupyterLab shows its first line,
# Colab its title). In the course's own lab it imports `helpers` and is done. Opened anywhere else (another
# Jupyter, a copy on its own, a hosted notebook), it finds the course folder above the notebook, or fetches it,
# installs it into this kernel's Python and runs on: one visible cell, no other step.
SETUP_CELL = """\
#@title Set-up: the course's code (opened outside the course, this cell fetches and installs it)
try:
    import torch, helpers
except ModuleNotFoundError as missing:     # another Jupyter, a copy on its own, a hosted notebook (Colab, Kaggle)
    import os, pathlib, subprocess, sys
    def step(*cmd):
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"set-up stopped: `{' '.join(cmd[:5])} ...` failed; its message is above") from None
    up = [p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "helpers" / "checking.py").is_file()]
    root = up[0] if up else pathlib.Path(os.environ.get("COURSE_DIR", "flash-attention-course")).resolve()
    if not up and not (root / "helpers").is_dir():
        url = os.environ.get("COURSE_URL", "%s")
        print(f"`{missing.name}` is not in this Python: fetching the course from {url} into {root}")
        step("git", "clone", "--quiet", "--depth", "1", url, str(root))
    print(f"installing the course ({root}) into this kernel's Python (a minute or two)")
    step(sys.executable, "-m", "pip", "install", "--quiet", "-e", str(root))
    sys.path.insert(0, str(root))
    import torch, helpers
""" % COURSE_URL
# The set-up cell's metadata: its source hidden in JupyterLab (`jupyter.source_hidden`) and shown as a form with
# its title in Colab (`cellView`).
SETUP_METADATA = {"jupyter": {"source_hidden": True}, "cellView": "form", "tags": ["course-setup"]}
# The cell metadata a learner notebook keeps from its worked notebook.
KEEP_METADATA = ("tags", "jupyter", "editable", "deletable", "cellView", "jp-MarkdownHeadingCollapsed")


CHECK_CALL = re.compile(r"^check\.(\w+)\((\w+)\)", re.M)


def exercises_in(nb) -> list[tuple[int, str]]:
    """``(cell index, exercise name)`` for every ``check.<name>(<name>)`` call in the notebook (nbformat's, or the
    notebook's JSON as ``json.load`` gives it: a cell's source a string or a list of lines)."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            found += [(i, name) for name, arg in CHECK_CALL.findall(src) if name == arg]
    return found


class GenerateError(Exception):
    pass


def stub_source(source: str, where: str = "") -> str:
    """Replace each solution region in one cell's source by a stub."""
    out, in_region, name_stack = [], False, []
    lines = source.split("\n")
    for n, line in enumerate(lines, 1):
        if in_region:
            if END.match(line):
                in_region = False
            elif BEGIN.match(line):
                raise GenerateError(f"{where}: line {n}: BEGIN SOLUTION inside another region")
            continue
        m = DEF.match(line)
        if m:
            name_stack.append(m.group(1))
        b = BEGIN.match(line)
        if b:
            name = b.group("name") or (name_stack[-1] if name_stack else "this exercise")
            indent = b.group("indent")
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f'{indent}raise NotImplementedError("{name}: replace this line with your code")')
            in_region = True
            continue
        if END.match(line):
            raise GenerateError(f"{where}: line {n}: END SOLUTION without BEGIN SOLUTION")
        out.append(line)
    if in_region:
        raise GenerateError(f"{where}: a BEGIN SOLUTION region is never closed")
    return "\n".join(out)


def sources_hash(nb) -> str:
    h = hashlib.sha256()
    for cell in nb.cells:
        h.update(cell.cell_type.encode())
        h.update(b"\0")
        h.update(cell.source.encode())
        h.update(b"\1")
    return h.hexdigest()


def learner_notebook(solution_path: Path):
    """The learner notebook (a NotebookNode) generated from one worked notebook."""
    import nbformat
    try:
        nb = read_notebook(solution_path)
    except Unreadable as e:
        raise GenerateError(f"{solution_path}: {e}") from None
    cells = []
    for i, cell in enumerate(nb.cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if "solution-only" in tags:
            continue
        new = nbformat.from_dict(dict(cell))
        new.metadata = nbformat.from_dict({k: v for k, v in cell.metadata.items() if k in KEEP_METADATA})
        new.pop("id", None)
        if cell.cell_type == "code":
            new.source = stub_source(cell.source, where=f"{solution_path.name} cell {i}")
            new.outputs = []
            new.execution_count = None
        elif "attachments" in new:
            new.pop("attachments")
        cells.append(new)
    learner = nbformat.v4.new_notebook()
    learner.cells = cells
    learner.metadata = nbformat.from_dict({
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    for k, cell in enumerate(learner.cells):  # stable ids: regenerating gives the same file
        cell["id"] = f"cell-{k:03d}"
    learner.metadata[META_KEY] = {
        "generated_from": f"solutions/{solution_path.name}",
        "sources_sha256": sources_hash(learner),
        "note": "Generated by `make notebooks` from the worked notebook. Edit freely: "
                "regeneration never overwrites a notebook you changed.",
    }
    return learner


def _write(nb, path: Path):
    import nbformat
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


class Unreadable(GenerateError):
    """A notebook file that is not a notebook this tool can read; the message says why."""


def read_notebook(path: Path):
    """The notebook at ``path`` (a NotebookNode), or ``Unreadable`` saying what is wrong with the file."""
    import nbformat
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"cannot open it ({e.strerror or type(e).__name__})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unreadable(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    try:
        nb = nbformat.reads(text, as_version=4, capture_validation_error={})   # checked below, not logged
    except Exception as e:  # noqa: BLE001 - JSON, nbformat and version errors all mean "not a notebook"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Unreadable(f"not a notebook ({first[:120]})") from None
    for i, cell in enumerate(nb.get("cells", [])):
        for key in ("cell_type", "source"):
            if key not in cell:
                raise Unreadable(f"cell {i} has no `{key}`")
        if not isinstance(cell.source, str):
            raise Unreadable(f"cell {i}'s `source` is not text")
    return nb


def learner_edited(path: Path) -> bool:
    """True when the notebook at ``path`` is not exactly what the generator last wrote (or is unreadable)."""
    try:
        nb = read_notebook(path)
    except Unreadable:  # an unreadable notebook is someone's work too
        return True
    return nb.metadata.get(META_KEY, {}).get("sources_sha256") != sources_hash(nb)


def back_up(path: Path, when: str | None = None) -> Path:
    """Copy ``path`` byte for byte to ``<stem>.backup-<when>[-k].ipynb``, never replacing a file; return it.

    The name is claimed with an exclusive create, so two backups in the same second (or a clock set
    back) get ``-2``, ``-3``, ... instead of overwriting each other.
    """
    data = path.read_bytes()
    when = when or time.strftime("%Y%m%d-%H%M%S")
    for k in range(1, 10_000):
        backup = path.with_name(f"{path.stem}.backup-{when}{'' if k == 1 else f'-{k}'}.ipynb")
        try:
            with open(backup, "xb") as f:
                f.write(data)
        except FileExistsError:
            continue
        if backup.read_bytes() != data:
            raise GenerateError(f"the backup {backup} does not match {path}: nothing overwritten")
        return backup
    raise GenerateError(f"no free backup name for {path} ({path.stem}.backup-{when}-*.ipynb)")


def generate(solutions: Path, out: Path, force: bool = False, log=print) -> list[Path]:
    """Write a learner notebook in ``out`` for each ``solutions/NN_*.ipynb``; return the paths written."""
    import nbformat
    out.mkdir(parents=True, exist_ok=True)
    written, refused = [], []
    sources = sorted(p for p in solutions.glob("[0-9][0-9]_*.ipynb"))
    if not sources:
        raise GenerateError(f"no worked notebooks (NN_name.ipynb) in {solutions}")
    for src in sources:
        nb = learner_notebook(src)
        dest = out / src.name
        if dest.exists():
            text = nbformat.writes(nb) + "\n"
            try:
                if dest.read_bytes() == text.encode("utf-8"):
                    continue  # already up to date
            except OSError as e:
                raise GenerateError(f"{dest}: cannot open it ({e.strerror}); nothing written for it") from None
            why = ""
            try:
                read_notebook(dest)
            except Unreadable as e:
                why = str(e)
            if why or learner_edited(dest):
                if not force:
                    refused.append(f"{dest} (cannot read it: {why})" if why else str(dest))
                    continue
                backup = back_up(dest)
                log(f"backed up your {'unreadable' if why else 'edited'} {dest} to {backup.name}")
        try:
            _write(nb, dest)
        except OSError as e:
            raise GenerateError(f"{dest}: cannot write it ({e.strerror})") from None
        written.append(dest)
        log(f"wrote {dest}")
    if refused:
        names = "\n  ".join(refused)
        raise GenerateError(
            f"not overwriting notebooks you edited:\n  {names}\n"
            "Your work is untouched. To regenerate anyway, run `make notebooks FORCE=1`: "
            "each of these is first copied to NN_name.backup-<time>.ipynb.")
    return written


def drift(solutions: Path, notebooks: Path) -> list[str]:
    """Names of learner notebooks that differ from what the generator would write (or are missing/extra)."""
    import nbformat
    problems = []
    want = {p.name: nbformat.writes(learner_notebook(p)) + "\n"
            for p in sorted(solutions.glob("[0-9][0-9]_*.ipynb"))}
    have = {p.name for p in notebooks.glob("[0-9][0-9]_*.ipynb") if ".backup-" not in p.name}
    for name, text in want.items():
        path = notebooks / name
        if not path.exists():
            problems.append(f"{name}: missing from {notebooks}")
        elif path.read_bytes() != text.encode("utf-8"):
            try:
                read_notebook(path)
                problems.append(f"{name}: differs from its worked notebook (run `make notebooks`)")
            except Unreadable as e:
                problems.append(f"{name}: cannot read it: {e}")
    problems += [f"{name}: has no worked notebook in {solutions}" for name in sorted(have - set(want))]
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    ap.add_argument("--out", type=Path, default=ROOT / "notebooks")
    ap.add_argument("--force", action="store_true", help="back up edited notebooks, then overwrite them")
    ap.add_argument("--check", action="store_true", help="report drift and exit 1, write nothing")
    a = ap.parse_args(argv)
    try:
        if a.check:
            problems = drift(a.solutions, a.out)
            for p in problems:
                print(p)
            return 1 if problems else 0
        written = generate(a.solutions, a.out, force=a.force)
        if not written:
            print(f"{a.out}: up to date")
        return 0
    except GenerateError as e:
        print(f"make notebooks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
