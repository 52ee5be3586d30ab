"""`make bench`, backward part: the Triton backward of helpers/kernels/backward.py against PyTorch's.

    python3 bench/bench_bwd.py [--quick] [--sweep] [--out DIR]

For the prefill shapes of bench.py: the backward alone (``o.backward(do)`` with the forward done once,
timed with ``triton.testing.do_bench``, median, L2 flushed) of ``flash_attention`` and of SDPA's flash
and cuDNN backends (each forced with ``sdpa_kernel`` for its forward, whose saved state fixes the
backward) and of FlexAttention (``torch.compile(flex_attention)``, static shapes: PyTorch's own
Triton-generated attention). TFLOP/s with FLOPs = 2.5 x 4*B*H*N^2*d, halved when causal.

Correctness first, on every timed shape and on ragged ones (N, Nk not multiples of any block, both
causal alignments): each gradient of the first and last (batch, head) against float64 autograd; the
rule is FlashAttention's own test rule, error <= 2 x the error of SDPA's backward in the same dtype
(+ a small floor); ``err_ratio`` = the worst of the three gradients' error over SDPA's.

Writes the rows under "backward" (and "backward_meta") into <out>/<gpu>.json, keeping whatever else
is there (bench.py's forward and decode rows), and <out>/<gpu>_backward.png. ``--sweep`` instead
times fixed tile configurations of the dK/dV and dQ kernels, and atomic vs separate dQ, into
<out>/<gpu>_bwd_sweep.json.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (ERR_FLOOR, RESULTS_DIR, TIMING, bench_ms, gpu_stem, log, results_path, run_meta,  # noqa: E402
                    save_figure, sdpa_backends, subplots, why, within_sdpa_error, write_json, write_section)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

import helpers.kernels.backward as tb  # noqa: E402
from helpers import reference  # noqa: E402
from helpers.results import geomean  # noqa: E402
from helpers.kernels.common import LOG2E  # noqa: E402
from helpers.kernels.forward import flash_attn_triton  # noqa: E402
from helpers.kernels.backward import flash_attention  # noqa: E402

import torch._dynamo  # noqa: E402
import torch._functorch.config  # noqa: E402
torch._functorch.config.donated_buffer = False  # FlexAttention's backward is timed with retain_graph=True
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def cases(quick):
    out = []
    for dtype in ("float16", "bfloat16"):
        for d in (64, 128):
            for causal in (False, True):
                for N in ((1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)):
                    out.append((dtype, d, causal, N, max(1, 32768 // N), 32 if d == 64 else 16))
    return [c for c in out if not quick or c[0] == "bfloat16"]


# ----------------------------------------------------------------------------- precompile


def _warm_one(job):
    """Compile one (kernel, specialisation, config) in a worker process; Triton's disk cache keeps it."""
    kind, dtype, d, causal, atomic, cfg = job
    import helpers.kernels.backward as tbw
    dt = DT[dtype]
    N = 1024
    q, k, v, do, dk, dv = (torch.empty(1, 1, N, d, device="cuda", dtype=dt) for _ in range(6))
    lse2, delta = (torch.empty(1, 1, N, device="cuda", dtype=torch.float32) for _ in range(2))
    bm, bn, w, s = cfg
    meta = dict(HEAD_DIM=d, BLOCK_D=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, EVEN=True)  # N = 1024
    try:
        if kind == "dkdv":
            dq = torch.empty(1, 1, N, d, device="cuda", dtype=torch.float32 if atomic else dt)
            tbw._bwd_dkdv.warmup(q, k, v, do, lse2, delta, dk, dv, dq, N, N, 0, 0.1, 0.1, 1, DQ_ATOMIC=atomic,
                                 grid=(1,), **meta)
        else:
            tbw._bwd_dq.warmup(q, k, v, do, lse2, delta, dk, N, N, 0, 0.1, 0.1, 1, grid=(1,), **meta)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{job}: {why(e, 200)}"


def precompile(jobs):
    import multiprocessing as mp
    t = time.time()
    with mp.get_context("spawn").Pool(min(len(jobs), max(1, (os.cpu_count() or 2) - 1))) as pool:
        errs = [e for e in pool.map(_warm_one, jobs) if e]
    for e in errs:
        log("  precompile failed:", e)
    log(f"  precompiled {len(jobs)} kernels in {time.time() - t:.0f}s")


# ----------------------------------------------------------------------------- correctness


def ref_grads(q, k, v, do, causal, align, sm_scale):
    """float64 autograd (O, dq, dk, dv) for one head q [N, d], k, v [Nk, d] (``helpers.reference.attention_grads``)."""
    mask = reference.causal_mask(q.shape[-2], k.shape[-2], align, device=q.device) if causal else None  # [N, Nk]
    o, _, dq, dk, dv = reference.attention_grads(q, k, v, do, mask=mask, scale=sm_scale)
    return o, dq, dk, dv


def sdpa_grads(q, k, v, do, causal, align):
    """SDPA's own gradients in the inputs' dtype (default dispatch; an explicit mask when bottom-right differs)."""
    a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    N, Nk = q.shape[-2], k.shape[-2]
    if causal and align == "bottom_right" and N != Nk:
        keep = reference.causal_mask(N, Nk, align, device=q.device)  # [N, Nk]
        o = F.scaled_dot_product_attention(*a, attn_mask=keep)
    else:
        o = F.scaled_dot_product_attention(*a, is_causal=causal)
    o.backward(do)
    return [t.grad.nan_to_num() for t in a]  # SDPA gives NaN on rows that see no key; the convention is 0


def check_grads(q, k, v, do, causal, align="top_left"):
    """Gradients of flash_attention vs float64 on the first and last head; SDPA's error as the yardstick."""
    B, H, N, d = q.shape
    a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*a, causal=causal, align=align).backward(do)
    mine = [t.grad for t in a]
    theirs = sdpa_grads(q, k, v, do, causal, align)
    out = {}
    for b, h in {(0, 0), (B - 1, H - 1)}:
        _, *refs = ref_grads(q[b, h], k[b, h], v[b, h], do[b, h], causal, align, 1 / math.sqrt(d))
        for name, m, t, r in zip(("dq", "dk", "dv"), mine, theirs, refs):
            e_m = (m[b, h].double() - r).abs().max().item()
            e_t = (t[b, h].double() - r).abs().max().item()
            out[name] = (max(out.get(name, (0, 0))[0], e_m), max(out.get(name, (0, 0))[1], e_t))
    finite = all(bool(torch.isfinite(m).all()) for m in mine)
    ratio = max(e / max(s, ERR_FLOOR) for e, s in out.values())
    ok = finite and all(within_sdpa_error(e, s) for e, s in out.values())
    return {"pass": ok, "err_ratio": round(ratio, 3),
            "grad_err": {k_: [float(f"{e:.3g}"), float(f"{s:.3g}")] for k_, (e, s) in out.items()}}


def ragged_checks():
    rows = []
    for dtype in ("float16", "bfloat16"):
        for (B, H, N, Nk, d, causal, align) in [
            (2, 3, 1000, 1000, 64, False, "top_left"), (2, 3, 1000, 1000, 128, True, "top_left"),
            (1, 4, 777, 1531, 128, True, "bottom_right"), (1, 4, 1531, 777, 64, True, "bottom_right"),
            (1, 4, 1531, 777, 128, True, "top_left"), (3, 2, 333, 2049, 64, False, "top_left"),
        ]:
            torch.manual_seed(N + Nk + d)
            q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=DT[dtype]) for n in (N, Nk, Nk))
            do = torch.randn_like(q)
            row = {"dtype": dtype, "B": B, "H": H, "N": N, "Nk": Nk, "d": d, "causal": causal, "align": align}
            for mode in ("separate", "atomic"):
                tb.DEFAULT_DQ_MODE, saved = mode, tb.DEFAULT_DQ_MODE
                try:
                    row[mode] = check_grads(q, k, v, do, causal, align)
                except Exception:
                    traceback.print_exc()
                    row[mode] = {"pass": False}
                finally:
                    tb.DEFAULT_DQ_MODE = saved
            log("  ragged", json.dumps(row))
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- timing


_flex = {}


def flex_fn(causal, N):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _flex:
        # static shapes (dynamic=True ran 0.77x slower in the 2026-11-29 run) and room for one compile per shape
        # (the default limit of 8 sent the 9th shape to the unfused eager path)
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        _flex["fn"] = torch.compile(flex_attention, dynamic=False)
    bm = None
    if causal:
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
    return lambda q, k, v: _flex["fn"](q, k, v, block_mask=bm)


def time_backward(fwd, q, k, v, do):
    """ms of o.backward(do) alone (the forward done once, its graph kept)."""
    a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fwd(*a)
    o.backward(do, retain_graph=True)
    torch.cuda.synchronize()
    return bench_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=a)


def sdpa_fwd(backend, causal):
    def fwd(q, k, v):
        with sdpa_kernel(sdpa_backends()[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fwd


def flex_wanted(which, dtype, N):
    """FlexAttention compiles once per shape (static shapes): 'some' = bf16 at N 4096 and 16384 only."""
    return which == "all" or (which == "some" and dtype == "bfloat16" and N in (4096, 16384))


def run(quick, save=None, flex="some"):
    rows = []
    for dtype, d, causal, N, B, H in cases(quick):
        torch.manual_seed(N + d)
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=DT[dtype]) for _ in range(4))
        flops = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
        tf = lambda ms: None if ms is None else round(flops / ms / 1e9, 1)  # noqa: E731
        row = {"dtype": dtype, "d": d, "causal": causal, "N": N, "B": B, "H": H}
        try:
            row.update(check_grads(q, k, v, do, causal))
            row["triton_tflops"] = tf(time_backward(lambda *a: flash_attention(*a, causal=causal), q, k, v, do))
            row["dq_mode"] = tb.DEFAULT_DQ_MODE
            for name, kern in (("dkdv", tb._bwd_dkdv_tuned[tb._d_class(d)]), ("dq", tb._bwd_dq_tuned[tb._d_class(d)])):
                cfg = getattr(kern, "best_config", None)
                row[f"config_{name}"] = str(cfg) if cfg is not None else None
        except Exception:
            traceback.print_exc()
            row.update({"pass": False, "triton_tflops": None})
        for name in ("flash", "cudnn"):
            try:
                row[f"sdpa_{name}_tflops"] = tf(time_backward(sdpa_fwd(name, causal), q, k, v, do))
            except Exception as e:
                log(f"    sdpa {name} refused: {why(e)}")
                row[f"sdpa_{name}_tflops"] = None
        try:
            row["flex_tflops"] = (tf(time_backward(flex_fn(causal, N), q, k, v, do))
                                  if flex_wanted(flex, dtype, N) else None)
        except Exception as e:
            log(f"    flex failed: {why(e, 160)}")
            row["flex_tflops"] = None
        log("  backward", json.dumps(row))
        rows.append(row)
        if save:
            save(rows)
        del q, k, v, do
    return rows


# ----------------------------------------------------------------------------- GQA and head dims (issue 24)


def _group_errors(mine, theirs, q, k, v, do, causal, group):
    """Max error of each gradient on batch 0, KV head 0 and its query group vs float64 autograd (k, v repeated,
    dk, dv summed back), for ours and SDPA's: {name: (ours, SDPA's)}."""
    qs, dos = q[:1, :group].double(), do[:1, :group].double()  # [1, g, N, d]
    ks, vs = (t[:1, :1].double().repeat_interleave(group, dim=1) for t in (k, v))  # [1, g, Nk, d]
    mask = reference.causal_mask(q.shape[-2], k.shape[-2], "top_left", device=q.device) if causal else None
    _, _, *refs = reference.attention_grads(qs, ks, vs, dos, mask=mask, scale=1 / math.sqrt(q.shape[-1]))
    refs = [refs[0][0], refs[1][0].sum(0), refs[2][0].sum(0)]  # dq [g, N, d]; dk, dv [Nk, d]
    out = {}
    for name, m, t, r in zip(("dq", "dk", "dv"), mine, theirs, refs):
        sl = (0, slice(0, group)) if name == "dq" else (0, 0)
        out[name] = ((m[sl].double() - r).abs().max().item(), (t[sl].double() - r).abs().max().item())
    return out


def gqa_rows(quick):
    """The backward with grouped-query attention: ours (dK, dV summed over the group in the kernel) vs SDPA's flash
    backend with enable_gqa=True, and vs our own backward on K, V repeated to H heads (the repeat's backward, a
    sum, included: that is what repeating costs). bf16, d = 128, H = 32, 32768 tokens a batch."""
    rows = []
    for causal in (False, True):
        for N in ((4096,) if quick else (2048, 4096, 16384)):
            for Hkv in (8, 4):
                B, H, d, dt = max(1, 32768 // N), 32, 128, torch.bfloat16
                group = H // Hkv
                torch.manual_seed(N + Hkv)
                q, do = (torch.randn(B, H, N, d, device="cuda", dtype=dt) for _ in range(2))
                k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=dt) for _ in range(2))
                flops = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
                tf = lambda ms: None if ms is None else round(flops / ms / 1e9, 1)  # noqa: E731
                row = {"dtype": "bfloat16", "d": d, "causal": causal, "N": N, "B": B, "H": H, "Hkv": Hkv}

                def ours(q, k, v):
                    return flash_attention(q, k, v, causal=causal)

                def ours_repeated(q, k, v):
                    return flash_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), causal=causal)

                def sdpa_gqa(q, k, v):
                    with sdpa_kernel(sdpa_backends()["flash"]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

                try:
                    grads = []
                    for fn in (ours, sdpa_gqa):
                        a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                        fn(*a).backward(do)
                        grads.append([t.grad for t in a])
                    errs = _group_errors(grads[0], grads[1], q, k, v, do, causal, group)
                    row["pass"] = all(within_sdpa_error(e, s) for e, s in errs.values())
                    row["err_ratio"] = round(max(e / max(s, ERR_FLOOR) for e, s in errs.values()), 3)
                    row["grad_err"] = {n: [float(f"{e:.3g}"), float(f"{s:.3g}")] for n, (e, s) in errs.items()}
                    del grads
                except Exception:
                    traceback.print_exc()
                    row["pass"] = False
                for name, fn in (("triton", ours), ("triton_repeated_kv", ours_repeated), ("sdpa_flash_gqa", sdpa_gqa)):
                    try:
                        row[f"{name}_tflops"] = tf(time_backward(fn, q, k, v, do))
                    except Exception as e:
                        log(f"    {name} refused: {why(e)}")
                        row[f"{name}_tflops"] = None
                t, r, sd = row.get("triton_tflops"), row.get("triton_repeated_kv_tflops"), row.get("sdpa_flash_gqa_tflops")
                row["vs_sdpa"] = round(t / sd, 3) if t and sd else None
                row["vs_repeated"] = round(t / r, 3) if t and r else None
                log("  gqa", json.dumps(row))
                rows.append(row)
                del q, k, v, do
    return rows


def head_dim_rows(quick):
    """Head dims that are not a power of two (80, 96) and 256, next to 64 and 128 (the issue's target: within 0.8x of
    the next power of two's TFLOP/s), ours vs SDPA's flash backward; bf16, H = 16, 32768 tokens a batch."""
    rows = []
    for causal in (False, True):
        for N in ((4096,) if quick else (2048, 8192)):
            for d in (64, 80, 96, 128, 256):
                B, H, dt = max(1, 32768 // N), 16, torch.bfloat16
                torch.manual_seed(N + d)
                q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dt) for _ in range(4))
                flops = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
                tf = lambda ms: None if ms is None else round(flops / ms / 1e9, 1)  # noqa: E731
                row = {"dtype": "bfloat16", "d": d, "causal": causal, "N": N, "B": B, "H": H}
                try:
                    row.update(check_grads(q, k, v, do, causal))
                    row["triton_tflops"] = tf(time_backward(lambda *a: flash_attention(*a, causal=causal), q, k, v, do))
                except Exception:
                    traceback.print_exc()
                    row.update({"pass": False, "triton_tflops": None})
                try:
                    row["sdpa_flash_tflops"] = tf(time_backward(sdpa_fwd("flash", causal), q, k, v, do))
                except Exception as e:
                    log(f"    sdpa flash refused: {why(e)}")
                    row["sdpa_flash_tflops"] = None
                log("  head dim", json.dumps(row))
                rows.append(row)
                del q, k, v, do
    by = {(r["causal"], r["N"], r["d"]): r.get("triton_tflops") for r in rows}
    for r in rows:  # the target: >= 0.8 x the TFLOP/s of the next power of two
        nxt = {80: 128, 96: 128}.get(r["d"])
        base = by.get((r["causal"], r["N"], nxt)) if nxt else None
        r["vs_next_pow2"] = round(r["triton_tflops"] / base, 3) if base and r.get("triton_tflops") else None
    return rows


# ----------------------------------------------------------------------------- sweep


SWEEP_DKDV = [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3),
              (16, 128, 4, 4), (128, 128, 8, 2)]
SWEEP_DQ = [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4), (128, 64, 4, 3)]


def sweep():
    res = []
    jobs = [("dkdv", "bfloat16", d, c, a, cfg) for d in (64, 128) for c in (False, True) for a in (False, True)
            for cfg in SWEEP_DKDV]
    jobs += [("dq", "bfloat16", d, c, False, cfg) for d in (64, 128) for c in (False, True) for cfg in SWEEP_DQ]
    precompile(jobs)
    for d in (64, 128):
        for causal in (False, True):
            for N in (4096, 16384):
                B, H = 32768 // N, (32 if d == 64 else 16)
                torch.manual_seed(0)
                q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                o, lse = flash_attn_triton(q, k, v, causal=causal)
                flops = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
                delta = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
                lse2 = torch.empty_like(delta)
                tb._bwd_preprocess[(triton.cdiv(N, 64), B * H)](o, do, lse, delta, lse2, N, N * d, d, HEAD_DIM=d, BLOCK_M=64, BLOCK_D=d)
                pre_ms = bench_ms(lambda: tb._bwd_preprocess[(triton.cdiv(N, 64), B * H)](
                    o, do, lse, delta, lse2, N, N * d, d, HEAD_DIM=d, BLOCK_M=64, BLOCK_D=d))
                line = {"d": d, "causal": causal, "N": N, "B": B, "H": H, "preprocess_ms": round(pre_ms, 4)}
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                dq = torch.empty_like(q)
                dq32 = torch.zeros(B, H, N, d, device="cuda", dtype=torch.float32)
                sc = 1 / math.sqrt(d)
                for atomic in (False, True):
                    for cfg in SWEEP_DKDV:
                        bm, bn, w, s = cfg
                        tag = f"dkdv{'_atomic' if atomic else ''}_{bm}x{bn}_w{w}_s{s}"
                        try:
                            def go():
                                if atomic:
                                    dq32.zero_()
                                tb._bwd_dkdv[(triton.cdiv(N, bn), B * H)](
                                    q, k, v, do, lse2, delta, dk, dv, dq32 if atomic else dq, N, N, 0, sc * LOG2E.value, sc, 1,
                                    HEAD_DIM=d, BLOCK_D=d, CAUSAL=causal, DQ_ATOMIC=atomic, BLOCK_M=bm, BLOCK_N=bn, EVEN=True,
                                    num_warps=w, num_stages=s)
                            go()
                            line[tag] = round(bench_ms(go), 4)
                        except Exception as e:
                            line[tag] = None
                            log("   ", tag, why(e, 120))
                for cfg in SWEEP_DQ:
                    bm, bn, w, s = cfg
                    tag = f"dq_{bm}x{bn}_w{w}_s{s}"
                    try:
                        def go():
                            tb._bwd_dq[(triton.cdiv(N, bm), B * H)](
                                q, k, v, do, lse2, delta, dq, N, N, 0, sc * LOG2E.value, sc, 1,
                                HEAD_DIM=d, BLOCK_D=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, EVEN=True)
                        go()
                        line[tag] = round(bench_ms(go), 4)
                    except Exception as e:
                        line[tag] = None
                        log("   ", tag, why(e, 120))
                zero_ms = bench_ms(lambda: dq32.zero_())
                line["zero_dq32_ms"] = round(zero_ms, 4)
                for name in ("flash", "cudnn"):
                    ms = time_backward(sdpa_fwd(name, causal), q, k, v, do)
                    line[f"sdpa_{name}_tflops"] = round(flops / ms / 1e9, 1)

                def best(prefix):
                    ks = [kk for kk in line if kk.startswith(prefix + "_") and line[kk]
                          and (prefix != "dkdv" or "atomic" not in kk)]
                    return min(ks, key=lambda kk: line[kk])
                sep = line[best("dkdv")] + line[best("dq")] + pre_ms
                atom = line[best("dkdv_atomic")] + zero_ms + pre_ms
                line["best_separate"] = [best("dkdv"), best("dq"), round(flops / sep / 1e9, 1)]
                line["best_atomic"] = [best("dkdv_atomic"), round(flops / atom / 1e9, 1)]
                log(f"  sweep d={d} causal={causal} N={N}: flash {line['sdpa_flash_tflops']} cudnn "
                    f"{line['sdpa_cudnn_tflops']} separate {line['best_separate']} atomic {line['best_atomic']}")
                res.append(line)
                del q, k, v, do, o, dk, dv, dq, dq32
    return {"dkdv_dq": res, "flex_dynamic_vs_static": flex_static_vs_dynamic()}


def flex_static_vs_dynamic():
    """FlexAttention's backward compiled with dynamic=True (as the bench does) and static, one shape."""
    N, d, B, H = 4096, 128, 8, 16
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 2.5 * 4 * B * H * N * N * d / 2
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
    fx = {}
    for dyn in (True, False):
        fn = torch.compile(flex_attention, dynamic=dyn)
        t = time.time()
        ms = time_backward(lambda a, b_, c: fn(a, b_, c, block_mask=bm), q, k, v, do)
        fx[f"dynamic={dyn}"] = {"tflops": round(flops / ms / 1e9, 1), "compile_and_time_s": round(time.time() - t, 1)}
        torch._dynamo.reset()
    log("  flex bf16 d=128 causal N=4096:", fx)
    return fx


# ----------------------------------------------------------------------------- report


def summary(rows):
    lines = ["backward (TFLOP/s) dtype    d  causal     N   triton  flash  cudnn   flex  t/flash t/cudnn t/flex"
             "  err_ratio ok"]
    for r in rows:
        t, f, c, x = (r.get(k) for k in ("triton_tflops", "sdpa_flash_tflops", "sdpa_cudnn_tflops", "flex_tflops"))
        lines.append(f"  {r['dtype']:>16} {r['d']:>4} {str(r['causal']):>7} {r['N']:>5} {t or 0:>8.0f} {f or 0:>6.0f} "
                     f"{c or 0:>6.0f} {x or 0:>6.0f} {t / f if t and f else 0:>8.2f} {t / c if t and c else 0:>7.2f} "
                     f"{t / x if t and x else 0:>6.2f} {r.get('err_ratio', 0):>10.2f} {'ok' if r.get('pass') else 'FAIL'}")
    big = [r for r in rows if r["N"] >= 2048 and r.get("triton_tflops")]
    for other, target in (("sdpa_flash_tflops", 1.3), ("sdpa_cudnn_tflops", 0.8), ("flex_tflops", 1.0)):
        g = geomean([r["triton_tflops"] / r[other] for r in big if r.get(other)]) or float("nan")
        lines.append(f"  geomean N>=2048 triton / {other[:-7]}: {g:.3f} (target {target})")
    lines.append(f"  backward correctness: {sum(bool(r.get('pass')) for r in rows)}/{len(rows)} pass")
    return "\n".join(lines)


def plot(result, path):
    rows = [r for r in result["backward"] if r["dtype"] == "bfloat16"]
    fig, axes = subplots(1, 4, figsize=(15, 3.8), sharey=True)
    for ax, (d, causal) in zip(axes, ((64, False), (64, True), (128, False), (128, True))):
        sel = sorted((r for r in rows if r["d"] == d and r["causal"] == causal), key=lambda r: r["N"])
        for key, style, label in (("triton_tflops", "-o", "Triton (course)"), ("sdpa_flash_tflops", "--s", "SDPA flash"),
                                  ("sdpa_cudnn_tflops", "--^", "SDPA cuDNN"), ("flex_tflops", ":v", "FlexAttention")):
            pts = [(r["N"], r[key]) for r in sel if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"bf16, d={d}, {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("N")
    axes[0].set_ylabel("TFLOP/s (backward, 2.5 x 4BHN²d)")
    axes[0].legend(fontsize=7)
    meta = result["backward_meta"]
    fig.suptitle(f"backward on {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · {meta['date']}",
                 fontsize=10)
    save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bf16 and three lengths only")
    ap.add_argument("--sweep", action="store_true", help="time fixed configurations instead (writes *_bwd_sweep.json)")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--no-ragged", action="store_true")
    ap.add_argument("--flex-check", action="store_true", help="only FlexAttention dynamic vs static, one shape")
    ap.add_argument("--ragged-only", action="store_true", help="only the ragged correctness checks")
    ap.add_argument("--gqa-head-dims", action="store_true",
                    help="only the GQA rows (vs SDPA enable_gqa and vs repeated K/V) and the d = 80, 96, 256 rows: "
                         "sections backward_gqa and backward_head_dims")
    ap.add_argument("--flex", choices=["all", "some", "none"], default="some",
                    help="which rows time FlexAttention (one compile per shape): some = bf16, N 4096 and 16384")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_bwd.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    stem = gpu_stem(gpu)
    t0 = time.time()
    log(f"{gpu} torch {torch.__version__} triton {triton.__version__}")
    if args.flex_check:
        fx = flex_static_vs_dynamic()
        write_json(os.path.join(args.out, f"{stem}_flex_check.json"), fx)
        return
    if args.sweep:
        res = sweep()
        res.update(run_meta(gpu))
        write_json(os.path.join(args.out, f"{stem}_bwd_sweep.json"), res)
        log(f"sweep done in {time.time() - t0:.0f}s")
        return
    if args.gqa_head_dims:
        path = results_path(gpu, args.out)
        meta = run_meta(gpu, dq_mode=tb.DEFAULT_DQ_MODE,
                        timing=f"o.backward(do) alone, {TIMING}; FLOPs = 2.5 x 4*B*H*N^2*d, halved when causal",
                        rule="each gradient's max error vs float64 autograd <= 2 x SDPA's + 1e-5 (GQA: batch 0, "
                             "KV head 0 and its query group)")
        write_section("backward_gqa", gqa_rows(args.quick), meta, path)
        log(f"gqa rows done at {time.time() - t0:.0f}s")
        write_section("backward_head_dims", head_dim_rows(args.quick), meta, path)
        log(f"done in {time.time() - t0:.0f}s; wrote {path}")
        return
    atomics = (False, True) if not args.no_ragged else (tb.DEFAULT_DQ_MODE == "atomic",)
    jobs = [("dkdv", dt, d, c, a, cfg) for dt in DT for d in (64, 128) for c in (False, True) for a in atomics
            for cfg in tb._DKDV_SHAPES]
    jobs += [("dq", dt, d, c, False, cfg) for dt in DT for d in (64, 128) for c in (False, True)
             for cfg in tb._DQ_SHAPES]
    precompile(jobs)
    if args.ragged_only:
        rag = ragged_checks()
        write_json(os.path.join(args.out, f"{stem}_bwd_ragged.json"), rag)
        log(f"ragged: {sum(r['separate'].get('pass', False) for r in rag)}/{len(rag)} separate, "
            f"{sum(r['atomic'].get('pass', False) for r in rag)}/{len(rag)} atomic pass")
        return
    path = results_path(gpu, args.out)
    meta = run_meta(
        gpu, dq_mode=tb.DEFAULT_DQ_MODE,
        timing=f"o.backward(do) alone, {TIMING}; FLOPs = 2.5 x 4*B*H*N^2*d, halved when causal",
        flex="torch.compile(flex_attention, dynamic=False), recompile limit 256, causal through create_block_mask; "
             f"rows: {args.flex} (some = bf16 at N 4096 and 16384; null elsewhere)",
        rule="each gradient's max error vs float64 autograd (first and last head) <= 2 x SDPA's + 1e-5")
    extra = {}  # measured in this run too; without --no-ragged the file's earlier ragged rows stay
    if not args.no_ragged:
        extra["backward_ragged"] = ragged_checks()
        log(f"ragged checks done at {time.time() - t0:.0f}s")
    result = {}

    def save(rows):  # after every row: a run cut short keeps what it measured
        result.update(write_section("backward", rows, meta, path, extra))

    save(run(args.quick, save, args.flex))
    try:
        plot(result, os.path.join(args.out, f"{stem}_backward.png"))
    except Exception:
        traceback.print_exc()
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")
    rag = result.get("backward_ragged", [])
    if rag:
        log(f"ragged: {sum(r['separate'].get('pass', False) for r in rag)}/{len(rag)} separate, "
            f"{sum(r['atomic'].get('pass', False) for r in rag)}/{len(rag)} atomic pass")
    log(summary(result["backward"]))


if __name__ == "__main__":
    main()
