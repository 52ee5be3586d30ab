"""Shared code for the FlashAttention course.

Every notebook starts with ``from helpers import check, meter``:

- ``helpers.check``: one grader per exercise, ``check.merge_ml(my_merge_ml)``.
- ``helpers.meter``: measures one call of a function (FLOPs, the largest tensor it
  made, bytes moved to and from "HBM") with ``TorchDispatchMode``.
- ``helpers.reference``: the float64 references (SDPA, ``torch.logsumexp``).
- ``helpers.widgets``: ipywidgets explorers; each lesson's figures are in ``helpers.lessonNN``.
- ``helpers.checking``: the grading framework behind ``helpers.check``.

Importing any ``helpers`` module first decides, once, whether Triton runs natively (a CUDA GPU) or
under its interpreter (no GPU): ``helpers.triton_mode``. It must happen before anything imports triton,
and every notebook's first cell imports ``helpers``. Apart from torch (for ``torch.cuda.is_available()``)
this file imports nothing heavy, so ``helpers.kernels`` can be used on a GPU machine that has
only torch and triton.
"""
import importlib

from . import triton_mode

triton_mode.choose()

__all__ = ["check", "meter", "reference", "widgets", "checking"]


def __getattr__(name):  # lazy submodules: `helpers.check` imports on first use
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'helpers' has no attribute {name!r}")
