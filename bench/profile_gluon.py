"""Lesson 11's Gluon kernels and cuDNN's under Nsight Compute: where each stands on the tensor cores, the
exponential unit (XU) and the FMA pipe, kernel by kernel (an sm_90 GPU with ``ncu``).

    python3 bench/profile_gluon.py [--out bench/results/gluon_profile_h200.json] [--cases CASE ...]
    python3 bench/profile_gluon.py --one CASE        # the child ncu profiles (one call of one pass)

A CASE is ``{fwd,bwd}-{gluon,cudnn}-d{64,128}-N{4096,16384}[-causal]`` (B * N = 32768 tokens, H = 32 at d = 64 and
16 at d = 128, bf16, as bench_gluon.py's rows). For each, ``ncu --profile-from-start off --metrics METRICS --csv``
runs this file with ``--one CASE``: the call runs three times first (compiles, autotunes, warms up), then once
between cudaProfilerStart and cudaProfilerStop, so ncu sees that call's kernels only: the forward, or the backward
alone (the forward whose state it uses runs before the range). Gluon: ``gluon_forward(variant="auto")`` and
``gluon_backward`` (dq_mode "separate"); cuDNN: SDPA forced to its cuDNN backend. Durations are ncu's, under the
clocks ncu sets (its default locks them to base), so they are for comparing kernels within this record, not with
do_bench's timings. The record is written after every case; a short table is printed last.
"""
import argparse
import csv
import io
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import log, run_meta, write_json  # noqa: E402

CASES = ["fwd-gluon-d64-N4096-causal", "fwd-cudnn-d64-N4096-causal", "fwd-gluon-d128-N16384", "fwd-cudnn-d128-N16384",
         "bwd-gluon-d128-N16384", "bwd-cudnn-d128-N16384", "bwd-gluon-d64-N4096-causal", "bwd-cudnn-d64-N4096-causal"]
# metric -> the record's key. Hopper's wgmma counts in the hmma pipe's cycles (ncu --query-metrics --chip gh100 lists
# no gmma pipe of its own); the XU pipe runs MUFU (ex2) among others.
METRICS = {"gpu__time_duration.sum": "ns", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active":
           "tensor_pct", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu_pct",
           "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma_pct",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
           "sm__warps_active.avg.pct_of_peak_sustained_active": "warps_pct",
           "launch__registers_per_thread": "registers", "launch__grid_size": "grid"}


def one(case):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = re.fullmatch(r"(fwd|bwd)-(gluon|cudnn)-d(64|128)-N(\d+)(-causal)?", case)
    if not m:
        raise SystemExit(f"profile_gluon: CASE must be like fwd-gluon-d64-N4096-causal, got {case!r}")
    pass_, who, d, N, causal = m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), bool(m.group(5))
    B, H = 32768 // N, (32 if d == 64 else 16)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if who == "gluon":
        from helpers.kernels.gluon_backward import gluon_backward
        from helpers.kernels.gluon_forward import gluon_forward
        o, lse = gluon_forward(q, k, v, variant="auto", causal=causal)
        do = torch.randn_like(o)
        call = (lambda: gluon_forward(q, k, v, variant="auto", causal=causal)) if pass_ == "fwd" else \
            (lambda: gluon_backward(do, q, k, v, o, lse, causal=causal))
    else:
        qg, kg, vg = (x.clone().requires_grad_(pass_ == "bwd") for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        do = torch.randn_like(o)

        def call():
            if pass_ == "bwd":
                qg.grad = kg.grad = vg.grad = None               # no accumulation kernels in the range
                o.backward(do, retain_graph=True)
            else:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def parse(text):
    """ncu's --csv output -> [{"kernel", <METRICS' keys>}], one per kernel launch, in launch order."""
    rows = list(csv.DictReader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))))
    kernels = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], {"kernel": r["Kernel Name"].split("(")[0].replace("void ", "")[:60]})
        if r["Metric Name"] in METRICS:
            k[METRICS[r["Metric Name"]]] = float(r["Metric Value"].replace(",", ""))
    return [kernels[i] for i in sorted(kernels, key=int)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help="(the child) profile one CASE's call")
    ap.add_argument("--cases", nargs="*", default=CASES)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "gluon_profile_h200.json"))
    ap.add_argument("--ncu", default="ncu")
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one)
    ver = subprocess.run([args.ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    import torch
    meta = run_meta(torch.cuda.get_device_name(), tool=f"Nsight Compute ({ver[-1] if ver else 'ncu'}), --metrics, default clock control",
                    shapes="B * N = 32768, H = 32 (d = 64) or 16 (d = 128), bf16", metrics=METRICS,
                    statistic="one profiled call per case (ncu's gpu__time_duration; ncu replays it per metric group)")
    record = {"meta": meta, "rows": []}
    for case in args.cases:
        r = subprocess.run([args.ncu, "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv",
                            sys.executable, os.path.abspath(__file__), "--one", case],
                           capture_output=True, text=True, timeout=300)
        kernels = parse(r.stdout)
        if r.returncode or not kernels:
            log(f"{case}: ncu exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
            continue
        record["rows"].append({"case": case, "kernels": kernels, "ms": sum(k.get("ns", 0) for k in kernels) / 1e6})
        write_json(args.out, record)
        log(f"{case}: {len(kernels)} kernels, {record['rows'][-1]['ms']:.3f} ms")
    print(f"\n{meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · {meta['date']} · {meta['tool']}")
    for row in record["rows"]:
        for k in row["kernels"]:
            print(f"{row['case']:28s} {k['kernel'][:44]:44s} {k.get('ns', 0) / 1e3:9.1f} us  tensor "
                  f"{k.get('tensor_pct', 0):5.1f}%  xu {k.get('xu_pct', 0):5.1f}%  regs {k.get('registers', 0):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
