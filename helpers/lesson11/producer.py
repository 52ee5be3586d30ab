"""Lesson 11's Gluon exercise, the producer warp: stand-ins for Gluon's names where Triton has none, the trace
of a producer's Python body through recording stand-ins, and, in child processes, its compile for sm_90 and its
native run on an sm_90 GPU (bounded in time: a deadlocked kernel is killed with its process)."""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass

__all__ = ["PRODUCER_ARGS", "TraceError", "gluon_api", "gluon_here", "trace_producer", "producer_source",
           "producer_module_source", "compile_producer_for_sm90", "run_producer_natively", "native_timeout"]


# ------------------------------------------------------------------ the Gluon exercise: the producer warp, traced
# A learner writes ``fa3_producer`` with ``@gluon.jit``: the producer partition of gluon_forward's "ws" kernel
# (``_ws_producer``'s signature). Three checks, as far as the machine allows: everywhere, the function's Python body
# is run with stand-ins for mbarrier and tma that record what it issues (with Gluon's own signatures: its keyword
# names, and ``pred=``, which switches a call off), and the record goes through ``simulate`` with the course's
# consumer, Q's barrier included (no Triton needed); with Triton's Gluon, the kernel is compiled for sm_90 with it;
# on an sm_90 GPU it runs natively against float64, in a child process with a time limit: a hang the trace missed
# is killed with that process, and the notebook's own CUDA context is untouched.

PRODUCER_ARGS = ("q_desc", "k_desc", "v_desc", "q_smem", "k_smem", "v_smem", "q_bar", "full", "empty", "q_row",
                 "kv_row", "n_tiles", "BLOCK_N", "NUM_STAGES")


class TraceError(Exception):
    """The producer did something the CPU trace does not model, or that Gluon would not take (the message says
    what; ``hint`` and ``fix``, when given, what to do)."""

    def __init__(self, message, hint="", fix=""):
        super().__init__(message)
        self.hint, self.fix = hint, fix


class _Constexpr:
    """Stand-in for ``gl.constexpr`` without Triton: an annotation, or ``gl.constexpr(x)`` giving ``x``."""

    def __new__(cls, value=None):
        return value


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


# Gluon's own signatures (Triton 3.9's, less ``_semantic``): without Triton the trace binds with these;
# tests/test_lesson11.py compares them with the installed ones where Triton has Gluon.
def _expect(mbarrier, bytes_per_cta=None, pred=True, *, from_cta=None): ...
def _wait(mbarrier, phase, pred=True, deps=()): ...
def _arrive(mbarrier, *, count=1, pred=True, from_cta=None): ...
def _async_load(tensor_desc, coord, barrier, result, pred=True, multicast=False, cache_policy=None): ...


_SIGNATURES = {name: inspect.signature(f) for name, f in (("expect", _expect), ("wait", _wait), ("arrive", _arrive),
                                                          ("async_load", _async_load))}


def gluon_signatures() -> dict:
    """{expect, wait, arrive, async_load, async_copy_global_to_shared?: inspect.Signature}, as this Triton's Gluon
    declares them (``_semantic`` left out), else the copies above. A name this Triton has removed (a stub taking
    ``*args``) is left out."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    except ImportError:
        return dict(_SIGNATURES, async_copy_global_to_shared=_SIGNATURES["async_load"])
    out = {}
    for name, f in (("expect", mbarrier.expect), ("wait", mbarrier.wait), ("arrive", mbarrier.arrive),
                    ("async_load", getattr(tma, "async_load", None)),
                    ("async_copy_global_to_shared", getattr(tma, "async_copy_global_to_shared", None))):
        if f is None:
            continue
        sig = inspect.signature(f)
        params = [p for p in sig.parameters.values() if p.name != "_semantic"]
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            continue                                          # Triton 3.9's "has been removed" stub
        out[name] = sig.replace(parameters=params)
    return out


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
                             "(tile j lives in stage j % NUM_STAGES)", "a stage index outside the ring",
                             "s = j % NUM_STAGES")
        return self.make(self.name, s)

    def __getattr__(self, attr):
        raise TraceError(f"{self.name}.{attr}: the CPU trace models only {self.name}.index(s) on a ring")


class _Bytes(int):
    """A byte count read off one descriptor (``q_desc.block_type.nbytes``): an int that remembers whose it is, so
    that an expect of Q's bytes on full[s] is named even where the numbers agree. Arithmetic gives plain ints."""

    def __new__(cls, value, src):
        out = super().__new__(cls, value)
        out.src = src
        return out


class _Opaque:
    """An attribute the trace has but does not look into (``desc.layout``)."""

    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return self.what


class _Dtype:
    """The descriptors' element type in the trace: bf16 (Gluon's ``gl.bfloat16``: 16 bits)."""
    primitive_bitwidth, name = 16, "bf16"

    def __repr__(self):
        return "bf16"

    def __getattr__(self, attr):
        raise TraceError(f"dtype.{attr}: the CPU trace models a descriptor's dtype by its primitive_bitwidth only")


@dataclass(frozen=True)
class _BlockType:
    nbytes: int
    shape: list
    element_ty: object
    numel: int


class _Desc:
    """A TMA descriptor of one tensor, [rows, d] per block, with Gluon's attributes: ``block_type`` (``nbytes``,
    ``shape``, ``element_ty``, ``numel``), ``block_shape``, ``dtype``, ``nbytes_per_cta``, ``layout``."""

    def __init__(self, name, rows, d, elsize=2):
        self.name = name
        self.block_shape = [rows, d]
        self.dtype = _Dtype()
        if descriptor_has_nbytes_per_cta():                      # Tritons newer than 3.6
            self.nbytes_per_cta = _Bytes(rows * d * elsize, name)
        self.block_type = _BlockType(_Bytes(rows * d * elsize, name), [rows, d], self.dtype, rows * d)
        self.layout = _Opaque(f"{name}.layout")

    def __repr__(self):
        return self.name

    def __getattr__(self, attr):
        if attr == "nbytes_per_cta":
            raise TraceError(f"{self.name}.nbytes_per_cta: this Triton's descriptors do not have it (newer "
                             "Tritons added it)", f"use {self.name}.block_type.nbytes")
        has = "block_type.nbytes, block_type.shape, block_shape, dtype, layout" + (
            ", nbytes_per_cta" if descriptor_has_nbytes_per_cta() else "")
        raise TraceError(f"{self.name}.{attr}: the CPU trace does not model this attribute of a descriptor (it has "
                         f"{has}); the producer needs only the block's bytes")


@functools.lru_cache(maxsize=None)
def descriptor_has_nbytes_per_cta() -> bool:
    """Whether this Triton's Gluon TMA descriptors have ``nbytes_per_cta`` (newer than 3.6; without Triton: the
    stand-ins follow the newest Gluon, as ``_SIGNATURES`` does)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return True
    return hasattr(getattr(tma, "tensor_descriptor", None), "nbytes_per_cta")


def _as_int(x, what):
    try:
        if isinstance(x, bool) or int(x) != x:
            raise TypeError
        return int(x)
    except (TypeError, ValueError):
        kind = "a bool, from a comparison" if isinstance(x, bool) else type(x).__name__
        raise TraceError(f"{what} is {x!r} ({kind}): it must be an integer (Gluon does not take it)",
                         "an integer where Gluon takes one", "((j // NUM_STAGES) & 1) ^ 1 for a phase: an int") \
            from None


def _pred(x, what):
    """A ``pred=`` as Gluon runs it: a bool of the producer's integer arguments (``j < n_tiles``)."""
    if isinstance(x, (bool, int)) or type(x).__name__ == "bool_":
        return bool(x)
    raise TraceError(f"{what}'s pred= is {x!r}: in the trace a predicate is a comparison of the producer's integer "
                     "arguments (j >= NUM_STAGES, j < n_tiles)")


class _Recorder:
    """mbarrier, tma and the parts of gl a producer uses, each call recorded as an event; a call whose ``pred=`` is
    False (it does nothing on the GPU) is recorded as ("skip", event) only."""

    def __init__(self, limit, signatures):
        self.events, self.limit, self.sigs = [], limit, signatures
        # expect's byte count is its second parameter: ``bytes_per_cta`` in Tritons newer than 3.6, ``bytes`` in 3.6
        self.byte_count = list(signatures["expect"].parameters)[1]

    def add(self, event):
        self.events.append(event)
        if len(self.events) > self.limit:
            raise TraceError(f"more than {self.limit} barrier and TMA operations for this case: does a loop run "
                             "past n_tiles?")

    def bind(self, name, args, kwargs):
        """The call's arguments by Gluon's own names (its keyword names bind as Gluon binds them)."""
        try:
            bound = self.sigs[name].bind(*args, **kwargs)
        except TypeError as e:
            call = {"async_load": "tma.async_load", "async_copy_global_to_shared": "tma.async_copy_global_to_shared"}
            raise TraceError(f"{call.get(name, 'mbarrier.' + name)}{self.sigs[name]}: {e}",
                             "Gluon's own signature, as above") from None
        bound.apply_defaults()
        return bound.arguments

    def bar(self, b, what):
        if not isinstance(b, _Bar):
            raise TraceError(f"{what}'s barrier is {b!r}: pass q_bar, or full.index(s) / empty.index(s)")
        return b

    # mbarrier
    def expect(self, *args, **kwargs):
        a = self.bind("expect", args, kwargs)
        bar = self.bar(a["mbarrier"], "mbarrier.expect")
        if not _pred(a["pred"], "mbarrier.expect"):
            return self.add(("skip", ("expect", bar)))
        n = a[self.byte_count]
        self.add(("expect", bar, _as_int(n, "mbarrier.expect's byte count"), getattr(n, "src", None)))

    def wait(self, *args, **kwargs):
        a = self.bind("wait", args, kwargs)
        bar = self.bar(a["mbarrier"], "mbarrier.wait")
        if not _pred(a["pred"], "mbarrier.wait"):
            return self.add(("skip", ("wait", bar)))
        self.add(("wait", bar, _as_int(a["phase"], "mbarrier.wait's phase")))

    def arrive(self, *args, **kwargs):
        a = self.bind("arrive", args, kwargs)
        bar = self.bar(a["mbarrier"], "mbarrier.arrive")
        self.add(("arrive", bar) if _pred(a["pred"], "mbarrier.arrive") else ("skip", ("arrive", bar)))

    def init(self, *args, **kwargs):
        raise TraceError("mbarrier.init in the producer: the kernel initialises every barrier before the partitions "
                         "start", "the producer only waits, expects and copies")

    invalidate = init

    # tma
    def load(self, *args, _name=None, **kwargs):
        """The TMA load, whichever name this Triton gives it (``tma_load`` is that name)."""
        if _name is None:
            _name = "async_load" if "async_load" in self.sigs else "async_copy_global_to_shared"
        a = self.bind(_name, args, kwargs)
        desc, coord, result = a["tensor_desc"], a["coord"], a["result"]
        if not isinstance(desc, _Desc):
            raise TraceError(f"the TMA load's descriptor is {desc!r}: q_desc, k_desc or v_desc")
        bar = self.bar(a["barrier"], "the TMA load")
        if not isinstance(result, _Smem):
            raise TraceError(f"the TMA load's destination is {result!r}: q_smem, or k_smem.index(s) / "
                             "v_smem.index(s)")
        if not _pred(a["pred"], "the TMA load"):
            return self.add(("skip", ("load", desc.name, None, bar, result)))
        try:
            coord = tuple(coord)
        except TypeError:
            coord = (coord,)
        coord = tuple(_as_int(c, "a TMA coordinate") for c in coord)
        if len(coord) != len(desc.block_shape):
            raise TraceError(f"{desc.name}'s coordinate {list(coord)} has {len(coord)} number"
                             f"{'s' if len(coord) != 1 else ''}; the descriptor is {len(desc.block_shape)}-D "
                             f"(blocks of {desc.block_shape}: rows, columns)",
                             "a TMA coordinate names the block's first row and its first column",
                             f"tma_load({desc.name}, [row, 0], bar, dest)")
        self.add(("load", desc.name, coord, bar, result))

    def async_load(self, *args, **kwargs):
        if "async_load" not in self.sigs:
            raise TraceError("tma.async_load: this Triton's Gluon does not have it yet (Triton 3.8 renamed "
                             "tma.async_copy_global_to_shared to it)", "this Triton's TMA load is "
                             "tma.async_copy_global_to_shared (tma_load is that name here)",
                             "tma_load(desc, [row, 0], bar, dest)")
        return self.load(*args, _name="async_load", **kwargs)

    def copy_global_to_shared(self, *args, **kwargs):
        if "async_copy_global_to_shared" not in self.sigs:
            raise TraceError("tma.async_copy_global_to_shared: this Triton removed it (it is Triton 3.6's name); "
                             "call tma.async_load", "this Triton's TMA load is tma.async_load (tma_load is that "
                             "name here)", "tma_load(desc, [row, 0], bar, dest)")
        return self.load(*args, _name="async_copy_global_to_shared", **kwargs)


def _range(*args, **kwargs):
    """``gl.static_range``: Python's range (its hints change nothing in what the producer issues)."""
    return range(*args)


class _Fake:
    """A stand-in module of the trace: the names it models, a TraceError naming any other (``real``: the module it
    stands for, where Triton has it: a name that module lacks is Gluon's error, not the trace's)."""

    def __init__(self, kind, names, real=None):
        self._kind, self._names, self._real = kind, names, real

    def __getattr__(self, attr):
        if self._real is not None and not hasattr(self._real, attr):
            raise TraceError(f"{self._kind}.{attr}: this Triton's Gluon has no such name (Gluon would not compile it)",
                             f"{self._kind}.{attr} is not Gluon's: a loop over the tiles is Python's range(n_tiles) "
                             "(gl.static_range needs constexpr bounds)", "for j in range(n_tiles):")
        if attr in self._names:
            return self._names[attr]
        raise TraceError(f"{self._kind}.{attr}: the CPU trace models only "
                         f"{', '.join(f'{self._kind}.{n}' for n in self._names)} (a producer needs no more)",
                         "the producer needs only mbarrier.expect / mbarrier.wait, the TMA load, .index(s) on the "
                         "rings and its arguments")


def _fakes(rec):
    """The trace's module tree: gluon, gl, gl.nvidia, gl.nvidia.hopper, mbarrier and tma."""
    mb = _Fake("mbarrier", {"expect": rec.expect, "wait": rec.wait, "arrive": rec.arrive, "init": rec.init,
                            "invalidate": rec.invalidate})
    tm = _Fake("tma", {"async_load": rec.async_load, "async_copy_global_to_shared": rec.copy_global_to_shared})
    hopper = _Fake("gl.nvidia.hopper", {"mbarrier": mb, "tma": tm})
    nvidia = _Fake("gl.nvidia", {"hopper": hopper})
    real_gl = gluon_api()[1] if gluon_here() else None
    gl = _Fake("gl", {"static_range": _range, "minimum": min, "maximum": max, "constexpr": _Constexpr,
                      "cdiv": lambda a, b: -(-a // b), "nvidia": nvidia}, real_gl)
    gluon = _Fake("gluon", {"language": gl, "jit": lambda f=None, **kw: f})
    return {"gluon": gluon, "gl": gl, "nvidia": nvidia, "hopper": hopper, "mbarrier": mb, "tma": tm}


def _real_modules():
    """Triton's own objects the learner's globals may hold, by kind: {kind: [module objects]}, and the functions
    of mbarrier and tma by name."""
    gluon, gl, mbarrier, tma, tma_load = gluon_api()
    mods = {"gluon": [gluon], "gl": [gl], "mbarrier": [mbarrier], "tma": [tma]}
    if gluon_here():
        mods["nvidia"], mods["hopper"] = [gl.nvidia], [gl.nvidia.hopper]
    return mods, tma_load


def _is_jit(obj) -> bool:
    """A Gluon kernel function: ``@gluon.jit`` (or its stand-in without Triton)."""
    if isinstance(obj, _StandInJit):
        return True
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return False
    return isinstance(obj, GluonJITFunction)


def _names(code):
    """The global names a function's code (and its nested code: comprehensions, lambdas) may read."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def trace_producer(producer, n_tiles, num_stages, block_n=64, d=64, q_row=0, kv_row=0, block_m=128, limit=10_000):
    """Run ``producer``'s Python body (a ``@gluon.jit`` function, or its stand-in) on the CPU with recording
    stand-ins for mbarrier, tma and gl (Gluon's module tree, its signatures and ``pred=``), the learner's own
    ``@gluon.jit`` helpers traced the same way; returns its events in order: ("expect", bar, nbytes, src),
    ("wait", bar, phase), ("arrive", bar), ("load", desc, (row, col), bar, dest), and ("skip", event) for a call
    whose pred= was False. Raises TraceError for what it does not model; the learner's own errors propagate."""
    fn = getattr(producer, "fn", producer)
    if not isinstance(fn, types.FunctionType):
        raise TraceError(f"{producer!r} is not a function defined with def", "decorate it with @gluon.jit")
    if not _is_jit(producer):
        kind = "a @triton.jit function" if hasattr(producer, "fn") else "a plain Python function"
        raise TraceError(f"{fn.__name__} is {kind}: the 'ws' kernel calls its producer as a Gluon kernel function",
                         "decorate it with @gluon.jit", "@gluon.jit on the line above def")
    params = list(inspect.signature(fn).parameters)
    if len(params) != len(PRODUCER_ARGS):
        missing = [a for a in PRODUCER_ARGS if a not in params]
        raise TraceError(f"{fn.__name__} takes {len(params)} arguments; the 'ws' kernel calls it with _ws_producer's "
                         f"{len(PRODUCER_ARGS)}" + (f" (missing: {', '.join(missing)})" if missing else ""),
                         "the signature is the exercise's, in its order", f"def {fn.__name__}({', '.join(PRODUCER_ARGS)})")
    rec = _Recorder(limit, gluon_signatures())
    fakes = _fakes(rec)
    mods, tma_load = _real_modules()
    by_id = {id(m): fakes[kind] for kind, ms in mods.items() for m in ms}
    by_id[id(tma_load)] = rec.load
    for kind in ("mbarrier", "tma"):                 # functions imported from the modules by name
        for m in mods[kind]:
            for attr, value in getattr(m, "__dict__", {}).items():
                if callable(value) and not isinstance(value, type) and not attr.startswith("_") and \
                        (getattr(value, "__module__", "") or "").startswith("triton.experimental.gluon"):
                    by_id.setdefault(id(value), getattr(fakes[kind], attr) if attr in fakes[kind]._names else
                                     _not_modelled(f"{kind}.{attr}"))
    made = {}

    def rebuilt(f):
        """``f`` with its globals rewritten: Gluon's names by the fakes, its jit helpers by their rebuilt bodies."""
        if f in made:
            return made[f]
        env = dict(f.__globals__)
        made[f] = out = types.FunctionType(f.__code__, env, f.__name__, f.__defaults__, f.__closure__)
        for name in _names(f.__code__):
            if name not in f.__globals__:
                continue
            value = f.__globals__[name]
            if id(value) in by_id:
                env[name] = by_id[id(value)]
            elif type(value).__name__ == "constexpr" and hasattr(value, "value"):
                env[name] = value.value                       # a gl.constexpr global: its value, as Gluon folds it
            elif hasattr(value, "fn") and isinstance(value.fn, types.FunctionType) and _is_jit(value):
                env[name] = rebuilt(value.fn)                 # a @gluon.jit helper of the learner's own
            elif isinstance(value, types.FunctionType) and value.__globals__ is fn.__globals__:
                env[name] = _not_jit_helper(name)
        return out
    args = dict(q_desc=_Desc("q_desc", block_m, d), k_desc=_Desc("k_desc", block_n, d),
                v_desc=_Desc("v_desc", block_n, d), q_smem=_Smem("q_smem"),
                k_smem=_Ring("k_smem", num_stages, _Smem), v_smem=_Ring("v_smem", num_stages, _Smem),
                q_bar=_Bar("q_bar"), full=_Ring("full", num_stages, _Bar), empty=_Ring("empty", num_stages, _Bar),
                q_row=q_row, kv_row=kv_row, n_tiles=n_tiles, BLOCK_N=block_n, NUM_STAGES=num_stages)
    rebuilt(fn)(*(args[name] for name in PRODUCER_ARGS))     # positionally, as the kernel calls it
    return rec.events


def _not_modelled(what):
    def call(*args, **kwargs):
        raise TraceError(f"{what}: the CPU trace does not model it (a producer needs only mbarrier.expect, "
                         "mbarrier.wait and the TMA load)", "the producer needs only mbarrier.expect / "
                         "mbarrier.wait, the TMA load, .index(s) on the rings and its arguments")
    return call


def _not_jit_helper(name):
    def call(*args, **kwargs):
        raise TraceError(f"{name} is a plain Python function: a Gluon kernel can call only @gluon.jit functions",
                         f"decorate {name} with @gluon.jit", f"@gluon.jit above def {name}")
    return call


# ------------------------------------------------------------------ the producer as a module of its own
def producer_source(producer) -> str:
    """The producer's source from its ``def`` on (decorators dropped), as ``inspect`` finds it (in a notebook,
    IPython keeps each cell's source)."""
    import re
    import textwrap
    src = textwrap.dedent(inspect.getsource(getattr(producer, "fn", producer)))
    start = re.search(r"^def\s", src, re.MULTILINE)
    return src[start.start():] if start else src


def _import_line(name, value):
    """The line that gives ``name`` this value in a fresh module (Triton's and the course's modules and functions,
    constexprs and numbers), or None."""
    import importlib
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}"
    if type(value).__name__ == "constexpr" and hasattr(value, "value"):
        return f"{name} = _gl_.constexpr({value.value!r})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{name} = {value!r}"                     # as the notebook has it (Gluon wants constexpr globals)
    mod = getattr(value, "__module__", None) or getattr(getattr(value, "fn", None), "__module__", None)
    attr = getattr(value, "__name__", None)
    if mod and attr and mod.split(".")[0] in ("triton", "helpers"):
        try:
            if getattr(importlib.import_module(mod), attr) is value:
                return f"from {mod} import {attr} as {name}"
        except ImportError:
            pass
    mods, _ = _real_modules()
    for ms in mods.values():
        for m in ms:
            for a, v in getattr(m, "__dict__", {}).items():
                if v is value and isinstance(m, types.ModuleType):
                    return f"from {m.__name__} import {a} as {name}"
    return None


def producer_module_source(producer) -> str:
    """A module that defines ``producer`` as a Gluon kernel function, rebuilt from the sources the notebook has: the
    imports of the modules and functions it names (under its names), its constexpr and number globals, and every
    ``@gluon.jit`` helper of its own it calls, transitively (each decorated with ``@gluon.jit``)."""
    header = ["from triton.experimental import gluon as _gluon_", "from triton.experimental.gluon import language as _gl_"]
    lines, defs, seen = {}, [], set()

    def visit(f):
        if f in seen:
            return
        seen.add(f)
        import ast
        src = producer_source(f)                       # annotations (BLOCK_N: gl.constexpr) are read at def time
        names = _names(f.__code__) | {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
        for name in sorted(names):
            if name not in f.__globals__ or name in lines:
                continue
            value = f.__globals__[name]
            if _is_jit(value) and isinstance(getattr(value, "fn", None), types.FunctionType) and \
                    (getattr(value.fn, "__module__", "") or "").split(".")[0] not in ("triton", "helpers"):
                visit(value.fn)
                continue
            line = _import_line(name, value)
            if line:
                lines[name] = line
        defs.append("@_gluon_.jit\n" + src)
    visit(getattr(producer, "fn", producer))
    return "\n".join(header + list(lines.values())) + "\n\n\n" + "\n\n".join(defs)


# ------------------------------------------------------------------ in child processes: the compile, the native run
def _child_env():
    import os
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return root, env


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


def compile_producer_for_sm90(producer, d=64, dtype="bf16", timeout=600):
    """Compile gluon_forward's "ws" kernel for sm_90 with ``producer`` as its producer warp, with Triton's own
    compiler and no GPU, in a child process: without a GPU the course runs Triton's interpreter, and a Gluon kernel
    has none (the child turns it off). The child rebuilds the producer as ``producer_module_source`` writes it
    (its imports, constexprs and own @gluon.jit helpers). Returns a dict: ``ok``, and ``ptx`` (the instructions
    found: the TMA copy, the parity wait, the expect) or ``error`` (the compiler's one-line reason)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    source = producer_module_source(producer)
    key = (source, d, dtype)
    if key in _COMPILED:                                         # the same source again (a cell run twice)
        return _COMPILED[key]
    root, env = _child_env()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "learner_producer.py").write_text(source)
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

# The native run's child: gluon_forward_selftest with the learner's producer, one line per case as it finishes
# ("ROW {json}"), then "DONE {json}". tests/test_lesson11.py replaces it with stand-ins (a case that never ends).
_NATIVE_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import learner_producer
from helpers.kernels.gluon_forward import gluon_forward_selftest
print("START " + json.dumps({"gpu": torch.cuda.get_device_name()}), flush=True)
res = gluon_forward_selftest(producer=getattr(learner_producer, sys.argv[2]), dtypes=(torch.bfloat16,),
                             log=lambda row: print("ROW " + json.dumps(row, default=str), flush=True))
print("DONE " + json.dumps({k: v for k, v in res.items() if k != "rows"}, default=str), flush=True)
"""


def native_timeout() -> float:
    """Seconds the native run may go without finishing a case: ``COURSE_NATIVE_TIMEOUT``, else the per-case limit
    (``COURSE_CASE_TIMEOUT``, default 60), never unbounded: a deadlocked kernel never returns."""
    import os

    from ..timelimit import case_timeout
    try:
        t = float(os.environ.get("COURSE_NATIVE_TIMEOUT", "") or 0)
    except ValueError:
        t = 0.0
    return t if t > 0 else (case_timeout() or 60.0)


def run_producer_natively(producer, timeout=None) -> dict:
    """On an sm_90 GPU: gluon_forward's "ws" kernel with ``producer`` against float64 (the self-test's harsh cases,
    bf16), in a child process of its own session. Each case must finish within ``timeout`` seconds (the first one
    includes the child's start and compile); one that does not is a deadlock: the child's process group is killed
    (the CUDA context and the hung kernel go with it). Returns {"gpu", "rows", "cases", "worst", "ok"}, or with
    ``"timeout"`` (seconds) or ``"error"`` (the child's last line) when it did not finish."""
    import json
    import os
    import queue
    import signal
    import subprocess
    import sys
    import tempfile
    import threading
    import time
    from pathlib import Path
    timeout = native_timeout() if timeout is None else timeout
    root, env = _child_env()
    out = {"rows": [], "gpu": "this GPU"}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "learner_producer.py").write_text(producer_module_source(producer))
        name = getattr(producer, "fn", producer).__name__
        proc = subprocess.Popen([sys.executable, "-c", _NATIVE_CHILD, tmp, name], cwd=root, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        lines, errors = queue.Queue(), []

        def read(stream, into):
            for ln in stream:
                into(ln.rstrip("\n"))
        readers = [threading.Thread(target=read, args=(proc.stdout, lines.put), daemon=True),
                   threading.Thread(target=read, args=(proc.stderr, errors.append), daemon=True)]
        for r in readers:
            r.start()
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    ln = lines.get(timeout=0.1)
                except queue.Empty:
                    if proc.poll() is not None or not readers[0].is_alive():
                        readers[0].join(timeout=1)             # the child ended: its last lines, then stop
                        if lines.empty():
                            break
                        continue
                    if time.monotonic() > deadline:
                        out["timeout"] = timeout
                        return out
                    continue
                kind, _, body = ln.partition(" ")
                if kind == "START":
                    out.update(json.loads(body))
                elif kind == "ROW":
                    out["rows"].append(json.loads(body))
                    deadline = time.monotonic() + timeout
                elif kind == "DONE":
                    out.update(json.loads(body))
                    return out
        finally:
            try:                                               # the child's session, whatever it started
                os.killpg(proc.pid, signal.SIGKILL)            # (a hang, an interrupted check, a leftover)
            except (ProcessLookupError, PermissionError, AttributeError):
                if proc.poll() is None:
                    proc.kill()
            proc.wait()
            for r in readers:
                r.join(timeout=5)
    tail = [ln for ln in errors if ln.strip()]
    out["error"] = tail[-1] if tail else f"the child process exited with {proc.returncode}"
    return out
