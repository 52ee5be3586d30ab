"""Lesson 12's masks and score modifications on one GPU: the course's block-sparse forward against FlexAttention
and against SDPA with a dense boolean mask.

    python3 bench/bench_masks.py [--N 4096 16384] [--d 128] [--bwd]

Per mask and score_mod (causal; sliding windows (1024, 0) and (4096, 0), causal; 8 and 64 packed documents,
causal; prefix-LM with a quarter of the sequence as prefix; softcap 50 and ALiBi on the causal mask), bf16,
d = 128, H = 16, B * N = 16384 tokens: the course's ``flash_attn_block_sparse_triton`` (its block index built on
the device beforehand, not timed), ``flex_attention`` compiled with ``torch.compile`` (its block mask from
``create_block_mask``, 128 x 128, not timed) and SDPA with the dense ``[N, N]`` boolean mask (no score mod: it
has none; rows with one get no SDPA figure). With ``--bwd`` also the backward (dO given, dQ, dK, dV) of the course
(``flash_attn_block_sparse``) and of FlexAttention; SDPA's is left out.

Correctness first, every row: O of the first and last head against float64 (the mask and score_mod applied
densely, lesson 12's ``attention_mods_ref`` chunked on the GPU), within twice FlexAttention's own error in bf16
(FlashAttention's 2x rule, FlexAttention as the baseline that runs every row), lse within 5e-3; a row that fails
is recorded and not timed. The backward's gradients are compared with FlexAttention's (largest difference over the
largest gradient, ``bwd_rel_diff``, timed when below 5e-2): no float64 backward at these sizes. Timing: bench/common.py's do_bench median, L2 flushed. Writes
bench/results/masks_<gpu>.json after every row (keeping the rows of other N from an earlier run: one call per N
fits a ten-minute limit) and prints a short table last.
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
    """[(name, the course's MaskSpec, its score_mod, lesson 12's mask_mod, lesson 12's score_mod or None)]: one
    mask written twice, for the course's kernel (a constexpr variant) and for FlexAttention and the reference
    (lesson 12's predicates, which run under vmap and torch.compile)."""
    from helpers import lesson12 as L
    from helpers.kernels import block_sparse as bs
    g = torch.Generator().manual_seed(0)

    def docs(n_docs):  # random lengths, at least 1 each, summing to N
        cuts = torch.sort(torch.randperm(N - 1, generator=g)[:n_docs - 1] + 1).values
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([N])]))
        return torch.repeat_interleave(torch.arange(n_docs), lengths).to(device)

    H = 16
    slopes = L.alibi_slopes(H).to(device)
    out = [("causal", bs.causal_mask(), None, L.causal(N, N), None)]
    for w in (1024, 4096):
        if w < N:
            out.append((f"window ({w}, 0)", bs.sliding_window_mask((w, 0), causal=True), None,
                        L.sliding_window(N, N, (w, 0), is_causal=True), None))
    for n in (8, 64):
        ids = docs(n)
        out.append((f"{n} documents", bs.document_mask(ids, causal=True), None, L.document(ids, is_causal=True), None))
    out.append((f"prefix-LM {N // 4}", bs.prefix_lm_mask(N // 4), None, L.prefix_lm(N // 4), None))
    out.append(("softcap 50, causal", bs.causal_mask(), bs.SoftCap(50.0), L.causal(N, N), L.softcap(50.0)))
    out.append(("ALiBi, causal", bs.causal_mask(), bs.ALiBi(slopes.float()), L.causal(N, N), L.alibi(slopes, N, N)))
    return out


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


def backward(q, k, v, bm, mod, fbm, fmod, flex):
    """The course's and FlexAttention's backward on one dO: their gradients' largest difference relative to the
    largest gradient, and (when below 5e-2) the ms of each backward alone (the forward's graph kept)."""
    from helpers.kernels import block_sparse as bs
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = bs.flash_attn_block_sparse(qg, kg, vg, bm, mod)
    o_f = flex(qg, kg, vg, score_mod=fmod, block_mask=fbm)
    do = torch.randn_like(o)
    mine = torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    theirs = torch.autograd.grad(o_f, (qg, kg, vg), do, retain_graph=True)
    rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
              for a, b in zip(mine, theirs))
    row = {"bwd_rel_diff": round(rel, 5)}
    if rel < 5e-2:
        row["course_bwd_ms"] = bench_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
        row["flex_bwd_ms"] = bench_ms(lambda: o_f.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--bwd", action="store_true", help="also time the backward")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(NEEDS_CUDA)
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from helpers.kernels import block_sparse as bs
    flex = torch.compile(flex_attention, dynamic=False)
    gpu = torch.cuda.get_device_name()
    path = results_path(gpu, prefix="masks_")
    dtype, d, H = torch.bfloat16, args.d, 16
    result = {"meta": run_meta(gpu, timing=TIMING, dtype="bfloat16", d=d, H=H,
                               direction="forward and backward" if args.bwd else "forward",
                               flex_block=128), "rows": []}
    if os.path.exists(path):  # a run for some N keeps the rows of the others (one call per N fits a time limit)
        with open(path, encoding="utf-8") as f:
            result["rows"] = [r for r in json.load(f).get("rows", []) if r.get("N") not in args.N]
    for N in args.N:
        B = max(1, 16384 // N)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        tiles = bs.block_sparse_tiles(d, dtype, q.device, backward=args.bwd)
        for name, spec, mod, mask_mod, score_mod in cases(N, q.device):
            row = {"mask": name, "N": N, "B": B, "tiles": list(tiles)}
            log(f"N={N} {name}")
            try:
                bm = bs.build_block_mask_triton(spec, N, N, *tiles, device=q.device)
                fbm = create_block_mask(mask_mod.fn, None, None, N, N, device="cuda", BLOCK_SIZE=128)
                row["visible"] = round(float(dense_mask(mask_mod, N, q.device).float().mean()), 4)
                row["tiles_visited"] = round(float((bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
                                                   / bm.kv_indices[0, 0].numel()), 4)
                fmod = score_mod.fn if score_mod is not None else None
                o, lse = bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=mod)
                o_flex = flex(q, k, v, score_mod=fmod, block_mask=fbm)
                row.update(check(q, k, v, mask_mod, score_mod, o, lse, o_flex))
                if row["pass"]:
                    row["course_ms"] = bench_ms(lambda: bs.flash_attn_block_sparse_triton(q, k, v, bm, score_mod=mod))
                    row["flex_ms"] = bench_ms(lambda: flex(q, k, v, score_mod=fmod, block_mask=fbm))
                    row["sdpa_dense_ms"] = None
                    if score_mod is None:
                        dm = dense_mask(mask_mod, N, q.device)
                        row["sdpa_dense_ms"] = sdpa_ms("efficient", lambda: F.scaled_dot_product_attention(
                            q, k, v, attn_mask=dm))
                        del dm
                    if args.bwd:
                        row.update(backward(q, k, v, bm, mod, fbm, fmod, flex))
            except Exception as e:  # noqa: BLE001 - recorded in the row
                row["error"] = why(e, 300)
                log(f"    {row['error']}")
            result["rows"].append(row)
            write_json(path, result)
    log(f"\n{gpu}, bf16, d={d}, H={H}, forward; ms (do_bench median); x = the other's time / the course's\n")
    log(f"{'mask':>22} {'N':>6} {'visible':>8} {'course':>8} {'flex':>8} {'x flex':>7} {'sdpa':>8} {'x sdpa':>7}")
    for r in result["rows"]:
        c, f, s = r.get("course_ms"), r.get("flex_ms"), r.get("sdpa_dense_ms")
        fmt = lambda x: f"{x:8.3f}" if x else f"{'-':>8}"  # noqa: E731
        log(f"{r['mask']:>22} {r['N']:>6} {r.get('visible', 0):8.3f} {fmt(c)} {fmt(f)} "
            f"{(f / c if c and f else 0):7.2f} {fmt(s)} {(s / c if c and s else 0):7.2f}"
            + (f"   bwd: course {fmt(r.get('course_bwd_ms'))}, flex {fmt(r.get('flex_bwd_ms'))}"
               if "bwd_rel_diff" in r else "")
            + ("" if r.get("pass") else f"  FAILED {r.get('error', r.get('err'))}"))
    log(f"\nwrote {path}")
    return result["rows"]


if __name__ == "__main__":
    main()
