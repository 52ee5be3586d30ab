"""The names lesson 11's Gluon exercise is written with: ``gluon``, ``gl``, ``mbarrier``, ``tma`` and ``tma_load``.

Triton's own (``triton.experimental.gluon`` and its Hopper modules; ``tma_load`` is ``tma.async_load`` from Triton
3.8, ``tma.async_copy_global_to_shared`` in 3.6 and 3.7) when this Triton has Gluon's Hopper API; without it (macOS,
Windows, no Triton) stand-ins with which the exercise can still be written and its barrier protocol traced on the
CPU (``helpers.lesson11.gluon_api``, ``trace_producer``), not compiled.
"""
from .producer import gluon_api as _gluon_api

gluon, gl, mbarrier, tma, tma_load = _gluon_api()

__all__ = ["gluon", "gl", "mbarrier", "tma", "tma_load"]
