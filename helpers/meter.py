"""The meter: what one call of a function costs, in the CPU model of a GPU.

A GPU kernel keeps its working tiles in SRAM (registers, shared memory) and reads
and writes everything else in HBM. On a CPU we cannot see SRAM, but every torch op
still goes through the dispatcher, so a ``TorchDispatchMode`` sees each op, its
inputs and its outputs. The meter calls memory "HBM" when it is

- an input of the function (q, k, v, x, ...), or a whole copy of one: ``q.double()``,
  ``k.T.contiguous()``, ``x.tolist()``, ``x.numpy()`` hold q's, k's, x's elements, so
  reading them is reading the input (the meter follows each element through copies,
  casts, numpy arrays and Python lists: its *provenance*),
- a tensor the function returns, or
- a buffer the function updates a piece at a time (``O[i:i+Br] = ...``), which is
  exactly what a kernel keeps off-chip between tiles (V1's O, m and l).

Everything else is "SRAM": tiles and temporaries. Copying a *piece* of an input
(``k[j:j+Bc].double()``) is a load of that tile into SRAM. The meter reports

- ``flops``: matrix-product FLOPs from ``torch.utils.flop_counter`` (2·M·N·K each; the
  meter adds ``mv`` and ``dot``, which it does not count), plus numpy's ``@``/``dot``;
- ``elementwise_flops``: one per element made by a pointwise op (``mul``, ``exp``,
  ``where``...) and one per element read by a reduction (``sum``, ``amax``...), in torch
  and numpy: a score tile computed as ``(Qi[:, None] * Kj[None]).sum(-1)`` costs the same
  2·Br·Bc·d here as ``Qi @ Kj.T`` does in ``flops``;
- ``largest``: the largest SRAM tensor or numpy array made (numel, shape, op), which is
  how the checkers catch an N x Nk score matrix;
- ``hbm_read_bytes`` / ``hbm_write_bytes``: bytes of HBM read and written. Taking a
  slice of an HBM tensor (``Qi = q[i:i+Br]``) and then reading it is one *load* of
  that tile: later reads of the same tile (or of views of it, like ``Kj.T``) are
  free, as they would be from SRAM. Slicing again (a new ``q[i:i+Br]`` in the next
  iteration) is a new load. Writing into a slice (``O[i:i+Br] = ...``) is a write
  each time and reads nothing. Bytes of an input are counted in the input's dtype.
- ``reads`` / ``writes``: the same, per named tensor (``q``, ``k``, ``v``, ``out``,
  and ``buffer0``, ``buffer1``, ... for the piecewise-updated buffers),
- ``read_ranges`` / ``read_sizes`` / ``read_elements``: per input, each load's (first,
  last+1) element, its number of elements and the elements themselves, in order; ``element_reads``: per input, how many times each
  element was loaded (2 everywhere is a second pass);
- ``divisions``: elements produced by dividing by a tensor of more than one element
  (``acc / l[:, None]``, ``1 / l``): dividing by a constant (``S / math.sqrt(d)``) is not
  counted;
- ``noop_masks``: masks applied to a 2-D tile that change nothing (``masked_fill`` with an
  all-False mask, ``where`` with an all-True condition, adding ``torch.log(keep.float())`` or
  multiplying by ``keep`` where keep is all True);
- ``elementwise``: how many elements each pointwise op made (``div``, ``exp``...),
- ``ops``: every op name seen, so a checker can spot ``scaled_dot_product_attention``;
  ``escapes``: conversions to Python or numpy (``tolist``, ``numpy``...).

Use: ``r = meter.measure(fn, q, k, v, names=("q", "k", "v"))``; ``print(r)``.

This file follows torch ops; ``helpers/meter_python.py`` follows what leaves torch (``.tolist()``,
``.numpy()``, numpy arrays and their ops) for the same recorder.

What the provenance cannot follow (Python floats, a list of a whole row) the working memory
catches: ``working_memory(fn, ...)`` (``torch_peak`` and ``python_peak``, one call each) gives
the peak elements of the torch tensors alive at once and, through ``tracemalloc``, the peak of
numpy arrays and Python objects (8 bytes to an element; a Python float in a list costs 4).
``helpers.checking.Grader.check_memory`` holds a call to an exercise's budget with it.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import sys
import tracemalloc
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from .meter_python import _FollowsPython, following

__all__ = ["measure", "Measurement", "Largest", "working_memory", "torch_peak", "python_peak", "Memory"]

_aten = torch.ops.aten
# Ops that only make metadata or fresh constant memory: not a read of anything.
_NO_READ = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
            "full", "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "arange",
            "scalar_tensor", "lift_fresh", "detach", "alias", "_to_copy_meta"}
# Ops that fill their (first) argument without reading it.
_FILL = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_"}
# Ops that copy their input as it is (maybe in another dtype or layout): a whole copy of an input is that input.
_COPY = {"_to_copy", "clone", "copy_"}
# Not marked as views, but their output shares the input's memory (reshape after a copy).
_VIEW_LIKE = {"_unsafe_view"}
_POINTWISE_TAG = torch.Tag.pointwise
_REDUCTION_TAG = torch.Tag.reduction
_REDUCTIONS = {"_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
_DIVISIONS = {"div", "div_", "true_divide", "true_divide_", "reciprocal", "reciprocal_"}
# numpy functions that look at an array's shape and dtype only, like torch's ``zeros_like``: not a read
# tensors made from a bool mask (``keep.float()``, ``torch.log(keep.float())``) stay "mask-like" through these
_MASK_FOLLOW = {"_to_copy", "log", "neg", "mul", "sub", "add", "where", "masked_fill", "logical_not", "bitwise_not",
                "clone", "expand", "unsqueeze", "view", "reshape", "_unsafe_view", "slice", "select", "t",
                "transpose", "permute", "rsub"}


def _mv_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1]


def _dot_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0]


def _addmv_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1]


# torch's flop counter counts mm/bmm/addmm/baddbmm (and attention kernels), not a matrix times a vector
_EXTRA_FLOPS = {_aten.mv: _mv_flops, _aten.dot: _dot_flops, _aten.vdot: _dot_flops, _aten.addmv: _addmv_flops}


@dataclass
class Largest:
    numel: int = 0
    shape: tuple = ()
    op: str = ""

    @property
    def made_by(self) -> str:
        """The op that made it: ``aten.mm``, or ``np.matmul`` for a numpy array."""
        return self.op if self.op.startswith("np.") else f"aten.{self.op}"

    def __str__(self):
        if not self.numel:
            return "none"
        return f"{list(self.shape)} ({self.numel:,} elements, made by {self.made_by})"


@dataclass
class Measurement:
    flops: int = 0
    largest: Largest = field(default_factory=Largest)
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    reads: dict = field(default_factory=dict)       # name -> bytes read
    writes: dict = field(default_factory=dict)      # name -> bytes written
    read_ranges: dict = field(default_factory=dict)  # name -> [(first, last+1) element offsets] in order
    elementwise: Counter = field(default_factory=Counter)  # op name -> elements produced
    ops: Counter = field(default_factory=Counter)   # op name -> calls
    elementwise_flops: int = 0                      # pointwise elements made + reduction elements read
    divisions: int = 0                              # elements divided by a tensor of > 1 element
    read_sizes: dict = field(default_factory=dict)  # input name -> [elements of each load] in order
    read_elements: dict = field(default_factory=dict)  # input name -> [int64 tensor: elements of each load]
    element_reads: dict = field(default_factory=dict)  # input name -> int64 tensor: loads of each element
    noop_masks: int = 0                             # tile masks that changed nothing
    escapes: Counter = field(default_factory=Counter)  # "tolist", "numpy", ... -> calls

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def total_flops(self) -> int:
        """Matmul FLOPs plus elementwise FLOPs."""
        return self.flops + self.elementwise_flops

    def passes(self, name) -> int:
        """The most times any element of input ``name`` was loaded (1: one pass; 0: never read)."""
        t = self.element_reads.get(name)
        return int(t.max()) if t is not None and t.numel() else 0

    def __str__(self):
        def kib(b):
            return f"{b / 1024:,.1f} KiB"
        rows = [f"FLOPs (matmuls)      {self.flops:,}",
                f"FLOPs (elementwise)  {self.elementwise_flops:,}",
                f"largest SRAM tensor  {self.largest}",
                f"HBM read             {kib(self.hbm_read_bytes)}  " +
                ", ".join(f"{k} {kib(v)}" for k, v in self.reads.items()),
                f"HBM written          {kib(self.hbm_write_bytes)}  " +
                ", ".join(f"{k} {kib(v)}" for k, v in self.writes.items()),
                f"divisions by a tensor {self.divisions:,} elements"]
        return "\n".join(rows)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _extent(shape, strides) -> tuple[int, int] | None:
    """(first, one-past-last) element offset, relative to its start, that a strided view touches; None if empty."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return None
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + 1


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last element offset in its storage that a tensor touches."""
    off, ext = t.storage_offset(), _extent(t.shape, t.stride())
    return (off, off) if ext is None else (off + ext[0], off + ext[1])


# ------------------------------------------------------------------ provenance
@dataclass
class _Region:
    """Memory that holds an input's elements: the input itself, or a whole copy of it.

    ``origin[e]`` is the input element (flat index) held by element ``e`` of the memory
    starting at address ``base``, or -1.
    """
    name: str
    base: int
    nbytes: int
    itemsize: int
    origin: torch.Tensor   # int64 [nbytes // itemsize]
    keep: object = None    # the owner of the memory, kept alive so the address is not reused


class _Provenance:
    """Which input element each element of a tensor, array or list holds."""

    def __init__(self):
        self.regions: list[_Region] = []
        self.numel: dict = {}      # input name -> numel
        self.itemsize: dict = {}   # input name -> bytes per element (the input's dtype)

    def add_input(self, name, t: torch.Tensor):
        self.numel[name] = t.numel()
        self.itemsize[name] = t.element_size()
        st = t.untyped_storage()
        n = st.nbytes() // t.element_size()
        origin = torch.full((n,), -1, dtype=torch.int64)
        if t.numel():
            origin.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(
                torch.arange(t.numel()).reshape(t.shape))
        self.regions.append(_Region(name, st.data_ptr(), st.nbytes(), t.element_size(), origin, t))

    def _find(self, addr, itemsize, shape, strides_el):
        if not self.regions or addr == 0:
            return None
        span = _extent(shape, strides_el)
        if span is None:
            return None
        for r in reversed(self.regions):
            if r.itemsize != itemsize or not (r.base <= addr < r.base + r.nbytes):
                continue
            off, rem = divmod(addr - r.base, itemsize)
            if rem or off + span[0] < 0 or off + span[1] > r.origin.numel():
                continue
            return r, off
        return None

    def of_tensor(self, t: torch.Tensor):
        """(name, int64 tensor of t's shape: input element per element, -1 where none) or None."""
        if not isinstance(t, torch.Tensor) or t.is_sparse or t.device.type == "meta" or t.numel() == 0:
            return None
        try:
            addr = t.data_ptr()
        except RuntimeError:
            return None
        hit = self._find(addr, t.element_size(), t.shape, t.stride())
        if hit is None:
            return None
        r, off = hit
        return r.name, r.origin.as_strided(t.shape, t.stride(), off)

    def of_array(self, a: np.ndarray):
        if not isinstance(a, np.ndarray) or a.size == 0 or a.dtype.hasobject:
            return None
        itemsize = a.itemsize
        if any(s % itemsize for s in a.strides):
            return None
        strides_el = tuple(s // itemsize for s in a.strides)
        hit = self._find(a.__array_interface__["data"][0], itemsize, a.shape, strides_el)
        if hit is None:
            return None
        r, off = hit
        o = r.origin.numpy()
        idx = np.lib.stride_tricks.as_strided(o[off:], shape=a.shape, strides=tuple(s * 8 for s in strides_el))
        return r.name, torch.from_numpy(np.array(idx))

    def whole(self, prov) -> bool:
        """True when ``prov`` holds every element of its input exactly once."""
        if prov is None:
            return False
        name, idx = prov
        n = self.numel.get(name, -1)
        return idx.numel() == n and bool((idx >= 0).all()) and torch.unique(idx).numel() == n

    def add_copy_tensor(self, name, idx, out: torch.Tensor):
        st = out.untyped_storage()
        n = st.nbytes() // out.element_size()
        origin = torch.full((n,), -1, dtype=torch.int64)
        origin.as_strided(out.shape, out.stride(), out.storage_offset()).copy_(idx.reshape(out.shape))
        self.regions.append(_Region(name, st.data_ptr(), st.nbytes(), out.element_size(), origin, out))

    def add_copy_array(self, name, idx, out: np.ndarray):
        base = out.base if out.base is not None and isinstance(out.base, np.ndarray) else out
        flat = np.full(out.size, -1, dtype=np.int64)
        # a fresh copy is contiguous (C or F order); place the origin in its memory order
        order = "F" if out.flags.f_contiguous and not out.flags.c_contiguous else "C"
        flat[:] = idx.reshape(out.shape).numpy().ravel(order=order)
        self.regions.append(_Region(name, out.__array_interface__["data"][0], out.nbytes, out.itemsize,
                                    torch.from_numpy(flat), (out, base)))


class _Recorder(_FollowsPython, TorchDispatchMode):
    """Records, for every op: which storages it read and wrote, and what it made."""

    def __init__(self):
        super().__init__()
        self.events = []      # (op, reads, writes); a read: (storage_key, bytes, span, input name, elements)
        self.made = []        # (storage_key, numel, shape, op) for every non-view output
        self.keep = []        # keep storages alive so their data_ptrs are not reused
        self.piecewise = {}  # storage keys written through a strict sub-view, in first-write order
        self.elementwise = Counter()
        self.elementwise_flops = 0
        self.extra_flops = 0  # numpy matmuls
        self.divisions = 0
        self.noop_masks = 0
        self.maskish = set()    # ids of tensors made from a bool mask (kept alive in self.keep)
        self.ops = Counter()
        self.escapes = Counter()
        self.tile_of = {}       # id(view tensor) -> tile number (views of views share it)
        self.loaded = set()     # tile numbers already read once
        self.tiles = 0
        self.prov = _Provenance()
        self.depth = 0          # > 0 inside a numpy function: its ufuncs are counted, not the function
        self.numpy_events = 0
        self.off = 0            # > 0 while the meter's own bookkeeping runs torch ops: not recorded

    @contextlib.contextmanager
    def quiet(self):
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1

    def new_tile(self):
        self.tiles += 1
        return -self.tiles   # numpy tiles: negative numbers, so they never meet torch's

    def _key(self, t):
        s = t.untyped_storage()
        self.keep.append(t)
        return s.data_ptr() if s.nbytes() else id(s)

    # ---- reads and things made, from any source
    def note_read(self, name, elems, op, key=None, nbytes=0, span=(0, 0)):
        self.events.append((op, [(key, nbytes, span, name, elems)], []))

    def note_made(self, numel, shape, op, key=None):
        self.made.append((key, int(numel), tuple(shape), op))

    def _read_entry(self, t, tile_owner=None):
        """The read of tensor t, or None when t is a tile already in SRAM."""
        tile = self.tile_of.get(id(t))
        if tile is not None and tile in self.loaded:
            return None
        if tile is not None:
            self.loaded.add(tile)
        prov = self.prov.of_tensor(t)
        name, elems = (prov[0], prov[1].flatten()) if prov is not None else (None, None)
        if elems is not None:
            elems = elems[elems >= 0]
        return (self._key(t), _bytes(t), _span(t), name, elems)

    # ---- torch ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.off:
            return out
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if func.is_view or name in _VIEW_LIKE:
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            tile = self.tile_of.get(id(src)) if src is not None else None
            if tile is None:
                tile = len(self.tile_of) + 1
            maskish = src is not None and (src.dtype == torch.bool or id(src) in self.maskish)
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.keep.append(o)
                    self.tile_of[id(o)] = tile if not isinstance(out, (list, tuple)) else len(self.tile_of) + 1
                    if maskish:
                        self.maskish.add(id(o))
            return out
        if name in _NO_READ:
            return out
        schema = func._schema
        written_args = set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                written_args.add(a.name)
        flat_in = []
        for i, a in enumerate(schema.arguments):
            val = args[i] if i < len(args) else kwargs.get(a.name)
            leaves, _ = tree_flatten(val)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    flat_in.append((a.name, leaf))
        if name in _COPY and self._whole_copy(name, flat_in, written_args, out):
            return out
        reads, writes = [], []
        for arg_name, t in flat_in:
            is_written = arg_name in written_args
            if is_written:
                key = self._key(t)
                whole = t.numel() * t.element_size() >= t.untyped_storage().nbytes()
                writes.append((key, _bytes(t), _span(t), whole))
                if not whole:
                    self.piecewise.setdefault(key, len(self.piecewise))
            if not is_written or name not in _FILL:
                entry = self._read_entry(t)
                if entry is not None:
                    reads.append(entry)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not written_args:  # a functional op: its outputs are new tensors
            for o in outs:
                key = self._key(o)
                writes.append((key, _bytes(o), _span(o), True))
                self.made.append((key, o.numel(), tuple(o.shape), name))
        produced = sum(o.numel() for o in outs) if not written_args else \
            max((t.numel() for n, t in flat_in if n in written_args), default=0)
        if _POINTWISE_TAG in func.tags:
            self.elementwise[name] += produced
            self.elementwise_flops += produced
        elif _REDUCTION_TAG in func.tags or name in _REDUCTIONS:
            self.elementwise_flops += max((t.numel() for n, t in flat_in if n not in written_args), default=0)
        if name in _DIVISIONS:
            divisor = [t for n, t in flat_in if n == ("other" if "div" in name else "self")]
            if divisor and divisor[0].numel() > 1:
                self.divisions += produced
        if name in ("masked_fill", "masked_fill_", "where", "index_put", "index_put_"):
            self._noop_mask(name, args, kwargs)
        self._bias_mask(name, flat_in, outs)
        self.events.append((name, reads, writes))
        return out

    def _whole_copy(self, name, flat_in, written_args, out) -> bool:
        """A copy of a whole input (or of a whole copy of one): register it as that input; no read."""
        srcs = [t for n, t in flat_in if n not in written_args]
        if len(srcs) != 1:
            return False
        prov = self.prov.of_tensor(srcs[0])
        if not self.prov.whole(prov):
            return False
        dst = [t for n, t in flat_in if n in written_args] if written_args else \
            [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if len(dst) != 1 or dst[0].numel() != srcs[0].numel():
            return False
        self.keep.append(dst[0])
        self.prov.add_copy_tensor(prov[0], prov[1], dst[0])
        self.events.append((name, [], []))
        return True

    def _bias_mask(self, name, flat_in, outs):
        """A mask applied as arithmetic: ``S + torch.log(keep.float())`` or ``P * keep`` on a tile where keep is
        all True adds 0 (multiplies by 1) everywhere, a mask that changes nothing. Tensors made from a bool
        tensor are followed (``self.maskish``) through casts, logs and sums."""
        ins = [t for _n, t in flat_in]
        if any(t.dtype == torch.bool or id(t) in self.maskish for t in ins) and name in _MASK_FOLLOW:
            for o in outs:
                self.keep.append(o)
                self.maskish.add(id(o))
        if name not in ("add", "add_", "sub", "sub_", "mul", "mul_") or len(ins) < 2:
            return
        a, b = ins[0], ins[1]
        for tile, bias in ((a, b), (b, a)):
            if (id(bias) in self.maskish and bias.dtype != torch.bool and id(tile) not in self.maskish
                    and tile.dtype.is_floating_point and bias.dim() == 2 and bias.shape[0] >= 1
                    and bias.shape[1] > 1):
                neutral = 1.0 if name.startswith("mul") else 0.0
                if bool((bias == neutral).all()):
                    self.noop_masks += 1
                return

    def _noop_mask(self, name, args, kwargs):
        bools = [t for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() == 2
                 and t.shape[0] >= 1 and t.shape[1] > 1]
        if bools:
            b = bools[0]
            self.noop_masks += int(bool(b.all()) if name == "where" else not bool(b.any()))


def _tensor_leaves(obj):
    leaves, _ = tree_flatten(obj)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def measure(fn, *args, names=None, **kwargs) -> Measurement:
    """Call ``fn(*args, **kwargs)`` once and measure it (see the module docstring).

    ``names`` names the positional tensor arguments (default: ``x0, x1, ...``).
    The arguments are passed as given: pass copies if ``fn`` may change them.
    """
    rec = _Recorder()
    hbm = {}  # storage key -> name (outputs and piecewise buffers; inputs are followed by provenance)
    tensor_args = [a for a in args if isinstance(a, torch.Tensor)]
    names = list(names) if names is not None else [f"x{i}" for i in range(len(tensor_args))]
    for nm, t in zip(names, tensor_args):
        hbm.setdefault(rec._key(t), nm)
        rec.prov.add_input(nm, t)
    flop_mode = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS)
    with following(rec), flop_mode, rec:
        result = fn(*args, **kwargs)
    outs = _tensor_leaves(result)
    for i, o in enumerate(outs):
        hbm.setdefault(rec._key(o), "out" if len(outs) == 1 else f"out{i}")
    for j, key in enumerate(k for k in rec.piecewise if k not in hbm):
        hbm[key] = f"buffer{j}"
    inputs = set(rec.prov.numel)

    m = Measurement(flops=int(flop_mode.get_total_flops()) + rec.extra_flops, elementwise=rec.elementwise,
                    ops=rec.ops, elementwise_flops=rec.elementwise_flops, divisions=rec.divisions,
                    noop_masks=rec.noop_masks, escapes=rec.escapes)
    reads, writes, ranges, sizes, loads = (defaultdict(int), defaultdict(int), defaultdict(list), defaultdict(list),
                                           defaultdict(list))
    counts = {nm: torch.zeros(n, dtype=torch.int64) for nm, n in rec.prov.numel.items()}
    for _name, rd, wr in rec.events:
        for key, nbytes, span, name, elems in rd:
            if name is not None:       # an input's elements, wherever they were copied to
                if elems is None or elems.numel() == 0:
                    continue
                reads[name] += elems.numel() * rec.prov.itemsize[name]
                ranges[name].append((int(elems.min()), int(elems.max()) + 1))
                sizes[name].append(int(elems.numel()))
                loads[name].append(elems)
                counts[name].index_add_(0, elems, torch.ones_like(elems))
            elif key in hbm and hbm[key] not in inputs:
                reads[hbm[key]] += nbytes
                ranges[hbm[key]].append(span)
        for key, nbytes, span, _whole in wr:
            if key in hbm:
                writes[hbm[key]] += nbytes
    for key, numel, shape, op in rec.made:
        if (key is None or key not in hbm) and numel > m.largest.numel:
            m.largest = Largest(numel, shape, op)
    m.reads, m.writes, m.read_ranges = dict(reads), dict(writes), dict(ranges)
    m.read_sizes, m.read_elements, m.element_reads = dict(sizes), dict(loads), counts
    m.hbm_read_bytes, m.hbm_write_bytes = sum(reads.values()), sum(writes.values())
    return m


# ------------------------------------------------------------------ working memory
@dataclass
class Memory:
    """The peak working memory of one call, in elements (see ``working_memory``)."""
    torch_peak: int = 0     # elements of torch tensors made by the call and alive at once, at the peak
    python_peak: int = 0    # bytes of Python objects and numpy arrays (tracemalloc), at the peak, / 8
    input_lists: int = 0    # of which ``.tolist()`` of a whole input (the meter follows those), bytes / 8
    triton: bool = False    # a Triton kernel ran (interpreted on a CPU: its Python memory is the interpreter's)
    torch_largest: Largest = field(default_factory=Largest)

    def __str__(self):
        return (f"torch tensors {self.torch_peak:,} elements at the peak; numpy arrays and Python objects "
                f"{self.python_peak * 8 / 1024:,.1f} KiB at the peak")


class _Live(TorchDispatchMode):
    """Counts the elements of the tensors an op makes while any tensor of that storage is alive."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.storages = {}   # data_ptr -> [live tensors, elements]
        self.refs = {}       # id(tensor) -> weak reference whose callback releases its storage
        self.live = self.peak = 0
        self.largest = Largest()

    def _release(self, ptr):
        entry = self.storages.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self.storages[ptr]
            self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ():
            if not isinstance(o, torch.Tensor) or o.is_sparse or o.device.type == "meta":
                continue
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            ptr = st.data_ptr()
            if not ptr or ptr in self.inputs:
                continue
            entry = self.storages.get(ptr)
            if entry is None:
                n = st.nbytes() // max(o.element_size(), 1)
                entry = self.storages[ptr] = [0, n]
                self.live += n
                if n > self.largest.numel:
                    self.largest = Largest(n, tuple(o.shape), func.overloadpacket.__name__)
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            self.refs[id(o)] = weakref.ref(o, functools.partial(self._dead, id(o), ptr))
        return out

    def _dead(self, key, ptr, _ref):
        self.refs.pop(key, None)
        self._release(ptr)


def working_memory(fn, *args, **kwargs) -> Memory:
    """Call ``fn(*args, **kwargs)`` twice and return the peak of its working memory (a ``Memory``).

    Once under a light dispatch mode that counts torch tensors (``torch_peak``), once under
    ``tracemalloc`` alone for numpy arrays and Python objects (``python_peak``): each way adds noise
    to the other's count. The arguments are passed as given (pass copies if ``fn`` may change them).
    """
    elements, largest = torch_peak(fn, *args, **kwargs)
    mem = python_peak(fn, *args, **kwargs)
    mem.torch_peak, mem.torch_largest = elements, largest
    return mem


def torch_peak(fn, *args, **kwargs):
    """(elements, Largest): the most elements of torch tensors made by one call of ``fn`` alive at once.

    A tensor's storage counts from the op that made it until the last tensor of it is gone; the
    arguments' own storages do not count.
    """
    mode = _Live(_tensor_leaves((args, kwargs)))
    with mode:
        result = fn(*args, **kwargs)
    del result
    return mode.peak, mode.largest


def python_peak(fn, *args, **kwargs) -> Memory:
    """A ``Memory`` with ``python_peak``: ``tracemalloc``'s peak during one call of ``fn`` (numpy reports
    its arrays to it), in units of 8 bytes (one float64; a Python float in a list costs 4).

    ``x.tolist()`` of a tensor as large as an argument is counted apart in ``input_lists`` (the meter
    follows it as that input itself). Iterating a tensor yields its rows one at a time here (torch's
    own ``__iter__`` unbinds them all first: a Python object per row at once, the learner's loop
    holds one). A Triton kernel launched (interpreted) sets ``triton``.
    """
    whole = {t.numel() for t in _tensor_leaves((args, kwargs))}
    state = {"lists": 0, "triton": False}
    orig_tolist = torch.Tensor.tolist
    own_iter = torch.Tensor.__dict__.get("__iter__")

    def lazy_iter(self):
        if self.dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        for i in range(self.shape[0]):
            yield self[i]

    def tolist(self, *a, **k):
        before = tracemalloc.get_traced_memory()[0]
        values = orig_tolist(self, *a, **k)
        if self.numel() in whole:
            state["lists"] += max(tracemalloc.get_traced_memory()[0] - before, 0)
        return values

    class _Counted(np.ndarray):           # x.numpy().tolist() counts like x.tolist()
        def tolist(self):
            before = tracemalloc.get_traced_memory()[0]
            values = self.view(np.ndarray).tolist()
            if self.size in whole:
                state["lists"] += max(tracemalloc.get_traced_memory()[0] - before, 0)
            return values

    def numpy(self, *a, **k):
        return orig_numpy(self, *a, **k).view(_Counted)
    orig_numpy = torch.Tensor.numpy
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    threshold = gc.get_threshold()
    gc.set_threshold(100, *threshold[1:])   # cyclic garbage waits less for collection: less noise in the peak
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    torch.Tensor.tolist, torch.Tensor.__iter__, torch.Tensor.numpy = tolist, lazy_iter, numpy
    grid = _triton_grid()
    grid_call = grid.__call__ if grid is not None else None
    if grid is not None:
        def launch(self, *a, **k):
            state["triton"] = True
            return grid_call(self, *a, **k)
        grid.__call__ = launch
    try:
        result = fn(*args, **kwargs)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        gc.set_threshold(*threshold)
        if grid is not None:
            grid.__call__ = grid_call
        del torch.Tensor.tolist, torch.Tensor.numpy
        if own_iter is not None:
            torch.Tensor.__iter__ = own_iter
        else:
            del torch.Tensor.__iter__
        if not was_tracing:
            tracemalloc.stop()
    del result
    return Memory(python_peak=max(peak, 0) // 8, input_lists=state["lists"] // 8, triton=state["triton"])


def _triton_grid():
    """Triton's interpreter launcher (``GridExecutor``), when Triton is already imported; else None."""
    interp = sys.modules.get("triton.runtime.interpreter")
    return getattr(interp, "GridExecutor", None)
