"""Build the course's static site from the worked notebooks as they were saved (`make site`).

    python site/build.py [--repo ROOT] [--out build/site] [--src build/site-src] [--hosted-url TEMPLATE]
    python site/build.py --requirements     # the `site` extra of pyproject.toml, for `pip install -r`

Reads, never writes, the course at ROOT (default: this file's parent's parent):
- ``solutions/NN_*.ipynb``: the worked notebooks, rendered with their saved outputs (nothing is executed);
- ``notebooks/NN_*.ipynb``: the learner copies, put beside the pages for download (``notebooks/`` of the site);
- ``bench/results/``: the measured records, rendered into ``results.html`` by each lesson's own table functions
  (``results_sections``, the one place that names them), with the PNG plots there;
- ``site/*.md``: hand-written pages (``site/install.md``, ...), each a page of the site, listed under "Start";
- ``README.md``: the home page's first paragraph.

``solutions/00_*.ipynb``, when there is one, is the start notebook: a page like a lesson's, linked above the course
map instead of in it.

Writes only under the build folder: the Sphinx sources it generates (``--src``, default ``build/site-src/``:
``index.md`` with the course map, ``lessons/NN_*.ipynb`` = each worked notebook with a header block after its
title, ``results.md``, ``_extra/``) and the HTML (``--out``, default ``build/site/``). The HTML uses relative
links only and loads nothing from the network, so it works opened from disk (``file://``) and from any static
server. Runs in the course's environment (`make setup`): the ``site`` extra (Sphinx, MyST-NB, Furo,
sphinx-mathjax-offline), and torch, which the lessons' modules that own the results tables import.

The sources are rewritten only where their text changed, so Sphinx's rebuild after a change to one notebook
re-renders that page (plus the ones whose navigation changes).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent                  # site/: conf.py and _static/ live here
DEFAULT_REPO = HERE.parent
LESSON_GLOB = "[0-9][0-9]_*.ipynb"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# How to run a learner notebook on a hosted service (the notebook's set-up cell, helpers.generate.SETUP_CELL, fetches
# and installs the course there). --hosted-url adds a link that opens the notebook on such a service.
HOSTED_DEFAULT = ("**On a hosted notebook service** (Colab, Kaggle, a JupyterHub): open the learner notebook there and "
                  "run it from the top; its first cell, the set-up, fetches the course and installs it into the "
                  "kernel (a minute or two).")
RESERVED = ("index", "results", "search", "genindex")   # the pages the build makes itself
SETUP_TAG = "course-setup"    # the set-up cell's tag: not shown on the site (it only makes the notebook runnable)

# Under a widget's still frame on a lesson page.
WIDGET_NOTE = ("<p class=\"course-widget-note\">Above: the widget's first frame, saved with the notebook. In Jupyter "
               "its controls move it: download the notebook to try.</p>")

PLOT_CAPTIONS = {   # bench/results/*.png; a plot not named here is shown with its file name
    "h200.png": "Lesson 07 on an H200: the forward's TFLOP/s against N (left) and Flash-Decoding's TB/s (right), the "
                "course's Triton kernels against SDPA's backends.",
    "h200_backward.png": "The backward (lesson 08): TFLOP/s against N.",
    "train_gpt.png": "A 6-layer GPT trained with the course's attention and with SDPA (lesson 08): the loss curves.",
    "train_llama.png": "An 8-layer Llama-style model on packed documents (lesson 08): the loss curves.",
}


# ------------------------------------------------------------------ the course's own table renderers
def course_module(repo: Path, name: str):
    """``helpers.<name>`` of the course at ``repo``, imported as the notebooks import it. The lessons' modules
    import torch (any build: the CPU wheel does), so the site builds in the course's environment."""
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    try:
        module = importlib.import_module(f"helpers.{name}")
    except ModuleNotFoundError as e:
        if e.name in ("torch", "numpy"):
            raise SystemExit(f"site: the results tables come from helpers.{name}, which needs {e.name}: build the site "
                             "in the course's environment (`make setup`, then `make site`)") from e
        raise
    where = Path(module.__file__).resolve()
    if repo.resolve() not in where.parents:
        raise SystemExit(f"site: helpers.{name} was imported from {where}, not from the course at {repo}")
    return module


def results_sections(repo: Path) -> list[tuple[str, object]]:
    """The results page's tables: ``(title, callable returning the table's text)``, in page order. This is the
    one place that names the course's renderers (each lesson's own, in ``helpers/lessonNN/``)."""
    results = course_module(repo, "results")
    l07, l08 = course_module(repo, "lesson07"), course_module(repo, "lesson08.gpu_section")
    l09, l10 = course_module(repo, "lesson09"), course_module(repo, "lesson10")
    l11, l12 = course_module(repo, "lesson11.records"), course_module(repo, "lesson12")
    l12r = course_module(repo, "lesson12.records")
    folder = repo / "bench" / "results"

    def table(fn, *files):              # fn(*records) returns the table
        def render():
            records = [results.load_json(folder / f) for f in files]
            missing = [f for f, rec in zip(files, records) if rec is None]
            return f"{results.NOT_MEASURED} ({', '.join(missing)} missing)" if missing else fn(*records)
        render.records = files          # the page names them under the title
        return render

    def printed(fn, file):              # fn(path) prints the table
        def render():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                fn(folder / file)
            return out.getvalue()
        render.records = (file,)
        return render

    return [
        ("Prefill: the forward kernel (lesson 07)", table(l07.prefill_table, "h200.json")),
        ("Decode: Flash-Decoding (lesson 07)", table(l07.decode_table, "h200.json")),
        ("The backward (lesson 08)", table(l08.backward_table, "h200.json")),
        ("Ring attention on two GPUs (lesson 09)", table(l09.gpu_results_table, "ring_h200x2.json")),
        ("Serving: packed prefill, paged decode (lesson 10)", table(l10.serving_tables, "h200.json")),
        ("The Gluon forward on Hopper (lesson 11)", table(l11.gluon_table, "gluon_h200.json")),
        ("FA3's overlap and ping-pong variants (lesson 11)", table(l11.gluon_table, "gluon_h200_variants.json")),
        ("The Gluon variants with causal masks (lesson 11)", table(l11.gluon_table, "gluon_h200_causal.json")),
        ("The Gluon forward and backward against cuDNN (lesson 11)",
         table(l11.gluon_targets_table, "gluon_forward_h200.json", "gluon_backward_h200.json")),
        ("Nsight Compute: why (lesson 11)", table(l11.gluon_profile_table, "gluon_profile_h200.json")),
        ("Masks and score modifications against FlexAttention (lesson 12)",
         printed(l12.show_masks_results, "masks_h200.json")),
        ("Packed documents, causal within each, against FlexAttention (lessons 08, 10, 12)",
         table(l12r.packed_documents_table, "h200.json")),
        ("The README's commands on a fresh clone (the course's CI machine)",
         table(results.check_times_table, "check_times.json")),
    ]


def record_label(repo: Path, path: Path) -> str:
    """GPU, versions and date of one JSON record, as the course labels a section ('?' where not recorded)."""
    results = course_module(repo, "results")
    data = results.load_json(path)
    if not isinstance(data, dict):
        return "a list of rows"
    meta = data.get("meta") or data.get("machine") or data
    if not any(k in meta for k in ("gpu", "device_name", "torch", "triton", "date")):
        return "no GPU, versions or date in the file"
    return results.results_label(meta)


# ------------------------------------------------------------------ the lessons
def lessons(repo: Path) -> list[dict]:
    """One dict per worked notebook: stem, number, title (its H1 less the number), blurb (the first sentence
    of the title cell's text), minutes (its "*About N minutes.*", or None), and the worked and learner notebooks."""
    out = []
    for path in sorted((repo / "solutions").glob(LESSON_GLOB)):
        nb = json.loads(path.read_text(encoding="utf-8"))
        first_cell = "".join(nb["cells"][0]["source"])
        title, blurb = title_and_blurb(first_cell)
        minutes = re.search(r"About (\d+) minutes", first_cell)
        learner = repo / "notebooks" / path.name
        if not learner.exists():
            raise SystemExit(f"site: {path.name} has no learner copy in notebooks/ (run `make notebooks`)")
        out.append({"stem": path.stem, "number": path.name[:2], "title": title, "blurb": blurb,
                    "minutes": int(minutes.group(1)) if minutes else None, "solution": path, "learner": learner})
    if not out:
        raise SystemExit(f"site: no worked notebooks ({LESSON_GLOB}) in {repo / 'solutions'}")
    return out


def title_and_blurb(markdown: str) -> tuple[str, str]:
    """The title cell's H1 (less its "NN · " prefix) and the first sentence of its first paragraph (less a bold
    lead-in such as **Why.**)."""
    lines = markdown.strip().splitlines()
    if not lines or not lines[0].startswith("# "):
        raise ValueError(f"the first cell does not start with a '# ' title: {markdown[:80]!r}")
    title = re.sub(r"^\d+\s*·\s*", "", lines[0][2:].strip())
    paragraph = []
    for line in lines[1:]:
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    text = re.sub(r"^\*\*[^*]{1,30}\.\*\*\s*", "", " ".join(paragraph))
    m = re.search(r"[.!?](?=\s+[A-Z\"*`(]|\s*$)", text)
    return title, (text[:m.end()] if m else text).replace("|", "\\|")


def header_block(lesson: dict, hosted_url: str | None) -> str:
    """The block every lesson page opens with, after its title: the download and how to run it."""
    name = lesson["learner"].name
    hosted = HOSTED_DEFAULT.format(name=name)
    if hosted_url:
        link = hosted_url.format(path=f"notebooks/{name}", name=name)
        hosted += f" <a class=\"course-hosted\" href=\"{link}\">Open {name} on a hosted service</a>."
    return (
        "```{admonition} Do this lesson yourself\n:class: tip course-run\n\n"
        f"- **Download the learner notebook:** <a class=\"course-download\" href=\"../notebooks/{name}\" "
        f"download=\"{name}\">{name}</a> (the exercises, no outputs). This page is the worked notebook with "
        "the outputs it saved; a widget shows its first frame as a still picture.\n"
        "- **On your machine:** clone the course, then `make setup && make lab`; JupyterLab opens on "
        f"`notebooks/`, where `{name}` is.\n"
        f"- {hosted}\n"
        "```\n"
    )


def check_notebook(path: Path, nb: dict) -> None:
    """A worked notebook the site can show: no error output, no stderr, a still PNG beside every widget."""
    problems = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            kind = out.get("output_type")
            if kind == "error":
                problems.append(f"cell {i}: an error output ({out.get('ename')}: {out.get('evalue')})")
            elif kind == "stream" and out.get("name") == "stderr":
                problems.append(f"cell {i}: stderr output")
            elif kind in ("display_data", "execute_result") and WIDGET_VIEW in out.get("data", {}) \
                    and "image/png" not in out["data"]:
                problems.append(f"cell {i}: a widget with no still PNG (it would show as nothing)")
    if problems:
        raise SystemExit(f"site: {path} cannot be published as saved:\n  " + "\n  ".join(problems))


def lesson_notebook(lesson: dict, hosted_url: str | None) -> str:
    """The worked notebook as the page shows it: the header block after its H1, no widget state."""
    nb = json.loads(lesson["solution"].read_text(encoding="utf-8"))
    check_notebook(lesson["solution"], nb)
    first = nb["cells"][0]
    h1, _, rest = "".join(first["source"]).partition("\n")
    first["source"] = h1 + "\n\n" + header_block(lesson, hosted_url) + rest
    nb["metadata"].pop("widgets", None)   # the widget state: nothing on the page can use it
    cells = []
    for cell in nb["cells"]:
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        if SETUP_TAG in tags:
            tags.append("remove-cell")     # MyST-NB leaves the cell out of the page
        elif cell["metadata"].get("jupyter", {}).get("source_hidden"):
            tags.append("hide-input")      # folded, as in JupyterLab
        cells.append(cell)
        if any(WIDGET_VIEW in o.get("data", {}) for o in cell.get("outputs", [])):
            cells.append({"cell_type": "markdown", "id": f"course-widget-note-{len(cells)}", "metadata": {},
                          "source": WIDGET_NOTE})
    nb["cells"] = cells
    return json.dumps(nb, ensure_ascii=False, indent=1) + "\n"


# ------------------------------------------------------------------ the pages
def readme_intro(repo: Path) -> str:
    """The README's first paragraph (the course in one sentence)."""
    readme = repo / "README.md"
    paragraphs = readme.read_text(encoding="utf-8").split("\n\n") if readme.exists() else []
    for p in paragraphs:
        if p.strip() and not p.lstrip().startswith("#"):
            return " ".join(p.split())
    return ""


def guides(repo: Path) -> list[dict]:
    """The hand-written pages in ``site/``: stem and title (the first ``# `` line)."""
    out = []
    for path in sorted((repo / "site").glob("*.md")):
        if path.stem in RESERVED:
            raise SystemExit(f"site: {path} would replace the generated {path.stem}.md: rename it")
        text = path.read_text(encoding="utf-8")
        title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), path.stem)
        out.append({"stem": path.stem, "title": title, "path": path})
    return out


def index_md(repo: Path, all_lessons: list[dict], pages: list[dict]) -> str:
    start = [l for l in all_lessons if l["number"] == "00"]
    course = [l for l in all_lessons if l["number"] != "00"]
    rows = "\n".join(f"| {l['number']} | [{l['title']}](lessons/{l['stem']}.ipynb) | "
                     f"{str(l['minutes']) + ' min' if l['minutes'] else '—'} | {l['blurb']} |" for l in course)
    first = "".join(f"New to the course? Begin with [{l['number']} · {l['title']}](lessons/{l['stem']}.ipynb): "
                    f"{l['blurb']}\n\n" for l in start)
    more = " · ".join(f"[{g['title']}]({g['stem']}.md)" for g in pages)
    start_toc = "\n".join([f"lessons/{l['stem']}" for l in start] + [g["stem"] for g in pages])
    toc = "\n".join(f"lessons/{l['stem']}" for l in course)
    start_block = f"""```{{toctree}}
:hidden:
:caption: Start

{start_toc}
```

""" if start_toc else ""
    return f"""# FlashAttention from first principles

{readme_intro(repo)}

{first}## The course map

{len(course)} lessons, each a worked argument (why → shapes → idea → exercise → check → picture → pitfalls →
"say it in the interview"). Each page below is the worked notebook as it was last run, with its outputs; each
page links its learner notebook to download.

| # | lesson | time | its opening line |
| --- | --- | --- | --- |
{rows}

The GPU figures the lessons quote, measured on NVIDIA H200s: [the measured results](results.md).

## Run the course

You need Python ≥ 3.10 and `make`. Clone the course, then:

```bash
make setup    # creates .venv/ and installs everything
make lab      # JupyterLab on notebooks/: the learner notebooks, exercises to fill in
```

No GPU is needed: the GPU parts run on a CPU under Triton's interpreter and show the recorded H200 figures.
Each exercise has a check cell: ⏳ not attempted yet, ✅ passed, ❌ says what is wrong.

{f"More: {more}." if more else ""}

{start_block}```{{toctree}}
:hidden:
:caption: Lessons

{toc}
```

```{{toctree}}
:hidden:
:caption: Measured

results
```
"""


def results_md(repo: Path, plots: list[str], records: list[Path]) -> str:
    folder = repo / "bench" / "results"
    parts = ["# Measured results", "",
             "What the course's kernels did on NVIDIA H200 GPUs, read from `bench/results/` when this site was built "
             "(the scripts in `bench/` write those records; the lessons print the same tables). Each table says which "
             "record it comes from, with its GPU, versions and date; the raw records are at the end.", ""]
    if plots:
        parts += ["## Plots", ""]
        for name in plots:
            caption = PLOT_CAPTIONS.get(name, name)
            parts += [f"```{{figure}} results/{name}", f":alt: {caption}", ":width: 100%", "", caption, "```", ""]
    parts += ["## Tables", ""]
    for title, render in results_sections(repo):
        parts += [f"### {title}", ""]
        sources = getattr(render, "records", ())
        if sources:
            parts += ["From " + ", ".join(f"`{f}` ({record_label(repo, folder / f)})" for f in sources) + ".", ""]
        parts += ["```text", render().rstrip(), "```", ""]
    parts += ["## Every record", "", "The raw JSON, as the bench scripts wrote it.", "",
              "| file | recorded on |", "| --- | --- |"]
    for path in records:
        parts.append(f"| <a href=\"data/{path.name}\">{path.name}</a> | {record_label(repo, path)} |")
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------ writing the sources, running Sphinx
def write_sources(repo: Path, src: Path, hosted_url: str | None = None) -> dict:
    """Generate the Sphinx source tree in ``src``; returns ``{relative path: bytes}`` of what it holds."""
    all_lessons, pages = lessons(repo), guides(repo)
    results = repo / "bench" / "results"
    plots = sorted(p.name for p in results.glob("*.png"))
    records = sorted(results.glob("*.json"))
    files: dict[str, bytes] = {
        "index.md": index_md(repo, all_lessons, pages).encode(),
        "results.md": results_md(repo, plots, records).encode(),
    }
    for lesson in all_lessons:
        files[f"lessons/{lesson['stem']}.ipynb"] = lesson_notebook(lesson, hosted_url).encode()
        files[f"_extra/notebooks/{lesson['learner'].name}"] = lesson["learner"].read_bytes()
    for page in pages:
        files[f"{page['stem']}.md"] = page["path"].read_bytes()
    for name in plots:
        files[f"results/{name}"] = (results / name).read_bytes()
    for path in records:
        files[f"_extra/data/{path.name}"] = path.read_bytes()
    src.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = src / rel
        if not path.exists() or path.read_bytes() != data:   # unchanged sources keep their mtime
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    for path in sorted(src.rglob("*"), reverse=True):          # what an earlier build wrote and this one did not
        rel = path.relative_to(src).as_posix()
        if rel.startswith(".doctrees"):
            continue
        if path.is_file() and rel not in files:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return files


def run_sphinx(src: Path, out: Path, jobs: str = "1", quiet: bool = True) -> int:
    from sphinx.cmd.build import build_main
    args = ["-b", "html", "-c", str(HERE), "-d", str(src / ".doctrees"), "-W", "--keep-going",
            "-j", jobs, "-D", f"html_extra_path={src / '_extra'}", str(src), str(out)]
    return build_main((["-q"] if quiet else []) + args)


def build(repo: Path, out: Path, src: Path, hosted_url: str | None = None, jobs: str = "1",
          quiet: bool = True) -> Path:
    """The whole build; returns the home page's path. Raises SystemExit on a failed build."""
    repo, out, src = repo.resolve(), out.resolve(), src.resolve()
    write_sources(repo, src, hosted_url)
    rc = run_sphinx(src, out, jobs=jobs, quiet=quiet)
    if rc != 0:
        raise SystemExit(f"site: sphinx-build failed (exit {rc}); the messages above say where")
    return out / "index.html"


def site_requirements(repo: Path) -> list[str]:
    """The ``site`` extra of the course's pyproject.toml: what a job that only builds the site installs."""
    text = (repo / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:                                         # Python 3.10: the list, read by hand
        block = re.search(r"^site\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        return re.findall(r"^\s*\"([^\"]+)\"", block.group(1), re.M) if block else []
    return tomllib.loads(text)["project"]["optional-dependencies"]["site"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=DEFAULT_REPO, help="the course's folder (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="the HTML (default: REPO/build/site)")
    ap.add_argument("--src", type=Path, help="the generated Sphinx sources (default: REPO/build/site-src)")
    ap.add_argument("--hosted-url", help="a link template for a hosted notebook service, {path} = notebooks/NN_x.ipynb")
    ap.add_argument("-j", "--jobs", default="1", help="Sphinx's parallel jobs (default 1)")
    ap.add_argument("-v", "--verbose", action="store_true", help="Sphinx's progress messages")
    ap.add_argument("--requirements", action="store_true",
                    help="print the site extra of pyproject.toml, one a line (for pip install -r), and stop")
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    if args.requirements:
        print("\n".join(site_requirements(repo)))
        return 0
    started = time.monotonic()
    index = build(repo, args.out or repo / "build" / "site", args.src or repo / "build" / "site-src",
                  args.hosted_url, args.jobs, quiet=not args.verbose)
    print(f"site built in {time.monotonic() - started:.1f} s: open {index.as_uri()}")
    print(f"  or serve it: python3 -m http.server -d {index.parent} 8000  (then http://127.0.0.1:8000/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
