"""Ring attention over NCCL on two GPUs (lesson 09): correctness, time per step and end to end.

    torchrun --nproc_per_node 2 bench/ring_gpu.py --out bench/results/ring_h200x2.json
    python bench/ring_gpu.py --cpu --out /tmp/ring.json          # gloo, 2 CPU processes, tiny N

Per chunk: ``helpers.kernels.forward.flash_attn_triton(q, k, v, causal, align="top_left")`` on
CUDA (it returns the natural-log LSE), a float32 torch fallback on the CPU. The ring is the
notebook's: K/V passed to rank + 1 with ``dist.batch_isend_irecv``; "overlap" posts the transfer
before the chunk's attention and waits after it, "no overlap" waits first. Causal uses the
zigzag layout (rank r holds chunks r and 2P-1-r), where step 0 is one causal block and every
later step is one full block of half the size. Merge: lesson 06's, in float32.

What it measures (each on fresh random inputs, B=1, d=128, bf16):
1. correctness: the ring's O against one GPU running the same kernel on the whole sequence
   (max abs error), for each layout;
2. per N (64k..512k) and layout: end-to-end ms per call (CUDA events, median of REPS after
   WARMUP), with and without overlap; the per-step compute time and transfer time measured
   alone (the transfer: one K/V chunk with batch_isend_irecv); peak memory per GPU;
3. the single-GPU time of the same kernel on the whole sequence where it fits (else why not).

Prints a short table last and writes JSON: {"meta": {...}, "ring": [rows]}, each row
{"world","N","B","H","d","dtype","layout","ms","single_gpu_ms","speedup","overlap",...}.
Budget: it stops starting new sizes after --budget-s seconds (default 400) so it finishes < 8 min.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import log as _log, run_meta, write_json  # noqa: E402


# ----------------------------------------------------------------------------- per-chunk kernel
def _torch_chunk(q, k, v, causal=False):
    """(O, lse) in float32 on any device: the fallback for --cpu (and a reference)."""
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])   # [B, H, nq, nk]
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return (torch.exp(s - safe[..., None]) @ v.float()).to(q.dtype), lse


def chunk_kernel():
    if torch.cuda.is_available():
        from helpers.kernels.forward import flash_attn_triton

        def triton_chunk(q, k, v, causal=False):
            return flash_attn_triton(q, k, v, causal=causal, align="top_left")
        return triton_chunk
    return _torch_chunk


def merge(o, lse, o_s, lse_s):
    """Lesson 06's merge in float32; writes into o (fp32 accumulator) and returns lse."""
    new = torch.logaddexp(lse, lse_s)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    o.mul_(torch.exp(lse - safe)[..., None]).add_(torch.exp(lse_s - safe)[..., None] * o_s.float())
    return new


# ----------------------------------------------------------------------------- the ring
def ring_forward(q, k, v, causal, layout, attn, overlap=True, step_times=None):
    """This rank's (O, lse). step_times: a list to append (start, end) CUDA events per step."""
    rank, P = dist.get_rank(), dist.get_world_size()
    B, H, n, d = q.shape
    half = n // 2
    o = torch.zeros(B, H, n, d, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, n), -math.inf, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k, v
    for t in range(P):
        reqs = None
        if t < P - 1:
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, k_cur, (rank + 1) % P), dist.P2POp(dist.isend, v_cur, (rank + 1) % P),
                dist.P2POp(dist.irecv, k_next, (rank - 1) % P), dist.P2POp(dist.irecv, v_next, (rank - 1) % P)])
            if not overlap:
                for r in reqs:
                    r.wait()
                reqs = None
        ev = None
        if step_times is not None and q.is_cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        src = (rank - t) % P
        rows, part = slice(None), None
        if not causal:
            part = attn(q, k_cur, v_cur)
        elif src == rank:
            part = attn(q, k_cur, v_cur, causal=True)
        elif layout == "contiguous":
            if src < rank:
                part = attn(q, k_cur, v_cur)
        elif src < rank:
            part = attn(q, k_cur[:, :, :half].contiguous(), v_cur[:, :, :half].contiguous())
        else:
            rows = slice(half, None)
            part = attn(q[:, :, half:].contiguous(), k_cur, v_cur)
        if part is not None:
            if rows == slice(None):
                lse = merge(o, lse, *part)
            else:
                o_r = o[:, :, rows].clone()
                lse_r = merge(o_r, lse[:, :, rows], *part)
                o[:, :, rows], lse[:, :, rows] = o_r, lse_r
        if ev is not None:
            ev[1].record()
            step_times.append(ev)
        if reqs is not None:
            for r in reqs:
                r.wait()
        if t < P - 1:
            k_cur, v_cur = k_next, v_next
    return o.to(q.dtype), lse


def shard(x, P, rank, layout):
    if layout == "contiguous":
        return x.chunk(P, dim=2)[rank].contiguous()
    pieces = x.chunk(2 * P, dim=2)
    return torch.cat([pieces[rank], pieces[2 * P - 1 - rank]], dim=2).contiguous()


# ----------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup, reps):
    """Median wall ms per call, all ranks in step (barrier before each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)                          # the slowest rank sets the pace
    return float(t.median())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes, tiny N, torch chunk kernel")
    ap.add_argument("--Ns", default=None, help="comma-separated sequence lengths (default 64k..512k; --cpu: 256,512)")
    ap.add_argument("--H", type=int, default=None, help="heads (default 32; --cpu: 2)")
    ap.add_argument("--d", type=int, default=None, help="head dim (default 128; --cpu: 16)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no new size after this many seconds")
    ap.add_argument("--world", type=int, default=2, help="--cpu without torchrun: processes to spawn")
    a = ap.parse_args()
    if "RANK" in os.environ:
        run(a)
    else:  # no torchrun: spawn the ranks ourselves
        import torch.multiprocessing as mp
        port = _free_port()
        mp.spawn(_spawned, args=(a, port), nprocs=a.world, join=True)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, a, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(a.world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(a)


def run(a):
    t_begin = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.cpu
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300),
                            **({"device_id": device} if cuda else {}))
    rank, P = dist.get_rank(), dist.get_world_size()
    attn = chunk_kernel() if cuda else _torch_chunk
    dtype = torch.bfloat16 if cuda else torch.float32
    H = a.H or (32 if cuda else 2)
    d = a.d or (128 if cuda else 16)
    Ns = [int(x) for x in a.Ns.split(",")] if a.Ns else ([65536, 131072, 262144, 524288] if cuda else [256, 512])
    warmup, reps = (2, a.reps or 5) if cuda else (1, a.reps or 3)
    B = 1
    log = _log if rank == 0 else (lambda *x: None)
    log(f"world {P}, {'NCCL on ' + torch.cuda.get_device_name(device) if cuda else 'gloo on CPU'}, "
        f"torch {torch.__version__}, B={B} H={H} d={d} {str(dtype).replace('torch.', '')}")

    # ---- 1. correctness vs one GPU (rank 0 computes the whole sequence with the same kernel)
    checks = []
    Nc = 16384 if cuda else 128
    g = torch.Generator(device="cpu").manual_seed(0)
    qf, kf, vf = (torch.randn(B, H, Nc, d, generator=g).to(device, dtype) for _ in range(3))
    for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
        o, lse = ring_forward(*(shard(x, P, rank, layout) for x in (qf, kf, vf)), causal, layout, attn)
        o_ref, lse_ref = attn(qf, kf, vf, causal=causal)
        err_o = (o.float() - shard(o_ref, P, rank, layout).float()).abs().max()
        err_l = (lse - shard(lse_ref[..., None], P, rank, layout)[..., 0]).abs().max()
        errs = torch.stack([err_o, err_l]).to(device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        checks.append({"N": Nc, "causal": causal, "layout": layout, "max_abs_err_O": float(errs[0]),
                       "max_abs_err_lse": float(errs[1])})
        log(f"check N={Nc} causal={causal} {layout}: max |O - one GPU| {float(errs[0]):.2e}, "
            f"max |lse - one GPU| {float(errs[1]):.2e}")
    del qf, kf, vf

    # ---- 2. per N: ring with / without overlap, per-step compute and transfer, memory; 3. single GPU
    rows, skipped = [], []
    for N in Ns:
        if time.perf_counter() - t_begin > a.budget_s:
            skipped.append(N)
            continue
        n = N // P
        for causal, layout in ((False, "contiguous"), (True, "zigzag")):
            gq = torch.Generator(device="cpu").manual_seed(N)
            q, k, v = (torch.randn(B, H, n, d, generator=gq).to(device, dtype) for _ in range(3))
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            w_n, r_n = (1, min(reps, 3)) if N >= 524288 else (warmup, reps)   # 512k: seconds per call
            res = {}
            for overlap in (True, False):
                res[overlap] = time_ms(lambda: ring_forward(q, k, v, causal, layout, attn, overlap=overlap),
                                       device, w_n, r_n)
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
            # per-step compute alone: one step's attention with the chunk in hand (step 0 and step 1)
            steps = []
            ring_forward(q, k, v, causal, layout, attn, overlap=True, step_times=steps)
            sync(device)
            step_ms = [round(s.elapsed_time(e), 3) for s, e in steps] if cuda else []
            # transfer alone: one K/V chunk each way with batch_isend_irecv
            kn, vn = torch.empty_like(k), torch.empty_like(v)

            def xfer():
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, k, (rank + 1) % P),
                                                 dist.P2POp(dist.isend, v, (rank + 1) % P),
                                                 dist.P2POp(dist.irecv, kn, (rank - 1) % P),
                                                 dist.P2POp(dist.irecv, vn, (rank - 1) % P)]):
                    w.wait()
            xfer_ms = time_ms(xfer, device, w_n, r_n)
            del kn, vn, q, k, v
            # single device, same kernel, whole sequence (rank 0 alone; others wait at the barrier)
            single, why = None, ""
            if rank == 0:
                try:
                    gs = torch.Generator(device="cpu").manual_seed(N)
                    qs, ks, vs = (torch.randn(B, H, N, d, generator=gs).to(device, dtype) for _ in range(3))
                    for _ in range(w_n):
                        attn(qs, ks, vs, causal=causal)
                    ts = []
                    for _ in range(r_n):
                        sync(device)
                        t0 = time.perf_counter()
                        attn(qs, ks, vs, causal=causal)
                        sync(device)
                        ts.append((time.perf_counter() - t0) * 1e3)
                    single = sorted(ts)[len(ts) // 2]
                    del qs, ks, vs
                except torch.cuda.OutOfMemoryError as e:  # the whole sequence does not fit
                    why = f"out of memory: {str(e).splitlines()[0][:120]}"
                    torch.cuda.empty_cache()
            obj = [single, why]
            dist.broadcast_object_list(obj, src=0)
            single, why = obj
            for overlap in (True, False):
                row = {"world": P, "N": N, "B": B, "H": H, "d": d, "dtype": str(dtype).replace("torch.", ""),
                       "layout": layout, "causal": causal, "ms": round(res[overlap], 3),
                       "single_gpu_ms": round(single, 3) if single else None,
                       "speedup": round(single / res[overlap], 3) if single else None, "overlap": overlap,
                       "step_ms": step_ms if overlap else None, "transfer_ms": round(xfer_ms, 3),
                       "peak_mem_gib": round(mem, 2) if mem is not None else None,
                       "single_gpu_note": why or None}
                rows.append(row)
            log(f"N={N:>7d} {layout:10s} causal={causal!s:5s}: ring {res[True]:9.2f} ms (no overlap "
                f"{res[False]:9.2f}), steps {step_ms} ms, transfer {xfer_ms:.2f} ms, single "
                f"{'%.2f ms' % single if single else why or 'n/a'}, mem {mem if mem is None else round(mem, 1)} GiB")
            if cuda:
                torch.cuda.empty_cache()

    if rank == 0:
        meta = {"gpus": P, **run_meta(torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"),
                "backend": "nccl" if cuda else "gloo", "kernel": "flash_attn_triton" if cuda else "torch fallback",
                "timing": f"median of {reps} calls after {warmup} warm-up (N >= 512k: 3 after 1), wall clock, "
                          "slowest rank",
                "checks": checks, "skipped_for_time": skipped, "seconds": round(time.perf_counter() - t_begin, 1)}
        write_json(a.out, {"meta": meta, "ring": rows})
        print(f"\n{'layout':10s} {'overlap':>7s} {'N':>7s} {'ring ms':>9s} {'1-GPU ms':>9s} {'speedup':>8s} {'GiB':>6s}")
        for r in rows:
            print(f"{r['layout']:10s} {str(r['overlap']):>7s} {r['N']:>7d} {r['ms']:>9.2f} "
                  f"{(r['single_gpu_ms'] or float('nan')):>9.2f} {(r['speedup'] or float('nan')):>8.2f} "
                  f"{(r['peak_mem_gib'] or float('nan')):>6.1f}")
        print(f"wrote {a.out} in {meta['seconds']} s" + (f"; skipped for time: {skipped}" if skipped else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
