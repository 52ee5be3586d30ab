"""The forward's two load paths on one GPU: TMA descriptors (Hopper and newer) against plain pointer loads.

    python3 bench/bench_paths.py [--N 8192]

`flash_attn_triton` loads K and V through TMA descriptors on sm_90 and with pointer arithmetic on every other
GPU (and under the interpreter). The H200 runs the TMA path by default, so this script is how the pointer path,
the one an A100, RTX 30/40 or T4 runs, is checked and timed natively: each row is checked first against
float64 (FlashAttention's rule, as in bench.py: error at most twice SDPA's own in the same dtype), then both
paths are timed (each autotuned for itself; bench/common.py's do_bench median, L2 flushed). Writes
bench/results/paths_<gpu>.json after every row and prints a short table last.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import TIMING, bench_ms, check_prefill, log, results_path, run_meta, write_json  # noqa: E402

import torch  # noqa: E402

from helpers.kernels.forward import flash_attn_triton  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, default=8192)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_paths.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    path = results_path(gpu, prefix="paths_")
    result = {"meta": run_meta(gpu, timing=f"{TIMING}; each path autotuned for itself"), "rows": []}
    N = args.N
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for causal in (False, True):
                B, H = max(1, 32768 // N), (32 if d == 64 else 16)
                q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
                flops = 4 * B * H * N * N * d / (2 if causal else 1)
                row = {"dtype": str(dtype).replace("torch.", ""), "d": d, "causal": causal, "N": N}
                for name, tma in (("ptr", False), ("tma", True)):
                    o, lse = flash_attn_triton(q, k, v, causal=causal, use_tma=tma)
                    chk = check_prefill(q, k, v, causal, o, lse)
                    row[f"{name}_pass"] = chk["pass"]
                    row[f"{name}_err_ratio"] = round(chk["err"] / max(chk["sdpa_err"], 1e-12), 2)
                    ms = bench_ms(lambda: flash_attn_triton(q, k, v, causal=causal, use_tma=tma))
                    row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
                row["ptr_over_tma"] = round(row["ptr_tflops"] / row["tma_tflops"], 3)
                result["rows"].append(row)
                log(row)
                write_json(path, result)
                del q, k, v
    rows = result["rows"]
    ratios = [r["ptr_over_tma"] for r in rows]
    result["meta"]["ptr_over_tma_range"] = [min(ratios), max(ratios)]
    result["meta"]["ptr_over_tma_geomean"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
    write_json(path, result)
    log(f"\n{gpu}, torch {torch.__version__}, triton {result['meta']['triton']}, N = {N}, TFLOP/s (median)")
    log(f"{'dtype':9s} {'d':>4s} {'causal':>6s} {'ptr':>7s} {'tma':>7s} {'ptr/tma':>8s}  correct (ptr, tma)")
    for r in rows:
        log(f"{r['dtype']:9s} {r['d']:4d} {str(r['causal']):>6s} {r['ptr_tflops']:7.1f} {r['tma_tflops']:7.1f} "
            f"{r['ptr_over_tma']:8.3f}  {r['ptr_pass']}, {r['tma_pass']}")
    log(f"pointer path / TMA path: {min(ratios):.2f}-{max(ratios):.2f}x, geomean {result['meta']['ptr_over_tma_geomean']:.3f}")
    return 0 if all(r["ptr_pass"] and r["tma_pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
