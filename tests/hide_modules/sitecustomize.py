"""Put this folder on PYTHONPATH to make some imports fail, as on a learner's machine that lacks them.

``COURSE_TEST_HIDE=triton`` (comma-separated top-level names) makes ``import triton`` and its submodules
raise ModuleNotFoundError, as on macOS or Windows where PyPI has no Triton; ``COURSE_TEST_HIDE=helpers``
is a notebook opened outside the course. Python imports ``sitecustomize`` at start-up, so a Jupyter
kernel started with this PYTHONPATH has the finder before any cell runs.
"""
import os
import sys

HIDDEN = {name.strip() for name in os.environ.get("COURSE_TEST_HIDE", "").split(",") if name.strip()}


class Hiding:
    """Wraps one of ``sys.meta_path``'s finders: a hidden package is "not found" (``None``), as where it is
    not installed, so ``import triton`` raises ModuleNotFoundError and ``importlib.util.find_spec`` is None."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        find = getattr(self.finder, "find_spec", None)
        if fullname.split(".")[0] in HIDDEN or find is None:
            return None
        return find(fullname, path, target)

    def __getattr__(self, name):               # invalidate_caches, find_distributions, ...
        return getattr(self.finder, name)


if HIDDEN:   # site.py ran the .pth files (editable installs add their finders there) before this file
    sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
