"""A FlashAttention backward in Gluon for Hopper (sm_90): TMA loads through an mbarrier ring, ``warpgroup_mma`` for
all five GEMMs, P recomputed in base 2 from the forward's lse. Lesson 11's GPU section, the backward half.

What it computes: ``gluon_backward(do, q, k, v, o, lse, causal, sm_scale, align) -> (dq, dk, dv)``, the same
contract as the course's Triton backward ``flash_attn_bwd_triton`` (helpers/kernels/backward.py, whose docstring
has the algorithm): q, o, do ``[B, H, N, d]``, k, v ``[B, Hkv, Nk, d]`` (GQA: H a multiple of Hkv, dk and dv summed
over each KV head's group inside the kernel), lse ``[B, H, N]`` float32 in natural log (-inf for a row that saw no
key), bf16 or fp16, d = 64 or 128, ragged N and Nk, causal in both alignments (row i sees key j when j <= i + diag;
diag = 0 "top_left", Nk - N "bottom_right"). dq, dk, dv come back in the inputs' dtype; a row that sees no key
gets dq = 0 exactly and adds nothing to dk, dv.

Three launches (``dq_mode="atomic"``: two and a cast):

1. Preprocess, the course's Triton kernel ``backward._bwd_preprocess`` (plain ``tl``, compiles for sm_90 like any
   Triton kernel): D = rowsum(dO * O) fp32 ``[B*H*N]`` and lse2 = lse * log2(e), +inf where lse = -inf so that
   P = exp2(S * qk_scale - lse2) = 0 on such a row. One memory-bound pass over O and dO: nothing in it needs a
   tensor core or the TMA, so a Gluon copy would add code and no speed.
2. dK/dV, ``_bwd_dkdv``: one program per (block of BLOCK_N keys, batch·KV head), ``BLOCK_N // 16`` warps (8 at
   BLOCK_N = 128: two warpgroups, each owning 64 of the keys, i.e. 64 rows of every transposed tile). K_j and V_j
   come in once by TMA; then the query tiles stream through a ring of NUM_STAGES shared-memory stages (Q_i and dO_i
   by TMA, one mbarrier ``full[s]`` per stage, tile t waits on stage t % NUM_STAGES with parity
   (t // NUM_STAGES) % 2, the forward's rule) over every query head of the group, one head after the other, and
   (causal) only the query blocks at or after the block's diagonal. The program works in the transposed frame
   (keys on rows), so that dK and dV accumulate in wgmma's accumulator layout with no transposes in registers:

       S^T  = K Q_i^T                  [BLOCK_N, BLOCK_M]  wgmma, A = K (smem), B = Q_i^T (smem, a permuted view)
       dP^T = V dO_i^T                 [BLOCK_N, BLOCK_M]  wgmma, A = V (smem), B = dO_i^T
       P^T  = exp2(S^T * qk_scale - lse2_i)                registers (ex2), masked on the causal band
       dV  += P^T dO_i                 [BLOCK_N, d]        wgmma, A = P^T from registers (DotOperandLayout)
       dS^T = P^T * (dP^T - D_i)                           registers
       dK  += dS^T Q_i                 [BLOCK_N, d]        wgmma, A = dS^T from registers

   S^T and dP^T are issued together asynchronously; the kernel waits for S^T alone and computes P^T while dP^T is on
   the tensor cores, issues dV asynchronously and waits for dP^T alone (dV may still run) while it forms dS^T, then
   issues dK and waits for both before the stage is refilled (``_dkdv_tiles``; the same warps issue the loads: no
   warp specialisation yet). With ``PIPELINE`` (``_dkdv_tiles_deferred``) dK_t is left in flight into tile t+1,
   whose S^T and dP^T queue behind it, and tile t's stage is refilled there, once dK_t is done. At the end
   dK *= sm_scale; dK, dV are stored with a row mask (keys < Nk).
   Query rows past N (the next head's rows in the ``[B*H*N, d]`` view, or the TMA's zeros) need no mask: their
   lse2 is loaded as +inf and D as 0, so their P and dS are 0. Keys past Nk (the last key block's tail) need none
   either: every quantity of a key row stays in its own row of dK, dV, and those rows are never stored.
3. dQ, ``_bwd_dq``: Q-outer like the forward (one program per query block and batch·head, ``BLOCK_M // 16``
   warps): Q_i, dO_i once by TMA, lse2_i and D_i once in registers, K_j, V_j streamed through the ring over the key
   tiles the block's rows see (the forward's ``_n_tiles`` and ``_n_free``: unmasked tiles first, then the causal band
   and the ragged last key tile masked with ``where``):

       S = Q_i K_j^T, dP = dO_i V_j^T  (both issued async, wait for S alone, then for dP);  P = exp2(S*qk_scale - lse2)
       dS = P * (dP - D);  dQ += dS K_j  (wgmma, A = dS from registers);  at the end dQ *= sm_scale

   With ``PIPELINE`` (``_dq_tiles_deferred``) the dQ GEMM of tile j is left in flight into tile j+1, as in dK/dV.

   Deterministic: every dq element is written once, by one program (``dq_mode="separate"``, the default).
4. Or ``dq_mode="atomic"`` (dQ as FA3 adds it, no dQ kernel; FA3 issues the adds from a dQ-writer warp of its own,
   here the dK/dV warps issue them): the dK/dV kernel also stores dS^T (bf16/fp16) in shared memory
   (then dK's wgmma reads its A from there too, which frees the registers of dS^T's operand copy) and computes
   dQ_i = dS K_j [BLOCK_M, d] with one more wgmma (A = dS, the transposed view of that buffer: an M-major A
   operand), scales it by sm_scale and adds the fp32 tile into a zeroed ``[B*H*N, d]`` buffer with the TMA's
   reduce-add (``cp.reduce.async.bulk.tensor ... .add``, two shared-memory tiles so one add runs while the next tile
   is computed); a cast to the dtype follows. 5 GEMMs per tile pair instead of 7 (the dQ kernel recomputes S and
   dP), at the price of run-to-run differences in the last bits of dq (the adds' order varies). Here keys past Nk
   must not reach dQ: on the ragged last key block every tile is masked. Triton 3.6's Gluon has no name for the
   TMA's reduce (3.8 on: ``tma.async_atomic_add``), so this module wraps the builder's ``create_async_tma_reduce``.

Grids are (blocks, heads), as the forward's: the CTAs side by side belong to one head and share its tiles in L2.
Causal, the heaviest go first: dK/dV's key block 0 is seen by the most rows; dQ reads its query blocks backwards
(the forward's ``_program_ids``).
Tiles (``BLOCKS``, ``config=`` overrides them for a sweep) and their shared memory are listed at ``BLOCKS``.

What it measured (the self-test's cases in both dQ modes against float64 autograd; the timings against SDPA and the
course's Triton backward): ``bench/results/gluon_backward_h200.json`` and ``logs/gluon_backward_selftest_*.log``,
shown by lesson 11; the runs' history is ``bench/NOTES.md``'s. Every kernel compiles for sm_90 under Triton 3.6 and
3.9 (``compile_backward_for_sm90``). Registers: the dK/dV kernel at d = 128 uses every one of the 255 a thread, and
the atomic mode, which adds dQ's operand and tiles to it, spills there (ptxas's report depends on its version;
with ``TRITON_DUMP_PTXAS_LOG=1`` and a fresh ``TRITON_CACHE_DIR``, ``compile_backward_for_sm90`` prints it). On an
sm_90 GPU: ``python -m helpers.kernels.gluon_backward`` runs ``gluon_backward_selftest()`` (harsh cases against
float64 autograd, both dQ modes, one line each, exit code 0/1); ``bench/bench_gluon.py --bwd`` times it.
``gluon_backward`` checks its inputs on the host first (TypeError/ValueError; a CPU tensor: "needs an sm_90 GPU").
Nothing here runs under Triton's interpreter.
"""
from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from .common import LOG2E
from .gluon_forward import (SELFTEST_CASES, _check_align, _check_inputs, _diag, _gl_dtype, _n_free, _n_tiles,
                            _program_ids, _tma_load)

__all__ = ["gluon_backward", "gluon_backward_selftest", "compile_backward_for_sm90", "BLOCKS", "DQ_MODES"]

if hasattr(tma, "async_atomic_add"):                             # Triton 3.8 on: the TMA's reduce-add into global
    _tma_add = tma.async_atomic_add
else:                                                            # Triton 3.6: its builder has the op, Gluon no name
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_add(tensor_desc, coord, src, _semantic=None):
        """Add the fp32 tile in shared memory src into the global tensor at coord, by the TMA (cp.reduce.async.bulk
        .tensor ... .add), asynchronously: tma.store_wait(n) waits until at most n such operations still read."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


# Tiles per head dim: {"dkdv": (BLOCK_M queries, BLOCK_N keys, NUM_STAGES, PIPELINE), "dkdv_atomic": (the same with
# dq_mode="atomic"), "dq": (BLOCK_M, BLOCK_N, NUM_STAGES, PIPELINE)}; num_warps = (dK/dV) BLOCK_N // 16, (dQ)
# BLOCK_M // 16: one warp per 16 rows of the wgmma accumulator. PIPELINE: a tile's last GEMM left in flight into the
# next (_dkdv_tiles_deferred, _dq_tiles_deferred), so a stage is refilled one tile later and the loads run
# NUM_STAGES - 1 tiles ahead: three stages where they fit. It is off for the dK/dV kernel at d = 128, where ptxas
# spilled with it and hardly without (Triton 3.6; registers: 255 either way); a sweep on the GPU should decide.
# Shared memory, bf16/fp16 (2 bytes), d = 128:
#   dK/dV: K + V 2 x 128 x 128 x 2 = 64 KiB, + 3 stages x (Q + dO) 2 x 64 x 128 x 2 = 96 KiB: 160 KiB;
#   dK/dV, atomic dQ: 64 + 2 stages x 32 KiB + dS^T 128 x 64 x 2 = 16 KiB + 2 fp32 dQ tiles 2 x 64 x 128 x 4 = 64 KiB:
#          208 KiB (three stages would need 240);
#   dQ:    Q + dO 2 x 128 x 128 x 2 = 64 KiB, + 3 stages x (K + V) 2 x 64 x 128 x 2 = 96 KiB: 160 KiB.
# d = 64: dK/dV 32 + 3 x 16 = 80 KiB (atomic 80 + 16 + 32 = 128); dQ 32 + 3 x 16 = 80 KiB. (sm_90: 227 KiB a CTA.)
# Registers, d = 128, dK/dV, per thread of a warpgroup owning 64 keys: dK and dV 64 fp32 each, S^T and dP^T
# [64, BLOCK_M = 64] 32 each, P^T and dS^T as bf16 operands 16 each, lse2 and D 16 each.
BLOCKS = {64: {"dkdv": (64, 128, 3, True), "dkdv_atomic": (64, 128, 3, False), "dq": (128, 64, 3, True)},
          128: {"dkdv": (64, 128, 3, False), "dkdv_atomic": (64, 128, 2, False), "dq": (128, 64, 3, True)}}
SMEM_LIMIT = 227 * 1024      # bytes of shared memory one CTA may use on sm_90


# ------------------------------------------------------------------ dK, dV: KV outer, query tiles streamed
@gluon.jit
def _probs(s, lse2, keys, rows, Nk, diag, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """P = exp2(s * qk_scale - lse2) of a score tile s, unscaled, in either orientation: keys and rows broadcast
    against it ([BLOCK_N, 1] and [1, BLOCK_M] for S^T, the other way round for S), lse2 too. With MASK, key c of row
    r counts when c < Nk and (causal) c <= r + diag; the others get P = 0 (keys past Nk: the next head's, or the
    TMA's zeros). Rows past N need no mask: their lse2 is +inf."""
    p = gl.exp2(s * qk_scale - lse2)
    if MASK:
        keep = keys < Nk
        if CAUSAL:
            keep = keep & (keys <= rows + diag)
        p = gl.where(keep, p, 0.0)
    return p


@gluon.jit
def _dkdv_tiles(t_lo, t_hi, t_head, i_lo, n_q, n_tiles, q_row0, l_row, k_smem, v_smem, q_smem, do_smem, full,
                q_desc, do_desc, LSE2, DELTA, dk, dv, sT_zero, offs_key, offs_col, N, Nk, diag, qk_scale, sm_scale,
                ds_smem, dq_smem, dq_desc, dq_zero, op_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                NUM_STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr):
    """Tiles [t_lo, t_hi) of the program's flat tile sequence, all of one query head whose first tile is t_head
    (tile t is that head's query block i_lo + t - t_head). dk, dv [BLOCK_N, HEAD_DIM] fp32; l_row: the head's row 0
    in LSE2 and DELTA ([B*H*N]); offs_key [BLOCK_N] the program's key indices, offs_col [BLOCK_M] 0..BLOCK_M-1.
    MASK: key c of row r counts when c < Nk and (causal) c <= r + diag, the others get P = 0. After a tile's last
    GEMM its stage is refilled with tile t + NUM_STAGES, which may belong to the next head (q_row0: the group's first
    row in q's [B*H*N, d]). DQ_ATOMIC: dS^T also goes to shared memory (ds_smem [BLOCK_N, BLOCK_M]), dQ_i = dS K
    [BLOCK_M, HEAD_DIM] is one more wgmma (A = dS, the transposed view of ds_smem), and its fp32 tile is added into
    dq_desc's [B*H*N, HEAD_DIM] by a TMA reduce from dq_smem (two buffers, so tile t's add may run during tile t+1)."""
    dtype: gl.constexpr = q_smem.dtype
    for t in range(t_lo, t_hi):
        s = t % NUM_STAGES                                       # stage of tile t
        rows = (i_lo + t - t_head) * BLOCK_M + offs_col          # [BLOCK_M] query rows of this head
        ok = rows < N                                            # rows past N: P = 0 through lse2 = +inf
        lse2 = gl.load(LSE2 + l_row + rows, mask=ok, other=float("inf"))    # [BLOCK_M], in flight during the wait
        delta = gl.load(DELTA + l_row + rows, mask=ok, other=0.0)           # [BLOCK_M]
        mbarrier.wait(full.index(s), (t // NUM_STAGES) & 1)      # lap r waits parity r%2
        q_tile = q_smem.index(s)                                 # [BLOCK_M, HEAD_DIM]
        do_tile = do_smem.index(s)                               # [BLOCK_M, HEAD_DIM]
        sT = warpgroup_mma(k_smem, q_tile.permute((1, 0)), sT_zero, use_acc=False, is_async=True)    # K Q^T
        dpT = warpgroup_mma(v_smem, do_tile.permute((1, 0)), sT_zero, use_acc=False, is_async=True)  # V dO^T
        sT = warpgroup_mma_wait(1, deps=(sT,))                   # S^T done; dP^T may still run
        pT = _probs(sT, lse2[None, :], offs_key[:, None], rows[None, :], Nk, diag, qk_scale, MASK, CAUSAL)   # P^T
        pT_op = gl.convert_layout(pT.to(dtype), op_layout)       # P^T as wgmma's A operand
        dv = warpgroup_mma(pT_op, do_tile, dv, is_async=True)    # dV += P^T dO     [BLOCK_N, HEAD_DIM]
        dpT = warpgroup_mma_wait(1, deps=(dpT,))                 # dP^T done; dV may still run
        dsT = pT * (dpT - delta[None, :])                        # [BLOCK_N, BLOCK_M] dS^T
        dsT_lo = dsT.to(dtype)
        if DQ_ATOMIC:
            ds_smem.store(dsT_lo)                                # dS^T for the dQ GEMM's A operand
            fence_async_shared()                                 # the stores before wgmma reads them
        if DQ_ATOMIC:
            dk = warpgroup_mma(ds_smem, q_tile, dk, is_async=True)    # dK += dS^T Q     [BLOCK_N, HEAD_DIM]
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)  # dS K
            dv, dk, pT_op, dq = warpgroup_mma_wait(0, deps=(dv, dk, pT_op, dq))
        else:
            dsT_op = gl.convert_layout(dsT_lo, op_layout)
            dk = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)    # dK += dS^T Q     [BLOCK_N, HEAD_DIM]
        if DQ_ATOMIC:
            buf = dq_smem.index(t % 2)
            tma.store_wait(1)                                    # the add of tile t - 2 has read this buffer
            buf.store(dq * sm_scale)                             # [BLOCK_M, HEAD_DIM] fp32
            fence_async_shared()
            _tma_add(dq_desc, [l_row + (i_lo + t - t_head) * BLOCK_M, 0], buf)    # rows past N add 0.0
        else:
            dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=(dv, dk, pT_op, dsT_op))   # stage s is read no more
        nxt = t + NUM_STAGES                                     # refill stage s with the tile one lap ahead
        if nxt < n_tiles:
            g2 = nxt // n_q                                      # its query head within the group
            row = q_row0 + g2 * N + (i_lo + nxt - g2 * n_q) * BLOCK_M
            mbarrier.expect(full.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            _tma_load(q_desc, [row, 0], full.index(s), q_tile)
            _tma_load(do_desc, [row, 0], full.index(s), do_tile)
    return dk, dv


@gluon.jit
def _dkdv_tiles_deferred(t_lo, t_hi, t_head, i_lo, n_q, n_tiles, q_row0, l_row, k_smem, v_smem, q_smem, do_smem, full,
                         q_desc, do_desc, LSE2, DELTA, dk, dv, dsT_op, sT_zero, offs_key, offs_col, N, Nk, diag,
                         qk_scale, op_layout: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                         MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """_dkdv_tiles (dQ separate) with tile t-1's dK GEMM left in flight into tile t (``PIPELINE``): dk comes in and
    goes out as a wgmma accumulator still being written, dsT_op as its A operand, kept alive until the wait that
    covers it. Tile t issues S^T_t and dP^T_t behind it and waits until only dP^T_t is left: the tensor cores go from
    dK_{t-1} to S^T_t with no gap for the loop's barrier, waits and loads, and stage (t-1) % NUM_STAGES, read no
    more, is refilled then with tile t - 1 + NUM_STAGES (so NUM_STAGES >= 2, and the loads run one stage less ahead
    than in _dkdv_tiles). dV_t is waited for right after dK_t is issued (it ran during dS^T's arithmetic), so P^T's
    registers are not carried into the next tile."""
    dtype: gl.constexpr = q_smem.dtype
    for t in range(t_lo, t_hi):
        s = t % NUM_STAGES                                       # stage of tile t
        rows = (i_lo + t - t_head) * BLOCK_M + offs_col          # [BLOCK_M] query rows of this head
        ok = rows < N                                            # rows past N: P = 0 through lse2 = +inf
        lse2 = gl.load(LSE2 + l_row + rows, mask=ok, other=float("inf"))    # [BLOCK_M]
        delta = gl.load(DELTA + l_row + rows, mask=ok, other=0.0)           # [BLOCK_M]
        mbarrier.wait(full.index(s), (t // NUM_STAGES) & 1)      # lap r waits parity r%2
        q_tile = q_smem.index(s)                                 # [BLOCK_M, HEAD_DIM]
        do_tile = do_smem.index(s)                               # [BLOCK_M, HEAD_DIM]
        sT = warpgroup_mma(k_smem, q_tile.permute((1, 0)), sT_zero, use_acc=False, is_async=True)    # K Q^T
        dpT = warpgroup_mma(v_smem, do_tile.permute((1, 0)), sT_zero, use_acc=False, is_async=True)  # V dO^T
        sT, dk, dsT_op = warpgroup_mma_wait(1, deps=(sT, dk, dsT_op))   # dK_{t-1} and S^T_t done; dP^T_t may run
        if t > 0:                                                # tile t-1's stage is free: refill it
            prv = t - 1 + NUM_STAGES
            if prv < n_tiles:
                sp = (t - 1) % NUM_STAGES
                g2 = prv // n_q                                  # its query head within the group
                row = q_row0 + g2 * N + (i_lo + prv - g2 * n_q) * BLOCK_M
                mbarrier.expect(full.index(sp), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                _tma_load(q_desc, [row, 0], full.index(sp), q_smem.index(sp))
                _tma_load(do_desc, [row, 0], full.index(sp), do_smem.index(sp))
        pT = _probs(sT, lse2[None, :], offs_key[:, None], rows[None, :], Nk, diag, qk_scale, MASK, CAUSAL)   # P^T
        pT_op = gl.convert_layout(pT.to(dtype), op_layout)       # P^T as wgmma's A operand
        dv = warpgroup_mma(pT_op, do_tile, dv, is_async=True)    # dV += P^T dO     [BLOCK_N, HEAD_DIM]
        dpT = warpgroup_mma_wait(1, deps=(dpT,))                 # dP^T done; dV may still run
        dsT = pT * (dpT - delta[None, :])                        # [BLOCK_N, BLOCK_M] dS^T
        dsT_op = gl.convert_layout(dsT.to(dtype), op_layout)
        dk = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)    # dK += dS^T Q, left in flight
        dv, pT_op = warpgroup_mma_wait(1, deps=(dv, pT_op))      # dV done (P^T's registers free); dK may run
    return dk, dv, dsT_op


# N, Nk, group and diag are not specialised on (Triton would compile a kernel per "== 1" and "% 16 == 0" of each):
# every address the kernels form from them goes through the TMA or a masked load of a few floats.
@gluon.jit(do_not_specialize=["N", "Nk", "group", "diag"])
def _bwd_dkdv(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE2, DELTA, DK, DV, N, Nk, group, diag, qk_scale, sm_scale,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, DQ_ATOMIC: gl.constexpr, PIPELINE: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    DEFER: gl.constexpr = PIPELINE and not DQ_ATOMIC             # atomic dQ waits for its GEMM inside the tile
    # grid (key blocks, B*Hkv): the CTAs side by side are one KV head's, reading the same Q and dO (L2 hits, as in
    # the forward's _program_ids); causal, key block 0 sees the most query rows and launches first
    start_n = gl.program_id(0) * BLOCK_N
    off_bkv = gl.program_id(1)
    kv_row = off_bkv * Nk + start_n                              # first key of this block in k viewed [B*Hkv*Nk, d]
    q_row0 = off_bkv * group * N                                 # row 0 of the group's first query head [B*H*N, d]

    # Query blocks per head: [i_lo, i_mid) on the causal band (masked), [i_mid, n_qb) seen whole (no mask); blocks
    # below i_lo see none of these keys (causal: row r sees key c when c <= r + diag) and are never visited.
    n_qb = gl.cdiv(N, BLOCK_M)
    if CAUSAL:
        i_lo = gl.minimum(gl.maximum(start_n - diag, 0) // BLOCK_M, n_qb)          # block of the first row that sees
        r_all = gl.maximum(start_n + BLOCK_N - 1 - diag, 0)                        # rows >= this see every key
        i_mid = gl.minimum(gl.maximum(gl.cdiv(r_all, BLOCK_M), i_lo), n_qb)
    else:
        i_lo = 0
        i_mid = 0
    if DQ_ATOMIC:                                                # the ragged last key block: every tile masked, so
        i_mid = gl.where(start_n + BLOCK_N > Nk, n_qb, i_mid)    # that no key past Nk reaches dQ
    n_q = n_qb - i_lo                                            # tiles per query head
    n_tiles = group * n_q                                        # the flat sequence: head g's tiles follow g - 1's

    # wgmma layouts, keys on rows: S^T, dP^T [BLOCK_N, BLOCK_M]; dK, dV [BLOCK_N, HEAD_DIM]; one warp per 16 keys
    sT_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)  # P^T, dS^T

    # shared memory: K, V once; a ring of NUM_STAGES (Q, dO) stages; a barrier for K, V and one per stage
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    if DQ_ATOMIC:                                                # dS^T as an operand; two fp32 dQ tiles for the adds
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_desc.layout)
        wm: gl.constexpr = min(num_warps, BLOCK_M // 16)         # dQ [BLOCK_M, HEAD_DIM]: warps along M, then N
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, num_warps // wm],
                                                            instr_shape=[16, HEAD_DIM // (num_warps // wm), 16])
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    else:
        ds_smem = None
        dq_smem = None
        dq_zero = None
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(i), count=1)
    fence_async_shared()                                         # the barriers' init before the TMA sees them

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [kv_row, 0], kv_bar, k_smem)
    _tma_load(v_desc, [kv_row, 0], kv_bar, v_smem)
    for i in gl.static_range(NUM_STAGES):                        # prologue: tile i into stage i (all of head 0 if
        if i < n_tiles:                                          # n_q < NUM_STAGES: the next heads' then)
            g = i // n_q
            row = q_row0 + g * N + (i_lo + i - g * n_q) * BLOCK_M
            mbarrier.expect(full.index(i), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            _tma_load(q_desc, [row, 0], full.index(i), q_smem.index(i))
            _tma_load(do_desc, [row, 0], full.index(i), do_smem.index(i))

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)     # sum over the group of dS^T Q
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)     # sum over the group of P^T dO
    sT_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=sT_layout)
    offs_key = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sT_layout))   # [BLOCK_N] key indices
    offs_col = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sT_layout))             # [BLOCK_M]
    mbarrier.wait(kv_bar, 0)
    if DEFER:
        dk = warpgroup_mma_init(dk)                              # an accumulator that may be in flight
        dsT_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=op_layout)
        for g in range(group):                                   # the group's query heads, one after the other
            t0 = g * n_q                                         # head g's first tile
            l_row = q_row0 + g * N                               # its row 0 in LSE2, DELTA
            if CAUSAL:                                           # the band, masked; then the blocks seen whole
                dk, dv, dsT_op = _dkdv_tiles_deferred(
                    t0, t0 + i_mid - i_lo, t0, i_lo, n_q, n_tiles, q_row0, l_row, k_smem, v_smem, q_smem, do_smem,
                    full, q_desc, do_desc, LSE2, DELTA, dk, dv, dsT_op, sT_zero, offs_key, offs_col, N, Nk,
                    diag, qk_scale, op_layout, BLOCK_M, NUM_STAGES, True, CAUSAL)
            dk, dv, dsT_op = _dkdv_tiles_deferred(
                t0 + i_mid - i_lo, t0 + n_q, t0, i_lo, n_q, n_tiles, q_row0, l_row, k_smem, v_smem, q_smem, do_smem,
                full, q_desc, do_desc, LSE2, DELTA, dk, dv, dsT_op, sT_zero, offs_key, offs_col, N, Nk,
                diag, qk_scale, op_layout, BLOCK_M, NUM_STAGES, False, CAUSAL)
        dk, dsT_op = warpgroup_mma_wait(0, deps=(dk, dsT_op))    # the last tile's dK
    else:
        for g in range(group):                                   # the group's query heads, one after the other
            t0 = g * n_q                                         # head g's first tile
            l_row = q_row0 + g * N                               # its row 0 in LSE2, DELTA
            if CAUSAL or DQ_ATOMIC:                              # the band, masked; then the blocks seen whole
                dk, dv = _dkdv_tiles(t0, t0 + i_mid - i_lo, t0, i_lo, n_q, n_tiles, q_row0, l_row, k_smem, v_smem,
                                     q_smem, do_smem, full, q_desc, do_desc, LSE2, DELTA, dk, dv, sT_zero, offs_key,
                                     offs_col, N, Nk, diag, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, dq_zero,
                                     op_layout, BLOCK_M, NUM_STAGES, True, CAUSAL, DQ_ATOMIC)
            dk, dv = _dkdv_tiles(t0 + i_mid - i_lo, t0 + n_q, t0, i_lo, n_q, n_tiles, q_row0, l_row, k_smem, v_smem,
                                 q_smem, do_smem, full, q_desc, do_desc, LSE2, DELTA, dk, dv, sT_zero, offs_key,
                                 offs_col, N, Nk, diag, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, dq_zero,
                                 op_layout, BLOCK_M, NUM_STAGES, False, CAUSAL, DQ_ATOMIC)

    if DQ_ATOMIC:
        tma.store_wait(0)                                        # the last adds have read dq_smem
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))
    dk = dk * sm_scale                                           # dS was taken w.r.t. S = q k^T * sm_scale
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))      # [BLOCK_N]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))             # [HEAD_DIM]
    ptrs = (off_bkv * Nk + keys).to(gl.int64)[:, None] * HEAD_DIM + offs_d[None, :]   # [BLOCK_N, HEAD_DIM]
    keep = (keys < Nk)[:, None]                                  # the last block's tail is the next head's keys
    gl.store(DK + ptrs, dk.to(DK.dtype.element_ty), mask=keep)
    gl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=keep)


# ------------------------------------------------------------------ dQ: Q outer, key tiles streamed (the forward's loop)
@gluon.jit
def _dq_tiles(lo, hi, q_smem, do_smem, k_smem, v_smem, full, k_desc, v_desc, kv_row, n_tiles, dq, lse2, delta,
              s_zero, offs_m, offs_n, Nk, diag, qk_scale, ds_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles [lo, hi): dq [BLOCK_M, HEAD_DIM] fp32 += dS K_j. lse2, delta [BLOCK_M] beside S; offs_m [BLOCK_M]
    the rows' indices, offs_n [BLOCK_N] 0..BLOCK_N-1. MASK: key c of row r counts when c < Nk and (causal)
    c <= r + diag, the others get P = 0."""
    dtype: gl.constexpr = q_smem.dtype
    for j in range(lo, hi):
        s = j % NUM_STAGES                                       # stage of tile j
        mbarrier.wait(full.index(s), (j // NUM_STAGES) & 1)      # lap r waits parity r%2
        k_tile = k_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        v_tile = v_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)   # Q K^T
        dp = warpgroup_mma(do_smem, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # dO V^T
        qk = warpgroup_mma_wait(1, deps=(qk,))                   # S done; dP may still run
        p = _probs(qk, lse2[:, None], (j * BLOCK_N + offs_n)[None, :], offs_m[:, None], Nk, diag, qk_scale, MASK,
                   CAUSAL)                                       # [BLOCK_M, BLOCK_N]
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * (dp - delta[:, None])                           # [BLOCK_M, BLOCK_N] dS
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_layout), k_tile, dq)   # += dS K; synchronous
        nxt = j + NUM_STAGES                                     # stage s is read no more: refill it
        if nxt < n_tiles:
            mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row + nxt * BLOCK_N, 0], full.index(s), k_tile)
            _tma_load(v_desc, [kv_row + nxt * BLOCK_N, 0], full.index(s), v_tile)
    return dq


@gluon.jit
def _dq_tiles_deferred(lo, hi, q_smem, do_smem, k_smem, v_smem, full, k_desc, v_desc, kv_row, n_tiles, dq, ds_op, lse2,
                       delta, s_zero, offs_m, offs_n, Nk, diag, qk_scale, ds_layout: gl.constexpr,
                       BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """_dq_tiles with tile j-1's dQ GEMM left in flight into tile j (``PIPELINE``): dq comes in and goes out as a
    wgmma accumulator still being written, ds_op as its A operand. Tile j issues S_j and dP_j behind it and waits
    until only dP_j is left; then stage (j-1) % NUM_STAGES is refilled with tile j - 1 + NUM_STAGES."""
    dtype: gl.constexpr = q_smem.dtype
    for j in range(lo, hi):
        s = j % NUM_STAGES                                       # stage of tile j
        mbarrier.wait(full.index(s), (j // NUM_STAGES) & 1)      # lap r waits parity r%2
        k_tile = k_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        v_tile = v_smem.index(s)                                 # [BLOCK_N, HEAD_DIM]
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)   # Q K^T
        dp = warpgroup_mma(do_smem, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # dO V^T
        qk, dq, ds_op = warpgroup_mma_wait(1, deps=(qk, dq, ds_op))   # dQ_{j-1} and S_j done; dP_j may run
        if j > 0:                                                # tile j-1's stage is free: refill it
            prv = j - 1 + NUM_STAGES
            if prv < n_tiles:
                sp = (j - 1) % NUM_STAGES
                mbarrier.expect(full.index(sp), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_row + prv * BLOCK_N, 0], full.index(sp), k_smem.index(sp))
                _tma_load(v_desc, [kv_row + prv * BLOCK_N, 0], full.index(sp), v_smem.index(sp))
        p = _probs(qk, lse2[:, None], (j * BLOCK_N + offs_n)[None, :], offs_m[:, None], Nk, diag, qk_scale, MASK,
                   CAUSAL)                                       # [BLOCK_M, BLOCK_N]
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * (dp - delta[:, None])                           # [BLOCK_M, BLOCK_N] dS
        ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
        dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)     # += dS K, left in flight
    return dq, ds_op


@gluon.jit(do_not_specialize=["N", "Nk", "group", "diag"])
def _bwd_dq(q_desc, k_desc, v_desc, do_desc, LSE2, DELTA, DQ, N, Nk, group, diag, qk_scale, sm_scale,
            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
            CAUSAL: gl.constexpr, PIPELINE: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_bh = _program_ids(CAUSAL)                       # which query block, which (batch, head)
    q_row = off_bh * N + start_m * BLOCK_M                       # first row of this block in q viewed [B*H*N, d]
    kv_row = (off_bh // group) * Nk                              # first key of its KV head in k viewed [B*Hkv*Nk, d]
    n_tiles = _n_tiles(gl.minimum(start_m * BLOCK_M + BLOCK_M, N) - 1, Nk, diag, BLOCK_N, CAUSAL)
    n_free = gl.minimum(_n_free(start_m * BLOCK_M, Nk, diag, BLOCK_N, CAUSAL), n_tiles)

    # wgmma layouts: S, dP [BLOCK_M, BLOCK_N]; dQ [BLOCK_M, HEAD_DIM]; one warp per 16 rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)   # dS from registers
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    _tma_load(do_desc, [q_row, 0], q_bar, do_smem)
    for i in gl.static_range(NUM_STAGES):                        # prologue: fill the ring, tile i into stage i
        if i < n_tiles:
            mbarrier.expect(full.index(i), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row + i * BLOCK_N, 0], full.index(i), k_smem.index(i))
            _tma_load(v_desc, [kv_row + i * BLOCK_N, 0], full.index(i), v_smem.index(i))

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)    # [BLOCK_M] rows of this head
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
    row_ok = offs_m < N
    lse2 = gl.load(LSE2 + off_bh * N + offs_m, mask=row_ok, other=float("inf"))   # [BLOCK_M]; past N: P = 0
    delta = gl.load(DELTA + off_bh * N + offs_m, mask=row_ok, other=0.0)          # [BLOCK_M]
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    # off-band tiles, no mask; then the band (causal) and the ragged last key tile, masked
    if PIPELINE:
        dq = warpgroup_mma_init(dq)
        ds_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=ds_layout)
        dq, ds_op = _dq_tiles_deferred(0, n_free, q_smem, do_smem, k_smem, v_smem, full, k_desc, v_desc, kv_row,
                                       n_tiles, dq, ds_op, lse2, delta, s_zero, offs_m, offs_n, Nk, diag, qk_scale,
                                       ds_layout, BLOCK_N, NUM_STAGES, False, CAUSAL)
        dq, ds_op = _dq_tiles_deferred(n_free, n_tiles, q_smem, do_smem, k_smem, v_smem, full, k_desc, v_desc, kv_row,
                                       n_tiles, dq, ds_op, lse2, delta, s_zero, offs_m, offs_n, Nk, diag, qk_scale,
                                       ds_layout, BLOCK_N, NUM_STAGES, True, CAUSAL)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
    else:
        dq = _dq_tiles(0, n_free, q_smem, do_smem, k_smem, v_smem, full, k_desc, v_desc, kv_row, n_tiles, dq, lse2,
                       delta, s_zero, offs_m, offs_n, Nk, diag, qk_scale, ds_layout, BLOCK_N, NUM_STAGES, False, CAUSAL)
        dq = _dq_tiles(n_free, n_tiles, q_smem, do_smem, k_smem, v_smem, full, k_desc, v_desc, kv_row, n_tiles, dq,
                       lse2, delta, s_zero, offs_m, offs_n, Nk, diag, qk_scale, ds_layout, BLOCK_N, NUM_STAGES, True,
                       CAUSAL)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(full.index(i))
    dq = dq * sm_scale
    rows = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))   # [BLOCK_M]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))                   # [HEAD_DIM]
    ptrs = (off_bh * N + rows).to(gl.int64)[:, None] * HEAD_DIM + offs_d[None, :]          # [BLOCK_M, HEAD_DIM]
    gl.store(DQ + ptrs, dq.to(DQ.dtype.element_ty), mask=(rows < N)[:, None])


# ------------------------------------------------------------------ host side
_KINDS = ("dkdv", "dq")
# dq_mode -> what it is
DQ_MODES = {
    "separate": "dQ in its own kernel, Q outer (recomputes S and dP: 7 GEMMs in all); deterministic",
    "atomic": "dQ in the dK/dV kernel (5 GEMMs in all), fp32 tiles added into a buffer by the TMA's reduce-add, "
              "then cast; the order of the adds varies from run to run",
}
DEFAULT_DQ_MODE = "separate"


def _dq_mode(dq_mode):
    mode = DEFAULT_DQ_MODE if dq_mode is None else dq_mode
    if mode not in DQ_MODES:
        raise ValueError(f"gluon_backward: dq_mode must be one of {', '.join(map(repr, DQ_MODES))} or None, got "
                         f"{dq_mode!r}")
    return mode


_KEYS = ("BLOCK_M", "BLOCK_N", "NUM_STAGES", "num_warps", "PIPELINE")


def _tiles(d, config=None, dq_mode=None):
    """{"dkdv": (BLOCK_M, BLOCK_N, NUM_STAGES, num_warps, PIPELINE), "dq": (...)} for head dim d: ``BLOCKS[d]`` with
    ``config``'s overrides ({"dkdv": {"BLOCK_M": .., "BLOCK_N": .., "NUM_STAGES": .., "num_warps": ..,
    "PIPELINE": True/False}, "dq": {..}}, any subset; PIPELINE: the last GEMM of a tile left in flight into the next,
    ``_dkdv_tiles_deferred``, ``_dq_tiles_deferred``; the dK/dV kernel with atomic dQ never defers).
    Raises ValueError for a tile the kernels cannot take or that needs more than SMEM_LIMIT (the dK/dV kernel's with
    ``dq_mode="atomic"``'s dS^T and two dQ tiles)."""
    atomic = _dq_mode(dq_mode) == "atomic"
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"gluon_backward: config must be a dict {{'dkdv': {{...}}, 'dq': {{...}}}} or None, got "
                        f"{type(config).__name__}")
    config = config or {}
    unknown = set(config) - set(_KINDS)
    if unknown:
        raise ValueError(f"gluon_backward: config keys are 'dkdv' and 'dq'; got {sorted(unknown)}")
    out = {}
    for kind in _KINDS:
        bm, bn, st, pipe = BLOCKS[d]["dkdv_atomic" if atomic and kind == "dkdv" else kind]
        over = config.get(kind) or {}
        bad = set(over) - set(_KEYS)
        if bad:
            raise ValueError(f"gluon_backward: config[{kind!r}] takes {', '.join(_KEYS)}; got {sorted(bad)}")
        bm, bn, st = over.get("BLOCK_M", bm), over.get("BLOCK_N", bn), over.get("NUM_STAGES", st)
        pipe = over.get("PIPELINE", pipe)
        if not isinstance(pipe, bool):
            raise ValueError(f"gluon_backward: config[{kind!r}]['PIPELINE'] must be True or False, got {pipe!r}")
        pipe = pipe and not (atomic and kind == "dkdv")           # atomic dQ waits for its GEMMs inside each tile
        acc_rows = bn if kind == "dkdv" else bm                  # the wgmma accumulators' rows: 16 per warp
        warps = over.get("num_warps", min(8, acc_rows // 16))
        for name, x in (("BLOCK_M", bm), ("BLOCK_N", bn)):
            if not isinstance(x, int) or x < 16 or x > 256 or x & (x - 1):
                raise ValueError(f"gluon_backward: config[{kind!r}][{name!r}] must be a power of two in [16, 256], "
                                 f"got {x!r}")
        if warps not in (4, 8) or acc_rows % (16 * warps):
            raise ValueError(f"gluon_backward: config[{kind!r}]: num_warps must be 4 or 8 and divide "
                             f"{'BLOCK_N' if kind == 'dkdv' else 'BLOCK_M'} = {acc_rows} into 16-row slices, "
                             f"got {warps}")
        if not isinstance(st, int) or not 1 <= st <= 8 or (pipe and st < 2):
            raise ValueError(f"gluon_backward: config[{kind!r}]['NUM_STAGES'] must be 1..8 (2..8 with PIPELINE), got "
                             f"{st!r}")
        if atomic and kind == "dkdv" and bm < 64:
            raise ValueError(f"gluon_backward: dq_mode='atomic' needs config['dkdv']['BLOCK_M'] >= 64 (dQ's wgmma "
                             f"rows), got {bm}")
        smem = _smem_bytes(kind, d, bm, bn, st, atomic)
        if smem > SMEM_LIMIT:
            raise ValueError(f"gluon_backward: config[{kind!r}] = {bm}x{bn}, {st} stages needs {smem // 1024} KiB of "
                             f"shared memory at d = {d}{' with atomic dQ' if atomic and kind == 'dkdv' else ''}; "
                             f"sm_90 gives a CTA {SMEM_LIMIT // 1024} KiB")
        out[kind] = (bm, bn, st, warps, pipe)
    return out


def _smem_bytes(kind, d, bm, bn, st, atomic=False):
    """Shared memory of one CTA at 2 bytes an element: dK/dV holds K, V and st stages of (Q, dO) (atomic dQ: also
    dS^T [bn, bm] and two fp32 dQ tiles [bm, d]); dQ holds Q, dO and st stages of (K, V); plus the barriers."""
    once, streamed = (bn, bm) if kind == "dkdv" else (bm, bn)
    extra = 2 * bn * bm + 2 * 4 * bm * d if atomic and kind == "dkdv" else 0
    return 2 * d * 2 * (once + st * streamed) + extra + 8 * (st + 1)


def _check_backward_inputs(do, q, k, v, o, lse, causal, sm_scale, align):
    """The host checks, before any GPU work: align and causal, do and o of q's shape, dtype and device, lse float32
    [B, H, N], then the forward's checks of q, k, v (``gluon_forward._check_inputs``, its messages renamed), which
    end with the device: a CPU tensor gets "needs an sm_90 GPU"."""
    import torch
    if not isinstance(causal, bool):
        raise TypeError(f"gluon_backward: causal must be True or False, got {causal!r}")
    try:
        _check_align(align)
        if isinstance(q, torch.Tensor) and q.dim() == 4:         # else the forward's checks say what q should be
            for name, x in (("do", do), ("o", o)):
                if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(q.shape):
                    raise ValueError(f"gluon_forward: {name} must be a tensor of q's shape {tuple(q.shape)}, got "
                                     f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
                if x.dtype != q.dtype:
                    raise TypeError(f"gluon_forward: {name} must have q's dtype {q.dtype}, got {x.dtype}")
                if x.device != q.device:
                    raise ValueError(f"gluon_forward: {name} is on {x.device}, q on {q.device}")
            if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:3]) or \
                    lse.dtype != torch.float32:
                raise ValueError(f"gluon_forward: lse must be a float32 tensor of shape {tuple(q.shape[:3])} (the "
                                 "forward's second output)")
            if lse.device != q.device:
                raise ValueError(f"gluon_forward: lse is on {lse.device}, q on {q.device}")
        _check_inputs(q, k, v, sm_scale)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("gluon_forward", "gluon_backward")) from None


def gluon_backward(do, q, k, v, o, lse, causal=False, sm_scale=None, align="top_left", dq_mode=None, config=None):
    """Gradients ``(dq, dk, dv)`` of O = attention(q, k, v) for the upstream gradient ``do``, on an sm_90 GPU.

    q, o, do ``[B, H, N, d]``; k, v ``[B, Hkv, Nk, d]`` (H a multiple of Hkv: query head h reads KV head
    h // (H // Hkv); dk, dv sum over each KV head's group inside the kernel); lse ``[B, H, N]`` float32 natural log
    (``gluon_forward``'s or ``flash_attn_triton``'s second output; -inf for a row that saw no key: its gradients are
    0). bf16 or fp16, d = 64 or 128. ``causal``, ``align``, ``sm_scale`` as in the forward. ``dq_mode``
    (``DQ_MODES``): "separate" (a dQ kernel; deterministic) or "atomic" (from the dK/dV kernel by the TMA's fp32
    reduce-add); None = ``DEFAULT_DQ_MODE``. ``config``: tile overrides for a sweep, {"dkdv": {"BLOCK_M", "BLOCK_N",
    "NUM_STAGES", "num_warps", "PIPELINE"}, "dq": {...}} (any subset; ``BLOCKS`` otherwise; ``_tiles`` checks it).
    Raises TypeError or ValueError, before any GPU work, for inputs it cannot take."""
    import torch
    atomic = _dq_mode(dq_mode) == "atomic"
    _check_backward_inputs(do, q, k, v, o, lse, causal, sm_scale, align)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .backward import _PRE_BLOCK_M, _bwd_preprocess
    B, H, N, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    tiles = _tiles(d, config, dq_mode)
    diag = _diag(causal, align, N, Nk)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    qk_scale = sm_scale * LOG2E.value
    q, k, v, o, do = (x.contiguous() for x in (q, k, v, o, do))
    lse = lse.contiguous()

    delta = torch.empty((B, H, N), device=q.device, dtype=torch.float32)   # [B, H, N] rowsum(dO * O)
    lse2 = torch.empty_like(delta)                                          # [B, H, N] base 2, +inf on empty rows
    _bwd_preprocess[(triton.cdiv(N, _PRE_BLOCK_M), B * H)](o, do, lse, delta, lse2, N, N * d, d, HEAD_DIM=d,
                                                           BLOCK_M=_PRE_BLOCK_M, BLOCK_D=d)
    el = _gl_dtype(q.dtype)
    q2, do2 = q.view(B * H * N, d), do.view(B * H * N, d)                  # [B*H*N, d]
    k2, v2 = k.view(B * Hkv * Nk, d), v.view(B * Hkv * Nk, d)              # [B*Hkv*Nk, d]

    def desc(x, rows, dt=el):
        return TensorDescriptor.from_tensor(x, [rows, d], gl.NVMMASharedLayout.get_default_for([rows, d], dt))

    dk, dv = torch.empty_like(k), torch.empty_like(v)                      # [B, Hkv, Nk, d]
    bm, bn, st, warps, pipe = tiles["dkdv"]
    n_kb = triton.cdiv(Nk, bn)
    grid = (n_kb, B * Hkv)
    dq_acc = torch.zeros((B * H * N, d), device=q.device, dtype=torch.float32) if atomic else None   # fp32 sums
    _bwd_dkdv[grid](desc(q2, bm), desc(k2, bn), desc(v2, bn), desc(do2, bm),
                    desc(dq_acc, bm, gl.float32) if atomic else None, lse2, delta, dk, dv, N, Nk, H // Hkv, diag,
                    qk_scale, sm_scale, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=st, CAUSAL=bool(causal),
                    DQ_ATOMIC=atomic, PIPELINE=pipe, num_warps=warps)
    if atomic:
        return dq_acc.view(B, H, N, d).to(q.dtype), dk, dv
    dq = torch.empty_like(q)                                               # [B, H, N, d]
    bm, bn, st, warps, pipe = tiles["dq"]
    n_qb = triton.cdiv(N, bm)
    grid = (n_qb, B * H)                                                  # causal: _program_ids reads it backwards
    _bwd_dq[grid](desc(q2, bm), desc(k2, bn), desc(v2, bn), desc(do2, bm), lse2, delta, dq, N, Nk, H // Hkv, diag,
                  qk_scale, sm_scale, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=st, CAUSAL=bool(causal),
                  PIPELINE=pipe, num_warps=warps)
    return dq, dk, dv


def compile_backward_for_sm90(d=128, dtype="bf16", causal=False, config=None, asm="ptx", dq_mode=None):
    """Compile the backward's kernels for sm_90 with Triton's own compiler, no GPU needed (TTGIR, PTX, and a cubin
    through the ptxas in Triton's wheel): {"preprocess", "dkdv", "dq"} -> the PTX (``asm``: another of Triton's
    stages, e.g. "ttgir"); ``dq_mode="atomic"``: {"preprocess", "dkdv"}, the dK/dV kernel with dQ in it. GQA, N, Nk
    and diag are runtime arguments: nothing to compile for them. The preprocess is a plain Triton kernel: it compiles
    only with Triton native (TRITON_INTERPRET off)."""
    atomic = _dq_mode(dq_mode) == "atomic"
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    from .backward import _PRE_BLOCK_M, _bwd_preprocess
    el = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    target = GPUTarget("cuda", 90, 32)
    out = {}
    pre = ASTSource(_bwd_preprocess, {"O": f"*{dtype}", "DO": f"*{dtype}", "LSE": "*fp32", "DELTA": "*fp32",
                                      "LSE2": "*fp32", "N": "i32", "stride_oh": "i32", "stride_om": "i32",
                                      "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_D": "constexpr"},
                    {"HEAD_DIM": d, "BLOCK_M": _PRE_BLOCK_M, "BLOCK_D": d})
    out["preprocess"] = triton.compile(pre, target=target).asm[asm]
    for kind, kernel in (("dkdv", _bwd_dkdv), ("dq", _bwd_dq)):
        if kind == "dq" and atomic:
            continue
        bm, bn, st, warps, pipe = _tiles(d, config, dq_mode)[kind]
        desc = {rows: f"tensordesc<{dtype}[{rows}, {d}],{gl.NVMMASharedLayout.get_default_for([rows, d], el)!r}>"
                for rows in (bm, bn)}
        const = {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": st, "CAUSAL": bool(causal),
                 "PIPELINE": pipe}
        if kind == "dkdv":
            dq_layout = gl.NVMMASharedLayout.get_default_for([bm, d], gl.float32)
            grads = {"dq_desc": f"tensordesc<fp32[{bm}, {d}],{dq_layout!r}>" if atomic else "constexpr"}
            const.update({"DQ_ATOMIC": atomic} if atomic else {"dq_desc": None, "DQ_ATOMIC": False})
            after = {"DK": f"*{dtype}", "DV": f"*{dtype}"}
        else:
            grads, after = {}, {"DQ": f"*{dtype}"}
        sig = {"q_desc": desc[bm], "k_desc": desc[bn], "v_desc": desc[bn], "do_desc": desc[bm], **grads,
               "LSE2": "*fp32", "DELTA": "*fp32", **after, "N": "i32", "Nk": "i32", "group": "i32", "diag": "i32",
               "qk_scale": "fp32", "sm_scale": "fp32", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr",
               "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr", "CAUSAL": "constexpr",
               **({"DQ_ATOMIC": "constexpr"} if kind == "dkdv" else {}), "PIPELINE": "constexpr",
               "num_warps": "constexpr"}
        const["num_warps"] = warps
        src = GluonASTSource(kernel, sig, const)
        out[kind] = triton.compile(src, target=target, options={"num_warps": warps}).asm[asm]
    return out


# ------------------------------------------------------------------ the self-test (an sm_90 GPU)
def _grads_reference(q, k, v, do, causal, align):
    """float64 (O, lse, dq, dk, dv) by torch.autograd: q [B, H, N, d], k, v [B, Hkv, Nk, d] repeated to H heads in
    the graph (so dk, dv sum over each group), scale 1/sqrt(d), the causal mask of ``align``
    (``helpers.reference.causal_mask``). A row that sees no key gets O = 0, lse = -inf and zero gradients: its
    scores are left unmasked and its P multiplied by 0, so no -inf - (-inf) reaches the graph, whatever SDPA's
    convention for such rows."""
    import torch
    from .. import reference
    B, H, N, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kr, vr = (x.repeat_interleave(H // Hkv, 1) for x in (k64, v64))          # [B, H, Nk, d]
    s = (q64 @ kr.transpose(-1, -2)) / math.sqrt(d)                           # [B, H, N, Nk]
    seen = torch.ones(N, dtype=torch.bool, device=q.device)
    if causal:
        keep = reference.causal_mask(N, Nk, align, device=q.device)           # [N, Nk] True: attend
        seen = keep.any(-1)                                                    # [N]
        s = s.masked_fill(~(keep | ~seen[:, None]), float("-inf"))
    p = torch.softmax(s, -1) * seen[:, None]                                   # [B, H, N, Nk]
    o = p @ vr                                                                 # [B, H, N, d]
    o.backward(do.double())
    lse = torch.logsumexp(s.detach(), -1).masked_fill(~seen, float("-inf"))   # [B, H, N]
    return o.detach(), lse, q64.grad, k64.grad, v64.grad


def _sdpa_grads(q, k, v, do, causal, align):
    """SDPA's gradients in the inputs' dtype (default dispatch; k, v repeated in the graph, so their gradients sum
    over the group). A row that sees no key has no SDPA convention, so it is given every key and a zero dO: its
    gradients are then 0, as the reference's."""
    import torch.nn.functional as F
    from .. import reference
    B, H, N, d = q.shape
    g = H // k.shape[1]
    a = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    mask, do_s = None, do
    if causal:
        keep = reference.causal_mask(N, k.shape[2], align, device=q.device)    # [N, Nk]
        seen = keep.any(-1)                                                      # [N]
        mask = keep | ~seen[:, None]
        do_s = do * seen[:, None].to(do.dtype)
    o = F.scaled_dot_product_attention(a[0], a[1].repeat_interleave(g, 1), a[2].repeat_interleave(g, 1),
                                       attn_mask=mask)
    o.backward(do_s)
    return [x.grad for x in a]


def gluon_backward_selftest(shapes=None, seed=0, log=None, causal=None, config=None, dtypes=None, dims=(64, 128),
                            dq_modes=None, before=None, device="cuda"):
    """On an sm_90 GPU: ``gluon_backward`` against float64 autograd on harsh cases (the forward's
    ``SELFTEST_CASES``: ragged N and Nk, N = 1, Nk = 1, N != Nk both ways, large logits at N = 257, GQA 4:1 and 8:1,
    causal in both alignments, rows that see no key), bf16 and fp16, d = 64 and 128, each ``dq_modes`` (default: all
    of ``DQ_MODES``) on the same inputs. The inputs o and lse are the float64 forward's, rounded (o to the dtype, lse
    to float32), so the backward is tested alone. Per gradient the bound is 2 x SDPA's own backward error in that
    dtype on the same inputs plus eps(dtype) x max|reference|; every gradient must be finite and a row that sees no
    key must get dq = 0 exactly. ``causal``: None every case, True or False only those. A case that raises is a
    failed row (its error kept) and the others still run; ``before(row)`` is called before a case runs (a kernel that
    hangs is then named) and ``log(row)`` after. Returns {"cases", "worst" {dq, dk, dv: max error / bound}, "ok",
    "rows"}. (``device``: "cuda"; the CPU only for testing this harness with a stand-in for the kernel.)"""
    import torch
    torch.manual_seed(seed)
    cases = [c if len(c) == 7 else (c[0], c[1], c[1], c[2], c[3], False, "top_left") for c in shapes or SELFTEST_CASES]
    cases = [c for c in cases if causal is None or c[5] == causal]
    modes = [_dq_mode(m) for m in (dq_modes or DQ_MODES)]
    rows, worst, ok = [], {"dq": 0.0, "dk": 0.0, "dv": 0.0}, True

    def record(row):
        rows.append(row)
        if log:
            log(row)

    for dt in dtypes or (torch.bfloat16, torch.float16):
        for d in dims:
            for B, H, Hkv, N, Nk, is_causal, align in cases:
                head = dict(dtype=str(dt).replace("torch.", ""), d=d, shape=(B, H, Hkv, N, Nk),
                            causal=align if is_causal else False)
                big = 4.0 if N == 257 else 1.0                   # large logits in one shape
                q = (torch.randn(B, H, N, d, device=device) * big).to(dt)
                k, v = (torch.randn(B, Hkv, Nk, d, device=device).to(dt) for _ in range(2))
                do = torch.randn(B, H, N, d, device=device).to(dt)
                try:
                    o64, lse64, *refs = _grads_reference(q, k, v, do, is_causal, align)
                    theirs = _sdpa_grads(q, k, v, do, is_causal, align)
                except Exception as e:  # noqa: BLE001 - the references failed: every mode's row says so
                    ok = False
                    for mode in modes:
                        record(dict(head, dq_mode=mode, ok=False, error=f"reference: {type(e).__name__}: "
                                                                          f"{str(e)[:300]}"))
                    continue
                seen = torch.isfinite(lse64)                     # [B, H, N] rows that see at least one key
                ref_finite = all(bool(torch.isfinite(r).all()) for r in refs)
                o_in, lse_in = o64.to(dt), lse64.float()
                for mode in modes:
                    row = dict(head, dq_mode=mode)
                    if before:
                        before(row)
                    try:
                        mine = gluon_backward(do, q, k, v, o_in, lse_in, causal=is_causal, align=align,
                                              dq_mode=mode, config=config)
                        if q.is_cuda:
                            torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001 - one report for the whole run
                        ok = False
                        record(dict(row, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
                        continue
                    good = ref_finite
                    row["ref_finite"] = ref_finite
                    for name, m, t, r in zip(("dq", "dk", "dv"), mine, theirs, refs):
                        err = (m.double() - r).abs().max().item() if r.numel() else 0.0
                        sdpa = (t.double() - r).abs().max().item() if r.numel() else 0.0
                        bound = 2 * sdpa + torch.finfo(dt).eps * (r.abs().max().item() if r.numel() else 0.0)
                        fine = bool(torch.isfinite(m).all()) and err <= bound
                        row.update({f"{name}_err": err, f"{name}_sdpa_err": sdpa, f"{name}_ok": fine})
                        worst[name] = max(worst[name], err / bound if bound > 0 else (0.0 if err == 0 else math.inf))
                        good &= fine
                    empty_ok = bool((mine[0][~seen] == 0).all())     # dq of rows that see no key: 0 exactly
                    row.update(empty_rows=int((~seen).sum().item()), empty_ok=empty_ok, ok=good and empty_ok)
                    ok &= row["ok"]
                    record(row)
                    del mine
                del q, k, v, do, o64, lse64, refs, theirs, o_in, lse_in
    return {"cases": len(rows), "worst": worst, "ok": ok, "rows": rows}


def _head(row):
    return (f"{row['dq_mode']:8s} {row['dtype']:8s} d={row['d']:<3d} (B,H,Hkv,N,Nk)={row['shape']} "
            f"causal={row['causal']}")


def _fmt(row):
    """One case on one line: its shape and, per gradient, error / SDPA's error."""
    if "error" in row:
        return f"FAIL {_head(row)}: {row['error']}"
    errs = " ".join(f"{n} {row[f'{n}_err']:.2e}/{row[f'{n}_sdpa_err']:.2e}" for n in ("dq", "dk", "dv"))
    empty = f" empty rows {row['empty_rows']} ({'dq 0' if row['empty_ok'] else 'dq NOT 0'})" if row["empty_rows"] else ""
    return f"{'ok  ' if row['ok'] else 'FAIL'} {_head(row)}: err/sdpa_err {errs}{empty}"


if __name__ == "__main__":     # on an sm_90 GPU: python -m helpers.kernels.gluon_backward [--causal] [--dq-mode M]
    import argparse
    import json

    import torch
    ap = argparse.ArgumentParser(description="The Gluon backward against float64 autograd on harsh cases "
                                             "(an sm_90 GPU).")
    ap.add_argument("--causal", action="store_true", help="only the causal cases (default: every case)")
    ap.add_argument("--dq-mode", nargs="+", choices=list(DQ_MODES), default=None, help="default: every mode")
    ap.add_argument("--config", type=json.loads, default=None, help="tile overrides (JSON), as gluon_backward's")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    result = gluon_backward_selftest(causal=True if args.causal else None, dq_modes=args.dq_mode, config=args.config,
                                     before=lambda r: print(f"...  {_head(r)}", end="\r", flush=True),
                                     log=lambda r: print(_fmt(r), flush=True))
    n_bad = sum(not r["ok"] for r in result["rows"])
    w = result["worst"]
    print(f"gluon_backward: {result['cases']} cases{' (causal)' if args.causal else ''}, {n_bad} failed; worst "
          f"error / bound: dq {w['dq']:.2f}, dk {w['dk']:.2f}, dv {w['dv']:.2f}: "
          f"{'ALL OK' if result['ok'] else 'FAILURES ABOVE'}")
    raise SystemExit(0 if result["ok"] else 1)
