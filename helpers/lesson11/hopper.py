"""Lesson 11's GPU section: whether this machine can run the Gluon kernels (an sm_90 GPU and a Triton with
Gluon's Hopper API), the recorded H200 figures when it cannot, and a small live benchmark when it can."""
from __future__ import annotations

import torch

from . import records

__all__ = ["NO_HOPPER", "hopper_here", "require_hopper", "show_recorded_hopper", "bench_gluon_live"]


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
        print(why + " The figures recorded on an H200 follow.")
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
