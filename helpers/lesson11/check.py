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
from .pipeline import PROFILES, expected_parity, random_cases, simulate
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


# ------------------------------------------------------------------ the producer warp, in Gluon
# (name, n_tiles, NUM_STAGES, BLOCK_N, q_row, kv_row): the schedules above with one consumer (the "ws" kernel has
# one consumer partition), each with a query block and a KV head that do not start at row 0 (a producer that
# forgets kv_row, GQA's KV head, loads head 0's keys), and both tile widths the kernel uses.
_PRODUCER_FIXED = [(name, n, s) for name, n, s, c in _FIXED if c == 1] + [
    ("two stages, many laps", 11, 2), ("three stages, 9 tiles", 9, 3)]
_PRODUCER_ARGS = ["n_tiles", "NUM_STAGES", "BLOCK_N", "q_row", "kv_row"]
_D = 64                                  # the head dim of the trace (bytes per tile: BLOCK_N x 64 x 2)
_BLOCK_M = 128


def _producer_cases():
    cases = [Case(name, n, s, (64, 128)[i % 2], 384 + 128 * i, 3 * 1024 + 512 * (i % 3))
             for i, (name, n, s) in enumerate(_PRODUCER_FIXED)]
    cases += [Case(f"random #{i}", n, s, (64, 128)[i % 2], 128 * (i + 1), 2048 * (i % 4 + 1))
              for i, (n, s, c) in enumerate(random_cases(112, 40)) if c == 1]
    return cases


def _in_gluon(hint: str) -> str:
    """A simulator hint in the Gluon exercise's words."""
    for sim, gl in (("wait_empty(s, (j // num_stages + 1) % 2)", "mbarrier.wait(empty.index(s), (j // NUM_STAGES + 1) % 2)"),
                    ("wait_empty(s, parity) before every load(s, j)",
                     "mbarrier.wait(empty.index(s), parity) before the loads into stage s"),
                    ("s = j % num_stages", "s = j % NUM_STAGES"), ("num_stages", "NUM_STAGES")):
        hint = hint.replace(sim, gl)
    return hint


class _Misuse(Exception):
    """A use of the barriers or the TMA that the simulator does not model: (what, hint)."""


def _producer_ops(events, n_tiles, num_stages, block_n, q_row, kv_row):
    """The traced events as the simulator's producer ops (wait_empty, load), after checking what the simulator takes
    on trust: each TMA copy's source row, destination, barrier and the bytes each barrier expects."""
    from .pipeline import load as load_op, wait_empty
    tile_bytes, q_bytes = block_n * _D * 2, _BLOCK_M * _D * 2
    ops, fills, q = [], {}, {"expect": 0, "loads": 0}

    def close(s, fill, why):
        """Stage s's fill is over (``why``): it must have K_j, V_j and an expect of both tiles' bytes."""
        j = fill["k"] if fill["k"] is not None else fill["v"]
        if fill["k"] is None or fill["v"] is None:
            miss = "K" if fill["k"] is None else "V"
            raise _Misuse((f"stage {s} got tile {j}'s {'V' if miss == 'K' else 'K'} but not its {miss} ({why})",
                           "each tile is two TMA copies into the same stage, K_j into k_smem.index(s) and V_j into "
                           "v_smem.index(s), both completing full.index(s); the consumer reads both"))
        if fill["expect"] is None:
            raise _Misuse((f"stage {s}: tile {j}'s loads have no mbarrier.expect on full.index({s}) ({why})",
                           "full[s] completes when its one arrival and the expected bytes are in; the arrival is "
                           "mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes). "
                           "Without it the consumer waits forever: a hang on a GPU"))
        if fill["expect"] != 2 * tile_bytes:
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
            raise _Misuse((f"stage {s} (tile {j}): full.index({s}) expects {what}",
                           f"{then}. Expect both tiles: k_desc.block_type.nbytes + v_desc.block_type.nbytes"))

    for ev in events:
        kind, bar = ev[0], (ev[3] if ev[0] == "load" else ev[1])
        if kind == "wait":
            if bar.name != "empty":
                raise _Misuse((f"the producer waits on {bar!r}", "the producer waits only on empty.index(s) (a "
                               "stage is free); full[s] and q_bar are the consumer's to wait on, and the TMA "
                               "completes them"))
            if ev[2] not in (0, 1):
                raise _Misuse((f"mbarrier.wait({bar!r}, {ev[2]}): a phase parity is 0 or 1", ""))
            ops.append(wait_empty(bar.stage, ev[2]))
        elif kind == "arrive":
            raise _Misuse((f"the producer arrives on {bar!r}",
                           "the producer never arrives: the TMA's bytes complete full[s] and q_bar (after the "
                           "expect's arrival), and the consumer arrives on empty[s] when it is done reading. An "
                           "arrival from the producer completes a phase nobody finished"))
        elif kind == "expect" and bar.name == "q_bar":
            q["expect"] += ev[2]
        elif kind == "expect" and bar.name == "full":
            fill = fills.setdefault(bar.stage, {"expect": None, "k": None, "v": None})
            if fill["expect"] is not None:
                close(bar.stage, fill, "a second expect came before both copies")
            fill["expect"] = ev[2]
        elif kind == "expect":
            raise _Misuse((f"mbarrier.expect on {bar!r}", "expect is for barriers the TMA completes by bytes: q_bar "
                           "and full.index(s); empty[s] completes by the consumer's arrival"))
        elif kind == "load" and ev[1] == "q_desc":
            if ev[4] != _Smem("q_smem") or bar.name != "q_bar" or ev[2] != (q_row, 0):
                raise _Misuse((f"Q's TMA copy: tma load(q_desc, {list(ev[2])}, {bar!r}, {ev[4]!r})",
                               "Q is loaded once: tma_load(q_desc, [q_row, 0], q_bar, q_smem), after "
                               "mbarrier.expect(q_bar, q_desc.block_type.nbytes)"))
            q["loads"] += 1
        else:                                                    # K_j or V_j
            desc, (row, col), dest = ev[1], ev[2], ev[4]
            ring = {"k_desc": "k_smem", "v_desc": "v_smem"}[desc]
            if dest.name != ring or dest.stage is None:
                raise _Misuse((f"{desc}'s tile lands in {dest!r}", "K_j goes to k_smem.index(s) and V_j to "
                               "v_smem.index(s), with s = j % NUM_STAGES"))
            if bar.name != "full" or bar.stage != dest.stage:
                raise _Misuse((f"the copy into {dest!r} completes {bar!r}",
                               "a stage's copies complete that stage's barrier: full.index(s) for k_smem.index(s) "
                               "and v_smem.index(s)"))
            off = row - kv_row
            if col != 0 or off % block_n or not 0 <= off // block_n < n_tiles:
                lost = (col == 0 and row % block_n == 0 and 0 <= row // block_n < n_tiles and kv_row != 0)
                raise _Misuse((f"{desc} copied from row {row}, column {col}: no tile of this head starts there "
                               f"(kv_row = {kv_row}, BLOCK_N = {block_n})",
                               "kv_row is missing: it is where this (batch, KV head)'s keys start in the [B*Hkv*Nk, "
                               "d] view, so tile j is at [kv_row + j * BLOCK_N, 0]; without it every head reads the "
                               "first head's keys" if lost else
                               "tile j of this head starts at [kv_row + j * BLOCK_N, 0]"))
            j, s = off // block_n, dest.stage
            fill = fills.setdefault(s, {"expect": None, "k": None, "v": None})
            key = "k" if desc == "k_desc" else "v"
            if fill[key] is not None:
                close(s, fill, "another copy came into the stage")
                fill = fills[s] = {"expect": None, "k": None, "v": None}
            other = fill["v" if key == "k" else "k"]
            if other is not None and other != j:
                raise _Misuse((f"stage {s} got K_{fill['k'] if key == 'v' else j} and V_{fill['v'] if key == 'k' else j}",
                               "K_j and V_j go into the same stage together: one tile index j for both copies"))
            if fill["k"] is None and fill["v"] is None:
                ops.append(load_op(s, j))                        # the stage is written from the first copy on
            fill[key] = j
            if fill["k"] is not None and fill["v"] is not None and fill["expect"] is not None:
                close(s, fill, "")
                del fills[s]
    for s, fill in sorted(fills.items()):
        close(s, fill, "at the end")
    if q["loads"] != 1:
        raise _Misuse((f"Q was loaded {q['loads']} times", "load Q once, before the loop: the consumer partition "
                       "waits on q_bar before its first tile and keeps Q in q_smem for all of them"))
    if q["expect"] != q_bytes:
        raise _Misuse((f"q_bar expects {q['expect']} bytes; Q's tile has {q_bytes}",
                       "mbarrier.expect(q_bar, q_desc.block_type.nbytes) once, with Q's copy"))
    return ops


@exercise("fa3_producer", arg_names=_PRODUCER_ARGS,
          reference="Hopper's mbarrier rule (helpers.lesson11.simulate) and float64 attention")
def fa3_producer(g):
    from .hopper import hopper_here
    from .pipeline import fa3_schedule_ref
    from .producer import TraceError, gluon_here, trace_producer
    producer = g.learner_fn
    cases = _producer_cases()

    def traced(n_tiles, num_stages, block_n, q_row, kv_row):
        try:
            return trace_producer(producer, n_tiles, num_stages, block_n=block_n, d=_D, q_row=q_row, kv_row=kv_row,
                                  block_m=_BLOCK_M)
        except TraceError as e:
            return e

    for case in cases:
        n_tiles, num_stages, block_n, q_row, kv_row = case.args
        events = g.call(case, fn=traced)
        if isinstance(events, TraceError):
            g.fail(f"the trace stopped: {events}", hint="write the producer with mbarrier.expect / mbarrier.wait, "
                   "tma_load and index(s) on the rings, as the exercise's table shows")
        try:
            ops = _producer_ops(events, n_tiles, num_stages, block_n, q_row, kv_row)
        except _Misuse as e:
            what, hint = e.args[0]
            g.fail(what, hint=hint)
        schedule = {"producer": ops, "consumer0": fa3_schedule_ref(n_tiles, num_stages, 1)["consumer0"]}
        for profile, timing in PROFILES.items():
            v = simulate(schedule, n_tiles, num_stages, 1, profile=profile, **timing).violation
            if v is not None:
                g.fail(f"{v.kind.replace('_', ' ')} (timing '{profile}'): {v.message}",
                       hint=_in_gluon(_hint(v, schedule, n_tiles, num_stages, 1)))
        g.count()
    summary = (f"{len(cases)} traced runs (1-13 tiles, 1-5 stages) ran clean with the course's consumer under "
               f"{len(PROFILES)} timings, every TMA copy from the right row into the right stage with its bytes expected")
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
               hint="the compile rebuilds your producer from its source with only gluon, gl, mbarrier, tma and "
                    "tma_load imported: use those and the producer's arguments, nothing else from the notebook")
    return summary + "; the 'ws' kernel with it compiles for sm_90 (Triton's compiler, no GPU; run this cell on an " \
                     "H100 or H200 to run it)"


def _run_natively(g, producer) -> str:
    """On an sm_90 GPU: gluon_forward's "ws" kernel with the learner's producer, against float64."""
    import torch
    from ..kernels.gluon_forward import gluon_forward_selftest
    result = gluon_forward_selftest(producer=producer, dtypes=(torch.bfloat16,))
    bad = [r for r in result["rows"] if not r["ok"]]
    if bad:
        r = bad[0]
        g.case = None
        what = r.get("error") or (f"|O - float64| {r['err']:.2e} > bound {r['bound']:.2e}" if "err" in r else "")
        g.fail(f"on this GPU the 'ws' kernel with your producer fails {len(bad)} of {result['cases']} cases; first: "
               f"d = {r['d']}, (B, H, Hkv, N, Nk) = {r['shape']}, causal {r['causal']}: {what}",
               hint="the trace passed, so look at what it cannot see: a value computed on the GPU differently "
                    "from Python (an integer overflow, a float where an int belongs)")
    return (f"on this {torch.cuda.get_device_name()} the 'ws' kernel with your producer matches float64 in "
            f"{result['cases']} cases (worst |O - float64| {result['worst']:.1e})")
