"""A first FlashAttention forward in Gluon for Hopper (sm_90): TMA loads with mbarriers, ``warpgroup_mma``
for both GEMMs, the online softmax in base 2. Lesson 11's GPU section.

What it is: one program per (query block, batch·head), ``num_warps = BLOCK_M // 16`` warps. It loads its Q tile
once with the TMA, then streams K_j, V_j through a ring of ``NUM_STAGES`` shared-memory stages, each with its own
mbarrier (``full[s]``): tile j waits on stage ``j % NUM_STAGES`` with phase parity ``(j // NUM_STAGES) % 2``, the
rule lesson 11's exercise and simulator teach. The same warps issue the loads and compute on them (no warp
specialisation yet), so a stage is refilled only after both GEMMs that read it have completed; the loads of the
next ``NUM_STAGES - 1`` tiles are in flight while a tile is computed. Non-causal, d = 64 or 128, bf16 or fp16,
ragged N and Nk. Returns ``(O, lse)`` like ``flash_attn_triton`` (lse in natural log, float32).

What it is not yet: FA3's two consumer warpgroups in ping-pong, or the intra-warpgroup overlap of the softmax
with the next QKᵀ (``_attn_fwd_ws`` has the producer warp and one consumer partition). Written against Gluon as
shipped in Triton 3.6 (``triton.experimental.gluon``; it also compiles under 3.9, where the TMA load is named
``async_load``). Nothing here runs under Triton's interpreter.

On an sm_90 GPU: ``python -m helpers.kernels.gluon_forward`` (``gluon_forward_selftest()``, one line per case);
add ``--warp-specialize`` for ``_attn_fwd_ws``, the same kernel split as FA3 splits it (a producer warp that only
issues TMA loads, the compute warps, full and empty barriers per stage: lesson 11's schedule with one consumer).
Both compile for sm_90; neither has run natively yet.
Without one: ``compile_for_sm90(d, dtype, warp_specialize)`` compiles it for sm_90 (TTGIR, PTX, a cubin through the
ptxas in Triton's wheel; no GPU needed) and returns the PTX.
"""
from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

__all__ = ["gluon_forward", "gluon_forward_selftest", "compile_for_sm90", "BLOCKS"]

# The TMA load's name: async_copy_global_to_shared in Triton 3.6 (the GPU machine's), async_load from 3.7 on.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453     # ln(2): a base-2 lse times LN2 is the natural-log lse

# (BLOCK_M, BLOCK_N, NUM_STAGES) per head dim: BLOCK_M // 16 warps; shared memory for bf16 at d = 128:
# Q 32 KiB + 2 stages x (K + V) 2 x 16 KiB = 96 KiB.
BLOCKS = {64: (128, 128, 2), 128: (128, 64, 2)}


@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, O, LSE, N, Nk, qk_scale,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    start_m = gl.program_id(0)                                   # which query block
    off_bh = gl.program_id(1)                                    # which (batch, head)
    q_row = off_bh * N + start_m * BLOCK_M                       # first row of this block in q viewed [B*H*N, d]
    kv_row = off_bh * Nk                                         # first key of this head in k viewed [B*H*Nk, d]

    # wgmma layouts: S = Q K^T is [BLOCK_M, BLOCK_N], acc = P V is [BLOCK_M, HEAD_DIM]; one warp per 16 rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)   # P from registers
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)            # [BLOCK_M] vectors beside S
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)            # [BLOCK_M] vectors beside acc
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)            # [BLOCK_N] key indices

    # shared memory: Q once, a ring of NUM_STAGES (K, V) stages, one barrier for Q and one per stage
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(i), count=1)
    fence_async_shared()                                         # the barriers' init before the TMA sees them

    kv_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    n_tiles = gl.cdiv(Nk, BLOCK_N)
    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(NUM_STAGES):                        # prologue: fill the ring, tile i into stage i
        if i < n_tiles:
            mbarrier.expect(full.index(i), kv_bytes)
            _tma_load(k_desc, [kv_row + i * BLOCK_N, 0], full.index(i), k_smem.index(i))
            _tma_load(v_desc, [kv_row + i * BLOCK_N, 0], full.index(i), v_smem.index(i))

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)   # running max (base 2)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)                 # running sum of exp2
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)    # running numerator
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)                        # [BLOCK_N]
    mbarrier.wait(q_bar, 0)

    for j in range(n_tiles):
        s = j % NUM_STAGES                                       # stage of tile j
        mbarrier.wait(full.index(s), (j // NUM_STAGES) & 1)      # parity flips each lap of the ring
        k_tile = k_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        v_tile = v_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False)   # [BLOCK_M, BLOCK_N] fp32
        keep = (j * BLOCK_N + offs_n) < Nk                       # keys past Nk: the next head's, or TMA's zeros
        qk = gl.where(keep[None, :], qk * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))                   # [BLOCK_M] finite: tile j holds a key
        p = gl.exp2(qk - m_new[:, None])                         # [BLOCK_M, BLOCK_N]
        alpha = gl.exp2(m_i - m_new)                             # [BLOCK_M]
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)          # [BLOCK_M, BLOCK_N] as wgmma's A operand
        acc = warpgroup_mma(p_op, v_tile, acc)                   # [BLOCK_M, HEAD_DIM]; synchronous: stage s is free
        m_i = m_new
        nxt = j + NUM_STAGES                                     # refill stage s with the tile one lap ahead
        if nxt < n_tiles:
            mbarrier.expect(full.index(s), kv_bytes)
            _tma_load(k_desc, [kv_row + nxt * BLOCK_N, 0], full.index(s), k_tile)
            _tma_load(v_desc, [kv_row + nxt * BLOCK_N, 0], full.index(s), v_tile)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))

    # epilogue: O = acc / l, lse = (m + log2 l) ln 2; rows past N are not stored (they belong to the next head)
    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)     # [BLOCK_M] rows of this head
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # [HEAD_DIM]
    row_ok = offs_m < N
    o_ptrs = O + (off_bh * N + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    gl.store(o_ptrs, acc.to(dtype), mask=row_ok[:, None])
    lse = gl.convert_layout((m_i + gl.log2(l_i)) * 0.6931471805599453, row_o)
    gl.store(LSE + off_bh * N + offs_m, lse, mask=row_ok)


# ------------------------------------------------------------------ FA3's split: a producer warp, a consumer partition
@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row, kv_row, n_tiles,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One warp that only loads: Q once, then tile j into stage j % NUM_STAGES once the consumers released it."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for j in range(n_tiles):
        s = j % NUM_STAGES
        mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)    # lap r waits parity (r+1)%2: lap 0 passes
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row + j * BLOCK_N, 0], full.index(s), k_smem.index(s))
        _tma_load(v_desc, [kv_row + j * BLOCK_N, 0], full.index(s), v_smem.index(s))


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, full, empty, n_tiles, Nk, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 num_warps: gl.constexpr):
    """The compute warps: wait for tile j's stage, both GEMMs and the online softmax, release the stage."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)   # running max (base 2)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)                 # running sum of exp2
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)    # running numerator
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        s = j % NUM_STAGES
        mbarrier.wait(full.index(s), (j // NUM_STAGES) & 1)      # lap r waits parity r%2
        qk = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False)   # [BLOCK_M, BLOCK_N]
        keep = (j * BLOCK_N + offs_n) < Nk
        qk = gl.where(keep[None, :], qk * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        p = gl.exp2(qk - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(s), acc)   # synchronous
        mbarrier.arrive(empty.index(s), count=1)                 # both GEMMs done reading stage s: release it
        m_i = m_new
    return acc, l_i, m_i


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, O, LSE, N, Nk, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    q_row = off_bh * N + start_m * BLOCK_M
    kv_row = off_bh * Nk
    n_tiles = gl.cdiv(Nk, BLOCK_N)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(i), count=1)                    # completed by the TMA's bytes
        mbarrier.init(empty.index(i), count=1)                   # completed by the consumer partition's release
    fence_async_shared()

    acc, l_i, m_i = gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, full, empty, n_tiles, Nk, qk_scale,
                        HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, num_warps)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row, kv_row, n_tiles,
                        BLOCK_N, NUM_STAGES)),
    ], [1], [24])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    row_ok = offs_m < N
    gl.store(O + (off_bh * N + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], acc.to(dtype), mask=row_ok[:, None])
    lse = gl.convert_layout((m_i + gl.log2(l_i)) * 0.6931471805599453, row_o)
    gl.store(LSE + off_bh * N + offs_m, lse, mask=row_ok)


def _gl_dtype(torch_dtype):
    import torch
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


def gluon_forward(q, k, v, sm_scale=None, warp_specialize=False):
    """(O, lse) of non-causal attention: q ``[B, H, N, d]``, k, v ``[B, H, Nk, d]`` on an sm_90 GPU, bf16 or fp16,
    d = 64 or 128. O has q's dtype, lse is float32 in natural log. ``warp_specialize``: FA3's split, a producer warp
    that only loads and the compute warps, handing stages over through full/empty barriers (not yet run natively)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, H, N, d = q.shape
    Nk = k.shape[2]
    assert k.shape == v.shape == (B, H, Nk, d), "k and v must be [B, H, Nk, d] with q's B, H, d"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16), "bf16 or fp16, all alike"
    assert d in BLOCKS, f"d must be one of {sorted(BLOCKS)}"
    assert q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0), "needs an sm_90 GPU (H100, H200)"
    BLOCK_M, BLOCK_N, NUM_STAGES = BLOCKS[d]
    q2 = q.contiguous().view(B * H * N, d)                       # [B*H*N, d]
    k2 = k.contiguous().view(B * H * Nk, d)                      # [B*H*Nk, d]
    v2 = v.contiguous().view(B * H * Nk, d)
    el = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], el)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], el)
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, d], kv_layout)
    o = torch.empty_like(q)                                      # [B, H, N, d]
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    qk_scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    grid = (triton.cdiv(N, BLOCK_M), B * H)
    kernel = _attn_fwd_ws if warp_specialize else _attn_fwd
    kernel[grid](q_desc, k_desc, v_desc, o, lse, N, Nk, qk_scale,
                    HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
                    num_warps=BLOCK_M // 16)
    return o, lse


def compile_for_sm90(d=128, dtype="bf16", warp_specialize=False):
    """Compile the kernel for sm_90 with Triton's own compiler, no GPU needed; returns the PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    BLOCK_M, BLOCK_N, NUM_STAGES = BLOCKS[d]
    el = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], el)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], el)
    num_warps = BLOCK_M // 16
    sig = {"q_desc": f"tensordesc<{dtype}[{BLOCK_M}, {d}],{q_layout!r}>",
           "k_desc": f"tensordesc<{dtype}[{BLOCK_N}, {d}],{kv_layout!r}>",
           "v_desc": f"tensordesc<{dtype}[{BLOCK_N}, {d}],{kv_layout!r}>",
           "O": f"*{dtype}", "LSE": "*fp32", "N": "i32", "Nk": "i32", "qk_scale": "fp32",
           "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr",
           "num_warps": "constexpr"}
    const = {"HEAD_DIM": d, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "NUM_STAGES": NUM_STAGES, "num_warps": num_warps}
    src = GluonASTSource(_attn_fwd_ws if warp_specialize else _attn_fwd, sig, const)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return kernel.asm["ptx"]


def gluon_forward_selftest(shapes=None, seed=0, warp_specialize=False):
    """On an sm_90 GPU: the kernel against float64 attention on harsh shapes (ragged N and Nk, N = 1, Nk = 1,
    large logits), bf16 and fp16, d = 64 and 128. The bound per case is 2 x SDPA's own error in that dtype plus the
    output's rounding. A case that raises is recorded as failed (its error in ``rows``), and the others still run.
    Returns {"cases", "worst" (max |O - O64|), "worst_lse", "ok", "rows"}."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(seed)
    shapes = shapes or [(2, 3, 1000, 1000), (1, 2, 1, 77), (1, 2, 130, 1), (2, 2, 257, 1029), (1, 4, 2048, 2048)]
    rows, worst, worst_lse, ok = [], 0.0, 0.0, True
    for dt in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for B, H, N, Nk in shapes:
                row = dict(dtype=str(dt).replace("torch.", ""), d=d, shape=(B, H, N, Nk))
                big = 4.0 if N == 257 else 1.0                   # large logits in one shape
                q = (torch.randn(B, H, N, d, device="cuda") * big).to(dt)
                k, v = (torch.randn(B, H, Nk, d, device="cuda").to(dt) for _ in range(2))
                try:
                    o, lse = gluon_forward(q, k, v, warp_specialize=warp_specialize)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - one report for the whole run
                    ok = False
                    rows.append(dict(row, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    continue
                q64, k64, v64 = q.double(), k.double(), v.double()
                s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(d)         # [B, H, N, Nk]
                lse64 = torch.logsumexp(s, -1)
                o64 = torch.softmax(s, -1) @ v64
                sdpa = (F.scaled_dot_product_attention(q, k, v).double() - o64).abs().max().item()
                err = (o.double() - o64).abs().max().item()
                err_lse = (lse.double() - lse64).abs().max().item()
                bound = 2 * sdpa + torch.finfo(dt).eps * o64.abs().max().item()
                good = bool(torch.isfinite(o).all()) and err <= bound and \
                    err_lse <= 1e-3 * max(1.0, lse64.abs().max().item())
                ok &= good
                worst, worst_lse = max(worst, err), max(worst_lse, err_lse)
                rows.append(dict(row, err=err, bound=bound, sdpa_err=sdpa, lse_err=err_lse, ok=good))
    return {"cases": len(rows), "worst": worst, "worst_lse": worst_lse, "ok": ok, "rows": rows}


if __name__ == "__main__":     # on an sm_90 GPU: python -m helpers.kernels.gluon_forward [--warp-specialize]
    import sys

    import torch
    ws = "--warp-specialize" in sys.argv[1:]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{'warp-specialised (producer warp + consumer warps)' if ws else 'one partition'}")
    result = gluon_forward_selftest(warp_specialize=ws)
    for r in result["rows"]:
        print(r)
    print(f"{result['cases']} cases, worst |O - float64| {result['worst']:.2e}, worst |lse - float64| "
          f"{result['worst_lse']:.2e}: {'ALL OK' if result['ok'] else 'FAILURES ABOVE'}")
