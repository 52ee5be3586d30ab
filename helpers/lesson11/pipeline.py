"""Lesson 11's pipeline: the operations of a schedule, the barrier simulator and the course's schedule.

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

import operator
import random
from dataclasses import dataclass, field

__all__ = ["wait_full", "wait_empty", "load", "compute", "release", "load_q", "wait_q", "agents", "expected_parity",
           "Violation", "Run", "PROFILES", "checked", "simulate", "first_violation", "fa3_schedule_ref",
           "random_cases"]


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


def load_q() -> tuple:
    """Producer, in the Gluon exercise's replay: issue Q's TMA load (it lands in issue order with the other loads,
    and then completes q_bar's first phase). ``fa3_schedule`` has no Q: ``simulate(..., q=True)`` only."""
    return ("load_q",)


def wait_q() -> tuple:
    """Consumer, in the Gluon exercise's replay: wait until Q has landed (q_bar's phase of parity 0), as the "ws"
    kernel's consumer partition does before its first tile."""
    return ("wait", "q", 0, 0)


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
    if set(schedule) != set(names):                    # keys of any type: ints, strings, both
        keys = [k for k in schedule]
        return Violation("bad_schedule", "", -1, None,
                         f"the schedule's agents are {keys}, expected {names} (num_consumers = {num_consumers})",
                         dict(keys=keys, int_keys=any(not isinstance(k, str) for k in keys)))
    for a in names:
        if not isinstance(schedule[a], (list, tuple)):
            return Violation("bad_schedule", a, -1, None,
                             f"schedule[{a!r}] must be a list of ops, got a {type(schedule[a]).__name__}")
    return None


def _integer(x):
    """``x`` as a Python int when it is an integer of any kind (int, bool, a numpy integer, an integer tensor of one
    element), else None. ``phase = not phase`` and ``np.arange`` give right schedules."""
    try:
        return operator.index(x)
    except TypeError:
        return None


_FIELDS = {"wait": ("stage", "parity"), "load": ("stage", "tile"), "compute": ("stage", "tile"), "release": ("stage",)}


def _check_op(agent, i, op, num_stages, num_tiles, q=False):
    """A Violation for an op that is malformed, out of range, or not this agent's to do, else None. Its ``details``
    say which: ``why`` in not_an_op, not_mine, not_an_integer (with ``field`` and ``value``), parity, stage, tile."""
    def bad(msg, why, **details):
        return Violation("bad_op", agent, i, op if isinstance(op, tuple) else None, msg, dict(why=why, **details))
    if not isinstance(op, tuple) or not op:
        return bad(f"op {i} of {agent} is {op!r}: ops are tuples made by wait_full, wait_empty, load, compute, "
                   "release", "not_an_op")
    producer = agent == "producer"
    kind = op[0]
    if q and op == ("load_q",):
        return None if producer else bad(f"op {i} of {agent} is {op!r}: only the producer loads Q", "not_mine")
    shapes = {"wait": 4, "load": 3, "compute": 3, "release": 2}
    if kind not in shapes or len(op) != shapes[kind] or (kind == "wait" and op[1] not in ("full", "empty", "q")) \
            or (kind == "wait" and op[1] == "q" and not q):
        return bad(f"op {i} of {agent} is {op!r}: not an op (use wait_full, wait_empty, load, compute, release)",
                   "not_an_op")
    numbers = op[2:] if kind == "wait" else op[1:]
    for name, x in zip(_FIELDS[kind], numbers):
        if _integer(x) is None:
            return bad(f"op {i} of {agent} is {op!r}: its {name} is {x!r}, a {type(x).__name__}; stages, tiles and "
                       "parities are integers", "not_an_integer", field=name, value=x)
    if kind == "wait":
        _, bar, s, p = op
        if bar == "q":
            return None if not producer else bad(f"op {i} of {agent} is {op!r}: the consumers wait for Q",
                                                 "not_mine")
        if _integer(p) not in (0, 1):
            return bad(f"op {i} of {agent} waits on parity {p!r}: a parity is 0 or 1", "parity", value=p)
        if (bar == "empty") != producer:
            who = "the producer waits on empty[s] only" if producer else "a consumer waits on full[s] only"
            return bad(f"op {i} of {agent} is {op!r}: {who}", "not_mine")
    elif kind == "load":
        if not producer:
            return bad(f"op {i} of {agent} is {op!r}: only the producer loads", "not_mine")
        j = _integer(op[2])
        if not 0 <= j < num_tiles:
            return bad(f"op {i} of {agent} loads tile {j}: the tiles are 0..{num_tiles - 1}", "tile", value=j)
    elif kind == "compute":
        if producer:
            return bad(f"op {i} of {agent} is {op!r}: the producer only waits on empty[s] and loads", "not_mine")
        j = _integer(op[2])
        if not 0 <= j < num_tiles:
            return bad(f"op {i} of {agent} computes tile {j}: the tiles are 0..{num_tiles - 1}", "tile", value=j)
    elif producer:
        return bad(f"op {i} of {agent} is {op!r}: consumers release stages, the producer fills them", "not_mine")
    s = _integer(op[2] if kind == "wait" else op[1])
    if not 0 <= s < num_stages:
        return bad(f"op {i} of {agent} names stage {s}, but with num_stages = {num_stages} the stages are "
                   f"0..{num_stages - 1}", "stage", value=s)
    return None


def checked(schedule, num_tiles, num_stages, num_consumers, q=False):
    """``(violation, ops)``: the first malformed thing in ``schedule`` (a ``bad_schedule`` or ``bad_op`` Violation),
    else None and the schedule as {agent: list of ops} with every number a Python int, in ``agents()`` order."""
    bad = _check_shape(schedule, num_consumers)
    if bad:
        return bad, None
    names = agents(num_consumers)
    for a in names:
        for i, op in enumerate(schedule[a]):
            bad = _check_op(a, i, op, num_stages, num_tiles, q)
            if bad:
                return bad, None
    return None, {a: [op[:2] + tuple(map(_integer, op[2:])) if op[0] == "wait" else
                      (op[0],) + tuple(map(_integer, op[1:])) for op in schedule[a]] for a in names}


def simulate(schedule, num_tiles, num_stages, num_consumers, load_t=3, gemm_t=2, softmax_t=(3, 3),
             pingpong=False, max_ticks=None, profile="", q=False) -> Run:
    """Execute ``schedule`` tick by tick; stop at the first violation.

    ``schedule``: {"producer": [...], "consumer0": [...], ...} of ops from ``wait_full`` etc. The producer's
    ops take no time (a TMA load is issued and lands ``load_t`` ticks later, loads landing in issue order);
    a consumer's ``compute`` is GEMM0 (``gemm_t``), softmax (``softmax_t[c]``), GEMM1 (``gemm_t``), reading its
    stage throughout; the tensor cores run one GEMM at a time. ``pingpong``: the consumers take turns on the
    tensor cores, one GEMM each (FA3's ping-pong), so one's softmax runs under the other's GEMM.
    Numbers may be any integers (bools, numpy's); ``checked`` says what is malformed. ``q``: the Gluon exercise's
    replay, with Q's barrier: the producer's ``load_q()`` completes q_bar when it lands, a consumer's ``wait_q()``
    waits for it. Returns a ``Run``: its ``violation`` is None when the schedule completed with every tile computed
    by every consumer, in order, and every stage released.
    """
    bad, schedule = checked(schedule, num_tiles, num_stages, num_consumers, q)
    if bad:
        return Run(bad, [], 0, profile)
    names = agents(num_consumers)
    C = num_consumers
    full = [_Barrier(1) for _ in range(num_stages)]
    empty = [_Barrier(C) for _ in range(num_stages)]
    bars = {"full": full, "empty": empty, "q": [_Barrier(1)]}          # q_bar: one arrival, Q's bytes
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
            if s == "q":
                bars["q"][0].arrive()
                continue
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
                        barrier = bars[bar][s]
                        if not barrier.passes(p):
                            if waiting_since[a] is None:
                                waiting_since[a] = t
                            break
                        at_once = waiting_since[a] is None
                        if not at_once:
                            events.append((a, "wait", waiting_since[a], t, s, None))
                        waiting_since[a] = None
                        last_wait[a][bar, s] = (p, i, at_once, uses[a][s])
                    elif kind == "load_q":
                        land = max(t, last_land) + load_t
                        last_land = land
                        in_flight.append((land, "q", None))
                        events.append((a, "load_q", t, land, None, None))
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
                barrier = bars[bar][s]
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


def random_cases(seed: int, n: int):
    """(num_tiles, num_stages, num_consumers) drawn at random, seeded."""
    rng = random.Random(seed)
    return [(rng.randint(1, 13), rng.randint(1, 5), rng.choice((1, 2))) for _ in range(n)]
