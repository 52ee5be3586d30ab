"""Packed variable-length attention forward in Triton (lesson 10), and the prepared batch a training step shares.

Serving and training systems do not pad a batch of sequences to one length: they pack them end to end and say
where each starts with ``cu_seqlens`` (0, then the cumulative lengths), the FlashAttention library's
``flash_attn_varlen_func`` layout. Pre-training packs documents into long rows the same way, with a causal mask
inside each document. Public:

* ``prepare_varlen(cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *, device=None)
  -> VarlenBatch``: the batch's layout, checked once where the batch is made. From host values (a list or a CPU
  tensor, as a data loader has them) nothing waits for the GPU; from a GPU tensor one copy to the host. The
  batch keeps its own device copy of cu_seqlens and builds the program maps from the host values (per block
  size, cached): every layer's forward and backward of a step reuse them, read nothing back from the GPU and
  can be captured in a CUDA graph. The library checks nothing either: it leaves validation to the caller.
* ``flash_attn_varlen_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
  sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
  block_table=None) -> (O, lse)``: q ``[total_q, H, d]``, k, v ``[total_k, Hkv, d]`` (or pages
  ``[num_pages, page, Hkv, d]`` with ``block_table``); ``cu_seqlens_q`` may be a ``VarlenBatch`` (then the next
  three are left out).
  Each program finds its sequence's rows and keys, then runs the dense forward's block body
  (``_attn_fwd_rows`` and its inner loop ``_attn_fwd_inner`` from helpers/kernels/forward.py: one source) with
  that sequence's lengths, so every document gets the dense kernel's tile classes: key tiles no row of the block
  sees are never visited, tiles every row sees in full run without a mask, the diagonal band and the ragged
  tail with one. Causal is bottom-right per sequence, as in the library; so are the sliding window and ALiBi
  (slopes [H] or [num_seqs, H]); softcap (with ALiBi too: the cap first), dropout and any head dim from 1 to 256
  as in the dense forward. Dropout's Philox counters name (sequence * H + head, row and key within the
  sequence), so sequence b's mask is the dense mask of batch entry b (``forward.dropout_keep_mask`` with
  B = num_seqs): reproducible, and the same whatever else is packed beside it. Paged K/V (the library's
  ``block_table``, forward only as there): key j of sequence b is row j % page of page block_table[b, j // page],
  looked up per key of each tile (any page size), in one masked loop over the keys the block sees.
* ``varlen_block_map(cu_seqlens_q, BLOCK_M) -> (seq_idx, q_start)`` and ``varlen_block_m(d)``: lesson 10's
  program map, built on the device with torch ops from the device's cu_seqlens (no host sync, an upper bound
  of programs, the spares marked -1), for a caller that has no batch.

The grid is one flat axis over (map entry, head), the heads fastest: the programs that run side by side are
the heads of a few blocks, which read the same keys of one document (grouped-query heads read one KV head).
A prepared batch's map lists the blocks by the work they do, heaviest first (under a causal mask the last
query blocks of the longest documents, which see the most keys; in the backward's dK/dV map the first key
blocks, which the most rows see), so that the long programs start first and the short ones, a document of 9
tokens next to one of 4291, fill the gaps at the end: the greedy longest-first order of list scheduling.

Tiles: each kernel's configuration is chosen per shape class (head dim, dtype, the masks, the GQA group, the
batch's length class: short or long documents, ``SHORT_DOCUMENTS``) by timing the candidates on the first call,
outside a CUDA graph capture; every candidate's map comes from the batch, and a batch of short documents has
smaller tiles among its candidates. The host's part of a call on a batch is small: the first call of a shape
checks the inputs and builds a launch plan (the chosen tile's map, grid, arguments), which the batch keeps for
every later layer; every tensor handed to a kernel starts on 16 bytes and the row count is not specialised on,
so a new batch compiles nothing.

References: Dao, "FlashAttention-2" (2023); the FlashAttention library's varlen interface (``cu_seqlens``,
``max_seqlen``); Graham, "Bounds on multiprocessing timing anomalies" (1969) for the longest-first order.
Written for this course.
"""

import math
import weakref

import torch
import triton
import triton.language as tl

from ..triton_mode import interpreting
from .common import (LN2, LOG2E, SHAPES, TensorDescriptor, _check_head_dim, _check_qkv, _device_limits, fitting_configs,
                     head_block, smem_estimate, tile_configs)
from .forward import _attn_fwd_inner, _attn_fwd_rows, _check_dropout_args, _check_mods, _check_use_tma, _use_tma_default

__all__ = ["flash_attn_varlen_triton", "varlen_block_map", "varlen_block_m", "prepare_varlen", "VarlenBatch"]


# ----------------------------------------------------------------------------
# The prepared batch: cu_seqlens checked once, the program maps built from the host values
# ----------------------------------------------------------------------------


def _check_cu_kind(name, cu):
    """cu_seqlens' type, rank and dtype (a tensor) or its entries (a list), without reading a tensor's values."""
    if isinstance(cu, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
            raise TypeError(f"{name} must hold ints, got {cu!r}")
        n = len(cu)
    elif isinstance(cu, torch.Tensor):
        if cu.dim() != 1:
            raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu.shape)}")
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {str(cu.dtype).replace('torch.', '')}")
        n = cu.numel()
    else:
        raise TypeError(f"{name} must be a torch.Tensor (int32 [B + 1]) or a list of ints, got {type(cu).__name__}")
    if n < 2:
        raise ValueError(f"{name} must hold at least one sequence: [0, len_0, ...], got "
                         f"{cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)}")


def _host_values(cu_q, cu_k):
    """Both cu_seqlens as lists of ints: one copy to the host for the tensors (none for CPU tensors and lists)."""
    _check_cu_kind("cu_seqlens_q", cu_q)
    _check_cu_kind("cu_seqlens_k", cu_k)
    if cu_k is cu_q:
        values = cu_q.tolist() if isinstance(cu_q, torch.Tensor) else list(cu_q)
        return values, values
    if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and cu_q.device == cu_k.device:
        both = torch.cat([cu_q.to(torch.int64), cu_k.to(torch.int64)]).tolist()  # the batch's one host copy
        return both[:cu_q.numel()], both[cu_q.numel():]
    return tuple(c.tolist() if isinstance(c, torch.Tensor) else list(c) for c in (cu_q, cu_k))


def _check_cu_values(name, cu, max_seqlen, max_name):
    """0 first, never decreasing, within int32, the longest within max_seqlen (when given). Returns the lengths."""
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{name} must not decrease: {name}[{i}] = {cu[i]} > {name}[{i + 1}] = {cu[i + 1]}")
    if cu[-1] >= 2**31:
        raise ValueError(f"{name}[-1] = {cu[-1]}: the kernels index packed rows in int32")
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"{max_name} must be an int, got {type(max_seqlen).__name__}")
        longest = max(lens)
        if max_seqlen < longest:
            raise ValueError(f"{max_name} = {max_seqlen} is smaller than sequence {lens.index(longest)}'s "
                             f"length {longest}")
    return lens


def _to_device(rows, device):
    """The rows of host ints ``rows`` [R, n] (a tensor or nested lists) as R int32 tensors [n] on ``device``, copied
    in one piece without waiting for the GPU (pinned memory, non-blocking), each starting on a 16-byte boundary.
    Triton specialises a kernel on whether each pointer argument is 16-byte aligned: rows of one [R, n] tensor
    would be aligned or not by n, so a batch with another number of blocks or documents would compile every
    kernel again (seconds each, in the middle of a training run). Each row is padded to a multiple of 4 entries."""
    rows = torch.as_tensor(rows)
    R, n = rows.shape
    width = max(4, -(-n // 4) * 4)  # int32 entries, 4 per 16 bytes
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a VarlenBatch builds its program maps outside a CUDA graph capture: run one forward and "
                           "backward of the step before capturing it (the maps are cached in the batch)")
    buf = torch.zeros((R, width), dtype=torch.int32, pin_memory=cuda)  # [R, width] on the host
    buf[:, :n] = rows
    out = buf.to(device, non_blocking=True) if cuda else buf.to(device)  # [R, width]
    return [out[i, :n] for i in range(R)]


# The batch's length class, part of the key its kernels' tiles are chosen under: "short" when the document an
# average token sits in (the token-weighted mean length, sum n^2 / sum n) is shorter than SHORT_DOCUMENTS tokens,
# "long" otherwise. A short batch's tiles are mostly empty rows and keys and its programs mostly prologue and
# epilogue: its candidates add smaller tiles and fewer stages (more programs side by side on an SM). Past a few
# tiles every document runs like a long one, so two classes: a finer split would make a training run time the
# candidates again each time a batch crossed a boundary.
SHORT_DOCUMENTS = 256


class VarlenBatch:
    """One packed batch's layout, checked once and shared by every layer of a step (``prepare_varlen`` makes it).

    ``cu_seqlens_q``, ``cu_seqlens_k``: the batch's own int32 [B + 1] copies on ``device`` (a later in-place change
    to the caller's tensors cannot make them disagree with the maps); ``max_seqlen_q``, ``max_seqlen_k``,
    ``total_q``, ``total_k``, ``num_seqs``: ints on the host; ``lengths_q``, ``lengths_k``: int64 [B] on the CPU;
    ``length_class``: "short" or "long" (``SHORT_DOCUMENTS``), part of the key the kernels' tile choice is cached
    under. ``block_map(block, kind, causal)``: a program map (below); ``built_maps()``: the (block, kind, causal)
    of the maps built so far. The batch also keeps each call shape's launch plan (``_plan_for``): the first layer's
    call checks and builds it, the other layers' calls only allocate their outputs and launch.
    """

    def __init__(self, cu_q, cu_k, max_seqlen_q, max_seqlen_k, device):
        lens_q = _check_cu_values("cu_seqlens_q", cu_q, max_seqlen_q, "max_seqlen_q")
        lens_k = _check_cu_values("cu_seqlens_k", cu_k, max_seqlen_k, "max_seqlen_k")
        if len(lens_q) != len(lens_k):
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences: "
                             f"B = {len(lens_q)} and {len(lens_k)}")
        self.device = device
        self.num_seqs = len(lens_q)
        self.total_q, self.total_k = cu_q[-1], cu_k[-1]
        self.max_seqlen_q = max(lens_q) if max_seqlen_q is None else max_seqlen_q
        self.max_seqlen_k = max(lens_k) if max_seqlen_k is None else max_seqlen_k
        self._cu_host = (torch.tensor(cu_q, dtype=torch.int64), torch.tensor(cu_k, dtype=torch.int64))
        self.lengths_q = self._cu_host[0][1:] - self._cu_host[0][:-1]  # [B]
        self.lengths_k = self._cu_host[1][1:] - self._cu_host[1][:-1]  # [B]
        self.cu_seqlens_q, self.cu_seqlens_k = _to_device(torch.stack(self._cu_host), device)  # one copy for both
        n = self.lengths_q.double()
        mean = float((n * n).sum() / n.sum()) if self.total_q else 0.0  # the token-weighted mean length
        self.length_class = "short" if mean < SHORT_DOCUMENTS else "long"
        self._maps = {}
        self._plans = {}

    def block_map(self, block, kind="q", causal=False):
        """``(seq_idx, start)``, int32 [P] on the batch's device: entry p is the block of ``block`` query rows
        (``kind="q"``: the forward and dQ) or keys (``"k"``: dK/dV) of sequence ``seq_idx[p]`` that starts at
        packed row ``start[p]``; exactly one entry per block with rows (a sequence of length 0 has none), a key
        block of a sequence with no queries included (its dK, dV are written as 0). Ordered by the work the
        block's programs do, heaviest first (``_work_order``); built once per (block, kind, causal) and cached."""
        key = (block, kind, bool(causal))
        if key not in self._maps:
            seq, start = _work_order(self._cu_host, self.lengths_q, self.lengths_k, block, kind, causal)
            self._maps[key] = tuple(_to_device(torch.stack([seq, start]), self.device))  # [P], [P]
        return self._maps[key]

    def built_maps(self):
        """The (block, kind, causal) of every map built so far (a benchmark rebuilds them to time a batch's set-up)."""
        return list(self._maps)

    def __repr__(self):
        return (f"VarlenBatch({self.num_seqs} sequences, {self.total_q} query / {self.total_k} key rows, "
                f"max_seqlen {self.max_seqlen_q}/{self.max_seqlen_k}, {self.length_class} documents, "
                f"on {self.device})")


def _work_order(cu_host, lens_q, lens_k, block, kind, causal):
    """(seq_idx, start) int64 [P] on the CPU, heaviest first. Kind "q": query block m of a sequence with lengths
    (n, nk) visits keys [0, min((m + 1) * block + nk - n, nk)) under the bottom-right causal mask (all nk keys
    without it); kind "k": key block j is seen by rows [clamp(j * block - (nk - n), 0, n), n) (all n without the
    mask). Ties keep sequence order, then block order (a stable sort)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if kind not in ("q", "k"):
        raise ValueError(f"kind must be 'q' (query blocks) or 'k' (key blocks), got {kind!r}")
    lens = lens_q if kind == "q" else lens_k  # [B]
    n_blocks = (lens + block - 1) // block  # [B]
    blocks_end = torch.cumsum(n_blocks, 0)  # [B] blocks of sequences 0..b together
    # [P] sequence by sequence (searchsorted, not repeat_interleave: that one wakes the CPU's thread pool, which
    # costs milliseconds per map on a busy host)
    seq = torch.searchsorted(blocks_end, torch.arange(int(blocks_end[-1]) if lens.numel() else 0), right=True)
    first = blocks_end - n_blocks  # [B] index of each sequence's first block
    j = torch.arange(seq.numel()) - first[seq]  # [P] block index within its sequence
    n, nk = lens_q[seq], lens_k[seq]  # [P]
    if kind == "q":
        work = torch.minimum((j + 1) * block + nk - n, nk).clamp(min=0) if causal else nk  # keys visited
    else:
        work = n - (j * block - (nk - n)).clamp(min=0).minimum(n) if causal else n  # rows visited
    order = torch.argsort(-work, stable=True)  # [P]
    start = cu_host[0 if kind == "q" else 1][seq] + j * block  # [P] first packed row (or key) of the block
    return seq[order], start[order]


def prepare_varlen(cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *, device=None):
    """The layout of one packed batch, checked once: returns a ``VarlenBatch`` to pass to every layer's
    ``flash_attention_varlen`` / ``flash_attn_varlen_triton`` (in place of cu_seqlens and max_seqlen).

    cu_seqlens_q: [B + 1] int32 or int64 (a tensor on any device, or a list of ints), 0 then the cumulative query
    lengths; cu_seqlens_k: the same for the keys, None for packed self-attention (the query layout).
    max_seqlen_q, max_seqlen_k: the library's arguments, checked when given (the longest lengths otherwise).
    device: where the kernels will run (default: cu_seqlens_q's device for a tensor; for a list, CUDA when the
    course runs natively, else the CPU). Checked: 0 first, never decreasing, the same B for q and k.

    Cost: from host values, no sync (a data loader builds cu_seqlens on the CPU); from a GPU tensor, one copy to
    the host. The program maps are built on the host and copied to the device without waiting (pinned memory),
    on the first call that needs each one: run one step before capturing a CUDA graph.
    """
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
        if max_seqlen_k is None:
            max_seqlen_k = max_seqlen_q
    if device is None:
        if isinstance(cu_seqlens_q, torch.Tensor):
            device = cu_seqlens_q.device
        else:
            device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cu_q, cu_k = _host_values(cu_seqlens_q, cu_seqlens_k)
    return VarlenBatch(cu_q, cu_k, max_seqlen_q, max_seqlen_k, device)


class _DeviceLayout:
    """The library's arguments taken as they are, nothing read back (``validate=False``): cu_seqlens stay on the
    device and each map is lesson 10's, built there with torch ops (``varlen_block_map``: block-index order, an
    upper bound of entries, the spares -1). Wrong values give wrong results, as in the library."""

    length_class = None

    def __init__(self, cu_q, cu_k, total_q, total_k):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_q.contiguous(), cu_k.contiguous()
        self.total_q, self.total_k = total_q, total_k
        self.num_seqs = cu_q.numel() - 1
        self._maps = {}

    def block_map(self, block, kind="q", causal=False):
        key = (block, kind)
        if key not in self._maps:
            cu, total = (self.cu_seqlens_q, self.total_q) if kind == "q" else (self.cu_seqlens_k, self.total_k)
            self._maps[key] = varlen_block_map(cu, block, total_q=total)
        return self._maps[key]


# ----------------------------------------------------------------------------
# Lesson 10's map: (sequence, Q block) per program, built on the device
# ----------------------------------------------------------------------------


def varlen_block_map(cu_seqlens_q, BLOCK_M, total_q=None):
    """Which (sequence, block of BLOCK_M query rows) each program of the varlen grid owns.

    cu_seqlens_q: [B + 1] int32 or int64, 0 then the cumulative query lengths: sequence b owns the
    packed rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1. BLOCK_M: query rows per program.
    total_q: the number of packed rows (q.shape[0]), known on the host, so that nothing is read back
    from the device (no sync); None reads cu_seqlens_q[-1].

    Returns (seq_idx, q_start), int32 [P] on cu_seqlens_q's device, with
    P = (total_q + B * (BLOCK_M - 1)) // BLOCK_M: an upper bound on the number of blocks (a sequence's
    last block leaves at most BLOCK_M - 1 rows empty), known without reading the lengths. Program p owns
    packed rows q_start[p] .. min(q_start[p] + BLOCK_M, cu_seqlens_q[seq_idx[p] + 1]) - 1; the spare
    programs at the end get seq_idx = q_start = -1 and return at once. A sequence of length 0 has no block.

    Order: by the block's index within its sequence, largest first; equal indices in sequence order.
    Under a causal mask a block's work grows with its index, and only long sequences have large
    indices, so the programs that run longest start first and the short ones fill in at the end.
    (A ``VarlenBatch``, which knows the lengths on the host, orders by the work itself: ``_work_order``.)
    """
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise ValueError("cu_seqlens_q must be a 1-D tensor [B + 1] with B >= 1")
    if isinstance(BLOCK_M, bool) or not isinstance(BLOCK_M, int) or BLOCK_M < 1:
        raise ValueError(f"BLOCK_M must be a positive int, got {BLOCK_M!r}")
    cu = cu_seqlens_q.to(torch.int64)  # [B + 1]
    B = cu.numel() - 1
    if total_q is None:
        total_q = int(cu[-1])
    lens = cu[1:] - cu[:-1]  # [B] query rows per sequence
    n_blocks = (lens + BLOCK_M - 1) // BLOCK_M  # [B] blocks per sequence
    blocks_end = torch.cumsum(n_blocks, 0)  # [B] blocks of sequences 0..b together
    P = (total_q + B * (BLOCK_M - 1)) // BLOCK_M
    p = torch.arange(P, device=cu.device)  # [P] blocks in sequence order
    seq = torch.searchsorted(blocks_end, p, right=True)  # [P] the sequence of block p; B: spare
    real = seq < B  # [P]
    seq_c = seq.clamp(max=B - 1)  # [P] a valid index for the gathers
    blk = p - (blocks_end[seq_c] - n_blocks[seq_c])  # [P] block index within its sequence
    q_start = cu[seq_c] + blk * BLOCK_M  # [P] first packed row of the block
    order = torch.argsort(torch.where(real, -blk, 1), stable=True)  # [P] largest index first, spares last
    seq_idx = torch.where(real, seq, -1)[order].to(torch.int32)  # [P]
    q_start = torch.where(real, q_start, -1)[order].to(torch.int32)  # [P]
    return seq_idx, q_start


# ----------------------------------------------------------------------------
# The kernel: find this program's sequence, then the dense forward's block body
# ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["total_q", "seed", "drop_off"])  # one compile for every batch size and mask
def _attn_fwd_varlen(
    Q, K, V, O, LSE,
    desc_k, desc_v,  # TMA path: descriptors over K, V viewed as [total_k, Hkv * D]
    SEQ_IDX, Q_START, CU_Q, CU_K,  # the map [P], [P]; cu_seqlens [B + 1], [B + 1]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_q, H, Hkv, qk_scale,
    SLOPES, stride_sb,  # ALiBi: slope of (sequence b, head h) at SLOPES[b * stride_sb + h] (stride_sb = 0: per head)
    left, right, sm_scale, cap,  # the window (each side >= 0 when its switch is on), the score mod's scalars
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_block(HEAD_DIM): the columns past HEAD_DIM are masked
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # an upper bound: j <= i + Nk - N + right (causal: right = 0)
    USE_TMA: tl.constexpr,
    WINDOW: tl.constexpr,  # a lower bound: j >= i + Nk - N - left
    SCORE_MOD: tl.constexpr,  # bits: 1 softcap, 2 ALiBi (3: both, the cap first)
    # dropout, last and off by default: its probability, the Philox key and counter offset. The mask's counters
    # name (sequence * H + head, row and key within the sequence): sequence b's mask is the dense mask of batch
    # entry b (forward.dropout_keep_mask with B = num_seqs), whatever the packing around it
    p_drop=0.0, seed=0, drop_off=0,
    DROPOUT: tl.constexpr = False,
    # paged K/V (the library's block_table, forward only): K, V [num_pages, page, Hkv, D]; key j of sequence b is
    # row j % page of page BT[b * stride_bt + j // page]; stride_kt, stride_vt the row strides within a page
    BT=None, stride_bt=0, page=1, stride_kp=0, stride_vp=0,
    PAGED: tl.constexpr = False,
):
    # grid = (P * H,): program pid owns entry pid // H of the map for query head pid % H (the heads fastest)
    pid = tl.program_id(0)
    entry = pid // H
    off_h = pid % H
    off_hkv = off_h // (H // Hkv)  # grouped-query attention

    seq = tl.load(SEQ_IDX + entry)
    if seq < 0:  # a spare program of lesson 10's map (an upper bound on the blocks)
        return
    q_beg = tl.load(CU_Q + seq).to(tl.int32)  # first packed row of this sequence (cu_seqlens may be int64)
    k_beg = tl.load(CU_K + seq).to(tl.int32)  # and its first key; int32 like TMA's coordinates
    N = tl.load(CU_Q + seq + 1).to(tl.int32) - q_beg  # this sequence's query rows
    Nk = tl.load(CU_K + seq + 1).to(tl.int32) - k_beg  # and keys
    diag = Nk - N  # causal, bottom-right: row i sees key j when j <= i + Nk - N
    alibi_diag = diag  # ALiBi's distance |i + Nk - N - j|
    diag_lo = diag - left  # the window: i + diag - left <= j <= i + diag + right
    diag = diag + right
    start_m = (tl.load(Q_START + entry) - q_beg) // BLOCK_M  # block index within the sequence
    slope = 0.0
    if SCORE_MOD & 2:
        slope = tl.load(SLOPES + seq * stride_sb + off_h)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows, counted from the sequence's first
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    row_ok = offs_m < N  # [BLOCK_M]
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_M, D]

    q_base = Q + q_beg.to(tl.int64) * stride_qt + off_h.to(tl.int64) * stride_qh
    k_base = K + k_beg.to(tl.int64) * stride_kt + off_hkv.to(tl.int64) * stride_kh
    v_base = V + k_beg.to(tl.int64) * stride_vt + off_hkv.to(tl.int64) * stride_vh
    o_base = O + q_beg.to(tl.int64) * stride_ot + off_h.to(tl.int64) * stride_oh
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]  # [BLOCK_N, D]
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, D]
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=io_ok, other=0.0)  # [BLOCK_M, D]

    # TMA: this sequence's keys of KV head off_hkv start at row k_beg, column off_hkv * D. A masked tile
    # may run into the next sequence's rows: their scores are masked to -inf and their values zeroed, so
    # nothing of another request (not even a NaN) reaches this one.
    if PAGED:  # column 0 of KV head off_hkv in page 0; the inner loop adds each key's page and row
        zero_n = offs_n[:, None] * 0  # [BLOCK_N, 1]
        k_head = K + off_hkv.to(tl.int64) * stride_kh + zero_n + offs_d[None, :]  # [BLOCK_N, D]
        v_head = V + off_hkv.to(tl.int64) * stride_vh + zero_n + offs_d[None, :]  # [BLOCK_N, D]
        acc, lse = _attn_fwd_rows_paged(
            q, k_head, v_head, stride_kt, stride_vt, BT + seq.to(tl.int64) * stride_bt, page, stride_kp, stride_vp,
            start_m, offs_m, offs_n, qk_scale, Nk, diag, diag_lo, sm_scale, cap, slope, alibi_diag,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SCORE_MOD,
            DROPOUT, p_drop, seed, drop_off, seq * H + off_h,
        )
    else:
        acc, lse = _attn_fwd_rows(
            q, k_ptrs, v_ptrs, stride_kt, stride_vt, desc_k, desc_v, k_beg, off_hkv * HEAD_DIM,
            start_m, offs_m, offs_n, qk_scale, Nk, diag, diag_lo, sm_scale, cap, slope, alibi_diag,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, USE_TMA, WINDOW, SCORE_MOD,
            DROPOUT, p_drop, seed, drop_off, seq * H + off_h,
        )
    tl.store(LSE + off_h.to(tl.int64) * total_q + q_beg + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=io_ok)


@triton.jit
def _attn_fwd_rows_paged(
    q, k_head, v_head, stride_kt, stride_vt, BT, page, stride_kp, stride_vp,  # BT: this sequence's row of the table
    start_m, offs_m, offs_n, qk_scale, Nk, diag, diag_lo, sm_scale, cap, slope, alibi_diag,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    DROPOUT: tl.constexpr, p_drop, seed, drop_off, bh,
):
    """``forward._attn_fwd_rows`` over paged keys: the same key range (keys no row of the block sees are never
    visited), one masked loop over it (the dense block body takes no page table), the same epilogue."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M + diag, 0), Nk)  # past the last row's last key
    else:
        hi = Nk
    lo = 0
    if WINDOW:
        lo = (tl.minimum(tl.maximum(start_m * BLOCK_M + diag_lo, 0), Nk) // BLOCK_N) * BLOCK_N  # the first row's
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kt, stride_vt, None, None, 0, 0,
        lo, hi, offs_m, offs_n, qk_scale, Nk, diag, diag_lo, sm_scale, cap, slope, alibi_diag,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, False, WINDOW, SCORE_MOD, DROPOUT, p_drop, seed, drop_off, bh,
        True, BT, page, stride_kp, stride_vp,
    )
    empty = l_i == 0.0  # [BLOCK_M] a row that saw no key: O = 0, lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    if DROPOUT:
        l_safe = l_safe * (1.0 - p_drop)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    return acc, lse


# ----------------------------------------------------------------------------
# Configurations: candidates per head-dim class, one chosen per shape class by timing them once
# ----------------------------------------------------------------------------

_INTERPRETER_VARLEN_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class, around what the dense forward's autotuner chose
# on the H200 (bench/results/h200.json: 128 x 64 for d = 64, 128 x 128 for d = 128 on long rows, 64 x 64 on
# rows of 512 to 1024). The first one's BLOCK_M is varlen_block_m(d), for lesson 10's maps.
_VARLEN_SHAPES = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],  # d <= 64
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(64, 64, 4, 3), (64, 32, 4, 3)],  # smaller tiles: q and two K/V stages fit shared memory
}
# Added on Hopper to the candidates of a batch of short documents (``VarlenBatch.length_class``,
# ``class_candidates``). A document of 32 tokens is one program with one key tile, whose 528 causal pairs are a
# sixteenth of a 128 x 64 tile: the program is mostly its q load, one K and V load and the stores, latencies
# that only other programs on the SM can hide. Smaller tiles waste less, and two stages instead of three leave
# shared memory for more programs side by side (d = 128: 128 KB a program at 128 x 64 x 3 stages, one per SM;
# 48 KB at 64 x 32 x 2, four). BLOCK_M = 32 runs two warps (16 rows each).
_VARLEN_SHORT_SHAPES = {
    64: [(64, 32, 4, 2), (32, 32, 2, 2)],
    128: [(64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 2)],
    256: [(32, 32, 4, 2)],
}


def _d_class(d):
    """The configuration class of head dim d: its padded width, with everything up to 64 in one class."""
    return max(64, head_block(d))


SHAPES["varlen"] = lambda d: tile_configs(_VARLEN_SHAPES[_d_class(d)])
SHAPES["varlen_short"] = lambda d: tile_configs(_VARLEN_SHORT_SHAPES[_d_class(d)])


def varlen_block_m(d):
    """The BLOCK_M of the varlen kernel's first configuration for head dimension d: a map passed in as
    ``block_map`` (lesson 10's ``varlen_block_map``) must be built for it."""
    if interpreting():
        return _INTERPRETER_VARLEN_CONFIG["BLOCK_M"]
    return _VARLEN_SHAPES[_d_class(d)][0][0]


def candidates(smem_kind, configs, d, dtype, device):
    """The configurations (dicts) of ``configs`` a launcher may time for head dim d on this device: those that fit
    the GPU's shared memory by ``smem_estimate(smem_kind, ...)`` ("varlen", "dkdv", "dq"); one fixed small tile
    under the interpreter."""
    if interpreting() or device.type != "cuda":
        return [dict(_INTERPRETER_VARLEN_CONFIG)]
    cap, smem = _device_limits(device)
    return fitting_configs(smem_kind, configs, d, dtype, cap, smem)


def class_candidates(kind, smem_kind, d, dtype, device, length_class):
    """The candidates of kernel ``kind`` ("varlen", "varlen_dkdv", "varlen_dq"; shared memory estimated as
    ``smem_kind``) on a batch of this length class: ``candidates`` of its set, and for "short" on a Hopper GPU
    (sm_90 and newer), after them, those of its short set (``SHAPES[kind + "_short"]``) that fit. The short sets
    answer Hopper's tiles, whose three stages leave room for one program per SM; elsewhere the set alone."""
    every = candidates(smem_kind, SHAPES[kind](d), d, dtype, device)
    if length_class != "short" or interpreting() or device.type != "cuda":
        return every
    cap, smem = _device_limits(device)
    if cap < (9, 0):
        return every
    elt = torch.empty((), dtype=dtype).element_size()
    return every + [c for c in SHAPES[kind + "_short"](d)
                    if c not in every and smem_estimate(smem_kind, c, d, elt, cap) <= smem]


_chosen = {}  # shape class -> the configuration timed fastest on its first call
_rejected = {}  # shape class -> [(configuration, error)] of the candidates that failed to compile or launch


def chosen_configs():
    """{shape class: configuration}: what each varlen kernel runs with after its first call (for the records)."""
    return dict(_chosen)


def rejected_configs():
    """{shape class: [(configuration, error)]}: candidates left out because they failed (for the records)."""
    return {key: list(v) for key, v in _rejected.items()}


def tuned_launch(key, configs, launch, device):
    """Run ``launch(cfg)`` in the configuration chosen for ``key``: on the first call outside a CUDA graph capture,
    with more than one candidate on a GPU, each is timed (do_bench median; a launch may be repeated: every
    kernel here writes its outputs, never adds to them) and the fastest kept (a lone candidate is kept as it is);
    a candidate that fails to compile or launch is left out (``rejected_configs``). ``configs``: the candidates,
    or a function that lists them (called only while ``key`` has no choice yet). Returns the configuration run."""
    cfg = _chosen.get(key)
    if cfg is None:
        configs = configs() if callable(configs) else configs
        cfg = configs[0]
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if len(configs) > 1 and device.type == "cuda" and not interpreting() and not capturing:
            best, error = None, None
            for c in configs:
                try:
                    ms = triton.testing.do_bench(lambda c=c: launch(c), warmup=5, rep=25, return_mode="median")
                except Exception as e:  # noqa: BLE001 - out of resources, or a compile error in this Triton
                    error = error or e
                    _rejected.setdefault(key, []).append((dict(c), f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                if best is None or ms < best[0]:
                    best = (ms, c)
            if best is None:
                raise error
            cfg = best[1]
        if not capturing:  # timed, or the only candidate (the interpreter's tile): kept, the next call launches it
            _chosen[key] = cfg
    launch(cfg)
    return cfg


# ----------------------------------------------------------------------------
# The wrapper: checks, the layout, the launch
# ----------------------------------------------------------------------------


def _check_packed(q, k, v):
    """q [total_q, H, d], k and v [total_k, Hkv, d] (H a multiple of Hkv, d a head dim the kernels take; any
    strides with a unit stride along d: the library's packed kv[:, 0] and qkv[:, 1] are read in place): returns
    (total_q, H, d, total_k, Hkv)."""
    _check_qkv(q, k, v, (3, 3, 3), strided=True)
    total_q, H, d = q.shape
    total_k, Hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k must be [total_k, Hkv, d] = [total_k, Hkv, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if H == 0 or Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads")
    _check_head_dim(d, any_d=True)
    return total_q, H, d, total_k, Hkv


def _check_paged(q, k, v, block_table, layout):
    """q [total_q, H, d]; k and v pages [num_pages, page, Hkv, d]; block_table int32 [B, max_pages] on q's device,
    long enough for every sequence's keys (checked on a batch's host lengths; with validate=False, as the library,
    not at all). Returns (total_q, H, d, Hkv, page)."""
    _check_qkv(q, k, v, (3, 4, 4), strided=True)
    total_q, H, d = q.shape
    num_pages, page, Hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k must be pages [num_pages, page_block_size, Hkv, d] = [.., .., Hkv, {d}], got "
                         f"{tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if H == 0 or Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads")
    if page < 1 or num_pages < 1:
        raise ValueError(f"k must hold at least one page of at least one row, got {tuple(k.shape)}")
    _check_head_dim(d, any_d=True)
    if (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32
            or block_table.device != q.device):
        raise ValueError(f"block_table must be an int32 tensor [B, max_pages] on {q.device}, got "
                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    if block_table.shape[0] != layout.num_seqs:
        raise ValueError(f"block_table must have a row per sequence: [{layout.num_seqs}, max_pages], got "
                         f"{tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must have a unit stride along its pages")
    lengths = getattr(layout, "lengths_k", None)
    if lengths is not None and lengths.numel() and int(lengths.max()) > block_table.shape[1] * page:
        b = int(lengths.argmax())
        raise ValueError(f"sequence {b} has {int(lengths[b])} keys; block_table's {block_table.shape[1]} pages of "
                         f"{page} hold {block_table.shape[1] * page}")
    return total_q, H, d, Hkv, page


def _check_cu_tensor(name, cu, device):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [B + 1]) or, for cu_seqlens_q, a VarlenBatch "
                        f"(prepare_varlen); got {type(cu).__name__}")
    if cu.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu.shape)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 (or int64), got {str(cu.dtype).replace('torch.', '')}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least one sequence: [0, len_0, ...], got {cu.tolist()}")


def _check_totals(layout, total_q, total_k):
    if layout.total_q != total_q:
        raise ValueError(f"cu_seqlens_q[-1] = {layout.total_q} must equal total_q (q.shape[0]) = {total_q} "
                         f"(the packed rows)")
    if total_k is not None and layout.total_k != total_k:  # None: paged K/V, whose rows are the table's
        raise ValueError(f"cu_seqlens_k[-1] = {layout.total_k} must equal total_k (k.shape[0]) = {total_k} "
                         f"(the packed rows)")


def _layout(q, total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate):
    """The batch a call runs on: the ``VarlenBatch`` passed in; or, from the library's arguments, one prepared here
    (``validate``: the host copy that checks the values) or a ``_DeviceLayout`` (nothing read back)."""
    if isinstance(cu_seqlens_q, VarlenBatch):
        if cu_seqlens_k is not None or max_seqlen_q is not None or max_seqlen_k is not None:
            raise TypeError("with a VarlenBatch in place of cu_seqlens_q, pass no cu_seqlens_k or max_seqlen: the "
                            "batch holds them (and causal, sm_scale by keyword)")
        batch = cu_seqlens_q
        if batch.device != q.device:
            raise ValueError(f"the VarlenBatch is on {batch.device} and q on {q.device}: "
                             f"prepare_varlen(..., device=q.device)")
        _check_totals(batch, total_q, total_k)
        return batch
    _check_cu_tensor("cu_seqlens_q", cu_seqlens_q, q.device)
    if cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise TypeError("cu_seqlens_k, max_seqlen_q and max_seqlen_k are the library's arguments beside a "
                        "cu_seqlens_q tensor (or pass the VarlenBatch of prepare_varlen alone)")
    _check_cu_tensor("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences: "
                         f"B = {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name} must be an int, got {type(m).__name__}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
    if validate:  # one copy of both to the host, then the batch's checks
        layout = prepare_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device=q.device)
    else:
        layout = _DeviceLayout(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    _check_totals(layout, total_q, total_k)
    return layout


def _call_key(q, k, v, causal, sm_scale, window_size, softcap, dropout_p=0.0):
    """What a call's launch plan depends on besides the batch (shapes, strides, dtypes, devices, the options): a
    call with the same key runs the plan built, and checked, for the first one. (Dropout's probability is part of
    it; its seed and offset, new every call, are the launch's arguments.)"""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, causal.__class__, causal, sm_scale, window_size, softcap, dropout_p.__class__,
            dropout_p)


def _plan_for(batch, q, k, v, causal, sm_scale, window_size, softcap, alibi_slopes, dropout_p=0.0):
    """The forward's launch plan of this call on a ``VarlenBatch``: the one the batch keeps for the call's key
    (every layer of a step after the first), else checked and built here (kept unless ALiBi slopes, a tensor that
    may change between calls, are given)."""
    if alibi_slopes is None:
        try:
            return batch._plans[_call_key(q, k, v, causal, sm_scale, window_size, softcap, dropout_p)]
        except (KeyError, TypeError, AttributeError):  # not built yet; or not a tensor, not hashable: checked below
            pass
    total_q, H, d, total_k, Hkv = _check_packed(q, k, v)
    _layout(q, total_q, total_k, batch, None, None, None, False)  # the batch fits q, k, v
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, batch.num_seqs, q.device, "num_seqs",
                       both=True)
    p_drop = _check_dropout_args(dropout_p, (0, 0)).p
    plan = _FwdPlan(q, k, v, batch, mods, sm_scale, p_drop=p_drop)
    if alibi_slopes is None:
        try:
            batch._plans[_call_key(q, k, v, causal, sm_scale, window_size, softcap, dropout_p)] = plan
            plan._layout = weakref.ref(batch)  # the batch keeps the plan: no cycle back
        except TypeError:  # window_size as a list: checked, but not kept
            pass
    return plan


class _LayoutRef:
    """A plan's batch (``layout``): held strongly, or weakly by a plan the batch keeps itself, so that a batch and
    its plans form no reference cycle: a step's batch, with its maps and plans, is freed as soon as the step drops
    it (the autograd graph holds the batch through its backward)."""

    _layout = None

    @property
    def layout(self):
        layout = self._layout
        return layout() if isinstance(layout, weakref.ref) else layout


class _FwdPlan(_LayoutRef):
    """Everything the forward's launch on one batch and one call shape needs but the tensors: the candidates' key,
    then the chosen configuration's map, grid, arguments and constexprs. Built (and the inputs checked) on a
    shape's first call; each later call allocates O and lse, makes the TMA descriptors of its k and v and
    launches. ``mods``, ``sm_scale`` and ``layout`` stay for the backward (``varlen_backward``), which keeps its
    own plan in ``bwd``."""

    def __init__(self, q, k, v, layout, mods, sm_scale, block_map=None, use_tma=None, config=None, p_drop=0.0,
                 block_table=None):
        total_q, H, d = q.shape
        paged = block_table is not None  # k, v [num_pages, page, Hkv, d]
        total_k, Hkv = (layout.total_k, k.shape[2]) if paged else (k.shape[0], k.shape[1])
        self._layout, self.mods, self.sm_scale, self.bwd = layout, mods, sm_scale, None
        self.p_drop = p_drop  # dropout's probability (0.0: off); the seed and offset come with each run
        self.H, self.d, self.lse_shape = H, d, (H, total_q)
        self.empty = total_q == 0 or total_k == 0
        if self.empty:
            return
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(d)
        qk_scale = float(sm_scale) * LOG2E.value  # scores in base-2 units
        self.block_map = None
        if block_map is not None:
            block_m = config["BLOCK_M"] if config is not None else varlen_block_m(d)
            P = (total_q + layout.num_seqs * (block_m - 1)) // block_m
            if not (isinstance(block_map, (tuple, list)) and len(block_map) == 2
                    and all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.shape == (P,)
                            and t.device == q.device for t in block_map)):
                raise ValueError(f"block_map must be varlen_block_map(cu_seqlens_q, {block_m}, {total_q}): two "
                                 f"int32 tensors of shape ({P},) on {q.device}")
            self.block_map, self.block_m = tuple(t.contiguous() for t in block_map), block_m
        if paged and use_tma:
            raise ValueError("use_tma=True with block_table: paged K/V takes the pointer path (a page lookup per "
                             "key tile): leave use_tma=None")
        # TMA's descriptors view K and V as [total_k, Hkv * d] with the token stride as the row stride: the heads
        # of a token side by side (head stride d), rows 16-byte aligned (contiguous k, and the library's kv[:, 0])
        elt = k.element_size()
        tma_view = (not paged and k.stride() == v.stride() and k.stride(1) == d and (k.stride(0) * elt) % 16 == 0
                    and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)
        if use_tma and not tma_view:
            raise ValueError(f"use_tma=True needs k and v with the heads of a token side by side (head stride d) and "
                             f"16-byte aligned rows; these have strides {k.stride()}, {v.stride()}: leave "
                             f"use_tma=None")
        if use_tma is None:
            use_tma = _use_tma_default(q) and tma_view
        _check_use_tma(use_tma, q)
        self.use_tma = bool(use_tma)
        self.kv_2d = [total_k, Hkv * d]  # K and V viewed as [total_k, Hkv * d] for their descriptors
        self.kv_strides = [k.stride(0), 1]
        # O: a new contiguous [total_q, H, d] (q may be a view of a packed qkv); K, V: their own strides; paged:
        # the strides within a page (row, head), the page's after
        ks, vs = (k.stride()[1:], v.stride()[1:]) if paged else (k.stride(), v.stride())
        self.tail = (layout.cu_seqlens_q, layout.cu_seqlens_k, q.stride(0), q.stride(1), ks[0], ks[1],
                     vs[0], vs[1], H * d, d, total_q, H, Hkv, qk_scale, mods.slopes,
                     mods.stride_sb, max(mods.left, 0), max(mods.right, 0), float(sm_scale), mods.cap)
        self.meta = dict(HEAD_DIM=d, BLOCK_D=head_block(d), USE_TMA=self.use_tma, **mods.meta())
        if p_drop > 0:
            self.meta.update(DROPOUT=True, p_drop=p_drop)
        if paged:
            self.meta.update(PAGED=True, BT=block_table, stride_bt=block_table.stride(0), page=k.shape[1],
                             stride_kp=k.stride(0), stride_vp=v.stride(0))
        self.key = ("varlen", d, q.dtype, self.use_tma, mods.right >= 0, mods.left >= 0, mods.score_mod, H // Hkv,
                    layout.length_class, block_map is not None, q.device.index, p_drop > 0, paged)
        self.dtype, self.device = q.dtype, q.device
        self.config = dict(config) if config is not None else None
        cfg = self.config or _chosen.get(self.key)
        self.parts = self._parts(cfg) if cfg is not None else None

    def _configs(self):  # the candidates: listed only on a shape class's first call
        every = class_candidates("varlen", "varlen", self.d, self.dtype, self.device, self.layout.length_class)
        if self.block_map is None:
            return every
        return [c for c in every if c["BLOCK_M"] == self.block_m] or [dict(every[0], BLOCK_M=self.block_m)]

    def _parts(self, cfg):
        """(the launcher of its grid or None, the arguments after the descriptors, the constexprs, the descriptors'
        block) of configuration cfg."""
        seq_idx, q_start = self.block_map or self.layout.block_map(cfg["BLOCK_M"], "q", self.mods.right >= 0)
        grid = seq_idx.numel() * self.H  # [P] entries x the heads, the heads fastest
        return (_attn_fwd_varlen[(grid,)] if grid else None, (seq_idx, q_start) + self.tail,
                {**self.meta, **cfg}, [cfg["BLOCK_N"], self.d])

    def _launch(self, parts, q, k, v, o, lse, rng):
        launcher, args, kwargs, block = parts
        if launcher is None:
            return
        desc_k = desc_v = None
        if self.use_tma:
            if (k.data_ptr() | v.data_ptr()) % 16:  # the plan was made for aligned ones: a view at another offset
                raise ValueError("k and v must start on 16 bytes on the TMA path this call shape's plan takes "
                                 "(pass use_tma=False, or aligned views)")
            desc_k = TensorDescriptor(k, self.kv_2d, self.kv_strides, block)  # [total_k, Hkv * d] over k's rows
            desc_v = TensorDescriptor(v, self.kv_2d, self.kv_strides, block)
        if rng is None:
            launcher(q, k, v, o, lse, desc_k, desc_v, *args, **kwargs)
        else:
            launcher(q, k, v, o, lse, desc_k, desc_v, *args, seed=rng[0], drop_off=rng[1], **kwargs)

    def run(self, q, k, v, rng=None):
        """(O [total_q, H, d], lse [H, total_q]) of this call's q, k, v (of the plan's shapes, checked there).
        rng: dropout's (seed, offset), with a plan that has dropout (``p_drop > 0``)."""
        if self.p_drop > 0 and rng is None:
            raise ValueError("a varlen plan with dropout runs with its rng_state=(seed, offset)")
        if self.p_drop == 0:
            rng = None
        o = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # [total_q, H, d]: every row is written (each
        # belongs to one map entry)
        lse = torch.empty(self.lse_shape, device=q.device, dtype=torch.float32)  # [H, total_q]
        if self.empty:  # no rows; or no sequence has a key: every row is empty (and nothing to point K at)
            return (o, lse) if o.numel() == 0 else (o.zero_(), lse.fill_(float("-inf")))
        if self.parts is not None:
            self._launch(self.parts, q, k, v, o, lse, rng)
            return o, lse
        tuned_launch(self.key, self._configs, lambda cfg: self._launch(self._parts(cfg), q, k, v, o, lse, rng),
                     q.device)
        cfg = _chosen.get(self.key)
        if cfg is not None:  # chosen now: the next calls launch it directly
            self.parts = self._parts(cfg)
        return o, lse


def flash_attn_varlen_triton(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                             causal=False, sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             dropout_p=0.0, rng_state=None, block_table=None, validate=True, block_map=None,
                             use_tma=None, config=None):
    """Attention over packed sequences of different lengths: returns ``(O, lse)``.

    q: [total_q, H, d]; k, v: [total_k, Hkv, d], H a multiple of Hkv (query head h reads KV head
    h // (H // Hkv)); any d from 1 to 256; any strides with a unit stride along d (the library's packed qkv[:, 1]
    and kv[:, 0] are read in place; TMA where the heads of a token sit side by side). The layout, either way:

    * ``flash_attn_varlen_triton(q, k, v, batch, causal=...)`` with ``batch = prepare_varlen(...)``, made once
      per batch: nothing waits for the GPU; the first call of a shape checks the inputs and builds its launch
      plan, which the batch keeps for the next layers' calls;
    * the library's ``cu_seqlens_q, cu_seqlens_k`` (int32 [B + 1] on q's device, 0 then the cumulative lengths:
      sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]];
      lengths may be 0 and may differ between q and k) and ``max_seqlen_q, max_seqlen_k`` (at least the longest
      lengths). ``validate=True`` prepares a batch in this call (one copy of cu_seqlens to the host, a sync, and
      the maps built again: the slow path); ``validate=False`` checks nothing and builds lesson 10's map on the
      device (no sync; wrong values give wrong results).

    O: [total_q, H, d] in q's dtype, contiguous; lse: [H, total_q] float32, natural log. causal: bottom-right per
    sequence, row i of a sequence with lengths (n, nk) sees key j when j <= i + nk - n (the library's
    convention); a row that sees no key (n > nk, or nk = 0) gets O = 0, lse = -inf.

    The library's ``flash_attn_varlen_func`` options, on the same per-sequence diagonal diag = nk - n:
    window_size=(left, right): row i sees key j when i + diag - left <= j <= i + diag + right (-1 unbounded;
    causal sets right = 0); softcap > 0: s = q.k * sm_scale becomes softcap * tanh(s / softcap); alibi_slopes:
    float32 [H] or [num_seqs, H] on q's device, s becomes s - slope[b, h] * |i + diag - j| (after the softcap
    when both are given). dropout_p: P's entries dropped after the softmax, the kept ones scaled by
    1 / (1 - dropout_p), the lse the undropped one; ``rng_state=(seed, offset)`` names the mask (None draws one
    from torch's generator); sequence b's mask is ``dropout_keep_mask(num_seqs, H, max_n, max_nk, ...)[b, :, :n_b,
    :nk_b]``. block_table: int32 [num_seqs, max_pages]; k, v are then pages [num_pages, page, Hkv, d] (any
    strides with a unit stride along d), sequence b's key j row j % page of page block_table[b, j // page], its
    length from cu_seqlens_k (forward only; no TMA).

    block_map: lesson 10's map, ``varlen_block_map(cu_seqlens_q, varlen_block_m(d), total_q)`` (or
    ``config["BLOCK_M"]``), launched as given. ``use_tma`` and ``config`` (BLOCK_M, BLOCK_N, num_warps,
    num_stages) are for benchmarking; None chooses (``tuned_launch``).
    """
    dropout = _check_dropout_args(dropout_p, rng_state)
    rng = (dropout.seed, dropout.offset) if dropout.p > 0 else None
    if block_table is not None:  # paged K/V: checked and planned every call (the table may change between them)
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q must be [total_q, H, d], got {getattr(q, 'shape', type(q).__name__)}")
        layout = _layout(q, q.shape[0], None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
        total_q, H, d, Hkv, page = _check_paged(q, k, v, block_table, layout)
        mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, layout.num_seqs, q.device, "num_seqs",
                           both=True)
        return _FwdPlan(q, k, v, layout, mods, sm_scale, block_map, use_tma, config, dropout.p,
                        block_table).run(q, k, v, rng)
    if (isinstance(cu_seqlens_q, VarlenBatch) and cu_seqlens_k is None and max_seqlen_q is None
            and max_seqlen_k is None and block_map is None and use_tma is None and config is None):
        return _plan_for(cu_seqlens_q, q, k, v, causal, sm_scale, window_size, softcap, alibi_slopes,
                         dropout.p).run(q, k, v, rng)
    total_q, H, d, total_k, Hkv = _check_packed(q, k, v)
    layout = _layout(q, total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
    mods = _check_mods(causal, window_size, softcap, alibi_slopes, H, layout.num_seqs, q.device, "num_seqs",
                       both=True)
    return _FwdPlan(q, k, v, layout, mods, sm_scale, block_map, use_tma, config, dropout.p).run(q, k, v, rng)
