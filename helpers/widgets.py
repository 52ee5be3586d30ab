"""ipywidgets explorers, thin on purpose: each draws through a plain, tested function.

``stepper(render, n_steps)`` puts a slider and a play button over ``render(step)``;
``explorer(render, N=(1, 64, 1, 16), align=["top_left", "bottom_right"])`` puts one
control per keyword over ``render(**values)``. Both call ``render`` once with the
initial values at once (into the widget's output area).
"""
from __future__ import annotations

__all__ = ["stepper", "explorer"]


def _show_now(render, **values):
    import matplotlib.pyplot as plt
    render(**values)
    plt.show()


def stepper(render, n_steps: int, description: str = "step", start: int = 0):
    """A slider (with a play button) over ``render(step)``, steps 0 .. n_steps-1."""
    import ipywidgets as w
    slider = w.IntSlider(value=start, min=0, max=max(n_steps - 1, 0), description=description,
                         continuous_update=True)
    play = w.Play(value=start, min=0, max=max(n_steps - 1, 0), interval=700)
    w.jslink((play, "value"), (slider, "value"))
    out = w.interactive_output(lambda step: _show_now(lambda: render(step)), {"step": slider})
    box = w.VBox([w.HBox([play, slider]), out])
    return box


def explorer(render, **controls):
    """One control per keyword: ``(lo, hi, step, value)`` for an int slider, a list for a dropdown."""
    import ipywidgets as w
    widgets = {}
    for name, spec in controls.items():
        if isinstance(spec, (list, tuple)) and len(spec) == 4 and all(isinstance(x, int) for x in spec):
            lo, hi, step, value = spec
            widgets[name] = w.IntSlider(value=value, min=lo, max=hi, step=step, description=name)
        elif isinstance(spec, (list, tuple)):
            widgets[name] = w.Dropdown(options=list(spec), value=spec[0], description=name)
        else:
            raise TypeError(f"explorer: control {name!r} must be (lo, hi, step, value) or a list of options")
    out = w.interactive_output(lambda **v: _show_now(lambda: render(**v)), widgets)
    return w.VBox([w.HBox(list(widgets.values())), out])
