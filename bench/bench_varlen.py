"""`make bench`, the "varlen" and "packed_documents" rows: packed variable-length attention on one GPU.

    python3 bench/bench_varlen.py [--out FILE] [--quick] [--packed | --serving] [--budget S] [--first I,J,..]
                                  [--tune-dense] [--smoke] [--host] [--report JSON [--train JSON]]

**packed_documents** (``--packed`` alone): pre-training's packed rows, documents causal within themselves, bf16,
H = 16 with Hkv = 4 (and one MHA row), forward and backward, three ways in one run:

* the course: ``flash_attention_varlen(q, k, v, batch, causal=True)`` on ``batch = prepare_varlen(cu_seqlens)``,
  made once per batch and not timed (a training step makes it once for every layer): q ``[T, H, d]``, k, v
  ``[T, Hkv, d]``;
* FlexAttention with a document mask, ``torch.compile(flex_attention, dynamic=False)``, its block mask from
  ``create_block_mask`` (128 x 128) built once and not timed, ``enable_gqa=True``, q ``[1, H, T, d]``;
* SDPA with the dense boolean document mask ``[T, T]`` (K and V repeated to H heads beforehand), the default
  dispatch (a mask rules out the flash backend); T <= 16384 only (it computes every pair).

Mixes (seeded): lognormal lengths of medians 32 to 1024 (sigma 1, as bench/train_llama.py's), 16 documents of
random length, equal lengths, a few long documents among many short ones, one document longer than all the others
together; T from 4096 to 32768, d 64 and 128. The table's first rows are the priorities: a time budget stops
starting new rows (they are listed as skipped). Every row is checked against float64 first, on its first, last
and longest documents (the forward's O and lse; dq, dk, dv by the closed-form backward): each error at most twice
SDPA's on the same document in bf16, plus 1e-5 (FlashAttention's rule); a row that fails is recorded, not timed.
Timing: bench/common.py's policy (do_bench median, L2 flushed); the backward alone (``o.backward(do)``, the
forward's graph kept). Rows ``{mix, T, d, H, Hkv, causal, fwd_course_ms, fwd_flex_ms, bwd_course_ms, bwd_flex_ms,
pass}`` plus SDPA's times and the lengths; the checks, the tiles chosen and the forward's CUDA-graph time in
``packed_documents_meta["details"]``. Written after every row.

**varlen** (``--serving`` alone): serving's packed prefill. For each length mix (uniform 512-8k, long-tailed:
many 128-1k plus a few 8k-16k, equal lengths; 32k tokens in all, seeded), bf16 and fp16, d = 64 (H = 32) and
d = 128 (H = 16), causal and not, Hkv = H and, on the uniform mix, Hkv = H / 4, three ways of doing the same
attention:

* ``flash_attn_varlen_triton`` on a prepared batch (helpers/kernels/varlen.py's ``prepare_varlen``, made
  once); the library's unchecked form (``validate=False``: nothing read back, lesson 10's map built in every
  call on the device) in the row's details;
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
mask), max error at most twice SDPA's own in the same dtype, plus 1e-5. Merges its rows into FILE (default
bench/results/<gpu>.json) under "varlen" and "varlen_meta" (and "packed_documents", "packed_documents_meta"),
leaving every other key as it was; prints a short table last.

--smoke: tiny sizes, fp32 under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set here when there
is no GPU; FlexAttention eager): the script's own test, not a measurement.
"""

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (TIMING, bench_ms, graph_ms, log, results_path, run_meta, sdpa_ms, why,  # noqa: E402
                    within_sdpa_error, write_section)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from helpers.kernels.forward import flash_attn_triton  # noqa: E402
from helpers.kernels.varlen import (chosen_configs, flash_attn_varlen_triton, prepare_varlen,  # noqa: E402
                                    rejected_configs)
from helpers.kernels.varlen_backward import flash_attention_varlen  # noqa: E402

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The dense kernel's autotuner chose these on the H200 for N >= 2048 in nearly every row of
# bench/results/h200.json (prefill); fixed here to keep the script's compile time inside its budget.
DENSE_CONFIG = {64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)}
BUDGET_S = 220  # serving rows: stop starting new ones after this
PACKED_BUDGET_S = 420  # packed rows: the same (with --quick, a third of it)


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

    batch = prepare_varlen(cu_list, device=device)  # checked once, as a server does per batch

    def varlen():
        return flash_attn_varlen_triton(q, k, v, batch, causal=causal)

    t_first = time.perf_counter()
    o, _ = varlen()
    t_first = (time.perf_counter() - t_first) * 1e3
    ok, err, sdpa_err = check(q, k, v, cu_list, lens, causal, o)
    row["err_ratio"] = round(err / max(sdpa_err, 1e-12), 3)
    detail.update({"pass": ok, "err": err, "sdpa_err": sdpa_err})
    del o
    ms = t_first if smoke else bench_ms(varlen)  # smoke: the interpreter is slow, one call is enough
    row["triton_tflops"] = round(flops / ms / 1e9, 1)
    if not smoke:  # the library's unchecked form: nothing read back, lesson 10's map built on the device per call
        ms = bench_ms(lambda: flash_attn_varlen_triton(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                       validate=False))
        detail["triton_unprepared_tflops"] = round(flops / ms / 1e9, 1)

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
    for r in rows:  # pass: the course's check against float64
        tv, td, ts = r.get("triton_tflops"), r.get("dense_triton_tflops"), r.get("sdpa_padded_tflops")
        lines.append(
            f"{r['dtype']:9} {r['d']:>4} {str(r['causal']):>6} {r['H']:>3}/{r['Hkv']:<2} {r['mix']:12} "
            f"{tv if tv is not None else '-':>7} {td if td is not None else '-':>7} {ts if ts is not None else '-':>8} "
            f"{(f'{tv / td:.2f}' if tv and td else '-'):>7} {(f'{tv / ts:.2f}' if tv and ts else '-'):>7} "
            f"{r.get('err_ratio', '-'):>8}")
    return "\n".join(lines) + "\n(TFLOP/s of useful work; v/dense, v/sdpa: the varlen kernel's ratios)"


def serving_section(args, device, gpu, path):
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
        if device == "cuda":
            torch.cuda.empty_cache()
    meta = {
        **run_meta(gpu),
        "timing": TIMING,
        "flops": "useful only: 4*H*d*visible (query, key) pairs summed over real sequences (causal: n(n+1)/2)",
        "varlen": "flash_attn_varlen_triton on a prepare_varlen batch (made once, not timed; tiles chosen on the "
                  "first call); details: triton_unprepared_tflops, the library's unchecked form (validate=False, "
                  "lesson 10's map built on the device in every call)",
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


# ----------------------------------------------------------------------------- packed documents (pre-training)


def doc_lengths(mix, T, rng, scale=1):
    """Document lengths summing to T for a named mix (seeded by rng; scale divides the lengths, for --smoke)."""
    def lognormal(median):
        lens = []
        while sum(lens) < T:
            lens.append(max(1, int(math.exp(math.log(median / scale) + rng.gauss(0.0, 1.0)))))
        lens[-1] -= sum(lens) - T  # the row's last document is cut
        return [n for n in lens if n > 0]

    if mix.startswith("lognormal "):
        return lognormal(int(mix.split()[1]))
    if mix.endswith(" random"):  # n documents at random cuts of the row
        n = int(mix.split()[0])
        cuts = sorted(rng.sample(range(1, T), n - 1))
        return [b - a for a, b in zip([0] + cuts, cuts + [T])]
    if " x " in mix:  # n equal lengths L (not scaled)
        n, L = (int(x) for x in mix.split(" x "))
        assert n * L == T, (mix, T)
        return [L] * n
    if mix == "few long, many short":  # two long documents among many of 16 to 256 tokens
        lens = [3 * T // 8, 3 * T // 8]
        while sum(lens) < T:
            lens.append(rng.randint(max(1, 16 // scale), max(1, 256 // scale)))
        lens[-1] -= sum(lens) - T
        rng.shuffle(lens)
        return [n for n in lens if n > 0]
    if mix == "one longer than the rest":  # 60% of the row in one document, the rest lognormal around 64
        long = 3 * T // 5
        rest = []
        while sum(rest) < T - long:
            rest.append(max(1, int(math.exp(math.log(64 / scale) + rng.gauss(0.0, 1.0)))))
        rest[-1] -= sum(rest) - (T - long)
        rest = [n for n in rest if n > 0]
        at = rng.randint(0, len(rest))
        return rest[:at] + [long] + rest[at:]
    raise ValueError(f"unknown mix {mix!r}")


def packed_cases(quick, smoke):
    """[(mix, T, d, Hkv, causal)] in priority order (H = 16): the first ones are what the targets are about."""
    if smoke:
        return [("lognormal 256", 64, 16, 1, True), ("one longer than the rest", 64, 16, 2, True),
                ("2 x 32", 64, 16, 1, False)]
    first = [(m, 16384, 128, 4, True) for m in ("lognormal 256", "16 random", "4 x 4096", "one longer than the rest")]
    if quick:
        return first
    more = [(m, 16384, 128, 4, True) for m in ("lognormal 64", "lognormal 1024", "few long, many short",
                                               "lognormal 32")]
    return first + more + [("lognormal 256", 4096, 128, 4, True), ("lognormal 1024", 32768, 128, 4, True),
                           ("8 x 4096", 32768, 128, 4, True), ("lognormal 256", 16384, 64, 4, True),
                           ("4 x 4096", 16384, 64, 4, True), ("lognormal 256", 16384, 128, 16, True),
                           ("lognormal 256", 16384, 128, 4, False), ("4 x 4096", 16384, 128, 4, False)]


def _document_mask_mods():
    """FlexAttention's document masks, causal and not, reading the document ids from ``holder[0]`` ([T] int32): one
    mask_mod function for every row, so that a new batch of the same T is no new compile (dynamo guards the
    tensor's shape, not its values; a closure, so that dynamo reaches it through the function however this
    script was loaded)."""
    holder = [None]

    def causal(b, h, q_idx, kv_idx):
        doc = holder[0]
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    def full(b, h, q_idx, kv_idx):
        doc = holder[0]
        return doc[q_idx] == doc[kv_idx]

    return holder, causal, full


_DOC_IDS, _doc_causal, _doc_full = _document_mask_mods()


def _reference_doc(q, k, v, do, causal):
    """float64 (O [n, H, d], lse [H, n], dq, dk [n, Hkv, d], dv) of one document, head by head, by the closed
    form: P = softmax(S), dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K s, dK = dS^T Q s, dV = P^T dO."""
    n, H, d = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    scale = 1.0 / math.sqrt(d)
    o = torch.empty(n, H, d, dtype=torch.float64, device=q.device)
    lse = torch.empty(H, n, dtype=torch.float64, device=q.device)
    dq = torch.empty_like(o)
    dk = torch.zeros(n, Hkv, d, dtype=torch.float64, device=q.device)
    dv = torch.zeros_like(dk)
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        keep = torch.tril(keep)
    for h in range(H):
        qh, kh, vh, doh = q[:, h].double(), k[:, h // g].double(), v[:, h // g].double(), do[:, h].double()
        s = (qh @ kh.T * scale).masked_fill(~keep, float("-inf"))  # [n, n]
        lse[h] = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[h][:, None])  # [n, n]
        o[:, h] = p @ vh
        dp = doh @ vh.T  # [n, n]
        ds = p * (dp - (doh * o[:, h]).sum(-1, keepdim=True))
        dq[:, h] = ds @ kh * scale
        dk[:, h // g] += ds.T @ qh * scale
        dv[:, h // g] += p.T @ doh
    return o, lse, dq, dk, dv


def _sdpa_doc(q, k, v, do, causal):
    """SDPA in the inputs' dtype on one document, K and V repeated to the query heads: (O, dq, dk, dv), the
    gradients of K and V summed back over each group in float32."""
    n, H, d = q.shape
    g = H // k.shape[1]
    qq, kk, vv = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))  # [1, heads, n, d]
    o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), is_causal=causal)
    o.backward(do.transpose(0, 1)[None])
    back = lambda t: t.grad[0].transpose(0, 1)  # noqa: E731
    return o[0].transpose(0, 1).detach(), back(qq), back(kk), back(vv)


def check_packed(q, k, v, do, lens, causal, o, lse, grads):
    """Errors of the course's O, lse and gradients against float64 on the first, last and longest documents,
    beside SDPA's on the same documents in the same dtype; pass: each within 2x SDPA's + 1e-5 (lse within 5e-3)."""
    B = len(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    picks = sorted({0, B - 1, max(range(B), key=lens.__getitem__)})
    err = {name: [0.0, 0.0] for name in ("o", "dq", "dk", "dv")}  # [course, sdpa]
    lse_err = 0.0
    for b in picks:
        r = slice(cu[b], cu[b + 1])
        ref = _reference_doc(q[r], k[r], v[r], do[r], causal)
        mine = (o[r], grads[0][r], grads[1][r], grads[2][r])
        theirs = _sdpa_doc(q[r], k[r], v[r], do[r], causal)
        for name, want, a, b_ in zip(("o", "dq", "dk", "dv"), (ref[0], ref[2], ref[3], ref[4]), mine, theirs):
            err[name][0] = max(err[name][0], (a.double() - want).abs().max().item())
            err[name][1] = max(err[name][1], (b_.double() - want).abs().max().item())
        lse_err = max(lse_err, (lse[:, r].double() - ref[1]).abs().max().item())
    finite = all(bool(torch.isfinite(t).all()) for t in (o, lse, *grads))
    ok = finite and lse_err < 5e-3 and all(within_sdpa_error(a, b) for a, b in err.values())
    return {"pass": ok, "lse_err": lse_err, **{f"{n}_err": [float(f"{a:.3g}"), float(f"{b:.3g}")]
                                              for n, (a, b) in err.items()}, "checked_docs": picks}


def run_packed_row(mix, T, d, Hkv, causal, flex, create_block_mask, device, smoke):
    H = 2 if smoke else 16
    dt = torch.float32 if smoke else torch.bfloat16
    rng = random.Random(f"{mix}-{T}")
    lens = doc_lengths(mix, T, rng, scale=128 if smoke else 1)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    g = torch.Generator(device=device).manual_seed(len(lens) * 1000 + d)
    q = torch.randn(T, H, d, device=device, dtype=dt, generator=g)  # [T, H, d]
    k = torch.randn(T, Hkv, d, device=device, dtype=dt, generator=g)  # [T, Hkv, d]
    v = torch.randn(T, Hkv, d, device=device, dtype=dt, generator=g)
    do = torch.randn(T, H, d, device=device, dtype=dt, generator=g)
    row = {"mix": mix, "T": T, "d": d, "H": H, "Hkv": Hkv, "causal": causal,
           "lengths": lens if len(lens) <= 16 else summary(lens)}
    detail = {"mix": mix, "T": T, "d": d, "Hkv": Hkv, "causal": causal}

    # the course: the batch made once (not timed), the library's layout
    batch = prepare_varlen(cu, device=device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_c = flash_attention_varlen(*leaves, batch, causal=causal)
    o_c.backward(do, retain_graph=True)
    grads = [t.grad.detach().clone() for t in leaves]
    _, lse = flash_attn_varlen_triton(q, k, v, batch, causal=causal)
    detail.update(check_packed(q, k, v, do, lens, causal, o_c.detach(), lse, grads))
    row["pass"] = detail["pass"]

    # FlexAttention: the block mask built once (not timed), compiled
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))  # [T]
    _DOC_IDS[0] = doc.to(torch.int32)
    mask_mod = _doc_causal if causal else _doc_full
    bm = create_block_mask(mask_mod, 1, None, T, T, device=device, BLOCK_SIZE=128)
    q4, k4, v4, do4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v, do))  # [1, heads, T, d]
    fl = [t.detach().clone().requires_grad_(not smoke) for t in (q4, k4, v4)]  # no Flex backward on a CPU
    o_f = flex(*fl, block_mask=bm, enable_gqa=True)
    detail["flex_vs_course_max_diff"] = float(f"{(o_f[0].transpose(0, 1).float() - o_c.float()).abs().max():.3g}")
    detail["flex_agrees"] = detail["flex_vs_course_max_diff"] < (1e-4 if smoke else 0.1)  # a stale mask: O(1) apart
    if not detail["flex_agrees"]:
        log(f"  FlexAttention's O differs from the course's by {detail['flex_vs_course_max_diff']}: its mask?")
    for key in ("fwd_course_ms", "fwd_flex_ms", "bwd_course_ms", "bwd_flex_ms", "fwd_sdpa_ms", "bwd_sdpa_ms"):
        row[key] = None
    if not row["pass"]:
        return row, detail
    ms = lambda fn, **kw: bench_ms(fn, smoke=smoke, **kw)  # noqa: E731  (smoke: one call's wall clock)
    plain = [t.detach() for t in (q, k, v)]
    row["fwd_course_ms"] = ms(lambda: flash_attention_varlen(*plain, batch, causal=causal))
    row["fwd_flex_ms"] = ms(lambda: flex(q4, k4, v4, block_mask=bm, enable_gqa=True))
    row["bwd_course_ms"] = ms(lambda: o_c.backward(do, retain_graph=True), grad_to_none=leaves)
    if not smoke:  # FlexAttention has no backward on a CPU
        row["bwd_flex_ms"] = ms(lambda: o_f.backward(do4, retain_graph=True), grad_to_none=fl)
    detail["fwd_course_graph_ms"] = graph_ms(lambda: flash_attention_varlen(*plain, batch, causal=causal), smoke)
    if T <= 16384:  # SDPA with the dense document mask: every pair computed
        same = doc[:, None] == doc[None, :]
        mask = (same & torch.ones_like(same).tril()) if causal else same  # [T, T]
        ke, ve = (t.repeat_interleave(H // Hkv, 1).detach() for t in (k4, v4))  # [1, H, T, d]
        sd = [t.detach().clone().requires_grad_() for t in (q4, ke, ve)]
        row["fwd_sdpa_ms"] = ms(lambda: F.scaled_dot_product_attention(q4, ke, ve, attn_mask=mask))
        o_s = F.scaled_dot_product_attention(*sd, attn_mask=mask)
        row["bwd_sdpa_ms"] = ms(lambda: o_s.backward(do4, retain_graph=True), grad_to_none=sd)
        del o_s, sd, mask, same
    flops = sum(4 * H * d * visible_pairs(n, n, causal) for n in lens)
    detail["useful_tflops"] = {f"{p}_{who}": round((2.5 if p == "bwd" else 1) * flops / row[f"{p}_{who}_ms"] / 1e9, 1)
                               for p in ("fwd", "bwd") for who in ("course", "flex") if row[f"{p}_{who}_ms"]}
    return row, detail


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def packed_summary(rows):
    """The issue's figures: geometric means of FlexAttention's time over the course's on the causal rows, forward and
    backward, and the lowest row of each."""
    causal = [r for r in rows if r["causal"] and r["pass"]]
    fwd = [r["fwd_flex_ms"] / r["fwd_course_ms"] for r in causal if r["fwd_flex_ms"] and r["fwd_course_ms"]]
    bwd = [r["bwd_flex_ms"] / r["bwd_course_ms"] for r in causal if r["bwd_flex_ms"] and r["bwd_course_ms"]]
    out = {"rows": len(causal), "fwd_x_flex": geomean(fwd), "bwd_x_flex": geomean(bwd),
           "fwd_min": min(fwd, default=None), "bwd_min": min(bwd, default=None)}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def packed_table(rows):
    fmt = lambda x: f"{x:8.3f}" if x else f"{'-':>8}"  # noqa: E731
    ratio = lambda a, b: f"{a / b:6.2f}" if a and b else f"{'-':>6}"  # noqa: E731
    head = (f"{'mix':26} {'T':>6} {'d':>4} {'H/Hkv':>6} {'causal':>6} {'fwd':>8} {'flex':>8} {'x':>6} {'sdpa':>8} "
            f"{'x':>6} {'bwd':>8} {'flex':>8} {'x':>6} {'sdpa':>8} {'x':>6} pass")
    lines = [head, "-" * len(head)]
    for r in rows:  # pass: the course's check against float64
        lines.append(f"{r['mix']:26} {r['T']:>6} {r['d']:>4} {r['H']:>3}/{r['Hkv']:<2} {str(r['causal']):>6} "
                     f"{fmt(r['fwd_course_ms'])} {fmt(r['fwd_flex_ms'])} {ratio(r['fwd_flex_ms'], r['fwd_course_ms'])} "
                     f"{fmt(r['fwd_sdpa_ms'])} {ratio(r['fwd_sdpa_ms'], r['fwd_course_ms'])} "
                     f"{fmt(r['bwd_course_ms'])} {fmt(r['bwd_flex_ms'])} {ratio(r['bwd_flex_ms'], r['bwd_course_ms'])} "
                     f"{fmt(r['bwd_sdpa_ms'])} {ratio(r['bwd_sdpa_ms'], r['bwd_course_ms'])} {r['pass']}")
    return "\n".join(lines) + "\n(ms, do_bench median; x = the peer's time / the course's)"


def host_costs(device, smoke):
    """The host's time per call on a prepared batch, microseconds (the best of 5 runs of back-to-back calls): the
    training forward (q, k, v require grad), the backward as the autograd engine calls it, and prepare_varlen with
    the maps its kernels use (once per step). ``python``: the course's own Python, every kernel launch stubbed out
    (under the interpreter the GPU's path is emulated: TMA descriptors made, the tiles chosen as on a GPU after a
    class's first call); ``launched`` (GPU only): the whole call with Triton's launches, on two documents of 300
    and 212 tokens, whose kernels take far less than the host's time, so the loop runs at the host's pace."""
    from helpers.kernels import varlen as kv, varlen_backward as kb
    H, Hkv, d = (2, 1, 16) if smoke else (16, 4, 128)
    dt = torch.float32 if smoke else torch.bfloat16
    cu = [0, 300, 512]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(512, h, d, device=device, dtype=dt, generator=g).requires_grad_() for h in (H, Hkv, Hkv))
    do = torch.randn(512, H, d, device=device, dtype=dt, generator=g)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    reps = 20 if smoke else 300

    def per_call(fn, n=reps):
        fn()
        best = float("inf")
        for _ in range(5):
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        return round(best, 1)

    def measure(batch):
        o = flash_attention_varlen(q, k, v, batch, causal=True)
        node = o.grad_fn
        out = {"forward": per_call(lambda: flash_attention_varlen(q, k, v, batch, causal=True)),
               "backward": per_call(lambda: node.apply(do))}

        def prepare():  # the step's set-up: the batch and the maps its kernels use
            made = prepare_varlen(cu, device=device)
            for key in batch.built_maps():
                made.block_map(*key)
        out["prepare_varlen"] = per_call(prepare, max(1, reps // 10))
        return out

    res = {}
    if not smoke:  # compiles and chooses the tiles first (the class of the packed rows: nothing new to compile)
        res["launched"] = measure(prepare_varlen(cu, device=device))

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    saved = {(m, n): getattr(m, n) for m, n in ((kv, "_attn_fwd_varlen"), (kb, "_bwd_dkdv_varlen"),
                                                (kb, "_bwd_dq_varlen"), (kb, "_bwd_preprocess"))}
    if smoke:  # the GPU's path under the interpreter: descriptors made, a tile kept per class as tuned_launch does
        def tuned(key, configs, launch, dev):
            cfg = kv._chosen.setdefault(key, (configs() if callable(configs) else configs)[0])
            launch(cfg)
            return cfg
        saved.update({(m, n): getattr(m, n) for m, n in ((kv, "_use_tma_default"), (kv, "_check_use_tma"),
                                                         (kv, "tuned_launch"), (kb, "tuned_launch"))})
        kv._use_tma_default, kv._check_use_tma = (lambda q: True), (lambda *a: None)
        kv.tuned_launch = kb.tuned_launch = tuned
        chosen = dict(kv._chosen)
    try:
        for m, n in saved:
            if n.startswith("_bwd") or n == "_attn_fwd_varlen":
                setattr(m, n, Stub())
        res["python"] = measure(prepare_varlen(cu, device=device))  # a new batch: its plans launch the stubs
    finally:
        for (m, n), obj in saved.items():
            setattr(m, n, obj)
        if smoke:
            kv._chosen.clear()
            kv._chosen.update(chosen)
    return res


def packed_section(args, device, gpu, path):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if args.smoke:
        flex = flex_attention  # eager on the CPU: a check of the script's paths
    else:
        # one compiled FlexAttention for every row; past dynamo's recompile limit torch.compile would silently run
        # flex_attention eagerly (bench_masks.py saw a 68x slower "FlexAttention" that way): lift the limit
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 10_000)
        flex = torch.compile(flex_attention, dynamic=False)
    budget = args.budget if args.budget is not None else PACKED_BUDGET_S / (3 if args.quick else 1)
    t0 = time.time()
    log(f"{gpu} torch {torch.__version__} triton {triton.__version__}; packed_documents rows into {path}")
    rows, details, skipped = [], [], []
    meta = {**run_meta(gpu), "timing": TIMING, "dtype": "float32 (smoke)" if args.smoke else "bfloat16",
            "course": "flash_attention_varlen(q, k, v, prepare_varlen(cu_seqlens), causal=...): the batch made once, "
                      "not timed; q [T, H, d], k, v [T, Hkv, d]; tiles chosen on the first call of each shape class",
            "flex": "torch.compile(flex_attention, dynamic=False), create_block_mask(document mask, 128 x 128) built "
                    "once, not timed; enable_gqa=True; q [1, H, T, d]",
            "sdpa": "F.scaled_dot_product_attention with the dense [T, T] bool document mask, default dispatch, K and "
                    "V repeated to H heads beforehand; T <= 16384 only",
            "bwd": "o.backward(do) alone, the forward's graph kept",
            "check": "first, last and longest document vs float64 (closed-form backward): O, dq, dk, dv each within "
                     "2x SDPA's error on the same document (bf16) + 1e-5, lse within 5e-3",
            "details": details, "skipped_for_time": skipped}
    cases = packed_cases(args.quick, args.smoke)
    first = [cases[i] for i in args.first if i < len(cases)]
    for c in first + [c for c in cases if c not in first]:
        if time.time() - t0 > budget:
            skipped.append(list(c))
            continue
        try:
            row, detail = run_packed_row(*c, flex=flex, create_block_mask=create_block_mask, device=device,
                                         smoke=args.smoke)
        except Exception as e:  # noqa: BLE001 - recorded in the row; the next rows still run
            if args.smoke:
                raise
            import traceback
            log(f"  {c}: {why(e, 300)}\n{traceback.format_exc()[-2000:]}")
            mix, T, d, Hkv, causal = c
            row = {"mix": mix, "T": T, "d": d, "H": 16, "Hkv": Hkv, "causal": causal, "lengths": None, "pass": False,
                   **{key: None for key in ("fwd_course_ms", "fwd_flex_ms", "bwd_course_ms", "bwd_flex_ms",
                                            "fwd_sdpa_ms", "bwd_sdpa_ms")}}
            detail = {"mix": mix, "T": T, "error": why(e, 300)}
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        detail["seconds_since_start"] = round(time.time() - t0, 1)
        log("  packed", json.dumps(row), json.dumps(detail))
        rows.append(row)
        details.append(detail)
        meta.update(seconds=round(time.time() - t0, 1), summary=packed_summary(rows),
                    tiles={str(key): cfg for key, cfg in chosen_configs().items()})
        write_section("packed_documents", rows, meta, path)  # after every row: a run cut short keeps what it did
        if device == "cuda":
            torch.cuda.empty_cache()
    meta["host_us_per_call"] = host_costs(device, args.smoke)
    meta.update(seconds=round(time.time() - t0, 1), summary=packed_summary(rows),
                tiles={str(key): cfg for key, cfg in chosen_configs().items()},
                rejected_tiles={str(key): v for key, v in rejected_configs().items()})
    write_section("packed_documents", rows, meta, path)
    log(f"done in {meta['seconds']}s; wrote {len(rows)} rows to {path}" + (f"; skipped {skipped}" if skipped else ""))
    log(packed_table(rows))
    log(f"host us per call on a prepared batch (python: launches stubbed; launched: with Triton's launches): "
        f"{json.dumps(meta['host_us_per_call'])}")
    log(f"causal rows, FlexAttention's time / the course's (geometric mean; lowest row): "
        f"{json.dumps(meta['summary'])}  (targets: forward >= 1.1, backward >= 1.0, no row below 0.9)")
    return rows


def report(path, train_path=None):
    """A short table of what a run wrote: the packed rows (FlexAttention's time over the course's, forward and
    backward; the forward in a CUDA graph), their summary, the host's time per call, the tiles chosen per class,
    and train_llama.py's runs (tokens per second, the attention's share, what the timed steps compiled)."""
    lines = []
    if path and os.path.exists(path):
        res = json.load(open(path))
        rows, meta = res.get("packed_documents", []), res.get("packed_documents_meta", {})
        details = {(d.get("mix"), d.get("T"), d.get("d"), d.get("Hkv"), d.get("causal")): d
                   for d in meta.get("details", [])}
        lines.append(f"{'mix':26} {'T':>6} {'d':>4} {'Hkv':>3} {'causal':>6} {'fwd x':>6} {'bwd x':>6} {'fwd ms':>7} "
                     f"{'graph':>7} pass")
        for r in rows:
            d = details.get((r["mix"], r["T"], r["d"], r["Hkv"], r["causal"]), {})
            x = lambda a, b: f"{r[a] / r[b]:6.2f}" if r.get(a) and r.get(b) else f"{'-':>6}"  # noqa: E731
            g = d.get("fwd_course_graph_ms")
            lines.append(f"{r['mix']:26} {r['T']:>6} {r['d']:>4} {r['Hkv']:>3} {str(r['causal']):>6} "
                         f"{x('fwd_flex_ms', 'fwd_course_ms')} {x('bwd_flex_ms', 'bwd_course_ms')} "
                         f"{(r['fwd_course_ms'] or 0):7.3f} {(g or 0):7.3f} {r['pass']}")
        lines.append(f"summary {json.dumps(meta.get('summary'))}; skipped {meta.get('skipped_for_time')}")
        lines.append(f"host us per call {json.dumps(meta.get('host_us_per_call'))}")
        lines.append(f"tiles {json.dumps(meta.get('tiles'))}; rejected {json.dumps(meta.get('rejected_tiles'))}")
    if train_path and os.path.exists(train_path):
        res = json.load(open(train_path))
        for name, r in res.get("runs", {}).items():
            lines.append(f"train {name:>6}: {r['tokens_per_s']:>9.0f} tokens/s, step median {r.get('step_ms_median')} "
                         f"max {r.get('step_ms_max')} ms, attention {r.get('attention_share')}, while timed: "
                         f"compiles {r.get('varlen_compiles_while_timed')}, "
                         f"tile choices {r.get('varlen_tile_choices_while_timed')}")
        lines.append(f"train errors {res.get('errors')}; course/flex {res.get('speedup_vs_flex_tokens_per_s')}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file to merge the rows into (default bench/results/<gpu>.json)")
    ap.add_argument("--quick", action="store_true", help="fewer rows: serving bf16 only; packed: 4 mixes at T 16384")
    ap.add_argument("--packed", action="store_true", help="only the packed documents (pre-training) rows")
    ap.add_argument("--serving", action="store_true", help="only the serving (varlen prefill) rows")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"packed rows: seconds after which no new row starts (default {PACKED_BUDGET_S}, a third "
                         f"with --quick)")
    ap.add_argument("--first", type=lambda x: [int(i) for i in x.split(",") if i], default=[],
                    help="packed rows to run before the others, as indices into the list (0-based, comma-separated)")
    ap.add_argument("--host", action="store_true", help="only the host's time per call on a prepared batch (printed)")
    ap.add_argument("--report", metavar="JSON", help="only print a short table of what a run wrote into JSON")
    ap.add_argument("--train", metavar="JSON", help="with --report: train_llama.py's train_llama.json too")
    ap.add_argument("--tune-dense", action="store_true", help="autotune the dense kernel instead of its fixed config")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes under the interpreter (the script's test)")
    args = ap.parse_args(argv)
    if args.report:
        log(report(args.report, args.train))
        return []
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        raise SystemExit("bench_varlen.py needs a CUDA GPU (or --smoke for the interpreter run)")
    if args.smoke and torch.cuda.is_available():
        raise SystemExit("--smoke is the CPU interpreter run; on a GPU machine run without it")
    if args.packed and args.serving:
        raise SystemExit("--packed and --serving each pick one section: give one, or neither for both")
    device = "cuda" if on_gpu else "cpu"
    gpu = torch.cuda.get_device_name() if on_gpu else "cpu (interpreter smoke run)"
    if args.host:
        log(json.dumps(host_costs(device, args.smoke)))
        return []
    path = args.out or results_path(gpu)
    rows = []
    if not args.packed:
        rows = serving_section(args, device, gpu, path)
    if not args.serving:
        packed = packed_section(args, device, gpu, path)
        rows = rows if not args.packed else packed
    return rows


if __name__ == "__main__":
    main()
