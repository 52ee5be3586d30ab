"""`make bench`, paged part: flash_attn_with_kvcache_triton on a paged cache against the same lengths in a
contiguous cache and against SDPA's cuDNN decode.

    python3 bench/bench_kvcache.py [--quick] [--out FILE]     # a CUDA GPU
    python3 bench/bench_kvcache.py --smoke --out FILE         # CPU, Triton's interpreter, tiny sizes (a test)

Rows under "paged" (and "paged_meta": gpu, torch, triton, date, how things were timed), merged into FILE
(default bench/results/<gpu>.json) without touching its other keys:
{"dtype", "B", "H", "Hkv", "d", "block_size", "mean_len", "triton_gbs", "contig_triton_gbs",
"sdpa_cudnn_gbs"} plus "lengths", "cache_mib", "num_splits", "triton_graph_gbs", the correctness fields.

One decode step (Nq = 1) per sequence, ragged lengths (seeded). GB/s = bytes of K and V that are valid
(sum of the lengths x Hkv x d x 2 tensors x bytes per element) / time, for every column, so the columns
compare the time to do the same useful work:
- triton_gbs: the paged cache, pages of block_size tokens in shuffled order (a random block_table).
- contig_triton_gbs: the same lengths in a contiguous cache [B, Nmax, Hkv, d] (Nmax = the longest).
- sdpa_cudnn_gbs: SDPA (cuDNN backend forced) cannot take per-sequence lengths without a mask, which
  sends a decode off its fast path; it runs on an equal-length batch with the same total tokens
  (B sequences of round(mean_len) keys, [B, Hkv, L, d]), the work a perfectly balanced batch needs.
Every row is checked first: the Triton output against float64 attention on each sequence alone must be
within 2x SDPA's own error (same dtype, each sequence alone) + 1e-5, and finite.
Timing: bench/common.py's policy, triton.testing.do_bench (median, L2 flushed); triton_graph_gbs also with
triton.testing.do_bench_cudagraph (no Python in the timed loop). A short table is printed last.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

if "--smoke" in sys.argv[1:]:  # before Triton is imported: the interpreter, on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (TIMING, GRAPH_TIMING, bench_ms, graph_ms, log, results_path, run_meta, sdpa_ms,  # noqa: E402
                    within_sdpa_error, write_section)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from helpers.kernels.kvcache import flash_attn_with_kvcache_triton  # noqa: E402
from helpers.kernels import common as kc, decode as kd  # noqa: E402

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
BLOCK_SIZES = (16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------- inputs


def ragged_lengths(B, mean_len, seed):
    """B lengths, seeded, uniform in [mean/2, 3*mean/2] then scaled so they sum to B * mean_len."""
    g = torch.Generator().manual_seed(seed)
    raw = (0.5 + torch.rand(B, generator=g, dtype=torch.float64)) * mean_len
    lens = (raw * (B * mean_len / raw.sum())).round().long().clamp(min=1)
    lens[-1] += B * mean_len - int(lens.sum())  # exact total
    return [int(x) for x in lens]


def contiguous_cache(B, H, Hkv, d, lens, dtype, device, seed):
    """q [B, 1, H, d]; caches [B, Nmax, Hkv, d] with noise past each length (a kernel that reads it is caught)."""
    g = torch.Generator(device=device).manual_seed(seed)
    Nmax = max(lens)
    q = torch.randn(B, 1, H, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Nmax, Hkv, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Nmax, Hkv, d, device=device, dtype=dtype, generator=g)
    for b, L in enumerate(lens):
        k[b, L:] = 1e4  # huge scores if read
        v[b, L:] = float("nan")
    return q, k, v


def paged_cache(k, v, lens, block_size, seed):
    """The same cache in pages [num_blocks, block_size, Hkv, d], shuffled; block_table int32 [B, max_blocks].

    Only the pages a sequence uses exist (num_blocks = sum of ceil(len / block_size)); table entries
    past a sequence's end point at page 0 and must never be read."""
    B, Nmax, Hkv, d = k.shape
    max_blocks = -(-Nmax // block_size)
    used = [-(-L // block_size) for L in lens]
    num_blocks = sum(used)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).to(k.device)
    table = torch.zeros(B, max_blocks, dtype=torch.int32, device=k.device)  # [B, max_blocks]
    kp = torch.empty(num_blocks, block_size, Hkv, d, device=k.device, dtype=k.dtype)
    vp = torch.empty_like(kp)
    start = 0
    for b, n in enumerate(used):
        pages = perm[start:start + n]
        start += n
        table[b, :n] = pages.to(torch.int32)
        pad = n * block_size - min(n * block_size, Nmax)
        kb = F.pad(k[b, :n * block_size], (0, 0, 0, 0, 0, pad)).view(n, block_size, Hkv, d)
        vb = F.pad(v[b, :n * block_size], (0, 0, 0, 0, 0, pad)).view(n, block_size, Hkv, d)
        kp[pages] = kb
        vp[pages] = vb
    return kp, vp, table


# ----------------------------------------------------------------------------- correctness


def check(q, k, v, lens, o_tri):
    """Max error of Triton and of SDPA (same dtype) against float64, each sequence alone, all heads."""
    B, _, H, d = q.shape
    tri_err = sdpa_err = 0.0
    for b, L in enumerate(lens):
        qb = q[b].transpose(0, 1)  # [H, 1, d]
        kb, vb = (t[b, :L].transpose(0, 1) for t in (k, v))  # [Hkv, L, d]
        ref = F.scaled_dot_product_attention(qb.double(), kb.double(), vb.double(), enable_gqa=True)  # [H, 1, d]
        o_sdpa = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
        tri_err = max(tri_err, (o_tri[b].transpose(0, 1).double() - ref).abs().max().item())
        sdpa_err = max(sdpa_err, (o_sdpa.double() - ref).abs().max().item())
    ok = bool(torch.isfinite(o_tri).all()) and within_sdpa_error(tri_err, sdpa_err)
    return {"pass": ok, "err": tri_err, "sdpa_err": sdpa_err}


# ----------------------------------------------------------------------------- timing


def sdpa_cudnn_ms(B, H, Hkv, d, L, dtype, device, smoke):
    """SDPA's cuDNN backend on an equal-length batch [B, Hkv, L, d] (None if it refuses or on the CPU)."""
    if smoke:
        return None
    q = torch.randn(B, H, 1, d, device=device, dtype=dtype)
    k, v = (torch.randn(B, Hkv, L, d, device=device, dtype=dtype) for _ in range(2))
    return sdpa_ms("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv))


def gbs(nbytes, ms):
    return None if not ms else float(f"{nbytes / ms / 1e6:.4g}")


# ----------------------------------------------------------------------------- rows


def cases(smoke, quick):
    """(dtype, B, H, Hkv, d, mean_len, seed): caches of 256 MiB or more on a GPU."""
    if smoke:
        return [("float32", 3, 4, 2, 16, 40, 1)]
    out = [("bfloat16", 8, 32, 8, 128, 24576, 1), ("float16", 16, 32, 8, 128, 16384, 2)]
    if not quick:
        out += [("bfloat16", 16, 32, 8, 128, 32768, 3)]
    return out


def run_paged(smoke, quick, save=None):
    device = "cpu" if smoke else "cuda"
    block_sizes = (16, 32) if smoke else BLOCK_SIZES
    rows = []
    for dtype, B, H, Hkv, d, mean_len, seed in cases(smoke, quick):
        lens = ragged_lengths(B, mean_len, seed)
        q, k, v = contiguous_cache(B, H, Hkv, d, lens, DT[dtype], device, seed)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        nbytes = 2 * sum(lens) * Hkv * d * k.element_size()  # valid K and V bytes
        contig = lambda: flash_attn_with_kvcache_triton(q, k, v, seqlens)  # noqa: E731
        contig_ok = check(q, k, v, lens, contig())
        contig_gbs = gbs(nbytes, bench_ms(contig, smoke=smoke))
        L_eq = round(sum(lens) / B)
        cudnn_gbs = gbs(2 * B * L_eq * Hkv * d * k.element_size(), sdpa_cudnn_ms(B, H, Hkv, d, L_eq, DT[dtype],
                                                                                 device, smoke))
        for bs in block_sizes:
            capacity = -(-max(lens) // bs) * bs  # max_blocks * block_size: what the split heuristic sees
            auto = kd._pick_num_splits(B * Hkv, capacity, kd._num_sms(q.device))
            row = {"dtype": dtype, "B": B, "H": H, "Hkv": Hkv, "d": d, "block_size": bs, "mean_len": mean_len,
                   "lengths": lens, "cache_mib": round(nbytes / 2 ** 20, 1), "num_splits": auto,
                   "contig_pass": contig_ok["pass"], "contig_triton_gbs": contig_gbs, "sdpa_cudnn_gbs": cudnn_gbs}
            try:
                kp, vp, table = paged_cache(k, v, lens, bs, seed + bs)
                paged = lambda: flash_attn_with_kvcache_triton(q, kp, vp, seqlens, block_table=table)  # noqa: E731
                row.update(check(q, k, v, lens, paged()))
                row["triton_gbs"] = gbs(nbytes, bench_ms(paged, smoke=smoke))
                row["triton_graph_gbs"] = gbs(nbytes, graph_ms(paged, smoke=smoke))
                # ragged lengths make programs of unequal length: how other split counts fare (data for the heuristic)
                row["splits_sweep_gbs"] = {
                    str(S): gbs(nbytes, bench_ms(lambda: flash_attn_with_kvcache_triton(
                        q, kp, vp, seqlens, block_table=table, num_splits=S), smoke=smoke))
                    for S in sorted({max(1, auto // 2), 2 * auto, 4 * auto} - {auto})[:1 if smoke else 3]}
                del kp, vp, table
            except Exception:
                traceback.print_exc()
                row.update({"pass": False, "triton_gbs": None})
            log("  paged", json.dumps({kk: vv for kk, vv in row.items() if kk != "lengths"}))
            rows.append(row)
            if save:  # after every row: a run cut short keeps what it measured
                save(rows)
        del q, k, v
    return rows


def summary(rows):
    lines = ["paged decode (GB/s of valid K+V)  dtype   B  bs  mean_len  MiB   paged  contig  cudnn  "
             "paged/contig  paged/cudnn  graph  ok"]
    for r in rows:
        t, c, n, gr = r.get("triton_gbs"), r.get("contig_triton_gbs"), r.get("sdpa_cudnn_gbs"), r.get("triton_graph_gbs")
        lines.append(f"  {r['dtype']:>36} {r['B']:>3} {r['block_size']:>3} {r['mean_len']:>9} {r['cache_mib']:>4.0f} "
                     f"{t or 0:>7.0f} {c or 0:>7.0f} {n or 0:>6.0f} {t / c if t and c else 0:>13.3f} "
                     f"{t / n if t and n else 0:>12.3f} {gr or 0:>6.0f}  {'ok' if r.get('pass') else 'FAIL'}")
    ratios = [r["triton_gbs"] / r["contig_triton_gbs"] for r in rows if r.get("triton_gbs") and r.get("contig_triton_gbs")]
    if ratios:
        lines.append(f"  paged / contiguous: min {min(ratios):.3f}, geomean "
                     f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} (target >= 0.95)")
    lines.append(f"  correctness: {sum(bool(r.get('pass')) for r in rows)}/{len(rows)} pass")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under Triton's interpreter")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--out", default=None, help="JSON file to merge the rows into (default bench/results/<gpu>.json)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_kvcache.py needs a CUDA GPU (or --smoke for the CPU)")
    if args.smoke and not kc.interpreting():
        sys.exit("--smoke runs under Triton's interpreter: set TRITON_INTERPRET=1 before Triton is imported")
    gpu = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    out = args.out or results_path(gpu)
    t0 = time.time()
    log(f"{gpu} torch {torch.__version__} triton {triton.__version__}")
    meta = run_meta(gpu, timing=f"{TIMING}; triton_graph_gbs: {GRAPH_TIMING}",
                    gbs="valid K and V bytes (sum of lengths) / time, for every column",
                    sdpa_cudnn="equal-length batch with the same total tokens (B x round(mean of the lengths))",
                    correctness="Triton vs float64 per sequence <= 2 x SDPA's own error + 1e-5")
    rows = run_paged(args.smoke, args.quick, save=lambda rows: write_section("paged", rows, meta, out))
    write_section("paged", rows, meta, out)
    log(f"done in {time.time() - t0:.0f}s; wrote 'paged' into {out}")
    log(summary(rows))
    return rows


if __name__ == "__main__":
    main()
