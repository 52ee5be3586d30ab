"""`make bench`: the Triton kernels of notebook 07 against PyTorch SDPA on one GPU.

    python3 bench/bench.py [--quick] [--explore] [--out DIR]

Prefill: forward TFLOP/s of flash_attn_triton and of SDPA's flash, cuDNN and
memory-efficient backends (each forced with sdpa_kernel), FLOPs = 4*B*H*N*N*d,
halved when causal. Decode: effective GB/s of flash_decode_triton and of SDPA's
flash and cuDNN backends, bytes = the K and V cache read once. Every Triton case
is checked first against a float64 reference (FlashAttention's rule: max error
at most twice SDPA's own, same dtype) and the row records pass or fail.
Timing: bench/common.py's policy (triton.testing.do_bench, median, L2 flushed
before each repetition). Also measured once: device-to-device copy bandwidth and
the bf16 matmul rate (the two ceilings, in each section's meta). Writes the
sections "prefill" and "decode", each with its "<section>_meta", into
<out>/<gpu>.json (other sections kept) and <out>/<gpu>.png, prints a short
table last. --explore also times fixed kernel configurations and
num_splits choices (written to <out>/explore.json) to pick the defaults.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (GRAPH_TIMING, RESULTS_DIR, TIMING, bench_ms, check_prefill, graph_ms, log,  # noqa: E402
                    results_path, run_meta, save_figure, sdpa_backends, sdpa_ms, subplots, within_sdpa_error,
                    write_json, write_section)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

from helpers.results import geomean  # noqa: E402
from helpers.kernels.decode import flash_decode_triton  # noqa: E402
from helpers.kernels.forward import flash_attn_triton  # noqa: E402
from helpers.kernels import decode as kd, forward as kf  # noqa: E402

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def ceilings():
    n = 1 << 28  # 256 Mi float32 = 1 GiB
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    copy_gbs = 2 * x.numel() * 4 / ms / 1e6
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    mm_tflops = 2 * 8192 ** 3 / ms / 1e9
    return {"copy_gbs_read_plus_write": round(copy_gbs, 1), "bf16_matmul_tflops": round(mm_tflops, 1)}


# ----------------------------------------------------------------------------- prefill


def graph_gbs(fn, nbytes):
    """GB/s of the call captured in a CUDA graph (common.graph_ms), None if it could not be captured."""
    ms = graph_ms(fn)
    return None if ms is None else round(nbytes / ms / 1e6, 1)


def sdpa_time(q, k, v, causal, backend, **kw):
    return sdpa_ms(backend, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw))


def prefill_cases(quick):
    cases = []
    for dtype in ("float16", "bfloat16"):
        for d in (64, 128):
            for causal in (False, True):
                Ns = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)
                for N in Ns:
                    B = max(1, 32768 // N)
                    H = 32 if d == 64 else 16
                    cases.append((dtype, d, causal, N, B, H))
    if quick:
        cases = [c for c in cases if c[0] == "bfloat16"]
    return cases


def run_prefill(quick, save=None):
    rows = []
    for dtype, d, causal, N, B, H in prefill_cases(quick):
        torch.manual_seed(N + d)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=DT[dtype]) for _ in range(3))
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        row = {"dtype": dtype, "d": d, "causal": causal, "N": N, "B": B, "H": H}
        try:
            o, lse = flash_attn_triton(q, k, v, causal=causal, backend="triton")
            row.update(check_prefill(q, k, v, causal, o, lse))
            del o, lse
            ms = bench_ms(lambda: flash_attn_triton(q, k, v, causal=causal, backend="triton"))
            row["triton_tflops"] = round(flops / ms / 1e9, 1)
            cfg = getattr(kf._attn_fwd_tuned, "best_config", None)
            row["config"] = str(cfg) if cfg is not None else None
        except Exception:
            traceback.print_exc()
            row.update({"pass": False, "triton_tflops": None})
        for name in ("flash", "cudnn", "efficient"):
            ms = sdpa_time(q, k, v, causal, name)
            row[f"sdpa_{name}_tflops"] = None if ms is None else round(flops / ms / 1e9, 1)
        log("  prefill", json.dumps(row))
        rows.append(row)
        if save:
            save(rows)
        del q, k, v
    return rows


# ----------------------------------------------------------------------------- decode


def decode_cases(quick):
    # B, H, Hkv, Nk  (d = 128); cache = 2*B*Hkv*Nk*d*2 bytes
    cases = [
        (1, 8, 8, 131072), (1, 32, 8, 131072), (1, 32, 32, 32768), (1, 32, 32, 131072),
        (4, 32, 8, 32768), (8, 32, 32, 4096), (8, 32, 32, 16384), (32, 64, 8, 8192),
        (8, 64, 8, 4096), (1, 32, 8, 4096),
    ]
    if quick:
        cases = cases[1:4] + cases[6:8]
    out = []
    for dtype in (("bfloat16",) if quick else ("float16", "bfloat16")):
        out += [(dtype, B, H, Hkv, Nk, 128) for B, H, Hkv, Nk in cases]
    return out


def check_decode(q, k, v, o_tri):
    B, H, d = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qd = q.double().view(B, Hkv, G, d)
    s = torch.einsum("bkgd,bknd->bkgn", qd, k.double()) / math.sqrt(d)  # [B, Hkv, G, Nk]
    ref = torch.einsum("bkgn,bknd->bkgd", torch.softmax(s, -1), v.double()).reshape(B, H, d)
    del s
    tri_err = (o_tri.double() - ref).abs().max().item()
    try:
        o_sdpa = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=G > 1)[:, :, 0]
        sdpa_err = (o_sdpa.double() - ref).abs().max().item()
    except Exception:
        o_lp = torch.softmax((q.view(B, Hkv, G, d) @ k.transpose(-1, -2)).float() / math.sqrt(d), -1)
        sdpa_err = ((o_lp.to(q.dtype) @ v).reshape(B, H, d).double() - ref).abs().max().item()
    ok = bool(torch.isfinite(o_tri).all()) and within_sdpa_error(tri_err, sdpa_err)
    return {"pass": ok, "err": tri_err, "sdpa_err": sdpa_err}


def launch_cost_us():
    """Wall time per call of back-to-back calls on a tiny cache (16 MiB): the Python
    launch cost, which do_bench includes whenever it exceeds the kernel time."""
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = {}
    fns = {"triton": lambda: flash_decode_triton(q, k, v),
           "triton_1split": lambda: flash_decode_triton(q, k, v, num_splits=1)}
    for name in ("flash", "cudnn"):
        def fn(name=name):
            with sdpa_kernel(sdpa_backends()[name]):
                return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
        fns["sdpa_" + name] = fn
    for name, fn in fns.items():
        try:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            out[name] = round((time.perf_counter() - t) / 200 * 1e6, 1)
        except Exception as e:
            out[name] = None
            log(f"    launch cost {name}: {type(e).__name__}")
    return out


def run_decode(quick, splits_override=None, config=None, save=None):
    rows = []
    for dtype, B, H, Hkv, Nk, d in decode_cases(quick):
        torch.manual_seed(Nk + H)
        q = torch.randn(B, H, d, device="cuda", dtype=DT[dtype])
        k = torch.randn(B, Hkv, Nk, d, device="cuda", dtype=DT[dtype])
        v = torch.randn(B, Hkv, Nk, d, device="cuda", dtype=DT[dtype])
        nbytes = 2 * k.numel() * k.element_size()
        S = kd._pick_num_splits(B * Hkv, Nk, kd._num_sms(q.device))
        row = {"dtype": dtype, "B": B, "H": H, "Hkv": Hkv, "Nk": Nk, "d": d, "num_splits": S,
               "cache_mib": nbytes / 2 ** 20}
        try:
            o = flash_decode_triton(q, k, v, config=config)
            row.update(check_decode(q, k, v, o))
            ms = bench_ms(lambda: flash_decode_triton(q, k, v, config=config))
            row["triton_gbs"] = round(nbytes / ms / 1e6, 1)
            row["config"] = str(config or kd._decode_choice.get(kd._decode_key(q, B, Hkv, Nk, S, H // Hkv, 1, d, 0, False)))
            # the same call captured in a CUDA graph: no Python launch cost in the timed loop
            row["triton_graph_gbs"] = graph_gbs(lambda: flash_decode_triton(q, k, v, config=config), nbytes)
            if row["triton_graph_gbs"] and row["triton_gbs"]:
                row["do_bench_over_graph"] = round(row["triton_gbs"] / row["triton_graph_gbs"], 3)
        except Exception:
            traceback.print_exc()
            row.update({"pass": False, "triton_gbs": None})
        q4 = q[:, :, None, :]  # [B, H, 1, d]
        for name in ("flash", "cudnn"):
            ms = sdpa_time(q4, k, v, False, name, enable_gqa=H != Hkv)
            row[f"sdpa_{name}_gbs"] = None if ms is None else round(nbytes / ms / 1e6, 1)
            if ms is not None:
                def fn(name=name):
                    with sdpa_kernel(sdpa_backends()[name]):
                        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=H != Hkv)
                row[f"sdpa_{name}_gbs_graph"] = graph_gbs(fn, nbytes)
        log("  decode", json.dumps(row))
        rows.append(row)
        if save:  # after every row: a run cut short keeps what it measured
            save(rows)
        del q, k, v
    return rows


# ----------------------------------------------------------------------------- explore


def explore():
    """Fixed configurations of the forward kernel (pointer loads vs TMA) and of decode."""
    res = {"prefill": [], "decode": []}
    fwd_cfgs = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                (128, 64, 4, 3), (64, 64, 4, 3)]
    for dtype in ("float16",):
        for d in (64, 128):
            for causal in (False, True):
                for N in (4096, 16384):
                    B, H = 32768 // N, (32 if d == 64 else 16)
                    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=DT[dtype]) for _ in range(3))
                    flops = 4 * B * H * N * N * d / (2 if causal else 1)
                    line = {"dtype": dtype, "d": d, "causal": causal, "N": N}
                    for name in ("flash", "cudnn"):
                        ms = sdpa_time(q, k, v, causal, name)
                        line[name] = None if ms is None else round(flops / ms / 1e9, 1)
                    for tma in (False, True):
                        for bm, bn, w, s in fwd_cfgs:
                            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
                            tag = f"{'tma' if tma else 'ptr'}_{bm}x{bn}_w{w}_s{s}"
                            try:
                                ms = bench_ms(lambda: flash_attn_triton(q, k, v, causal=causal, use_tma=tma,
                                                                        config=cfg))
                                line[tag] = round(flops / ms / 1e9, 1)
                            except Exception as e:
                                line[tag] = None
                                log("   ", tag, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
                    best = max((kk for kk in line if kk.startswith(("tma", "ptr")) and line[kk]),
                               key=lambda kk: line[kk])
                    log(f"  explore prefill {dtype} d={d} causal={causal} N={N}: flash {line['flash']} "
                        f"cudnn {line['cudnn']} best {best} {line[best]}")
                    res["prefill"].append(line)
                    del q, k, v
    dec_cfgs = [(64, 4, 3), (64, 4, 4), (64, 8, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (128, 8, 4)]
    for B, H, Hkv, Nk in ((1, 32, 8, 131072), (1, 32, 32, 32768), (8, 32, 32, 16384), (32, 64, 8, 8192)):
        q = torch.randn(B, H, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * k.numel() * 2
        line = {"B": B, "H": H, "Hkv": Hkv, "Nk": Nk}
        ms = sdpa_time(q[:, :, None], k, v, False, "cudnn", enable_gqa=H != Hkv)
        line["cudnn"] = None if ms is None else round(nbytes / ms / 1e6, 1)
        base = kd._pick_num_splits(B * Hkv, Nk, kd._num_sms(q.device))
        for bn, w, s in dec_cfgs:
            cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": s}
            for S in sorted({max(1, base // 2), base, base * 2, max(1, 132 // (B * Hkv)), max(1, 264 // (B * Hkv))}):
                tag = f"bn{bn}_w{w}_s{s}_S{S}"
                try:
                    ms = bench_ms(lambda: flash_decode_triton(q, k, v, num_splits=S, config=cfg))
                    line[tag] = round(nbytes / ms / 1e6, 1)
                except Exception as e:
                    line[tag] = None
                    log("   ", tag, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
        best = sorted((kk for kk in line if kk.startswith("bn") and line[kk]), key=lambda kk: -line[kk])[:3]
        log(f"  explore decode B={B} H={H} Hkv={Hkv} Nk={Nk}: cudnn {line['cudnn']} "
            + ", ".join(f"{kk} {line[kk]}" for kk in best))
        res["decode"].append(line)
        del q, k, v
    return res


# ----------------------------------------------------------------------------- report


def section_meta(result, section):
    """A section's meta (GPU, versions, date, ceilings): its own ``<section>_meta``, else the file's top level
    (files written before each section carried one)."""
    return result.get(f"{section}_meta", result)


def summary(result):
    lines = []
    pre = result.get("prefill", [])
    if pre:
        lines.append("prefill (TFLOP/s)   dtype    d  causal     N   triton  flash  cudnn  t/flash  t/cudnn  ok")
        for r in pre:
            t, f, c = r.get("triton_tflops"), r.get("sdpa_flash_tflops"), r.get("sdpa_cudnn_tflops")
            lines.append(f"  {r['dtype']:>26} {r['d']:>4} {str(r['causal']):>7} {r['N']:>5} {t or 0:>8.0f} "
                         f"{f or 0:>6.0f} {c or 0:>6.0f} {t / f if t and f else 0:>8.2f} "
                         f"{t / c if t and c else 0:>8.2f}  {'ok' if r.get('pass') else 'FAIL'}")
        big = [r for r in pre if r["N"] >= 2048]
        for label, sel in (("all", big), ("float16", [r for r in big if r["dtype"] == "float16"]),
                           ("bfloat16", [r for r in big if r["dtype"] == "bfloat16"])):
            if sel:
                gf = geomean([r["triton_tflops"] / r["sdpa_flash_tflops"] for r in sel
                              if r.get("triton_tflops") and r.get("sdpa_flash_tflops")]) or float("nan")
                gc = geomean([r["triton_tflops"] / r["sdpa_cudnn_tflops"] for r in sel
                              if r.get("triton_tflops") and r.get("sdpa_cudnn_tflops")]) or float("nan")
                lines.append(f"  geomean N>=2048 {label:>8}: {gf:.3f}x flash (target 1.3), "
                             f"{gc:.3f}x cuDNN (target 0.9)")
        lines.append(f"  prefill correctness: {sum(bool(r.get('pass')) for r in pre)}/{len(pre)} pass")
    dec = result.get("decode", [])
    if dec:
        lines.append("decode (GB/s)      dtype   B   H Hkv     Nk  MiB  S   triton   flash   cudnn  t/cudnn  ok"
                     "   | graph: triton  cudnn")
        for r in dec:
            t, f, c = r.get("triton_gbs"), r.get("sdpa_flash_gbs"), r.get("sdpa_cudnn_gbs")
            tg, cg = r.get("triton_graph_gbs", r.get("triton_gbs_graph")), r.get("sdpa_cudnn_gbs_graph")  # old key too
            lines.append(f"  {r['dtype']:>16} {r['B']:>3} {r['H']:>3} {r['Hkv']:>3} {r['Nk']:>6} "
                         f"{r['cache_mib']:>4.0f} {r['num_splits']:>2} {t or 0:>8.0f} {f or 0:>7.0f} {c or 0:>7.0f} "
                         f"{t / c if t and c else 0:>8.2f}  {'ok' if r.get('pass') else 'FAIL'}"
                         f"   |        {tg or 0:>6.0f} {cg or 0:>6.0f}   do_bench/graph {t / tg if t and tg else 0:.3f}")
        big = [r for r in dec if r["cache_mib"] >= 256 and r.get("triton_gbs")]
        if big:
            lines.append(f"  caches >= 256 MiB: triton min {min(r['triton_gbs'] for r in big):.0f} GB/s "
                         f"(target 3800), min ratio vs cuDNN "
                         f"{min((r['triton_gbs'] / r['sdpa_cudnn_gbs'] for r in big if r.get('sdpa_cudnn_gbs')), default=float('nan')):.3f} "
                         f"(target 0.9)")
        ratios = [r["triton_gbs"] / r["triton_graph_gbs"] for r in big if r.get("triton_graph_gbs")]
        if ratios:
            lines.append(f"  caches >= 256 MiB: Triton do_bench / CUDA-graph GB/s min {min(ratios):.3f} (target >= 0.95)")
        lines.append(f"  decode correctness: {sum(bool(r.get('pass')) for r in dec)}/{len(dec)} pass")
    meta = section_meta(result, "decode" if dec and not pre else "prefill")
    if "ceilings" in meta:
        lines.append(f"ceilings: {meta['ceilings']}")
    launch = section_meta(result, "decode").get("launch_cost_us") or result.get("launch_cost_us")
    if launch:
        lines.append(f"launch cost, us per call: {launch}")
    return "\n".join(lines)


def plot(result, path):
    fig, axes = subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    pre = [r for r in result.get("prefill", []) if r["dtype"] == "bfloat16"]
    colors = {(64, False): "C0", (64, True): "C1", (128, False): "C2", (128, True): "C3"}
    for (d, causal), col in colors.items():
        sel = sorted((r for r in pre if r["d"] == d and r["causal"] == causal), key=lambda r: r["N"])
        if not sel:
            continue
        Ns = [r["N"] for r in sel]
        ax.plot(Ns, [r["triton_tflops"] or 0 for r in sel], "-o", color=col, label=f"Triton d={d} causal={causal}")
        ax.plot(Ns, [r["sdpa_cudnn_tflops"] or 0 for r in sel], "--", color=col, alpha=0.7, label="SDPA cuDNN")
        ax.plot(Ns, [r["sdpa_flash_tflops"] or 0 for r in sel], ":", color=col, alpha=0.7, label="SDPA flash")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (forward, bf16)")
    gpu = section_meta(result, "prefill").get("gpu", "?")
    ax.set_title(f"Prefill on {gpu}: solid Triton, dashed cuDNN, dotted flash")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1]
    dec = [r for r in result.get("decode", []) if r["dtype"] == "bfloat16"]
    xs = range(len(dec))
    w = 0.27
    for i, (key, name) in enumerate((("triton_gbs", "Triton"), ("sdpa_flash_gbs", "SDPA flash"),
                                     ("sdpa_cudnn_gbs", "SDPA cuDNN"))):
        ax.bar([x + (i - 1) * w for x in xs], [(r.get(key) or 0) / 1000 for r in dec], w, label=name)
    copy = section_meta(result, "decode").get("ceilings", {}).get("copy_gbs_read_plus_write")
    if copy:
        ax.axhline(copy / 1000, color="k", lw=0.8, ls="--", label="measured copy (read+write)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"B{r['B']} H{r['H']}/{r['Hkv']}\nNk{r['Nk'] // 1024}k" for r in dec], fontsize=6)
    ax.set_ylabel("TB/s (K and V read once)")
    ax.set_title("Decode, bf16, d=128")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small subset of the cases")
    ap.add_argument("--explore", action="store_true", help="also sweep fixed configurations (slow)")
    ap.add_argument("--explore-only", action="store_true")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--quick-prefill", action="store_true", help="the quick prefill subset, every decode row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    t0 = time.time()
    log(f"{gpu} torch {torch.__version__} triton {triton.__version__} "
        f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    if args.explore or args.explore_only:
        write_json(os.path.join(args.out, "explore.json"), explore())
        log(f"explore done at {time.time() - t0:.0f}s")
        if args.explore_only:
            return
    path = results_path(gpu, args.out)
    meta = run_meta(gpu, timing=f"{TIMING}; *_graph: {GRAPH_TIMING}", ceilings=ceilings())
    log("ceilings", meta["ceilings"])
    result = {}

    def save(key, key_meta):
        def write(rows):  # after every row: a run cut short keeps what it measured
            result.update(write_section(key, rows, key_meta, path))
        return write

    if not args.skip_prefill:
        save("prefill", meta)(run_prefill(args.quick or args.quick_prefill, save("prefill", meta)))
        log(f"prefill done at {time.time() - t0:.0f}s")
    if not args.skip_decode:
        decode_meta = dict(meta, launch_cost_us=launch_cost_us())
        log("launch cost (us per call, 16 MiB cache)", decode_meta["launch_cost_us"])
        save("decode", decode_meta)(run_decode(args.quick, save=save("decode", decode_meta)))
    try:
        plot(result, os.path.splitext(path)[0] + ".png")
    except Exception:
        traceback.print_exc()
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")
    log(summary(result))


if __name__ == "__main__":
    main()
