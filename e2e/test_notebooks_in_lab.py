"""Every learner notebook, opened in JupyterLab in headless Chromium and run as a learner runs it.

For each of ``notebooks/`` (the learner copies), on a throwaway copy: open it, wait for the kernel,
Run All, then assert what a learner sees: no error output and nothing on stderr; every figure drawn
(an ``<img>`` that loaded); every widget rendered by the widget manager (not its still fallback), and
for each widget a slider moved with the keyboard redraws its figure; a verdict per exercise, ``⏳``.
The ✅ side: test_first_exercise.py answers an exercise in the lab; the inspector's planted notebook
holds the "pass" mode to a stub. A screenshot per notebook goes to ``artifacts/e2e/``.
"""
from __future__ import annotations

import nbformat
import pytest

from helpers.grade import exercises_in
from conftest import ROOT, COURSE_FOLDERS, PANEL, _tree_sha

RUN_TIMEOUT_MS = 600_000          # one notebook, Run All (notebook 07 runs Triton's interpreter on a CPU)
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

# Every learner copy (what a learner opens). The worked notebooks all pass strict under nbval (make check-solutions)
# and their saved outputs hold no error or stderr (tests/test_lesson_form.py); the lab's ✅ is test_first_exercise.py's
# (a learner's answer passing in the lab, then graded once saved).
# The learner copy of the first exercise is run and checked here by test_first_exercise.py, on a copy of its own,
# before the learner's answer goes in (one run of it, not two).
FIRST_EXERCISE = "01_online_softmax.ipynb"
NOTEBOOKS = [f"notebooks/{p.name}" for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             if p.name != FIRST_EXERCISE]

_ALL_RUN = f"""() => {{
    const panel = {PANEL};
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    const code = panel.content.widgets.filter(c => c.model.type === 'code' && c.model.sharedModel.getSource().trim());
    return !!kernel && kernel.status === 'idle'
           && code.every(c => c.model.executionCount !== null && c.model.executionState !== 'running');
}}"""
# One record per cell (the notebook's own order), from the model and from what is on screen.
_CELLS = f"""() => {PANEL}.content.widgets.map((cell, index) => {{
    const area = cell.node.querySelector('.jp-OutputArea');
    const outputs = cell.model.type === 'code' ? cell.model.outputs.toJSON() : [];
    return {{
        index, type: cell.model.type,
        count: cell.model.type === 'code' ? cell.model.executionCount : null,
        outputs: outputs.map(o => ({{type: o.output_type, name: o.name || '', mimes: Object.keys(o.data || {{}}),
                                    ename: o.ename || '', evalue: o.evalue || '', text: o.text || ''}})),
        text: area ? area.innerText : '',
        images: area ? [...area.querySelectorAll('img')].map(i => ({{
            loaded: i.complete && i.naturalWidth > 0, inWidget: !!i.closest('.jupyter-widgets')}})) : [],
        widgetViews: area ? area.querySelectorAll('.jp-OutputArea-output > .jupyter-widgets').length : 0,
        sliders: area ? area.querySelectorAll('.widget-slider .noUi-handle').length : 0,
    }};
}})"""
_REDRAWN = f"""([index, before]) => {{
    const cell = {PANEL}.content.widgets[index].node;
    const img = cell && cell.querySelector('.widget-output img');
    return !!img && img.complete && img.naturalWidth > 0 && img.getAttribute('src') !== before;
}}"""


def run_all(lab_page, notebook):
    """Open ``notebook`` in the lab and Run All; returns the page and a record per cell (``_CELLS``)."""
    page = lab_page.open(notebook)
    # resolves once every cell ran (false if one raised: the error shows in its outputs)
    page.evaluate("async () => await window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(_ALL_RUN, timeout=RUN_TIMEOUT_MS, polling=100)
    return page, page.evaluate(_CELLS)


def _move_first_slider(page, cell, timeout_ms):
    """Press → on the cell's first slider; its figure must be drawn again, differently."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    i = cell["index"]
    node = page.locator(".jp-Notebook .jp-Cell").nth(i)
    node.scroll_into_view_if_needed()
    handle = node.locator(".widget-slider .noUi-handle").first
    before_value = handle.get_attribute("aria-valuenow")
    before_src = node.locator(".widget-output img").first.get_attribute("src")
    handle.focus()
    page.keyboard.press("ArrowRight")
    try:
        page.wait_for_function(_REDRAWN, arg=[i, before_src], timeout=timeout_ms, polling=200)
    except PlaywrightTimeout:
        return [f"cell {i}: slider moved {before_value} -> {handle.get_attribute('aria-valuenow')} "
                f"but the figure was not redrawn within {timeout_ms / 1000:.0f} s"]
    if handle.get_attribute("aria-valuenow") == before_value:
        return [f"cell {i}: the figure changed but the slider did not move ({before_value})"]
    return []


def inspect(lab_page, notebook, verdict, redraw_timeout_ms=120_000):
    """Open ``notebook`` in the lab, Run All, and list what a learner would see go wrong.

    ``verdict`` is "todo" (every check cell shows ⏳) or "pass" (✅). Returns
    ``(problems, widget_cells)``; ``problems`` is empty when all is well.
    """
    page, cells = run_all(lab_page, notebook)
    problems = []

    # 1. No error, nothing on stderr, anywhere.
    for c in cells:
        for o in c["outputs"]:
            if o["type"] == "error":
                problems.append(f"cell {c['index']}: error output {o['ename']}: {o['evalue']}")
            elif o["type"] == "stream" and o["name"] == "stderr":
                problems.append(f"cell {c['index']}: output on stderr: {o['text'][:200]!r}")

    # 2. Every figure is on screen.
    images = [im for c in cells for im in c["images"]]
    if not images and _draws(notebook):
        problems.append("no figure drawn")
    if not all(im["loaded"] for im in images):
        problems.append(f"{sum(not im['loaded'] for im in images)} figure(s) did not load")

    # 3. Widgets: rendered live by the widget manager, and a slider redraws the figure.
    widget_cells = [c for c in cells if any(WIDGET_MIME in o["mimes"] for o in c["outputs"])]
    for c in widget_cells:
        where = f"cell {c['index']}"
        if c["widgetViews"] < 1 or "Error displaying widget" in c["text"]:
            problems.append(f"{where}: no live widget shown: {c['text'][:200]!r}")
        elif any(not im["inWidget"] for im in c["images"]):
            problems.append(f"{where}: the still fallback is shown beside the live widget")
        elif not any(im["inWidget"] for im in c["images"]):
            problems.append(f"{where}: the widget shows no figure")
        elif c["sliders"] < 1:
            problems.append(f"{where}: the widget has no slider")
        else:
            problems += _move_first_slider(page, c, redraw_timeout_ms)

    # 4. One verdict per exercise: ⏳ for a learner copy, ✅ for a worked notebook.
    nb = nbformat.read(lab_page.lab.root / notebook, as_version=4)
    for index, exercise in exercises_in(nb):
        want = f"⏳ {exercise} not attempted yet" if verdict == "todo" else f"✅ {exercise} passed: "
        if want not in cells[index]["text"]:
            problems.append(f"cell {index}: should say {want!r}, shows {cells[index]['text'][:200]!r}")
    problems += [f"JavaScript error in the page: {e}" for e in lab_page.errors]

    # 5. Bring the (moved) widget, else the last figure, into view for the screenshot.
    shown = [c["index"] for c in widget_cells] or [c["index"] for c in cells if c["images"]]
    if shown:
        page.locator(".jp-Notebook .jp-Cell").nth(shown[0] if widget_cells else shown[-1]).scroll_into_view_if_needed()
    return problems, widget_cells


def _draws(notebook: str) -> bool:
    """Whether the worked notebook of this name draws a figure (its saved outputs hold one; the start notebook
    draws none). A notebook outside the course (the planted one) must draw."""
    worked = ROOT / "solutions" / notebook.split("/")[-1]
    if not worked.exists():
        return True
    return any("image/png" in o.get("data", {}) for c in nbformat.read(worked, as_version=4).cells
               for o in c.get("outputs", []))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(notebook, lab_page, artifacts):
    folder, name = notebook.split("/")
    with lab_page.closed_on_error():
        problems, _ = inspect(lab_page, notebook, "todo" if folder == "notebooks" else "pass")
        lab_page.page.screenshot(path=str(artifacts / f"{folder}__{name.removesuffix('.ipynb')}.png"))
    assert not problems, f"{notebook} in JupyterLab:\n  " + "\n  ".join(problems)


PLANTED = [
    "import sys\nimport matplotlib.pyplot as plt\nfrom helpers import check, widgets",
    # a widget whose figure ignores the slider: moving it redraws nothing new
    "widgets.stepper(lambda step: plt.plot([0, 1], [0, 1]), n_steps=3)",
    "print('a warning a learner would see', file=sys.stderr)",
    "def merge_ml(m1, l1, m2, l2):\n    raise NotImplementedError('merge_ml: replace this line with your code')",
    "check.merge_ml(merge_ml)",
    "raise ValueError('planted')",
]


def test_the_inspector_sees_each_planted_problem(lab, lab_page):
    """The checks above can fail: a notebook with one of each problem is reported on each."""
    (lab.root / "planted").mkdir(exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in PLANTED])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "planted" / "00_planted.ipynb")
    with lab_page.closed_on_error():     # its figure never changes, so no wait sees it redrawn: a short one does
        problems, widget_cells = inspect(lab_page, "planted/00_planted.ipynb", "pass", redraw_timeout_ms=1_000)
    report = "\n".join(problems)
    assert [c["index"] for c in widget_cells] == [1]
    assert "cell 1: slider moved 0.0 -> 1.0 but the figure was not redrawn" in report, report
    assert "cell 2: output on stderr: 'a warning a learner would see" in report, report
    assert "cell 4: should say '✅ merge_ml passed: ', shows '⏳ merge_ml not attempted yet" in report, report
    assert "cell 5: error output ValueError: planted" in report, report
    assert len(problems) == 4, report


def test_the_course_files_were_not_touched(originals):
    """The suite works on a copy: the learner's notebooks and the worked ones are as they were."""
    assert {f: _tree_sha(ROOT / f) for f in COURSE_FOLDERS} == originals
