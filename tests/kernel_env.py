"""Where the Triton kernel tests run: natively on a CUDA GPU (fp16, bf16), else on the CPU under Triton's
interpreter (fp32, fp16). Import it before anything that imports Triton: it sets TRITON_INTERPRET=1 when
there is no GPU (Triton reads it once)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.triton_mode import interpreting  # noqa: E402

ON_GPU = torch.cuda.is_available() and not interpreting()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}  # max abs error against float64
