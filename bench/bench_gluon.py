"""Lesson 11's Gluon forward on one Hopper GPU against the course's Triton forward and SDPA's backends.

    python3 bench/bench_gluon.py [--variant one ws overlap pp] [--N 4096 16384] [--causal] [--group 1 4]
                                 [--dtype bfloat16 float16] [--d 64 128] [--out PATH]

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
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import TIMING, bench_ms, check_prefill, log, results_path, run_meta, sdpa_ms, why, write_json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helpers.kernels.forward import flash_attn_triton  # noqa: E402


def parse_variant(spec):
    """``one`` or ``pp@64x128x2``: (row key, variant, blocks or None); blocks = (BLOCK_M, BLOCK_N, NUM_STAGES), a
    tuning sweep's replacement of the variant's table entry (``gluon_forward(..., blocks=...)``)."""
    name, _, tiles = spec.partition("@")
    blocks = tuple(int(x) for x in tiles.split("x")) if tiles else None
    if blocks is not None and len(blocks) != 3:
        raise ValueError(f"--variant {spec}: the tiles are BLOCK_MxBLOCK_NxNUM_STAGES, e.g. pp@64x128x2")
    key = ("gluon" if name == "one" else f"gluon_{name}") + ("_" + tiles if tiles else "")
    return key, name, blocks


def bench_row(q, k, v, causal, variants, gluon_forward):
    """One row: each Gluon variant checked, then timed; the Triton forward and SDPA flash / cuDNN timed. variants:
    (row key, variant, blocks) triples."""
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
    ms = bench_ms(lambda: flash_attn_triton(q, k, v, causal=causal))
    row["triton_tflops"] = round(flops / ms / 1e9, 1)
    gqa = {"enable_gqa": True} if Hkv != H else {}
    for backend in ("flash", "cudnn"):
        ms = sdpa_ms(backend, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa))
        row[f"sdpa_{backend}_tflops"] = None if ms is None else round(flops / ms / 1e9, 1)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--variant", nargs="+", default=["one"],
                    help="Gluon variants: one, ws, overlap, pp, pp128; VARIANT@BMxBNxSTAGES fixes the tiles (a sweep)")
    ap.add_argument("--ws", action="store_true", help="also the warp-specialised Gluon kernel (--variant ... ws)")
    ap.add_argument("--causal", action="store_true", help="each row's causal twin too (top-left, N = Nk)")
    ap.add_argument("--group", type=int, nargs="+", default=[1], help="query heads per KV head (GQA rows: G > 1)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--out", default=None, help="the JSON to write (default bench/results/gluon_<gpu>.json)")
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.variant + (["ws"] if args.ws else [])))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench_gluon.py needs an sm_90 GPU (H100, H200)")
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
                    B, H = max(1, 32768 // N), (32 if d == 64 else 16)
                    if H % group:
                        sys.exit(f"--group {group} does not divide H = {H}")
                    q = torch.randn(B, H, N, d, device="cuda", dtype=dtype)
                    k, v = (torch.randn(B, H // group, N, d, device="cuda", dtype=dtype) for _ in range(2))
                    for causal in ((False, True) if args.causal else (False,)):
                        row = bench_row(q, k, v, causal, variants, gluon_forward)
                        result["rows"].append(row)
                        log(row)
                        write_json(path, result)
                    del q, k, v
    cols = [n for n, _, _ in variants] + ["triton", "sdpa_flash", "sdpa_cudnn"]
    log(f"\n{gpu}, torch {torch.__version__}, triton {result['meta']['triton']}, TFLOP/s (median; causal counts half "
        "the FLOPs)")
    log(f"{'dtype':9s} {'d':>4s} {'N':>6s} {'H:Hkv':>6s} {'causal':>6s} " + " ".join(f"{c:>10s}" for c in cols) +
        "  correct")
    for r in result["rows"]:
        vals = " ".join(f"{r.get(c + '_tflops') or 0:10.1f}" for c in cols)
        log(f"{r['dtype']:9s} {r['d']:4d} {r['N']:6d} {r['H'] // r['Hkv']:>4d}:1 {str(r['causal']):>6s} {vals}  " +
            ", ".join(f"{n}={r.get(n + '_pass', r.get(n + '_error'))}" for n, _, _ in variants))
    return 0 if all(r.get(f"{n}_pass") for r in result["rows"] for n, _, _ in variants) else 1


if __name__ == "__main__":
    sys.exit(main())
