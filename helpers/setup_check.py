"""``make check-setup``: does this machine run the course? Under a minute, before the first lesson.

    python -m helpers.setup_check

It checks, in order, and says in one line each what it found: Python and torch; the GPU (or none) and how Triton
runs here (natively, under its interpreter, or not at all: macOS and Windows have no Triton); one checker grading
the course's own answer; one Triton kernel against float64 (where Triton is); one tiny notebook run by the course's
Jupyter kernel; JupyterLab. It exits 1 when something the course needs is missing, naming the fix. This is not the
test suite (``make check``, for maintainers): it proves the set-up, not the course.
"""
from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import triton_mode

ROOT = Path(__file__).resolve().parent.parent
OK, BAD, NOTE = "ok  ", "FAIL", "note"


def _line(status: str, what: str, detail: str) -> bool:
    print(f"  [{status}] {what:<22} {detail}")
    return status != BAD


def _torch() -> bool:
    import torch
    return _line(OK, "Python, torch", f"Python {platform.python_version()}, torch {torch.__version__} "
                                      f"({platform.system()} {platform.machine()})")


def _gpu_and_triton() -> tuple[bool, bool]:
    """(passed, triton usable here)."""
    import torch
    gpu = (f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
           if torch.cuda.is_available() else "none: the GPU lessons run under Triton's interpreter and show the "
                                             "figures recorded on an H200")
    _line(OK, "GPU", gpu)
    if importlib.util.find_spec("triton") is None:
        _line(NOTE, "Triton", "not installed (PyPI has it for Linux only): lessons 07, 08's GPU part and 10's "
                              "serving step show the recorded results; everything else runs")
        return True, False
    import triton
    mode = "under its interpreter (no CUDA GPU)" if triton_mode.interpreting() else "natively on the GPU"
    return _line(OK, "Triton", f"{triton.__version__}, runs kernels {mode}"), True


def _checker() -> bool:
    from . import check, reference

    def merge_ml(m1, l1, m2, l2):                     # the course's answer, in the inputs' dtype
        m, l = reference.merge_ml(m1, l1, m2, l2)
        return m.to(m1.dtype), l.to(l1.dtype)
    import contextlib
    import io
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check.merge_ml(merge_ml)
    except AssertionError as e:
        return _line(BAD, "a checker", f"check.merge_ml rejected the course's answer: {str(e).splitlines()[0]}")
    return _line(OK, "a checker", "check.merge_ml graded the course's answer ✅")


def _kernel() -> bool:
    import torch

    from .kernels.forward import flash_attn_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if dev == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 2, 40, 32, device=dev, dtype=dtype) for _ in range(3))
    t0 = time.perf_counter()
    try:
        o, _ = flash_attn_triton(q, k, v, causal=True)
    except Exception as e:  # noqa: BLE001 - the check's verdict, not a traceback
        return _line(BAD, "a Triton kernel", f"flash_attn_triton raised {type(e).__name__}: {e}")
    o_ref, _ = reference_attention(q, k, v)
    err = (o.double().cpu() - o_ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    status = OK if err <= tol else BAD
    return _line(status, "a Triton kernel", f"the causal forward matches float64 (max error {err:.1e}) in "
                                            f"{time.perf_counter() - t0:.1f} s")


def reference_attention(q, k, v):
    from . import reference
    mask = reference.causal_mask(q.shape[-2], k.shape[-2])
    return reference.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask=mask)


def _notebook() -> bool:
    """A two-cell notebook run by the kernel JupyterLab will use (``make setup`` installs it into the venv)."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as e:
        return _line(BAD, "a notebook", f"{e.name} is missing: run `make setup`")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import helpers, torch\nfrom helpers import check"),
                nbformat.v4.new_code_cell("print('kernel ok', torch.__version__)")]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with open(Path(tmp) / "kernel.log", "w") as log:          # the kernel's own chatter stays out of sight
                NotebookClient(nb, timeout=120, kernel_name="python3",
                               resources={"metadata": {"path": tmp}}).execute(stdout=log, stderr=log)
        except Exception as e:  # noqa: BLE001 - no kernel, a kernel that dies, an import error inside it
            return _line(BAD, "a notebook", f"the course's Jupyter kernel could not run a notebook: "
                                            f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    out = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    return _line(OK if "kernel ok" in out else BAD, "a notebook", "a notebook ran in the course's Jupyter kernel")


def _lab() -> bool:
    exe = Path(sys.executable).with_name("jupyter")
    jupyter = str(exe) if exe.exists() else shutil.which("jupyter")
    if not jupyter:
        return _line(BAD, "JupyterLab", "`jupyter` is not on this Python's path: run `make setup`")
    r = subprocess.run([jupyter, "lab", "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode:
        return _line(BAD, "JupyterLab", "`jupyter lab` is missing: run `make setup`")
    return _line(OK, "JupyterLab", f"{r.stdout.strip()}: `make lab` opens the course")


def main() -> int:
    t0 = time.perf_counter()
    print("Checking this machine for the course (this is not the test suite: that is `make check`):")
    ok = _torch()
    passed, has_triton = _gpu_and_triton()
    ok &= passed
    ok &= _checker()
    if has_triton:
        ok &= _kernel()
    ok &= _notebook()
    ok &= _lab()
    took = time.perf_counter() - t0
    if ok:
        print(f"Ready ({took:.0f} s). Next: `make lab`, and open 00_start_here.ipynb (the lab opens on it).")
        return 0
    print(f"Not ready ({took:.0f} s): fix the FAIL lines above, then run `make check-setup` again.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
