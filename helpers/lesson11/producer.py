"""Lesson 11's Gluon exercise, the producer warp: stand-ins for Gluon's names where Triton has none, the trace
of a producer's Python body through recording stand-ins, and its compile for sm_90 in a child process."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRODUCER_ARGS", "TraceError", "gluon_api", "gluon_here", "trace_producer", "producer_source",
           "compile_producer_for_sm90"]


# ------------------------------------------------------------------ the Gluon exercise: the producer warp, traced
# A learner writes ``fa3_producer`` with ``@gluon.jit``: the producer partition of gluon_forward's "ws" kernel
# (``_ws_producer``'s signature). Three checks, as far as the machine allows: everywhere, the function's Python body
# is run with stand-ins for mbarrier and tma that record what it issues, and the record goes through ``simulate``
# with the course's consumer (no Triton needed); with Triton's Gluon, the kernel is compiled for sm_90 with it; on
# an sm_90 GPU it runs natively against float64. The first check comes first on a GPU too: a wrong parity hangs a
# real kernel, and nothing can interrupt it.

PRODUCER_ARGS = ("q_desc", "k_desc", "v_desc", "q_smem", "k_smem", "v_smem", "q_bar", "full", "empty", "q_row",
                 "kv_row", "n_tiles", "BLOCK_N", "NUM_STAGES")


class TraceError(Exception):
    """The producer did something the CPU trace does not model (the message says what)."""


class _Constexpr:
    """Stand-in for ``gl.constexpr`` without Triton: an annotation only."""


class _NotHere:
    """A stand-in module of Gluon without Triton: names resolve (so a producer can be written and traced), calls
    say that only the trace runs here."""

    def __init__(self, name, **attrs):
        self._name = name
        self.__dict__.update(attrs)

    def __getattr__(self, attr):
        def nowhere(*args, **kwargs):
            raise RuntimeError(f"{self._name}.{attr} needs Triton with Gluon (Linux, Triton >= 3.6); here the "
                               "checker only traces your producer on the CPU")
        return nowhere


class _StandInJit:
    """What ``gluon.jit`` gives without Triton: the function, kept for the trace (``.fn``), not callable."""

    def __init__(self, fn):
        self.fn, self.__name__, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a Gluon kernel function: it runs inside a kernel on an sm_90 GPU, "
                           "not as Python")


def gluon_api():
    """``(gluon, gl, mbarrier, tma, tma_load)``: Triton's Gluon, its Hopper ``mbarrier`` and ``tma`` modules and the
    TMA load (``tma.async_load`` from Triton 3.7, ``tma.async_copy_global_to_shared`` in 3.6) when this Triton has
    them; without them, stand-ins with which the exercise can be written and traced on the CPU, not compiled."""
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

        from ..kernels.gluon_forward import _tma_load as tma_load     # the kernels' own version shim
        return gluon, gl, mbarrier, tma, tma_load
    except ImportError:
        return _STAND_INS


def gluon_here() -> bool:
    """True when this Triton has Gluon's Hopper API (a kernel can be compiled for sm_90 here)."""
    return gluon_api() is not _STAND_INS


_tma_stand_in = _NotHere("tma")
# One set, so that the trace knows them by identity: (gluon, gl, mbarrier, tma, tma_load) without Triton.
_STAND_INS = (_NotHere("gluon", jit=_StandInJit), _NotHere("gl", constexpr=_Constexpr), _NotHere("mbarrier"),
              _tma_stand_in, _tma_stand_in.async_load)


@dataclass(frozen=True)
class _Named:
    """A kernel object by its argument's name, and its stage when taken from a ring with ``.index(s)``."""
    name: str
    stage: int | None = None

    def __repr__(self):
        return self.name if self.stage is None else f"{self.name}.index({self.stage})"


class _Bar(_Named):
    """One mbarrier: q_bar, or full / empty's stage."""


class _Smem(_Named):
    """A shared-memory buffer: q_smem, or k_smem / v_smem's stage."""


class _Ring:
    """``full``, ``empty``, ``k_smem`` or ``v_smem``: NUM_STAGES of something, taken with ``.index(s)``."""

    def __init__(self, name, n, make):
        self.name, self.n, self.make = name, n, make

    def index(self, s):
        s = _as_int(s, f"{self.name}.index(s)")
        if not 0 <= s < self.n:
            raise TraceError(f"{self.name}.index({s}): with NUM_STAGES = {self.n} the stages are 0..{self.n - 1} "
                             "(tile j lives in stage j % NUM_STAGES)")
        return self.make(self.name, s)


class _Desc:
    """A TMA descriptor of one tensor, [rows, d] per block: ``block_type.nbytes`` as Gluon's has it."""

    def __init__(self, name, rows, d, elsize=2):
        self.name = name
        self.block_shape = [rows, d]
        self.block_type = _BlockType(rows * d * elsize, [rows, d])

    def __repr__(self):
        return self.name


@dataclass(frozen=True)
class _BlockType:
    nbytes: int
    shape: list


def _as_int(x, what):
    try:
        if isinstance(x, bool) or int(x) != x:
            raise TypeError
        return int(x)
    except (TypeError, ValueError):
        raise TraceError(f"{what} is {x!r}: it must be an integer") from None


class _Recorder:
    """mbarrier, tma and the parts of gl a producer uses, each call recorded as an event."""

    def __init__(self, limit):
        self.events, self.limit = [], limit

    def add(self, event):
        self.events.append(event)
        if len(self.events) > self.limit:
            raise TraceError(f"more than {self.limit} barrier and TMA operations for this case: does a loop run "
                             "past n_tiles?")

    def bar(self, b, what):
        if not isinstance(b, _Bar):
            raise TraceError(f"{what}'s barrier is {b!r}: pass q_bar, or full.index(s) / empty.index(s)")
        return b

    # mbarrier
    def expect(self, bar, nbytes, pred=True):
        self.add(("expect", self.bar(bar, "mbarrier.expect"), _as_int(nbytes, "mbarrier.expect's byte count")))

    def wait(self, bar, phase, pred=True, deps=None):
        self.add(("wait", self.bar(bar, "mbarrier.wait"), _as_int(phase, "mbarrier.wait's phase")))

    def arrive(self, bar, count=1, pred=True):
        self.add(("arrive", self.bar(bar, "mbarrier.arrive")))

    def init(self, bar, count=1):
        raise TraceError("mbarrier.init in the producer: the kernel initialises every barrier before the partitions "
                         "start")

    invalidate = init

    # tma
    def load(self, desc, coord, bar, result, pred=True):
        if not isinstance(desc, _Desc):
            raise TraceError(f"the TMA load's descriptor is {desc!r}: q_desc, k_desc or v_desc")
        coord = tuple(_as_int(c, "a TMA coordinate") for c in coord)
        if not isinstance(result, _Smem):
            raise TraceError(f"the TMA load's destination is {result!r}: q_smem, or k_smem.index(s) / "
                             "v_smem.index(s)")
        self.add(("load", desc.name, coord, self.bar(bar, "the TMA load"), result))


def _fake_module(rec, kind):
    names = {"mbarrier": {"expect": rec.expect, "wait": rec.wait, "arrive": rec.arrive, "init": rec.init,
                          "invalidate": rec.invalidate},
             "tma": {"async_load": rec.load, "async_copy_global_to_shared": rec.load},
             "gl": {"static_range": range, "range": range, "minimum": min, "maximum": max, "constexpr": _Constexpr,
                    "cdiv": lambda a, b: -(-a // b)}}[kind]

    class Fake:
        def __getattr__(self, attr):
            if attr in names:
                return names[attr]
            raise TraceError(f"{kind}.{attr}: the CPU trace models only "
                             f"{', '.join(f'{kind}.{n}' for n in names)} (a producer needs no more)")
    return Fake()


def trace_producer(producer, n_tiles, num_stages, block_n=64, d=64, q_row=0, kv_row=0, block_m=128, limit=10_000):
    """Run ``producer``'s Python body (a ``@gluon.jit`` function, or its stand-in) on the CPU with recording
    stand-ins for mbarrier, tma and gl; returns its events in order: ("expect", bar, nbytes), ("wait", bar, phase),
    ("arrive", bar), ("load", desc, (row, col), bar, dest). Raises TraceError for what it does not model; the
    learner's own errors propagate."""
    import types
    fn = getattr(producer, "fn", producer)
    if not isinstance(fn, types.FunctionType):
        raise TraceError(f"{producer!r} is not a function defined with def (decorate it with @gluon.jit)")
    rec = _Recorder(limit)
    fakes = {"mbarrier": _fake_module(rec, "mbarrier"), "tma": _fake_module(rec, "tma"), "gl": _fake_module(rec, "gl")}
    _, gl, mbarrier, tma, tma_load = gluon_api()                # the objects the learner's globals may hold
    by_id = {id(gl): fakes["gl"], id(mbarrier): fakes["mbarrier"], id(tma): fakes["tma"], id(tma_load): rec.load}
    env = dict(fn.__globals__)
    for name, value in fn.__globals__.items():
        if id(value) in by_id:
            env[name] = by_id[id(value)]
    traced = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
    args = dict(q_desc=_Desc("q_desc", block_m, d), k_desc=_Desc("k_desc", block_n, d),
                v_desc=_Desc("v_desc", block_n, d), q_smem=_Smem("q_smem"),
                k_smem=_Ring("k_smem", num_stages, _Smem), v_smem=_Ring("v_smem", num_stages, _Smem),
                q_bar=_Bar("q_bar"), full=_Ring("full", num_stages, _Bar), empty=_Ring("empty", num_stages, _Bar),
                q_row=q_row, kv_row=kv_row, n_tiles=n_tiles, BLOCK_N=block_n, NUM_STAGES=num_stages)
    traced(*(args[name] for name in PRODUCER_ARGS))            # positionally, as the kernel calls it
    return rec.events


def producer_source(producer) -> str:
    """The producer's source from its ``def`` on (decorators dropped), as ``inspect`` finds it (in a notebook,
    IPython keeps each cell's source)."""
    import inspect
    import re
    import textwrap
    src = textwrap.dedent(inspect.getsource(getattr(producer, "fn", producer)))
    start = re.search(r"^def\s", src, re.MULTILINE)
    return src[start.start():] if start else src


_COMPILE_PRODUCER = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
try:
    import learner_producer
    from helpers.kernels.gluon_forward import compile_for_sm90
    ptx = compile_for_sm90(d=int(sys.argv[3]), dtype=sys.argv[4], variant="ws",
                           producer=getattr(learner_producer, sys.argv[2]))
    print(json.dumps({"ok": True, "ptx": [k for k in ("cp.async.bulk.tensor", "mbarrier.try_wait.parity",
                                                     "mbarrier.arrive.expect_tx") if k in ptx]}))
except Exception as e:
    while type(e.__cause__).__name__ == "CompilationError":     # the innermost: the kernel calls the producer
        e = e.__cause__
    cause = getattr(e, "error_message", None) or (f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__
                                                   else (str(e).strip().splitlines() or [""])[-1])
    where = str(e).splitlines()[0].rstrip(":") + " " if str(e).startswith("at ") else ""
    print(json.dumps({"ok": False, "error": f"{type(e).__name__} {where}(line:column from your def): {cause}"}))
"""

_PRODUCER_HEADER = """from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from helpers.kernels.gluon_forward import _tma_load as tma_load


@gluon.jit
"""


def compile_producer_for_sm90(producer, d=64, dtype="bf16", timeout=600):
    """Compile gluon_forward's "ws" kernel for sm_90 with ``producer`` as its producer warp, with Triton's own
    compiler and no GPU, in a child process: without a GPU the course runs Triton's interpreter, and a Gluon kernel
    has none (the child turns it off). The child rebuilds the producer from its source with the exercise's names
    (``gluon``, ``gl``, ``mbarrier``, ``tma``, ``tma_load``) and nothing else from the notebook. Returns a dict:
    ``ok``, and ``ptx`` (the instructions found: the TMA copy, the parity wait, the expect) or ``error`` (the
    compiler's one-line reason)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    source = _PRODUCER_HEADER + producer_source(producer)
    key = (source, d, dtype)
    if key in _COMPILED:                                         # the same source again (a cell run twice)
        return _COMPILED[key]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "learner_producer.py").write_text(source)
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        try:
            name = getattr(producer, "fn", producer).__name__
            r = subprocess.run([sys.executable, "-c", _COMPILE_PRODUCER, tmp, name, str(d), dtype],
                               cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"the compile took longer than {timeout} s"}
    out = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not out:
        tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        return {"ok": False, "error": tail[-1] if tail else f"the compiler's process exited with {r.returncode}"}
    _COMPILED[key] = json.loads(out[-1])
    return _COMPILED[key]


_COMPILED: dict = {}         # (source, d, dtype) -> compile_producer_for_sm90's answer, for this process
