"""Lesson 12's masks and score modifications on one GPU: the course's kernels against FlexAttention and against SDPA
with a dense boolean mask.

    python3 bench/bench_masks.py [--N 8192 32768] [--d 64 128] [--bwd] [--scaling] [--targets | --masks NAME ...]

(The recorded run, ``make bench``'s: ``--d 128 64 --bwd --scaling --targets``.)

Per mask and score_mod (causal; sliding windows (1024, 0) and (4096, 0), causal; 8 and 64 packed documents, causal;
prefix-LM with a quarter of the sequence as prefix; softcap 50 and ALiBi on the causal mask), bf16, H = 16,
B * N = 16384 tokens (B = 1 from N = 16384 on). "course" is the path a user of the course takes for that mask:
masks that are an interval around the diagonal (causal, windows) and the score mods on them go to the dense kernels
with the FlashAttention library's arguments (``flash_attn_triton(..., causal=True, window_size=..., softcap=...,
alibi_slopes=...)``, ``flash_attention`` for the backward): tile classes by arithmetic, no index; documents and
prefix-LM go to the block-sparse kernels (``flash_attn_block_sparse_triton``, its block index built on the device
beforehand, not timed). Window and causal rows also time the block-sparse kernel on the same mask
(``block_sparse_ms``). Peers: ``flex_attention`` compiled with ``torch.compile`` (its block mask from
``create_block_mask``, 128 x 128, not timed) and SDPA with the dense ``[N, N]`` boolean mask (no score mod: it has
none; rows with one get no SDPA figure). With ``--bwd`` also the backward (dO given, dQ, dK, dV) of the course and of
FlexAttention; SDPA's is left out. ``--scaling``: the course's sliding window (1024, 0) alone at B = 1 and
N = 8192 and 65536 (forward, and backward with ``--bwd``): its time should grow as N, not N^2.

Correctness first, every row: O of the first and last head against float64 (the mask and score_mod applied
densely, chunked on the GPU), within twice FlexAttention's own error in bf16 (FlashAttention's 2x rule,
FlexAttention as the baseline that runs every row), lse within 5e-3; a row that fails is recorded and not timed.
The backward's gradients are compared with FlexAttention's (largest difference over the largest gradient,
``bwd_rel_diff``, timed when below 5e-2): no float64 backward at these sizes. Timing: bench/common.py's do_bench
median, L2 flushed. Writes bench/results/masks_<gpu>.json after every row (keeping the rows of other (N, d) from
an earlier run: a call per d fits a ten-minute limit) and prints a short table last, with the issue's geometric
means.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import ERR_FLOOR, TIMING, bench_ms, log, results_path, run_meta, sdpa_ms, why, write_json  # noqa: E402

import torch  # noqa: E402

NEEDS_CUDA = "bench_masks.py times kernels on a CUDA GPU, and this machine has none (torch.cuda.is_available() is False)"


def cases(N, device):
    """[(name, the course's MaskSpec, its score_mod, lesson 12's mask_mod, lesson 12's score_mod or None, route)]:
    one mask written twice, for the course's block-sparse kernel (a constexpr variant) and for FlexAttention and the
    reference (lesson 12's predicates, which run under vmap and torch.compile); ``route``: the dense kernels'
    keyword arguments for the same mask and mod (the FlashAttention library's), or None where the course takes the
    block-sparse kernel (documents, prefix-LM)."""
    from helpers import lesson12 as L
    from helpers.kernels import block_sparse as bs
    g = torch.Generator().manual_seed(0)

    def docs(n_docs):  # random lengths, at least 1 each, summing to N
        cuts = torch.sort(torch.randperm(N - 1, generator=g)[:n_docs - 1] + 1).values
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([N])]))
        return torch.repeat_interleave(torch.arange(n_docs), lengths).to(device)

    H = 16
    slopes = L.alibi_slopes(H).to(device)
    out = [("causal", bs.causal_mask(), None, L.causal(N, N), None, dict(causal=True))]
    for w in (1024, 4096):
        if w < N:
            out.append((f"window ({w}, 0)", bs.sliding_window_mask((w, 0), causal=True), None,
                        L.sliding_window(N, N, (w, 0), is_causal=True), None, dict(causal=True, window_size=(w, 0))))
    for n in (8, 64):
        ids = docs(n)
        out.append((f"{n} documents", bs.document_mask(ids, causal=True), None, L.document(ids, is_causal=True), None,
                    "varlen"))
    out.append((f"prefix-LM {N // 4}", bs.prefix_lm_mask(N // 4), None, L.prefix_lm(N // 4), None, None))
    out.append(("softcap 50, causal", bs.causal_mask(), bs.SoftCap(50.0), L.causal(N, N), L.softcap(50.0),
                dict(causal=True, softcap=50.0)))
    out.append(("ALiBi, causal", bs.causal_mask(), bs.ALiBi(slopes.float()), L.causal(N, N), L.alibi(slopes, N, N),
                dict(causal=True, alibi_slopes=slopes.float())))
    return out


# The targets: the geometric mean over these masks (at every N and d timed) of FlexAttention's time over
# the course's, forward and backward; SDPA with a dense mask at N = 32768 and window 1024; the window's scaling.
TARGET_MASKS = ("window (1024, 0)", "window (4096, 0)", "8 documents", "64 documents", "softcap 50, causal",
                "ALiBi, causal")


def doc_cu_seqlens(doc_ids, B):
    """The packed-documents layout of ``B`` sequences sharing doc_ids [N]: (cu_seqlens int32 [docs * B + 1],
    the longest document)."""
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[1:] = doc_ids[1:] != doc_ids[:-1]
    starts = new.nonzero().flatten()
    lengths = torch.diff(torch.cat([starts, starts.new_tensor([doc_ids.numel()])])).repeat(B)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    return cu, int(lengths.max())


class CoursePath:
    """The course's path for a row, in its own layout: ``forward() -> (O, lse)``; ``leaves()`` the inputs as leaf
    tensors that require grad and ``differentiable(q, k, v) -> O`` for the backward; ``dense(t)`` any of its
    [B, H, N, d]-shaped results (O, a gradient) in the dense layout and ``dense_lse`` its lse as [B, H, N].
    route: the dense kernels' keyword arguments; "varlen" (packed documents: the FlashAttention library's way,
    ``flash_attn_varlen_func``; the inputs packed [B * N, H, d] and the grid's block map built beforehand, not
    timed, as a training step builds them once for every layer); None: the block-sparse kernels."""

    def __init__(self, q, k, v, route, bm, mod, spec):
        from helpers.kernels import block_sparse as bs
        self.B, self.H, self.N, self.d = q.shape
        self.route = route
        if route == "varlen":
            from helpers.kernels.varlen import flash_attn_varlen_triton, prepare_varlen
            from helpers.kernels.varlen_backward import flash_attention_varlen
            cu, longest = doc_cu_seqlens(spec.doc_ids, self.B)
            self.inputs = tuple(self.packed(t) for t in (q, k, v))  # [B * N, H, d]
            batch = prepare_varlen(cu, max_seqlen_q=longest)  # once, as a training step does for every layer
            self.forward = lambda: flash_attn_varlen_triton(*self.inputs, batch, causal=True)
            self.differentiable = lambda a, b, c: flash_attention_varlen(a, b, c, batch, causal=True)
        elif route is not None:
            from helpers.kernels.backward import flash_attention
            from helpers.kernels.forward import flash_attn_triton
            self.inputs = (q, k, v)
            self.forward = lambda: flash_attn_triton(q, k, v, **route)
            self.differentiable = lambda a, b, c: flash_attention(a, b, c, **route)
        else:
            self.inputs = (q, k, v)
            self.forward = lambda: bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=mod)
            self.differentiable = lambda a, b, c: bs.flash_attn_block_sparse(a, b, c, bm, mod)[0]

    def packed(self, t):
        return t.transpose(1, 2).reshape(self.B * self.N, self.H, self.d).contiguous()

    def dense(self, t):
        if self.route != "varlen":
            return t
        return t.view(self.B, self.N, self.H, self.d).transpose(1, 2)

    def dense_lse(self, lse):
        return lse.view(self.H, self.B, self.N).transpose(0, 1) if self.route == "varlen" else lse

    def leaves(self):
        return tuple(t.detach().requires_grad_() for t in self.inputs)


def dense_mask(mask_mod, N, device):
    """bool [N, N] on the device: the predicate on every pair (SDPA's attn_mask and the reference's)."""
    i = torch.arange(N, device=device)[:, None]
    j = torch.arange(N, device=device)[None, :]
    return torch.as_tensor(mask_mod(0, 0, i, j)).expand(N, N)


def reference(q, k, v, mask_mod, score_mod, b, h, chunk=2048):
    """float64 (O [N, d], lse [N]) of head (b, h), the mod and the mask applied densely, ``chunk`` rows at a time."""
    qh, kh, vh = (t[b, h].double() for t in (q, k, v))
    N, d = qh.shape
    j = torch.arange(kh.shape[0], device=q.device)[None, :]
    outs, lses = [], []
    for i0 in range(0, N, chunk):
        i = torch.arange(i0, min(i0 + chunk, N), device=q.device)[:, None]
        s = qh[i0:i0 + chunk] @ kh.T / math.sqrt(d)  # [chunk, Nk]
        if score_mod is not None:
            s = score_mod(s, b, h, i, j)
        s = s.masked_fill(~torch.as_tensor(mask_mod(b, h, i, j)), float("-inf"))
        lse = torch.logsumexp(s, -1)  # [chunk]
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[:, None])
        outs.append(p @ vh)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check(q, k, v, mask_mod, score_mod, o, lse, o_flex):
    """The course's O within twice FlexAttention's error against float64 (first and last head), lse within 5e-3."""
    B, H = q.shape[:2]
    err = flex_err = lse_err = 0.0
    for b, h in ((0, 0), (B - 1, H - 1)):
        ro, rl = reference(q, k, v, mask_mod, score_mod, b, h)
        err = max(err, (o[b, h].double() - ro).abs().max().item())
        flex_err = max(flex_err, (o_flex[b, h].double() - ro).abs().max().item())
        seen = torch.isfinite(rl)
        lse_err = max(lse_err, (lse[b, h].double()[seen] - rl[seen]).abs().max().item())
    finite = bool(torch.isfinite(o).all())
    ok = finite and err <= 2 * flex_err + ERR_FLOOR and lse_err < 5e-3
    return {"pass": ok, "err": err, "flex_err": flex_err, "lse_err": lse_err}


def backward(q, k, v, course, fbm, fmod, flex):
    """The course's and FlexAttention's backward on one dO: their gradients' largest difference relative to the
    largest gradient, and (when below 5e-2) the ms of each backward alone (the forward's graph kept)."""
    mine_in = course.leaves()
    o = course.differentiable(*mine_in)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o_f = flex(qg, kg, vg, score_mod=fmod, block_mask=fbm)
    do_f = torch.randn_like(o_f)  # [B, H, N, d]
    do = course.packed(do_f) if course.route == "varlen" else do_f
    mine = [course.dense(g) for g in torch.autograd.grad(o, mine_in, do, retain_graph=True)]
    theirs = torch.autograd.grad(o_f, (qg, kg, vg), do_f, retain_graph=True)
    rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
              for a, b in zip(mine, theirs))
    row = {"bwd_rel_diff": round(rel, 5)}
    if rel < 5e-2:
        row["course_bwd_ms"] = bench_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=list(mine_in))
        row["flex_bwd_ms"] = bench_ms(lambda: o_f.backward(do_f, retain_graph=True), grad_to_none=[qg, kg, vg])
    return row


def scaling_rows(d, bwd, dtype=torch.bfloat16, H=16, window=(1024, 0)):
    """The course's sliding window at B = 1, N = 8192 and 65536: forward (and backward) ms, correctness checked at
    N = 8192 against float64 like every row."""
    from helpers import lesson12 as L
    from helpers.kernels.backward import flash_attention
    from helpers.kernels.forward import flash_attn_triton
    rows = []
    for N in (8192, 65536):
        q, k, v = (torch.randn(1, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        row = {"mask": f"window {window} scaling", "N": N, "B": 1, "d": d}
        o, lse = flash_attn_triton(q, k, v, causal=True, window_size=window)
        if N == 8192:
            ro, rl = reference(q, k, v, L.sliding_window(N, N, window, is_causal=True), None, 0, H - 1)
            row["err"] = (o[0, H - 1].double() - ro).abs().max().item()
        row["course_ms"] = bench_ms(lambda: flash_attn_triton(q, k, v, causal=True, window_size=window))
        if bwd:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            og = flash_attention(qg, kg, vg, causal=True, window_size=window)
            do = torch.randn_like(og)
            row["course_bwd_ms"] = bench_ms(lambda: og.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
        rows.append(row)
        q = k = v = og = None  # free them before the next N
    return rows


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary(rows):
    """The issue's figures from the rows: geometric means of flex / course over TARGET_MASKS, the SDPA ratio at
    N = 32768 window 1024, the window's time at 65536 over 8192."""
    target = [r for r in rows if r.get("mask") in TARGET_MASKS and r.get("pass")]
    out = {"fwd_x_flex": geomean([r["flex_ms"] / r["course_ms"] for r in target if r.get("course_ms")]),
           "bwd_x_flex": geomean([r["flex_bwd_ms"] / r["course_bwd_ms"] for r in target if r.get("course_bwd_ms")]),
           "rows": len(target)}
    w = [r for r in target if r["mask"] == "window (1024, 0)" and r["N"] == 32768 and r.get("sdpa_dense_ms")]
    out["sdpa_x_at_32k_w1024"] = [round(r["sdpa_dense_ms"] / r["course_ms"], 2) for r in w]
    for d in sorted({r.get("d") for r in rows if "scaling" in r.get("mask", "")}):
        sc = {r["N"]: r for r in rows if "scaling" in r.get("mask", "") and r.get("d") == d}
        if 8192 in sc and 65536 in sc:
            out[f"scaling_64k_over_8k_d{d}"] = round(sc[65536]["course_ms"] / sc[8192]["course_ms"], 2)
            if "course_bwd_ms" in sc[8192]:
                out[f"scaling_bwd_64k_over_8k_d{d}"] = round(sc[65536]["course_bwd_ms"] / sc[8192]["course_bwd_ms"], 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--d", type=int, nargs="+", default=[128])
    ap.add_argument("--bwd", action="store_true", help="also time the backward")
    ap.add_argument("--scaling", action="store_true", help="the sliding window's time at N = 8192 and 65536")
    ap.add_argument("--masks", nargs="+", default=None, help="only these masks (names as in the table)")
    ap.add_argument("--targets", action="store_true", help="only the issue's masks (TARGET_MASKS): the recorded run")
    args = ap.parse_args(argv)
    if args.targets:
        args.masks = list(TARGET_MASKS)
    if not torch.cuda.is_available():
        sys.exit(NEEDS_CUDA)
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from helpers.kernels import block_sparse as bs
    # One compiled FlexAttention serves every row: each new mask, score_mod or shape is a recompile, and past
    # dynamo's recompile limit (8 by default) torch.compile silently runs flex_attention eagerly, which
    # materialises every score (a 68x slower "FlexAttention" in a first run of this script). Lift the limit.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 10_000)
    flex = torch.compile(flex_attention, dynamic=False)
    gpu = torch.cuda.get_device_name()
    path = results_path(gpu, prefix="masks_")
    dtype, H = torch.bfloat16, 16
    result = {"meta": run_meta(gpu, timing=TIMING, dtype="bfloat16", H=H, flex_block=128), "rows": []}
    if os.path.exists(path):  # keep the rows of other (N, d) (one call per d fits a time limit)
        with open(path, encoding="utf-8") as f:
            old = json.load(f).get("rows", [])
        redo = {(N, d) for N in args.N for d in args.d}
        result["rows"] = [r for r in old if "d" in r and (r.get("N"), r["d"]) not in redo
                          and not (args.scaling and "scaling" in r["mask"] and r["d"] in args.d)]
    for d in args.d:
        for N in args.N:
            B = max(1, 16384 // N)
            q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
            tiles = bs.block_sparse_tiles(d, dtype, q.device, backward=args.bwd)
            for name, spec, mod, mask_mod, score_mod, route in cases(N, q.device):
                if args.masks and name not in args.masks:
                    continue
                row = {"mask": name, "N": N, "B": B, "d": d,
                       "route": "dense" if isinstance(route, dict) else route or "block-sparse",
                       "tiles": list(tiles)}
                log(f"d={d} N={N} {name}")
                try:
                    bm = bs.build_block_mask_triton(spec, N, N, *tiles, device=q.device)
                    fbm = create_block_mask(mask_mod.fn, None, None, N, N, device="cuda", BLOCK_SIZE=128)
                    row["visible"] = round(float(dense_mask(mask_mod, N, q.device).float().mean()), 4)
                    row["tiles_visited"] = round(float((bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
                                                       / bm.kv_indices[0, 0].numel()), 4)
                    fmod = score_mod.fn if score_mod is not None else None
                    course = CoursePath(q, k, v, route, bm, mod, spec)
                    o, lse = course.forward()
                    o, lse = course.dense(o), course.dense_lse(lse)
                    o_flex = flex(q, k, v, score_mod=fmod, block_mask=fbm)
                    row.update(check(q, k, v, mask_mod, score_mod, o, lse, o_flex))
                    if row["pass"]:
                        row["course_ms"] = bench_ms(course.forward)
                        row["flex_ms"] = bench_ms(lambda: flex(q, k, v, score_mod=fmod, block_mask=fbm))
                        if route is not None and mod is None:  # the same mask through the block-sparse kernel
                            row["block_sparse_ms"] = bench_ms(lambda: bs.flash_attn_block_sparse_triton(q, k, v, bm))
                        row["sdpa_dense_ms"] = None
                        if score_mod is None and (N <= 16384 or name == "window (1024, 0)"):
                            dm = dense_mask(mask_mod, N, q.device)
                            row["sdpa_dense_ms"] = sdpa_ms("efficient", lambda: F.scaled_dot_product_attention(
                                q, k, v, attn_mask=dm))
                            del dm
                        if args.bwd:
                            row.update(backward(q, k, v, course, fbm, fmod, flex))
                            if route == "varlen":  # the documents' backward through the block index, beside
                                bsb = backward(q, k, v, CoursePath(q, k, v, None, bm, mod, spec), fbm, fmod, flex)
                                row["block_sparse_bwd_ms"] = bsb.get("course_bwd_ms")
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    row["error"] = why(e, 300)
                    log(f"    {row['error']}")
                result["rows"].append(row)
                write_json(path, result)
            q = k = v = None  # free them before the next N
        if args.scaling:
            try:
                result["rows"] += scaling_rows(d, args.bwd)
            except Exception as e:  # noqa: BLE001
                result["rows"].append({"mask": "window (1024, 0) scaling", "d": d, "error": why(e, 300)})
            write_json(path, result)
    result["summary"] = summary(result["rows"])
    write_json(path, result)
    log(f"\n{gpu}, bf16, H={H}; ms (do_bench median); x = the other's time / the course's\n")
    log(f"{'mask':>24} {'d':>4} {'N':>6} {'route':>6} {'course':>8} {'flex':>8} {'x flex':>7} {'sdpa':>8} "
        f"{'x sdpa':>7} {'bwd':>8} {'flex bwd':>8} {'x flex':>7}")
    fmt = lambda x: f"{x:8.3f}" if x else f"{'-':>8}"  # noqa: E731
    ratio = lambda a, b: f"{a / b:7.2f}" if a and b else f"{'-':>7}"  # noqa: E731
    for r in result["rows"]:
        c, f, s = r.get("course_ms"), r.get("flex_ms"), r.get("sdpa_dense_ms")
        cb, fb = r.get("course_bwd_ms"), r.get("flex_bwd_ms")
        log(f"{r['mask']:>24} {r.get('d', '-'):>4} {r.get('N', '-'):>6} {r.get('route', '-')[:6]:>6} {fmt(c)} "
            f"{fmt(f)} {ratio(f, c)} {fmt(s)} {ratio(s, c)} {fmt(cb)} {fmt(fb)} {ratio(fb, cb)}"
            + ("" if r.get("pass", True) and "error" not in r else f"  FAILED {r.get('error', r.get('err'))}"))
    log(f"\nsummary: {json.dumps(result['summary'])}")
    log(f"wrote {path}")
    return result["rows"]


if __name__ == "__main__":
    main()
