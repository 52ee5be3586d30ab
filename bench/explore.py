"""Exploration on the GPU: variants of the forward and backward kernels, before any goes into helpers/.

    python3 bench/explore.py [--out DIR] [--budget-s 480] [--only fwd|bwd]

Not part of `make bench`. Each variant is a constexpr switch on one kernel written for square,
block-aligned shapes (N a multiple of 128, top-left causal), so the variants differ in one thing:

  forward  (_fwd_x):  K/V always through TMA descriptors (the committed kernel's default);
                      QO_DESC: Q loaded and O stored through 3-D descriptors too;
                      WS: Triton's automatic warp specialisation on the key loops (tl.range(...,
                      warp_specialize=True)), where this Triton supports it on Hopper.
  dK/dV    (_dkdv_x): QDESC: the streamed q and dO tiles through TMA descriptors; WS as above.
  dQ       (_dq_x):   KDESC: the streamed k and v tiles through TMA descriptors; WS as above.

Each (variant, tile config) is compiled in parallel worker processes first, then timed with
do_bench (median, L2 flushed) on bf16, d 64/128, causal and not, N 4096 and 16384 (B*N = 32k
tokens), beside SDPA's flash and cuDNN backends. Every variant's output is compared with the
committed kernels' before it is timed. Results: <out>/explore_fwd_bwd.json, a table printed last.
Figures and what was kept: bench/NOTES.md.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

LOG2E = 1.4426950408889634
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------- forward variants


@triton.jit
def _fwd_x_loop(acc, l_i, m_i, q, desc_k, desc_v, row0, lo, hi, offs_m, qk_scale,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([row0 + start_n, 0])  # [BLOCK_N, D]
        v = desc_v.load([row0 + start_n, 0])  # [BLOCK_N, D]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        if MASKED:
            keep = (start_n + offs_n)[None, :] <= offs_m[:, None]
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _fwd_x_loop_pipe(acc, l_i, m_i, q, desc_k, desc_v, row0, lo, hi, qk_scale, BLOCK_N: tl.constexpr):
    # The unmasked loop with S = q k^T of tile j+1 issued before the softmax of tile j (FA3's
    # intra-warpgroup overlap, written by hand): the tensor cores work on the next scores while
    # the exp2 of this tile run. Needs hi > lo.
    k = desc_k.load([row0 + lo, 0])
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] scores of tile lo
    for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
        k = desc_k.load([row0 + start_n, 0])
        qk_next = tl.dot(q, tl.trans(k))  # issued now, used next iteration
        v = desc_v.load([row0 + start_n - BLOCK_N, 0])
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
        qk = qk_next
    v = desc_v.load([row0 + hi - BLOCK_N, 0])
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_ij


@triton.jit
def _fwd_x(desc_q, desc_k, desc_v, desc_o, Q, O, LSE, N, qk_scale,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           CAUSAL: tl.constexpr, WS: tl.constexpr, QO_DESC: tl.constexpr, PIPE: tl.constexpr):
    # grid = (N // BLOCK_M, B*H); all of [B*H*N, D] contiguous; N % BLOCK_M == 0, BLOCK_M % BLOCK_N == 0
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (row0 + offs_m).to(tl.int64)
    if QO_DESC:
        q = desc_q.load([off_bh, start_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(Q + q_rows[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if PIPE:
        hi_full = N
        if CAUSAL:
            hi_full = start_m * BLOCK_M
        if hi_full > 0:
            acc, l_i, m_i = _fwd_x_loop_pipe(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, hi_full, qk_scale, BLOCK_N)
        if CAUSAL:
            acc, l_i, m_i = _fwd_x_loop(acc, l_i, m_i, q, desc_k, desc_v, row0, start_m * BLOCK_M,
                                        start_m * BLOCK_M + BLOCK_M, offs_m, qk_scale, BLOCK_N, True, WS)
    elif CAUSAL:
        acc, l_i, m_i = _fwd_x_loop(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, start_m * BLOCK_M, offs_m,
                                    qk_scale, BLOCK_N, False, WS)
        acc, l_i, m_i = _fwd_x_loop(acc, l_i, m_i, q, desc_k, desc_v, row0, start_m * BLOCK_M,
                                    start_m * BLOCK_M + BLOCK_M, offs_m, qk_scale, BLOCK_N, True, WS)
    else:
        acc, l_i, m_i = _fwd_x_loop(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, N, offs_m, qk_scale,
                                    BLOCK_N, False, WS)
    acc = acc / l_i[:, None]
    tl.store(LSE + q_rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
    if QO_DESC:
        desc_o.store([off_bh, start_m * BLOCK_M, 0], acc.to(O.dtype.element_ty).reshape(1, BLOCK_M, HEAD_DIM))
    else:
        tl.store(O + q_rows[:, None] * HEAD_DIM + offs_d[None, :], acc.to(O.dtype.element_ty))


def fwd_x(q, k, v, causal, cfg, ws, qo_desc, pipe=False, warm=False):
    B, H, N, d = q.shape
    bm, bn, w, s = cfg
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    dq_ = TensorDescriptor.from_tensor(q.view(B * H, N, d), [1, bm, d])
    do_ = TensorDescriptor.from_tensor(o.view(B * H, N, d), [1, bm, d])
    dk = TensorDescriptor.from_tensor(k.view(B * H * N, d), [bn, d])
    dv = TensorDescriptor.from_tensor(v.view(B * H * N, d), [bn, d])
    args = (dq_, dk, dv, do_, q, o, lse, N, (1 / math.sqrt(d)) * LOG2E)
    meta = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, QO_DESC=qo_desc,
                PIPE=pipe, num_warps=w, num_stages=s)
    if warm:
        _fwd_x.warmup(*args, grid=(1,), **meta)
        return None
    _fwd_x[(N // bm, B * H)](*args, **meta)
    return o, lse


# ----------------------------------------------------------------------------- backward variants


@triton.jit
def _dkdv_x_loop(dk, dv, k, v, desc_q, desc_do, Q, DO, LSE2, DELTA, row0, lo, hi, offs_n, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr,
                 QDESC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WS):
        rows = start_m + tl.arange(0, BLOCK_M)
        if QDESC:
            q = desc_q.load([row0 + start_m, 0])
            do = desc_do.load([row0 + start_m, 0])
        else:
            ptrs = (row0 + rows).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(Q + ptrs)
            do = tl.load(DO + ptrs)
        lse2 = tl.load(LSE2 + row0 + rows)
        delta = tl.load(DELTA + row0 + rows)
        qkT = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            pT = tl.where(offs_n[:, None] <= rows[None, :], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dkdv_x(desc_q, desc_do, Q, K, V, DO, LSE2, DELTA, DK, DV, N, qk_scale, sm_scale,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            WS: tl.constexpr, QDESC: tl.constexpr):
    # grid = (N // BLOCK_N, B*H); BLOCK_N % BLOCK_M == 0
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv = (row0 + offs_n).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv)
    v = tl.load(V + kv)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        dk, dv = _dkdv_x_loop(dk, dv, k, v, desc_q, desc_do, Q, DO, LSE2, DELTA, row0, start_n, start_n + BLOCK_N,
                              offs_n, qk_scale, HEAD_DIM, BLOCK_M, True, WS, QDESC)
        dk, dv = _dkdv_x_loop(dk, dv, k, v, desc_q, desc_do, Q, DO, LSE2, DELTA, row0, start_n + BLOCK_N, N,
                              offs_n, qk_scale, HEAD_DIM, BLOCK_M, False, WS, QDESC)
    else:
        dk, dv = _dkdv_x_loop(dk, dv, k, v, desc_q, desc_do, Q, DO, LSE2, DELTA, row0, 0, N,
                              offs_n, qk_scale, HEAD_DIM, BLOCK_M, False, WS, QDESC)
    tl.store(DK + kv, (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + kv, dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_x_loop(dq, q, do, lse2, delta, desc_k, desc_v, K, V, row0, lo, hi, offs_m, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr,
               KDESC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        cols = start_n + tl.arange(0, BLOCK_N)
        if KDESC:
            k = desc_k.load([row0 + start_n, 0])
            v = desc_v.load([row0 + start_n, 0])
        else:
            ptrs = (row0 + cols).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
            k = tl.load(K + ptrs)
            v = tl.load(V + ptrs)
        qk = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_x(desc_k, desc_v, Q, K, V, DO, LSE2, DELTA, DQ, N, qk_scale, sm_scale,
          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
          WS: tl.constexpr, KDESC: tl.constexpr):
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    row0 = off_bh * N
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = (row0 + offs_m).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + ptrs)
    do = tl.load(DO + ptrs)
    lse2 = tl.load(LSE2 + row0 + offs_m)
    delta = tl.load(DELTA + row0 + offs_m)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        dq = _dq_x_loop(dq, q, do, lse2, delta, desc_k, desc_v, K, V, row0, 0, start_m * BLOCK_M, offs_m, qk_scale,
                        HEAD_DIM, BLOCK_N, False, WS, KDESC)
        dq = _dq_x_loop(dq, q, do, lse2, delta, desc_k, desc_v, K, V, row0, start_m * BLOCK_M,
                        start_m * BLOCK_M + BLOCK_M, offs_m, qk_scale, HEAD_DIM, BLOCK_N, True, WS, KDESC)
    else:
        dq = _dq_x_loop(dq, q, do, lse2, delta, desc_k, desc_v, K, V, row0, 0, N, offs_m, qk_scale,
                        HEAD_DIM, BLOCK_N, False, WS, KDESC)
    tl.store(DQ + ptrs, (dq * sm_scale).to(DQ.dtype.element_ty))


def bwd_x(q, k, v, do, lse2, delta, causal, dkdv_cfg, dq_cfg, ws, desc, warm=None):
    """(dq, dk, dv) from the variant kernels; lse2/delta from the committed preprocess."""
    B, H, N, d = q.shape
    sc = 1 / math.sqrt(d)
    outs = []
    if dkdv_cfg is not None:
        bm, bn, w, s = dkdv_cfg
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq_ = TensorDescriptor.from_tensor(q.view(B * H * N, d), [bm, d])
        ddo = TensorDescriptor.from_tensor(do.view(B * H * N, d), [bm, d])
        args = (dq_, ddo, q, k, v, do, lse2, delta, dk, dv, N, sc * LOG2E, sc)
        meta = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, QDESC=desc, num_warps=w, num_stages=s)
        if warm:
            _dkdv_x.warmup(*args, grid=(1,), **meta)
        else:
            _dkdv_x[(N // bn, B * H)](*args, **meta)
        outs += [dk, dv]
    if dq_cfg is not None:
        bm, bn, w, s = dq_cfg
        dq = torch.empty_like(q)
        dk_ = TensorDescriptor.from_tensor(k.view(B * H * N, d), [bn, d])
        dv_ = TensorDescriptor.from_tensor(v.view(B * H * N, d), [bn, d])
        args = (dk_, dv_, q, k, v, do, lse2, delta, dq, N, sc * LOG2E, sc)
        meta = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, KDESC=desc, num_warps=w, num_stages=s)
        if warm:
            _dq_x.warmup(*args, grid=(1,), **meta)
        else:
            _dq_x[(N // bm, B * H)](*args, **meta)
        outs.insert(0, dq)
    return outs


# ----------------------------------------------------------------------------- the sweep

FWD_CFGS = {64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)],
            128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)]}
DKDV_CFGS = {64: [(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3)],
             128: [(64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]}
DQ_CFGS = {64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)],
           128: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]}
VARIANTS = [(False, False), (False, True), (True, True)]  # backward: (WS, descriptor)
FWD_VARIANTS = [(False, False, False), (False, False, True), (True, False, True)]  # (WS, Q/O descriptors, PIPE)


def _warm_job(job):
    kind, d, causal, cfg, ws, desc = job
    try:
        N, dt = 1024, torch.bfloat16
        q, k, v, do = (torch.randn(1, 1, N, d, device="cuda", dtype=dt) for _ in range(4))
        lse2, delta = (torch.zeros(1, 1, N, device="cuda") for _ in range(2))
        if kind == "fwd":
            fwd_x(q, k, v, causal, cfg, ws, False, desc, warm=True)
        elif kind == "dkdv":
            bwd_x(q, k, v, do, lse2, delta, causal, cfg, None, ws, desc, warm=True)
        else:
            bwd_x(q, k, v, do, lse2, delta, causal, None, cfg, ws, desc, warm=True)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{job}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def precompile(jobs):
    import multiprocessing as mp
    t = time.time()
    with mp.get_context("spawn").Pool(max(1, min(len(jobs), (os.cpu_count() or 2) - 1))) as pool:
        errs = [e for e in pool.map(_warm_job, jobs) if e]
    for e in errs[:20]:
        log("  compile failed:", e)
    log(f"precompiled {len(jobs)} variants in {time.time() - t:.0f}s, {len(errs)} failed")
    return {e.split(":")[0] for e in errs}


def bench_ms(fn, rep=40):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def sdpa_ms(fwd_only, q, k, v, do, causal, backend):
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    try:
        with sdpa_kernel(be):
            if fwd_only:
                return bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            return bench_ms(lambda: o.backward(do, retain_graph=True), rep=60)
    except Exception as e:  # noqa: BLE001
        log("  sdpa", backend, "refused:", type(e).__name__)
        return None


def tag(cfg, ws, desc):
    bm, bn, w, s = cfg
    return f"{bm}x{bn}w{w}s{s}{'+desc' if desc else ''}{'+ws' if ws else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--only", choices=["fwd", "bwd"], default=None)
    ap.add_argument("--Ns", default="4096,16384")
    ap.add_argument("--ab", action="store_true", help="only the A/B of committed vs specialised vs variant")
    a = ap.parse_args()
    if a.ab:
        os.makedirs(a.out, exist_ok=True)
        return ab(a.out)
    Ns = [int(x) for x in a.Ns.split(",")]
    from helpers.triton_attention import flash_attn_triton
    import helpers.triton_attention_bwd as tb
    kinds = [x for x in ("fwd", "dkdv", "dq") if a.only is None or (a.only == "fwd") == (x == "fwd")]
    cfgs = {"fwd": FWD_CFGS, "dkdv": DKDV_CFGS, "dq": DQ_CFGS}
    jobs = [(kind, d, c, cfg, ws, desc) for kind in kinds for d in (64, 128) for c in (False, True)
            for cfg in cfgs[kind][d] for ws, desc in (VARIANTS if kind != "fwd" else [(w, p) for w, _, p in FWD_VARIANTS])]
    failed = precompile(jobs)
    res = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "date": datetime.date.today().isoformat()}, "rows": []}
    table = []
    for d in (64, 128):
        for causal in (False, True):
            for N in Ns:
                if time.time() - T0 > a.budget_s:
                    log("budget reached: stopping")
                    break
                B, H = 32768 // N, (32 if d == 64 else 16)
                torch.manual_seed(N + d)
                q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                fl = 4 * B * H * N * N * d / (2 if causal else 1)
                row = {"d": d, "causal": causal, "N": N, "B": B, "H": H}
                o_ref, lse_ref = flash_attn_triton(q, k, v, causal=causal)
                if "fwd" in kinds:
                    row["fwd_sdpa_flash"] = fl / sdpa_ms(True, q, k, v, do, causal, "flash") / 1e9
                    c = sdpa_ms(True, q, k, v, do, causal, "cudnn")
                    row["fwd_sdpa_cudnn"] = fl / c / 1e9 if c else None
                    row["fwd_committed"] = fl / bench_ms(lambda: flash_attn_triton(q, k, v, causal=causal)) / 1e9
                    for cfg in FWD_CFGS[d]:
                        for ws, _, desc in FWD_VARIANTS:  # desc here = PIPE (Q/O descriptors lost in run 1)
                            t = "fwd_" + tag(cfg, ws, desc).replace("+desc", "+pipe")
                            if str(("fwd", d, causal, cfg, ws, desc)) in failed:
                                row[t] = None
                                continue
                            try:
                                o, lse = fwd_x(q, k, v, causal, cfg, ws, False, desc)
                                err = (o.float() - o_ref.float()).abs().max().item()
                                if not err < 2e-2:
                                    log("  WRONG", t, err)
                                    row[t] = None
                                    continue
                                row[t] = fl / bench_ms(lambda: fwd_x(q, k, v, causal, cfg, ws, False, desc)) / 1e9
                            except Exception as e:  # noqa: BLE001
                                log("  ", t, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
                                row[t] = None
                if "dkdv" in kinds:
                    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                    from helpers.triton_attention_bwd import flash_attention
                    out = flash_attention(qq, kk, vv, causal=causal)
                    ms = bench_ms(lambda: out.backward(do, retain_graph=True), rep=60)
                    row["bwd_committed"] = 2.5 * fl / ms / 1e9
                    qq.grad = kk.grad = vv.grad = None  # the timing above accumulated into them
                    out.backward(do, retain_graph=True)
                    gref = [x.grad.clone() for x in (qq, kk, vv)]
                    for name in ("flash", "cudnn"):
                        m = sdpa_ms(False, q, k, v, do, causal, name)
                        row[f"bwd_sdpa_{name}"] = 2.5 * fl / m / 1e9 if m else None
                    delta = torch.empty(B, H, N, device="cuda")
                    lse2 = torch.empty_like(delta)
                    pre = lambda: tb._bwd_preprocess[(triton.cdiv(N, 64), B * H)](  # noqa: E731
                        o_ref, do, lse_ref, delta, lse2, N, HEAD_DIM=d, BLOCK_M=64)
                    pre()
                    row["pre_ms"] = bench_ms(pre)
                    for kind, cset in (("dkdv", DKDV_CFGS[d]), ("dq", DQ_CFGS[d])):
                        for cfg in cset:
                            for ws, desc in VARIANTS:
                                t = f"{kind}_" + tag(cfg, ws, desc)
                                if str((kind, d, causal, cfg, ws, desc)) in failed:
                                    row[t] = None
                                    continue
                                args = (q, k, v, do, lse2, delta, causal,
                                        cfg if kind == "dkdv" else None, cfg if kind == "dq" else None, ws, desc)
                                try:
                                    got = bwd_x(*args)
                                    want = gref[1:] if kind == "dkdv" else gref[:1]
                                    err = max((g.float() - w_.float()).abs().max().item() for g, w_ in zip(got, want))
                                    scale = max(w_.float().abs().max().item() for w_ in want)
                                    if not err <= 2e-2 * scale:
                                        log("  WRONG", t, err, scale)
                                        row[t] = None
                                        continue
                                    row[t] = bench_ms(lambda: bwd_x(*args))  # ms
                                except Exception as e:  # noqa: BLE001
                                    log("  ", t, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
                                    row[t] = None

                    def best(prefix, want_ws=None, want_desc=None):
                        ks = [x for x in row if x.startswith(prefix) and row[x]
                              and (want_ws is None or (("+ws" in x) == want_ws))
                              and (want_desc is None or (("+desc" in x) == want_desc))]
                        return min(ks, key=lambda x: row[x]) if ks else None
                    for label, ws, desc in (("plain", False, False), ("desc", False, True), ("desc+ws", True, True),
                                            ("any", None, None)):
                        a1, a2 = best("dkdv_", ws, desc), best("dq_", ws, desc)
                        if a1 and a2:
                            row[f"bwd_best_{label}"] = [a1, a2, 2.5 * fl / (row[a1] + row[a2] + row["pre_ms"]) / 1e9]
                    del qq, kk, vv, out, gref
                res["rows"].append(row)
                log("row", json.dumps({x: (round(y, 4) if isinstance(y, float) else y) for x, y in row.items()}))
                fbest = max([(y, x) for x, y in row.items() if x.startswith("fwd_") and x[4].isdigit() and y],
                            default=(None, None))
                table.append((d, causal, N, row.get("fwd_committed"), fbest, row.get("fwd_sdpa_cudnn"),
                              row.get("bwd_committed"), row.get("bwd_best_any"), row.get("bwd_sdpa_flash"),
                              row.get("bwd_sdpa_cudnn")))
                del q, k, v, do, o_ref, lse_ref
                torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "explore_fwd_bwd.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n d causal     N | fwd committed  best variant                      cudnn | bwd committed  best variant"
          "                          flash  cudnn")
    f1 = lambda x: "  -  " if x is None else f"{x:5.0f}"  # noqa: E731
    for d, c, N, fc, (fb, fbn), fcu, bc, bb, bf, bcu in table:
        bbs = "-" if not bb else f"{bb[0]}|{bb[1]} {bb[2]:.0f}"
        print(f"{d:3d} {str(c):5s} {N:6d} | {f1(fc)} {f1(fb)} {str(fbn)[4:]:26s} {f1(fcu)} | {f1(bc)}  "
              f"{bbs:40s} {f1(bf)} {f1(bcu)}")



# ----------------------------------------------------------------------------- A/B: why the variants beat the committed kernels


def ab(out_dir):
    """Same inputs, same tile configs: the committed backward kernels as committed (N, Nk, diag not
    specialised), the same source with every argument specialised, and the variant kernels above;
    the committed forward autotuned, with a fixed config, and the variant forward."""
    import helpers.triton_attention as ta
    import helpers.triton_attention_bwd as tb
    spec_dkdv = triton.jit(tb._bwd_dkdv.fn)  # the committed source, lengths specialised
    spec_dq = triton.jit(tb._bwd_dq.fn)
    rows = []
    for d, dk_cfg, dq_cfg, f_cfg in ((64, (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 3)),
                                     (128, (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3))):
        for causal in (False, True):
            for N in (4096, 16384):
                B, H = 32768 // N, (32 if d == 64 else 16)
                torch.manual_seed(1)
                q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                fl = 4 * B * H * N * N * d / (2 if causal else 1)
                o, lse = ta.flash_attn_triton(q, k, v, causal=causal)
                delta = torch.empty(B, H, N, device="cuda")
                lse2 = torch.empty_like(delta)
                tb._bwd_preprocess[(triton.cdiv(N, 64), B * H)](o, do, lse, delta, lse2, N, HEAD_DIM=d, BLOCK_M=64)
                sc = 1 / math.sqrt(d)
                dkk, dvv, dqq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
                r = {"d": d, "causal": causal, "N": N}
                bm, bn, w, s = dk_cfg
                for name, kern in (("dkdv_committed", tb._bwd_dkdv), ("dkdv_specialised", spec_dkdv)):
                    fn = lambda kern=kern: kern[(triton.cdiv(N, bn), B * H)](  # noqa: E731
                        q, k, v, do, lse2, delta, dkk, dvv, dqq, N, N, 0, sc * LOG2E, sc, HEAD_DIM=d, BLOCK_M=bm,
                        BLOCK_N=bn, CAUSAL=causal, DQ_ATOMIC=False, num_warps=w, num_stages=s, EVEN=True)
                    fn()
                    r[name] = bench_ms(fn)
                r["dkdv_variant"] = bench_ms(lambda: bwd_x(q, k, v, do, lse2, delta, causal, dk_cfg, None, False, False))
                bm, bn, w, s = dq_cfg
                for name, kern in (("dq_committed", tb._bwd_dq), ("dq_specialised", spec_dq)):
                    fn = lambda kern=kern: kern[(triton.cdiv(N, bm), B * H)](  # noqa: E731
                        q, k, v, do, lse2, delta, dqq, N, N, 0, sc * LOG2E, sc, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                        CAUSAL=causal, num_warps=w, num_stages=s, EVEN=True)
                    fn()
                    r[name] = bench_ms(fn)
                r["dq_variant"] = bench_ms(lambda: bwd_x(q, k, v, do, lse2, delta, causal, None, dq_cfg, False, False))
                qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                from helpers.triton_attention_bwd import flash_attention
                out = flash_attention(qq, kk, vv, causal=causal)
                r["autograd_total"] = bench_ms(lambda: out.backward(do, retain_graph=True), rep=60)
                r["bwd_config_chosen"] = [str(getattr(tb._bwd_dkdv_tuned, "best_config", None)),
                                          str(getattr(tb._bwd_dq_tuned, "best_config", None))]
                r["fwd_autotuned"] = fl / bench_ms(lambda: ta.flash_attn_triton(q, k, v, causal=causal)) / 1e9
                r["fwd_config_chosen"] = str(getattr(ta._attn_fwd_tuned, "best_config", None))
                fb, fn_, fw, fs = f_cfg
                r["fwd_fixed"] = fl / bench_ms(lambda: ta.flash_attn_triton(
                    q, k, v, causal=causal, config=dict(BLOCK_M=fb, BLOCK_N=fn_, num_warps=fw, num_stages=fs))) / 1e9
                r["fwd_variant"] = fl / bench_ms(lambda: fwd_x(q, k, v, causal, f_cfg, False, False)) / 1e9
                log("ab", json.dumps({x: (round(y, 3) if isinstance(y, float) else y) for x, y in r.items()}))
                rows.append(r)
                del q, k, v, do, o, lse, qq, kk, vv, out
    with open(os.path.join(out_dir, "explore_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n d causal     N | dkdv ms: committed  specialised  variant | dq ms: committed  specialised  variant"
          " | autograd ms | fwd TF/s: autotuned fixed variant")
    for r in rows:
        print(f"{r['d']:3d} {str(r['causal']):5s} {r['N']:6d} | {r['dkdv_committed']:8.3f} {r['dkdv_specialised']:8.3f} "
              f"{r['dkdv_variant']:8.3f} | {r['dq_committed']:8.3f} {r['dq_specialised']:8.3f} {r['dq_variant']:8.3f} | "
              f"{r['autograd_total']:8.3f} | {r['fwd_autotuned']:5.0f} {r['fwd_fixed']:5.0f} {r['fwd_variant']:5.0f}")
        print("      chosen:", r["bwd_config_chosen"], r["fwd_config_chosen"])


if __name__ == "__main__":
    main()
