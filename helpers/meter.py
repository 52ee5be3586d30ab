"""The meter: what one call of a function costs, in the CPU model of a GPU.

A GPU kernel keeps its working tiles in SRAM (registers, shared memory) and reads
and writes everything else in HBM. On a CPU we cannot see SRAM, but every torch op
still goes through the dispatcher, so a ``TorchDispatchMode`` sees each op, its
inputs and its outputs. The meter calls a storage "HBM" when it is

- an input of the function (q, k, v, x, ...),
- a tensor the function returns, or
- a buffer the function updates a piece at a time (``O[i:i+Br] = ...``), which is
  exactly what a kernel keeps off-chip between tiles (V1's O, m and l).

Everything else is "SRAM": tiles and temporaries. The meter reports

- ``flops``: from ``torch.utils.flop_counter`` (matrix products: 2·M·N·K each),
- ``largest``: the largest SRAM tensor made (numel, shape, op), which is how the
  checkers catch an N x Nk score matrix,
- ``hbm_read_bytes`` / ``hbm_write_bytes``: bytes of HBM read and written. Taking a
  slice of an HBM tensor (``Qi = q[i:i+Br]``) and then reading it is one *load* of
  that tile: later reads of the same tile (or of views of it, like ``Kj.T``) are
  free, as they would be from SRAM. Slicing again (a new ``q[i:i+Br]`` in the next
  iteration) is a new load. Writing into a slice (``O[i:i+Br] = ...``) is a write
  each time and reads nothing.
- ``reads`` / ``writes``: the same, per named tensor (``q``, ``k``, ``v``, ``out``,
  and ``buffer0``, ``buffer1``, ... for the piecewise-updated buffers),
- ``elementwise``: how many elements each pointwise op touched (``div``, ``exp``...),
- ``ops``: every op name seen, so a checker can spot ``scaled_dot_product_attention``.

Use: ``r = meter.measure(fn, q, k, v, names=("q", "k", "v"))``; ``print(r)``.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["measure", "Measurement", "Largest"]

_aten = torch.ops.aten
# Ops that only make metadata or fresh constant memory: not a read of anything.
_NO_READ = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
            "full", "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "arange",
            "scalar_tensor", "lift_fresh", "detach", "alias", "_to_copy_meta"}
# Ops that fill their (first) argument without reading it.
_FILL = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_"}
_POINTWISE_TAG = torch.Tag.pointwise


@dataclass
class Largest:
    numel: int = 0
    shape: tuple = ()
    op: str = ""

    def __str__(self):
        return f"{list(self.shape)} ({self.numel:,} elements, made by aten.{self.op})" if self.numel else "none"


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

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    def __str__(self):
        def kib(b):
            return f"{b / 1024:,.1f} KiB"
        rows = [f"FLOPs (matmuls)      {self.flops:,}",
                f"largest SRAM tensor  {self.largest}",
                f"HBM read             {kib(self.hbm_read_bytes)}  " +
                ", ".join(f"{k} {kib(v)}" for k, v in self.reads.items()),
                f"HBM written          {kib(self.hbm_write_bytes)}  " +
                ", ".join(f"{k} {kib(v)}" for k, v in self.writes.items())]
        return "\n".join(rows)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last element offset that a (strided) view touches."""
    if t.numel() == 0:
        return (t.storage_offset(), t.storage_offset())
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return (lo, hi + 1)


class _Recorder(TorchDispatchMode):
    """Records, for every op: which storages it read and wrote, and what it made."""

    def __init__(self):
        super().__init__()
        self.events = []      # (op, [(storage_key, bytes, span)] read, [(key, bytes, span, whole)] written)
        self.made = []        # (storage_key, numel, shape, op) for every non-view output
        self.keep = []        # keep storages alive so their data_ptrs are not reused
        self.piecewise = {}  # storage keys written through a strict sub-view, in first-write order
        self.elementwise = Counter()
        self.ops = Counter()
        self.tile_of = {}       # id(view tensor) -> tile number (views of views share it)
        self.loaded = set()     # tile numbers already read once

    def _key(self, t):
        s = t.untyped_storage()
        self.keep.append(t)
        return s.data_ptr() if s.nbytes() else id(s)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if func.is_view:
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            tile = self.tile_of.get(id(src)) if src is not None else None
            if tile is None:
                tile = len(self.tile_of) + 1
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.keep.append(o)
                    self.tile_of[id(o)] = tile if not isinstance(out, (list, tuple)) else len(self.tile_of) + 1
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
        reads, writes = [], []
        for arg_name, t in flat_in:
            key = self._key(t)
            is_written = arg_name in written_args
            if is_written:
                whole = t.numel() * t.element_size() >= t.untyped_storage().nbytes()
                writes.append((key, _bytes(t), _span(t), whole))
                if not whole:
                    self.piecewise.setdefault(key, len(self.piecewise))
            if not is_written or name not in _FILL:
                tile = self.tile_of.get(id(t))
                if tile is not None and tile in self.loaded:
                    continue  # this tile is already in SRAM
                if tile is not None and not is_written:
                    self.loaded.add(tile)
                reads.append((key, _bytes(t), _span(t)))
        if not written_args:  # a functional op: its outputs are new tensors
            outs, _ = tree_flatten(out)
            for o in outs:
                if isinstance(o, torch.Tensor):
                    key = self._key(o)
                    writes.append((key, _bytes(o), _span(o), True))
                    self.made.append((key, o.numel(), tuple(o.shape), name))
                    if _POINTWISE_TAG in func.tags:
                        self.elementwise[name] += o.numel()
        elif _POINTWISE_TAG in func.tags:
            self.elementwise[name] += max((t.numel() for n, t in flat_in if n in written_args), default=0)
        self.events.append((name, reads, writes))
        return out


def _tensor_leaves(obj):
    leaves, _ = tree_flatten(obj)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def measure(fn, *args, names=None, **kwargs) -> Measurement:
    """Call ``fn(*args, **kwargs)`` once and measure it (see the module docstring).

    ``names`` names the positional tensor arguments (default: ``x0, x1, ...``).
    The arguments are passed as given: pass copies if ``fn`` may change them.
    """
    rec = _Recorder()
    hbm = {}  # storage key -> name
    tensor_args = [a for a in args if isinstance(a, torch.Tensor)]
    names = list(names) if names is not None else [f"x{i}" for i in range(len(tensor_args))]
    for nm, t in zip(names, tensor_args):
        hbm.setdefault(rec._key(t), nm)
    flop_mode = FlopCounterMode(display=False)
    with flop_mode, rec:
        result = fn(*args, **kwargs)
    outs = _tensor_leaves(result)
    for i, o in enumerate(outs):
        hbm.setdefault(rec._key(o), "out" if len(outs) == 1 else f"out{i}")
    for j, key in enumerate(k for k in rec.piecewise if k not in hbm):
        hbm[key] = f"buffer{j}"

    m = Measurement(flops=int(flop_mode.get_total_flops()), elementwise=rec.elementwise, ops=rec.ops)
    reads, writes, ranges = defaultdict(int), defaultdict(int), defaultdict(list)
    for _name, rd, wr in rec.events:
        for key, nbytes, span in rd:
            if key in hbm:
                reads[hbm[key]] += nbytes
                ranges[hbm[key]].append(span)
        for key, nbytes, span, _whole in wr:
            if key in hbm:
                writes[hbm[key]] += nbytes
    for key, numel, shape, op in rec.made:
        if key not in hbm and numel > m.largest.numel:
            m.largest = Largest(numel, shape, op)
    m.reads, m.writes, m.read_ranges = dict(reads), dict(writes), dict(ranges)
    m.hbm_read_bytes, m.hbm_write_bytes = sum(reads.values()), sum(writes.values())
    return m
