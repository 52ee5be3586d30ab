"""Lesson 09 (ring attention): the launcher, the checkers, planted bugs, another correct way.

Planted ring bugs are top-level functions of this module: the launcher ships their source
(and that of the module functions they call) to real gloo worker processes.
"""
import math
import os
import time

import nbformat
import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, notebook_namespace, rejects
from helpers import check, reference
from helpers import lesson09 as L
from helpers.lesson09 import check as C
from helpers.lesson09 import chunk_attention

NB = "09_ring_attention"


@pytest.fixture(scope="module")
def sol():
    return notebook_namespace(NB)


def test_worked_ring_passes_the_launcher(sol):
    """The notebook's own ring_attention, shipped from the notebook namespace, equals SDPA."""
    q = torch.randn(1, 2, 16, 4)
    O, lse = L.run_ring(sol["ring_attention"], q, q, q, 2, causal=True, layout="zigzag")
    o_ref, _ = reference.attention(q, q, q, mask=reference.causal_mask(16, 16))
    assert (O.double() - o_ref).abs().max() < 1e-5


def _no_survivors():
    time.sleep(0.05)
    alive = []
    for pid in L.LAST_PIDS:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert not alive, f"worker processes {alive} outlived the run"


# ------------------------------------------------------------------ a correct ring, parametrised by mistakes
def _merge(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse_a - safe)[..., None] * o_a + torch.exp(lse_b - safe)[..., None] * o_b, lse


def _ring(q, k, v, causal, layout, direction=1, swap=True, merge="lse", diag_all=False, zig_second=None,
          skip=True, hoard=False, book=1, hop=False, wait_first=False, f64=False, wire64=False, numpy=""):
    """A ring with knobs for mistakes. direction: where chunks are sent (+1: rank + 1); book: whose chunk
    a rank thinks it holds at step t, (rank - book * t) % P; hop: at step t send the own chunk straight to
    rank + t + 1 (the right chunks, the wrong peers); wait_first: wait for the transfer before computing;
    f64: compute each chunk pair in float64; wire64: send float64 copies; numpy: "kept" (received chunks
    kept as numpy arrays) or "skip" (invisible chunk pairs computed in numpy, then dropped)."""
    import numpy as np
    rank, P = dist.get_rank(), dist.get_world_size()
    B, H, n, d = q.shape
    nc = 2 * P if layout == "zigzag" else P
    c = n * P // nc                                                  # chunk length
    mine = [rank] if layout == "contiguous" else [rank, zig_second(rank, P) if zig_second else 2 * P - 1 - rank]
    o = torch.zeros_like(q)
    lse = torch.full((B, H, n), -math.inf)
    parts, kept = 0, []
    k_cur, v_cur = k, v
    for t in range(P):
        reqs = []
        if t < P - 1:
            wire = torch.float64 if wire64 else k.dtype
            k_next, v_next = torch.empty_like(k, dtype=wire), torch.empty_like(v, dtype=wire)
            to, frm = (rank + direction) % P, (rank - direction) % P
            if hop:
                to, frm = (rank + t + 1) % P, (rank - t - 1) % P
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, (k if hop else k_cur).to(wire), to),
                dist.P2POp(dist.isend, (v if hop else v_cur).to(wire), to),
                dist.P2POp(dist.irecv, k_next, frm), dist.P2POp(dist.irecv, v_next, frm)])
            if wait_first:
                for req in reqs:
                    req.wait()
                reqs = []
        src = (rank - book * t) % P
        theirs = [src] if layout == "contiguous" else [src, zig_second(src, P) if zig_second else 2 * P - 1 - src]
        for ia, a in enumerate(mine):
            for ib, b in enumerate(theirs):
                if causal and b > a and skip:
                    if numpy == "skip":           # computed off the books, then dropped
                        np.exp(q.numpy() @ k_cur.numpy().swapaxes(-1, -2))
                    continue
                qa = q[:, :, ia * c:(ia + 1) * c]
                kb, vb = k_cur[:, :, ib * c:(ib + 1) * c], v_cur[:, :, ib * c:(ib + 1) * c]
                if not skip and causal:           # a naive masked softmax over a block it may not see
                    s = qa @ kb.transpose(-1, -2) / math.sqrt(d)
                    i = torch.arange(c)[:, None] + a * c
                    j = torch.arange(c)[None, :] + b * c
                    s = s.masked_fill(j > i, -math.inf)
                    p = torch.softmax(s, dim=-1)
                    o_s, lse_s = p @ vb, torch.logsumexp(s, dim=-1)
                elif f64:                         # float64 math on the float32 chunks
                    o_s, lse_s = chunk_attention(qa.double(), kb, vb, causal=causal and (a == b or diag_all))
                    o_s, lse_s = o_s.to(q.dtype), lse_s.to(q.dtype)
                else:
                    o_s, lse_s = chunk_attention(qa, kb, vb, causal=causal and (a == b or diag_all))
                rows = slice(ia * c, (ia + 1) * c)
                if merge == "mean":
                    o[:, :, rows] = (o[:, :, rows] * parts + o_s) / (parts + 1)
                    lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], lse_s)
                else:
                    o[:, :, rows], lse[:, :, rows] = _merge(o[:, :, rows], lse[:, :, rows], o_s, lse_s)
        parts += 1
        qa = kb = vb = None                       # drop the views of this step's chunk before the next one comes
        for req in reqs:
            req.wait()
        reqs = None
        if hoard:
            kept.append((k_cur, v_cur))
        if numpy == "kept":
            kept.append((k_cur.numpy().copy(), v_cur.numpy().copy()))
        if t < P - 1 and swap:
            k_cur, v_cur = k_next.to(k.dtype), v_next.to(v.dtype)
    return o, lse


def ring_ok(q, k, v, causal=False, layout="contiguous"):
    return _ring(q, k, v, causal, layout)


def ring_reverse(q, k, v, causal=False, layout="contiguous"):              # planted: sends go the other way
    return _ring(q, k, v, causal, layout, direction=-1)


def ring_no_swap(q, k, v, causal=False, layout="contiguous"):              # planted: own chunk used every step
    return _ring(q, k, v, causal, layout, swap=False)


def ring_mean(q, k, v, causal=False, layout="contiguous"):                 # planted: merge by plain mean
    return _ring(q, k, v, causal, layout, merge="mean")


def ring_diag_all(q, k, v, causal=False, layout="contiguous"):             # planted: causal mask on every chunk
    return _ring(q, k, v, causal, layout, diag_all=True)


def _second_p_plus_r(r, P):
    return P + r


def ring_zigzag_misordered(q, k, v, causal=False, layout="contiguous"):    # planted: chunks r and P + r
    return _ring(q, k, v, causal, layout, zig_second=_second_p_plus_r)


def ring_no_skip_nan(q, k, v, causal=False, layout="contiguous"):          # planted: invisible chunk -> NaN
    return _ring(q, k, v, causal, layout, skip=False)


def ring_hoard(q, k, v, causal=False, layout="contiguous"):                # planted: keeps every chunk
    return _ring(q, k, v, causal, layout, hoard=True)


def ring_no_skip_masked(q, k, v, causal=False, layout="contiguous"):       # planted: computes invisible chunks
    rank, P = dist.get_rank(), dist.get_world_size()
    o, lse = _ring(q, k, v, False, layout) if not causal else _ring_masked_everything(q, k, v, layout)
    return o, lse


def _ring_masked_everything(q, k, v, layout):
    rank, P = dist.get_rank(), dist.get_world_size()
    B, H, n, d = q.shape
    c = n if layout == "contiguous" else n // 2
    pos = lambda r: torch.cat([torch.arange(ch * c, (ch + 1) * c) for ch in L.chunks_of_rank(r, P, layout)])  # noqa: E731
    o, lse = torch.zeros_like(q), torch.full((B, H, n), -math.inf)
    k_cur, v_cur = k, v
    for t in range(P):
        src = (rank - t) % P
        s = q @ k_cur.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(pos(src)[None, :] > pos(rank)[:, None], -math.inf)
        lse_s = torch.logsumexp(s, -1)
        safe = torch.where(torch.isneginf(lse_s), torch.zeros_like(lse_s), lse_s)
        o, lse = _merge(o, lse, torch.exp(s - safe[..., None]) @ v_cur, lse_s)
        if t < P - 1:
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, k_cur, (rank + 1) % P),
                                             dist.P2POp(dist.isend, v_cur, (rank + 1) % P),
                                             dist.P2POp(dist.irecv, k_next, (rank - 1) % P),
                                             dist.P2POp(dist.irecv, v_next, (rank - 1) % P)]):
                w.wait()
            k_cur, v_cur = k_next, v_next
    return o, lse


def ring_reversed(q, k, v, causal=False, layout="contiguous"):             # planted: right answer, ring backwards
    return _ring(q, k, v, causal, layout, direction=-1, book=-1)


def ring_hop(q, k, v, causal=False, layout="contiguous"):                  # planted: right bytes, wrong peers
    return _ring(q, k, v, causal, layout, hop=True)


def ring_wait_first(q, k, v, causal=False, layout="contiguous"):           # planted: no overlap
    return _ring(q, k, v, causal, layout, wait_first=True)


def ring_f64(q, k, v, causal=False, layout="contiguous"):                  # correct: float64 math per chunk
    return _ring(q, k, v, causal, layout, f64=True)


def ring_wire64(q, k, v, causal=False, layout="contiguous"):               # planted: float64 on the wire
    return _ring(q, k, v, causal, layout, wire64=True)


def ring_numpy_kept(q, k, v, causal=False, layout="contiguous"):           # planted: chunks kept as numpy
    return _ring(q, k, v, causal, layout, numpy="kept")


def ring_numpy_skip(q, k, v, causal=False, layout="contiguous"):           # planted: invisible pairs in numpy
    return _ring(q, k, v, causal, layout, numpy="skip")


def ring_collective_error(q, k, v, causal=False, layout="contiguous"):     # planted: a mismatched collective
    P = dist.get_world_size()
    ks = [torch.empty(1) for _ in range(P)]
    dist.all_gather(ks, k)
    return _ring(q, k, v, causal, layout)


def ring_allgather(q, k, v, causal=False, layout="contiguous"):            # planted: all-gather of K/V
    P = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(P)], [torch.empty_like(v) for _ in range(P)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return _ring(q, k, v, causal, layout)


def ring_deadlock(q, k, v, causal=False, layout="contiguous"):             # planted: blocking sends first
    rank, P = dist.get_rank(), dist.get_world_size()
    k_next = torch.empty_like(k)
    dist.send(k, (rank + 1) % P)
    dist.recv(k_next, (rank - 1) % P)
    return _ring(q, k, v, causal, layout)


def ring_raises(q, k, v, causal=False, layout="contiguous"):               # planted: rank 1 fails
    if dist.get_rank() == 1:
        raise IndexError("planted failure on rank 1")
    return _ring(q, k, v, causal, layout)


def ring_other_way(q, k, v, causal=False, layout="contiguous", blocking=False):   # correct: another way
    """isend/irecv posted before computing (blocking=True: blocking send/recv by rank parity after it),
    K and V stacked into one tensor, logaddexp merge."""
    rank, P = dist.get_rank(), dist.get_world_size()
    B, H, n, d = q.shape
    halves = 2 if layout == "zigzag" else 1
    c = n // halves
    order = lambda r: [r] if halves == 1 else [r, 2 * P - 1 - r]  # noqa: E731
    kv = torch.stack([k, v])                                          # [2, B, H, n, d]
    o = torch.zeros(B, H, n, d)
    lse = torch.full((B, H, n), -math.inf)
    for t in range(P):
        reqs = []
        if t < P - 1 and not blocking:
            incoming = torch.empty_like(kv)
            reqs = [dist.isend(kv, (rank + 1) % P), dist.irecv(incoming, (rank - 1) % P)]
        src = (rank - t) % P
        for ia, a in enumerate(order(rank)):
            for ib, b in enumerate(order(src)):
                if causal and b > a:
                    continue
                o_s, lse_s = chunk_attention(q[:, :, ia * c:(ia + 1) * c], kv[0, :, :, ib * c:(ib + 1) * c],
                                             kv[1, :, :, ib * c:(ib + 1) * c], causal=causal and a == b)
                new = torch.logaddexp(lse[:, :, ia * c:(ia + 1) * c], lse_s)
                safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
                o[:, :, ia * c:(ia + 1) * c] = (torch.exp(lse[:, :, ia * c:(ia + 1) * c] - safe)[..., None]
                                                * o[:, :, ia * c:(ia + 1) * c] + torch.exp(lse_s - safe)[..., None] * o_s)
                lse[:, :, ia * c:(ia + 1) * c] = new
        if t < P - 1 and blocking:
            incoming = torch.empty_like(kv)
            if rank % 2 == 0:
                dist.send(kv, (rank + 1) % P)
                dist.recv(incoming, (rank - 1) % P)
            else:
                dist.recv(incoming, (rank - 1) % P)
                dist.send(kv, (rank + 1) % P)
        for req in reqs:
            req.wait()
        if t < P - 1:
            kv, reqs = incoming, None
    return o, lse


def ring_blocking(q, k, v, causal=False, layout="contiguous"):             # planted: transfers after computing
    return ring_other_way(q, k, v, causal, layout, blocking=True)


# ------------------------------------------------------------------ launcher
def test_run_ring_matches_sdpa_and_measures():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 24, 5, generator=g) for _ in range(3))
    O, lse, stats = L.run_ring(ring_ok, q, k, v, 3, causal=True, layout="zigzag", stats=True)
    o_ref, lse_ref = reference.attention(q, k, v, mask=reference.causal_mask(24, 24))
    assert (O.double() - o_ref).abs().max() < 1e-5 and (lse.double() - lse_ref).abs().max() < 1e-5
    chunk = 2 * 1 * 3 * 8 * 5 * 4
    assert [s.bytes_sent for s in stats] == [2 * chunk] * 3 == [s.bytes_recv for s in stats]
    assert all(s.peak_chunks == 2.0 for s in stats)
    assert len({s.flops for s in stats}) == 1                        # zigzag: the same work on every rank
    _no_survivors()


@pytest.mark.parametrize("N, P, layout, words", [(10, 4, "contiguous", "multiple of 4"),
                                                   (12, 4, "zigzag", "multiple of 8"),
                                                   (8, 2, "striped", "layout must be")])
def test_run_ring_bad_shapes(N, P, layout, words):
    x = torch.randn(1, 1, N, 4)
    with pytest.raises(ValueError, match=words):
        L.run_ring(ring_ok, x, x, x, P, layout=layout)


def test_run_ring_refuses_what_it_cannot_ship():
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="def"):
        L.run_ring(lambda q, k, v, **kw: (q, q[..., 0]), x, x, x, 2)

    def outer():
        y = 1

        def inner(q, k, v, causal=False, layout="contiguous"):
            return q * y, q[..., 0]
        return inner
    with pytest.raises(ValueError, match="closure"):
        L.run_ring(outer(), x, x, x, 2)
    with pytest.raises(ValueError, match="gloo"):
        L.run_ring(ring_ok, x, x, x, 2, backend="nccl")


def test_raising_rank_is_named_and_nothing_survives():
    x = torch.randn(1, 1, 8, 4)
    with pytest.raises(L.RingError, match=r"rank 1 raised IndexError: planted failure on rank 1 at line \d+ "
                                          r"of test_lesson09.py \(in ring_raises\)") as info:
        L.run_ring(ring_raises, x, x, x, 2)
    assert info.value.ranks == [1]
    _no_survivors()


def test_deadlock_is_stopped_within_the_limit_with_a_hint():
    x = torch.randn(1, 1, 8, 4)
    t = time.monotonic()
    with pytest.raises(L.RingError) as info:
        L.run_ring(ring_deadlock, x, x, x, 2, timeout=2.0)
    assert time.monotonic() - t < 15
    assert "rank 0 (waiting for a send of 64 bytes to rank 1)" in str(info.value)
    assert "every rank is blocked in a send" in info.value.hint
    _no_survivors()


def test_schedule_and_layout():
    assert L.ring_schedule(4, "contiguous") == [[0.5] + [1] * r + [0] * (3 - r) for r in range(4)]
    totals = [sum(r) for r in L.ring_schedule(4, "zigzag")]
    assert max(totals) == min(totals) == 2.0
    x = torch.arange(16.0).reshape(1, 1, 16, 1)
    parts = L.shard(x, 4, "zigzag")
    assert parts[0].flatten().tolist() == [0, 1, 14, 15]
    assert torch.equal(L.unshard(parts, "zigzag"), x)


def test_function_from_a_notebook_cell_under_spawn(tmp_path, monkeypatch):
    """The path a learner takes: a function defined in a cell, shipped by source, spawn start method."""
    import nbclient
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import os; os.environ['COURSE_RING_START'] = 'spawn'\n"
                                  "import torch, torch.distributed as dist\nfrom helpers import lesson09 as L"),
        nbformat.v4.new_code_cell("SCALE = 2.0\n\ndef helper(x):\n    return x * SCALE\n\n"
                                  "def local_only(q, k, v, causal=False, layout='contiguous'):\n"
                                  "    o, lse = L.chunk_attention(q, k, v)\n"
                                  "    return helper(o) + dist.get_rank(), lse"),
        nbformat.v4.new_code_cell("x = torch.randn(1, 1, 4, 2)\nO, lse = L.run_ring(local_only, x, x, x, 2)\n"
                                  "ref = torch.cat([L.chunk_attention(x[:, :, i:i+2], x[:, :, i:i+2], x[:, :, i:i+2])[0]"
                                  " * 2 + i // 2 for i in (0, 2)], 2)\n"
                                  "assert torch.allclose(O, ref, atol=1e-6), (O, ref)\nprint('shipped ok')"),
    ]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert "shipped ok" in nb.cells[2].outputs[0]["text"]


# ------------------------------------------------------------------ merge_attention
def merge_mean(o_a, lse_a, o_b, lse_b):
    return (o_a + o_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_nan(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b, lse


def merge_lse_max(o_a, lse_a, o_b, lse_b):
    o, _ = _merge(o_a, lse_a, o_b, lse_b)
    return o, torch.maximum(lse_a, lse_b)


def merge_other_way(o_a, lse_a, o_b, lse_b):             # correct: a softmax over the two sides
    lse = torch.logsumexp(torch.stack([lse_a, lse_b]), 0)
    w = torch.softmax(torch.stack([lse_a, lse_b]), 0).nan_to_num(0.0)
    return w[0][..., None] * o_a + w[1][..., None] * o_b, lse


def test_merge_mean_rejected():
    rejects(check.merge_attention, merge_mean, "plain mean")


def test_merge_nan_rejected():
    rejects(check.merge_attention, merge_nan, "BOTH sides", "safe max")


def test_merge_lse_max_rejected():
    rejects(check.merge_attention, merge_lse_max, "drops the smaller side")


def test_merge_other_way_passes(strict):
    check.merge_attention(merge_other_way)


# ------------------------------------------------------------------ ring_attention: planted bugs
@pytest.mark.parametrize("fn, words", [
    (ring_reverse, ["opposite ways"]),
    (ring_no_swap, ["OWN chunk"]),
    (ring_mean, ["averaged"]),
    (ring_diag_all, ["diagonal"]),
    (ring_zigzag_misordered, ["2P - 1 - r"]),
    (ring_no_skip_nan, ["NaN", "Skip chunks"]),
    (ring_hoard, ["held", "chunks of K/V at once"]),
    (ring_no_skip_masked, ["blocks of work", "skip"]),
    (ring_allgather, ["collective (allgather", "all-gather"]),
    (ring_raises, ["rank 1 raised IndexError", "ring_raises"]),
    (ring_blocking, ["computed nothing while a receive was in flight", "blocking send/recv"]),
    (ring_reversed, ["the ring turns the other way", "(rank + 1) % P"]),
    (ring_hop, ["rank 0 sent to rank(s) [1, 2]", "one hop"]),
    (ring_wait_first, ["computed nothing while a receive was in flight", "post the transfer first"]),
    (ring_wire64, ["sent float64 tensors", "in their own dtype"]),
    (ring_numpy_kept, ["out of torch", "keep K/V chunks as torch tensors"]),
    (ring_numpy_skip, ["out of torch", "keep K/V chunks as torch tensors"]),
    (ring_collective_error, ["inside torch.distributed", "same shape and dtype on both sides"]),
])
def test_ring_bug_rejected(fn, words):
    rejects(check.ring_attention, fn, *words)
    _no_survivors()


def test_ring_deadlock_rejected_within_the_limit(monkeypatch):
    monkeypatch.setattr(C, "TIME_LIMIT_S", 2.0)
    t = time.monotonic()
    rejects(check.ring_attention, ring_deadlock, "not finished after 2 s", "blocked in a send", "batch_isend_irecv")
    assert time.monotonic() - t < 15
    _no_survivors()


@pytest.mark.parametrize("fn", [ring_other_way, ring_f64])
def test_ring_other_way_passes(fn, strict, capsys):
    check.ring_attention(fn)
    assert "✅ ring_attention" in capsys.readouterr().out


def test_simulation_without_mistakes_is_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 3, generator=g) for _ in range(3))
    for layout in L.LAYOUTS:
        O, lse = C._simulate(q, k, v, 4, True, layout)
        o_ref, lse_ref = reference.attention(q, k, v, mask=reference.causal_mask(16, 16))
        assert torch.allclose(O, o_ref, atol=1e-10) and torch.allclose(lse, lse_ref, atol=1e-10)
