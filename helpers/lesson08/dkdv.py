"""Lesson 08's teaching launcher: the dK/dV kernel with the inner loop passed in (``dkdv_teaching``).

The learner writes ``dkdv_inner`` (a ``@triton.jit`` function) in notebook 08; ``_teach_dkdv`` is the program
around it (one program per BLOCK_N keys of one (batch, head), top-left causal), and the preprocess (D and the
base-2 lse) is the course's own (``helpers.kernels.backward._bwd_preprocess``). ``helpers.lesson08.check_gpu``
grades the learner's loop through it. Imports Triton: import it only where Triton may be imported
(``helpers`` chooses the interpreter first).
"""

import math

import torch
import triton
import triton.language as tl

from ..kernels.backward import _PRE_BLOCK_M, _bwd_preprocess, _check_inputs
from ..kernels.common import LOG2E
from ..kernels.forward import flash_attn_triton
from ..triton_mode import interpreting

__all__ = ["dkdv_teaching"]


@triton.jit
def _teach_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV,  # contiguous [B*H, rows, D]; LSE2, DELTA [B*H, N]
    N, Nk, qk_scale, sm_scale,
    INNER: tl.constexpr,  # the learner's @triton.jit inner loop
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    # grid = (cdiv(Nk, BLOCK_N), B * H): one program owns BLOCK_N keys of one (batch, head)
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] this program's keys
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    kv_ptrs = off_bh * Nk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_N, D]
    key_ok = offs_n < Nk
    k = tl.load(K + kv_ptrs, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
    v = tl.load(V + kv_ptrs, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # rows before start_n see none of these keys (top-left: row i sees keys j <= i)
        lo = (start_n // BLOCK_M) * BLOCK_M
    dk, dv = INNER(dk, dv, k, v, Q + off_bh * N * HEAD_DIM, DO + off_bh * N * HEAD_DIM, LSE2 + off_bh * N,
                   DELTA + off_bh * N, lo, N, offs_n, N, Nk, qk_scale, HEAD_DIM, BLOCK_M, CAUSAL)
    tl.store(DK + kv_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


def dkdv_teaching(q, k, v, do, inner, causal=False, sm_scale=None, *, o=None, lse=None, block=None):
    """(dk, dv) from lesson 08's dK/dV kernel with ``inner`` (a ``@triton.jit`` inner loop) as its loop.

    q, do: [B, H, N, d]; k, v: [B, H, Nk, d]; causal is top-left (SDPA's). The forward (O, lse) comes
    from ``flash_attn_triton`` unless given; D and the base-2 lse from the preprocess kernel.
    ``inner(dk, dv, k, v, q_ptr, do_ptr, lse2_ptr, delta_ptr, lo, hi, offs_n, N, Nk, qk_scale,
    HEAD_DIM, BLOCK_M, CAUSAL) -> (dk, dv)``. Tiles: 16 x 16 under the interpreter, 64 x 64 on a GPU.
    """
    if not isinstance(inner, triton.runtime.JITFunction) and not hasattr(inner, "fn"):
        raise TypeError("inner must be a @triton.jit function (decorate your dkdv_inner with @triton.jit)")
    B, H, Hkv, N, Nk, d = _check_inputs(q, k, v, bool(causal), "top_left")
    if Hkv != H:
        raise ValueError(f"dkdv_teaching takes k, v with q's {H} heads (no grouped-query attention); got {Hkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"dkdv_teaching takes a head dim that is a power of two >= 16; got {d}")
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do must have q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if o is None or lse is None:
        o, lse = flash_attn_triton(q, k, v, causal=bool(causal), sm_scale=sm_scale)
    do = do.to(q.dtype).contiguous()
    delta = torch.empty((B, H, N), device=q.device, dtype=torch.float32)  # [B, H, N]
    lse2 = torch.empty_like(delta)  # [B, H, N]
    _bwd_preprocess[(triton.cdiv(N, _PRE_BLOCK_M), B * H)](o, do, lse, delta, lse2, N, N * d, d, HEAD_DIM=d,
                                                           BLOCK_M=_PRE_BLOCK_M, BLOCK_D=d)
    bm, bn = block or ((16, 16) if interpreting() else (64, 64))
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # [B, H, Nk, d]
    _teach_dkdv[(triton.cdiv(Nk, bn), B * H)](q, k, v, do, lse2, delta, dk, dv, N, Nk, float(sm_scale) * LOG2E.value,
                                              float(sm_scale), INNER=inner, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                                              CAUSAL=bool(causal), num_warps=4, num_stages=2)
    return dk, dv
