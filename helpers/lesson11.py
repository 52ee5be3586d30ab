"""Plain functions behind notebook 11 (FlashAttention-3 on Hopper): the pipeline's barrier simulator,
the course's schedule, the softmax-vs-matmul count, and the timeline picture.

FA3's forward (Shah et al., 2024, "FlashAttention-3", §3.1) splits a CTA into a *producer* warp that
issues TMA loads of K_j, V_j into a circular buffer of ``num_stages`` shared-memory stages, and one or
two *consumer* warpgroups that run the GEMMs and the softmax on each stage. Two arrays of mbarriers
keep them in step: ``full[s]`` completes a phase when a load into stage s has landed, ``empty[s]`` when
every consumer has released stage s. A Hopper mbarrier keeps only the *parity* of its current phase, and
``wait(parity)`` returns once the phase of that parity has completed, i.e. as soon as the barrier's
current phase parity differs from it. This module executes a schedule written with those operations,
one tick at a time, and reports the first deadlock, race or misuse it sees.

Nothing here imports Triton or needs a GPU. References: the FA3 paper (arXiv:2407.08608, §3.1-3.2);
PTX ISA, ``mbarrier.try_wait.parity`` (the phase-parity rule simulated here).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from . import results

__all__ = ["wait_full", "wait_empty", "load", "compute", "release", "agents", "Violation", "Run", "simulate",
           "PROFILES", "first_violation", "fa3_schedule_ref", "expected_parity", "count_forward_ops",
           "softmax_share", "PAPER", "plot_timeline", "tensor_core_busy", "require_hopper", "hopper_here",
           "NO_HOPPER", "show_recorded_hopper", "bench_gluon_live", "gluon_api", "trace_producer", "TraceError",
           "PRODUCER_ARGS", "producer_source", "compile_producer_for_sm90", "gluon_here"]


# ------------------------------------------------------------------ the operations of a schedule
def wait_full(s: int, parity: int) -> tuple:
    """Consumer: wait until full[s]'s phase of this parity has completed (the load into stage s landed)."""
    return ("wait", "full", s, parity)


def wait_empty(s: int, parity: int) -> tuple:
    """Producer: wait until empty[s]'s phase of this parity has completed (every consumer released stage s)."""
    return ("wait", "empty", s, parity)


def load(s: int, j: int) -> tuple:
    """Producer: issue the TMA load of K_j and V_j into stage s (asynchronous: it lands later, and then
    completes the current phase of full[s])."""
    return ("load", s, j)


def compute(s: int, j: int) -> tuple:
    """Consumer: S = Q K_j^T, the online softmax, O += P V_j, reading K_j and V_j from stage s."""
    return ("compute", s, j)


def release(s: int) -> tuple:
    """Consumer: arrive on empty[s] (this consumer is done reading stage s)."""
    return ("release", s)


def agents(num_consumers: int) -> list[str]:
    """The names a schedule must use: "producer", "consumer0", ... ."""
    return ["producer"] + [f"consumer{c}" for c in range(num_consumers)]


def expected_parity(kind: str, round_: int) -> int:
    """The parity to wait on before the ``round_``-th use (0, 1, ...) of a stage.

    full: round r needs the (r+1)-th completion, whose phase has parity r % 2.
    empty: round r needs the r-th completion (the consumers released round r-1), parity (r - 1) % 2,
    which for r = 0 is 1: a fresh barrier (phase 0 in progress) passes a wait on parity 1 at once."""
    return round_ % 2 if kind == "full" else (round_ + 1) % 2


# ------------------------------------------------------------------ the simulator
@dataclass
class Violation:
    """The first thing that went wrong: ``kind`` (below), who, which op (index into that agent's list)."""
    kind: str       # bad_schedule, bad_op, deadlock, read_before_landed, read_wrong_tile, overwrite_unreleased,
    #                 overwrite_in_flight, release_before_use, double_release, missing_work, unreleased_at_end
    agent: str
    index: int
    op: tuple | None
    message: str
    details: dict = field(default_factory=dict)


@dataclass
class Run:
    """What a simulation did: ``violation`` (None if clean), the ``events`` for a timeline, the end ``time``."""
    violation: Violation | None
    events: list            # (agent, what, t0, t1, stage, tile): what in load, gemm0, softmax, gemm1, wait
    time: int
    profile: str = ""


@dataclass
class _Barrier:
    count: int              # arrivals that complete a phase
    arrived: int = 0
    completed: int = 0      # phases completed so far; the phase in progress has parity completed % 2

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived = 0
            self.completed += 1

    def passes(self, parity: int) -> bool:
        return self.completed % 2 != parity


# Timing profiles (ticks): load latency, GEMM time, softmax time per consumer. "producer ahead" lets the
# producer run laps ahead of slow consumers (an overwrite shows); "consumer ahead" makes loads slow (a read
# before the data landed shows); "uneven" gives the consumers different speeds (a stage released by one only).
PROFILES = {
    "producer ahead": dict(load_t=1, gemm_t=2, softmax_t=(9, 13)),
    "consumer ahead": dict(load_t=11, gemm_t=1, softmax_t=(1, 1)),
    "uneven consumers": dict(load_t=3, gemm_t=1, softmax_t=(1, 7)),
}


def _check_shape(schedule, num_consumers):
    """A Violation for a schedule that is not {agent: list of ops} with the right agents, else None."""
    names = agents(num_consumers)
    if not isinstance(schedule, dict):
        return Violation("bad_schedule", "", -1, None,
                         f"the schedule must be a dict {{agent: list of ops}}, got a {type(schedule).__name__}")
    if sorted(schedule) != sorted(names):
        return Violation("bad_schedule", "", -1, None,
                         f"the schedule's agents are {sorted(schedule)}, expected {names} "
                         f"(num_consumers = {num_consumers})")
    for a in names:
        if not isinstance(schedule[a], (list, tuple)):
            return Violation("bad_schedule", a, -1, None,
                             f"schedule[{a!r}] must be a list of ops, got a {type(schedule[a]).__name__}")
    return None


def _check_op(agent, i, op, num_stages, num_tiles):
    """A Violation for an op that is malformed, out of range, or not this agent's to do, else None."""
    def bad(msg):
        return Violation("bad_op", agent, i, op if isinstance(op, tuple) else None, msg)
    if not isinstance(op, tuple) or not op:
        return bad(f"op {i} of {agent} is {op!r}: ops are tuples made by wait_full, wait_empty, load, compute, "
                   "release")
    numbers = op[2:] if op[0] == "wait" else op[1:]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in numbers):
        return bad(f"op {i} of {agent} is {op!r}: stages, tiles and parities are Python ints "
                   "(int(x) of a tensor or a numpy value)")
    producer = agent == "producer"
    kind = op[0]
    if kind == "wait" and len(op) == 4 and op[1] in ("full", "empty"):
        _, bar, s, p = op
        if p not in (0, 1):
            return bad(f"op {i} of {agent} waits on parity {p}: a parity is 0 or 1")
        if (bar == "empty") != producer:
            who = "the producer waits on empty[s] only" if producer else "a consumer waits on full[s] only"
            return bad(f"op {i} of {agent} is {op!r}: {who}")
    elif kind == "load" and len(op) == 3:
        if not producer:
            return bad(f"op {i} of {agent} is {op!r}: only the producer loads")
        s, j = op[1], op[2]
        if not 0 <= j < num_tiles:
            return bad(f"op {i} of {agent} loads tile {j}: the tiles are 0..{num_tiles - 1}")
    elif kind == "compute" and len(op) == 3:
        if producer:
            return bad(f"op {i} of {agent} is {op!r}: the producer only waits on empty[s] and loads")
        j = op[2]
        if not 0 <= j < num_tiles:
            return bad(f"op {i} of {agent} computes tile {j}: the tiles are 0..{num_tiles - 1}")
    elif kind == "release" and len(op) == 2:
        if producer:
            return bad(f"op {i} of {agent} is {op!r}: consumers release stages, the producer fills them")
    else:
        return bad(f"op {i} of {agent} is {op!r}: not an op (use wait_full, wait_empty, load, compute, release)")
    s = op[2] if kind == "wait" else op[1]
    if not 0 <= s < num_stages:
        return bad(f"op {i} of {agent} names stage {s}, but with num_stages = {num_stages} the stages are "
                   f"0..{num_stages - 1}")
    return None


def simulate(schedule, num_tiles, num_stages, num_consumers, load_t=3, gemm_t=2, softmax_t=(3, 3),
             pingpong=False, max_ticks=None, profile="") -> Run:
    """Execute ``schedule`` tick by tick; stop at the first violation.

    ``schedule``: {"producer": [...], "consumer0": [...], ...} of ops from ``wait_full`` etc. The producer's
    ops take no time (a TMA load is issued and lands ``load_t`` ticks later, loads landing in issue order);
    a consumer's ``compute`` is GEMM0 (``gemm_t``), softmax (``softmax_t[c]``), GEMM1 (``gemm_t``), reading its
    stage throughout; the tensor cores run one GEMM at a time. ``pingpong``: the consumers take turns on the
    tensor cores, one GEMM each (FA3's ping-pong), so one's softmax runs under the other's GEMM.
    Returns a ``Run``: its ``violation`` is None when the schedule completed with every tile computed by every
    consumer, in order, and every stage released.
    """
    bad = _check_shape(schedule, num_consumers)
    if bad:
        return Run(bad, [], 0, profile)
    names = agents(num_consumers)
    for a in names:
        for i, op in enumerate(schedule[a]):
            bad = _check_op(a, i, op, num_stages, num_tiles)
            if bad:
                return Run(bad, [], 0, profile)
    C = num_consumers
    full = [_Barrier(1) for _ in range(num_stages)]
    empty = [_Barrier(C) for _ in range(num_stages)]
    # what each stage holds: the tile, whether it landed, the consumers that still owe it a release
    holds = [None] * num_stages
    landed = [False] * num_stages
    owes = [set() for _ in range(num_stages)]
    reading = [set() for _ in range(num_stages)]          # consumers reading the stage right now
    uses = {a: [0] * num_stages for a in names}           # rounds done per stage (loads, computes)
    last_wait = {a: {} for a in names}                    # (bar, s) -> (parity, index, passed_at_once)
    computed = {f"consumer{c}": [] for c in range(C)}
    held = {f"consumer{c}": {} for c in range(C)}         # stage -> tile computed and not yet released
    released = {f"consumer{c}": {} for c in range(C)}     # stage -> tile last released
    in_flight = []                                        # (land_time, stage, tile)
    pc = {a: 0 for a in names}
    busy = {a: None for a in names}                       # consumer: [phase, t_end, stage, tile, t0]
    waiting_since = {a: None for a in names}
    tc_free_at, turn = 0, 0
    last_land = 0
    events = []
    if max_ticks is None:
        max_ticks = 50 + (num_tiles + 2) * (load_t + 2 * gemm_t + max(softmax_t)) * (C + 1) * 4

    def my_turn(c):
        """Ping-pong: consumer c may take the tensor cores on its turn, or when the other has no GEMM left."""
        if not pingpong or C == 1:
            return True
        other = f"consumer{1 - c}"
        return turn == c or (pc[other] >= len(schedule[other]) and busy[other] is None)

    def stop(kind, agent, index, op, message, **details):
        return Run(Violation(kind, agent, index, op, message, details), events, t, profile)

    t = 0
    while t <= max_ticks:
        # 1. loads that land now complete a phase of full[s]
        for item in [x for x in in_flight if x[0] == t]:
            in_flight.remove(item)
            _, s, j = item
            if holds[s] == j:
                landed[s] = True
            full[s].arrive()
        # 2. consumers' compute phases
        for c in range(C):
            a = f"consumer{c}"
            b = busy[a]
            if b is None:
                continue
            phase, t_end, s, j, t0 = b
            if phase in ("gemm0", "gemm1") and t_end is None:       # waiting for the tensor cores
                if t >= tc_free_at and my_turn(c):
                    b[1] = t + gemm_t
                    b[4] = t
                    tc_free_at = t + gemm_t
                continue
            if t_end is not None and t >= t_end:
                events.append((a, phase, t0, t_end, s, j))
                if phase == "gemm0":
                    turn = (turn + 1) % C if pingpong else turn
                    busy[a] = ["softmax", t + softmax_t[c % len(softmax_t)], s, j, t]
                elif phase == "softmax":
                    busy[a] = ["gemm1", None, s, j, t]
                    if t >= tc_free_at and my_turn(c):
                        busy[a] = ["gemm1", t + gemm_t, s, j, t]
                        tc_free_at = t + gemm_t
                else:
                    turn = (turn + 1) % C if pingpong else turn
                    busy[a] = None
                    reading[s].discard(a)
                    computed[a].append(j)
                    held[a][s] = j
                    uses[a][s] += 1
                    pc[a] += 1
        # 3. every agent runs its zero-time ops until it blocks or starts a compute; repeat until quiet
        progressed = True
        while progressed:
            progressed = False
            for a in names:
                while busy[a] is None and pc[a] < len(schedule[a]):
                    i, op = pc[a], schedule[a][pc[a]]
                    kind = op[0]
                    if kind == "wait":
                        _, bar, s, p = op
                        barrier = (full if bar == "full" else empty)[s]
                        if not barrier.passes(p):
                            if waiting_since[a] is None:
                                waiting_since[a] = t
                            break
                        at_once = waiting_since[a] is None
                        if not at_once:
                            events.append((a, "wait", waiting_since[a], t, s, None))
                        waiting_since[a] = None
                        last_wait[a][bar, s] = (p, i, at_once, uses[a][s])
                    elif kind == "load":
                        _, s, j = op
                        if any(x[1] == s for x in in_flight):
                            return stop("overwrite_in_flight", a, i, op,
                                        f"the producer issued load(stage {s}, tile {j}) while the load of tile "
                                        f"{holds[s]} into stage {s} was still in flight", stage=s, tile=j,
                                        old=holds[s], wait=last_wait[a].get(("empty", s)), round=uses[a][s])
                        if owes[s]:
                            who = sorted(owes[s])
                            use = "is still reading it" if reading[s] & owes[s] else \
                                "has not released it yet"
                            return stop("overwrite_unreleased", a, i, op,
                                        f"the producer loaded tile {j} into stage {s} while it still held tile "
                                        f"{holds[s]}, which {', '.join(who)} {use}", stage=s, tile=j,
                                        old=holds[s], owing=who, wait=last_wait[a].get(("empty", s)),
                                        round=uses[a][s])
                        holds[s], landed[s] = j, False
                        owes[s] = {f"consumer{c}" for c in range(C)}
                        land = max(t, last_land) + load_t
                        last_land = land
                        in_flight.append((land, s, j))
                        events.append((a, "load", t, land, s, j))
                        uses[a][s] += 1
                    elif kind == "compute":
                        _, s, j = op
                        w = last_wait[a].get(("full", s))
                        if holds[s] != j:
                            there = "nothing" if holds[s] is None else f"tile {holds[s]}"
                            return stop("read_wrong_tile", a, i, op,
                                        f"{a} computed on stage {s} as tile {j}, but stage {s} holds {there}",
                                        stage=s, tile=j, there=holds[s], wait=w, round=uses[a][s])
                        if not landed[s]:
                            return stop("read_before_landed", a, i, op,
                                        f"{a} read stage {s} (tile {j}) before its load had landed",
                                        stage=s, tile=j, wait=w, round=uses[a][s])
                        if a in released and released[a].get(s) == j and a not in owes[s]:
                            return stop("release_before_use", a, i, op,
                                        f"{a} computed on stage {s} (tile {j}) after it had already released "
                                        "it: the producer may be overwriting it right now", stage=s, tile=j)
                        reading[s].add(a)
                        busy[a] = ["gemm0", None, s, j, t]
                        if t >= tc_free_at and my_turn(int(a[8:])):
                            busy[a] = ["gemm0", t + gemm_t, s, j, t]
                            tc_free_at = t + gemm_t
                        progressed = True
                        break                                  # pc advances when the compute ends
                    elif kind == "release":
                        _, s = op
                        if s not in held[a]:
                            before = [o for o in schedule[a][:i] if o[0] in ("compute", "release") and o[1] == s]
                            if before and before[-1][0] == "release":
                                return stop("double_release", a, i, op,
                                            f"{a} released stage {s} twice in a row: empty[{s}] "
                                            "counts arrivals, so a second one completes the phase for another "
                                            "consumer", stage=s)
                            return stop("release_before_use", a, i, op,
                                        f"{a} released stage {s} before computing on the tile it holds "
                                        f"({'nothing' if holds[s] is None else f'tile {holds[s]}'}): the producer "
                                        "may overwrite it while (or before) it is read", stage=s)
                        released[a][s] = held[a].pop(s)
                        owes[s].discard(a)
                        empty[s].arrive()
                    pc[a] += 1
                    progressed = True
        # 4. done, stuck, or on to the next tick
        if all(pc[a] >= len(schedule[a]) and busy[a] is None for a in names) and not in_flight:
            break
        if not in_flight and all(busy[a] is None for a in names):
            stuck = [a for a in names if pc[a] < len(schedule[a])]
            a = stuck[0]
            op = schedule[a][pc[a]]
            blocked = []
            for b in stuck:
                _, bar, s, p = schedule[b][pc[b]]
                barrier = (full if bar == "full" else empty)[s]
                blocked.append(dict(agent=b, index=pc[b], bar=bar, stage=s, parity=p, round=uses[b][s],
                                    completed=barrier.completed, arrived=barrier.arrived, count=barrier.count))
            lines = "; ".join(f"{x['agent']} (op {x['index']}) waits on {x['bar']}[{x['stage']}] parity "
                              f"{x['parity']}, which has completed {x['completed']} phase"
                              f"{'s' if x['completed'] != 1 else ''}" for x in blocked)
            return stop("deadlock", a, pc[a], op, f"{lines}, and nothing in flight can complete them",
                        blocked=blocked)
        t += 1
    else:
        return stop("deadlock", "", -1, None, f"still running after {max_ticks} ticks", blocked=[])
    # 5. the work: every consumer computed every tile once, in order, and released every stage
    for c in range(C):
        a = f"consumer{c}"
        if computed[a] != list(range(num_tiles)):
            missing = sorted(set(range(num_tiles)) - set(computed[a]))
            what = (f"never computed tile{'s' if len(missing) > 1 else ''} {missing}" if missing else
                    f"computed the tiles in the order {computed[a]}")
            return Run(Violation("missing_work", a, -1, None,
                                 f"{a} {what}; each consumer computes tiles 0..{num_tiles - 1} once, in order",
                                 dict(computed=computed[a])), events, t, profile)
        if held[a]:
            s = min(held[a])
            return Run(Violation("unreleased_at_end", a, -1, None,
                                 f"{a} never released stage {s} after computing tile {held[a][s]}",
                                 dict(stage=s)), events, t, profile)
    loaded = sorted(e[5] for e in events if e[1] == "load")
    if loaded != list(range(num_tiles)):
        return Run(Violation("missing_work", "producer", -1, None,
                             f"the producer loaded tiles {loaded}; each tile 0..{num_tiles - 1} is loaded once",
                             dict(loaded=loaded)), events, t, profile)
    return Run(None, events, t, profile)


def first_violation(schedule_fn, num_tiles, num_stages, num_consumers):
    """Run ``schedule_fn(num_tiles, num_stages, num_consumers)`` under every timing profile; the first ``Run``
    with a violation, else None. (The schedule is built once and run as given.)"""
    schedule = schedule_fn(num_tiles, num_stages, num_consumers)
    for name, prof in PROFILES.items():
        run = simulate(schedule, num_tiles, num_stages, num_consumers, profile=name, **prof)
        if run.violation is not None:
            return run
    return None


# ------------------------------------------------------------------ the course's schedule
def fa3_schedule_ref(num_tiles: int, num_stages: int, num_consumers: int) -> dict:
    """FA3's producer/consumer schedule over a ring of ``num_stages`` stages: tile j lives in stage
    j % num_stages during round j // num_stages; the parity flips each time the ring wraps."""
    producer = []
    for j in range(num_tiles):
        s, r = j % num_stages, j // num_stages                 # stage, round (laps of the ring)
        producer += [wait_empty(s, (r + 1) % 2), load(s, j)]  # round 0: parity 1 passes a fresh barrier
    schedule = {"producer": producer}
    for c in range(num_consumers):
        ops = []
        for j in range(num_tiles):
            s, r = j % num_stages, j // num_stages
            ops += [wait_full(s, r % 2), compute(s, j), release(s)]
        schedule[f"consumer{c}"] = ops
    return schedule


# ------------------------------------------------------------------ why softmax matters on Hopper
# The FA3 paper's figures for the H100 SXM5 (Shah et al., 2024, §3.2): "989 TFLOPS of FP16 matmul but only
# 3.9 TFLOPS of special functions such as exponential". Not measured here.
PAPER = {"mma_tflops": 989.0, "exp_tflops": 3.9, "source": "FlashAttention-3 (Shah et al., 2024), §3.2, H100 SXM5"}


def count_forward_ops(N=256, Nk=256, d=64, BLOCK_M=64, BLOCK_N=64):
    """Count, by running it, the matmul FLOPs and the exponentials of one head's tiled forward
    (online softmax in base 2): a dispatch mode sees every aten op. Returns {"matmul_flops", "exps"}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"matmul_flops": 0, "exps": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name == "mm":
                (m, k), n = args[0].shape, args[1].shape[1]
                counts["matmul_flops"] += 2 * m * k * n
            elif name in ("exp", "exp2"):
                counts["exps"] += out.numel()
            return out

    rng = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=rng) for n in (N, Nk, Nk))
    with Count():
        _tiled_forward(q, k, v, BLOCK_M, BLOCK_N)
    return counts


def _tiled_forward(q, k, v, BLOCK_M, BLOCK_N):
    """The forward FA2 and FA3 both compute, tile by tile (base 2): what ``count_forward_ops`` counts."""
    N, d = q.shape
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    out = []
    for i in range(0, N, BLOCK_M):
        qi = q[i:i + BLOCK_M]                                         # [BLOCK_M, d]
        m = torch.full((qi.shape[0],), -math.inf)
        l = torch.zeros(qi.shape[0])
        acc = torch.zeros(qi.shape[0], d)
        for j in range(0, k.shape[0], BLOCK_N):
            s = (qi @ k[j:j + BLOCK_N].T) * qk_scale                  # [BLOCK_M, BLOCK_N]  GEMM0
            m_new = torch.maximum(m, s.amax(1))
            alpha = torch.exp2(m - m_new)                             # [BLOCK_M]
            p = torch.exp2(s - m_new[:, None])                        # [BLOCK_M, BLOCK_N]
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ v[j:j + BLOCK_N]         # [BLOCK_M, d]  GEMM1
            m = m_new
        out.append(acc / l[:, None])
    return torch.cat(out)


def softmax_share(d, mma_tflops=PAPER["mma_tflops"], exp_tflops=PAPER["exp_tflops"], **shape):
    """From counted ops and the given throughputs: the time of the exponentials against the matmuls, and the
    share of the total they take if nothing overlaps. Returns a dict of the counts and ratios."""
    c = count_forward_ops(d=d, **shape)
    t_mma = c["matmul_flops"] / (mma_tflops * 1e12)
    t_exp = c["exps"] / (exp_tflops * 1e12)
    return dict(d=d, **c, flops_per_exp=c["matmul_flops"] / c["exps"], exp_over_mma=t_exp / t_mma,
                share_if_serial=t_exp / (t_exp + t_mma))


# ------------------------------------------------------------------ the picture
_COLOURS = {"load": "#4c72b0", "gemm0": "#dd8452", "gemm1": "#c44e52", "softmax": "#55a868", "wait": "#dddddd"}


def tensor_core_busy(run: Run) -> float:
    """The fraction of the run's time the tensor cores spent on GEMMs (the model's, not a measurement)."""
    busy = sum(t1 - t0 for _, what, t0, t1, _, _ in run.events if what in ("gemm0", "gemm1"))
    return busy / max(run.time, 1)


def plot_timeline(run: Run, ax=None, title=""):
    """One lane per stage for the producer's loads (issue to landing) and one per consumer: its waits, GEMM0,
    softmax, GEMM1."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 2.4))
    names = sorted({e[0] for e in run.events}, key=lambda a: (a != "producer", a))
    loads = [e for e in run.events if e[1] == "load"]
    rows = {}
    y = 0
    for a in names:
        if a == "producer":                 # loads overlap in flight: one lane per stage
            for s in sorted({e[4] for e in loads}):
                rows[a, s] = y
                y += 1
        else:
            rows[a, None] = y
            y += 1
    for a, what, t0, t1, s, j in run.events:
        if a == "producer" and what == "wait":      # the lanes show the loads in flight; the waits are the gaps
            continue
        row = rows[a, s] if a == "producer" else rows[a, None]
        ax.barh(row, t1 - t0, left=t0, color=_COLOURS[what], edgecolor="white", height=0.8)
        if j is not None and what in ("load", "softmax") and t1 - t0 >= 2:
            ax.text((t0 + t1) / 2, row, str(j), ha="center", va="center", fontsize=7, color="white")
    labels = [f"TMA stage {s}" if a == "producer" else a.replace("consumer", "consumer WG ") for a, s in rows]
    ax.set_yticks(list(rows.values()), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (model ticks)")
    busy = tensor_core_busy(run)
    ax.set_title((title + ": " if title else "") + f"tensor cores busy {busy:.0%} of the time", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()], fontsize=7, ncol=5,
              loc="upper right", bbox_to_anchor=(1, 1.35), frameon=False)
    return ax


# ------------------------------------------------------------------ the GPU section's gate
NO_HOPPER = ("The Gluon kernel of this section needs an NVIDIA Hopper GPU (sm_90: H100, H200) and Triton >= 3.6; "
             "it cannot run under Triton's interpreter.")


def hopper_here() -> str:
    """'' when an sm_90 GPU and a Triton with Gluon's Hopper API are here; else the one-line reason."""
    try:
        import torch as _t
        if not _t.cuda.is_available():
            return NO_HOPPER + " This machine has no CUDA GPU."
        major, minor = _t.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            return NO_HOPPER + f" This GPU is sm_{major}{minor}."
        import triton  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
    except ImportError as e:
        return NO_HOPPER + f" ({e.name or e} is missing here.)"
    return ""


def require_hopper() -> bool:
    """True if the GPU section can run; otherwise print its one line and return False (no exception: the CPU
    parts above must run clean everywhere, in nbval and in JupyterLab). The recorded H200 figures are shown by
    the next cell, ``show_recorded_hopper()``, on every machine."""
    why = hopper_here()
    if why:
        print(why + " The figures recorded on an H200 follow.")
        return False
    return True


def show_recorded_hopper(res=None):
    """The recorded H200 figures of this lesson's Gluon kernels (``bench/results/gluon_h200.json``, written by
    ``bench/bench_gluon.py``): the table with its GPU, versions, date and statistic, then the plot. Returns the
    figure (None when nothing is recorded)."""
    res = results.load_gluon() if res is None else res
    if not res or not res.get("rows"):
        print(f"No H200 figures are recorded for this lesson's Gluon forward ({results.GLUON.name} is missing): "
              "none are typed in here.")
        return None
    print(results.gluon_table(res))
    return results.plot_gluon(res)


def bench_gluon_live(shapes=((1, 16, 4096, 128), (2, 32, 4096, 64)), dtype=torch.bfloat16,
                     variants=("one", "ws")):
    """On an sm_90 GPU: a small live version of bench/bench_gluon.py, rows shaped like its record (``meta``,
    ``rows``), so that ``results.gluon_table`` prints them. ``variants``: ``gluon_forward``'s (``"one"``, ``"ws"``,
    ``"pp"``), recorded as ``gluon``, ``gluon_ws``, ``gluon_pp``. Each Gluon variant is checked against float64 first
    (2x SDPA's own error) and timed only when correct; do_bench's median, L2 flushed by do_bench."""
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench

    from .kernels.forward import flash_attn_triton
    from .kernels.gluon_forward import gluon_forward

    def ms(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def sdpa(backend, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        try:
            with sdpa_kernel(b):
                return ms(lambda: F.scaled_dot_product_attention(q, k, v))
        except RuntimeError:                                     # that backend cannot take this shape here
            return None

    rows = []
    for B, H, N, d in shapes:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * B * H * N * N * d
        o64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        sdpa_err = (F.scaled_dot_product_attention(q, k, v).double() - o64).abs().max().item()
        row = {"dtype": str(dtype).replace("torch.", ""), "d": d, "N": N, "B": B, "H": H}
        for var in variants:
            key = "gluon" if var == "one" else f"gluon_{var}"
            o, _ = gluon_forward(q, k, v, variant=var)
            row[f"{key}_pass"] = (o.double() - o64).abs().max().item() <= 2 * sdpa_err + torch.finfo(dtype).eps
            if row[f"{key}_pass"]:
                row[f"{key}_tflops"] = flops / ms(lambda: gluon_forward(q, k, v, variant=var)) / 1e9
        row["triton_tflops"] = flops / ms(lambda: flash_attn_triton(q, k, v)) / 1e9
        for backend in ("flash", "cudnn"):
            t = sdpa(backend, q, k, v)
            row[f"sdpa_{backend}_tflops"] = None if t is None else flops / t / 1e9
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": "now (this notebook)", "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms)",
            "causal": False}
    return {"meta": meta, "rows": rows}


def random_cases(seed: int, n: int):
    """(num_tiles, num_stages, num_consumers) drawn at random, seeded."""
    rng = random.Random(seed)
    return [(rng.randint(1, 13), rng.randint(1, 5), rng.choice((1, 2))) for _ in range(n)]


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

        from .kernels.gluon_forward import _tma_load as tma_load     # the kernels' own version shim
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
    root = Path(__file__).resolve().parent.parent
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
