"""helpers.widgets: every widget also carries a still PNG of its first frame.

A frontend with a widget manager (JupyterLab) shows the live widget; one without
(nbval, ``make grade``, nbconvert) shows the PNG. The browser half is in ``e2e/``.
"""
import base64

import matplotlib.pyplot as plt
import nbformat
import pytest
from nbclient import NotebookClient

from helpers import widgets, lesson04

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _draw_line(step):
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, step])
    ax.set_ylim(0, 5)


def test_stepper_offers_widget_and_still_first_frame():
    view = widgets.stepper(_draw_line, n_steps=5, start=2)
    bundle = view._repr_mimebundle_()
    assert widgets.WIDGET_VIEW in bundle and bundle[widgets.WIDGET_VIEW]["model_id"] == view.box.model_id
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(PNG_MAGIC)
    assert png == widgets.still_png(_draw_line, step=2)          # the first frame, i.e. start=2
    assert png != widgets.still_png(_draw_line, step=4)          # a different step draws differently
    assert "step=2" in bundle["text/plain"]


def test_still_png_leaves_no_open_figure():
    plt.close("all")
    widgets.still_png(lesson04.render_tile_classes, N=8, Nk=8)
    assert plt.get_fignums() == []


def test_explorer_initial_values_from_sliders_and_dropdowns():
    view = widgets.explorer(lesson04.render_tile_classes, N=(1, 48, 1, 20), Nk=(1, 48, 1, 28),
                            align=["bottom_right", "top_left"])
    assert view.initial == {"N": 20, "Nk": 28, "align": "bottom_right"}
    assert view.png == widgets.still_png(lesson04.render_tile_classes, N=20, Nk=28, align="bottom_right")


def test_explorer_rejects_a_bad_control():
    with pytest.raises(TypeError, match="control 'N'"):
        widgets.explorer(lesson04.render_tile_classes, N=5)


def test_render_that_draws_nothing_is_a_clear_error():
    with pytest.raises(RuntimeError, match="drew no matplotlib figure"):
        widgets.still_png(lambda: None)


def test_a_kernel_without_a_widget_frontend_saves_the_still_figure():
    """What nbval and `make grade` see: the output holds the PNG beside the widget view."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from helpers import widgets, lesson01\n"
        "import torch\n"
        "widgets.stepper(lambda step: lesson01.render_trace(torch.tensor([1., 3., 2.]), step), n_steps=3)")]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert [o.output_type for o in outputs] == ["execute_result"], outputs
    data = outputs[0].data
    assert widgets.WIDGET_VIEW in data
    assert base64.b64decode(data["image/png"]).startswith(PNG_MAGIC)
