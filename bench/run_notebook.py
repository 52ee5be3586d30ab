"""Run a worked notebook's code cells as a plain script: for the GPU machine, which has no Jupyter.

    python3 bench/run_notebook.py solutions/08_backward_pass.ipynb [--from "The backward as a GPU kernel"]

Cells run in order in one namespace, with COURSE_STRICT=1 (a failed check raises) and matplotlib's
Agg backend. Each cell's source is registered in ``linecache`` under its own file name, so that
``@triton.jit`` (which reads a kernel's source through ``inspect``) works on functions defined in a
cell. ``--from TEXT`` starts at the first markdown cell containing TEXT (a GPU section that needs
nothing from the cells before it). Prints one line per cell and exits 1 at the first error.
"""

import argparse
import json
import linecache
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("notebook")
    ap.add_argument("--from", dest="start", default=None)
    a = ap.parse_args()
    os.environ["COURSE_STRICT"] = "1"
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.path.insert(0, ROOT)
    path = os.path.abspath(a.notebook)
    with open(path) as f:
        cells = json.load(f)["cells"]
    os.chdir(os.path.dirname(path))  # a notebook runs from its folder
    if a.start:
        first = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                      and a.start in "".join(c["source"])), None)
        if first is None:
            sys.exit(f"no markdown cell contains {a.start!r}")
        cells = cells[first:]
    ns = {"__name__": "__main__", "display": lambda *x, **k: [print(repr(y)[:200]) for y in x]}
    t0 = time.time()
    for i, c in enumerate(cells):
        if c["cell_type"] != "code":
            continue
        src = "".join(c["source"])
        if not src.strip() or src.lstrip().startswith(("%", "!")):
            continue
        name = f"<cell {i}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        t = time.time()
        try:
            exec(compile(src, name, "exec"), ns)
        except Exception:
            traceback.print_exc()
            print(f"cell {i}: FAILED after {time.time() - t:.1f}s: {src.splitlines()[0][:80]!r}", flush=True)
            sys.exit(1)
        print(f"cell {i}: ok {time.time() - t:.1f}s  {src.strip().splitlines()[0][:70]!r}", flush=True)
    print(f"all cells ran in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
