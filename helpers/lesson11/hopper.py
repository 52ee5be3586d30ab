"""Lesson 11's GPU section: whether this machine can run the Gluon kernels (an sm_90 GPU and a Triton with
Gluon's Hopper API), the recorded H200 figures when it cannot, and a small live benchmark when it can."""
from __future__ import annotations

import torch

from . import records

__all__ = ["NO_HOPPER", "hopper_here", "require_hopper", "show_recorded_hopper", "bench_gluon_live", "ptxas_report",
           "ptxas_lines"]


# ------------------------------------------------------------------ the GPU section's gate
NO_HOPPER = ("The Gluon kernel of this section needs an NVIDIA Hopper GPU (sm_90: H100, H200) and Triton >= 3.6; "
             "it cannot run under Triton's interpreter.")


def hopper_here() -> str:
    """'' when an sm_90 GPU and a Triton with Gluon's Hopper API are here; else the one-line reason."""
    try:
        import torch as _t
        if not _t.cuda.is_available():
            return NO_HOPPER + " This machine has no CUDA GPU."
        major, minor = _t.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            return NO_HOPPER + f" This GPU is sm_{major}{minor}."
        import triton  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
    except ImportError as e:
        return NO_HOPPER + f" ({e.name or e} is missing here.)"
    return ""


def require_hopper() -> bool:
    """True if the GPU section can run; otherwise print its one line and return False (no exception: the CPU
    parts above must run clean everywhere, in nbval and in JupyterLab). The recorded H200 figures are shown by
    the next cell, ``show_recorded_hopper()``, on every machine."""
    why = hopper_here()
    if why:
        print(why + " The figures recorded on an H200 follow in \"Going deeper\".")
        return False
    return True


def show_recorded_hopper(res=None):
    """The recorded H200 figures of this lesson's Gluon kernels (``bench/results/gluon_h200.json``, written by
    ``bench/bench_gluon.py``): the table with its GPU, versions, date and statistic, then the plot. Returns the
    figure (None when nothing is recorded)."""
    res = records.load_gluon() if res is None else res
    if not res or not res.get("rows"):
        print(f"No H200 figures are recorded for this lesson's Gluon forward ({records.GLUON.name} is missing): "
              "none are typed in here.")
        return None
    print(records.gluon_table(res))
    return records.plot_gluon(res)


def bench_gluon_live(shapes=((1, 16, 4096, 128), (2, 32, 4096, 64)), dtype=torch.bfloat16,
                     variants=("one", "ws")):
    """On an sm_90 GPU: a small live version of bench/bench_gluon.py, rows shaped like its record (``meta``,
    ``rows``), so that ``records.gluon_table`` prints them. ``variants``: ``gluon_forward``'s (``"one"``, ``"ws"``,
    ``"pp"``), recorded as ``gluon``, ``gluon_ws``, ``gluon_pp``. Each Gluon variant is checked against float64 first
    (2x SDPA's own error) and timed only when correct; do_bench's median, L2 flushed by do_bench. The "triton" column is
    the course's Triton forward (``flash_attn_triton(..., backend="triton")``), not the kernel it routes to."""
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench

    from ..kernels.forward import flash_attn_triton
    from ..kernels.gluon_forward import gluon_forward

    def ms(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def sdpa(backend, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        try:
            with sdpa_kernel(b):
                return ms(lambda: F.scaled_dot_product_attention(q, k, v))
        except RuntimeError:                                     # that backend cannot take this shape here
            return None

    rows = []
    for B, H, N, d in shapes:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * B * H * N * N * d
        o64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        sdpa_err = (F.scaled_dot_product_attention(q, k, v).double() - o64).abs().max().item()
        row = {"dtype": str(dtype).replace("torch.", ""), "d": d, "N": N, "B": B, "H": H}
        for var in variants:
            key = "gluon" if var == "one" else f"gluon_{var}"
            o, _ = gluon_forward(q, k, v, variant=var)
            row[f"{key}_pass"] = (o.double() - o64).abs().max().item() <= 2 * sdpa_err + torch.finfo(dtype).eps
            if row[f"{key}_pass"]:
                row[f"{key}_tflops"] = flops / ms(lambda: gluon_forward(q, k, v, variant=var)) / 1e9
        # backend="triton": on sm_90 flash_attn_triton routes these shapes to the Gluon forward (forward.GLUON_ROUTES)
        row["triton_tflops"] = flops / ms(lambda: flash_attn_triton(q, k, v, backend="triton")) / 1e9
        for backend in ("flash", "cudnn"):
            t = sdpa(backend, q, k, v)
            row[f"sdpa_{backend}_tflops"] = None if t is None else flops / t / 1e9
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": "now (this notebook)", "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms)",
            "causal": False}
    return {"meta": meta, "rows": rows}


# ------------------------------------------------------------------ what ptxas makes of a variant (no GPU needed)
_PTXAS_CHILD = r"""
import json, re, sys
import triton
from helpers.kernels.gluon_forward import compile_for_sm90
d, dtype, causal = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
try:
    from triton.backends.nvidia.compiler import get_ptxas_version
    try:
        ver = get_ptxas_version(90)
    except TypeError:
        ver = get_ptxas_version()
    ver = re.search(r"V[\d.]+", ver).group(0)
except Exception:                                  # noqa: BLE001 - the version is a label, not the result
    ver = "?"
print(json.dumps({"triton": triton.__version__, "ptxas": ver}), flush=True)
for v in sys.argv[4:]:
    print("<<" + v, flush=True)
    k = compile_for_sm90(d, dtype, variant=v, causal=causal, compiled=True)
    print(">>" + json.dumps({"variant": v, "shared": getattr(k.metadata, "shared", None)}), flush=True)
"""


def ptxas_report(variants=("pp", "pp128"), d=128, dtype="bf16", causal=False, timeout=600) -> dict:
    """Compile Gluon forward variants for sm_90a with Triton's own compiler (no GPU needed, in a child process with a
    fresh cache and ``TRITON_DUMP_PTXAS_LOG=1``) and read ptxas's report for each: registers, spill stores and loads
    (bytes a thread) and its performance notes (C7512: wgmma serialised for want of registers). These are the
    compiler's figures for this machine's Triton and ptxas, not a measurement, and they change with the version.
    Returns ``{"triton", "ptxas", "rows": [...]}`` or ``{"error": why}``. A report is kept beside Triton's cache
    (``_report_file``: keyed on Triton's version, the kernels' sources and the arguments), so that running the
    notebook again does not compile again (``"cached": True``)."""
    import json
    import os
    import re
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    from .producer import gluon_here
    if not gluon_here():
        return {"error": "this Python's Triton has no Gluon Hopper API (Triton >= 3.6, Linux)"}
    root = Path(__file__).resolve().parents[2]
    kept = _report_file(root, variants, d, dtype, causal)
    try:
        return {**json.loads(kept.read_text()), "cached": True}
    except (OSError, ValueError):
        pass
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_DUMP_PTXAS_LOG="1",
                   TRITON_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        try:
            r = subprocess.run([sys.executable, "-c", _PTXAS_CHILD, str(d), dtype, "1" if causal else "0", *variants],
                               cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the compile took longer than {timeout} s"}
    out = r.stdout.splitlines()
    if r.returncode or not out or not out[0].startswith("{"):
        tail = [ln for ln in r.stderr.splitlines() if ln.strip()]
        return {"error": tail[-1] if tail else f"the compiler's process exited with {r.returncode}"}
    rep, rows, log = json.loads(out[0]), [], []
    for ln in out[1:]:
        if ln.startswith("<<"):
            log = []
        elif ln.startswith(">>"):
            row = json.loads(ln[2:])
            text = "\n".join(log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
            regs = re.search(r"Used (\d+) registers", text)
            row.update(d=d, dtype=dtype, causal=causal, report=bool(spill),
                       spill_stores=int(spill.group(1)) if spill else None,
                       spill_loads=int(spill.group(2)) if spill else None,
                       registers=int(regs.group(1)) if regs else None,
                       notes=sorted(set(re.findall(r"\((C\d+)\) ([^\n]*?) for the function", text))))
            rows.append(row)
        else:
            log.append(ln)
    rep["rows"] = rows
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rep))
        os.replace(tmp, kept)
    except OSError:  # a read-only cache: the report is still returned
        pass
    return rep


def _report_file(root, variants, d, dtype, causal):
    """Where ptxas_report keeps a report: Triton's cache folder (``TRITON_CACHE_DIR``, else ``~/.triton/cache``), a
    name that changes with Triton's version, every kernel source under helpers/kernels/, the child's script and the
    arguments."""
    import hashlib
    import os
    from pathlib import Path
    import triton
    h = hashlib.sha256(f"{triton.__version__}|{_PTXAS_CHILD}|{list(variants)}|{d}|{dtype}|{causal}".encode())
    for src in sorted((root / "helpers" / "kernels").glob("*.py")):
        h.update(src.read_bytes())
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return folder / f"course_ptxas_report_{h.hexdigest()[:24]}.json"


def ptxas_lines(rep) -> str:
    """ptxas_report's answer as lines, labelled with Triton's and ptxas's versions and the target."""
    if "error" in rep:
        return f"ptxas's report could not be made here: {rep['error']}"
    when = "compiled on this machine earlier (kept beside Triton's cache)" if rep.get("cached") else \
        "compiled on this machine now"
    lines = [f"ptxas {rep['ptxas']} (Triton {rep['triton']}'s), sm_90a, {when} (no GPU needed); bytes a thread"]
    for r in rep["rows"]:
        if not r["report"]:
            lines.append(f"  {r['variant']:6} d = {r['d']} {r['dtype']}: this Triton printed no ptxas report")
            continue
        notes = "; ".join(f"{c}: {t}" for c, t in r["notes"]) or "no notes"
        lines.append(f"  {r['variant']:6} d = {r['d']} {r['dtype']} {'causal' if r['causal'] else 'full'}: "
                     f"{r['spill_stores']} spill stores, {r['spill_loads']} spill loads, {r['registers']} registers a "
                     f"thread at launch (the partitions' budgets are set after it, by setmaxnreg); {notes}")
    return "\n".join(lines)
