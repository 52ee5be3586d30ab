"""A first FlashAttention forward in Gluon for Hopper (sm_90): TMA loads with mbarriers, ``warpgroup_mma``
for both GEMMs, the online softmax in base 2. Lesson 11's GPU section.

What it is: one program per (query block, batch·head), ``num_warps = BLOCK_M // 16`` warps. It loads its Q tile
once with the TMA, then streams K_j, V_j through a ring of ``NUM_STAGES`` shared-memory stages, each with its own
mbarrier (``full[s]``): tile j waits on stage ``j % NUM_STAGES`` with phase parity ``(j // NUM_STAGES) % 2``, the
rule lesson 11's exercise and simulator teach. The same warps issue the loads and compute on them (no warp
specialisation yet), so a stage is refilled only after both GEMMs that read it have completed; the loads of the
next ``NUM_STAGES - 1`` tiles are in flight while a tile is computed. d = 64 or 128, bf16 or fp16, ragged N and Nk,
GQA (k, v may have fewer heads than q: the KV descriptor's row offset is the KV head's). Returns ``(O, lse)`` like
``flash_attn_triton`` (lse in natural log, float32).

Causal (``causal=True``, ``align`` "top_left" or "bottom_right", ``flash_attn_triton``'s rule: row i sees key j when
j <= i + diag): a program visits key tiles only up to its last row's diagonal (``_n_tiles``), the tiles every row sees
in full go through the loop with no mask, and only the tiles on the diagonal band and the ragged last tile are
masked, with ``where`` on the S tile in registers (``_n_free``, ``_softmax_tile``; the ``CAUSAL`` and ``MASK``
constexprs). The grid is (query blocks, B·H) with the query block read backwards, so each head's heaviest query blocks
launch first and the CTAs running side by side read one head's K and V (L2 hits; see ``_program_ids``). Where a
producer and consumers share the ring, the kernel computes ``n_tiles`` once per program and hands the same value to
each partition: the barriers' phase rule is unchanged, only the number of laps differs between programs. A row that
sees no key gets O = 0 and lse = -inf.

More variants (``gluon_forward(..., variant=...)``, ``VARIANTS``):
* ``"ws"``, ``_attn_fwd_ws``: FA3's split with ``gl.warp_specialize``, a producer warp that only issues TMA loads and
  one consumer partition, full and empty barriers per stage (lesson 11's schedule with one consumer). It adds
  hand-overs but overlaps no softmax with the tensor cores.
* ``"overlap"`` and ``"pp"``, ``_attn_fwd_pp``: the producer warp feeds two consumer warpgroups, each owning 64 of the
  CTA's 128 query rows (empty barriers expect two releases). Each warpgroup issues S_j = Q K_jᵀ and P_{j-1} V_{j-1}
  asynchronously, waits for S_j alone and runs tile j's softmax while P_{j-1} V_{j-1} is on the tensor cores (FA3's
  intra-warpgroup overlap, Algorithm 2). ``"pp"`` adds ping-pong: the warpgroups take turns to issue their GEMMs
  (two mbarriers, ``turn``; FA3 uses named barriers), so one's softmax runs under the other's GEMMs. ``"pp128"`` is
  ``"pp"`` with 128 rows per warpgroup (CTA 256 rows), an experiment and not FA3's tile. At d = 128 FlashAttention-3
  takes 128 query rows a CTA, split over two MMA warpgroups of 64 rows each (flash-attention ``hopper/tile_size.h``,
  and ``kBlockM / 64`` warpgroups in ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp``), which is what ``"pp"`` does
  (``PP128_BLOCKS``; ``"pp128"`` spills at d = 128).
  The kernel loops over work items (2 x BLOCK_M query rows of one head), its ring's phases running on from one item
  to the next and Q's buffer handed back through a barrier of its own (``q_free``): these variants launch one
  program per item, ``"ppp"`` one per SM (persistent, as FA3's ``StaticPersistentTileScheduler``), so an item's
  epilogue overlaps the next item's first loads.

What each variant measured, and the self-tests behind them: their records in ``bench/results/`` (``gluon_h200*.json``,
``gluon_forward_h200.json``, ``logs/``), shown with their GPU, versions and dates by lesson 11
(``helpers/lesson11/records.py``); the runs' history is ``bench/NOTES.md``'s.
Written against Gluon as shipped in Triton 3.6 (``triton.experimental.gluon``); it also compiles under 3.9. The TMA
load is ``async_copy_global_to_shared`` in 3.6 and 3.7 and ``async_load`` from 3.8 (``_tma_load``). Nothing here
runs under Triton's interpreter.

On an sm_90 GPU: ``python -m helpers.kernels.gluon_forward [--variant one|ws|overlap|pp|pp128] [--causal]``
(``gluon_forward_selftest()``, one line per case; ``--warp-specialize`` is ``--variant ws``), and
``bench/bench_gluon.py --variant ...`` for the timings. ``gluon_forward`` checks its inputs on the host first
(TypeError/ValueError; a CPU tensor: "needs an sm_90 GPU").
Without one: ``compile_for_sm90(d, dtype, variant=..., causal=...)`` compiles a variant for sm_90 (TTGIR, PTX, a
cubin through the ptxas in Triton's wheel; no GPU needed) and returns the PTX.
"""
from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .common import LN2, LOG2E, _check_dense_kv

__all__ = ["gluon_forward", "gluon_forward_selftest", "compile_for_sm90", "BLOCKS", "PP_BLOCKS", "PP128_BLOCKS",
           "VARIANTS", "AUTO_VARIANT"]

# The TMA load's name: async_copy_global_to_shared in Triton 3.6 (the GPU machine's) and 3.7, async_load from 3.8 on
# (3.8 keeps the old name as an alias, 3.9 removes it).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

# (BLOCK_M, BLOCK_N, NUM_STAGES) per head dim: BLOCK_M // 16 warps; shared memory for bf16 at d = 128:
# Q 32 KiB + 2 stages x (K + V) 2 x 16 KiB = 96 KiB.
BLOCKS = {64: (128, 128, 2), 128: (128, 64, 2)}


# ------------------------------------------------------------------ pieces every variant shares
@gluon.jit
def _program_ids(CAUSAL: gl.constexpr):
    """(query block, batch·head) of this program; grid (query blocks, B*H). Causal: the query block is read from the
    end, so every head's last query blocks, which visit the most key tiles, launch first and the light ones fill in
    behind them. The CTAs that run side by side are one head's (the grid's first axis varies fastest): they read the
    same K and V, which stay in L2. (A first version ran the grid as (B*H, query blocks), one query block of every
    head side by side: each CTA streamed another head's K and V from HBM, and the causal rows fell far behind their
    non-causal twins while the Triton forward's did not; lesson 11 shows the sweep that found it, bench/NOTES.md has
    the run.)"""
    start_m = gl.program_id(0)
    if CAUSAL:
        start_m = gl.num_programs(0) - 1 - start_m
    off_bh = gl.program_id(1)
    return start_m, off_bh


@gluon.jit
def _n_tiles(last_row, Nk, diag, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many key tiles a program visits: all of them, or (causal) up to its last row's diagonal (row i sees key c
    when c <= i + diag). At least one: a program whose rows see nothing masks all of tile 0. The producer and the
    consumers must agree on this number or the ring's barriers deadlock: the kernel computes it once, from the
    program's last row (below N), and hands the same value to every partition."""
    n_keys = Nk
    if CAUSAL:
        n_keys = gl.minimum(n_keys, last_row + diag + 1)         # keys the last row sees
    return gl.cdiv(gl.maximum(n_keys, 1), BLOCK_N)


@gluon.jit
def _n_free(first_row, Nk, diag, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Tiles [0, this) need no mask: all their keys are < Nk and (causal) on or left of first_row's diagonal, so of
    every row's. The tiles after them, up to n_tiles, are the masked ones: the diagonal band and the ragged last."""
    n = Nk // BLOCK_N
    if CAUSAL:
        n = gl.minimum(n, gl.maximum(first_row + diag + 1, 0) // BLOCK_N)
    return n


@gluon.jit
def _softmax_tile(qk, m_i, l_i, j, offs_m, offs_n, Nk, diag, qk_scale,
                  BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """The online softmax of key tile j. qk = Q K_j^T [BLOCK_M, BLOCK_N] fp32, unscaled; m_i, l_i [BLOCK_M]; offs_m
    [BLOCK_M] the rows' indices in the sequence, offs_n [BLOCK_N] 0..BLOCK_N-1. With MASK, key c of row i counts
    when c < Nk and (causal) c <= i + diag; the others become -inf in registers. Returns (p, alpha, m_new, l_new)."""
    if MASK:
        cols = j * BLOCK_N + offs_n                              # [BLOCK_N] key indices
        keep = (cols < Nk)[None, :]                              # keys past Nk: the next head's, or TMA's zeros
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + diag)      # [BLOCK_M, BLOCK_N]
        qk = gl.where(keep, qk * qk_scale, float("-inf"))        # [BLOCK_M, BLOCK_N] base-2 units
        m_new = gl.maximum(m_i, gl.max(qk, 1))                   # [BLOCK_M]
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)     # a row that saw no key yet: P = 0, alpha = 0, no NaN
        p = gl.exp2(qk - m_use[:, None])                         # [BLOCK_M, BLOCK_N]
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)        # [BLOCK_M] finite: every key counts
        m_use = m_new
        p = gl.exp2(qk * qk_scale - m_use[:, None])              # [BLOCK_M, BLOCK_N], one FMA and exp2 per score
    alpha = gl.exp2(m_i - m_use)                                 # [BLOCK_M]
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _store_rows(O, LSE, acc, m_i, l_i, off_bh, first_row, N, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                o_layout: gl.constexpr):
    """The epilogue of BLOCK_M rows from first_row: O = acc / l, lse = (m + log2 l) ln 2; a row that saw no key gets
    O = 0, lse = -inf. Rows past N are not stored (they belong to the next head)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)                          # [BLOCK_M]
    seen = l_o > 0.0
    acc = acc / gl.where(seen, l_o, 1.0)[:, None]                # [BLOCK_M, HEAD_DIM]
    lse = gl.where(seen, (gl.convert_layout(m_i, row_o) + gl.log2(l_o)) * LN2, float("-inf"))   # [BLOCK_M]
    offs_m = first_row + gl.arange(0, BLOCK_M, layout=row_o)    # [BLOCK_M] rows of this head
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # [HEAD_DIM]
    row_ok = offs_m < N
    gl.store(O + (off_bh * N + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    gl.store(LSE + off_bh * N + offs_m, lse, mask=row_ok)


@gluon.jit
def _tiles_sync(lo, hi, q_smem, k_smem, v_smem, full, empty, k_desc, v_desc, kv_row, n_tiles, acc, m_i, l_i, s_zero,
                offs_m, offs_n, Nk, diag, qk_scale, p_layout: gl.constexpr, row_o: gl.constexpr,
                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                REFILL: gl.constexpr):
    """Key tiles [lo, hi) of the partition that computes, both GEMMs synchronous. REFILL ("one"): it refills the
    stage it just read with the tile one lap ahead itself (``empty`` unused); else ("ws"'s consumer) it releases the
    stage to the producer warp (``k_desc``, ``v_desc`` unused)."""
    dtype: gl.constexpr = q_smem.dtype
    for j in range(lo, hi):
        s = j % NUM_STAGES                                       # stage of tile j
        mbarrier.wait(full.index(s), (j // NUM_STAGES) & 1)      # lap r waits parity r%2
        k_tile = k_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        v_tile = v_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False)   # [BLOCK_M, BLOCK_N] fp32
        p, alpha, m_i, l_i = _softmax_tile(qk, m_i, l_i, j, offs_m, offs_n, Nk, diag, qk_scale, BLOCK_N, MASK, CAUSAL)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)          # [BLOCK_M, BLOCK_N] as wgmma's A operand
        acc = warpgroup_mma(p_op, v_tile, acc)                   # [BLOCK_M, HEAD_DIM]; synchronous: stage s is free
        if REFILL:
            nxt = j + NUM_STAGES                                 # refill stage s with the tile one lap ahead
            if nxt < n_tiles:
                mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_row + nxt * BLOCK_N, 0], full.index(s), k_tile)
                _tma_load(v_desc, [kv_row + nxt * BLOCK_N, 0], full.index(s), v_tile)
        else:
            mbarrier.arrive(empty.index(s), count=1)             # both GEMMs done reading stage s: release it
    return acc, m_i, l_i


# ------------------------------------------------------------------ "one": the same warps load and compute
@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, O, LSE, N, Nk, group, diag, qk_scale,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_bh = _program_ids(CAUSAL)                       # which query block, which (batch, head)
    q_row = off_bh * N + start_m * BLOCK_M                       # first row of this block in q viewed [B*H*N, d]
    kv_row = (off_bh // group) * Nk                              # first key of its KV head in k viewed [B*Hkv*Nk, d]
    n_tiles = _n_tiles(gl.minimum(start_m * BLOCK_M + BLOCK_M, N) - 1, Nk, diag, BLOCK_N, CAUSAL)
    n_free = gl.minimum(_n_free(start_m * BLOCK_M, Nk, diag, BLOCK_N, CAUSAL), n_tiles)

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

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(NUM_STAGES):                        # prologue: fill the ring, tile i into stage i
        if i < n_tiles:
            mbarrier.expect(full.index(i), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row + i * BLOCK_N, 0], full.index(i), k_smem.index(i))
            _tma_load(v_desc, [kv_row + i * BLOCK_N, 0], full.index(i), v_smem.index(i))

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)   # running max (base 2)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)                 # running sum of exp2
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)    # running numerator
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)    # [BLOCK_M] rows of this head
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)                        # [BLOCK_N]
    mbarrier.wait(q_bar, 0)
    # off-band tiles, no mask; then the band (causal) and the ragged last tile, masked
    acc, m_i, l_i = _tiles_sync(0, n_free, q_smem, k_smem, v_smem, full, None, k_desc, v_desc, kv_row, n_tiles,
                                acc, m_i, l_i, s_zero, offs_m, offs_n, Nk, diag, qk_scale, p_layout, row_o,
                                BLOCK_N, NUM_STAGES, False, CAUSAL, True)
    acc, m_i, l_i = _tiles_sync(n_free, n_tiles, q_smem, k_smem, v_smem, full, None, k_desc, v_desc, kv_row, n_tiles,
                                acc, m_i, l_i, s_zero, offs_m, offs_n, Nk, diag, qk_scale, p_layout, row_o,
                                BLOCK_N, NUM_STAGES, True, CAUSAL, True)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))
    _store_rows(O, LSE, acc, m_i, l_i, off_bh, start_m * BLOCK_M, N, HEAD_DIM, BLOCK_M, o_layout)


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
def _ws_worker(PRODUCER: gl.constexpr, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row,
               kv_row, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The producer warp's partition: runs PRODUCER, ``_ws_producer`` or lesson 11's exercise (gl.warp_specialize
    takes only jit functions as partitions, not one passed in as a constexpr)."""
    PRODUCER(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row, kv_row, n_tiles,
             BLOCK_N, NUM_STAGES)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, full, empty, first_row, n_free, n_tiles, Nk, diag, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """The compute warps: for each tile, wait for its stage, both GEMMs and the online softmax, release the stage."""
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
    offs_m = first_row + gl.arange(0, BLOCK_M, layout=row_s)            # [BLOCK_M] rows of this head
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _tiles_sync(0, n_free, q_smem, k_smem, v_smem, full, empty, None, None, 0, n_tiles,
                                acc, m_i, l_i, s_zero, offs_m, offs_n, Nk, diag, qk_scale, p_layout, row_o,
                                BLOCK_N, NUM_STAGES, False, CAUSAL, False)
    acc, m_i, l_i = _tiles_sync(n_free, n_tiles, q_smem, k_smem, v_smem, full, empty, None, None, 0, n_tiles,
                                acc, m_i, l_i, s_zero, offs_m, offs_n, Nk, diag, qk_scale, p_layout, row_o,
                                BLOCK_N, NUM_STAGES, True, CAUSAL, False)
    return acc, l_i, m_i


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, O, LSE, N, Nk, group, diag, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, PRODUCER: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_bh = _program_ids(CAUSAL)
    q_row = off_bh * N + start_m * BLOCK_M
    kv_row = (off_bh // group) * Nk                              # its KV head (GQA): b * Hkv + h // group
    n_tiles = _n_tiles(gl.minimum(start_m * BLOCK_M + BLOCK_M, N) - 1, Nk, diag, BLOCK_N, CAUSAL)   # one count for both
    n_free = gl.minimum(_n_free(start_m * BLOCK_M, Nk, diag, BLOCK_N, CAUSAL), n_tiles)
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
        (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, full, empty, start_m * BLOCK_M, n_free, n_tiles, Nk, diag,
                        qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, num_warps)),
        (_ws_worker, (PRODUCER, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, q_row, kv_row,
                      n_tiles, BLOCK_N, NUM_STAGES)),
    ], [1], [24])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    _store_rows(O, LSE, acc, m_i, l_i, off_bh, start_m * BLOCK_M, N, HEAD_DIM, BLOCK_M, o_layout)


# ------------------------------------------------------------------ FA3's ping-pong and intra-warpgroup overlap
# Two consumer warpgroups (4 warps each), each owning 64 rows of the CTA's 128-row query tile, and the producer warp
# feeding both: every stage is read by both, so empty[s] expects two arrivals. Inside each warpgroup the loop is FA3's
# Algorithm 2: issue S_j = Q K_j^T and P_{j-1} V_{j-1} together, asynchronously; wait for S_j alone; the softmax of
# tile j runs while the tensor cores still do P_{j-1} V_{j-1}. With PINGPONG the two warpgroups also take turns to
# issue their GEMMs (mbarriers turn[0], turn[1]: FA3 uses named barriers), so one's softmax runs under the other's
# GEMMs. (BLOCK_M, BLOCK_N, NUM_STAGES) per head dim: BLOCK_M rows per warpgroup; shared memory for bf16 at d = 128:
# Q 2 x 16 KiB + 3 stages x (K + V) 2 x 32 KiB = 224 KiB of the 227 available. BLOCK_N = 128 at d = 128 (FA3 uses
# 128 causal, 176 not: hopper/tile_size.h) makes each turn's GEMMs twice as long as with 64, so the hand-overs weigh
# less; it was the fastest of bench_gluon.py's sweep of tiles on an H200 (bench/NOTES.md, issue 26, call 1).
PP_BLOCKS = {64: (64, 128, 3), 128: (64, 128, 3)}
# "pp128": each consumer warpgroup owns 128 rows (CTA 256 rows), a test of longer GEMMs a turn. FA3 never does this:
# every MMA warpgroup of its forward owns 64 rows (kBlockM / 64 warpgroups; kBlockM = 128 at d = 128), and 240
# registers a thread hold O and S for 64 rows, not 128. The consumers' registers are raised to 240 each by
# warp_specialize (the producer warp keeps 24): acc alone is 128 fp32 registers a thread at d = 128. Shared memory for
# bf16 at d = 128: Q 2 x 32 KiB + 2 stages x (K + V) 2 x 16 KiB = 128 KiB. At d = 128 ptxas spills it and serialises
# its wgmmas; how much depends on the Triton (and ptxas) version: lesson 11 compiles it and prints ptxas's report
# (helpers.lesson11.ptxas_report). Its timings: bench/results/gluon_h200_causal.json.
PP128_BLOCKS = {64: (128, 64, 3), 128: (128, 64, 2)}


@gluon.jit
def _pp_work(t, n_blocks, N, Nk, group, diag, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item t of the grid-stride loop: (batch·head, first row, Q's row, K/V's row, key tiles). The query block
    varies fastest, so the items that run side by side read one head's K and V (L2); causal reads the blocks from
    the end, heaviest first (as _program_ids does for a grid of one item per program). Every partition computes the
    same values: the producer and both warpgroups must agree on the tile count, or the ring deadlocks."""
    block = t % n_blocks
    if CAUSAL:
        block = n_blocks - 1 - block
    off_bh = t // n_blocks
    m_row = block * (2 * BLOCK_M)                                # first row of the item's 2 x BLOCK_M query rows
    kv_row = (off_bh // group) * Nk                              # its KV head (GQA): b * Hkv + h // group
    n_tiles = _n_tiles(gl.minimum(m_row + 2 * BLOCK_M, N) - 1, Nk, diag, BLOCK_N, CAUSAL)
    return off_bh, m_row, off_bh * N + m_row, kv_row, n_tiles


@gluon.jit
def _pp_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, full, empty, n_blocks, total, N, Nk,
                 group, diag, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """One warp that only loads, item after item: both warpgroups' Q halves once both released the last item's
    (q_free), then tile i of the item into stage j % NUM_STAGES, j counting tiles over all the program's items,
    once both consumers released it. The ring's phases run on across items; so Q's loads and the first K, V tiles
    of the next item overlap the consumers' epilogue."""
    base = 0                                                     # tiles loaded by this program before this item
    w = 0                                                        # items before this one
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        off_bh, m_row, q_row, kv_row, n_tiles = _pp_work(t, n_blocks, N, Nk, group, diag, BLOCK_M, BLOCK_N, CAUSAL)
        mbarrier.wait(q_free, (w & 1) ^ 1)                       # item 0 passes a fresh barrier
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, 0], q_bar, q_smem.index(0))
        _tma_load(q_desc, [q_row + BLOCK_M, 0], q_bar, q_smem.index(1))
        for i in range(n_tiles):
            j = base + i                                         # the ring's running tile count
            s = j % NUM_STAGES
            mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)    # lap r waits parity (r+1)%2: lap 0 passes
            mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row + i * BLOCK_N, 0], full.index(s), k_smem.index(s))
            _tma_load(v_desc, [kv_row + i * BLOCK_N, 0], full.index(s), v_smem.index(s))
        base += n_tiles
        w += 1


@gluon.jit
def _pp_tiles(lo, hi, base, q_tile, k_smem, v_smem, full, empty, turn, acc, p_op, m_i, l_i, s_zero, offs_m, offs_n,
              Nk, diag, qk_scale, p_layout: gl.constexpr, row_o: gl.constexpr, WG: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, MASK: gl.constexpr,
              CAUSAL: gl.constexpr):
    """Key tiles [lo, hi), lo >= 1, of the item, for one consumer warpgroup: p_op holds P_{lo-1}, whose P V is still
    to do. ``base``: the program's tiles before this item (the ring's count, and the turns', run on)."""
    dtype: gl.constexpr = k_smem.dtype
    for i in range(lo, hi):
        j = base + i                                             # the ring's running tile count
        s = j % NUM_STAGES                                       # stage of tile i
        sp = (j - 1) % NUM_STAGES                                # stage of tile i - 1 (its V is still needed)
        mbarrier.wait(full.index(s), (j // NUM_STAGES) & 1)      # lap r waits parity r%2
        if PINGPONG:
            mbarrier.wait(turn.index(WG), j & 1)
        qk = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)   # P_{j-1} V_{j-1}, behind S_j
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        qk = warpgroup_mma_wait(1, deps=(qk,))                   # S_j done; P_{j-1} V_{j-1} may still run
        # the softmax of tile i, under the P V GEMM
        p, alpha, m_i, l_i = _softmax_tile(qk, m_i, l_i, i, offs_m, offs_n, Nk, diag, qk_scale, BLOCK_N, MASK, CAUSAL)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))      # P_{j-1} V_{j-1} done: acc in base m_{j-1}
        mbarrier.arrive(empty.index(sp), count=1)                # both GEMMs that read stage sp are done
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]     # now in base m_j
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return acc, p_op, m_i, l_i


@gluon.jit
def _pp_item(q_smem, k_smem, v_smem, q_bar, q_free, full, empty, turn, O, LSE, off_bh, m_row, N, Nk, diag, n_tiles,
             qk_scale, base, w, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr):
    """One work item of consumer warpgroup WG (0 or 1): rows m_row + WG * BLOCK_M of head off_bh, all n_tiles key
    tiles of the item (the producer's count: causal, warpgroup 0's last tiles may lie past its own rows' diagonal
    and be masked whole), its own epilogue. ``base``: the program's tiles before this item; ``w``: its items before
    this one (Q's phase)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    first_row = m_row + WG * BLOCK_M                             # this warpgroup's first row in the head
    q_tile = q_smem.index(WG)                                    # [BLOCK_M, HEAD_DIM], this warpgroup's rows
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)    # running numerator
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_m = first_row + gl.arange(0, BLOCK_M, layout=row_s)            # [BLOCK_M] rows of this head
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
    n_free = gl.minimum(_n_free(first_row, Nk, diag, BLOCK_N, CAUSAL), n_tiles)   # this warpgroup's unmasked tiles
    mbarrier.wait(q_bar, w & 1)                                  # this item's Q

    # tile 0: S_0 alone (no P V yet), then its softmax, masked (it may be on the band)
    j = base                                                     # the ring's running tile count
    mbarrier.wait(full.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), j & 1)                     # turn k waits parity k % 2
    qk = warpgroup_mma(q_tile, k_smem.index(j % NUM_STAGES).permute((1, 0)), s_zero, use_acc=False)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)             # the other warpgroup's turn
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)   # running max (base 2)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)                 # running sum of exp2
    p, alpha, m_i, l_i = _softmax_tile(qk, m_i, l_i, 0, offs_m, offs_n, Nk, diag, qk_scale, BLOCK_N, True, CAUSAL)
    p_op = gl.convert_layout(p.to(dtype), p_layout)              # P_0 as wgmma's A operand

    # tiles 1.. : off-band, no mask; then the band (causal) and the ragged last tile, masked
    lo = gl.maximum(n_free, 1)
    acc, p_op, m_i, l_i = _pp_tiles(1, lo, base, q_tile, k_smem, v_smem, full, empty, turn, acc, p_op, m_i, l_i,
                                    s_zero, offs_m, offs_n, Nk, diag, qk_scale, p_layout, row_o, WG, BLOCK_N,
                                    NUM_STAGES, PINGPONG, False, CAUSAL)
    acc, p_op, m_i, l_i = _pp_tiles(lo, n_tiles, base, q_tile, k_smem, v_smem, full, empty, turn, acc, p_op, m_i,
                                    l_i, s_zero, offs_m, offs_n, Nk, diag, qk_scale, p_layout, row_o, WG, BLOCK_N,
                                    NUM_STAGES, PINGPONG, True, CAUSAL)
    mbarrier.arrive(q_free, count=1)                             # every Q K^T of the item is done: Q may be replaced

    last = (base + n_tiles - 1) % NUM_STAGES
    acc = warpgroup_mma(p_op, v_smem.index(last), acc)           # P_{T-1} V_{T-1}, synchronous
    mbarrier.arrive(empty.index(last), count=1)
    _store_rows(O, LSE, acc, m_i, l_i, off_bh, first_row, N, HEAD_DIM, BLOCK_M, o_layout)


@gluon.jit
def _pp_consumer(q_smem, k_smem, v_smem, q_bar, q_free, full, empty, turn, O, LSE, n_blocks, total, N, Nk, group,
                 diag, qk_scale, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr):
    """Consumer warpgroup WG: the program's work items in turn (``_pp_item``), the ring's and the turns' counts
    carried from one item to the next as the producer carries them."""
    if PINGPONG:
        if WG == 1:
            mbarrier.arrive(turn.index(0), count=1)              # warpgroup 0 takes the first turn
    base = 0
    w = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        off_bh, m_row, q_row, kv_row, n_tiles = _pp_work(t, n_blocks, N, Nk, group, diag, BLOCK_M, BLOCK_N, CAUSAL)
        _pp_item(q_smem, k_smem, v_smem, q_bar, q_free, full, empty, turn, O, LSE, off_bh, m_row, N, Nk, diag,
                 n_tiles, qk_scale, base, w, WG, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, PINGPONG, CAUSAL)
        base += n_tiles
        w += 1


@gluon.jit
def _attn_fwd_pp(q_desc, k_desc, v_desc, O, LSE, N, Nk, group, diag, qk_scale, BH,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    """FA3's forward: work items of 2 x BLOCK_M query rows of one head, BH heads. A grid of one program per item
    runs each once ("overlap", "pp", "pp128"); a smaller grid makes the programs persistent ("ppp"): each takes
    items t, t + programs, ... in turn, so one item's epilogue overlaps the next one's first loads."""
    dtype: gl.constexpr = q_desc.dtype
    n_blocks = gl.cdiv(N, 2 * BLOCK_M)                           # query blocks of a head
    total = n_blocks * BH                                        # work items
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_free, count=2)                               # completed when both warpgroups are done with Q
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(i), count=1)                    # completed by the TMA's bytes
        mbarrier.init(empty.index(i), count=2)                   # completed when both warpgroups released it
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)                    # completed by the other warpgroup's hand-over
    fence_async_shared()

    gl.warp_specialize([
        (_pp_consumer, (q_smem, k_smem, v_smem, q_bar, q_free, full, empty, turn, O, LSE, n_blocks, total, N, Nk,
                        group, diag, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, PINGPONG, CAUSAL)),
        (_pp_consumer, (q_smem, k_smem, v_smem, q_bar, q_free, full, empty, turn, O, LSE, n_blocks, total, N, Nk,
                        group, diag, qk_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, PINGPONG, CAUSAL)),
        (_pp_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, full, empty, n_blocks, total,
                        N, Nk, group, diag, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL)),
    ], [4, 1], [240, 24])

    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(q_free)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


def _sm_count(device):
    """The GPU's SMs: a persistent grid's size (one CTA per SM: "ppp" takes 224 KiB of shared memory)."""
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gl_dtype(torch_dtype):
    import torch
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


# "auto": per (head dim, causal), the one of the one-partition and ping-pong kernels that was faster in a run that
# timed both on an H200 after the grid and PP_BLOCKS changes (bench_gluon.py, bench/NOTES.md issue 26 call 2; lesson 11
# prints the comparison): the one-partition kernel without a mask at d = 64 (two CTAs share an SM), ping-pong
# everywhere else. Other tilings, not in "auto", were ahead by a little in a few rows. flash_attn_triton routes to it
# on sm_90 where forward.GLUON_ROUTES says, not at d = 64 causal.
AUTO_VARIANT = {(64, False): "one", (64, True): "pp", (128, False): "pp", (128, True): "pp"}

# variant -> what it is (the kernel and its launch: _launch_spec)
VARIANTS = {
    "auto": "the fastest measured per head dim and mask (AUTO_VARIANT)",
    "one": "one partition: the same warps load and compute (_attn_fwd)",
    "ws": "a producer warp + one consumer partition (_attn_fwd_ws)",
    "overlap": "a producer warp + two consumer warpgroups, intra-warpgroup overlap (_attn_fwd_pp, PINGPONG=False)",
    "pp": "a producer warp + two consumer warpgroups in ping-pong, intra-warpgroup overlap (_attn_fwd_pp)",
    "pp128": "as pp, each consumer warpgroup owning 128 query rows, the CTA 256 (_attn_fwd_pp, PP128_BLOCKS)",
    "ppp": "as pp, persistent: a program per SM takes work item after item (_attn_fwd_pp, a grid of the SMs)",
}


def _launch_spec(variant, d, blocks=None, producer=None):
    """(kernel, (BLOCK_M, BLOCK_N, NUM_STAGES), extra constexprs, query rows per CTA, num_warps) of a variant;
    ``blocks`` (BLOCK_M, BLOCK_N, NUM_STAGES) replaces the variant's table entry (a tuning sweep's); ``producer``
    replaces ``_ws_producer`` in the "ws" kernel (lesson 11's exercise)."""
    if blocks is not None:
        blocks = _check_blocks(blocks)
    if variant in ("overlap", "pp", "pp128", "ppp"):
        bm, bn, st = blocks or (PP128_BLOCKS if variant == "pp128" else PP_BLOCKS)[d]
        return _attn_fwd_pp, (bm, bn, st), {"PINGPONG": variant != "overlap"}, 2 * bm, 4   # + 4 + 1 worker warps
    bm, bn, st = blocks or BLOCKS[d]
    if variant == "ws":
        return _attn_fwd_ws, (bm, bn, st), {"PRODUCER": producer or _ws_producer}, bm, bm // 16
    return _attn_fwd, (bm, bn, st), {}, bm, bm // 16


def _check_blocks(blocks):
    """(BLOCK_M, BLOCK_N, NUM_STAGES): BLOCK_M 64 or 128 (one warpgroup's or two's rows), BLOCK_N a power of two from
    16 to 256 (Gluon tensors have power-of-two shapes; wgmma's N), 1 to 4 stages."""
    try:
        bm, bn, st = (int(x) for x in blocks)
    except (TypeError, ValueError):
        raise ValueError(f"gluon_forward: blocks must be (BLOCK_M, BLOCK_N, NUM_STAGES), got {blocks!r}") from None
    if bm not in (64, 128) or bn not in (16, 32, 64, 128, 256) or not 1 <= st <= 4:
        raise ValueError(f"gluon_forward: blocks {blocks!r}: BLOCK_M must be 64 or 128, BLOCK_N a power of two from "
                         "16 to 256, NUM_STAGES 1 to 4")
    return bm, bn, st


def _variant(variant, warp_specialize):
    if variant is None:
        return "ws" if warp_specialize else "one"
    if variant not in VARIANTS:
        raise ValueError(f"gluon_forward: variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    if warp_specialize and variant == "one":
        raise ValueError("gluon_forward: warp_specialize=True contradicts variant='one'")
    return variant


def _check_producer(producer, variant):
    """A producer for the "ws" kernel: a Gluon jit function with ``_ws_producer``'s 14 arguments."""
    if producer is None:
        return
    if variant != "ws":
        raise ValueError(f"gluon_forward: a producer replaces the 'ws' kernel's producer warp; variant is {variant!r}")
    from triton.experimental.gluon._runtime import GluonJITFunction
    if not isinstance(producer, GluonJITFunction):
        raise TypeError(f"gluon_forward: producer must be a @gluon.jit function, got {type(producer).__name__}")
    if len(producer.arg_names) != 14:
        raise TypeError(f"gluon_forward: producer takes _ws_producer's 14 arguments (q_desc, ..., NUM_STAGES); "
                        f"{producer.__name__} takes {len(producer.arg_names)}")


def _check_inputs(q, k, v, sm_scale):
    """What gluon_forward needs, checked on the host before any GPU work: three tensors, q [B, H, N, d], k and v
    [B, Hkv, Nk, d] with H a multiple of Hkv (GQA), one dtype, bf16 or fp16, d = 64 or 128, N and Nk >= 1, on one
    sm_90 GPU."""
    import torch
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"gluon_forward: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"gluon_forward: {name} must be [B, H, N, d] (4 dimensions), got shape {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"gluon_forward: {name} has dtype {str(x.dtype).replace('torch.', '')}; the Gluon "
                            "kernels take bfloat16 or float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"gluon_forward: q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, N, d = q.shape
    try:                                         # k, v [B, Hkv, Nk, d], H % Hkv == 0: the course's check
        _check_dense_kv(q, k, v)
    except ValueError as e:
        raise ValueError(f"gluon_forward: {e}") from None
    if d not in BLOCKS:
        raise ValueError(f"gluon_forward: head dimension d must be one of {', '.join(map(str, sorted(BLOCKS)))}; "
                         f"got {d}")
    if N == 0 or k.shape[2] == 0 or B * H == 0:
        raise ValueError(f"gluon_forward: needs at least one query and one key per head; q is {tuple(q.shape)}, "
                         f"k is {tuple(k.shape)}")
    if sm_scale is not None and not isinstance(sm_scale, (int, float)):
        raise TypeError(f"gluon_forward: sm_scale must be a Python number or None, got {type(sm_scale).__name__}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"gluon_forward: q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda":
        raise ValueError(f"gluon_forward needs an sm_90 GPU (H100, H200): the tensors are on {q.device}, and Gluon "
                         "kernels have no interpreter")
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"gluon_forward needs an sm_90 GPU (H100, H200); {torch.cuda.get_device_name(q.device)} "
                         f"is sm_{cap[0]}{cap[1]}")


def _check_align(align):
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"gluon_forward: align must be 'top_left' or 'bottom_right', got {align!r}")


def _diag(causal, align, N, Nk):
    """Causal: row i sees key j when j <= i + diag; diag = 0 for "top_left" (SDPA's is_causal), Nk - N for
    "bottom_right" (the FlashAttention library's: the last query sees every key), as in flash_attn_triton."""
    _check_align(align)
    return (Nk - N) if (causal and align == "bottom_right") else 0


def gluon_forward(q, k, v, sm_scale=None, warp_specialize=False, variant=None, causal=False, align="top_left",
                  blocks=None, producer=None):
    """(O, lse) of attention: q ``[B, H, N, d]``, k, v ``[B, Hkv, Nk, d]`` (H a multiple of Hkv: query head h reads
    KV head h // (H // Hkv)) on an sm_90 GPU, bf16 or fp16, d = 64 or 128. O has q's dtype, lse is float32 in natural
    log. ``causal``: row i sees key j when j <= i + diag, diag = 0 for ``align="top_left"``, Nk - N for
    ``"bottom_right"`` (``flash_attn_triton``'s rule); a row that sees no key gets O = 0, lse = -inf. A program visits
    key tiles only up to its last row's diagonal, masks only the tiles on the band, and the heaviest query blocks
    launch first. ``variant`` (``VARIANTS``): ``"one"`` (default), ``"ws"`` (FA3's split: a producer warp that only
    loads and the compute warps, handing stages over through full/empty barriers; ``warp_specialize=True`` says the
    same), ``"overlap"`` (a producer warp and two consumer warpgroups, each issuing the next QK^T before this tile's
    softmax), ``"pp"`` (those warpgroups also take turns on the tensor cores: FA3's ping-pong) and ``"auto"`` (the
    fastest measured for this head dim and mask, ``AUTO_VARIANT``). ``blocks``
    (BLOCK_M, BLOCK_N, NUM_STAGES) replaces the variant's tiles (for a tuning sweep; BLOCK_M is per warpgroup in the
    two-warpgroup variants). ``producer``: a ``@gluon.jit`` function with ``_ws_producer``'s arguments that runs as
    the "ws" kernel's producer warp (lesson 11's exercise; ``variant`` None means "ws" then). Raises TypeError or
    ValueError, before any GPU work, for inputs it cannot take."""
    import torch
    variant = _variant("ws" if producer is not None and variant is None else variant, warp_specialize)
    _check_producer(producer, variant)
    _check_align(align)
    if blocks is not None:
        _check_blocks(blocks)
    _check_inputs(q, k, v, sm_scale)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, H, N, d = q.shape
    if variant == "auto":
        variant = AUTO_VARIANT[(d, bool(causal))]
    Hkv, Nk = k.shape[1], k.shape[2]
    diag = _diag(causal, align, N, Nk)
    kernel, (BLOCK_M, BLOCK_N, NUM_STAGES), extra, rows_per_cta, num_warps = _launch_spec(variant, d, blocks, producer)
    q2 = q.contiguous().view(B * H * N, d)                       # [B*H*N, d]
    k2 = k.contiguous().view(B * Hkv * Nk, d)                    # [B*Hkv*Nk, d]
    v2 = v.contiguous().view(B * Hkv * Nk, d)
    el = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], el)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], el)
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, d], kv_layout)
    o = torch.empty_like(q)                                      # [B, H, N, d]
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    qk_scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)) * LOG2E.value
    n_blocks = triton.cdiv(N, rows_per_cta)
    grid = (n_blocks, B * H)                                     # causal: _program_ids reads it last block first
    runtime = ()
    if kernel is _attn_fwd_pp:                                   # a grid-stride loop over the work items
        runtime = (B * H,)
        items = n_blocks * B * H
        grid = (min(items, _sm_count(q.device)) if variant == "ppp" else items,)
    kernel[grid](q_desc, k_desc, v_desc, o, lse, N, Nk, H // Hkv, diag, qk_scale, *runtime,
                 HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, CAUSAL=bool(causal), **extra,
                 num_warps=num_warps)
    return o, lse


def compile_for_sm90(d=128, dtype="bf16", warp_specialize=False, variant=None, causal=False, blocks=None,
                     compiled=False, producer=None):
    """Compile one variant's kernel for sm_90 with Triton's own compiler, no GPU needed; returns the PTX, or with
    ``compiled=True`` the compiled kernel (its ``asm`` and ``metadata``: shared memory, ptxas's spills). (GQA needs
    no compile of its own: the query heads per KV head are a runtime argument.) ``producer``: as gluon_forward's."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    variant = _variant("ws" if producer is not None and variant is None else variant, warp_specialize)
    _check_producer(producer, variant)
    if variant == "auto":
        variant = AUTO_VARIANT[(d, bool(causal))]
    kernel, (BLOCK_M, BLOCK_N, NUM_STAGES), extra, _, num_warps = _launch_spec(variant, d, blocks, producer)
    el = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], el)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], el)
    sig = {"q_desc": f"tensordesc<{dtype}[{BLOCK_M}, {d}],{q_layout!r}>",
           "k_desc": f"tensordesc<{dtype}[{BLOCK_N}, {d}],{kv_layout!r}>",
           "v_desc": f"tensordesc<{dtype}[{BLOCK_N}, {d}],{kv_layout!r}>",
           "O": f"*{dtype}", "LSE": "*fp32", "N": "i32", "Nk": "i32", "group": "i32", "diag": "i32",
           "qk_scale": "fp32", **({"BH": "i32"} if kernel is _attn_fwd_pp else {}),   # pp's items: B*H heads
           "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr", "CAUSAL": "constexpr", **{name: "constexpr" for name in extra},
           "num_warps": "constexpr"}
    const = {"HEAD_DIM": d, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "NUM_STAGES": NUM_STAGES, "CAUSAL": bool(causal),
             **extra, "num_warps": num_warps}
    src = GluonASTSource(kernel, sig, const)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return kernel if compiled else kernel.asm["ptx"]


# Self-test cases (B, H, Hkv, N, Nk, causal, align): ragged N and Nk, N = 1, Nk = 1, N != Nk both ways, GQA 4:1
# and 8:1, and causal rows that see no key (bottom_right with N > Nk: the first N - Nk rows; N = 130, Nk = 1 leaves a
# whole 128-row program empty). N = 257 also gets large logits.
SELFTEST_CASES = [
    (2, 3, 3, 1000, 1000, False, "top_left"), (1, 2, 2, 1, 77, False, "top_left"), (1, 2, 2, 130, 1, False, "top_left"),
    (2, 2, 2, 257, 1029, False, "top_left"), (1, 4, 4, 2048, 2048, False, "top_left"),
    (2, 8, 2, 513, 700, False, "top_left"),                                         # GQA 4:1
    (2, 3, 3, 1000, 1000, True, "top_left"), (1, 2, 2, 300, 1000, True, "top_left"),
    (1, 2, 2, 300, 1000, True, "bottom_right"), (1, 2, 2, 1000, 300, True, "top_left"),
    (1, 2, 2, 1000, 300, True, "bottom_right"),                                     # rows 0..699 see nothing
    (1, 2, 2, 1, 77, True, "bottom_right"), (1, 2, 2, 130, 1, True, "bottom_right"),
    (2, 2, 2, 257, 1029, True, "bottom_right"),
    (1, 8, 2, 1000, 1000, True, "top_left"),                                        # GQA 4:1
    (1, 8, 1, 777, 1000, True, "bottom_right"), (1, 16, 2, 2048, 2048, True, "top_left"),   # GQA 8:1
]


def _reference(q, k, v, causal, align):
    """float64 (O, lse) of q [B, H, N, d], k, v [B, Hkv, Nk, d]; a row that sees no key: O = 0, lse = -inf."""
    import torch
    B, H, N, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    k64 = k.double().repeat_interleave(H // Hkv, 1)              # [B, H, Nk, d]: query head h reads KV head h // group
    v64 = v.double().repeat_interleave(H // Hkv, 1)
    s = (q.double() @ k64.transpose(-1, -2)) / math.sqrt(d)      # [B, H, N, Nk]
    if causal:
        diag = _diag(causal, align, N, Nk)
        rows, cols = torch.arange(N, device=q.device), torch.arange(Nk, device=q.device)
        s = s.masked_fill(cols[None, :] > rows[:, None] + diag, float("-inf"))
    lse = torch.logsumexp(s, -1)                                  # [B, H, N], -inf where a row sees nothing
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])      # [B, H, N, Nk], 0 in such a row
    return p @ v64, lse


def gluon_forward_selftest(shapes=None, seed=0, warp_specialize=False, variant=None, log=None, causal=None,
                           producer=None, dtypes=None, head_dims=(64, 128)):
    """On an sm_90 GPU: one variant of the kernel (``VARIANTS``) against float64 attention on harsh cases
    (``SELFTEST_CASES``: ragged N and Nk, N = 1, Nk = 1, N != Nk both ways, large logits, GQA 4:1 and 8:1, causal in
    both alignments, rows that see no key), bf16 and fp16, d = 64 and 128. ``causal``: None runs every case, True
    only the causal ones, False only the others; ``shapes``: other cases, (B, H, N, Nk) or the 7-tuples. The bound
    per case is 2 x SDPA's own error in that dtype (on the rows that see a key) plus the output's rounding; rows that
    see no key must give O = 0 exactly and lse = -inf. A case that raises is recorded as failed (its error in
    ``rows``), and the others still run; ``log(row)`` is called after each case. ``producer``, ``dtypes``
    (default bf16 and fp16), ``head_dims``: lesson 11's exercise runs a learner's producer on fewer. Returns
    {"cases", "worst" (max |O - O64|), "worst_lse", "ok", "rows"}."""
    import torch
    import torch.nn.functional as F
    variant = _variant("ws" if producer is not None and variant is None else variant, warp_specialize)
    torch.manual_seed(seed)
    cases = [c if len(c) == 7 else (c[0], c[1], c[1], c[2], c[3], False, "top_left") for c in shapes or SELFTEST_CASES]
    cases = [c for c in cases if causal is None or c[5] == causal]
    rows, worst, worst_lse, ok = [], 0.0, 0.0, True
    for dt in dtypes or (torch.bfloat16, torch.float16):
        for d in head_dims:
            for B, H, Hkv, N, Nk, is_causal, align in cases:
                row = dict(dtype=str(dt).replace("torch.", ""), d=d, shape=(B, H, Hkv, N, Nk),
                           causal=align if is_causal else False)
                big = 4.0 if N == 257 else 1.0                   # large logits in one shape
                q = (torch.randn(B, H, N, d, device="cuda") * big).to(dt)
                k, v = (torch.randn(B, Hkv, Nk, d, device="cuda").to(dt) for _ in range(2))
                try:
                    o, lse = gluon_forward(q, k, v, variant=variant, causal=is_causal, align=align, producer=producer)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - one report for the whole run
                    ok = False
                    rows.append(dict(row, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    if log:
                        log(rows[-1])
                    continue
                o64, lse64 = _reference(q, k, v, is_causal, align)
                seen = torch.isfinite(lse64)                     # [B, H, N] rows that see at least one key
                mask = None
                if is_causal:                                    # SDPA on the same rows: its own error, the yardstick
                    rr, cc = torch.arange(N, device="cuda"), torch.arange(Nk, device="cuda")
                    mask = cc[None, :] <= rr[:, None] + _diag(True, align, N, Nk)      # [N, Nk] True: attend
                kr, vr = (x.repeat_interleave(H // Hkv, 1) for x in (k, v))
                o_sdpa = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask).double()
                sdpa = (o_sdpa - o64)[seen].abs().max().item() if seen.any() else 0.0
                err = (o.double() - o64)[seen].abs().max().item() if seen.any() else 0.0
                err_lse = (lse.double() - lse64)[seen].abs().max().item() if seen.any() else 0.0
                bound = 2 * sdpa + torch.finfo(dt).eps * o64.abs().max().item()
                empty_ok = bool((o[~seen] == 0).all()) and bool((lse[~seen] == float("-inf")).all())
                good = bool(torch.isfinite(o).all()) and err <= bound and empty_ok and \
                    err_lse <= 1e-3 * max(1.0, lse64[seen].abs().max().item() if seen.any() else 1.0)
                ok &= good
                worst, worst_lse = max(worst, err), max(worst_lse, err_lse)
                rows.append(dict(row, err=err, bound=bound, sdpa_err=sdpa, lse_err=err_lse,
                                 empty_rows=int((~seen).sum().item()), empty_ok=empty_ok, ok=good))
                if log:
                    log(rows[-1])
    return {"cases": len(rows), "worst": worst, "worst_lse": worst_lse, "ok": ok, "rows": rows}


if __name__ == "__main__":     # on an sm_90 GPU: python -m helpers.kernels.gluon_forward [--variant X] [--causal]
    import argparse

    import torch
    ap = argparse.ArgumentParser(description="The Gluon forward against float64 on harsh cases (an sm_90 GPU).")
    ap.add_argument("--variant", choices=list(VARIANTS), default=None)
    ap.add_argument("--warp-specialize", action="store_true", help="the same as --variant ws")
    ap.add_argument("--causal", action="store_true", help="only the causal cases (default: every case)")
    args = ap.parse_args()
    variant = _variant(args.variant, args.warp_specialize)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"variant {variant}: {VARIANTS[variant]}", flush=True)
    result = gluon_forward_selftest(variant=variant, causal=True if args.causal else None,
                                    log=lambda r: print(r, flush=True))
    print(f"variant {variant}: {result['cases']} cases{' (causal)' if args.causal else ''}, worst |O - float64| "
          f"{result['worst']:.2e}, worst |lse - float64| {result['worst_lse']:.2e}: "
          f"{'ALL OK' if result['ok'] else 'FAILURES ABOVE'}")
    raise SystemExit(0 if result["ok"] else 1)
