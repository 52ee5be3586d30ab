"""``check.<exercise>(fn)`` for every exercise of the course.

Each lesson's checkers live in its own package, ``helpers/lessonNN/check.py`` (lesson 08 also has
``check_gpu.py``); they register themselves with ``helpers.checking.exercise`` and are gathered here by name.
"""
import importlib
import pkgutil
from pathlib import Path

from .checking import REGISTRY, CheckFailure, hint

_HERE = Path(__file__).resolve().parent
for _lesson in sorted(p.name for p in _HERE.glob("lesson[0-9][0-9]") if p.is_dir()):
    for _mod in sorted(m.name for m in pkgutil.iter_modules([str(_HERE / _lesson)]) if m.name.startswith("check")):
        importlib.import_module(f"{__package__}.{_lesson}.{_mod}")

globals().update(REGISTRY)
__all__ = sorted(REGISTRY) + ["CheckFailure", "hint"]
