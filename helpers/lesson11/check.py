"""Checker of lesson 11, FlashAttention-3's pipeline: the producer/consumer schedule over a ring of stages.

The learner's ``fa3_schedule(num_tiles, num_stages, num_consumers)`` returns the ops of the producer and of
each consumer warpgroup. ``helpers.lesson11.simulate`` executes them against Hopper's mbarrier rule (a wait
on a parity returns once the barrier's phase of that parity has completed) under three timings, and stops at
the first deadlock, race or misuse: that decides. The hint names the first thing that went wrong in the
learner's own order of operations: a walk of each agent's list against the ring's protocol (tile j in stage
j % num_stages, its wait before its load, wait, compute and release one tile at a time), and only when the
lists follow it, what the timing showed (a stage off by one, a parity that does not flip when the ring wraps,
a stage released by one consumer only, ...). The exact line goes in the fix, shown on ``check.hint``.
The Gluon exercise, ``fa3_producer``, is traced (``producer.trace_producer``) into the same ops.
"""
from __future__ import annotations

import math

from ..checking import Case, exercise
from .pipeline import PROFILES, checked, expected_parity, random_cases, simulate
from .producer import _Smem

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
_RULES = {"full": "wait_full(s, (j // num_stages) % 2)", "empty": "wait_empty(s, (j // num_stages + 1) % 2)"}
_ONE_AT_A_TIME = "for each tile j: wait_full(s, (j // num_stages) % 2), compute(s, j), release(s), with s = j % num_stages"


def _cases():
    cases = [Case(name, n, s, c) for name, n, s, c in _FIXED]
    cases += [Case(f"random #{i}", n, s, c) for i, (n, s, c) in enumerate(random_cases(111, 24))]
    return cases


def _parity_hint(bar, parity, round_, stage, num_stages, tile=None):
    """``(hint, fix)`` when ``parity`` is not the one the ``round_``-th use of ``stage`` needs; else None."""
    want = expected_parity(bar, round_)
    if parity == want:
        return None
    j = round_ * num_stages + stage if tile is None else tile
    who = "a consumer's wait on full" if bar == "full" else "the producer's wait on empty"
    fix = _RULES[bar]
    if round_ >= 1 and parity == expected_parity(bar, 0):
        return (f"parity not flipped on wrap: tile {j} is round {round_} of stage {stage} (the ring has wrapped "
                f"{round_} time{'s' if round_ > 1 else ''}), so {who}[{stage}] needs parity {want}, and you waited on "
                f"{parity}, the first lap's. The phase flips each time the ring wraps", fix)
    if num_stages > 1 and parity == expected_parity(bar, j):
        return (f"the parity flips every tile instead of every lap of the ring: tile {j} is round {round_} of stage "
                f"{stage}, so {who}[{stage}] needs parity {want} (you used {parity}, from j % 2). Each stage has its "
                "own barrier, whose phase advances once per lap", fix)
    if round_ == 0:
        first = ("0: the first load's completion is the phase of parity 0" if bar == "full" else
                 "1: a fresh barrier is in phase 0, so a wait on parity 1 passes at once (the stage starts empty)")
        return f"inverted parity: on the first lap {who}[{stage}] takes parity {first}. You waited on {parity}", fix
    return f"wrong parity: tile {j} (round {round_} of stage {stage}) needs {who}[{stage}] parity {want}, not {parity}", fix


def _tiles(ops, kind):
    return [op[2] for op in ops if op[0] == kind]


def _releasers_hint(ops, num_consumers):
    """(hint, fix) when some consumer never releases a stage; else None."""
    rel = [c for c in range(num_consumers) if any(op[0] == "release" for op in ops[f"consumer{c}"])]
    if not rel:
        return ("no consumer ever releases a stage, so the producer waits forever for an empty one",
                "release(s) after each compute(s, j)")
    if len(rel) < num_consumers:
        return (f"only consumer{rel[0]} releases stages; with {num_consumers} consumers empty[s] completes after "
                f"{num_consumers} arrivals: every consumer reads every stage and releases it",
                "each consumer's list: wait_full, compute(s, j), release(s) for every tile")
    return None


def _work_hint(raw, ops, num_tiles, num_consumers):
    """(hint, fix) when the ops, read as written, load or compute the wrong tiles or in the wrong order; else None."""
    want = list(range(num_tiles))
    got = _tiles(ops["producer"], "load")
    if got != want:
        return (f"the producer loads tiles {got}: every tile 0..{num_tiles - 1} is loaded once, in order",
                "for j in range(num_tiles): ..., load(j % num_stages, j)")
    for c in range(num_consumers):
        got = _tiles(ops[f"consumer{c}"], "compute")
        if got == want:
            continue
        shared = [d for d in range(num_consumers) if d != c and raw[f"consumer{d}"] is raw[f"consumer{c}"]]
        if shared and len(got) > num_tiles:
            return (f"consumer{c} and consumer{shared[0]} are one list object, holding {len(got)} computes: both "
                    f"consumers' ops were appended to it (ops = [] is outside the consumer loop), so each consumer "
                    f"computes every tile {len(got) // num_tiles} times",
                    "for c in range(num_consumers): ops = []; ...; schedule[f'consumer{c}'] = ops")
        if sorted(got) == want:
            return (f"consumer{c} computes the tiles in the order {got}: each consumer computes them in the order the "
                    f"producer loads them, 0..{num_tiles - 1} (a stage holds one tile at a time)",
                    "for j in range(num_tiles): ... compute(j % num_stages, j) ...")
        return (f"consumer{c} computes tiles {got}: every tile is computed once by each consumer, in order "
                f"0..{num_tiles - 1} (each consumer owns its own rows of Q and needs every K_j, V_j); a stage it "
                "skips is never released, so the ring stops", "for j in range(num_tiles): ...")
    return None


def _walk(raw, ops, num_tiles, num_stages, num_consumers, notes=None):
    """(hint, fix) for the first step of the learner's own lists that leaves the ring's protocol; else None.

    Read as written, before any timing, agent by agent: the tiles (``_work_hint``); the producer's k-th load is tile
    k, into the stage the consumers read it from, its wait before it on that stage with that round's parity (lap 0
    may skip it); each consumer waits for tile k, computes it and releases that stage, and never waits for a tile
    whose stage it still holds. Only what is certainly wrong is named (a consistent other stage order, a deferred
    release, a first lap without waits are left to the simulator). ``notes``: {tile: why} for a wait the trace saw
    switched off (``pred=``)."""
    notes = notes or {}
    work = _work_hint(raw, ops, num_tiles, num_consumers)
    if work:
        return work
    S = num_stages
    prod = [op for op in ops["producer"] if op[0] != "load_q"]
    stage_of = {op[2]: op[1] for op in prod if op[0] == "load"}
    read_at = {op[2]: op[1] for c in range(num_consumers) for op in ops[f"consumer{c}"] if op[0] == "compute"}
    before = {}                                            # tile -> the tile before it in the same stage
    last = {}
    for j in range(num_tiles):
        before[j] = last.get(stage_of[j])
        last[stage_of[j]] = j
    rounds = {}
    for j in range(num_tiles):
        rounds[j] = 0 if before[j] is None else rounds[before[j]] + 1

    def late(k):
        return (f"the wait for tile {k} comes after its load: the producer issued load({stage_of[k]}, {k}) and then "
                f"waited on empty[{stage_of[k]}]; a wait guards the load that follows it, so the stage was written "
                "before it was free", "wait_empty(s, (j // num_stages + 1) % 2), then load(s, j)")

    k, waited, had_wait = 0, None, set()
    for i, op in enumerate(prod):
        if op[0] == "wait":
            s, p = op[2], op[3]
            if waited == (s, p):
                continue                                   # the same wait again: harmless
            if k < num_tiles and s == stage_of[k] != read_at.get(k, s) and read_at[k] == k % S:
                # the wait and the load agree on a stage the consumers do not read: the stage, computed before both,
                # is the first thing wrong (j & (S - 1) is j % S only when S is a power of two)
                return (f"the producer loads tile {k} into stage {s} (its wait on empty[{s}] too), the consumers read "
                        f"it from stage {read_at[k]}: both must use the same stage, s = j % num_stages",
                        "s = j % num_stages")
            if k < num_tiles and s == stage_of[k] and p == expected_parity("empty", rounds[k]):
                waited = (s, p)
                had_wait.add(k)
                continue
            if k >= 1 and k - 1 not in had_wait and s == stage_of[k - 1] and \
                    p == expected_parity("empty", rounds[k - 1]):
                return late(k - 1)
            nxt = k + 1                                        # tile k + 1's wait, one tile early?
            if (stage_of.get(nxt, nxt % S), expected_parity("empty", rounds.get(nxt, nxt // S))) == (s, p) and \
                    (k >= num_tiles or s != stage_of[k] or p != expected_parity("empty", rounds[k])):
                return (f"the producer waits for tile {nxt}'s stage (empty[{s}], parity {p}) before loading tile {k}: "
                        f"the wait before a load is that tile's own, on the stage it loads into",
                        "s = j % num_stages; wait_empty(s, (j // num_stages + 1) % 2); load(s, j)")
            if k >= num_tiles:
                return (f"the producer waits on empty[{s}] after its last load (tile {num_tiles - 1}): a wait frees "
                        "the stage for the load that follows it", "wait_empty(s, parity) only before a load(s, j)")
            if s != stage_of[k]:
                return (f"the producer waits on empty[{s}] before loading tile {k} into stage {stage_of[k]}: the wait "
                        "that frees a stage is on that stage, right before the load into it",
                        "s = j % num_stages; wait_empty(s, (j // num_stages + 1) % 2); load(s, j)")
            return _parity_hint("empty", p, rounds[k], s, S, tile=k)
        s, j = op[1], op[2]                                # a load; the work check made j == k
        if read_at.get(j, s) != s and read_at[j] == j % S:
            return (f"the producer loads tile {j} into stage {s}, the consumers read it from stage {read_at[j]}: "
                    "both must use the same stage, s = j % num_stages", "load(j % num_stages, j)")
        if waited is None and rounds[k] >= 1:
            nxt = next((o for o in prod[i + 1:]), None)
            if nxt is not None and nxt[0] == "wait" and nxt[2] == s and nxt[3] == expected_parity("empty", rounds[k]):
                return late(k)
            if k in notes:
                return (f"the producer loads tile {k} into stage {s} without waiting for it: {notes[k]}, so the copy "
                        f"overwrites tile {before[k]} while the consumer may still read it (a race)",
                        "wait on every tile past the first lap: pred=j >= NUM_STAGES, or no pred= at all")
            return (f"the producer loads tile {k} into stage {s} without waiting for the consumers to release it (tile "
                    f"{before[k]} was there): it must wait until the stage is free before loading into it again",
                    "wait_empty(s, parity) before every load(s, j)")
        waited = None
        k += 1
    for c in range(num_consumers):
        a = f"consumer{c}"
        w, k, held, released, prev = 0, 0, {}, set(), None
        for i, op in enumerate(ops[a]):
            kind = op[0]
            if kind == "wait" and op[1] == "q":
                continue
            if kind == "wait":
                s, p = op[2], op[3]
                if prev is not None and prev == op:
                    continue
                t = w
                if t >= num_tiles:
                    return (f"{a} waits on full[{s}] after its last tile: each consumer waits once per tile",
                            _ONE_AT_A_TIME)
                if s != stage_of[t]:
                    return (f"off by one stage: tile {t} lives in stage {t} % {S} = {stage_of[t]}, and {a} waited on "
                            f"full[{s}]. Producer and consumers index the ring the same way",
                            "s = j % num_stages") if stage_of[t] == t % S else None
                bad = _parity_hint("full", p, rounds[t], s, S, tile=t)
                if bad:
                    return bad
                b = before[t]
                if b is not None and b not in released:
                    if b < k:
                        return _releasers_hint(ops, num_consumers) or (
                            f"{a} waits for tile {t} in stage {s} while it still holds stage {s} (tile {b}, computed "
                            f"and not yet released): the producer can load tile {t} there only after every consumer "
                            "released it, so the ring stops. Release each stage right after computing on it",
                            _ONE_AT_A_TIME)
                    return (f"{a} waits for tile {t} before computing tile {b}: tile {t} goes into stage {s}, which "
                            f"the producer refills only after {a} computed and released tile {b}. Wait, compute and "
                            "release one tile at a time", _ONE_AT_A_TIME)
                w += 1
            elif kind == "compute":
                s = op[1]
                if w <= k:
                    return (f"{a} computed on stage {s} (tile {k}) without waiting for its load",
                            "wait_full(s, (j // num_stages) % 2) before every compute(s, j)")
                if s != stage_of[k]:
                    return (f"off by one stage: tile {k} lives in stage {k} % {S} = {stage_of[k]}, and {a} computed "
                            f"on stage {s}", "s = j % num_stages") if stage_of[k] == k % S else None
                held[s] = k
                k += 1
            else:
                s = op[1]
                if s in held:
                    released.add(held.pop(s))
                elif held:
                    t = max(held.values())
                    return (f"{a} released stage {s} after computing tile {t} on stage {stage_of[t]}: release the "
                            "stage it just read, so that the producer refills that one",
                            "compute(s, j), then release(s) with the same s")
                elif prev is not None and prev[0] == "release" and prev[1] == s:
                    return ("one release per compute: empty[s] completes after num_consumers arrivals, so an extra "
                            "release lets the producer overwrite a stage another consumer is still reading",
                            _ONE_AT_A_TIME)
                else:
                    return ("release a stage only after computing on it: wait_full, compute, then release. Released "
                            "early, the producer may overwrite K_j and V_j while the GEMMs still read them",
                            _ONE_AT_A_TIME)
            prev = op
    return None


def _sim_hint(v, ops, num_tiles, num_stages, num_consumers):
    """(hint, fix) from what the simulation showed, for lists that follow the protocol as written."""
    d = v.details
    if v.kind in ("read_wrong_tile", "read_before_landed"):
        s = d["stage"]
        w = d.get("wait")
        if w is None or w[3] != d["round"]:
            return (f"{v.agent} computed on stage {s} without waiting for its load",
                    "wait_full(s, parity) before every compute(s, j)")
        return _parity_hint("full", w[0], d["round"], s, num_stages) or \
            ("the wait on full[s] passed before the load of this tile landed: compare its stage and parity with the "
             "ring's rule", _RULES["full"])
    if v.kind in ("overwrite_unreleased", "overwrite_in_flight"):
        w = d.get("wait")
        if w is None or w[3] != d["round"]:
            return ("the producer must wait until the consumers released a stage before loading into it again",
                    "wait_empty(s, parity) before every load(s, j)")
        return _parity_hint("empty", w[0], d["round"], d["stage"], num_stages) or \
            ("the producer's wait on empty[s] passed before every consumer released the stage: check its parity",
             _RULES["empty"])
    if v.kind == "release_before_use":
        return ("release a stage only after computing on it: wait_full, compute, then release. Released early, the "
                "producer may overwrite K_j and V_j while the GEMMs still read them", _ONE_AT_A_TIME)
    if v.kind == "double_release":
        return ("one release per compute: empty[s] completes after num_consumers arrivals, so an extra release lets "
                "the producer overwrite a stage another consumer is still reading", _ONE_AT_A_TIME)
    if v.kind == "deadlock":
        blocked = d.get("blocked", [])
        if any(b["bar"] == "q" for b in blocked):
            return ("the consumer waits for Q (q_bar) before its first tile, and your producer copies Q only after a "
                    "wait on empty[s] that needs that consumer's release (the first wait past the first lap): "
                    "nothing is ever released. Copy Q first, before the loop",
                    "mbarrier.expect(q_bar, q_desc.block_type.nbytes); tma_load(q_desc, [q_row, 0], q_bar, q_smem), "
                    "then the loop")
        for b in blocked:
            found = _parity_hint(b["bar"], b["parity"], b["round"], b["stage"], num_stages)
            if found:
                return found
        found = _releasers_hint(ops, num_consumers)
        if found:
            return found
        if any(b["bar"] == "full" for b in blocked):
            return ("a consumer waits for a load that never comes: the producer loads tile j into stage "
                    "j % num_stages, and the consumer must wait on full[j % num_stages]", "s = j % num_stages")
        return ("every wait must be completed by someone: compare each wait's stage and parity with the ring's rule",
                f"{_RULES['empty']}; {_RULES['full']}")
    if v.kind == "unreleased_at_end":
        return ("release every stage after computing on it, the last ones too: a persistent kernel reuses the ring "
                "for its next query block, and would wait forever for a stage never released", _ONE_AT_A_TIME)
    return ("every tile is loaded once (by the producer) and computed once by each consumer, in order "
            "j = 0 .. num_tiles - 1: each consumer owns its own rows of Q and needs every K_j, V_j", _ONE_AT_A_TIME)


def _bad_hint(v, num_stages):
    """(hint, fix) for a malformed schedule or op (``checked``'s Violation)."""
    d = v.details
    if v.kind == "bad_schedule":
        if d.get("int_keys"):
            return ("the keys are the agents' names, 'producer', 'consumer0', ... (strings), not numbers",
                    "{'producer': [...], **{f'consumer{c}': [...] for c in range(num_consumers)}}, or "
                    "lesson11.agents(num_consumers) for the names")
        return ("return a dict with one list of ops per agent: 'producer', 'consumer0' and 'consumer1' when "
                "num_consumers = 2", "lesson11.agents(num_consumers) gives the names")
    why = d.get("why")
    if why == "stage":
        return ("off by one stage: tile j lives in stage j % num_stages, and the stages are 0..num_stages - 1",
                "s = j % num_stages")
    if why == "tile":
        return "the tiles are 0..num_tiles - 1", "for j in range(num_tiles)"
    if why == "parity":
        return (f"parity {d['value']!r} is not a parity: a barrier's phase parity is 0 or 1, so take the lap % 2",
                f"{_RULES['empty']}; {_RULES['full']}")
    if why == "not_an_integer":
        x, name = d["value"], d["field"]
        if isinstance(x, str):
            return (f"the {name} is the string {x!r}: stages, tiles and parities are integers",
                    "build ops with the helpers, from ints: load(s, j), not load('0', j)")
        try:
            value = float(x)
        except (TypeError, ValueError):
            value = None
        if value is not None and math.isnan(value):
            return f"the {name} is NaN: stages, tiles and parities are integers", _RULES["full"]
        if value is not None:
            return (f"the {name} {x!r} is a float (from % 2.0, / or a float lap): stages, tiles and parities are "
                    "integers", "integer division and remainder: s = j % num_stages, r = j // num_stages, parity "
                    "(r + 1) % 2 or r % 2")
        return (f"the {name} is a {type(x).__name__}: stages, tiles and parities are integers",
                "int(x) when it comes from a tensor or an array")
    if why == "not_mine":
        return ("the producer waits on empty[s] and loads; a consumer waits on full[s], computes and releases",
                "wait_empty and load in schedule['producer']; wait_full, compute, release in each consumer's list")
    return ("build ops with the helpers: wait_full(s, parity), wait_empty(s, parity), load(s, j), compute(s, j), "
            "release(s); the producer waits on empty and loads, a consumer waits on full, computes, releases",
            "from helpers.lesson11 import wait_full, wait_empty, load, compute, release")


def _hint(v, raw, ops, num_tiles, num_stages, num_consumers, notes=None):
    """(hint, fix) for the Violation ``v``: what is malformed, else the first step of the learner's own lists that
    leaves the protocol, else what the timing showed."""
    if v.kind in ("bad_schedule", "bad_op"):
        return _bad_hint(v, num_stages)
    return _walk(raw, ops, num_tiles, num_stages, num_consumers, notes) or \
        _sim_hint(v, ops, num_tiles, num_stages, num_consumers)


@exercise("fa3_schedule", arg_names=["num_tiles", "num_stages", "num_consumers"],
          reference="Hopper's mbarrier rule (helpers.lesson11.simulate)")
def fa3_schedule(g):
    cases = _cases()
    for case in cases:
        num_tiles, num_stages, num_consumers = case.args
        schedule = g.call(case)
        bad, ops = checked(schedule, num_tiles, num_stages, num_consumers)
        for profile, timing in PROFILES.items():
            run = simulate(schedule, num_tiles, num_stages, num_consumers, profile=profile, **timing)
            v = run.violation
            if v is None:
                continue
            g.case = case
            where = f"{v.agent}, op {v.index} {v.op!r}: " if v.op is not None else ""
            when = f" (timing '{profile}')" if v.kind not in ("bad_schedule", "bad_op") else ""
            hint, fix = _hint(v, schedule, ops, num_tiles, num_stages, num_consumers)
            g.fail(f"{v.kind.replace('_', ' ')}{when}: {where}{v.message}", hint=hint, fix=fix)
        g.count()
    n = len(cases)
    return (f"{n} schedules (1-13 tiles, 1-5 stages, 1 or 2 consumers) ran clean under {len(PROFILES)} timings "
            "each: no deadlock, no race, every tile loaded once and computed once by every consumer")


# ------------------------------------------------------------------ the producer warp, in Gluon
# (name, n_tiles, NUM_STAGES, BLOCK_N, q_row, kv_row): the schedules above with one consumer (the "ws" kernel has
# one consumer partition), each with a query block and a KV head that do not start at row 0 (a producer that
# forgets kv_row, GQA's KV head, loads head 0's keys), and both tile widths the kernel uses.
_PRODUCER_FIXED = [(name, n, s) for name, n, s, c in _FIXED if c == 1] + [
    ("two stages, many laps", 11, 2), ("three stages, 9 tiles", 9, 3)]
_FIRST_PROGRAM = ("the first program: q_row = kv_row = 0, 6 tiles, 2 stages", 6, 2, 64, 0, 0)
_PRODUCER_ARGS = ["n_tiles", "NUM_STAGES", "BLOCK_N", "q_row", "kv_row"]
_DIMS = (64, 128)                        # the head dims of the trace, case by case (bytes per tile: BLOCK_N x d x 2)
_BLOCK_M = 128
_EXPECT_BOTH = "mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)"
_Q_FIRST = ("mbarrier.expect(q_bar, q_desc.block_type.nbytes); tma_load(q_desc, [q_row, 0], q_bar, q_smem), before "
            "the loop")


def _pcase(name, n_tiles, num_stages, block_n, q_row, kv_row, d):
    c = Case(name, n_tiles, num_stages, block_n, q_row, kv_row, note=f"head dim d = {d}: a tile is BLOCK_N x d x 2 bytes")
    c.d = d
    return c


def _producer_cases():
    """Rows where the kernel puts them: q_row = (batch, head) * N + the query block, kv_row = (batch, KV head) * Nk,
    so with a ragged N or Nk neither is a multiple of a tile (some cases here are not); d = 64 and 128 by turns."""
    cases = [_pcase(name, n, s, (64, 128)[i % 2], 384 + 128 * i + 3 * (i % 2), 3 * 1024 + 512 * (i % 3) + 40 * (i % 2),
                    _DIMS[(i // 2) % 2])
             for i, (name, n, s) in enumerate(_PRODUCER_FIXED)]
    cases += [_pcase(f"random #{i}", n, s, (64, 128)[i % 2], 128 * (i + 1), 2048 * (i % 4 + 1) + 17 * (i % 3),
                     _DIMS[(i // 2) % 2])
              for i, (n, s, c) in enumerate(random_cases(112, 40)) if c == 1]
    return cases + [_pcase(*_FIRST_PROGRAM, _DIMS[0])]


def _in_gluon(text: str) -> str:
    """A simulator hint or fix in the Gluon exercise's words."""
    for sim, gl in (("wait_empty(s, (j // num_stages + 1) % 2), then load(s, j)",
                     "mbarrier.wait(empty.index(s), (j // NUM_STAGES + 1) % 2), then the expect and the two copies"),
                    ("wait_empty(s, (j // num_stages + 1) % 2)", "mbarrier.wait(empty.index(s), (j // NUM_STAGES + 1) % 2)"),
                    ("wait_empty(s, parity) before every load(s, j)",
                     "mbarrier.wait(empty.index(s), parity) before the loads into stage s"),
                    ("load(j % num_stages, j)", "k_smem.index(j % NUM_STAGES), v_smem.index(j % NUM_STAGES), "
                                                "full.index(j % NUM_STAGES)"),
                    ("for j in range(num_tiles): ..., load(j % num_stages, j)", "for j in range(n_tiles): ..."),
                    ("num_tiles", "n_tiles"), ("s = j % num_stages", "s = j % NUM_STAGES"),
                    ("num_stages", "NUM_STAGES")):
        text = text.replace(sim, gl)
    return text


class _Misuse(Exception):
    """A use of the barriers or the TMA that the simulator does not model: (what, hint, fix)."""


def _producer_ops(events, n_tiles, num_stages, block_n, q_row, kv_row, d=_DIMS[0]):
    """The traced events as the simulator's producer ops (wait_empty, load, load_q) and notes for its hints ({tile:
    why its wait is missing}), after checking what the simulator takes on trust: each TMA copy's source row,
    destination, barrier and the bytes each barrier expects, in the producer's own order."""
    from .pipeline import load as load_op, load_q, wait_empty
    tile_bytes, q_bytes = block_n * d * 2, _BLOCK_M * d * 2
    ops, notes, fills, q = [], {}, {}, {"expect": 0, "loads": 0, "src": set(), "skipped": False}
    copies = {"k_desc": 0, "v_desc": 0}                  # K and V copies so far: the k-th of each is tile k
    skipped = {"wait": False, "copy": set(), "expect": set()}

    def close(s, fill, why):
        """Stage s's fill is over (``why``): it must have K_j, V_j and an expect of both tiles' bytes."""
        j = fill["k"] if fill["k"] is not None else fill["v"]
        if j is None:                                      # an expect, and no copy after it
            off = any(st == s for _, st in skipped["copy"])
            raise _Misuse((f"full.index({s}) expects {fill['expect']} bytes that no copy brings" +
                           (": the copies' pred= was False, the expect's was not" if off else f" ({why})"),
                           "full[s] never completes: the consumer waits forever (a hang on a GPU). A pred= must "
                           "switch off a tile's expect and both its copies together", "one predicate, pred=j < n_tiles, "
                           "on the expect and both copies"))
        if fill["k"] is None or fill["v"] is None:
            miss = "K" if fill["k"] is None else "V"
            if ({"K": "k_desc", "V": "v_desc"}[miss], s) in skipped["copy"]:
                raise _Misuse((f"stage {s} got tile {j}'s {'V' if miss == 'K' else 'K'} but not its {miss}: its copy's "
                               f"pred= was False for tile {j}",
                               f"the expect counts both tiles' bytes, so full.index({s}) never completes: the consumer "
                               "waits forever (a hang on a GPU). A pred= must switch off a tile's expect and both its "
                               "copies together, or none of them", "one predicate for the expect and both copies"))
            raise _Misuse((f"stage {s} got tile {j}'s {'V' if miss == 'K' else 'K'} but not its {miss} ({why})",
                           "each tile is two TMA copies into the same stage, K_j into k_smem.index(s) and V_j into "
                           "v_smem.index(s), both completing full.index(s); the consumer reads both",
                           "tma_load(k_desc, [row, 0], full.index(s), k_smem.index(s)) and the same for v"))
        if fill["expect"] is None:
            off = " (its pred= was False for this tile)" if s in skipped["expect"] else ""
            raise _Misuse((f"stage {s}: tile {j}'s loads have no mbarrier.expect on full.index({s}){off}",
                           "full[s] completes when its one arrival and the expected bytes are in, and the arrival "
                           "is the expect's. Without it the consumer waits forever: a hang on a GPU", _EXPECT_BOTH))
        if fill["src"] == "q_desc":
            raise _Misuse((f"stage {s} (tile {j}): full.index({s}) expects q_desc's bytes, Q's block of {_BLOCK_M} rows"
                           + (" (the same number here, by chance)" if fill["expect"] == 2 * tile_bytes else ""),
                           "full[s] counts the bytes of K_j and V_j, two blocks of BLOCK_N rows; Q's block is "
                           "BLOCK_M rows, and with another BLOCK_N the counts differ", _EXPECT_BOTH))
        if fill["expect"] != 2 * tile_bytes:
            other_d = fill["expect"] / (4 * block_n)          # the head dim for which the count is two tiles
            if other_d in _DIMS and other_d != d:             # the kernel runs at d = 64 and 128
                raise _Misuse((f"stage {s} (tile {j}): full.index({s}) expects {fill['expect']} bytes: two tiles at "
                               f"d = {int(other_d)}" + (" (or one at this d)" if fill["expect"] == tile_bytes else "")
                               + f", but this case's head dim is d = {d} ({2 * tile_bytes} bytes)",
                               "a byte count written for one head dim: the bytes of a tile are BLOCK_N x d x 2, so "
                               "read them from the descriptors (the kernel runs at d = 64 and 128)", _EXPECT_BOTH))
            if fill["expect"] == tile_bytes:
                what = "one tile's bytes (K's or V's alone)"
                then = ("full[s] completes as soon as the first copy lands, and the consumer reads the other "
                        "half-written; the rest of the bytes count against the next phase")
            elif fill["expect"] > 2 * tile_bytes:
                what = f"{fill['expect']} bytes, more than the two copies bring ({2 * tile_bytes})"
                then = "full[s] never completes: the consumer waits forever (a hang on a GPU)"
            else:
                what = f"{fill['expect']} bytes, fewer than the two copies bring ({2 * tile_bytes})"
                then = "full[s] completes before both copies landed: the consumer reads a half-written stage"
            raise _Misuse((f"stage {s} (tile {j}): full.index({s}) expects {what}", f"{then}. Expect both tiles",
                           _EXPECT_BOTH))

    for ev in events:
        kind = ev[0]
        if kind == "skip":
            inner = ev[1]
            if inner[0] == "wait":
                skipped["wait"] = True
            elif inner[0] == "expect":
                if inner[1].name == "q_bar":
                    q["skipped"] = True
                else:
                    skipped["expect"].add(inner[1].stage)
            elif inner[0] == "load":
                if inner[1] == "q_desc":
                    q["skipped"] = True
                else:
                    skipped["copy"].add((inner[1], inner[4].stage))
            continue
        bar = ev[3] if kind == "load" else ev[1]
        if kind == "wait":
            if bar.name != "empty":
                raise _Misuse((f"the producer waits on {bar!r}", "the producer waits only on empty.index(s) (a "
                               "stage is free); full[s] and q_bar are the consumer's to wait on, and the TMA "
                               "completes them", "mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)"))
            if ev[2] not in (0, 1):
                raise _Misuse((f"mbarrier.wait({bar!r}, {ev[2]}): a phase parity is 0 or 1", "take the lap % 2",
                               "((j // NUM_STAGES) & 1) ^ 1"))
            ops.append(wait_empty(bar.stage, ev[2]))
            skipped["wait"] = False
        elif kind == "arrive":
            raise _Misuse((f"the producer arrives on {bar!r}",
                           "the producer never arrives: the TMA's bytes complete full[s] and q_bar (after the "
                           "expect's arrival), and the consumer arrives on empty[s] when it is done reading. An "
                           "arrival from the producer completes a phase nobody finished", "no mbarrier.arrive"))
        elif kind == "expect" and bar.name == "q_bar":
            q["expect"] += ev[2]
            q["src"].add(ev[3])
        elif kind == "expect" and bar.name == "full":
            fill = fills.setdefault(bar.stage, {"expect": None, "src": None, "k": None, "v": None})
            if fill["expect"] is not None:                      # told apart at the stage's next copy
                fill["extra"] = True
                continue
            fill["expect"], fill["src"] = ev[2], ev[3]
        elif kind == "expect":
            raise _Misuse((f"mbarrier.expect on {bar!r}", "expect is for barriers the TMA completes by bytes: q_bar "
                           "and full.index(s); empty[s] completes by the consumer's arrival", _EXPECT_BOTH))
        elif kind == "load" and ev[1] == "q_desc":
            if ev[4] != _Smem("q_smem") or bar.name != "q_bar" or ev[2] != (q_row, 0):
                missing = " (q_row is missing)" if ev[2] == (0, 0) and q_row != 0 else ""
                raise _Misuse((f"Q's TMA copy: tma load(q_desc, {list(ev[2])}, {bar!r}, {ev[4]!r}){missing}",
                               "Q is loaded once, from this program's query block (q_row), into q_smem, completing "
                               "q_bar", "tma_load(q_desc, [q_row, 0], q_bar, q_smem), after "
                               "mbarrier.expect(q_bar, q_desc.block_type.nbytes)"))
            q["loads"] += 1
            ops.append(load_q())
        else:                                                    # K_j or V_j
            desc, (row, col), dest = ev[1], ev[2], ev[4]
            ring = {"k_desc": "k_smem", "v_desc": "v_smem"}[desc]
            if dest.name != ring or dest.stage is None:
                raise _Misuse((f"{desc}'s tile lands in {dest!r}", "K_j goes to k_smem.index(s) and V_j to "
                               "v_smem.index(s), with s = j % NUM_STAGES: each descriptor into its own ring",
                               "tma_load(k_desc, [row, 0], full.index(s), k_smem.index(s)); "
                               "tma_load(v_desc, [row, 0], full.index(s), v_smem.index(s))"))
            if bar.name != "full" or bar.stage != dest.stage:
                raise _Misuse((f"the copy into {dest!r} completes {bar!r}",
                               "a stage's copies go into that stage's buffers and complete that stage's barrier: "
                               "full.index(s) with k_smem.index(s) and v_smem.index(s), the same s = j % NUM_STAGES", f"tma_load({desc}, [row, 0], full.index(s), {ring}.index(s))"))
            off, k = row - kv_row, copies[desc]
            if col == 0 and off == n_tiles * block_n and k == n_tiles:
                raise _Misuse((f"{desc} copied from row {row}, tile {n_tiles} of a head of {n_tiles} tiles: the loop "
                               "copies one tile past the last", "the tiles are j = 0 .. n_tiles - 1",
                               "for j in range(n_tiles)"))
            if col == 0 and q_row != kv_row and row == q_row + k * block_n:
                raise _Misuse((f"{desc} copied from row {row} = q_row + {k} * BLOCK_N: the query block's row, not "
                               f"the KV head's (kv_row = {kv_row})", "K and V start at kv_row, where this (batch, KV "
                               "head)'s keys are in the [B*Hkv*Nk, d] view; q_row is where the query block starts in "
                               "Q's", "tma_load(k_desc, [kv_row + j * BLOCK_N, 0], full.index(s), k_smem.index(s))"))
            if col != 0 or off % block_n or not 0 <= off // block_n < n_tiles:
                lost = (col == 0 and row % block_n == 0 and 0 <= row // block_n < n_tiles and kv_row != 0)
                raise _Misuse((f"{desc} copied from row {row}, column {col}: no tile of this head starts there "
                               f"(kv_row = {kv_row}, BLOCK_N = {block_n})",
                               "kv_row is missing: it is where this (batch, KV head)'s keys start in the [B*Hkv*Nk, "
                               "d] view; without it every head reads the first head's keys" if lost else
                               "a tile of this head starts at row kv_row + j * BLOCK_N, column 0",
                               "tma_load(k_desc, [kv_row + j * BLOCK_N, 0], full.index(s), k_smem.index(s))"))
            j, s = off // block_n, dest.stage
            fill = fills.setdefault(s, {"expect": None, "src": None, "k": None, "v": None})
            key = "k" if desc == "k_desc" else "v"
            if fill[key] is not None:
                close(s, fill, "another copy came into the stage")
                fill = fills[s] = {"expect": None, "src": None, "k": None, "v": None}
            other = fill["v" if key == "k" else "k"]
            if fill.get("extra") and other == j:
                raise _Misuse((f"two expects on full.index({s}) for tile {j}, one for each copy",
                               "full[s] counts one arrival, and each expect is one: the first expect's phase completes "
                               "as soon as its bytes land, the other copy still in flight, and the second expect "
                               "arrives on the next phase. One expect with both tiles' bytes", _EXPECT_BOTH))
            if other is not None and other != j:
                raise _Misuse((f"stage {s} got K_{fill['k'] if key == 'v' else j} and V_{fill['v'] if key == 'k' else j}",
                               "K_j and V_j go into the same stage together: one tile index j for both copies",
                               "row = kv_row + j * BLOCK_N for both copies"))
            if j != k and other is None:
                name = desc[0].upper()
                if j == s:
                    raise _Misuse((f"{desc} copied tile {j} (row {row}) where tile {k} comes next: the row uses the "
                                   f"stage index s = {s}, not the tile's j = {k}",
                                   "stage s holds tile j, but the tile's keys are at its own row: "
                                   f"{name}_{k} starts at kv_row + {k} * BLOCK_N", "row = kv_row + j * BLOCK_N"))
                raise _Misuse((f"{desc} copied tile {j} (row {row}) where tile {k} comes next",
                               "the producer copies the tiles in order, 0 .. n_tiles - 1, tile j from row "
                               "kv_row + j * BLOCK_N", "row = kv_row + j * BLOCK_N"))
            copies[desc] += 1
            if other is None:
                if skipped["wait"]:
                    notes[j] = f"its mbarrier.wait's pred= was False for j = {j}"
                ops.append(load_op(s, j))                        # the stage is written from the first copy on
            skipped["wait"] = False
            fill[key] = j
            if fill["k"] is not None and fill["v"] is not None and fill["expect"] is not None:
                close(s, fill, "")
                del fills[s]
    for s, fill in sorted(fills.items()):
        close(s, fill, "at the end")
    if q["loads"] != 1:
        off = " (its pred= was False)" if q["skipped"] and not q["loads"] else ""
        raise _Misuse((f"Q was loaded {q['loads']} times{off}", "Q is loaded once, before the loop: the consumer "
                       "partition waits on q_bar before its first tile and keeps Q in q_smem for all of them", _Q_FIRST))
    if q["expect"] != q_bytes:
        whose = next((s for s in q["src"] if s in ("k_desc", "v_desc")), None)
        raise _Misuse((f"q_bar expects {q['expect']} bytes" + (f" ({whose}'s)" if whose else "") +
                       f"; Q's tile has {q_bytes}", "q_bar completes when its one arrival (the expect) and Q's "
                       "bytes are in: expect Q's block once, with Q's copy",
                       "mbarrier.expect(q_bar, q_desc.block_type.nbytes)"))
    return ops, notes


def _compile_hint(error: str) -> str:
    if "has been removed" in error and "async_load" in error:
        return ("this Triton removed tma.async_copy_global_to_shared (Triton 3.6's name): its TMA load is "
                "tma.async_load, which tma_load is here")
    if "NameError" in error or "is not defined" in error:
        return ("a name your producer uses is not in the module the compile rebuilds from your sources: it carries "
                "the modules and functions you imported, your constexpr globals and your own @gluon.jit helpers, "
                "nothing computed in another cell (pass it through the producer's arguments, or make it a "
                "gl.constexpr global)")
    return "Triton's compiler rejected it here: its message above names the line and column (counted from your def)"


@exercise("fa3_producer", arg_names=_PRODUCER_ARGS,
          reference="Hopper's mbarrier rule (helpers.lesson11.simulate) and float64 attention")
def fa3_producer(g):
    from .hopper import hopper_here
    from .pipeline import fa3_schedule_ref, wait_q
    from .producer import TraceError, gluon_here, trace_producer
    producer = g.learner_fn
    cases = _producer_cases()

    def traced(n_tiles, num_stages, block_n, q_row, kv_row, d=_DIMS[0]):
        try:
            return trace_producer(producer, n_tiles, num_stages, block_n=block_n, d=d, q_row=q_row, kv_row=kv_row,
                                  block_m=_BLOCK_M)
        except TraceError as e:
            return e

    for case in cases:
        n_tiles, num_stages, block_n, q_row, kv_row = case.args
        d = case.d                                        # set by _pcase
        events = g.call(case, fn=lambda *a, d=d: traced(*a, d=d))
        if isinstance(events, TraceError):
            g.fail(f"the trace stopped: {events}", hint=events.hint or "write the producer with mbarrier.expect / "
                   "mbarrier.wait, the TMA load and index(s) on the rings, as the exercise's table shows",
                   fix=events.fix)
        try:
            ops, notes = _producer_ops(events, n_tiles, num_stages, block_n, q_row, kv_row, d)
        except _Misuse as e:
            what, hint, fix = e.args[0]
            g.fail(what, hint=hint, fix=fix)
        schedule = {"producer": ops, "consumer0": [wait_q()] + fa3_schedule_ref(n_tiles, num_stages, 1)["consumer0"]}
        for profile, timing in PROFILES.items():
            v = simulate(schedule, n_tiles, num_stages, 1, profile=profile, q=True, **timing).violation
            if v is not None:
                hint, fix = _hint(v, schedule, schedule, n_tiles, num_stages, 1, notes)
                g.fail(f"{v.kind.replace('_', ' ')} (timing '{profile}'): {v.message}", hint=_in_gluon(hint),
                       fix=_in_gluon(fix))
        g.count()
    summary = (f"{len(cases)} traced runs (1-13 tiles, 1-5 stages) ran clean with the course's consumer (Q first, then "
               f"each tile) under {len(PROFILES)} timings, every TMA copy from the right row into the right stage with "
               "its bytes expected")
    if not hopper_here():                                        # an sm_90 GPU: run it for real
        return summary + "; " + _run_natively(g, producer)
    if not gluon_here():
        return summary + (" (no Triton with Gluon here: the compile for sm_90 needs Linux with Triton >= 3.6, the "
                          "native run an sm_90 GPU)")
    from .producer import compile_producer_for_sm90
    built = compile_producer_for_sm90(producer)
    if not built["ok"]:
        g.case = None
        g.fail(f"the 'ws' kernel with your producer does not compile for sm_90: {built['error']}",
               hint=_compile_hint(built["error"]))
    return summary + "; the 'ws' kernel with it compiles for sm_90 (Triton's compiler, no GPU; run this cell on an " \
                     "H100 or H200 to run it)"


def _run_natively(g, producer) -> str:
    """On an sm_90 GPU: gluon_forward's "ws" kernel with the learner's producer, against float64, in a child process
    with a time limit per case (``producer.run_producer_natively``)."""
    from .producer import run_producer_natively
    result = run_producer_natively(producer)
    g.case = None
    done = len(result["rows"])
    if "timeout" in result:
        g.fail(f"on this GPU the 'ws' kernel with your producer did not finish: after {done} case"
               f"{'s' if done != 1 else ''} of the self-test, the next ran past {result['timeout']:g} s, so the check "
               "killed its process (a likely deadlock: a wait whose phase never completes, or an expect whose bytes "
               "never all arrive)",
               hint="the trace passed, so look at what it cannot see: a value the GPU computes differently from "
                    "Python (an integer overflow in a row, a float where an int belongs), a predicate or a loop bound "
                    "read from GPU memory. If the GPU is only slow to compile, COURSE_NATIVE_TIMEOUT (seconds) "
                    "raises the limit")
    if "error" in result:
        g.fail(f"on this GPU the 'ws' kernel with your producer stopped its process after {done} case"
               f"{'s' if done != 1 else ''}: {result['error']}",
               hint="the trace passed, so look at what it cannot see: an address the GPU computes differently from "
                    "Python (an integer overflow in a row), or an error the message above names")
    bad = [r for r in result["rows"] if not r["ok"]]
    if bad:
        r = bad[0]
        what = r.get("error") or (f"|O - float64| {r['err']:.2e} > bound {r['bound']:.2e}" if "err" in r else "")
        g.fail(f"on this GPU the 'ws' kernel with your producer fails {len(bad)} of {done} cases; first: "
               f"d = {r['d']}, (B, H, Hkv, N, Nk) = {tuple(r['shape'])}, causal {r['causal']}: {what}",
               hint="the trace passed, so look at what it cannot see: a value computed on the GPU differently "
                    "from Python (an integer overflow, a float where an int belongs)")
    return (f"on this {result['gpu']} the 'ws' kernel with your producer matches float64 in {done} cases (worst "
            f"|O - float64| {result.get('worst', 0.0):.1e})")
