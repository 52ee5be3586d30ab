"""Lesson 09, ring attention: the course's launcher and the plain functions behind the plots.

The launcher runs a learner's ``ring_attention`` on real ``torch.distributed`` processes
(gloo, 127.0.0.1), one per rank:

- ``run_ring(fn, q, k, v, world_size, causal=False, layout="contiguous", backend="gloo")
  -> (O, lse)``: lays the global ``[B, H, N, d]`` tensors out over the ranks, starts the
  process group, calls ``fn(q_r, k_r, v_r, causal=..., layout=...)`` on every rank and
  gathers ``O`` and ``lse`` back into global order.
- ``launch(fn, jobs, world_size)``: the same for several inputs in one process group (the
  checker uses it: starting processes is the expensive part), returning per rank what
  ``fn`` returned and what the launcher measured (``RankStats``).

How a function gets to the workers. A function defined in a notebook cell cannot be
pickled by reference (the workers have no such ``__main__``). The launcher ships its
*source* (``inspect.getsource``; IPython registers every cell's source in ``linecache``),
the source of every function of the same notebook or module that it calls, and one line
per other global it uses (``import torch.distributed as dist``, ``from helpers.lesson09
import chunk_attention``, ``TILE = 4``). Each worker compiles them under their original
file name and line numbers, so a traceback points at the learner's cell. This works with
every start method; the default is ``forkserver`` with torch preloaded on Linux (a fork
of a clean server: no second ``import torch`` per rank) and ``spawn`` on macOS (fork is
unsafe there once system frameworks are loaded). ``COURSE_RING_START`` overrides it.

Failures. A rank that raises, dies or does not finish an input within ``timeout`` seconds
ends the whole run: every worker is killed (terminate, then kill) and joined before
``RingError`` is raised, naming the rank(s), the input, the learner's line, and for a hang
the point-to-point operation each rank was blocked in. No process outlives a call.

What is measured, per rank and per input (``RankStats``), and how:

- bytes sent and received: the launcher wraps the process group's ``send``/``recv``, the
  calls under ``dist.send``, ``dist.isend``, ``dist.batch_isend_irecv`` and their ``recv``
  counterparts: the bytes of the tensors handed to them (payload, not wire bytes);
- collectives (``all_gather``, ``broadcast``, ...): their names and bytes, likewise;
- peak K/V chunks held: the most bytes of K/V data alive at once among the tensors the
  function *made* (receive buffers, copies, concatenations of K/V; its input k and v are
  not counted, as the caller holds them anyway), divided by the bytes of this rank's own
  ``k`` and ``v``. A double-buffered ring holds 2 (the chunk in hand, the one in flight). Copies in
  another dtype (``k.double()`` for the math) count in the chunk's own dtype, and one chunk's worth of
  them is compute, not a held chunk;
- matmul FLOPs (``torch.utils.flop_counter``), from which the causal work per rank;
- the peer of every send and receive, the dtypes sent, and per receive the matmul FLOPs done between
  posting it and the first wait after (0 everywhere: no overlap of transfer and compute);
- bytes of K/V taken out of torch (``.numpy()``, ``.tolist()``), which nothing above could count.

References: Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers" (2023);
Brandon et al., "Striped Attention" (2023) and the zigzag layout of Llama 3's context
parallelism (Meta, "The Llama 3 Herd of Models", 2024); Jacobs et al., "DeepSpeed
Ulysses" (2023).
"""
from __future__ import annotations

import datetime
import inspect
import io
import linecache
import math
import multiprocessing
import os
import re
import socket
import sys
import textwrap
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait as _wait_any

import torch

from .results import RING, gpu_results_table, load_gpu_results

__all__ = ["run_ring", "launch", "RingError", "RankStats", "shard", "unshard", "chunks_of_rank",
           "check_layout", "chunk_attention", "merge_reference", "ring_schedule", "plot_schedule",
           "kv_bytes", "activation_bytes", "plot_memory", "step_times", "plot_overlap",
           "load_gpu_results", "gpu_results_table", "H200_HBM_BYTES", "H200_BF16_FLOPS",
           "NVLINK_BYTES_PER_S", "START_METHOD_ENV", "GPU_RESULTS"]

LAYOUTS = ("contiguous", "zigzag")
START_METHOD_ENV = "COURSE_RING_START"
H200_HBM_BYTES = 141e9            # NVIDIA's datasheet (HBM3e)
H200_BF16_FLOPS = 989e12          # dense BF16, datasheet
NVLINK_BYTES_PER_S = 450e9        # NVLink 4 on an H200: 900 GB/s both directions, one direction here
GPU_RESULTS = str(RING)            # bench/results/ring_h200x2.json (helpers/results.py reads it)


class RingError(RuntimeError):
    """A run of ``fn`` on the ranks failed: ``str(e)`` names the rank(s); ``e.hint`` says what to look at."""

    def __init__(self, message, *, ranks=(), job=None, kind="", hint="", details=""):
        super().__init__(message)
        self.ranks, self.job, self.kind, self.hint, self.details = list(ranks), job, kind, hint, details


class RingNotImplemented(NotImplementedError):
    """The function on the ranks still raises NotImplementedError (the stub)."""


# ---------------------------------------------------------------------------- layouts
def check_layout(N: int, world_size: int, layout: str) -> int:
    """Validate; return the number of chunks the sequence is cut into (P or 2P)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    n_chunks = world_size if layout == "contiguous" else 2 * world_size
    if N % n_chunks:
        raise ValueError(f"N = {N} does not split evenly: the {layout} layout over {world_size} ranks cuts the "
                         f"sequence into {n_chunks} equal chunks, so N must be a multiple of {n_chunks}")
    return n_chunks


def chunks_of_rank(rank: int, world_size: int, layout: str) -> list[int]:
    """Which chunks (in sequence order) rank ``rank`` holds: [r] of P, or zigzag [r, 2P-1-r] of 2P."""
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def shard(x: torch.Tensor, world_size: int, layout: str = "contiguous", dim: int = -2) -> list[torch.Tensor]:
    """Cut ``x`` along ``dim`` (the sequence) into each rank's local tensor (chunks concatenated in order)."""
    n_chunks = check_layout(x.shape[dim], world_size, layout)
    pieces = x.chunk(n_chunks, dim=dim)
    return [torch.cat([pieces[c] for c in chunks_of_rank(r, world_size, layout)], dim=dim).contiguous()
            for r in range(world_size)]


def unshard(parts: list[torch.Tensor], layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The inverse of ``shard``: the ranks' local tensors back in sequence order."""
    P = len(parts)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    check_layout(sum(p.shape[dim] for p in parts), P, layout)
    halves = {}
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        halves[r], halves[2 * P - 1 - r] = a, b
    return torch.cat([halves[c] for c in range(2 * P)], dim=dim)


# ---------------------------------------------------------------------------- one chunk pair
def chunk_attention(q, k, v, causal=False):
    """(O, lse) of q ``[B, H, nq, d]`` against k, v ``[B, H, nk, d]``, in float32 (float64 inputs: float64).

    ``causal=True`` masks top-left aligned (query i sees keys j <= i), which is what a
    chunk pair on the diagonal needs. Rows that see no key: O = 0, lse = -inf. The same
    contract as ``helpers.triton_attention.flash_attn_triton`` (the per-chunk kernel on GPUs).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)                   # no copy of a float32/float64 chunk
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale              # [B, H, nq, nk]
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)                                    # [B, H, nq]
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])                                  # [B, H, nq, nk], 0 where masked
    return (p @ v.to(acc)).to(q.dtype), lse


def merge_reference(o_a, lse_a, o_b, lse_b):
    """Lesson 06's merge of two partial (O, lse), for any leading shape; -inf on both sides stays (0, -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)       # 0 for an empty side
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


# ---------------------------------------------------------------------------- shipping fn
class ShipError(ValueError):
    pass


def _code_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _importable(obj) -> bool:
    mod = getattr(obj, "__module__", None)
    if not mod or mod == "__main__" or mod.startswith("notebook_") or mod not in sys.modules:
        return False
    target = sys.modules[mod]
    for part in getattr(obj, "__qualname__", "").split("."):
        target = getattr(target, part, None)
    return target is obj and getattr(sys.modules[mod], "__file__", None) is not None


def _source(fn):
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise ShipError(f"cannot find the source of {fn.__name__!r} ({e}): define it with `def` in a notebook "
                        "cell or a .py file, so the launcher can send it to the worker processes") from None
    skip = 0
    while skip < len(lines) and not re.match(r"\s*(async\s+)?def\s", lines[skip]):
        skip += 1          # decorators: ship the bare function (a decorator would run again in the worker)
    if skip == len(lines):
        raise ShipError(f"cannot find the `def` line of {fn.__name__!r}")
    return textwrap.dedent("".join(lines[skip:])), first + skip


def ship(fn) -> dict:
    """What a worker needs to rebuild ``fn``: sources of it and its sibling functions, plus a preamble."""
    if not isinstance(fn, types.FunctionType):
        raise ShipError(f"pass a function defined with `def`, not a {type(fn).__name__}")
    if fn.__name__ == "<lambda>":
        raise ShipError("pass a function defined with `def` (a lambda's source cannot be sent to the workers)")
    units, preamble, files, seen = [], {}, {}, set()

    def visit(f):
        if f.__name__ in seen:
            return
        seen.add(f.__name__)
        if f.__closure__:
            raise ShipError(f"{f.__name__!r} is a closure (defined inside another function): define it at the "
                            "top level of a cell, so the launcher can send its source to the workers")
        src, first = _source(f)
        filename = f.__code__.co_filename
        files.setdefault(filename, linecache.getlines(filename))
        units.append((f.__name__, filename, first, src))
        g = f.__globals__
        for name in sorted(_code_names(f.__code__)):
            if name not in g or name in preamble or name in seen:
                continue
            val = g[name]
            if isinstance(val, types.ModuleType):
                preamble[name] = f"import {val.__name__} as {name}" if val.__name__ != name else f"import {name}"
            elif isinstance(val, types.FunctionType) and (val.__module__ == fn.__module__ or not _importable(val)):
                visit(val)     # a sibling: shipped by source (importing its module could cost seconds)
            elif callable(val) and _importable(val):
                preamble[name] = f"from {val.__module__} import {val.__qualname__.split('.')[0]} as {name}" \
                    if "." not in val.__qualname__ else f"import {val.__module__} as _m_{name}; " \
                    f"{name} = _m_{name}.{val.__qualname__}"
            elif isinstance(val, float) and not math.isfinite(val):
                preamble[name] = f"{name} = float({str(val)!r})"
            elif isinstance(val, (bool, int, float, str, type(None))) or (
                    isinstance(val, tuple) and all(isinstance(x, (bool, int, float, str)) for x in val)):
                preamble[name] = f"{name} = {val!r}"
            elif isinstance(val, torch.dtype):
                preamble[name] = f"import torch as _t_{name}; {name} = {val}"
            else:
                raise ShipError(f"{f.__name__!r} uses the global {name!r} (a {type(val).__name__}), which the launcher "
                                "cannot send to the worker processes: pass it as an argument, or make it a constant")

    visit(fn)
    return {"name": fn.__name__, "units": units, "preamble": list(preamble.values()), "files": files}


def _rebuild(payload):
    ns = {"__name__": "__ring_worker__", "__builtins__": __builtins__}
    exec(compile("\n".join(payload["preamble"]), "<ring preamble>", "exec"), ns)  # noqa: S102
    for filename, lines in payload["files"].items():
        if lines:
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    for _name, filename, first, src in reversed(payload["units"]):
        exec(compile("\n" * (first - 1) + src, filename, "exec"), ns)  # noqa: S102
    return ns[payload["name"]], {u[1] for u in payload["units"]}


def _where(tb, filenames) -> str:
    frames = [f for f in traceback.extract_tb(tb) if f.filename in filenames]
    if not frames:
        return ""
    f = frames[-1]
    where = "your cell" if f.filename.startswith("<") or "ipykernel" in f.filename else os.path.basename(f.filename)
    line = f"  `{f.line.strip()}`" if f.line else ""
    return f" at line {f.lineno} of {where} (in {f.name}){line}"


# ---------------------------------------------------------------------------- worker-side meters
@dataclass
class RankStats:
    """What the launcher measured on one rank for one input (see the module docstring)."""
    bytes_sent: int = 0
    bytes_recv: int = 0
    sends: int = 0
    recvs: int = 0
    collectives: list = field(default_factory=list)   # [(op name, bytes)]
    peak_chunks: float = 0.0
    flops: int = 0
    seconds: float = 0.0
    send_to: list = field(default_factory=list)       # the peer of each send, in order
    recv_from: list = field(default_factory=list)     # the peer of each receive (-1: any rank)
    send_dtypes: list = field(default_factory=list)   # the dtype of each tensor sent, as a string
    overlapped: list = field(default_factory=list)    # per receive: matmul FLOPs done between its post and wait
    escaped: int = 0                                  # bytes of K/V taken out of torch (.numpy(), .tolist())


_MOVES = {"clone", "_to_copy", "cat", "stack", "index_select", "index", "repeat", "flip", "roll",
          "contiguous", "where", "_unsafe_index", "narrow_copy", "slice_copy", "split_with_sizes_copy"}


def _kv_tracker_class():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    class KVTracker(TorchDispatchMode):
        """Tracks storages that carry K/V data (received, or copied from K/V) and their live bytes;
        counts matmul FLOPs with torch.utils.flop_counter's formulas (FlopCounterMode itself would
        import torch._dynamo in every worker: seconds each)."""

        def __init__(self, inputs, chunk_bytes):
            super().__init__()
            self.carriers, self.live, self.peak, self.chunk_bytes = {}, 0, 0, chunk_bytes
            self.cast = 0       # live bytes of K/V in another dtype, counted in the chunk's own dtype
            self.flops = 0
            for t in inputs:
                self.mark(t, counted=False)

        def _free(self, key, nbytes, cast):
            self.carriers.pop(key, None)
            if cast:
                self.cast -= nbytes
            else:
                self.live -= nbytes

        def mark(self, t, counted=True, cast_from=None):
            """Count t's storage as K/V held. ``cast_from``: t is a copy of that tensor in another dtype
            (``k.double()`` for the math): one chunk's worth of such copies is compute, not a held chunk."""
            s = t.untyped_storage()
            key = s.data_ptr()
            if not s.nbytes() or key in self.carriers:
                return
            nbytes = s.nbytes() if counted else 0
            cast = cast_from is not None and cast_from.dtype != t.dtype
            if cast:
                nbytes = nbytes * cast_from.element_size() // t.element_size()
                self.cast += nbytes
            else:
                self.live += nbytes
            self.carriers[key] = nbytes
            self.peak = max(self.peak, self.live + max(0, self.cast - self.chunk_bytes))
            weakref.finalize(s, self._free, key, nbytes, cast)

        def carries(self, t):
            return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.carriers

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func.overloadpacket
            if packet in flop_registry:
                self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
            name = packet.__name__
            if name in ("copy_",) and len(args) >= 2 and self.carries(args[1]):
                self.mark(args[0], cast_from=args[1])
            elif name in _MOVES and any(self.carries(t) for t in tree_flatten((args, kwargs))[0]):
                src = args[0] if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) else None
                for o in tree_flatten(out)[0]:
                    if isinstance(o, torch.Tensor):
                        self.mark(o, cast_from=src)
            return out

    return KVTracker


class _Probe:
    """Per-worker instrumentation of the process group (installed once per worker)."""

    def __init__(self, conn, job_ref):
        self.conn, self.job_ref = conn, job_ref
        self.stats, self.tracker, self.pending = RankStats(), None, {}
        self.posted = []     # FLOPs done when each receive not yet waited for was posted

    def flops(self):
        return self.tracker.flops if self.tracker is not None else 0

    def state(self, text):
        try:
            self.conn.send(("state", self.job_ref[0], text))
        except (OSError, ValueError):
            pass

    def install(self):
        from torch._C._distributed_c10d import ProcessGroup as PG
        from torch.distributed.distributed_c10d import Work
        probe = self

        def nbytes(tensors):
            ts = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            flat = []
            for t in ts:
                flat += t if isinstance(t, (list, tuple)) else [t]
            return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor)), flat

        orig_send, orig_recv, orig_any = PG.send, PG.recv, PG.recv_anysource

        def send(self, tensors, dst, tag=0):
            n, flat = nbytes(tensors)
            probe.stats.bytes_sent += n
            probe.stats.sends += 1
            probe.stats.send_to.append(int(dst))
            probe.stats.send_dtypes += [str(t.dtype).replace("torch.", "") for t in flat if isinstance(t, torch.Tensor)]
            work = orig_send(self, tensors, dst, tag)
            probe.pending[id(work)] = (f"a send of {n:,} bytes to rank {dst}")
            return work

        def recv(self, tensors, src, tag=0):
            n, flat = nbytes(tensors)
            probe.stats.bytes_recv += n
            probe.stats.recvs += 1
            probe.stats.recv_from.append(int(src))
            probe.posted.append(probe.flops())
            if probe.tracker is not None:
                for t in flat:
                    probe.tracker.mark(t)
            work = orig_recv(self, tensors, src, tag)
            probe.pending[id(work)] = (f"a receive of {n:,} bytes from rank {src}")
            return work

        def recv_any(self, tensors, tag=0):
            n, _ = nbytes(tensors)
            probe.stats.bytes_recv += n
            probe.stats.recvs += 1
            probe.stats.recv_from.append(-1)
            probe.posted.append(probe.flops())
            work = orig_any(self, tensors, tag)
            probe.pending[id(work)] = (f"a receive of {n:,} bytes from any rank")
            return work

        PG.send, PG.recv, PG.recv_anysource = send, recv, recv_any

        def collective(op_name):
            orig = getattr(PG, op_name)

            def wrapped(self, *args, **kwargs):
                n = 0
                for a in args:
                    if isinstance(a, (torch.Tensor, list, tuple)):
                        try:
                            n += nbytes(a)[0]
                        except TypeError:
                            pass
                probe.stats.collectives.append((op_name.lstrip("_"), n))
                work = orig(self, *args, **kwargs)
                probe.pending[id(work)] = (f"a collective ({op_name.lstrip('_')})")
                return work
            setattr(PG, op_name, wrapped)

        for op_name in ("allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
                        "allgather_into_tensor_coalesced", "broadcast", "allreduce", "allreduce_coalesced",
                        "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter", "reduce",
                        "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
            if hasattr(PG, op_name):
                collective(op_name)

        orig_wait = Work.wait

        def wait(self, *args, **kwargs):
            what = probe.pending.pop(id(self), "an operation")  # no reference to the work: it holds its tensors
            now = probe.flops()        # the receives posted so far are done by now (a batch's works are waited together)
            probe.stats.overlapped += [now - f for f in probe.posted]
            probe.posted = []
            probe.state(f"waiting for {what}")
            out = orig_wait(self, *args, **kwargs)
            probe.state("running")
            return out
        Work.wait = wait

        def escape(name):
            orig = getattr(torch.Tensor, name)

            def out_of_torch(self, *args, **kwargs):
                if probe.tracker is not None and probe.tracker.carries(self):
                    probe.stats.escaped += self.numel() * self.element_size()
                return orig(self, *args, **kwargs)
            setattr(torch.Tensor, name, out_of_torch)
        for name in ("numpy", "tolist", "__array__"):
            escape(name)


def _loopback_name() -> str:
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank, world_size, port, payload, jobs_blob, conn, pg_timeout_s):
    """One rank: join the group, run every job, send back what fn returned and what was measured."""
    job_ref = [None]
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_name())
        import torch.distributed as dist
        fn, filenames = _rebuild(payload)
        jobs = _loads(jobs_blob)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        probe = _Probe(conn, job_ref)
        probe.install()
        KVTracker = _kv_tracker_class()
        conn.send(("ready", None, None))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which ends the run
        conn.send(("error", None, {"type": type(e).__name__, "msg": str(e), "where": "",
                                   "tb": traceback.format_exc()}))
        return
    for i, (args, kwargs) in enumerate(jobs):
        job_ref[0] = i
        conn.send(("start", i, None))
        probe.stats, probe.pending, probe.posted = RankStats(), {}, []
        q, k, v = args
        chunk_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        try:
            tracker = KVTracker([k, v], chunk_bytes)
            probe.tracker = tracker
            t0 = time.perf_counter()
            with tracker:
                out = fn(*args, **kwargs)
            probe.stats.seconds = time.perf_counter() - t0
            probe.tracker = None
            del args, q, k, v
            probe.stats.peak_chunks = tracker.peak / chunk_bytes
            probe.stats.flops = tracker.flops
            conn.send(("done", i, _dumps({"out": out, "stats": probe.stats})))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", i, {"type": type(e).__name__, "msg": str(e).split("\n")[0][:500],
                                    "where": _where(e.__traceback__, filenames),
                                    "not_implemented": isinstance(e, NotImplementedError),
                                    "tb": traceback.format_exc()}))
            return
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        conn.send(("finished", None, None))


# ---------------------------------------------------------------------------- parent side
_CTX = {}
LAST_PIDS: list = []   # the worker pids of the last launch (tests check none survives)


def _context(start_method=None):
    method = start_method or os.environ.get(START_METHOD_ENV) or ("spawn" if sys.platform == "darwin" else "forkserver")
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start method {method!r} is not available here "
                         f"({', '.join(multiprocessing.get_all_start_methods())})")
    if method not in _CTX:
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.utils.flop_counter",
                                      "helpers.lesson09"])
        _CTX[method] = ctx
    return _CTX[method]


@dataclass
class RankResult:
    out: object
    stats: RankStats


def _stop(procs):
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.05, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2)


def _hang_hint(states):
    waiting = [s for s in states.values() if s.startswith("waiting for")]
    if waiting and len(waiting) == len(states) and all("send" in s for s in waiting):
        return ("every rank is blocked in a send: a blocking dist.send returns only once the peer has posted "
                "the matching receive, so if every rank sends first, nobody receives: a deadlock. Post the send "
                "and the receive together (dist.isend + dist.irecv, or dist.batch_isend_irecv), then wait")
    if waiting and all("receive" in s for s in waiting):
        return ("every blocked rank waits to receive: check that each receive has a matching send from that "
                "rank (send to (rank + 1) % P, receive from (rank - 1) % P), and that no rank skips a step")
    return ("a rank never finished: look for a send or receive without its partner (a peer off by one, a step "
            "skipped on some ranks), or a loop that never ends")


def launch(fn, jobs, world_size, *, timeout=20.0, startup_timeout=90.0, start_method=None, backend="gloo"):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks for each job; return ``[job][rank]`` results.

    ``jobs`` is a list of ``(per_rank_args, kwargs)``: ``per_rank_args[r]`` is the tuple of
    rank r's arguments (its q, k, v). One process group serves every job, in order.
    ``timeout``: seconds each rank may spend on one job. Raises ``RingError`` (naming the
    ranks) when a rank raises, dies or hangs, ``RingNotImplemented`` for the stub.
    """
    if backend != "gloo":
        raise ValueError(f"run_ring runs CPU processes with the gloo backend (got backend={backend!r}); "
                         "on GPUs launch with torchrun: see bench/ring_gpu.py")
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    payload = ship(fn)
    import torch.distributed as dist
    ctx = _context(start_method)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=startup_timeout))
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = []
    LAST_PIDS.clear()
    results = [[None] * world_size for _ in jobs]
    blobs = [_dumps([(args[r], kwargs) for args, kwargs in jobs]) for r in range(world_size)]
    pg_timeout = timeout * max(1, len(jobs)) + startup_timeout
    try:
        for r in range(world_size):
            p = ctx.Process(target=_worker, args=(r, world_size, store.port, payload, blobs[r], pipes[r][1],
                                                  pg_timeout), daemon=True, name=f"ring-rank-{r}")
            p.start()
            pipes[r][1].close()
            procs.append(p)
            LAST_PIDS.append(p.pid)
        conns = {pipes[r][0]: r for r in range(world_size)}
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        state = {r: "starting" for r in range(world_size)}
        job_of = {r: None for r in range(world_size)}
        started = {r: time.monotonic() for r in range(world_size)}
        finished = set()
        t_start = time.monotonic()
        errors = []
        while len(finished) < world_size:
            ready = _wait_any(list(conns) + list(sentinels), timeout=0.2)
            now = time.monotonic()
            for obj in ready:
                if obj in conns:
                    r = conns[obj]
                    try:
                        kind, i, data = obj.recv()
                    except (EOFError, OSError):
                        del conns[obj]
                        continue
                    if kind == "ready":
                        state[r] = "running"
                    elif kind == "start":
                        job_of[r], started[r], state[r] = i, now, "running"
                    elif kind == "state":
                        state[r] = data
                    elif kind == "done":
                        res = _loads(data)
                        results[i][r] = RankResult(res["out"], res["stats"])
                        state[r] = "done"
                    elif kind == "error":
                        errors.append((r, i, data))
                    elif kind == "finished":
                        finished.add(r)
            for s, r in list(sentinels.items()):
                if s in ready and r not in finished:
                    # drain what it sent before it exited
                    conn = next((c for c, rr in conns.items() if rr == r), None)
                    while conn is not None and conn.poll():
                        try:
                            kind, i, data = conn.recv()
                        except (EOFError, OSError):
                            break
                        if kind == "error":
                            errors.append((r, i, data))
                        elif kind == "finished":
                            finished.add(r)
                        elif kind == "done":
                            res = _loads(data)
                            results[i][r] = RankResult(res["out"], res["stats"])
                    if r not in finished and not any(e[0] == r for e in errors):
                        errors.append((r, job_of[r], {"type": "died", "msg": f"exit code {procs[r].exitcode}",
                                                      "where": "", "tb": ""}))
                    del sentinels[s]
            if errors:
                time.sleep(0.3)   # let a second rank's error arrive: the first one is the cause
                for c, r in conns.items():
                    while c.poll():
                        try:
                            kind, i, data = c.recv()
                        except (EOFError, OSError):
                            break
                        if kind == "error" and not any(e[0] == r for e in errors):
                            errors.append((r, i, data))
                _stop(procs)
                _raise_error(errors, jobs)
            for r in range(world_size):
                if r in finished:
                    continue
                if job_of[r] is None and now - t_start > startup_timeout:
                    _stop(procs)
                    raise RingError(f"rank {r} did not start within {startup_timeout:.0f} s", ranks=[r],
                                    kind="startup", hint="the machine may be overloaded; try again")
                if job_of[r] is not None and state[r] != "done" and now - started[r] > timeout:
                    stuck = {rr: state[rr] for rr in range(world_size) if rr not in finished and state[rr] != "done"}
                    _stop(procs)
                    who = ", ".join(f"rank {rr} ({s})" for rr, s in stuck.items())
                    raise RingError(f"input {job_of[r] + 1} of {len(jobs)}: not finished after {timeout:g} s; "
                                    f"still running: {who}", ranks=list(stuck), job=job_of[r], kind="hang",
                                    hint=_hang_hint(stuck))
        return results
    finally:
        _stop(procs)
        for a, b in pipes:
            a.close()
        del store


def _raise_error(errors, jobs):
    # the first reported error is the cause; a rank that died after another raised is a consequence
    r, i, info = errors[0]
    if info.get("not_implemented"):
        raise RingNotImplemented(info["msg"])
    where = info.get("where", "")
    if info["type"] == "died":
        msg = f"rank {r} died ({info['msg']})" + (f" during input {i + 1} of {len(jobs)}" if i is not None else "")
        hint = "a worker process was killed (out of memory?) or crashed"
    elif i is None:
        msg = f"rank {r} could not start: {info['type']}: {info['msg']}"
        hint = "the launcher could not rebuild your function in the worker: define it with `def` at the top of a cell"
    else:
        msg = f"rank {r} raised {info['type']}: {info['msg']}{where} (input {i + 1} of {len(jobs)})"
        hint = ""
    others = sorted({e[0] for e in errors[1:]})
    if others:
        msg += f"; then rank(s) {', '.join(map(str, others))} failed too"
    raise RingError(msg, ranks=[r], job=i, kind=info["type"], hint=hint, details=info.get("tb", ""))


def run_ring(fn, q, k, v, world_size, causal=False, layout="contiguous", backend="gloo", *, timeout=20.0,
             stats=False, start_method=None):
    """Run ``fn`` as ring attention on ``world_size`` processes; return the global ``(O, lse)``.

    q, k, v ``[B, H, N, d]``, N a multiple of world_size (contiguous) or 2·world_size
    (zigzag). Rank r gets its chunk(s) of each and calls ``fn(q_r, k_r, v_r, causal=causal,
    layout=layout)``, which returns its ``(O_r [B, H, n, d], lse_r [B, H, n])``. With
    ``stats=True`` also returns the list of ``RankStats``, one per rank.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, N, d] tensor, got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: expected the same [B, H, N, d]")
    check_layout(q.shape[2], world_size, layout)
    per_rank = list(zip(*(shard(t, world_size, layout) for t in (q, k, v))))
    res = launch(fn, [(per_rank, {"causal": causal, "layout": layout})], world_size, timeout=timeout,
                 start_method=start_method, backend=backend)[0]
    outs = []
    for r, rr in enumerate(res):
        out = rr.out
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise RingError(f"rank {r} returned a {type(out).__name__}, expected (O, lse)", ranks=[r], kind="output")
        outs.append(out)
    O = unshard([o for o, _ in outs], layout, dim=-2)
    lse = unshard([l for _, l in outs], layout, dim=-1)
    return (O, lse, [rr.stats for rr in res]) if stats else (O, lse)


# ---------------------------------------------------------------------------- schedules and pictures
def ring_schedule(P: int, layout: str = "contiguous", causal: bool = True):
    """work[r][t]: the fraction of one (N/P x N/P) block of scores that rank r must compute at step t.

    At step t rank r holds the K/V of rank (r - t) mod P (chunks pass to r + 1). Visible area
    only (a kernel that skips masked tiles): a diagonal block is half visible.
    """
    n = 2 * P if layout == "zigzag" else P
    area = 1.0 / (n // P) ** 2        # one chunk-by-chunk block, in units of a rank's block
    work = [[0.0] * P for _ in range(P)]
    for r in range(P):
        for t in range(P):
            s = (r - t) % P
            for a in chunks_of_rank(r, P, layout):
                for b in chunks_of_rank(s, P, layout):
                    if not causal or b < a:
                        work[r][t] += area
                    elif b == a:
                        work[r][t] += area / 2
    return work


def plot_schedule(P: int = 4, axes=None):
    """Work per rank and step, causal, contiguous vs zigzag (heat maps) and the total per rank (bars)."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    totals = {}
    for ax, layout in zip(axes[:2], LAYOUTS):
        w = ring_schedule(P, layout, causal=True)
        totals[layout] = [sum(row) for row in w]
        ax.imshow(w, cmap="Blues", vmin=0, vmax=1)
        for r in range(P):
            for t in range(P):
                ax.text(t, r, f"{w[r][t]:.2g}", ha="center", va="center", fontsize=8,
                        color="white" if w[r][t] > 0.6 else "black")
        ax.set_xticks(range(P))
        ax.set_yticks(range(P))
        ax.set_xlabel("step t")
        ax.set_ylabel("rank r")
        ax.set_title(f"{layout}: work per step (blocks)", fontsize=10)
    x = range(P)
    axes[2].bar([i - 0.2 for i in x], totals["contiguous"], 0.4, label="contiguous")
    axes[2].bar([i + 0.2 for i in x], totals["zigzag"], 0.4, label="zigzag")
    axes[2].set_xlabel("rank r")
    axes[2].set_title("causal work per rank (blocks)", fontsize=10)
    axes[2].legend(fontsize=8)
    plt.tight_layout()
    return axes


def kv_bytes(N, layers=32, Hkv=8, d=128, bytes_per_elem=2, B=1):
    """Bytes of K and V for N tokens over all layers (a KV cache, or what the attention reads)."""
    return 2 * B * N * layers * Hkv * d * bytes_per_elem


def activation_bytes(N, layers=32, hidden=4096, B=1):
    """Activations a training step keeps for backward, ~34·N·hidden bytes per layer in bf16 with
    FlashAttention (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models", 2022: s·b·h·(34 + 5·a·s/h), whose second term FlashAttention removes). The 34 already
    counts the layer's Q, K and V, its dropout masks and a GeLU MLP of width 4·h (that paper's model),
    so K/V (``kv_bytes``) is a part of this figure, not something to add to it."""
    return 34 * B * N * hidden * layers


def plot_memory(Ns=(131072, 262144, 524288, 1048576), Ps=(1, 2, 4, 8), ax=None, **model):
    """Per-GPU memory of training activations (K/V among them; a Llama-3-8B shape) vs N, sharded over P GPUs."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 3.4))[1]
    for P in Ps:
        ax.plot(Ns, [activation_bytes(N, **model) / P / 1e9 for N in Ns], "o-", label=f"P = {P}")
    ax.axhline(H200_HBM_BYTES / 1e9, color="k", ls=":", lw=1)
    ax.text(Ns[0], H200_HBM_BYTES / 1e9 * 1.1, "one H200 (141 GB)", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("GB per GPU")
    ax.set_title("activations of a training step, K/V included (32 layers, hidden 4096)", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def step_times(N, P=2, B=1, H=32, d=128, bytes_per_elem=2, flops=H200_BF16_FLOPS, link=NVLINK_BYTES_PER_S,
               efficiency=0.6):
    """(compute_s, comm_s) of one non-causal ring step: an (N/P)^2 block vs sending one K/V chunk.

    A model, not a measurement: compute at ``efficiency`` x the datasheet's dense BF16 rate,
    the chunk over one NVLink direction at the datasheet rate.
    """
    n = N // P
    compute = 4 * B * H * n * n * d / (flops * efficiency)
    comm = 2 * B * H * n * d * bytes_per_elem / link
    return compute, comm


def plot_overlap(Ns=(4096, 16384, 65536, 262144, 1048576), P=2, ax=None):
    """Compute vs communication per step (model): compute grows as N^2, the chunk as N."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    c = [step_times(N, P)[0] * 1e3 for N in Ns]
    m = [step_times(N, P)[1] * 1e3 for N in Ns]
    ax.loglog(Ns, c, "o-", label="compute one block")
    ax.loglog(Ns, m, "s-", label="send one K/V chunk")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens N")
    ax.set_ylabel("ms per step")
    ax.set_title(f"one ring step on H200s, P = {P} (model: 60% of 989 TFLOP/s, 450 GB/s)", fontsize=10)
    ax.legend(fontsize=8)
    return ax
