"""Checkers of lesson 09, ring attention: the pairwise LSE merge and ``ring_attention`` on real processes.

``ring_attention`` is run by ``helpers.lesson09.launch`` on 2, 3 and 4 gloo processes (one
process group per world size, every input of that size in it) and compared, rank by rank,
with float64 SDPA on the whole sequence (``helpers.reference.attention``). What the
launcher measured on each rank is checked too: bytes sent and received (P-1 chunks of K
and V, in their dtype), sent only to the next rank and received only from the previous one, no
collective moving K/V, nothing taken out of torch, at most 2 K/V chunks alive at once, compute
while a receive is in flight (overlap), and the causal work (matmul FLOPs) per rank: no invisible chunk computed, and zigzag balanced (max/min <= 1.1).
The known mistakes are modelled by a one-process simulation of the ring (``_simulate``).
"""
from __future__ import annotations

import builtins

import torch

from .. import checking, reference
from .. import lesson09 as L
from ..checking import Bug, Case, exercise
from ..cases import NEG_INF, gen

TIME_LIMIT_S = 20.0     # per input and rank; tests lower it


# ------------------------------------------------------------------ merge_attention
def _merge64(o_a, lse_a, o_b, lse_b):
    return L.merge_reference(o_a.double(), lse_a.double(), o_b.double(), lse_b.double())


def _merge_case(name, shape, seed, lse_scale=3.0, note="", edit=None):
    rng = gen(seed)
    o_a, o_b = torch.randn(*shape, generator=rng), torch.randn(*shape, generator=rng)
    lse_a, lse_b = (torch.randn(*shape[:-1], generator=rng) * lse_scale for _ in range(2))
    if edit:
        edit(o_a, lse_a, o_b, lse_b)
    return Case(name, o_a, lse_a, o_b, lse_b, note=note)


def _merge_cases():
    def one_empty(o_a, lse_a, o_b, lse_b):
        lse_b[..., ::2] = NEG_INF
        o_b[..., ::2, :] = 0.0

    def both_empty(o_a, lse_a, o_b, lse_b):
        lse_a[..., 1] = NEG_INF
        lse_b[..., 1] = NEG_INF
        o_a[..., 1, :] = 0.0
        o_b[..., 1, :] = 0.0
        lse_a[..., 3] = NEG_INF
        o_a[..., 3, :] = 0.0

    def far(o_a, lse_a, o_b, lse_b):
        lse_a[..., 0] = 40.0
        lse_b[..., 0] = -40.0

    def huge(o_a, lse_a, o_b, lse_b):
        lse_a.add_(1000.0)
        lse_b.add_(1000.0)

    return [
        _merge_case("two partials, [B, H, n, d] = [2, 3, 5, 4]", (2, 3, 5, 4), 1),
        _merge_case("odd shape [1, 1, 7, 3]", (1, 1, 7, 3), 2),
        _merge_case("one side has no keys on every other row (lse = -inf, O = 0)", (1, 2, 6, 4), 3, edit=one_empty,
                    note="an empty side must weigh exactly 0"),
        _merge_case("rows where BOTH sides are empty", (2, 1, 5, 3), 4, edit=both_empty,
                    note="a row that has seen no key yet (the accumulator starts at O = 0, lse = -inf) merged with "
                         "a chunk it cannot see: the answer is still O = 0, lse = -inf, never NaN"),
        _merge_case("lse far apart (40 vs -40)", (1, 2, 4, 4), 5, edit=far),
        _merge_case("huge lse (1000: exp overflows)", (1, 2, 4, 4), 6, edit=huge,
                    note="exp(1000) is inf: weigh by exp(lse_x - lse), never by exp(lse_x)"),
    ]


def _merge_bugs():
    def mean(c):
        return (c.args[0].double() + c.args[2].double()) / 2

    def unnormalised(c):
        o_a, lse_a, o_b, lse_b = (a.double() for a in c.args)
        m = torch.maximum(lse_a, lse_b)
        return torch.exp(lse_a - m)[..., None] * o_a + torch.exp(lse_b - m)[..., None] * o_b

    return [Bug("that is the plain mean of the two outputs: each O is normalised over ITS keys only; weigh them "
                "by their softmax mass, exp(lse_a - lse) and exp(lse_b - lse) (lesson 06)", mean),
            Bug("the weights exp(lse_x - max) do not sum to 1: use exp(lse_x - lse) with "
                "lse = logaddexp(lse_a, lse_b)", unnormalised)]


def _merge_lse_bugs():
    return [Bug("lse = max(lse_a, lse_b) drops the smaller side's mass: lse = log(exp(lse_a) + exp(lse_b)), "
                "computed as m + log(exp(lse_a - m) + exp(lse_b - m))",
                lambda c: torch.maximum(c.args[1].double(), c.args[3].double())),
            Bug("masses add, so their logs combine by logaddexp, not by +",
                lambda c: c.args[1].double() + c.args[3].double())]


@exercise("merge_attention", arg_names=["o_a", "lse_a", "o_b", "lse_b"],
          reference="float64 torch.logaddexp merge")
def merge_attention(g):
    bugs, lse_bugs = _merge_bugs(), _merge_lse_bugs()
    for case in _merge_cases():
        o_a, lse_a = case.args[:2]
        out = g.call(case)
        o, lse = g.expect_tuple(out, 2, "(o, lse)")
        g.expect_tensor(o, "o", shape=o_a.shape, dtype=o_a.dtype)
        g.expect_tensor(lse, "lse", shape=lse_a.shape, dtype=lse_a.dtype)
        o_ref, lse_ref = _merge64(*case.args)
        nan_hint = ("NaN where both sides are empty: exp(-inf - (-inf)) is NaN; use a safe max (0 where it is -inf) "
                    "so both weights are 0, O = 0 and lse = -inf") if "BOTH" in case.name else ""
        g.compare(lse, lse_ref, "lse", rtol=1e-5, atol=1e-5, bugs=lse_bugs, nan_hint=nan_hint,
                  hint="lse = m + log(exp(lse_a - m) + exp(lse_b - m)), m = max(lse_a, lse_b)")
        g.compare(o, o_ref, "o", rtol=1e-4 if "huge" not in case.name else 5e-4, atol=1e-5, bugs=bugs,
                  nan_hint=nan_hint, hint="o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b")
        g.count()


# ------------------------------------------------------------------ ring_attention: the simulation of mistakes
def _simulate(q, k, v, P, causal, layout, *, held=None, believed=None, positions=None, merge="lse",
              diag_everywhere=False):
    """Global (O, lse) in float64 of a one-process ring with a mistake planted.

    held(r, t): whose K/V rank r really holds at step t; believed(r, t): whose it thinks it is;
    positions(r): the chunks rank r thinks it holds; merge: "lse" | "mean" | "running";
    diag_everywhere: every visible chunk pair is masked as if it were on the diagonal.
    """
    held = held or (lambda r, t: (r - t) % P)
    believed = believed or (lambda r, t: (r - t) % P)
    positions = positions or (lambda r: L.chunks_of_rank(r, P, layout))
    N = q.shape[2]
    n_chunks = L.check_layout(N, P, layout)
    c = N // n_chunks
    qs, ks, vs = (L.shard(t.double(), P, layout) for t in (q, k, v))

    def pos(r):
        return torch.cat([torch.arange(ch * c, (ch + 1) * c) for ch in positions(r)])

    outs, lses = [], []
    for r in range(P):
        parts = []
        for t in range(P):
            s_h, s_b = held(r, t), believed(r, t)
            if causal:
                mask = pos(s_b)[None, :] <= pos(r)[:, None]           # [n, n]
                if not mask.any():
                    continue
                if diag_everywhere:
                    mask = torch.ones_like(mask).tril()
            else:
                mask = None
            parts.append(reference.attention(qs[r], ks[s_h], vs[s_h], mask=mask))
        if merge == "lse":
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
            safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
            o = sum(torch.exp(p[1] - safe)[..., None] * p[0] for p in parts)
        elif merge == "mean":
            o = sum(p[0] for p in parts) / len(parts)
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
        else:  # running mean
            o = parts[0][0]
            for p in parts[1:]:
                o = (o + p[0]) / 2
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
        outs.append(o)
        lses.append(lse)
    return L.unshard(outs, layout, dim=-2), L.unshard(lses, layout, dim=-1)


def _rank_o(model, rank):
    """A Bug model for rank ``rank``'s O, from a global simulation."""
    def f(case):
        P, layout = case.kwargs["world_size"], case.kwargs["layout"]
        O, _ = model(case)
        return L.shard(O, P, layout)[rank]
    return f


def _ring_bug_models(case):
    q, k, v = case.args
    P, causal, layout = case.kwargs["world_size"], case.kwargs["causal"], case.kwargs["layout"]

    def sim(**kw):
        return lambda c: _simulate(q, k, v, P, causal, layout, **kw)

    return [
        ("the answer matches a ring that holds rank (r + t) % P's chunk at step t while masking as if it were "
         "rank (r - t) % P's: the sends and the bookkeeping go opposite ways round the ring. Send to (rank + 1) % P, "
         "receive from (rank - 1) % P, and at step t you hold the chunk of rank (rank - t) % P",
         sim(held=lambda r, t: (r + t) % P)),
        ("the answer matches a ring where each rank uses its OWN chunk at every step: the received chunk was never "
         "used (swap in the receive buffer after waiting: k_cur, v_cur = k_next, v_next)",
         sim(held=lambda r, t: r)),
        ("the partial outputs were averaged: each step's O is normalised over that chunk's keys only; merge them by "
         "their LSE (your merge_attention), which weighs each by exp(lse_t - lse)", sim(merge="mean")),
        ("the partial outputs were averaged pairwise, (O + O_t) / 2: merge them by their LSE (merge_attention)",
         sim(merge="running")),
        ("every visible chunk was masked as if it were on the diagonal (causal=True for every chunk): only the "
         "chunk pair with the same position needs the causal mask; a chunk from earlier in the sequence is seen "
         "in full (causal=False)", sim(diag_everywhere=True)),
        ("the answer matches a zigzag layout read as chunks r and P + r: rank r holds chunks r and 2P - 1 - r "
         "(rank 0 holds the first and the LAST chunk), so the second half's positions, and which chunk pairs are "
         "visible, differ", sim(positions=lambda r: [r, P + r])),
    ]


# ------------------------------------------------------------------ ring_attention: the cases
def _ring_case(name, P, B, H, N, d, causal, layout, seed, scale=1.0, note=""):
    rng = gen(seed)
    q = torch.randn(B, H, N, d, generator=rng) * scale
    k, v = torch.randn(B, H, N, d, generator=rng), torch.randn(B, H, N, d, generator=rng)
    return Case(name, q, k, v, causal=causal, layout=layout, world_size=P, note=note)


def _ring_plan():
    return {
        2: [_ring_case("P=2, not causal, contiguous", 2, 1, 3, 8, 5, False, "contiguous", 1),
            _ring_case("P=2, causal, contiguous", 2, 2, 1, 12, 7, True, "contiguous", 2),
            _ring_case("P=2, causal, zigzag", 2, 1, 3, 16, 5, True, "zigzag", 3),
            _ring_case("P=2, not causal, zigzag", 2, 1, 1, 8, 3, False, "zigzag", 4),
            _ring_case("P=2, causal, zigzag, large logits (q x 20)", 2, 1, 2, 8, 4, True, "zigzag", 5, scale=20.0)],
        3: [_ring_case("P=3, causal, contiguous", 3, 1, 3, 18, 5, True, "contiguous", 6),
            _ring_case("P=3, causal, zigzag", 3, 1, 1, 24, 7, True, "zigzag", 7),
            _ring_case("P=3, not causal, contiguous", 3, 2, 1, 9, 3, False, "contiguous", 8)],
        4: [_ring_case("P=4, causal, zigzag", 4, 1, 3, 32, 5, True, "zigzag", 9,
                       note="the work per rank is metered: every rank should do the same"),
            _ring_case("P=4, causal, contiguous", 4, 1, 2, 16, 3, True, "contiguous", 10),
            _ring_case("P=4, not causal, zigzag", 4, 1, 1, 16, 5, False, "zigzag", 11)],
    }


def _exception_hint(type_name, msg):
    hint_for = getattr(checking, "_hint_for_exception", None)
    cls = getattr(builtins, type_name, None)
    if hint_for is None or not (isinstance(cls, type) and issubclass(cls, Exception)):
        return ""
    try:
        return hint_for(cls(msg))
    except Exception:  # noqa: BLE001
        return ""


def _distributed_hint(e):
    """A hint for an error raised inside torch.distributed (the last frame of the rank's traceback is there)."""
    frames = [line for line in (e.details or "").splitlines() if line.strip().startswith("File ")]
    if not any("torch/distributed" in f.replace("\\", "/") for f in frames):
        return ""
    return ("the error came from inside torch.distributed, in the call on your line: a send and its receive (or "
            "every rank's part of a collective) must match, the same shape and dtype on both sides, in the same "
            "order on every rank; ring attention needs no collective, only isend/irecv (batch_isend_irecv)")


def _run_batch(g, P, cases):
    jobs = []
    for c in cases:
        per_rank = list(zip(*(L.shard(t, P, c.kwargs["layout"]) for t in c.args)))
        jobs.append((per_rank, {"causal": c.kwargs["causal"], "layout": c.kwargs["layout"]}))

    def run():
        try:
            return L.launch(g.learner_fn, jobs, P, timeout=TIME_LIMIT_S)
        except L.ShipError as e:
            g.fail(f"the launcher cannot send your function to the worker processes: {e}")
        except L.RingError as e:
            case = cases[e.job] if e.job is not None and e.job < len(cases) else cases[0]
            hint = e.hint or _distributed_hint(e) or _exception_hint(e.kind, str(e))
            g.fail(str(e), hint=hint, case=case)

    batch = Case(f"world_size={P}: {len(cases)} inputs in one process group",
                 note="each rank runs ring_attention(q_r, k_r, v_r, causal=..., layout=...) on its chunk(s)")
    return g.call(batch, fn=run)


_NAN_HINT = ("NaN: a row that sees no key in a chunk (causal: a chunk from later in the sequence) makes exp(-inf - "
             "(-inf)). Skip chunks a rank cannot see, and guard the merge (both lse = -inf stays O = 0, lse = -inf)")


def _check_stats(g, case, results):
    P, causal, layout = case.kwargs["world_size"], case.kwargs["causal"], case.kwargs["layout"]
    q, k, v = case.args
    B, H, N, d = q.shape
    n = N // P
    chunk_bytes = 2 * B * H * n * d * k.element_size()           # one rank's K and V
    want = (P - 1) * chunk_bytes
    for r, res in enumerate(results):
        s = res.stats
        big = [(op, b) for op, b in s.collectives if b >= chunk_bytes // 2]
        if big:
            op, b = big[0]
            g.fail(f"rank {r} called a collective ({op}, {b:,} bytes)",
                   hint="an all-gather of K and V puts the whole sequence's K/V on every rank: the memory ring "
                        "attention exists to avoid. Pass one chunk at a time to the next rank (isend/irecv)")
        if s.escaped:
            g.fail(f"rank {r} took {s.escaped:,} bytes of K/V out of torch (.numpy() or .tolist())",
                   hint="keep K/V chunks as torch tensors and compute with torch: a numpy or Python copy is "
                        "invisible to the checker's count of chunks held and of work done (on a GPU it is a "
                        "copy to the host); a list of them is an all-gather, and work on a chunk a rank cannot "
                        "see is to be skipped, not done elsewhere")
        wire = sorted({dt for dt in s.send_dtypes if dt != str(k.dtype).replace("torch.", "")})
        if wire:
            g.fail(f"rank {r} sent {wire[0]} tensors; the chunks are {str(k.dtype).replace('torch.', '')}",
                   hint="send K and V in their own dtype: an upcast copy on the wire doubles the bytes (float64 "
                        "is 8 bytes an element). Compute in higher precision after receiving, if you want to")
        if s.bytes_sent != want or s.bytes_recv != want:
            g.fail(f"rank {r} sent {s.bytes_sent:,} and received {s.bytes_recv:,} bytes; a ring passes P - 1 = "
                   f"{P - 1} chunks of K and V, {want:,} bytes each way",
                   hint="every rank sends the K/V chunk it holds to (rank + 1) % P and receives the next from "
                        "(rank - 1) % P, P - 1 times (the last chunk need not travel on)" if s.bytes_sent > want else
                        "some chunk did not go round the whole ring: P - 1 transfers of K and V per rank")
        nxt, prv = (r + 1) % P, (r - 1) % P
        peers_out, peers_in = sorted(set(s.send_to)), sorted(set(s.recv_from) - {-1})
        if P > 2 and peers_out == [prv] and peers_in in ([], [nxt]):
            g.fail(f"rank {r} sent to rank {prv} and received from rank {nxt}: the ring turns the other way",
                   hint="the lesson's ring sends to (rank + 1) % P and receives from (rank - 1) % P, so that at "
                        "step t a rank holds the chunk of rank (rank - t) % P; keep that direction")
        if peers_out != [nxt] or peers_in not in ([], [prv]):
            g.fail(f"rank {r} sent to rank(s) {peers_out} and received from {peers_in or ['any']}; a ring sends "
                   f"only to its next rank, {nxt}, and receives only from its previous one, {prv}",
                   hint="each step passes the chunk in hand one hop: send to (rank + 1) % P, receive from "
                        "(rank - 1) % P (on GPUs these are the NVLink neighbours; sending to rank + t crosses "
                        "the ring)")
        if s.peak_chunks > 2.0 + 1e-9:
            g.fail(f"rank {r} held {s.peak_chunks:.3g} chunks of K/V at once (received buffers and copies); "
                   f"a ring needs 2: the one in hand and the one in flight",
                   hint="don't collect the chunks (a list of them is an all-gather). Allocate the next receive "
                        "buffers, wait, then swap them in; the request objects from isend/batch_isend_irecv keep "
                        "their tensors alive until you drop them (reqs = None after waiting)")
    if causal:
        _check_causal_work(g, case, results)
    for r, res in enumerate(results):
        s = res.stats
        if P > 1 and s.flops > 0 and s.overlapped and not any(f > 0 for f in s.overlapped):
            g.fail(f"rank {r} computed nothing while a receive was in flight: each of its {len(s.overlapped)} "
                   "receives was waited for before any attention",
                   hint="post the transfer first (dist.batch_isend_irecv, or isend/irecv), compute on the chunk in "
                        "hand, then wait: the transfer hides behind the compute. Waiting right after posting "
                        "(or a blocking send/recv) serialises them")


def _check_causal_work(g, case, results):
    """Causal: no invisible chunk computed (matmul FLOPs per rank), zigzag balanced."""
    P, layout = case.kwargs["world_size"], case.kwargs["layout"]
    B, H, N, d = case.args[0].shape
    n = N // P
    flops = [res.stats.flops for res in results]
    if layout == "contiguous":
        block = 4 * B * H * n * n * d
        for r, f in enumerate(flops):
            if f > (r + 1) * block * 1.001:
                g.fail(f"rank {r} did {f / block:.3g} blocks of work (matmul FLOPs / one chunk-by-chunk block); "
                       f"with causal masking it sees {r + 1} chunk(s): its own and those of ranks before it",
                       hint="skip a chunk from a later position entirely (no matmul): it is invisible, the "
                            "'skip' class of lesson 04")
    else:
        c = N // (2 * P)
        half = 4 * B * H * c * c * d
        bound = 2 * P + 2
        for r, f in enumerate(flops):
            if f > bound * half * 1.001:
                g.fail(f"rank {r} did {f / half:.3g} half-chunk blocks of work; the visible ones fit in {bound}",
                       hint="at a step with a chunk from an earlier rank, only its first half is visible to your "
                            "queries; with a later rank's chunk, only your second half of queries sees it: compute "
                            "just those")
        if min(flops) <= 0 or max(flops) / min(flops) > 1.1:
            g.fail(f"the zigzag work per rank is unbalanced: {', '.join(f'{f / half:.3g}' for f in flops)} "
                   "half-chunk blocks (max/min must be <= 1.1)",
                   hint="with zigzag every rank does the same work at every step: skip only what is invisible")


@exercise("ring_attention", arg_names=["q", "k", "v"], reference="float64 SDPA on the whole sequence")
def ring_attention(g):
    for P, cases in _ring_plan().items():
        batch = _run_batch(g, P, cases)
        for case, results in zip(cases, batch):
            g.case = case
            q, k, v = case.args
            B, H, N, d = q.shape
            causal, layout = case.kwargs["causal"], case.kwargs["layout"]
            mask = reference.causal_mask(N, N) if causal else None
            o_ref, lse_ref = reference.attention(q, k, v, mask=mask)
            o_ref_r, lse_ref_r = L.shard(o_ref, P, layout), L.shard(lse_ref[..., None], P, layout)
            models = _ring_bug_models(case)
            for r, res in enumerate(results):
                O, lse = g.expect_tuple(res.out, 2, f"(O, lse) from rank {r}")
                n = N // P
                g.expect_tensor(O, f"O of rank {r}", shape=(B, H, n, d), dtype=q.dtype)
                g.expect_tensor(lse, f"lse of rank {r}", shape=(B, H, n), dtype=q.dtype)
                bugs = [Bug(h, _rank_o(m, r)) for h, m in models]
                rtol = 1e-4 if "large" not in case.name else 5e-4
                g.compare(O, o_ref_r[r], f"O on rank {r}", rtol=rtol, atol=1e-5, bugs=bugs, nan_hint=_NAN_HINT,
                          hint="at step t rank r holds the K/V of rank (r - t) % P; attend to what it can see "
                               "(all of it without causal) and merge by LSE")
                g.compare(lse, lse_ref_r[r][..., 0], f"lse on rank {r}", rtol=1e-5, atol=1e-5, nan_hint=_NAN_HINT,
                          hint="lse is the natural-log log-sum-exp over every key the row sees, across all steps")
            _check_stats(g, case, results)
            g.count()
    return f"{g.cases} inputs on 2-4 gloo processes match float64 SDPA (max rel err {g.max_rel_err:.0e}); " \
           "bytes, chunks held and causal work per rank as a ring should"
