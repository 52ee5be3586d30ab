"""Lesson 11 (FlashAttention-3's pipeline): the simulator's rules, the schedule checker's planted bugs and
other correct schedules, the softmax count, the GPU section's gate. The Gluon part (the forward compiled for sm_90,
the producer-warp exercise): tests/test_lesson11_gluon.py."""
import math

import pytest

from conftest import notebook_namespace, rejects
from helpers import check, checking
from helpers import lesson11 as L
from helpers.lesson11 import compute, load, release, wait_empty, wait_full
from helpers.lesson11 import hopper as H, pipeline as P, producer as T

NB = "11_hopper_fa3"


# ------------------------------------------------------------------ the simulator itself
def test_a_fresh_barrier_passes_parity_1_and_blocks_parity_0():
    sched = {"producer": [load(0, 0)], "consumer0": [wait_full(0, 0), compute(0, 0), release(0)]}
    assert L.simulate(sched, 1, 1, 1).violation is None
    stuck = L.simulate({"producer": [wait_empty(0, 0), load(0, 0)],
                        "consumer0": [wait_full(0, 0), compute(0, 0), release(0)]}, 1, 1, 1).violation
    assert stuck.kind == "deadlock" and stuck.details["blocked"][0]["agent"] == "producer"


def test_parity_aliasing_two_phases_ahead_blocks():
    """A wait sees only the parity: two completions later the same parity blocks again (the hardware rule)."""
    b = P._Barrier(1)
    assert b.passes(1) and not b.passes(0)
    b.arrive()
    assert b.passes(0) and not b.passes(1)
    b.arrive()
    assert b.passes(1) and not b.passes(0)


def test_the_reference_runs_clean_everywhere():
    for n, s, c in L.random_cases(5, 80) + [(1, 1, 1), (13, 1, 2), (2, 5, 2)]:
        assert L.first_violation(L.fa3_schedule_ref, n, s, c) is None, (n, s, c)


def test_every_timing_profile_is_needed():
    """Each planted race shows under some timing only: the checker runs all three."""
    no_wait = _variant(prod_wait=False)
    early = _variant(cons_par=lambda j, S: (j // S + 1) % 2)
    kinds = {}
    for name, prof in L.PROFILES.items():
        for label, fn in (("no_wait", no_wait), ("early", early)):
            v = L.simulate(fn(7, 2, 2), 7, 2, 2, **prof).violation
            kinds[label, name] = v.kind if v else None
    assert kinds["no_wait", "producer ahead"] in ("overwrite_in_flight", "overwrite_unreleased")
    assert kinds["early", "consumer ahead"] == "read_before_landed"


def test_pingpong_keeps_the_tensor_cores_busier():
    sched = L.fa3_schedule_ref(8, 2, 2)
    one = L.simulate(L.fa3_schedule_ref(8, 2, 1), 8, 2, 1, load_t=2, gemm_t=4, softmax_t=(4,))
    pp = L.simulate(sched, 8, 2, 2, load_t=2, gemm_t=4, softmax_t=(4, 4), pingpong=True)
    assert one.violation is None and pp.violation is None
    assert L.tensor_core_busy(one) < 0.7 < L.tensor_core_busy(pp)


def test_timeline_plot_draws(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    run = L.simulate(L.fa3_schedule_ref(5, 2, 2), 5, 2, 2, pingpong=True)
    ax = L.plot_timeline(run, title="x")
    drawn = [e for e in run.events if not (e[0] == "producer" and e[1] == "wait")]
    assert len(ax.patches) == len(drawn) and "tensor cores busy" in ax.get_title()


# ------------------------------------------------------------------ why softmax matters
def test_softmax_counts_match_the_formula_and_the_paper():
    c = L.count_forward_ops(N=128, Nk=192, d=64, BLOCK_M=64, BLOCK_N=64)
    assert c["matmul_flops"] == 4 * 128 * 192 * 64
    assert c["exps"] == 128 * 192 + 128 * 3               # p, and alpha once per row and KV tile
    r = L.softmax_share(128, N=256, Nk=256, BLOCK_M=128, BLOCK_N=128)
    assert abs(r["flops_per_exp"] - 512) < 5               # the paper: "512x more matmul FLOPS" at d = 128
    assert abs(r["exp_over_mma"] - 0.5) < 0.01             # "exponential can take 50% of the cycle"
    assert math.isclose(r["share_if_serial"], r["exp_over_mma"] / (1 + r["exp_over_mma"]))


# ------------------------------------------------------------------ the checker: planted bugs
def _variant(cons_stage=None, cons_par=None, prod_par=None, order="wcr", prod_wait=True, releasers=None,
             prod_stage=None, skip_first_wait=False, tiles=None):
    """One loop, one switch per bug: the planted schedules differ from the reference by one thing."""
    cons_stage = cons_stage or (lambda j, S: j % S)
    prod_stage = prod_stage or (lambda j, S: j % S)
    cons_par = cons_par or (lambda j, S: (j // S) % 2)
    prod_par = prod_par or (lambda j, S: (j // S + 1) % 2)

    def fa3_schedule(num_tiles, num_stages, num_consumers):
        S = num_stages
        producer = []
        for j in range(num_tiles):
            if prod_wait and not (skip_first_wait and j < S):
                producer.append(wait_empty(prod_stage(j, S), prod_par(j, S)))
            producer.append(load(prod_stage(j, S), j))
        out = {"producer": producer}
        for c in range(num_consumers):
            ops = []
            for j in (tiles(num_tiles) if tiles else range(num_tiles)):
                s = cons_stage(j, S)
                step = {"w": wait_full(s, cons_par(j, S)), "c": compute(s, j), "r": release(s)}
                mine = order if releasers is None or c in releasers else order.replace("r", "")
                ops += [step[x] for x in mine]
            out[f"consumer{c}"] = ops
        return out
    return fa3_schedule


def _fix(name):
    """The exact fix of ``name``'s last ❌ (what ``check.hint(name)`` prints)."""
    return checking._LAST_FIX[name][1]


def test_stage_off_by_one_rejected():
    rejects(check.fa3_schedule, _variant(cons_stage=lambda j, S: (j + 1) % S), "off by one stage", "stage 0 % 2 = 0")
    assert "j % num_stages" in _fix("fa3_schedule")


def test_stage_out_of_range_rejected():
    rejects(check.fa3_schedule, _variant(cons_stage=lambda j, S: j % S + 1, prod_stage=lambda j, S: j % S + 1),
            "off by one stage", "0..num_stages - 1")


def test_producer_and_consumers_disagree_on_the_stage_rejected():
    rejects(check.fa3_schedule, _variant(prod_stage=lambda j, S: (S - 1 - j % S)), "stage")


def test_consumer_parity_not_flipped_on_wrap_rejected():
    rejects(check.fa3_schedule, _variant(cons_par=lambda j, S: 0), "parity not flipped on wrap", "full")


def test_producer_parity_not_flipped_on_wrap_rejected():
    rejects(check.fa3_schedule, _variant(prod_par=lambda j, S: 1), "parity not flipped on wrap", "empty")


def test_parity_flipped_every_tile_rejected():
    rejects(check.fa3_schedule, _variant(cons_par=lambda j, S: j % 2, prod_par=lambda j, S: (j + 1) % 2),
            "flips every tile")


def test_consumer_parity_inverted_rejected():
    rejects(check.fa3_schedule, _variant(cons_par=lambda j, S: (j // S + 1) % 2), "inverted parity", "full")


def test_producer_parity_inverted_rejected():
    rejects(check.fa3_schedule, _variant(prod_par=lambda j, S: (j // S) % 2), "inverted parity",
            "passes at once", "deadlock")


def test_release_before_use_rejected():
    rejects(check.fa3_schedule, _variant(order="wrc"), "release before use", "only after computing")


def test_no_wait_before_compute_rejected():
    rejects(check.fa3_schedule, _variant(order="cr"), "without waiting for its load")


def test_producer_does_not_wait_rejected():
    rejects(check.fa3_schedule, _variant(prod_wait=False), "without waiting for the consumers to release it")
    assert "wait_empty(s, parity) before every load" in _fix("fa3_schedule")


def test_never_released_rejected():
    rejects(check.fa3_schedule, _variant(order="wc"), "release")


def test_only_one_consumer_releases_rejected():
    rejects(check.fa3_schedule, _variant(releasers={0}), "only consumer0 releases", "2 arrivals")


def test_double_release_rejected():
    rejects(check.fa3_schedule, _variant(order="wcrr"), "double release", "one release per compute")


def test_skipped_tile_rejected():
    rejects(check.fa3_schedule, _variant(tiles=lambda n: range(0, n, 2)), "consumer0 computes tiles [0, 2",
            "computed once")


def test_ops_that_are_not_ops_get_a_verdict_not_a_traceback():
    import torch
    rejects(check.fa3_schedule, lambda n, s, c: {**L.fa3_schedule_ref(n, s, c), "producer": [("load", "0", 0)]},
            "bad op", "its stage is '0', a str", "the string '0'")
    rejects(check.fa3_schedule, lambda n, s, c: {**L.fa3_schedule_ref(n, s, c),
                                                 "producer": [load(torch.tensor(0.0), 0)]}, "bad op", "a float")
    rejects(check.fa3_schedule, lambda n, s, c: {**L.fa3_schedule_ref(n, s, c), "consumer0": [load(0, 0)]},
            "bad op", "only the producer loads")
    rejects(check.fa3_schedule, lambda n, s, c: {**L.fa3_schedule_ref(n, s, c), "producer": ["load 0"]},
            "bad op", "ops are tuples")


def test_not_a_dict_rejected():
    rejects(check.fa3_schedule, lambda n, s, c: [load(0, 0)], "bad schedule", "one list of ops per agent")


# ------------------------------------------------------------------ the checker: correct schedules, other ways
def _running_phase(num_tiles, num_stages, num_consumers):
    """CUTLASS style: a running (stage, phase) pair, the phase flipped when the stage wraps to 0; the producer's
    phase starts at 1 so its first lap passes at once."""
    producer, s, phase = [], 0, 1
    for j in range(num_tiles):
        producer += [wait_empty(s, phase), load(s, j)]
        s += 1
        if s == num_stages:
            s, phase = 0, phase ^ 1
    out = {"producer": producer}
    for c in range(num_consumers):
        ops, s, phase = [], 0, 0
        for j in range(num_tiles):
            ops += [wait_full(s, phase), compute(s, j), release(s)]
            s += 1
            if s == num_stages:
                s, phase = 0, phase ^ 1
        out[f"consumer{c}"] = ops
    return out


def test_running_phase_schedule_passes(strict):
    check.fa3_schedule(_running_phase)


def test_first_lap_without_producer_waits_passes(strict):
    """The ring starts empty: skipping the producer's first-lap waits is also right."""
    check.fa3_schedule(_variant(skip_first_wait=True))


def test_consumers_listed_in_another_order_pass(strict):
    def reordered(n, s, c):
        out = L.fa3_schedule_ref(n, s, c)
        return dict(reversed(list(out.items())))
    check.fa3_schedule(reordered)


# ------------------------------------------------------------------ issue 37: what a correct schedule may hold, and the hints
def _bool_phase(num_tiles, num_stages, num_consumers):
    """A running phase kept as a bool (phase = not phase), stages and tiles as numpy integers."""
    import numpy as np
    out = {"producer": []}
    s, phase = 0, True
    for j in np.arange(num_tiles):
        out["producer"] += [wait_empty(s, phase), load(s, j)]
        s, phase = (0, not phase) if s + 1 == num_stages else (s + 1, phase)
    for c in range(num_consumers):
        ops, s, phase = [], np.int64(0), False
        for j in range(num_tiles):
            ops += [wait_full(s, phase), compute(s, j), release(s)]
            s, phase = (np.int64(0), not phase) if s + 1 == num_stages else (s + 1, phase)
        out[f"consumer{c}"] = ops
    return out


def _deferred_release(num_tiles, num_stages, num_consumers):
    """Each stage released after the next tile's compute (as FA3 releases V late): right with 2 stages or more."""
    out = L.fa3_schedule_ref(num_tiles, num_stages, num_consumers)
    for c in range(num_consumers):
        ops = []
        for j in range(num_tiles):
            s = j % num_stages
            ops += [wait_full(s, (j // num_stages) % 2), compute(s, j)] + ([release((j - 1) % num_stages)] if j else [])
        out[f"consumer{c}"] = ops + [release((num_tiles - 1) % num_stages)]
    return out


def test_schedule_with_bools_and_numpy_integers_passes(strict):
    check.fa3_schedule(_bool_phase)


def test_the_protocol_walk_names_nothing_in_a_correct_schedule():
    """The hint's walk of the learner's lists never flags a right schedule (only what is certainly wrong)."""
    from helpers.lesson11 import check as C
    for fn in (L.fa3_schedule_ref, _running_phase, _variant(skip_first_wait=True), _bool_phase, _deferred_release):
        for n, s, c in L.random_cases(3, 40) + [(1, 1, 1), (13, 1, 2), (2, 5, 2)]:
            if fn is _deferred_release and s == 1:
                continue
            raw = fn(n, s, c)
            bad, ops = P.checked(raw, n, s, c)
            assert bad is None and C._walk(raw, ops, n, s, c) is None, (fn, n, s, c)
            assert L.first_violation(fn, n, s, c) is None, (fn, n, s, c)


def _edit(agent_ops):
    """A schedule built from the reference, one agent's list rewritten: agent_ops(agent, ops, n, S) -> ops."""
    def fa3_schedule(n, S, C):
        out = L.fa3_schedule_ref(n, S, C)
        return {a: agent_ops(a, ops, n, S) for a, ops in out.items()}
    return fa3_schedule


def _shared_list(n, S, C):
    out, ops = {"producer": L.fa3_schedule_ref(n, S, 1)["producer"]}, []
    for c in range(C):
        ops += L.fa3_schedule_ref(n, S, 1)["consumer0"]
        out[f"consumer{c}"] = ops
    return out


@pytest.mark.parametrize("fn, words, fix", [
    (_edit(lambda a, ops, n, S: [x for j in range(n) for x in (load(j % S, j), wait_empty(j % S, (j // S + 1) % 2))]
           if a == "producer" else ops), ["the wait for tile 0 comes after its load"], "then load(s, j)"),
    (_edit(lambda a, ops, n, S: ops if a == "producer" else
           [wait_full(j % S, (j // S) % 2) for j in range(n)] + [x for x in ops if x[0] != "wait"]),
     ["consumer0 waits for tile 2 before computing tile 0", "one tile at a time"], "release(s)"),
    (_edit(lambda a, ops, n, S: ops if a == "producer" else
           [x for x in ops if x[0] != "release"] + [release(s) for s in range(min(S, n))]),
     ["consumer0 waits for tile 2 in stage 0 while it still holds stage 0"], "release(s)"),
    (_shared_list, ["consumer0 and consumer1 are one list object", "ops = [] is outside the consumer loop"], "ops = []"),
    (_edit(lambda a, ops, n, S: ops if a == "producer" else
           [x for j in reversed(range(n)) for x in (wait_full(j % S, (j // S) % 2), compute(j % S, j), release(j % S))]),
     ["consumer0 computes the tiles in the order [6, 5, 4, 3, 2, 1, 0]"], ""),
    (_edit(lambda a, ops, n, S: ops if a == "producer" else
           [release((x[1] + 1) % S) if x[0] == "release" else x for x in ops]),
     ["consumer0 released stage 1 after computing tile 0 on stage 0"], "the same s"),
    (_edit(lambda a, ops, n, S: [x for j in range(n) for x in (wait_empty((j + 1) % S, ((j + 1) // S + 1) % 2),
                                                                 load(j % S, j))] if a == "producer" else ops),
     ["the producer waits for tile 1's stage", "before loading tile 0"], ""),
    (_edit(lambda a, ops, n, S: [x[:3] + (float(x[3]),) if x[0] == "wait" else x for x in ops]),
     ["bad op", "is a float", "integers"], "//"),
    (_edit(lambda a, ops, n, S: [x[:3] + (float("nan"),) if x[0] == "wait" else x for x in ops]), ["is NaN"], ""),
    (_edit(lambda a, ops, n, S: [x[:3] + (x[3] + 2,) if x[0] == "wait" else x for x in ops]),
     ["parity 3 is not a parity", "0 or 1"], "% 2"),
    (lambda n, S, C: dict(enumerate(L.fa3_schedule_ref(n, S, C).values())), ["bad schedule", "agents are [0, 1]",
                                                                               "the agents' names"], "agents("),
    (lambda n, S, C: {"producer": L.fa3_schedule_ref(n, S, C)["producer"],
                      **{c: v for c, v in enumerate(list(L.fa3_schedule_ref(n, S, C).values())[1:])}},
     ["bad schedule", "['producer', 0]", "the agents' names"], ""),
])
def test_schedule_hint_names_the_first_step_that_went_wrong(fn, words, fix):
    """Issue 37: reorderings of whole phases and malformed numbers get the hint that names them, never a
    traceback (mixed int and str keys crashed in sorted())."""
    rejects(check.fa3_schedule, fn, *words)
    assert fix in _fix("fa3_schedule")


def test_q_barrier_in_the_simulator():
    """The Gluon exercise's replay: the consumer waits for Q; a Q copied after a wait that needs a release deadlocks
    once there are more tiles than stages; fa3_schedule's ops know no Q."""
    n, S = 5, 2
    cons = [P.wait_q()] + L.fa3_schedule_ref(n, S, 1)["consumer0"]
    prod = L.fa3_schedule_ref(n, S, 1)["producer"]
    assert L.simulate({"producer": [P.load_q()] + prod, "consumer0": cons}, n, S, 1, q=True).violation is None
    v = L.simulate({"producer": prod + [P.load_q()], "consumer0": cons}, n, S, 1, q=True).violation
    assert v.kind == "deadlock" and any(b["bar"] == "q" for b in v.details["blocked"])
    assert L.simulate({"producer": prod[:4] + [P.load_q()] + prod[4:], "consumer0": cons}, n, S, 1,
                      q=True).violation is None                    # Q with the first lap: nothing waits on it yet
    assert L.simulate({"producer": [P.load_q()] + prod, "consumer0": cons}, n, S, 1).violation.kind == "bad_op"


def test_reference_passes(strict, capsys):
    check.fa3_schedule(L.fa3_schedule_ref)
    assert "course's reference" in capsys.readouterr().out


def test_worked_answer_passes(strict, capsys):
    check.fa3_schedule(notebook_namespace(NB)["fa3_schedule"])
    assert "✅ fa3_schedule" in capsys.readouterr().out


def test_worked_producer_passes(strict, capsys, monkeypatch):
    monkeypatch.setattr(H, "hopper_here", lambda: "no sm_90 GPU in this test")
    monkeypatch.setattr(T, "compile_producer_for_sm90", lambda p, **kw: {"ok": True, "ptx": []})
    check.fa3_producer(notebook_namespace(NB)["fa3_producer"])
    assert "✅ fa3_producer" in capsys.readouterr().out


# ------------------------------------------------------------------ the GPU section's gate
def test_gpu_section_says_one_line_without_hopper(capsys, monkeypatch):
    monkeypatch.setattr(H, "hopper_here", lambda: L.NO_HOPPER + " This machine has no CUDA GPU.")
    assert L.require_hopper() is False
    out = capsys.readouterr().out
    assert out.startswith(L.NO_HOPPER) and out.count("\n") == 1 and "recorded on an H200 follow" in out


def test_recorded_hopper_figures_are_shown_with_their_label(capsys, monkeypatch):
    """The recorded table names the GPU, versions, date and statistic; its ratios are the record's own."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from helpers.lesson11 import records as results
    res = results.load_gluon()
    assert res and res["meta"]["gpu"] == "NVIDIA H200" and len(res["rows"]) == 8
    fig = L.show_recorded_hopper(res)
    out = capsys.readouterr().out
    for word in ("NVIDIA H200", "torch 2.11.0+cu130", "triton 3.6.0", "2026-12-01", "median", "non-causal"):
        assert word in out, word
    assert "one partition / triton: geomean 0.96x (0.91-1.03x over 8 rows)" in out
    assert "one partition / SDPA cudnn: geomean 0.91x (0.83-0.98x over 8 rows)" in out
    assert "producer warp + consumers / triton: geomean 0.77x (0.74-0.80x over 8 rows)" in out
    assert len(fig.axes) == 4 and "NVIDIA H200" in fig._suptitle.get_text()
    plt.close(fig)
    monkeypatch.setattr(results, "load_gluon", lambda: None)
    assert L.show_recorded_hopper() is None and "none are typed in" in capsys.readouterr().out
