"""A learner's first exercise, in JupyterLab in headless Chromium: the notebook run all as it comes, with every check
test_notebooks_in_lab.py makes of a learner copy (this is its run of notebooks/01_online_softmax.ipynb); then write the
answer into the cell, run it and its check, see ✅; `make grade`, run before the notebook is saved, says the saved
file does not give it yet; saved, the grade agrees with the lab.

The lab is the session's throwaway copy (e2e/conftest.py), with autosave off, so "not saved" is under the test's
control. The lab tells each kernel its notebook's path, and the checker records its verdict beside the notebook
(helpers.progress): that is what grade compares with.
"""
from __future__ import annotations

import json
import shutil

from conftest import PANEL
from helpers import grade
from test_notebooks_in_lab import FIRST_EXERCISE, inspect

NB = f"first-exercise/{FIRST_EXERCISE}"     # a copy of its own: the other tests open notebooks/ untouched
ANSWER = '''def merge_ml(m1, l1, m2, l2):
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return m, l1 * torch.exp(m1 - m_safe) + l2 * torch.exp(m2 - m_safe)'''


def _cell_index(page, needle):
    return page.evaluate(f"""() => {PANEL}.content.widgets.findIndex(
        c => c.model.type === 'code' && c.model.sharedModel.getSource().includes({json.dumps(needle)}))""")


def _output_text(page, index):
    return page.evaluate(f"() => {PANEL}.content.widgets[{index}].node.innerText")


def test_the_first_exercise_passes_in_the_lab_and_grade_agrees_once_saved(lab, lab_page, artifacts):
    (lab.root / NB).parent.mkdir(exist_ok=True)
    shutil.copy(lab.root / "notebooks" / FIRST_EXERCISE, lab.root / NB)
    with lab_page.closed_on_error():
        problems, _ = inspect(lab_page, NB, "todo")
        page = lab_page.page
        page.screenshot(path=str(artifacts / f"notebooks__{FIRST_EXERCISE.removesuffix('.ipynb')}.png"))
        assert not problems, f"notebooks/{FIRST_EXERCISE} in JupyterLab:\n  " + "\n  ".join(problems)
        check = _cell_index(page, "check.merge_ml(merge_ml)")
        assert "⏳ merge_ml not attempted yet" in _output_text(page, check)
        answer = _cell_index(page, 'raise NotImplementedError("merge_ml')
        page.evaluate(f"() => {PANEL}.content.widgets[{answer}].model.sharedModel.setSource({json.dumps(ANSWER)})")
        for i in (answer, check):                     # the learner runs the function's cell, then its check
            page.evaluate(f"""async () => {{
                const panel = {PANEL};
                panel.content.activeCellIndex = {i};
                await window.jupyterapp.commands.execute('notebook:run-cell');
            }}""")
            page.wait_for_function(f"() => {PANEL}.content.widgets[{i}].model.executionState === 'idle'"
                                   f" && {PANEL}.sessionContext.session.kernel.status === 'idle'", timeout=120_000)
        page.wait_for_function(f"() => {PANEL}.content.widgets[{check}].node.innerText.includes('passed')",
                               timeout=60_000)
        assert "✅ merge_ml passed" in _output_text(page, check)
        page.screenshot(path=str(artifacts / "first_exercise_passed.png"))

        path = lab.root / NB
        unsaved = {v.exercise: v for v in grade.grade([str(path)])}
        assert unsaved["merge_ml"].status == "todo"                    # the file still holds the stub
        assert "the lab showed ✅" in unsaved["merge_ml"].unsaved, unsaved["merge_ml"]

        page.evaluate(f"async () => await {PANEL}.context.save()")
        saved = {v.exercise: v for v in grade.grade([str(path)])}
        assert saved["merge_ml"].status == "pass" and not saved["merge_ml"].unsaved
        assert saved["online_softmax_stats"].status == "todo"
