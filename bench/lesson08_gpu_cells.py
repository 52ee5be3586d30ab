# Lesson 08's GPU section, in jupytext percent format, for the coordinator to paste into
# solutions/08_*.ipynb after the CPU backward (one cell per `# %%` marker; the exercise's answer is
# between `### BEGIN SOLUTION` / `### END SOLUTION`, which helpers/generate.py turns into a stub).
# The cells assume nothing from the CPU part except `import torch`; they import what they use.

# %% [markdown]
# ## The backward as a GPU kernel
#
# The CPU backward you just wrote loops over key blocks outside and query blocks inside, so that
# each key block's `dK` and `dV` stay in one place while every query row that sees them streams
# past. A Triton kernel makes the outer loop a grid: **one program per `BLOCK_N` keys** of one
# (batch, head), holding `k`, `v` and the fp32 accumulators `dk`, `dv` in registers, and a loop over
# query blocks of `BLOCK_M` rows inside. Before it, a tiny **preprocess** kernel writes
# `D = rowsum(dO ∘ O)` and the forward's `lse` in base 2 (`lse2 = lse · log2 e`, and `+inf` for a
# row that saw no key, so its `P` comes out as `exp2(-inf) = 0` without a mask).
#
# | CPU (lesson 08) | Triton |
# | --- | --- |
# | `for j in range(0, Nk, Bc):` | `tl.program_id(0)`: one program per key block, all at once |
# | `Kj, Vj`, `dKj`, `dVj` | `k`, `v` `[BLOCK_N, d]`; `dk`, `dv` fp32 `[BLOCK_N, d]`, in registers |
# | `for i in range(0, N, Br):` | the loop you write: `for start_m in range(lo, hi, BLOCK_M)` |
# | `P = exp(S - lse)` | `pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])`, **transposed**: `[BLOCK_N, BLOCK_M]` |
# | `dV += P.T @ dO` | `dv = tl.dot(pT.to(do.dtype), do, dv)` |
# | `dP = dO @ V.T`; `dS = P * (dP - D)` | `dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])` |
# | `dK += dS.T @ Q * scale` | `dk = tl.dot(dsT.to(q.dtype), q, dk)` (the launcher multiplies by `sm_scale` once) |
#
# Working with `P` transposed keeps every product a plain `tl.dot` with the key block on the left:
# no transposes of the accumulators. `dQ` needs a sum over key blocks, i.e. over programs: the
# course's kernel runs a second kernel for it (query blocks outside, like the forward) rather than
# atomic adds from here, which the H200 measured slower and which are not deterministic.

# %%
import math
import os

import torch

if not torch.cuda.is_available():              # must be set before triton sees any @triton.jit
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from helpers import check, lesson08_gpu
from helpers.triton_attention_bwd import dkdv_teaching, flash_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device: {DEVICE}, triton {triton.__version__}, interpreter: {os.environ.get('TRITON_INTERPRET') == '1'}")

# %% [markdown]
# ### Exercise: the inner loop of the dK/dV kernel
#
# **Goal.** Write `dkdv_inner`, the loop over query blocks `[lo, hi)` of one program of the dK/dV
# kernel. It receives this program's keys and values and returns the updated accumulators.
#
# **Shapes.** `k`, `v`: `[BLOCK_N, HEAD_DIM]` (keys past `Nk` are zeros); `dk`, `dv`: fp32
# `[BLOCK_N, HEAD_DIM]`; `offs_n`: `[BLOCK_N]`, this program's key indices. `Q`, `DO` point at this
# head's `[N, HEAD_DIM]` rows (contiguous: row `i` starts at `i * HEAD_DIM`); `LSE2`, `DELTA` at its
# `[N]` base-2 lse and `D`. `qk_scale = sm_scale · log2 e`.
#
# **Constraints.** Query rows past `N` must not be read (mask the loads; give `lse2` the value
# `+inf` there so `P = 0`). Keys past `Nk` and, with `CAUSAL`, keys after the row (`j > i`, SDPA's
# top-left mask) must get `P = 0`. One `exp2` per score; no `exp`.
#
# **Hint.** Nine lines in the loop: the row indices, four masked loads, `pT`, the mask, `dv`, `dsT`,
# `dk`. The launcher starts causal programs at the first query block that can see their keys.

# %%
@triton.jit
def dkdv_inner(dk, dv, k, v, Q, DO, LSE2, DELTA, lo, hi, offs_n, N, Nk, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Stream query blocks [lo, hi) past this program's keys -> (dk, dv), fp32 [BLOCK_N, HEAD_DIM]."""
    ### BEGIN SOLUTION
    offs_d = tl.arange(0, HEAD_DIM)                                               # [D]
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)                                    # [BLOCK_M] query rows
        row_ok = rows < N
        ptrs = rows[:, None] * HEAD_DIM + offs_d[None, :]                         # [BLOCK_M, D]
        q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)                    # [BLOCK_M, D]
        do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)                  # [BLOCK_M, D]
        lse2 = tl.load(LSE2 + rows, mask=row_ok, other=float("inf"))              # [BLOCK_M] padding: P = 0
        delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)                     # [BLOCK_M]
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])      # [BLOCK_N, BLOCK_M]
        keep = offs_n[:, None] < Nk                                               # [BLOCK_N, 1]
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= rows[None, :])                      # [BLOCK_N, BLOCK_M]
        pT = tl.where(keep, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)                                      # [BLOCK_N, D] += P^T dO
        dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])                     # [BLOCK_N, BLOCK_M]
        dk = tl.dot(dsT.to(q.dtype), q, dk)                                       # [BLOCK_N, D] += dS^T q
    return dk, dv
    ### END SOLUTION

# %%
check.dkdv_inner(dkdv_inner)

# %% [markdown]
# The course's tuned kernel (`helpers/triton_attention_bwd.py`) is this loop three times over, one
# copy per tile class as in the forward: query blocks on the causal band or the ragged row tail run
# the masked copy, blocks that see every key of the program run a copy with no mask at all, and
# blocks before the band are never visited. `flash_attention(q, k, v, causal=True)` wraps the forward
# and both backward kernels in a `torch.autograd.Function`, so it trains like SDPA:

# %%
torch.manual_seed(0)
dt = torch.float16 if DEVICE == "cuda" else torch.float32
q, k, v = (torch.randn(2, 2, 45, 32, device=DEVICE, dtype=dt, requires_grad=True) for _ in range(3))
do = torch.randn(2, 2, 45, 32, device=DEVICE, dtype=dt)
flash_attention(q, k, v, causal=True).backward(do)
_, dq_ref, dk_ref, dv_ref = lesson08_gpu.reference_grads(q, k, v, do, causal=True)
for name, got, ref in (("dq", q.grad, dq_ref), ("dk", k.grad, dk_ref), ("dv", v.grad, dv_ref)):
    print(f"{name}: max |flash_attention - float64| = {(got.double().cpu() - ref).abs().max().item():.2e}")

# %% [markdown]
# ### On an H200: the backward timed against PyTorch's
#
# Recorded by `bench/bench_bwd.py` (`make bench`): the backward alone (`o.backward(do)` after one
# forward), median of `triton.testing.do_bench`, FLOPs `2.5 · 4·B·H·N²·d` (two matmuls forward
# become five backward), halved when causal. Every row was first checked against float64 autograd
# (each gradient within 2× SDPA's own error). On a CPU-only machine these are the committed figures.

# %%
res = lesson08_gpu.load_results()
if res is None or not res.get("backward"):
    print("no recorded backward results (bench/results/h200.json has no 'backward' rows yet)")
else:
    print(lesson08_gpu.backward_table(res))
    for other, label in (("sdpa_flash_tflops", "SDPA flash"), ("sdpa_cudnn_tflops", "SDPA cuDNN")):
        print(f"geometric mean over N >= 2048, Triton / {label}: {lesson08_gpu.geomean_ratio(res, other):.2f}x")
    lesson08_gpu.plot_backward(res)

# %% [markdown]
# What the table says: the course's kernel beats SDPA's flash backend (FlashAttention-2's CUDA
# kernel, built for the A100) by about 1.2×, and stays behind cuDNN's Hopper kernel (about 0.7×),
# which keeps the tensor cores busy with warp-specialised producer and consumer warps and
# asynchronous matrix instructions: the same gap as in the forward, wider, because the backward has
# five matmuls and two of them wait on an elementwise step (`dS = P ∘ (dP − D)`). See
# bench/NOTES.md for each version's prediction and outcome.
#
# ### A GPT trained with it
#
# `bench/train_gpt.py`: a 6-layer GPT (context 2048) trained 300 steps on the course's own text with
# `flash_attention`, and again from the same seed and batches with SDPA.

# %%
rec = lesson08_gpu.load_training()
if rec is None:
    print("no training record yet (bench/results/train_gpt.json)")
else:
    print(lesson08_gpu.training_summary(rec))
    lesson08_gpu.plot_training(rec)
