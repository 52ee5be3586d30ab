"""Triton's mode (native or interpreter) is chosen once by the course, whatever imports triton later.

Each test is a fresh Python process with TRITON_INTERPRET removed from its environment, as a learner's
`make lab` or `make check` has it (this test process has it set by conftest.py). The bug these guard
against: torch 2.13's ``torch.utils.flop_counter`` (imported by ``helpers.meter``) imports triton, so a
notebook that set TRITON_INTERPRET at its GPU section was too late, and Triton's own library ran compiled
while the course's kernels ran interpreted ("Cannot call @triton.jit'd outside of the scope of a kernel").
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="about the interpreter on a machine without a GPU")


def run(*parts: str, **env_extra) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    proc = subprocess.run([sys.executable, "-c", "".join(textwrap.dedent(p) for p in parts)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# A course kernel whose body calls Triton's own library (tl.max, tl.sum), checked against float64 SDPA.
KERNEL_RUNS = """
    import torch
    from helpers.kernels.forward import flash_attn_triton
    from helpers import reference
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    o, lse = flash_attn_triton(q, k, v, causal=True)
    o_ref, lse_ref = reference.attention(q, k, v, mask=reference.causal_mask(33, 33))
    err = max((o.double() - o_ref).abs().max().item(), (lse.double() - lse_ref).abs().max().item())
    assert err < 1e-4, err
    print("kernel ok")
"""


def test_helpers_chooses_the_interpreter_before_flop_counter_imports_triton():
    out = run("""
        import os, sys, torch
        import helpers                                 # a notebook's first cell: torch, then helpers
        assert "triton" not in sys.modules
        import torch.utils.flop_counter                # imports triton (torch 2.13), as helpers.meter does
        from helpers import triton_mode
        print(triton_mode.decided, os.environ["TRITON_INTERPRET"])
    """, KERNEL_RUNS)
    assert out.splitlines() == ["no-gpu 1", "kernel ok"]


def test_importing_a_kernel_module_first_chooses_too():
    out = run("""
        from helpers import triton_mode, meter         # meter imports flop_counter, which imports triton
        print(triton_mode.decided)
    """, KERNEL_RUNS)
    assert out.splitlines() == ["no-gpu", "kernel ok"]


@pytest.mark.parametrize("value", ["1", "0"])
def test_the_learners_own_value_is_respected(value):
    out = run("""
        import os, helpers
        print(helpers.triton_mode.decided, os.environ["TRITON_INTERPRET"], helpers.triton_mode.interpreting())
    """, TRITON_INTERPRET=value)
    assert out.split() == ["learner", value, str(value == "1")]


def test_triton_imported_before_the_course_is_one_clear_line():
    """Too late to choose: each Triton lesson's require_triton stops with how to recover, not a kernel error."""
    out = run("""
        import torch.utils.flop_counter                # triton imported, compiled-for-GPU, before helpers
        from helpers import lesson07, lesson10, triton_mode
        from helpers.lesson08 import gpu_section
        print(triton_mode.decided)
        for lesson in (lesson07, gpu_section, lesson10):
            try:
                lesson.require_triton()
            except triton_mode.TritonMissing as e:
                print(e._render_traceback_()[0])
    """)
    lines = out.splitlines()
    assert lines[0] == "too-late" and len(lines) == 4
    for line in lines[1:]:
        assert line.startswith("Run All stops here: Triton was imported before the course") and "restart the kernel" in line
