"""Lesson 11's Gluon forward (or, with ``--bwd``, backward) on one Hopper GPU against the course's Triton kernels
and SDPA's backends.

    python3 bench/bench_gluon.py [--variant one ws overlap pp] [--N 4096 16384] [--causal] [--group 1 4]
                                 [--dtype bfloat16 float16] [--d 64 128] [--out PATH]
    python3 bench/bench_gluon.py --bwd [--bwd-dq-mode separate atomic] [--bwd-config JSON] [the same row options]

bf16 and fp16, d = 64 and 128, B * N = 32768 tokens (H = 32 for d = 64, 16 for d = 128). Non-causal rows; with
``--causal`` each is followed by its causal twin (top-left, N = Nk: both alignments agree), against the Triton
forward's and SDPA's causal paths. ``--group G`` adds GQA rows, Hkv = H // G KV heads (SDPA with ``enable_gqa``; the
check compares against float64 on K, V repeated to H heads). Each Gluon row is checked first against float64
(FlashAttention's rule, as in bench.py: error at most twice SDPA's own in the same dtype) and timed only when
correct. ``--variant`` picks the Gluon variants (``gluon_forward.VARIANTS``; default ``one``; ``--ws`` adds ``ws``):
run a new one after ``python -m helpers.kernels.gluon_forward --variant X`` passed, since a barrier mistake hangs
rather than fails. Rows are keyed ``gluon`` (one), ``gluon_<variant>``. TFLOP/s count 4 B H N Nk d for a dense row
and half that for a causal one (the convention of FlashAttention's benchmarks).
Timing: bench/common.py's do_bench median, L2 flushed. Writes bench/results/gluon_<gpu>.json (or ``--out``) after
every row and prints a short table last.

``--bwd``: the same rows for the backward instead. O and lse come from the course's Triton forward
(``flash_attn_triton``); then, per row, ``gluon_backward`` (helpers/kernels/gluon_backward.py: preprocess, dK/dV, dQ;
``--bwd-config`` passes its tile overrides, a JSON dict, for a sweep; ``--bwd-dq-mode``: its dq modes, by default
both, rows keyed ``gluon`` (separate) and ``gluon_atomic``) is checked first: dq of every query head of
two KV groups (batch 0's first, the last batch's last) and their dk, dv against float64 (computed exactly, in row
chunks), each within twice the error of SDPA's own backward in the same dtype (k, v repeated in the graph so that
their gradients sum over the group), and everything finite; it is timed only when correct. Timed against the
course's Triton backward (``flash_attn_bwd_triton``, autotuned, on the same O and lse) and SDPA's flash and cuDNN
backward (``sdpa_kernel`` forces the backend for the forward, whose saved state fixes the backward; the time is
``o.backward(do)`` alone). TFLOP/s count 2.5 x the forward's FLOPs (two GEMMs forward, five backward, the
convention of FlashAttention's benchmarks), halved when causal. Rows are keyed ``gluon``, ``gluon_atomic``,
``triton``, ``sdpa_flash``, ``sdpa_cudnn``; the results go to bench/results/gluon_bwd_<gpu>.json (or ``--out``). The
run ``--bwd --N 16384 --dtype bfloat16 --causal --group 1 4`` has the causal forward run's eight rows.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (ERR_FLOOR, TIMING, bench_ms, check_prefill, log, results_path, run_meta, sdpa_ms,  # noqa: E402
                    why, within_sdpa_error, write_json)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helpers.kernels.forward import flash_attn_triton  # noqa: E402

BWD_FLOPS = 2.5     # a backward's FLOPs over its forward's: 5 GEMMs (S, dP, dV, dK, dQ) against 2 (S, PV)


def parse_variant(spec):
    """``one`` or ``pp@64x128x2``: (row key, variant, blocks or None); blocks = (BLOCK_M, BLOCK_N, NUM_STAGES), a
    tuning sweep's replacement of the variant's table entry (``gluon_forward(..., blocks=...)``)."""
    name, _, tiles = spec.partition("@")
    blocks = tuple(int(x) for x in tiles.split("x")) if tiles else None
    if blocks is not None and len(blocks) != 3:
        raise ValueError(f"--variant {spec}: the tiles are BLOCK_MxBLOCK_NxNUM_STAGES, e.g. pp@64x128x2")
    key = ("gluon" if name == "one" else f"gluon_{name}") + ("_" + tiles if tiles else "")
    return key, name, blocks


def bench_row(q, k, v, causal, variants, gluon_forward, triton=True):
    """One row: each Gluon variant checked, then timed; the Triton forward (unless ``triton`` is False) and SDPA
    flash / cuDNN timed. variants: (row key, variant, blocks) triples."""
    B, H, N, d = q.shape
    Hkv = k.shape[1]
    flops = 4 * B * H * N * k.shape[2] * d // (2 if causal else 1)
    row = {"dtype": str(q.dtype).replace("torch.", ""), "d": d, "N": N, "B": B, "H": H, "Hkv": Hkv, "causal": causal}
    kr, vr = (x.repeat_interleave(H // Hkv, 1) for x in (k, v))     # [B, H, Nk, d]: the reference's K, V
    for name, var, blocks in variants:
        try:
            o, lse = gluon_forward(q, k, v, variant=var, causal=causal, blocks=blocks)
            chk = check_prefill(q, kr, vr, causal, o, lse)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            row[f"{name}_error"] = why(e, 200)
            continue
        row[f"{name}_pass"] = chk["pass"]
        row[f"{name}_err_ratio"] = round(chk["err"] / max(chk["sdpa_err"], 1e-12), 2)
        if chk["pass"]:
            ms = bench_ms(lambda: gluon_forward(q, k, v, variant=var, causal=causal, blocks=blocks))
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
    if triton:
        ms = bench_ms(lambda: flash_attn_triton(q, k, v, causal=causal, backend="triton"))   # the tl kernel, not routed
        row["triton_tflops"] = round(flops / ms / 1e9, 1)
    gqa = {"enable_gqa": True} if Hkv != H else {}
    for backend in ("flash", "cudnn"):
        ms = sdpa_ms(backend, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa))
        row[f"sdpa_{backend}_tflops"] = None if ms is None else round(flops / ms / 1e9, 1)
    return row


def ref_group_grads(q, k, v, do, causal, b, kh, chunk=2048):
    """float64 (dq [group, N, d], dk [Nk, d], dv [Nk, d]) of KV head kh of batch b and the query heads that read it
    (top-left causal), from the formulas (P = softmax(S), D = rowsum(dO * O), dS = P (dP - D)), chunk query rows at
    a time: exact, and no N x N matrix kept."""
    import math
    B, H, N, d = q.shape
    group = H // k.shape[1]
    K, V = k[b, kh].double(), v[b, kh].double()                  # [Nk, d]
    scale = 1 / math.sqrt(d)
    dk, dv, dqs = torch.zeros_like(K), torch.zeros_like(V), []
    for h in range(kh * group, (kh + 1) * group):
        Q, dO = q[b, h].double(), do[b, h].double()              # [N, d]
        dq = torch.empty_like(Q)
        for i0 in range(0, N, chunk):
            qc, doc = Q[i0:i0 + chunk], dO[i0:i0 + chunk]        # [c, d]
            s = qc @ K.T * scale                                 # [c, Nk]
            if causal:
                rows = torch.arange(i0, i0 + qc.shape[0], device=q.device)[:, None]
                s = s.masked_fill(torch.arange(K.shape[0], device=q.device)[None, :] > rows, float("-inf"))
            p = torch.softmax(s, -1)                             # [c, Nk]
            dp = doc @ V.T                                       # [c, Nk]
            ds = p * (dp - (doc * (p @ V)).sum(-1, keepdim=True))
            dq[i0:i0 + chunk] = ds @ K * scale
            dk += ds.T @ qc * scale
            dv += p.T @ doc
        dqs.append(dq)
    return torch.stack(dqs), dk, dv


def check_backward(q, k, v, do, causal, grads):
    """grads = (dq, dk, dv) of a backward on q [B, H, N, d], k, v [B, Hkv, N, d]: each within twice SDPA's own
    backward error (same dtype) of float64 on two KV groups, and finite. Returns {"pass", "err_ratio", "grad_err"}."""
    B, H, N, d = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(a[0], a[1].repeat_interleave(group, 1), a[2].repeat_interleave(group, 1),
                                       is_causal=causal)          # default dispatch; dk, dv sum over the group
    o.backward(do)
    theirs = [t.grad for t in a]
    errs = {}
    for b, kh in {(0, 0), (B - 1, Hkv - 1)}:
        refs = ref_group_grads(q, k, v, do, causal, b, kh)
        hs = slice(kh * group, (kh + 1) * group)
        for name, m, t, r in zip(("dq", "dk", "dv"), grads, theirs, refs):
            sl = (b, hs) if name == "dq" else (b, kh)
            e_m, e_t = ((x[sl].double() - r).abs().max().item() for x in (m, t))
            old = errs.get(name, (0.0, 0.0))
            errs[name] = (max(old[0], e_m), max(old[1], e_t))
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    ok = finite and all(within_sdpa_error(e, s) for e, s in errs.values())
    return {"pass": ok, "err_ratio": round(max(e / max(s, ERR_FLOOR) for e, s in errs.values()), 2),
            "grad_err": {n: [float(f"{e:.3g}"), float(f"{s:.3g}")] for n, (e, s) in errs.items()}}


def sdpa_bwd_ms(backend, q, k, v, do, causal):
    """ms of o.backward(do) alone for SDPA forced onto backend (its forward under ``sdpa_kernel``, done once and kept);
    None when the backend refuses the case."""
    H, Hkv = q.shape[1], k.shape[1]
    gqa = {"enable_gqa": True} if Hkv != H else {}
    a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    state = {}

    def forward():
        state["o"] = F.scaled_dot_product_attention(*a, is_causal=causal, **gqa)
        state["o"].backward(do, retain_graph=True)               # refused backends raise here, in sdpa_ms's guard

    return sdpa_ms(backend, forward,
                   timer=lambda _: bench_ms(lambda: state["o"].backward(do, retain_graph=True), grad_to_none=a))


def bench_bwd_row(q, k, v, do, causal, gluon_backward, config=None, dq_modes=("separate", "atomic")):
    """One backward row: gluon_backward in each dq mode checked, then timed (keys ``gluon``, ``gluon_atomic``); the
    Triton backward and SDPA flash / cuDNN timed."""
    from helpers.kernels.backward import flash_attn_bwd_triton
    B, H, N, d = q.shape
    Hkv = k.shape[1]
    flops = BWD_FLOPS * 4 * B * H * N * k.shape[2] * d // (2 if causal else 1)
    row = {"dtype": str(q.dtype).replace("torch.", ""), "d": d, "N": N, "B": B, "H": H, "Hkv": Hkv, "causal": causal}
    o, lse = flash_attn_triton(q, k, v, causal=causal)          # the saved state both course backwards take
    for mode in dq_modes:
        name = "gluon" if mode == "separate" else f"gluon_{mode}"

        def run(mode=mode):
            return gluon_backward(do, q, k, v, o, lse, causal=causal, dq_mode=mode, config=config)
        try:
            chk = check_backward(q, k, v, do, causal, run())
            row.update({f"{name}_pass": chk["pass"], f"{name}_err_ratio": chk["err_ratio"],
                        f"{name}_grad_err": chk["grad_err"]})
            if chk["pass"]:
                row[f"{name}_tflops"] = round(flops / bench_ms(run) / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            row[f"{name}_error"] = why(e, 200)
            torch.cuda.synchronize()
    try:
        flash_attn_bwd_triton(do, q, k, v, o, lse, causal=causal)   # the autotuner's first call, untimed
        ms = bench_ms(lambda: flash_attn_bwd_triton(do, q, k, v, o, lse, causal=causal))
        row["triton_tflops"] = round(flops / ms / 1e9, 1)
    except Exception as e:  # noqa: BLE001 - recorded in the row
        row["triton_error"] = why(e, 200)
    for backend in ("flash", "cudnn"):
        ms = sdpa_bwd_ms(backend, q, k, v, do, causal)
        row[f"sdpa_{backend}_tflops"] = None if ms is None else round(flops / ms / 1e9, 1)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--variant", nargs="+", default=["one"],
                    help="Gluon variants: one, ws, overlap, pp, pp128, ppp, auto; VARIANT@BMxBNxSTAGES fixes the tiles (a sweep)")
    ap.add_argument("--ws", action="store_true", help="also the warp-specialised Gluon kernel (--variant ... ws)")
    ap.add_argument("--causal", action="store_true", help="each row's causal twin too (top-left, N = Nk)")
    ap.add_argument("--group", type=int, nargs="+", default=[1], help="query heads per KV head (GQA rows: G > 1)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--out", default=None, help="the JSON to write (default bench/results/gluon_<gpu>.json; "
                                                "with --bwd gluon_bwd_<gpu>.json)")
    ap.add_argument("--no-triton", action="store_true", help="the forward without the Triton kernel's column (a "
                                                             "sweep of Gluon variants against SDPA alone)")
    ap.add_argument("--bwd", action="store_true", help="the backward (gluon_backward) instead of the forward")
    ap.add_argument("--bwd-config", type=json.loads, default=None,
                    help='gluon_backward\'s tile overrides, e.g. \'{"dkdv": {"BLOCK_M": 64, "NUM_STAGES": 3}}\'')
    ap.add_argument("--bwd-dq-mode", nargs="+", default=["separate", "atomic"], choices=["separate", "atomic"],
                    help="gluon_backward's dq modes to check and time (rows keyed gluon, gluon_atomic)")
    args = ap.parse_args(argv)
    if args.bwd_config is not None and not args.bwd:
        sys.exit("--bwd-config needs --bwd")
    names = list(dict.fromkeys(args.variant + (["ws"] if args.ws else [])))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench_gluon.py needs an sm_90 GPU (H100, H200)")
    if args.bwd:
        return main_bwd(args)
    from helpers.kernels.gluon_forward import VARIANTS, gluon_forward
    try:
        variants = [parse_variant(n) for n in names]             # (row key, variant, blocks)
    except ValueError as e:
        sys.exit(str(e))
    bad = [n for _, n, _ in variants if n not in VARIANTS]
    if bad:
        sys.exit(f"unknown --variant {bad}: choose from {list(VARIANTS)}")
    gpu = torch.cuda.get_device_name()
    path = args.out or results_path(gpu, prefix="gluon_")
    result = {"meta": run_meta(gpu, timing=TIMING, causal="per row" if args.causal else False), "rows": []}
    for dtype in (getattr(torch, name) for name in args.dtype):
        for d in args.d:
            for N in args.N:
                for group in args.group:
                    q, k, v = row_inputs(dtype, d, N, group)
                    for causal in ((False, True) if args.causal else (False,)):
                        row = bench_row(q, k, v, causal, variants, gluon_forward, triton=not args.no_triton)
                        result["rows"].append(row)
                        log(row)
                        write_json(path, result)
                    del q, k, v
    cols = [n for n, _, _ in variants] + ([] if args.no_triton else ["triton"]) + ["sdpa_flash", "sdpa_cudnn"]
    log(f"\n{gpu}, torch {torch.__version__}, triton {result['meta']['triton']}, TFLOP/s (median; causal counts half "
        "the FLOPs)")
    log(f"{'dtype':9s} {'d':>4s} {'N':>6s} {'H:Hkv':>6s} {'causal':>6s} " + " ".join(f"{c:>10s}" for c in cols) +
        "  correct")
    for r in result["rows"]:
        vals = " ".join(f"{r.get(c + '_tflops') or 0:10.1f}" for c in cols)
        log(f"{r['dtype']:9s} {r['d']:4d} {r['N']:6d} {r['H'] // r['Hkv']:>4d}:1 {str(r['causal']):>6s} {vals}  " +
            ", ".join(f"{n}={r.get(n + '_pass', r.get(n + '_error'))}" for n, _, _ in variants))
    return 0 if all(r.get(f"{n}_pass") for r in result["rows"] for n, _, _ in variants) else 1


def row_inputs(dtype, d, N, group, make_do=False):
    """A row's tensors, as the forward's rows build them: B * N = 32768 tokens, H = 32 (d = 64) or 16 (d = 128),
    Hkv = H // group KV heads; q, k, v (and dO) standard normal."""
    B, H = max(1, 32768 // N), (32 if d == 64 else 16)
    if H % group:
        sys.exit(f"--group {group} does not divide H = {H}")
    q = torch.randn(B, H, N, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H // group, N, d, device="cuda", dtype=dtype) for _ in range(2))
    return (q, k, v, torch.randn_like(q)) if make_do else (q, k, v)


def main_bwd(args):
    """--bwd: the backward's rows (bench_bwd_row), the JSON after each, the table last; 0 when every row passed."""
    from helpers.kernels import gluon_backward as gb
    gpu = torch.cuda.get_device_name()
    path = args.out or results_path(gpu, prefix="gluon_bwd_")
    meta = run_meta(gpu, timing=TIMING, causal="per row" if args.causal else False, direction="backward",
                    flops=f"{BWD_FLOPS} x the forward's 4 B H N Nk d, halved when causal",
                    inputs="O, lse from flash_attn_triton; dO standard normal",
                    gluon_tiles={m: {d: gb._tiles(d, args.bwd_config, m) for d in args.d} for m in args.bwd_dq_mode},
                    bwd_config=args.bwd_config, dq_modes={m: gb.DQ_MODES[m] for m in args.bwd_dq_mode})
    result = {"meta": meta, "rows": []}
    for dtype in (getattr(torch, name) for name in args.dtype):
        for d in args.d:
            for N in args.N:
                for group in args.group:
                    torch.manual_seed(N + d + group)
                    q, k, v, do = row_inputs(dtype, d, N, group, make_do=True)
                    for causal in ((False, True) if args.causal else (False,)):
                        row = bench_bwd_row(q, k, v, do, causal, gb.gluon_backward, args.bwd_config,
                                            args.bwd_dq_mode)
                        result["rows"].append(row)
                        log(row)
                        write_json(path, result)
                    del q, k, v, do
    names = ["gluon" if m == "separate" else f"gluon_{m}" for m in args.bwd_dq_mode]
    cols = names + ["triton", "sdpa_flash", "sdpa_cudnn"]
    log(f"\n{gpu}, torch {torch.__version__}, triton {meta['triton']}, backward TFLOP/s (median; {BWD_FLOPS} x the "
        "forward's FLOPs, causal counts half)")
    log(f"{'dtype':9s} {'d':>4s} {'N':>6s} {'H:Hkv':>6s} {'causal':>6s} " + " ".join(f"{c:>12s}" for c in cols) +
        f" {'best/cudnn':>10s}  correct (err / SDPA's)")
    for r in result["rows"]:
        vals = " ".join(f"{r.get(c + '_tflops') or 0:12.1f}" for c in cols)
        g, c = max((r.get(n + "_tflops") or 0 for n in names), default=0), r.get("sdpa_cudnn_tflops")
        ratio = f"{g / c:9.2f}x" if g and c else f"{'-':>10s}"
        log(f"{r['dtype']:9s} {r['d']:4d} {r['N']:6d} {r['H'] // r['Hkv']:>4d}:1 {str(r['causal']):>6s} {vals} "
            f"{ratio}  " + ", ".join(f"{n}={r.get(n + '_pass', r.get(n + '_error'))} ({r.get(n + '_err_ratio')})"
                                     for n in names))
    return 0 if all(r.get(f"{n}_pass") for r in result["rows"] for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
