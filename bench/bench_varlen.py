"""`make bench`, the "varlen" rows: packed variable-length prefill on one GPU.

    python3 bench/bench_varlen.py [--out FILE] [--quick] [--tune-dense] [--smoke]

For each length mix (uniform 512-8k, long-tailed: many 128-1k plus a few 8k-16k, equal lengths;
32k tokens in all, seeded), bf16 and fp16, d = 64 (H = 32) and d = 128 (H = 16), causal and not,
Hkv = H and, on the uniform mix, Hkv = H / 4, three ways of doing the same attention:

* ``flash_attn_varlen_triton`` on the packed batch (helpers/kernels/varlen.py), called with
  validate=False: no host sync, as the FlashAttention library (the default validate=True adds one
  device-to-host copy of cu_seqlens per call);
* ``flash_attn_triton`` (the dense kernel) on a batch of equal lengths with the same total tokens,
  L = the mix's mean length rounded to 128, B' = total / L;
* SDPA on the padded batch [B, H, max_len, d], the fastest of its cuDNN and flash backends (forced
  with sdpa_kernel; K and V expanded to H heads beforehand, outside the timing). Causal: is_causal=True
  (right padding keeps every real row's mask right). Not causal: no mask, so padded keys would enter
  the softmax; the time is a lower bound on what a correct key-padding mask would cost (and the only
  way to keep the flash and cuDNN backends, which refuse arbitrary masks).

Useful FLOPs only: 4 * H * d * (visible (query, key) pairs), summed over the real sequences (causal:
n (n + 1) / 2 pairs for a sequence of n tokens); the dense row counts its own batch's pairs, the padded
SDPA row the same useful FLOPs as the varlen row. Correctness first: the first two, the last two and the
longest sequence of each case against SDPA in float64 on that sequence alone (chunks of rows, explicit
mask), max error at most twice SDPA's own in the same dtype, plus 1e-5. Timing: bench/common.py's policy,
triton.testing.do_bench median, L2 flushed. Merges its rows into FILE (default bench/results/<gpu>.json)
under "varlen" and "varlen_meta", leaving every other key as it was; prints a short table last.

--smoke: tiny sizes, fp32 under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set here when there
is no GPU): the script's own test, not a measurement.
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (TIMING, bench_ms, log, results_path, run_meta, sdpa_ms, within_sdpa_error,  # noqa: E402
                    write_section)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from helpers.kernels.forward import flash_attn_triton  # noqa: E402
from helpers.kernels.varlen import flash_attn_varlen_triton, varlen_block_m, varlen_block_map  # noqa: E402

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The dense kernel's autotuner chose these on the H200 for N >= 2048 in nearly every row of
# bench/results/h200.json (prefill); fixed here to keep the script's compile time inside its budget.
DENSE_CONFIG = {64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)}
BUDGET_S = 220  # stop starting new rows after this (the whole script must stay under 4 minutes)


# ----------------------------------------------------------------------------- lengths and FLOPs


def make_lengths(mix, total, rng, scale=1):
    """Sequence lengths summing to total. scale divides every length range (--smoke uses tiny ones)."""
    if mix == "equal":
        n = 4096 // scale
        return [n] * (total // n) + ([total % n] if total % n else [])
    if mix == "uniform":
        lens = []
        while sum(lens) < total:
            lens.append(rng.randint(512 // scale, 8192 // scale))
        lens[-1] -= sum(lens) - total  # the last one takes what is left (a ragged tail, maybe short)
        return lens
    if mix == "long-tailed":  # a few long documents among many short requests
        lens = [rng.randint(8192 // scale, 16384 // scale) for _ in range(2)]
        assert sum(lens) < total, "the long documents must leave room for the short ones"
        while sum(lens) < total:
            lens.append(rng.randint(128 // scale, 1024 // scale))
        lens[-1] -= sum(lens) - total
        rng.shuffle(lens)
        return lens
    raise ValueError(f"unknown mix {mix!r}")


def visible_pairs(n, nk, causal):
    """(query, key) pairs attention computes for one sequence; causal is bottom-right (row i sees j <= i + nk - n)."""
    if not causal:
        return n * nk
    if nk >= n:
        return n * (2 * nk - n + 1) // 2
    return nk * (nk + 1) // 2


def useful_flops(lens, H, d, causal):
    return sum(4 * H * d * visible_pairs(n, n, causal) for n in lens)  # two matmuls, 2 FLOPs per multiply-add


def summary(lens):
    return {"count": len(lens), "min": min(lens), "max": max(lens), "mean": round(sum(lens) / len(lens), 1)}


# ----------------------------------------------------------------------------- correctness


def reference_one(q, k, v, causal):
    """SDPA in float64 on one sequence: q [n, H, d], k, v [n, H, d] -> O [n, H, d], chunks of rows."""
    n, H, d = q.shape
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))  # [H, n, d]
    rows = max(1, (1 << 26) // max(1, H * n))  # keep each [H, rows, n] float64 score block near 512 MiB
    out = []
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        mask = None
        if causal:
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(i0, i1, device=q.device)[:, None]
        out.append(F.scaled_dot_product_attention(qd[:, i0:i1], kd, vd, attn_mask=mask))  # [H, rows, d]
    return torch.cat(out, 1).transpose(0, 1)  # [n, H, d]


def check(q, k, v, cu, lens, causal, o):
    """Max error of the varlen O and of SDPA (same dtype) against float64, over a few sequences."""
    H, Hkv = q.shape[1], k.shape[1]
    B = len(lens)
    picks = sorted({0, 1, B - 2, B - 1, max(range(B), key=lens.__getitem__)} & set(range(B)))  # first, last, longest
    tri_err = sdpa_err = 0.0
    for b in picks:
        r = slice(cu[b], cu[b + 1])
        if lens[b] == 0:
            continue
        qs = q[r]  # [n, H, d]
        ks, vs = (t[r].repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # [n, H, d]
        ref = reference_one(qs, ks, vs, causal)
        lp = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)), is_causal=causal)
        tri_err = max(tri_err, (o[r].double() - ref).abs().max().item())
        sdpa_err = max(sdpa_err, (lp[0].transpose(0, 1).double() - ref).abs().max().item())
    finite = bool(torch.isfinite(o).all())
    ok = finite and within_sdpa_error(tri_err, sdpa_err)
    return ok, tri_err, sdpa_err


# ----------------------------------------------------------------------------- timing


def pad(x, cu, lens, L):
    """Packed [total, H, d] -> padded [B, H, L, d] (zeros after each sequence)."""
    out = x.new_zeros(len(lens), L, x.shape[1], x.shape[2])  # [B, L, H, d]
    for b, n in enumerate(lens):
        out[b, :n] = x[cu[b]:cu[b + 1]]
    return out.transpose(1, 2).contiguous()  # [B, H, L, d]


def sdpa_padded_ms(qp, kp, vp, causal, smoke):
    """Fastest SDPA backend on the padded batch; returns (ms, backend name)."""
    def fn():
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)

    if smoke:
        return bench_ms(fn, smoke=smoke), "default"
    best = (None, None)
    for name in ("cudnn", "flash"):
        ms = sdpa_ms(name, fn)  # None: the backend refused this case, skipped
        if ms is not None and (best[0] is None or ms < best[0]):
            best = (ms, name)
    return best


# ----------------------------------------------------------------------------- the rows


def cases(quick, smoke):
    out = []
    if smoke:
        return [("float32", 16, False, 2, 1, "uniform"), ("float32", 16, True, 2, 2, "long-tailed")]
    for dtype in (("bfloat16",) if quick else ("bfloat16", "float16")):
        for d, H in ((64, 32), (128, 16)):
            for causal in (False, True):
                for mix in ("uniform", "long-tailed", "equal"):
                    out.append((dtype, d, causal, H, H, mix))
                    if mix == "uniform" and dtype == "bfloat16":
                        out.append((dtype, d, causal, H, H // 4, mix))
    return out


def run_row(dtype, d, causal, H, Hkv, mix, total, device, smoke, tune_dense):
    scale = 512 if smoke else 1  # smoke: lengths 1-16; 16-32 and 0-2; 8
    rng = random.Random(f"{mix}-{total}")  # the same lengths for every dtype, d and causal
    lens = make_lengths(mix, total, rng, scale)
    cu_list = [0]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)  # [B + 1]
    g = torch.Generator(device=device).manual_seed(len(lens) * 1000 + d)
    dt = DT[dtype]
    q = torch.randn(total, H, d, device=device, dtype=dt, generator=g)  # [total, H, d]
    k = torch.randn(total, Hkv, d, device=device, dtype=dt, generator=g)  # [total, Hkv, d]
    v = torch.randn(total, Hkv, d, device=device, dtype=dt, generator=g)
    flops = useful_flops(lens, H, d, causal)
    row = {"dtype": dtype, "d": d, "causal": causal, "H": H, "Hkv": Hkv, "total_tokens": total, "mix": mix,
           "lengths": lens if len(lens) <= 16 else summary(lens)}
    detail = {}  # what does not belong in the row's fixed keys: into varlen_meta["details"]

    def varlen():
        return flash_attn_varlen_triton(q, k, v, cu, cu, max(lens), max(lens), causal=causal, validate=False)

    t_first = time.perf_counter()
    o, _ = flash_attn_varlen_triton(q, k, v, cu, cu, max(lens), max(lens), causal=causal)  # validated once
    t_first = (time.perf_counter() - t_first) * 1e3
    ok, err, sdpa_err = check(q, k, v, cu_list, lens, causal, o)
    row["err_ratio"] = round(err / max(sdpa_err, 1e-12), 3)
    detail.update({"pass": ok, "err": err, "sdpa_err": sdpa_err})
    del o
    ms = t_first if smoke else bench_ms(varlen)  # smoke: the interpreter is slow, one call is enough
    row["triton_tflops"] = round(flops / ms / 1e9, 1)
    if not smoke:  # the map built once per batch and shared by the layers: what the map costs per call
        premade = varlen_block_map(cu, varlen_block_m(d), total_q=total)
        ms = bench_ms(lambda: flash_attn_varlen_triton(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                       validate=False, block_map=premade))
        detail["triton_premapped_tflops"] = round(flops / ms / 1e9, 1)

    # the dense kernel on equal lengths, same total tokens
    step = 16 if smoke else 128
    L = max(step, round(sum(lens) / len(lens) / step) * step)
    Bd = max(1, round(total / L))
    qd = torch.randn(Bd, H, L, d, device=device, dtype=dt, generator=g)  # [B', H, L, d]
    kd = torch.randn(Bd, Hkv, L, d, device=device, dtype=dt, generator=g)  # [B', Hkv, L, d]
    vd = torch.randn(Bd, Hkv, L, d, device=device, dtype=dt, generator=g)
    cfg = None if (tune_dense or smoke) else DENSE_CONFIG.get(d)
    ms = bench_ms(lambda: flash_attn_triton(qd, kd, vd, causal=causal, config=cfg), smoke=smoke)
    row["dense_triton_tflops"] = round(useful_flops([L] * Bd, H, d, causal) / ms / 1e9, 1)
    detail["dense_shape"] = [Bd, H, L, d]

    # SDPA on the padded batch, K and V expanded to H heads outside the timing
    Lp = max(lens)
    qp = pad(q, cu_list, lens, Lp)  # [B, H, Lp, d]
    kp = pad(k.repeat_interleave(H // Hkv, dim=1), cu_list, lens, Lp)  # [B, H, Lp, d]
    vp = pad(v.repeat_interleave(H // Hkv, dim=1), cu_list, lens, Lp)
    ms, backend = sdpa_padded_ms(qp, kp, vp, causal, smoke)
    row["sdpa_padded_tflops"] = None if ms is None else round(flops / ms / 1e9, 1)
    detail["sdpa_backend"] = backend
    detail["padding_fraction"] = round(1 - total / (len(lens) * Lp), 3)  # of the padded batch's query rows
    return row, detail


def table(rows):
    head = f"{'dtype':9} {'d':>4} {'causal':>6} {'H/Hkv':>6} {'mix':12} {'varlen':>7} {'dense':>7} {'sdpa-pad':>8} " \
           f"{'v/dense':>7} {'v/sdpa':>7} {'err/sdpa':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        tv, td, ts = r.get("triton_tflops"), r.get("dense_triton_tflops"), r.get("sdpa_padded_tflops")
        lines.append(
            f"{r['dtype']:9} {r['d']:>4} {str(r['causal']):>6} {r['H']:>3}/{r['Hkv']:<2} {r['mix']:12} "
            f"{tv if tv is not None else '-':>7} {td if td is not None else '-':>7} {ts if ts is not None else '-':>8} "
            f"{(f'{tv / td:.2f}' if tv and td else '-'):>7} {(f'{tv / ts:.2f}' if tv and ts else '-'):>7} "
            f"{r.get('err_ratio', '-'):>8}")
    return "\n".join(lines) + "\n(TFLOP/s of useful work; v/dense, v/sdpa: the varlen kernel's ratios)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file to merge the rows into (default bench/results/<gpu>.json)")
    ap.add_argument("--quick", action="store_true", help="bf16 only")
    ap.add_argument("--tune-dense", action="store_true", help="autotune the dense kernel instead of its fixed config")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes under the interpreter (the script's test)")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        raise SystemExit("bench_varlen.py needs a CUDA GPU (or --smoke for the interpreter run)")
    if args.smoke and torch.cuda.is_available():
        raise SystemExit("--smoke is the CPU interpreter run; on a GPU machine run without it")
    device = "cuda" if on_gpu else "cpu"
    gpu = torch.cuda.get_device_name() if on_gpu else "cpu (interpreter smoke run)"
    path = args.out or results_path(gpu)
    total = 96 if args.smoke else 32768
    t0 = time.time()
    log(f"{gpu} torch {torch.__version__} triton {triton.__version__}; varlen rows into {path}")
    rows, details, skipped = [], [], []
    for c in cases(args.quick, args.smoke):
        if time.time() - t0 > BUDGET_S:
            skipped.append(list(c))
            continue
        try:
            row, detail = run_row(*c, total=total, device=device, smoke=args.smoke, tune_dense=args.tune_dense)
        except torch.cuda.OutOfMemoryError as e:
            log(f"  {c}: out of memory: {str(e).splitlines()[0][:120]}")
            torch.cuda.empty_cache()
            continue
        log("  varlen", json.dumps(row), json.dumps(detail))
        rows.append(row)
        details.append(detail)
        if on_gpu:
            torch.cuda.empty_cache()
    meta = {
        **run_meta(gpu),
        "timing": TIMING,
        "flops": "useful only: 4*H*d*visible (query, key) pairs summed over real sequences (causal: n(n+1)/2)",
        "varlen": "flash_attn_varlen_triton, validate=False (no host sync), the block map built in every call "
                  "(details: triton_premapped_tflops, the map passed in); autotuned BLOCK_N, warps, stages",
        "dense": "flash_attn_triton on [B', H, L, d], L = mean length rounded to 128, same total tokens; "
                 + ("autotuned" if args.tune_dense else f"fixed config {DENSE_CONFIG}"),
        "sdpa_padded": "fastest of SDPA cuDNN / flash on [B, H, max_len, d], K/V expanded to H heads; causal: "
                       "is_causal=True (right padding keeps real rows right); not causal: no mask, a lower bound "
                       "on a correctly masked call's time",
        "check": "first 2, last 2 and the longest sequence vs float64 SDPA on that sequence; pass: "
                 "err <= 2 * (SDPA same dtype err) + 1e-5",
        "details": details,  # one per row, same order: the check, the dense shape, SDPA's backend, padding
        "seconds": round(time.time() - t0, 1),
        "skipped_for_time": skipped,
    }
    write_section("varlen", rows, meta, path)
    log(f"done in {meta['seconds']}s; wrote {len(rows)} rows to {path}" + (f"; skipped {skipped}" if skipped else ""))
    log(table(rows))
    return rows


if __name__ == "__main__":
    main()
