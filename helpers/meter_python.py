"""The meter's numpy and Python-list half: it follows an input's elements out of torch.

``helpers.meter`` sees every torch op through the dispatcher. What leaves torch it cannot see
that way: ``x.tolist()``, ``x.numpy()``, ``np.array(x)``, and what numpy then computes. This module
follows those: while ``following(rec)`` runs,

- ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.__array__`` are wrapped (``_escapes``); a whole
  input becomes a ``_TrackedList`` (reading an element is a load of that element, a slice one load
  of a tile) or a ``_TrackedArray``; a piece of one is a load into SRAM;
- ``np.array``, ``np.asarray`` and ``np.asanyarray`` of a tensor or a followed list give followed
  arrays (``_numpy_constructors``);
- a ``_TrackedArray``'s ufuncs and numpy functions are counted like torch ops: reads of input
  elements, FLOPs (``@``/``dot``, one per element of a pointwise result or of a reduction's input),
  divisions, arrays made (``_FollowsPython.numpy_op``, a part of the meter's recorder).

The recorder (``helpers.meter._Recorder``) holds the provenance and the counts; everything here
reaches it through ``rec`` at run time, so this module imports nothing from the meter.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

_NP_ARRAY = np.array   # numpy's own, while the meter puts a following version in its place

_NP_NO_READ = {"empty_like", "zeros_like", "ones_like", "full_like", "shape", "ndim", "size", "result_type",
               "can_cast", "min_scalar_type", "may_share_memory", "shares_memory"}


class _TrackedList(list):
    """``t.tolist()`` of an input (or a whole copy): reading an element is a load of that element."""

    def __init__(self, values, origin, name, rec):
        super().__init__(values)
        self._origin, self._name, self._rec = origin, name, rec

    def _read(self, i):
        v = list.__getitem__(self, i)
        if isinstance(v, _TrackedList):
            return v
        with self._rec.quiet():
            self._rec.note_read(self._name, torch.tensor([self._origin[i]]), "tolist[i]")
        return v

    def __getitem__(self, i):
        if isinstance(i, slice):   # a tile: one load of its elements, then a plain list (SRAM), read for free
            idx = range(len(self))[i]
            items = [list.__getitem__(self, j) for j in idx]
            origins = _flat_origins([self._origin[j] for j in idx])
            if origins:
                with self._rec.quiet():
                    self._rec.note_read(self._name, torch.tensor(origins), "tolist[a:b]")
            return [_plain(v) for v in items]
        return self._read(i)

    def __iter__(self):
        for i in range(len(self)):
            yield self._read(i)

    def __reversed__(self):
        for i in reversed(range(len(self))):
            yield self._read(i)

    def __contains__(self, v):
        return any(x == v for x in self)

    def copy(self):
        return self[:]


def _flat_origins(origin) -> list:
    out = []
    for o in origin:
        if isinstance(o, list):
            out += _flat_origins(o)
        elif o >= 0:
            out.append(o)
    return out


def _plain(v):
    return [_plain(x) for x in list.__iter__(v)] if isinstance(v, list) else v


def _wrap_list(values, origin, name, rec):
    if isinstance(values, list):
        return _TrackedList([_wrap_list(v, o, name, rec) if isinstance(v, list) else v
                             for v, o in zip(values, origin)], origin, name, rec)
    return values


class _TrackedArray(np.ndarray):
    """A numpy array the meter follows: its ufuncs and functions are counted like torch ops."""

    _rec = None

    def __array_finalize__(self, obj):
        self._tile = getattr(obj, "_tile", None)

    # ---- element access
    def __getitem__(self, key):
        out = super().__getitem__(key)
        rec = _TrackedArray._rec
        if rec is None:
            return out
        if isinstance(out, np.ndarray):
            if out.size and not np.may_share_memory(out, self.view(np.ndarray)):
                # advanced indexing (a[idx], a[mask]) copies: a gather, one load of those elements into SRAM
                with rec.quiet():
                    prov = rec.prov.of_array(self.view(np.ndarray))
                    if prov is not None:
                        idx = torch.from_numpy(np.ascontiguousarray(prov[1].numpy()[_plain_key(key)])).flatten()
                        rec.note_read(prov[0], idx[idx >= 0], "np.ndarray[idx]")
                        rec.note_made(out.size, out.shape, "np.ndarray[idx]")
                out = out.view(_TrackedArray)
                out._tile = rec.new_tile()
                rec.loaded.add(out._tile)      # held in SRAM, made here: reading it again is free
                return out
            out = out.view(_TrackedArray)
            out._tile = self._tile if self._tile is not None else rec.new_tile()
            return out
        with rec.quiet():
            prov = rec.prov.of_array(self.view(np.ndarray))
            if prov is not None:
                idx = prov[1].numpy()[key]
                if idx >= 0:
                    rec.note_read(prov[0], torch.tensor([int(idx)]), "ndarray[i]")
        return out

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def tolist(self):
        rec = _TrackedArray._rec
        plain = self.view(np.ndarray)
        if rec is None:
            return plain.tolist()
        with rec.quiet():
            return rec.to_list(plain, plain.tolist(), rec.prov.of_array(plain), tile=self._tile)

    def item(self, *args):
        if args:
            return self[args if len(args) > 1 else args[0]].item()
        return super().item()

    def astype(self, dtype, *args, **kwargs):
        return _copy_array(self, super().astype(dtype, *args, **kwargs))

    def copy(self, *args, **kwargs):
        return _copy_array(self, super().copy(*args, **kwargs))

    # ---- compute
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        rec = _TrackedArray._rec
        plain = [x.view(np.ndarray) if isinstance(x, _TrackedArray) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, _TrackedArray) else x for x in out)
        if rec is not None:
            rec.depth += 1
        try:
            result = getattr(ufunc, method)(*plain, **kwargs)
        finally:
            if rec is not None:
                rec.depth -= 1
        if rec is not None:
            with rec.quiet():
                rec.numpy_op(f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}"), inputs,
                             result, ufunc=ufunc, method=method)
        return _wrap_result(result, out)

    def __array_function__(self, func, types, args, kwargs):
        rec = _TrackedArray._rec
        if rec is None:
            return super().__array_function__(func, types, args, kwargs)
        before = rec.numpy_events
        rec.depth += 1
        try:
            result = super().__array_function__(func, types, args, kwargs)
        finally:
            rec.depth -= 1
        if rec.numpy_events == before:   # implemented in C: no ufunc inside told us anything
            leaves = [a for a in _np_leaves((args, kwargs)) if isinstance(a, np.ndarray)]
            with rec.quiet():
                rec.numpy_op(f"np.{func.__name__}", leaves, result, func=func)
        return _wrap_result(result, None)


def _plain_key(key):
    """An index with followed arrays in it, as plain numpy (to index the provenance with)."""
    if isinstance(key, tuple):
        return tuple(_plain_key(k) for k in key)
    return key.view(np.ndarray) if isinstance(key, _TrackedArray) else key


def _np_leaves(obj):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _np_leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _np_leaves(x)
    else:
        yield obj


def _wrap_result(result, out):
    if out is not None:
        return result
    if isinstance(result, tuple):
        return tuple(_wrap_result(r, None) for r in result)
    if isinstance(result, np.ndarray) and not isinstance(result, _TrackedArray):
        return result.view(_TrackedArray)
    return result


def _copy_array(src, out):
    rec = _TrackedArray._rec
    if rec is None or out is src:
        return out
    out = out.view(_TrackedArray) if not isinstance(out, _TrackedArray) else out
    with rec.quiet():
        prov = rec.prov.of_array(src.view(np.ndarray))
        if rec.prov.whole(prov):
            rec.prov.add_copy_array(prov[0], prov[1], out.view(np.ndarray))
        elif prov is not None:
            rec.read_array(src, "np.copy")
            rec.note_made(out.size, out.shape, "np.copy")
    return out


class _FollowsPython:
    """The recorder's numpy and Python-list methods (mixed into ``helpers.meter._Recorder``)."""

    def read_array(self, a, op):
        """A numpy op read array a: a load of the input elements it holds (once per numpy tile)."""
        tile = getattr(a, "_tile", None)
        if tile is not None and tile in self.loaded:
            return
        prov = self.prov.of_array(a.view(np.ndarray))
        if prov is None:
            return
        if tile is not None:
            self.loaded.add(tile)
        elems = prov[1].flatten()
        self.note_read(prov[0], elems[elems >= 0], op)

    def numpy_op(self, op, inputs, result, ufunc=None, method=None, func=None):
        if self.depth:
            return
        self.numpy_events += 1
        self.ops[op] += 1
        arrays = [x for x in inputs if isinstance(x, np.ndarray)]
        base = (ufunc.__name__ if ufunc is not None else func.__name__ if func is not None else op)
        read = [] if base in _NP_NO_READ else arrays[1:] if base == "copyto" else arrays
        for a in read:
            self.read_array(a, op)
        outs = [r for r in (result if isinstance(result, tuple) else (result,)) if isinstance(r, np.ndarray)]
        out_size = sum(r.size for r in outs) if outs else 1
        in_size = max((a.size for a in arrays), default=1)
        if base in _NP_NO_READ:
            in_size = 0
        if base in ("matmul", "dot", "inner", "tensordot", "vdot", "einsum") and len(arrays) >= 2:
            a, b = arrays[0], arrays[1]
            k = a.shape[-1] if a.ndim else 1
            self.extra_flops += 2 * max(out_size, 1) * k
        elif method in (None, "__call__") and ufunc is not None:
            self.elementwise_flops += out_size
            self.elementwise[op] += out_size
            if base in ("divide", "true_divide", "floor_divide", "reciprocal"):
                divisor = inputs[-1] if base != "reciprocal" else inputs[0]
                if isinstance(divisor, np.ndarray) and divisor.size > 1:
                    self.divisions += out_size
        else:   # reductions and other functions: one per element read
            self.elementwise_flops += in_size
        for r in outs:
            if r.ndim:
                self.note_made(r.size, r.shape, op)

    # ---- conversions to Python (called by _escapes)
    def to_list(self, source, values, prov, tile=None, tensor=None):
        if self.prov.whole(prov):
            if isinstance(values, list):
                return _wrap_list(values, prov[1].tolist(), prov[0], self)
            self.note_read(prov[0], prov[1].flatten(), "tolist")
            return values
        if tensor is not None:
            entry = self._read_entry(tensor)
            if entry is not None:
                self.events.append(("tolist", [entry], []))
        elif prov is not None:
            self.read_array(source, "tolist")
        return values


@contextlib.contextmanager
def _escapes(rec):
    """Follows a tensor out of torch, into a Python list or a numpy array: ``t.tolist()``,
    ``t.numpy()`` and ``t.__array__()`` are wrapped while the meter runs (a TorchFunctionMode
    would do it too, at the cost of a Python call around every torch op)."""
    names = ("tolist", "numpy", "__array__")
    own = {n: torch.Tensor.__dict__[n] for n in names if n in torch.Tensor.__dict__}
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name, orig):
        def escape(self, *args, **kwargs):
            values = orig(self, *args, **kwargs)
            if rec.off:
                return values
            rec.escapes[name] += 1
            with rec.quiet():
                if name == "tolist":
                    return rec.to_list(None, values, rec.prov.of_tensor(self), tensor=self)
                return _tensor_to_array(rec, self, values)
        escape.__name__ = name
        return escape
    try:
        for n, f in originals.items():
            setattr(torch.Tensor, n, wrap(n, f))
        yield
    finally:
        for n in names:
            if n in own:
                setattr(torch.Tensor, n, own[n])
            else:
                delattr(torch.Tensor, n)


def _tensor_to_array(rec, t, arr):
    """``t.numpy()``: a whole input stays that input; a piece of one is loaded (copied) into SRAM."""
    prov = rec.prov.of_tensor(t)
    if prov is None or rec.prov.whole(prov):
        if prov is not None and arr.__array_interface__["data"][0] != t.data_ptr():
            rec.prov.add_copy_array(prov[0], prov[1], arr)   # __array__(dtype) made a copy
        rec.keep.append(t)
        return arr.view(_TrackedArray)
    if arr.size and rec.prov.of_array(arr) is not None:
        # a piece of an input, sharing its memory: a load when an op reads it (np.zeros_like(piece) reads nothing)
        out = arr.view(_TrackedArray)
        out._tile = rec.new_tile()
        rec.keep.append(t)
        return out
    entry = rec._read_entry(t)
    if entry is not None:
        rec.events.append(("numpy", [entry], []))
    out = np.array(arr).view(_TrackedArray)
    rec.note_made(out.size, out.shape, "np.array")
    return out


@contextlib.contextmanager
def _numpy_constructors(rec):
    """np.array / np.asarray / np.asanyarray of a tensor or a followed list give followed arrays."""
    saved = {n: getattr(np, n) for n in ("array", "asarray", "asanyarray")}

    def make(fname, orig):
        def from_tracked(arr, args, kwargs):
            if fname == "array":
                kwargs["subok"] = True
                res = orig(arr, *args, **kwargs)
                return _copy_array(arr, res) if res is not arr else res
            dtype = args[0] if args else kwargs.get("dtype")
            return arr if dtype is None or np.dtype(dtype) == arr.dtype else arr.astype(dtype)

        def conv(obj, *args, **kwargs):
            if isinstance(obj, torch.Tensor):
                rec.escapes["np." + fname] += 1
                with rec.quiet():
                    arr = _tensor_to_array(rec, obj, obj.detach().cpu().resolve_conj().numpy())
                return from_tracked(arr, args, kwargs)
            if isinstance(obj, _TrackedList) and obj and not isinstance(list.__getitem__(obj, 0), list):
                res = _NP_ARRAY(list(list.__iter__(obj)), *args, **kwargs).view(_TrackedArray)
                with rec.quiet():
                    idx = torch.tensor(obj._origin)
                    if rec.prov.whole((obj._name, idx)):
                        rec.prov.add_copy_array(obj._name, idx, res.view(np.ndarray))
                    else:
                        rec.note_read(obj._name, idx, "np.array(list)")
                return res
            if isinstance(obj, _TrackedArray):
                return from_tracked(obj, args, kwargs)
            return orig(obj, *args, **kwargs)
        return conv
    try:
        for n, f in saved.items():
            setattr(np, n, make(n, f))
        yield
    finally:
        for n, f in saved.items():
            setattr(np, n, f)


@contextlib.contextmanager
def following(rec):
    """While it runs, tensors that leave torch (lists, numpy arrays) are followed and counted by ``rec``."""
    prev = _TrackedArray._rec
    _TrackedArray._rec = rec
    try:
        with _numpy_constructors(rec), _escapes(rec):
            yield
    finally:
        _TrackedArray._rec = prev
