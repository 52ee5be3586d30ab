"""What the bench scripts share: `log`, one timing policy, SDPA-backend timing, the 2x-SDPA error rule,
the float64 prefill check, atomic writes of the results JSON (one section at a time), and the figures'
canvas (``subplots`` / ``save_figure``).

How the scripts import it: as ``common``, a plain module next to them, never as ``bench.common``
(bench/bench.py would shadow a ``bench`` package). A script run as a file (``python3 bench/bench.py``)
has bench/ first on sys.path already; each script also puts its own folder there before
``import common`` so that loading it by path (tests/test_bench_scripts.py) finds it too. Importing
this module puts the repository root on sys.path (for ``helpers``). Nothing here imports torch or
Triton at module level: a script that runs under Triton's interpreter (``--smoke``) sets
``TRITON_INTERPRET`` before anything imports Triton.

Timing policy (the one the committed forward and decode figures used, bench/NOTES.md):
``triton.testing.do_bench``, median, L2 flushed before every repetition, warmup 25 ms, rep 100 ms;
``graph_ms``: the same call captured in a CUDA graph (``do_bench_cudagraph``, median, no L2 flush, no
Python in the timed loop).

Results: ``write_section(name, rows, meta, path)`` sets ``name`` and ``name_meta`` in the JSON at
path and keeps every other key, so one script's run never relabels another's rows; the write is
atomic (a temporary file, then ``os.replace``). helpers/results.py reads what these write.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS_DIR = os.path.join(ROOT, "bench", "results")

WARMUP_MS, REP_MS = 25, 100                     # do_bench's time budgets, milliseconds
TIMING = f"triton.testing.do_bench median (warmup {WARMUP_MS} ms, rep {REP_MS} ms), L2 flushed"
GRAPH_TIMING = f"triton.testing.do_bench_cudagraph median (rep {REP_MS} ms), no L2 flush"
ERR_FLOOR = 1e-5                                # the rule's absolute floor


def log(*a):
    print(*a, flush=True)


def why(e, n=100) -> str:
    """An exception in one line: its type and the first n characters of its message's first line."""
    text = str(e).splitlines()[0][:n] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"


# ----------------------------------------------------------------------------- timing


def bench_ms(fn, grad_to_none=None, smoke=False) -> float:
    """ms per call of fn: do_bench's median (the policy above). smoke: Triton's interpreter on a CPU,
    one call's wall clock (a check that the path runs, not a figure)."""
    if smoke:
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=grad_to_none,
                                   return_mode="median")


def graph_ms(fn, smoke=False):
    """ms per call of fn captured in a CUDA graph (kernel time without Python launch cost); None if the
    capture fails or under the interpreter. No L2 flush: for caches far larger than L2 that does not matter."""
    if smoke:
        return None
    import torch
    import triton
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured gets no graph figure
        log(f"    graph timing failed: {why(e)}")
        torch.cuda.synchronize()
        return None


def sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_ms(backend: str, fn, timer=None):
    """ms of fn() (an SDPA call) with SDPA forced onto backend ('flash', 'cudnn', 'efficient'), timed by
    ``timer`` (default bench_ms) after one untimed call; None when the backend refuses the case."""
    import torch
    from torch.nn.attention import sdpa_kernel
    try:
        with sdpa_kernel(sdpa_backends()[backend]):
            fn()
            torch.cuda.synchronize()
            return (timer or bench_ms)(fn)
    except Exception as e:  # noqa: BLE001 - a backend that refuses this case is a None in the row
        log(f"    sdpa {backend} refused: {why(e)}")
        torch.cuda.synchronize()
        return None


# ----------------------------------------------------------------------------- correctness


def within_sdpa_error(err: float, sdpa_err: float) -> bool:
    """FlashAttention's own test rule: the kernel's max error against float64 is at most twice the error
    of SDPA in the same dtype, plus a small floor."""
    return err <= 2 * sdpa_err + ERR_FLOOR


def ref_heads(q, k, v, causal, heads):
    """float64 reference O for the (b, h) pairs in heads: list of [N, d] (top-left causal), 4096 rows at a time."""
    import torch
    outs = []
    for b, h in heads:
        qh, kh, vh = (t[b, h].double() for t in (q, k, v))
        N, d = qh.shape
        rows = []
        for i0 in range(0, N, 4096):
            s = qh[i0:i0 + 4096] @ kh.T / math.sqrt(d)  # [chunk, Nk]
            if causal:
                i = torch.arange(i0, min(i0 + 4096, N), device=q.device)[:, None]
                j = torch.arange(kh.shape[0], device=q.device)[None, :]
                s = s.masked_fill(j > i, float("-inf"))
            rows.append(torch.softmax(s, -1) @ vh)
        outs.append(torch.cat(rows))
    return outs


def check_prefill(q, k, v, causal, o_tri, lse_tri):
    """A forward's (O, lse) on q, k, v [B, H, N, d]: O of the first and last head within the 2x-SDPA rule
    against float64, lse of head 0 (first 2048 rows) within 5e-3 of float64 logsumexp, everything finite."""
    import torch
    import torch.nn.functional as F
    B, H, N, d = q.shape
    heads = [(0, 0), (B - 1, H - 1)]
    refs = ref_heads(q, k, v, causal, heads)
    o_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # default dispatch, same dtype
    tri_err = max((o_tri[b, h].double() - r).abs().max().item() for (b, h), r in zip(heads, refs))
    sdpa_err = max((o_sdpa[b, h].double() - r).abs().max().item() for (b, h), r in zip(heads, refs))
    qh, kh = q[0, 0].double(), k[0, 0].double()
    s = qh[:2048] @ kh.T / math.sqrt(d)  # [2048, Nk]
    if causal:
        s = s.masked_fill(torch.arange(kh.shape[0], device=q.device)[None, :]
                          > torch.arange(s.shape[0], device=q.device)[:, None], float("-inf"))
    lse_err = (lse_tri[0, 0, :2048].double() - torch.logsumexp(s, -1)).abs().max().item()
    finite = bool(torch.isfinite(o_tri).all()) and bool(torch.isfinite(lse_tri).all())
    full_diff = (o_tri.float() - o_sdpa.float()).abs().max().item()
    ok = finite and within_sdpa_error(tri_err, sdpa_err) and lse_err < 5e-3
    return {"pass": ok, "err": tri_err, "sdpa_err": sdpa_err, "lse_err": lse_err, "max_diff_vs_sdpa": full_diff}


# ----------------------------------------------------------------------------- results files


def gpu_stem(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200': the results file's name."""
    return gpu.lower().replace("nvidia", "").strip().replace(" ", "_") or "gpu"


def results_path(gpu: str, out_dir: str | None = None, prefix: str = "") -> str:
    """<out_dir>/<prefix><gpu stem>.json (out_dir: bench/results by default)."""
    return os.path.join(out_dir or RESULTS_DIR, f"{prefix}{gpu_stem(gpu)}.json")


def run_meta(gpu: str, **more) -> dict:
    """The label of one run's rows: GPU, torch and Triton versions, today's date, and whatever more."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # ring_gpu.py --cpu needs no Triton
        triton_version = None
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version,
            "date": datetime.date.today().isoformat(), **more}


def write_json(path: str, data) -> None:
    """Write data as JSON at path atomically: a reader (or a run cut short) sees the old file or the new one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def update_json(path: str, updates: dict) -> dict:
    """Set updates' keys in the JSON object at path (created if missing), keep every other key; atomic."""
    data = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise SystemExit(f"{path} does not hold a JSON object; not touching it")
    data.update(updates)
    write_json(path, data)
    return data


def write_section(name: str, rows, meta: dict, path: str, extra: dict | None = None) -> dict:
    """Write one script's section into the results file at path: ``name`` = rows, ``name_meta`` = meta
    (GPU, versions, date, how it was timed), plus ``extra`` keys measured in the same run; every other
    section and its meta stays as it was. Atomic. Returns the whole file's data."""
    return update_json(path, {name: rows, f"{name}_meta": meta, **(extra or {})})


# ----------------------------------------------------------------------------- figures


def subplots(*args, **kwargs):
    """matplotlib's plt.subplots on the file-only Agg backend (a GPU machine has no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: str) -> None:
    """A results figure as the committed PNGs are: tight layout, 110 dpi."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- training data


def corpus_bytes() -> bytes:
    """The course's own text, as bytes (a byte-level vocabulary of 256): README, CONTRIBUTING, the bench notes and
    the worked notebooks' cells, read from this repository (the training scripts' data; no network)."""
    import glob
    parts = []
    for path in [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CONTRIBUTING.md"),
                 os.path.join(ROOT, "bench", "NOTES.md")] + sorted(glob.glob(os.path.join(ROOT, "solutions", "*.ipynb"))):
        if not os.path.exists(path):
            continue
        if path.endswith(".ipynb"):
            with open(path) as f:
                nb = json.load(f)
            parts += ["".join(c["source"]) for c in nb["cells"]]
        else:
            with open(path) as f:
                parts.append(f.read())
    data = "\n\n".join(parts).encode("utf-8")
    if len(data) < 10_000:
        raise RuntimeError(f"corpus too small ({len(data)} bytes): run from the course's repository")
    return data


def training_cli(doc: str, script: str, gpu_cfg: dict, tiny_cfg: dict, tiny_help: str):
    """The training scripts' command line (``--cpu``, ``--tiny``, ``--steps``, ``--out``): (args, device, cfg, dtype).
    On a GPU bf16 autocast; with ``--cpu`` fp32 under Triton's interpreter (the script sets TRITON_INTERPRET itself
    before importing Triton)."""
    import argparse
    import torch
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU under TRITON_INTERPRET=1 (fp32)")
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --cpu --tiny for the interpreter)")
    cfg = dict(tiny_cfg if args.tiny else gpu_cfg)
    if args.steps:
        cfg["steps"] = args.steps
    return args, device, cfg, torch.bfloat16 if device == "cuda" else torch.float32


def adamw_cosine(model, cfg: dict):
    """AdamW (betas 0.9, 0.95; weight decay 0.1) at cfg["lr"], linear warmup over cfg["warmup"] steps, then a
    cosine decay over cfg["steps"]: (optimizer, scheduler)."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg["warmup"])
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg["steps"]))))
    return opt, sched


def train_step(model, opt, sched, device: str, dtype, *inputs) -> float:
    """One training step: the model's loss on inputs (bf16 autocast on a GPU), backward, gradients clipped at 1.0,
    the optimizer and the schedule. Returns the loss as a float (``.item()`` syncs: a step's time is all of it)."""
    import torch
    with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
        loss = model(*inputs)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()
