"""A multiprocess launcher for ring attention: ship a function to worker processes by source,
run it on one ``torch.distributed`` (gloo, 127.0.0.1) process per rank, and measure what each rank did.

- ``launch(fn, jobs, world_size)``: runs ``fn(*args, **kwargs)`` for each job on every rank in one
  process group (starting processes is the expensive part), returning per rank what ``fn`` returned
  and what the launcher measured (``RankStats``). ``helpers.lesson09.run_ring`` lays the global
  tensors out over the ranks and calls it; lesson 09's checker calls it with several inputs at once.
- ``ship(fn)``: what a worker needs to rebuild ``fn`` from source.

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

__all__ = ["launch", "ship", "RingError", "RingNotImplemented", "ShipError", "RankStats", "START_METHOD_ENV",
           "LAST_PIDS"]

START_METHOD_ENV = "COURSE_RING_START"


class RingError(RuntimeError):
    """A run of ``fn`` on the ranks failed: ``str(e)`` names the rank(s); ``e.hint`` says what to look at."""

    def __init__(self, message, *, ranks=(), job=None, kind="", hint="", details=""):
        super().__init__(message)
        self.ranks, self.job, self.kind, self.hint, self.details = list(ranks), job, kind, hint, details


class RingNotImplemented(NotImplementedError):
    """The function on the ranks still raises NotImplementedError (the stub)."""


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
        # Every rank connected before any runs a job: a rank whose job fails at once (a learner's stub) must not
        # end the run while another is still connecting (gloo then prints "connectFullMesh failed" on stderr).
        dist.barrier()
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
            # helpers.lesson09 (which imports this module): the learner's preamble imports from it
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
