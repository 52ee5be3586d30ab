"""Plain functions behind notebook 11 (FlashAttention-3 on Hopper): the pipeline's barrier simulator,
the course's schedule, the softmax-vs-matmul count, and the timeline picture.

FA3's forward (Shah et al., 2024, "FlashAttention-3", §3.1) splits a CTA into a *producer* warp that
issues TMA loads of K_j, V_j into a circular buffer of ``num_stages`` shared-memory stages, and one or
two *consumer* warpgroups that run the GEMMs and the softmax on each stage. Two arrays of mbarriers
keep them in step: ``full[s]`` completes a phase when a load into stage s has landed, ``empty[s]`` when
every consumer has released stage s. A Hopper mbarrier keeps only the *parity* of its current phase, and
``wait(parity)`` returns once the phase of that parity has completed, i.e. as soon as the barrier's
current phase parity differs from it. ``pipeline`` executes a schedule written with those operations,
one tick at a time, and reports the first deadlock, race or misuse it sees.

Nothing here imports Triton or needs a GPU. References: the FA3 paper (arXiv:2407.08608, §3.1-3.2);
PTX ISA, ``mbarrier.try_wait.parity`` (the phase-parity rule simulated here).
"""
from __future__ import annotations

from .costs import PAPER, count_forward_ops, plot_timeline, softmax_share, tensor_core_busy
from .hopper import (NO_HOPPER, bench_gluon_live, hopper_here, ptxas_lines, ptxas_report, require_hopper,
                     show_recorded_hopper)
from .pipeline import (PROFILES, Run, Violation, agents, compute, expected_parity, fa3_schedule_ref, first_violation,
                       load, random_cases, release, simulate, wait_empty, wait_full)
from .producer import (PRODUCER_ARGS, TraceError, compile_producer_for_sm90, gluon_api, gluon_here, producer_source,
                       trace_producer)

__all__ = ["wait_full", "wait_empty", "load", "compute", "release", "agents", "Violation", "Run", "simulate",
           "PROFILES", "first_violation", "fa3_schedule_ref", "expected_parity", "random_cases", "count_forward_ops",
           "softmax_share", "PAPER", "plot_timeline", "tensor_core_busy", "require_hopper", "hopper_here",
           "NO_HOPPER", "show_recorded_hopper", "bench_gluon_live", "gluon_api", "trace_producer", "TraceError",
           "PRODUCER_ARGS", "producer_source", "compile_producer_for_sm90", "gluon_here", "ptxas_report", "ptxas_lines"]


# The lesson's files: ``pipeline`` (the schedule's operations, the simulator, the course's schedule), ``costs``
# (the softmax-vs-matmul count, the timeline picture), ``hopper`` (the GPU section: the gate, the recorded figures,
# a live benchmark), ``producer`` (the Gluon exercise: stand-ins, the trace, the sm_90 compile), ``gluon`` (the
# names the exercise is written with), ``records`` (the tables of the recorded Gluon results), ``check`` (the
# checkers).
