"""Whether Triton runs kernels natively or under its interpreter, decided once for the whole course.

Triton reads ``TRITON_INTERPRET`` when it *decorates* a function: ``triton.jit`` returns an
``InterpretedFunction`` when it is on, a ``JITFunction`` (compiled for a GPU) when it is off
(``triton/runtime/jit.py``, ``jit``). Its own library (``tl.max``, ``tl.sum``, ... in
``triton/language/standard.py``) is decorated when ``triton`` is first imported. So the variable must be
set before *anything* imports triton, and in torch 2.13 ``torch.utils.flop_counter`` (which
``helpers.meter`` imports) already does. A notebook cell that sets it later is too late: the course's
kernels then run in the interpreter but call Triton's library compiled for a GPU, which fails with
"Cannot call @triton.jit'd outside of the scope of a kernel".

``helpers/__init__.py`` therefore calls :func:`choose` the first time any ``helpers`` module is imported
(every notebook's first cell does): without a CUDA GPU it sets ``TRITON_INTERPRET=1``; with one it leaves
Triton native. A value the learner set (``TRITON_INTERPRET=0`` or ``=1`` before starting Jupyter) is
respected. If triton was imported before the course could decide, :func:`require_triton` says so in one
line instead of letting a kernel fail later.
"""
from __future__ import annotations

import os
import sys

__all__ = ["TRUTHY", "interpreting", "choose", "decided", "TritonMissing", "require_triton"]

# The values of TRITON_INTERPRET that Triton itself takes as "on" (its knobs' env_bool: 1, true, on, yes, y,
# in any case); anything else, or unset, is off. tests/test_learner_machines.py compares with Triton's own.
TRUTHY = ("1", "true", "on", "yes", "y")

# How the mode was decided: "learner" (TRITON_INTERPRET was in the environment), "no-gpu" (set here),
# "gpu" (left off: CUDA is available), "too-late" (triton was imported first, nothing set), "no-torch".
decided: str | None = None


def interpreting() -> bool:
    """True when Triton runs kernels under its interpreter (TRITON_INTERPRET on, as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in TRUTHY


def choose() -> str:
    """Decide the mode once: interpreter without a CUDA GPU, native with one; the learner's own value wins.

    Returns how it was decided (the module's ``decided``). Cheap after the first call."""
    global decided
    if decided is not None:
        return decided
    if "TRITON_INTERPRET" in os.environ:
        decided = "learner"
    elif "triton" in sys.modules:     # too late to change what Triton decorated; require_triton says so
        decided = "too-late"
    else:
        try:
            import torch              # torch itself does not import triton; torch.cuda.is_available() neither
        except ImportError:
            decided = "no-torch"
        else:
            if torch.cuda.is_available():
                decided = "gpu"
            else:
                os.environ["TRITON_INTERPRET"] = "1"
                decided = "no-gpu"
    return decided


def _half_set_up() -> bool:
    """True when triton was imported compiled-for-GPU but there is no GPU to compile for."""
    if interpreting() or "triton" not in sys.modules:
        return False
    try:
        import torch
    except ImportError:
        return False
    return not torch.cuda.is_available()


TOO_LATE = ("Triton was imported before the course could switch on its interpreter (this machine has no CUDA "
            "GPU): restart the kernel and run the notebook from its first cell (it imports `helpers` before "
            "anything imports triton), or start Jupyter with TRITON_INTERPRET=1 set")


class TritonMissing(Exception):
    """Stops a notebook where its Triton part cannot run. IPython shows its one line, not a traceback;
    ``make grade`` marks the exercises after it ➖ with this message (``helpers.grade.STOPS``)."""

    def _render_traceback_(self):
        return [f"Run All stops here: {self}."]


def require_triton(no_triton: str, show_recorded, what: str = "the rest of this notebook") -> None:
    """Return if Triton can run this notebook's kernels here; otherwise stop Run All with one line.

    Without Triton (macOS, Windows): print ``no_triton``, call ``show_recorded()`` (the recorded GPU
    figures), raise :class:`TritonMissing`. With triton imported too early on a machine without a GPU:
    raise :class:`TritonMissing` saying how to recover."""
    try:
        import triton  # noqa: F401 - only whether it imports
    except ImportError:
        print(no_triton)
        show_recorded()
        raise TritonMissing(f"{what} needs Triton, which this Python does not have") from None
    if _half_set_up():
        raise TritonMissing(TOO_LATE)
