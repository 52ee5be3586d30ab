"""Checker of lesson 11, FlashAttention-3's pipeline: the producer/consumer schedule over a ring of stages.

The learner's ``fa3_schedule(num_tiles, num_stages, num_consumers)`` returns the ops of the producer and of
each consumer warpgroup. ``helpers.lesson11.simulate`` executes them against Hopper's mbarrier rule (a wait
on a parity returns once the barrier's phase of that parity has completed) under three timings, and stops at
the first deadlock, race or misuse. This file turns that violation into one verdict and a hint that names
the bug (a stage off by one, a parity that does not flip when the ring wraps, a release before the compute,
a stage released by one consumer only, ...).
"""
from __future__ import annotations

from ..checking import Case, exercise
from ..lesson11 import PROFILES, expected_parity, random_cases, simulate

_FIXED = [
    ("the notebook's walk-through: 7 tiles, 2 stages, 1 consumer", 7, 2, 1),
    ("one tile", 1, 1, 1),
    ("one stage (every tile reuses stage 0)", 5, 1, 1),
    ("fewer tiles than stages (the ring never wraps)", 2, 5, 1),
    ("two consumers (ping-pong): 9 tiles, 3 stages", 9, 3, 2),
    ("two consumers, one stage", 6, 1, 2),
    ("many laps of the ring: 13 tiles, 2 stages, 2 consumers", 13, 2, 2),
    ("13 tiles, 4 stages", 13, 4, 1),
]


def _cases():
    cases = [Case(name, n, s, c) for name, n, s, c in _FIXED]
    cases += [Case(f"random #{i}", n, s, c) for i, (n, s, c) in enumerate(random_cases(111, 24))]
    return cases


def _parity_hint(bar, parity, round_, stage, num_stages):
    """A hint when ``parity`` is not the one the ``round_``-th use of ``stage`` needs; else ''."""
    want = expected_parity(bar, round_)
    if parity == want:
        return ""
    j = round_ * num_stages + stage
    who = "a consumer's wait on full" if bar == "full" else "the producer's wait on empty"
    rule = ("wait_full(s, (j // num_stages) % 2)" if bar == "full"
            else "wait_empty(s, (j // num_stages + 1) % 2)")
    if round_ >= 1 and parity == expected_parity(bar, 0):
        return (f"parity not flipped on wrap: tile {j} is round {round_} of stage {stage} (the ring has wrapped "
                f"{round_} time{'s' if round_ > 1 else ''}), so {who}[{stage}] needs parity {want}, and you "
                f"waited on {parity}, the first lap's. The phase flips each time the ring wraps: {rule}")
    if num_stages > 1 and parity == expected_parity(bar, j):
        return (f"the parity flips every tile instead of every lap of the ring: tile {j} is round {round_} of "
                f"stage {stage}, so {who}[{stage}] needs parity {want} (you used {parity}, from j % 2). Each stage "
                f"has its own barrier, whose phase advances once per lap: {rule}")
    if round_ == 0:
        first = ("0: the first load's completion is the phase of parity 0" if bar == "full" else
                 "1: a fresh barrier is in phase 0, so a wait on parity 1 passes at once (the stage starts empty)")
        return (f"inverted parity: on the first lap {who}[{stage}] takes parity {first}. You waited on {parity}. "
                f"The rule: {rule}")
    return f"wrong parity: tile {j} (round {round_} of stage {stage}) needs {who}[{stage}] parity {want}: {rule}"


def _load_stage(schedule, j):
    """Where the learner's producer loads tile j (None if it never does)."""
    for op in schedule.get("producer", []):
        if isinstance(op, tuple) and len(op) == 3 and op[0] == "load" and op[2] == j:
            return op[1]
    return None


def _releasers(schedule, num_consumers):
    """The consumers that release at least one stage."""
    return [c for c in range(num_consumers)
            if any(isinstance(op, tuple) and op and op[0] == "release" for op in schedule[f"consumer{c}"])]


def _work_hint(schedule, num_tiles, num_consumers) -> str:
    """A hint when the ops (read as written, before any timing) skip or repeat a tile; else ''."""
    def tiles(agent, kind):
        return [op[2] for op in schedule[agent] if isinstance(op, tuple) and len(op) == 3 and op[0] == kind]
    want = list(range(num_tiles))
    if tiles("producer", "load") != want:
        return (f"the producer loads tiles {tiles('producer', 'load')}: every tile 0..{num_tiles - 1} is loaded "
                "once, in order")
    for c in range(num_consumers):
        got = tiles(f"consumer{c}", "compute")
        if got != want:
            return (f"consumer{c} computes tiles {got}: every tile is computed once by each consumer, in order "
                    f"0..{num_tiles - 1} (each consumer owns its own rows of Q and needs every K_j, V_j); a stage "
                    "it skips is never released, so the ring stops")
    return ""


def _hint(v, schedule, num_tiles, num_stages, num_consumers) -> str:
    d = v.details
    if v.kind == "bad_schedule":
        return ("return a dict with one list of ops per agent: {'producer': [...], 'consumer0': [...]} and "
                "'consumer1' when num_consumers = 2 (lesson11.agents(num_consumers) gives the names)")
    if v.kind == "bad_op":
        if "names stage" in v.message:
            return "off by one stage: tile j lives in stage j % num_stages, and the stages are 0..num_stages - 1"
        return "build ops with the helpers: wait_full(s, parity), wait_empty(s, parity), load(s, j), compute(s, j), " \
               "release(s); the producer waits on empty and loads, a consumer waits on full, computes, releases"
    if v.kind in ("read_wrong_tile", "read_before_landed"):
        s, j = d["stage"], d["tile"]
        if s != j % num_stages:
            return (f"off by one stage: tile {j} lives in stage {j} % {num_stages} = {j % num_stages}, and "
                    f"the consumer read stage {s}. Producer and consumers index the ring the same way, "
                    "s = j % num_stages")
        where = _load_stage(schedule, j)
        if where is not None and where != s:
            return (f"the producer loads tile {j} into stage {where}, the consumers read it from stage {s}: "
                    f"both must use s = j % num_stages")
        w = d.get("wait")
        if w is None or w[3] != d["round"]:
            return (f"{v.agent} computed on stage {s} without waiting for its load: wait_full(s, parity) before "
                    "every compute(s, j)")
        return _parity_hint("full", w[0], d["round"], s, num_stages) or \
            "the wait on full[s] passed before the load of this tile landed: check its stage and parity"
    if v.kind in ("overwrite_unreleased", "overwrite_in_flight"):
        s, j = d["stage"], d["tile"]
        if s != j % num_stages:
            return (f"off by one stage: the producer loaded tile {j} into stage {s}, but tile {j} lives in stage "
                    f"{j % num_stages}: s = j % num_stages")
        w = d.get("wait")
        if w is None or w[3] != d["round"]:
            return ("the producer must wait until the consumers released a stage before loading into it again: "
                    "wait_empty(s, parity) before every load(s, j)")
        return _parity_hint("empty", w[0], d["round"], s, num_stages) or \
            "the producer's wait on empty[s] passed before every consumer released the stage: check its parity"
    if v.kind == "release_before_use":
        return ("release a stage only after computing on it: wait_full, compute, then release. Released early, the "
                "producer may overwrite K_j and V_j while the GEMMs still read them")
    if v.kind == "double_release":
        return ("one release per compute: empty[s] completes after num_consumers arrivals, so an extra release "
                "lets the producer overwrite a stage another consumer is still reading")
    if v.kind == "deadlock":
        work = _work_hint(schedule, num_tiles, num_consumers)
        if work:
            return work
        for b in d.get("blocked", []):
            hint = _parity_hint(b["bar"], b["parity"], b["round"], b["stage"], num_stages)
            if hint:
                return hint
        rel = _releasers(schedule, num_consumers)
        if not rel:
            return ("no consumer ever releases a stage, so the producer waits forever for an empty one: "
                    "release(s) after each compute(s, j)")
        if len(rel) < num_consumers:
            return (f"only consumer{rel[0]} releases stages; with {num_consumers} consumers empty[s] completes after "
                    f"{num_consumers} arrivals: every consumer reads every stage and releases it")
        for b in d.get("blocked", []):
            if b["bar"] == "full":
                return ("a consumer waits for a load that never comes: the producer loads tile j into stage "
                        "j % num_stages, and the consumer must wait on full[j % num_stages]")
        return "every wait must be completed by someone: compare each wait's stage and parity with the ring's rule"
    if v.kind == "unreleased_at_end":
        return ("release every stage after computing on it, the last ones too: a persistent kernel reuses the ring "
                "for its next query block, and would wait forever for a stage never released")
    if v.kind == "missing_work":
        return _work_hint(schedule, num_tiles, num_consumers) or (
            "every tile is loaded once (by the producer) and computed once by each consumer, in order "
            "j = 0 .. num_tiles - 1: each consumer owns its own rows of Q and needs every K_j, V_j")
    return ""


@exercise("fa3_schedule", arg_names=["num_tiles", "num_stages", "num_consumers"],
          reference="Hopper's mbarrier rule (helpers.lesson11.simulate)")
def fa3_schedule(g):
    cases = _cases()
    for case in cases:
        num_tiles, num_stages, num_consumers = case.args
        schedule = g.call(case)
        for profile, timing in PROFILES.items():
            run = simulate(schedule, num_tiles, num_stages, num_consumers, profile=profile, **timing)
            v = run.violation
            if v is None:
                continue
            g.case = case
            where = f"{v.agent}, op {v.index} {v.op!r}: " if v.op is not None else ""
            when = f" (timing '{profile}')" if v.kind not in ("bad_schedule", "bad_op") else ""
            g.fail(f"{v.kind.replace('_', ' ')}{when}: {where}{v.message}",
                   hint=_hint(v, schedule, num_tiles, num_stages, num_consumers))
        g.count()
    n = len(cases)
    return (f"{n} schedules (1-13 tiles, 1-5 stages, 1 or 2 consumers) ran clean under {len(PROFILES)} timings "
            "each: no deadlock, no race, every tile loaded once and computed once by every consumer")
