"""``check.<exercise>(fn)`` for every exercise of the course.

Each module in this folder holds the checkers of one lesson; they register themselves
with ``helpers.checking.exercise`` and are collected here by name.
"""
import importlib
import pkgutil

from ..checking import REGISTRY, CheckFailure

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")

globals().update(REGISTRY)
__all__ = sorted(REGISTRY) + ["CheckFailure"]
