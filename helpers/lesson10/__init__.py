"""Lesson 10, serving: the plain functions behind its tables, figures and serving step.

- ``cu_seqlens_from_lengths`` / ``check_cu_seqlens``: the packed layout's prefix sums (int32, B + 1
  entries, the library's convention) and the errors a wrong one gets.
- ``padding_waste``: FLOPs and bytes of one attention layer on a padded ``[B, H, max_len, d]`` batch
  against the packed one, counted exactly (causal: the visible (query, key) pairs of each sequence).
  ``long_tailed_lengths``, ``uniform_lengths``, ``few_long_many_short``: seeded length mixes.
- ``varlen_block_map_ref``: the course's reference for exercise 1, the (sequence, first packed row) of
  each program of a packed (varlen) launch, in the order and with the spare programs of the course's
  kernel, ``helpers.kernels.varlen.varlen_block_map``; ``num_programs``: its grid size.
- ``BlockAllocator`` (a free list of cache blocks) and ``PagedKVCache`` (pools ``[num_blocks,
  block_size, Hkv, d]``, ``block_table`` int32 ``[B, max_blocks]``, ``cache_seqlens`` int32 ``[B]``: the
  layout of the library's ``flash_attn_with_kvcache``).
- ``gather_kv_ref``: the course's reference for exercise 2, the page lookup.
- ``kv_cache_bytes``: the cache's size, MHA against GQA.
- ``serving_results`` / ``show_serving_results``: the ``"varlen"``, ``"paged"`` and ``"decode"`` rows of
  ``bench/results/h200.json`` (written by ``make bench``), or "not measured yet"; ``serving_summary``: what
  they say, one line a comparison (geometric means and ranges of the rows' ratios), each with its label.

Nothing here imports Triton (``helpers.lesson10.check`` imports this module in every notebook).
"""
from __future__ import annotations

import math
import random


import torch

from .. import triton_mode
from ..results import NOT_MEASURED, RESULTS, geomean, load_results, results_label
from ..results import fmt as _f
from ..results import ratio as _ratio

__all__ = ["cu_seqlens_from_lengths", "check_cu_seqlens", "lengths_from_cu_seqlens", "padding_waste",
           "waste_table", "plot_waste", "long_tailed_lengths", "uniform_lengths", "few_long_many_short",
           "num_programs", "varlen_block_map_ref", "plot_block_map", "CacheFull", "BlockAllocator", "PagedKVCache",
           "gather_kv_ref", "plot_pool", "kv_cache_bytes", "block_waste", "RESULTS", "load_results", "results_label",
           "serving_results", "serving_tables", "show_serving_results", "serving_summary", "NOT_MEASURED", "NO_TRITON",
           "require_triton"]



# ------------------------------------------------------------------ the packed layout
def cu_seqlens_from_lengths(lengths) -> torch.Tensor:
    """int32 ``[B + 1]``: ``[0, n0, n0 + n1, ...]``, the library's ``cu_seqlens`` for these lengths."""
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(torch.int32)


def check_cu_seqlens(cu_seqlens, name: str = "cu_seqlens", total: int | None = None) -> None:
    """Raise ``ValueError`` saying what is wrong with ``cu_seqlens``, as the library's checks would.

    It must be a 1-D int32 tensor of ``B + 1`` entries that starts at 0 and never decreases; with
    ``total`` given, its last entry must be the number of packed tokens.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor (int32 [B + 1]), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 entries, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (the library's dtype), got {cu_seqlens.dtype}: "
                         f"build it with torch.tensor(..., dtype=torch.int32) or .to(torch.int32)")
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"{name}[0] must be 0 (it holds B + 1 prefix sums [0, n0, n0+n1, ...]), "
                         f"got {int(cu_seqlens[0])}: did you leave out the leading 0?")
    if cu_seqlens.numel() > 1 and bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        i = int((cu_seqlens[1:] < cu_seqlens[:-1]).nonzero()[0])
        raise ValueError(f"{name} must never decrease (each entry adds a length >= 0), but "
                         f"{name}[{i + 1}] = {int(cu_seqlens[i + 1])} < {name}[{i}] = {int(cu_seqlens[i])}")
    if total is not None and int(cu_seqlens[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(cu_seqlens[-1])} must equal the number of packed tokens, {total}")


def lengths_from_cu_seqlens(cu_seqlens) -> torch.Tensor:
    """int64 ``[B]`` lengths of a checked ``cu_seqlens``."""
    check_cu_seqlens(cu_seqlens)
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


# ------------------------------------------------------------------ length mixes (seeded)
def long_tailed_lengths(B: int = 64, seed: int = 0, median: int = 512, sigma: float = 1.0,
                        max_len: int = 8192) -> list[int]:
    """B lengths drawn from a lognormal (``median``, ``sigma``), rounded, clipped to [1, max_len]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(B, generator=g, dtype=torch.float64))
    return [int(n) for n in x.round().clamp(1, max_len).tolist()]


def uniform_lengths(B: int = 64, seed: int = 0, lo: int = 512, hi: int = 8192) -> list[int]:
    """B lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    return [int(n) for n in torch.randint(lo, hi + 1, (B,), generator=g).tolist()]


def few_long_many_short(B: int = 64, n_long: int = 4, long: int = 8192, seed: int = 0, short_lo: int = 32,
                        short_hi: int = 512) -> list[int]:
    """``n_long`` prompts of ``long`` tokens among ``B - n_long`` short ones, uniform in [short_lo, short_hi]."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(short_lo, short_hi + 1, (B - n_long,), generator=g).tolist()
    out = [long] * n_long + [int(n) for n in short]
    random.Random(seed).shuffle(out)
    return out


# ------------------------------------------------------------------ padding's waste, counted exactly
def _pairs(n: int, causal: bool) -> int:
    """(query, key) pairs one sequence of n tokens computes: n(n+1)/2 causal, n^2 otherwise."""
    return n * (n + 1) // 2 if causal else n * n


def padding_waste(lengths, H: int = 32, Hkv: int = 8, d: int = 128, causal: bool = True,
                  bytes_per_elem: int = 2) -> dict:
    """One attention layer's forward on ``lengths``: padded to ``[B, H, max_len, d]`` against packed.

    FLOPs are ``4 d`` per visible (query, key) pair per query head (``2 d`` for the score, ``2 d`` for
    ``p v``), pairs counted exactly (causal: ``n (n + 1) / 2`` per sequence; a padded batch computes
    ``max_len (max_len + 1) / 2`` for every sequence, its pad rows and columns included). Bytes are
    the HBM traffic of a FlashAttention forward that reads Q, K, V once and writes O once:
    ``(2 H + 2 Hkv) d`` elements per token. Returns a dict of exact integers and the two ratios.
    """
    lengths = [int(n) for n in lengths]
    if not lengths or any(n < 0 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of integers >= 0, got {lengths}")
    if H % Hkv:
        raise ValueError(f"H = {H} must be a multiple of Hkv = {Hkv} (GQA)")
    B, max_len, total = len(lengths), max(lengths), sum(lengths)
    useful_pairs = sum(_pairs(n, causal) for n in lengths)
    padded_pairs = B * _pairs(max_len, causal)
    per_token_bytes = (2 * H + 2 * Hkv) * d * bytes_per_elem
    out = dict(B=B, total_tokens=total, max_len=max_len, padded_tokens=B * max_len,
               useful_pairs=useful_pairs, padded_pairs=padded_pairs,
               useful_flops=4 * d * H * useful_pairs, padded_flops=4 * d * H * padded_pairs,
               useful_bytes=total * per_token_bytes, padded_bytes=B * max_len * per_token_bytes)
    out["flops_ratio"] = out["padded_flops"] / max(out["useful_flops"], 1)
    out["bytes_ratio"] = out["padded_bytes"] / max(out["useful_bytes"], 1)
    out["wasted_flops_frac"] = 1 - out["useful_flops"] / max(out["padded_flops"], 1)
    out["wasted_bytes_frac"] = 1 - out["useful_bytes"] / max(out["padded_bytes"], 1)
    return out


def waste_table(mixes: dict, **shape) -> str:
    """A plain-text table of ``padding_waste`` for each named length mix ``{name: lengths}``."""
    head = (f"{'length mix':28s} {'B':>3} {'tokens':>8} {'max':>5} {'useful TFLOP':>12} {'padded':>8} "
            f"{'x':>6} {'useful GB':>9} {'padded':>7} {'x':>5}")
    lines = [head]
    for name, lengths in mixes.items():
        w = padding_waste(lengths, **shape)
        lines.append(f"{name:28s} {w['B']:>3} {w['total_tokens']:>8} {w['max_len']:>5} "
                     f"{w['useful_flops'] / 1e12:>12.2f} {w['padded_flops'] / 1e12:>8.2f} {w['flops_ratio']:>5.1f}x "
                     f"{w['useful_bytes'] / 1e9:>9.3f} {w['padded_bytes'] / 1e9:>7.3f} {w['bytes_ratio']:>4.1f}x")
    return "\n".join(lines)


def plot_waste(mixes: dict, **shape):
    """Two bar panels, TFLOPs and GB per mix: packed (useful) against padded."""
    import matplotlib.pyplot as plt
    names = list(mixes)
    ws = [padding_waste(mixes[n], **shape) for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    x = range(len(names))
    for ax, key, scale, unit in ((axes[0], "flops", 1e12, "TFLOP"), (axes[1], "bytes", 1e9, "GB")):
        useful = [w[f"useful_{key}"] / scale for w in ws]
        padded = [w[f"padded_{key}"] / scale for w in ws]
        ax.bar([i - 0.2 for i in x], useful, 0.4, label="packed (useful work)", color="#4c72b0")
        ax.bar([i + 0.2 for i in x], padded, 0.4, label="padded to max_len", color="#dd8452")
        for i, w in enumerate(ws):
            ax.text(i + 0.2, padded[i], f"{w[f'{key}_ratio']:.1f}x", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(padded + useful) * 1.3)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"one attention layer's forward: {unit} ({'causal' if shape.get('causal', True) else 'full'})",
                     fontsize=9)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ exercise 1: the varlen grid's program map
def num_programs(total_q: int, B: int, BLOCK_M: int) -> int:
    """P = (total_q + B (BLOCK_M - 1)) // BLOCK_M: the varlen launch's grid size, from numbers the host knows.

    Each sequence's last block leaves at most BLOCK_M - 1 rows empty, so P bounds
    sum_b cdiv(n_b, BLOCK_M) without reading the lengths (which live on the GPU: reading them is a sync).
    """
    return (total_q + B * (BLOCK_M - 1)) // BLOCK_M


def varlen_block_map_ref(cu_seqlens, BLOCK_M):
    """``(seq_idx, q_start)``, int32 ``[P]``: the (sequence, first packed row) of every program.

    The course's reference, with the contract of ``helpers.kernels.varlen.varlen_block_map`` (a test
    keeps the two equal): sequence b of ``n_b`` tokens has ``cdiv(n_b, BLOCK_M)`` query blocks (none
    when ``n_b = 0``); its block m starts at packed row ``cu_seqlens[b] + m * BLOCK_M``. Entries are
    ordered by m, largest first, ties in sequence order (the longest-running causal blocks start
    first); the ``P = num_programs(...)`` entries past the real blocks are ``(-1, -1)``: spare programs.
    """
    check_cu_seqlens(cu_seqlens)
    if isinstance(BLOCK_M, bool) or int(BLOCK_M) != BLOCK_M or BLOCK_M < 1:
        raise ValueError(f"BLOCK_M must be a positive int, got {BLOCK_M!r}")
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]                                                # [B]
    n_blocks = (lengths + BLOCK_M - 1) // BLOCK_M                             # [B], cdiv; 0 when empty
    seq = torch.repeat_interleave(torch.arange(len(lengths)), n_blocks)       # [R] sequence by sequence
    m = torch.arange(len(seq)) - (n_blocks.cumsum(0) - n_blocks)[seq]         # [R] block index in its sequence
    order = torch.sort(-m, stable=True).indices                               # [R] largest m first, stable
    P = num_programs(int(cu[-1]), len(lengths), BLOCK_M)
    seq_idx = torch.full((P,), -1, dtype=torch.int32)                         # [P]
    q_start = torch.full((P,), -1, dtype=torch.int32)                         # [P]
    seq_idx[:len(seq)] = seq[order].to(torch.int32)
    q_start[:len(seq)] = (cu[seq] + m * BLOCK_M)[order].to(torch.int32)
    return seq_idx, q_start


def plot_block_map(lengths, BLOCK_M: int, ax=None):
    """The packed rows cut into the Q blocks the varlen grid's programs own, labelled p (launch order)."""
    import matplotlib.pyplot as plt
    cu = cu_seqlens_from_lengths(lengths)
    seq_idx, q_start = varlen_block_map_ref(cu, BLOCK_M)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    spare = 0
    for p, (b, s) in enumerate(zip(seq_idx.tolist(), q_start.tolist())):
        if b < 0:
            spare += 1
            continue
        rows = min(BLOCK_M, int(cu[b + 1]) - s)
        ax.barh(0, rows, left=s, color=colors[b % len(colors)], edgecolor="k", lw=0.6)
        ax.text(s + rows / 2, 0, f"p{p}\n({b},{s})", ha="center", va="center", fontsize=7)
    for b, n in enumerate(lengths):
        if n == 0:
            ax.axvline(int(cu[b]), color="r", lw=1, ls=":")
            ax.text(int(cu[b]), -0.5, f"seq {b}: empty", color="r", fontsize=7, ha="center", va="bottom")
    ax.set_xlim(0, max(1, int(cu[-1])))
    ax.set_yticks([])
    ax.set_xlabel("packed row (token) of q [total_q, H, d]")
    ax.set_title(f"lengths {list(lengths)}, BLOCK_M = {BLOCK_M}: program p owns (seq_idx, q_start); "
                 f"P = {len(seq_idx)}, {spare} spare", fontsize=9)
    return ax


# ------------------------------------------------------------------ the paged cache
class CacheFull(RuntimeError):
    """No free block is left in the pool: the server must wait, evict or preempt a request."""


class BlockAllocator:
    """A free list of the pool's blocks (pages). ``allocate(n)`` pops n, ``free(blocks)`` pushes them back.

    ``seed`` shuffles the initial list: a pool that has served for hours hands out pages in no
    particular order, and a test on an identity block table would hide a lookup that skips the table.
    """

    def __init__(self, num_blocks: int, seed: int | None = None):
        if int(num_blocks) < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._free = list(range(self.num_blocks - 1, -1, -1))      # a stack: pop() hands out block 0 first
        if seed is not None:
            random.Random(seed).shuffle(self._free)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise CacheFull(f"asked for {n} blocks, {len(self._free)} of {self.num_blocks} are free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks) -> None:
        for blk in blocks:
            blk = int(blk)
            if blk not in self._used:
                raise ValueError(f"block {blk} is not allocated (freed twice, or never handed out)")
            self._used.remove(blk)
            self._free.append(blk)


def gather_kv_ref(k_pages, block_table, cache_seqlens, b):
    """Sequence ``b``'s cache, contiguous: ``[cache_seqlens[b], Hkv, d]``.

    Token t lives in physical block ``block_table[b, t // block_size]``, row ``t % block_size``;
    entries of ``block_table[b]`` past ``cdiv(cache_seqlens[b], block_size)`` are padding, never read.
    """
    if k_pages.dim() != 4 or block_table.dim() != 2 or cache_seqlens.dim() != 1:
        raise ValueError(f"expected k_pages [num_blocks, block_size, Hkv, d], block_table [B, max_blocks], "
                         f"cache_seqlens [B]; got {list(k_pages.shape)}, {list(block_table.shape)}, "
                         f"{list(cache_seqlens.shape)}")
    if not 0 <= b < block_table.shape[0]:
        raise ValueError(f"sequence b = {b} is not in the batch of {block_table.shape[0]}")
    block_size = k_pages.shape[1]
    n = int(cache_seqlens[b])
    if n > block_table.shape[1] * block_size:
        raise ValueError(f"cache_seqlens[{b}] = {n} tokens need {-(-n // block_size)} blocks; the table's row "
                         f"has {block_table.shape[1]}")
    t = torch.arange(n, device=block_table.device)               # [n] token positions
    blocks = block_table[b, t // block_size].long()               # [n] physical block of each token
    return k_pages[blocks, t % block_size]                        # [n, Hkv, d]


class PagedKVCache:
    """The paged KV cache of a batch: the library's layout, filled through a ``BlockAllocator``.

    ``k_pages``, ``v_pages`` ``[num_blocks, block_size, Hkv, d]``; ``block_table`` int32
    ``[max_seqs, max_blocks]`` (unused entries hold ``pad``, 0 by default: a valid block, so a kernel
    that loads a table entry it then masks out never faults); ``cache_seqlens`` int32 ``[max_seqs]``.
    """

    def __init__(self, num_blocks: int, block_size: int, Hkv: int, d: int, max_seqs: int, max_blocks: int,
                 dtype=torch.float32, device="cpu", seed: int | None = 0, pad: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size, self.Hkv, self.d, self.pad = block_size, Hkv, d, pad
        self.allocator = BlockAllocator(num_blocks, seed=seed)
        self.k_pages = torch.zeros(num_blocks, block_size, Hkv, d, dtype=dtype, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)
        self.block_table = torch.full((max_seqs, max_blocks), pad, dtype=torch.int32, device=device)
        self.cache_seqlens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.blocks: list[list[int]] = [[] for _ in range(max_seqs)]

    def append(self, b: int, k, v) -> None:
        """Write ``n`` new tokens' k, v ``[n, Hkv, d]`` after sequence b's cache, taking blocks as needed."""
        if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (self.Hkv, self.d):
            raise ValueError(f"k and v must both be [n, Hkv={self.Hkv}, d={self.d}], got {list(k.shape)} "
                             f"and {list(v.shape)}")
        n0, n = int(self.cache_seqlens[b]), k.shape[0]
        need = -(-(n0 + n) // self.block_size) - len(self.blocks[b])
        if len(self.blocks[b]) + max(need, 0) > self.block_table.shape[1]:
            raise CacheFull(f"sequence {b} would need {len(self.blocks[b]) + need} blocks, its block_table "
                            f"row has {self.block_table.shape[1]}")
        if need > 0:
            new = self.allocator.allocate(need)
            self.block_table[b, len(self.blocks[b]):len(self.blocks[b]) + need] = torch.tensor(new, dtype=torch.int32)
            self.blocks[b] += new
        t = torch.arange(n0, n0 + n, device=self.block_table.device)       # [n] positions of the new tokens
        blocks = self.block_table[b, t // self.block_size].long()          # [n] the same lookup as gather_kv
        self.k_pages[blocks, t % self.block_size] = k.to(self.k_pages.dtype)
        self.v_pages[blocks, t % self.block_size] = v.to(self.v_pages.dtype)
        self.cache_seqlens[b] = n0 + n

    def gather(self, b: int):
        """Sequence b's (k, v), contiguous ``[cache_seqlens[b], Hkv, d]`` (for checking, not for serving)."""
        return (gather_kv_ref(self.k_pages, self.block_table, self.cache_seqlens, b),
                gather_kv_ref(self.v_pages, self.block_table, self.cache_seqlens, b))

    def free(self, b: int) -> None:
        """A finished request gives its blocks back."""
        self.allocator.free(self.blocks[b])
        self.blocks[b] = []
        self.block_table[b] = self.pad
        self.cache_seqlens[b] = 0


def plot_pool(cache: PagedKVCache, ax=None, title: str = ""):
    """The pool, one cell per block: the request that owns it and how many of its rows are filled."""
    import matplotlib.pyplot as plt
    num_blocks = cache.k_pages.shape[0]
    cols = min(num_blocks, 16)
    rows = -(-num_blocks // cols)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * rows + 1.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    owner = {}
    for b, blks in enumerate(cache.blocks):
        n = int(cache.cache_seqlens[b])
        for p, blk in enumerate(blks):
            owner[blk] = (b, p, min(cache.block_size, n - p * cache.block_size))
    for blk in range(num_blocks):
        r, c = divmod(blk, cols)
        if blk in owner:
            b, p, filled = owner[blk]
            ax.add_patch(plt.Rectangle((c, -r - 1), 1, 1, color=colors[b % len(colors)], alpha=0.35))
            ax.add_patch(plt.Rectangle((c, -r - 1), filled / cache.block_size, 1, color=colors[b % len(colors)]))
            ax.text(c + 0.5, -r - 0.5, f"r{b}.{p}", ha="center", va="center", fontsize=7)
        else:
            ax.add_patch(plt.Rectangle((c, -r - 1), 1, 1, fill=False, ec="#bbbbbb"))
        ax.text(c + 0.05, -r - 0.08, str(blk), fontsize=5, va="top", color="#555555")
    ax.set_xlim(0, cols)
    ax.set_ylim(-rows, 0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"pool of {num_blocks} blocks of {cache.block_size} tokens: rB.p = request B's logical "
                 f"page p (dark part: rows filled); {cache.allocator.num_free} free", fontsize=8)
    return ax


def kv_cache_bytes(tokens: int, layers: int, Hkv: int, d: int, bytes_per_elem: int = 2) -> int:
    """Bytes of K and V for ``tokens`` tokens over all layers: ``2 * layers * Hkv * d * bytes`` per token."""
    return 2 * layers * Hkv * d * bytes_per_elem * tokens


def block_waste(lengths, block_size: int) -> dict:
    """Internal fragmentation of a paged cache: sequences of ``lengths`` tokens in blocks of ``block_size``.

    Each sequence holds ``cdiv(n, block_size)`` blocks; only its last one can be partly filled. Returns the
    token slots held, the empty ones (``wasted``), their fraction of what is held, the empty slots per
    sequence, and the block-table entries (one int32 per block).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    blocks = sum(-(-n // block_size) for n in lengths)
    held = blocks * block_size
    wasted = held - sum(lengths)
    return dict(held=held, wasted=wasted, fraction=wasted / held if held else 0.0,
                per_seq=wasted / len(lengths) if lengths else 0.0, table_entries=blocks)


# ------------------------------------------------------------------ recorded results (bench/results/h200.json)
def show_serving_results(res=None, path=RESULTS) -> None:
    """Print the recorded serving figures with their label (GPU, versions, date), or say they are missing."""
    res = load_results(path) if res is None else res
    if res is None:
        print(f"(no recorded results: {path} is missing; `make bench` on a CUDA GPU writes it)")
        return
    print(serving_tables(res))


# ------------------------------------------------------------------ without Triton (macOS, Windows)
NO_TRITON = ("Triton is not installed in this Python (PyPI has it for Linux only, not for macOS or Windows), "
             "so the serving step's kernels cannot run here: below are the serving figures recorded on an "
             "NVIDIA H200, and README.md (section 3) says how to run the kernels on Linux or in WSL2.")


def require_triton() -> None:
    """Return if Triton can run here; otherwise say so, show the recorded figures, and stop Run All
    (``helpers.triton_mode.require_triton``: one line, no traceback; ``make grade`` knows it)."""
    def show():
        print()
        show_serving_results()
    triton_mode.require_triton(NO_TRITON, show)


def serving_results(res) -> dict:
    """``{"varlen": [...], "paged": [...], "decode": [...]}``: the rows of each section, [] when absent."""
    res = res or {}
    return {key: list(res.get(key) or []) for key in ("varlen", "paged", "decode")}


def _lengths_label(row) -> str:
    """A varlen row's length mix: its name ("mix") and the lengths (a list, or bench_varlen's summary dict)."""
    lengths = row.get("lengths")
    if isinstance(lengths, dict) and {"count", "min", "max"} <= set(lengths):
        text = f"{lengths['count']} seqs {lengths['min']}-{lengths['max']}"
    elif isinstance(lengths, (list, tuple)) and lengths:
        text = f"{len(lengths)} seqs {min(lengths)}-{max(lengths)}"
    else:
        text = str(lengths) if lengths else ""
    return " ".join(x for x in (str(row.get("mix") or ""), text) if x) or "?"


def _graph_gbs(r):
    return r.get("triton_graph_gbs", r.get("triton_gbs_graph"))


def serving_tables(res) -> str:
    """The three tables, each with its label, or "not measured yet" for a section with no rows."""
    rows = serving_results(res)
    out = []
    out.append("varlen prefill (packed), TFLOP/s of useful work (padding not counted); median of do_bench")
    if rows["varlen"]:
        out.append("  " + results_label(res, "varlen"))
        out.append(f"{'dtype':>8} {'d':>4} {'causal':>6} {'H':>3} {'Hkv':>3} {'tokens':>7} {'lengths':>30} "
                   f"{'varlen':>7} {'dense':>7} {'padded':>7} {'v/dense':>7} {'v/padded':>8}")
        for r in rows["varlen"]:
            t, dn, sp = r.get("triton_tflops"), r.get("dense_triton_tflops"), r.get("sdpa_padded_tflops")
            out.append(f"{r.get('dtype', '?'):>8} {r.get('d', '?'):>4} {str(bool(r.get('causal'))):>6} "
                       f"{r.get('H', '?'):>3} {r.get('Hkv', '?'):>3} {r.get('total_tokens', '?'):>7} "
                       f"{_lengths_label(r)[:30]:>30} {_f(t):>7} {_f(dn):>7} {_f(sp):>7} "
                       f"{_ratio(t, dn):>7} {_ratio(t, sp):>8}")
    else:
        out.append(f"  {NOT_MEASURED}")
    out.append("")
    out.append("paged decode, GB/s (K and V read once); median of do_bench, graph: median of do_bench_cudagraph")
    if rows["paged"]:
        out.append("  " + results_label(res, "paged"))
        out.append(f"{'dtype':>8} {'B':>3} {'H':>3} {'Hkv':>3} {'d':>4} {'block':>5} {'mean_len':>8} "
                   f"{'paged':>7} {'graph':>7} {'contig':>7} {'eq_sdpa':>7} {'p/contig':>8}")
        for r in rows["paged"]:
            t, c, cu = r.get("triton_gbs"), r.get("contig_triton_gbs"), r.get("sdpa_cudnn_gbs")
            out.append(f"{r.get('dtype', '?'):>8} {r.get('B', '?'):>3} {r.get('H', '?'):>3} {r.get('Hkv', '?'):>3} "
                       f"{r.get('d', '?'):>4} {r.get('block_size', '?'):>5} {_f(r.get('mean_len')):>8} {_f(t):>7} "
                       f"{_f(_graph_gbs(r)):>7} {_f(c):>7} {_f(cu):>7} {_ratio(t, c):>8}")
        out.append("  eq_sdpa: SDPA (cuDNN backend) on an equal-length, non-paged batch with the same total tokens,")
        out.append("  not a paged kernel: SDPA cannot take per-sequence lengths without a mask")
    else:
        out.append(f"  {NOT_MEASURED}")
    out.append("")
    out.append("decode (contiguous cache), GB/s: medians of do_bench and of do_bench_cudagraph (graph)")
    if rows["decode"]:
        out.append("  " + results_label(res, "decode"))
        out.append(f"{'dtype':>8} {'B':>3} {'H':>3} {'Hkv':>3} {'Nk':>7} {'d':>4} {'triton':>7} {'graph':>7} "
                   f"{'cudnn':>7} {'tri/cudnn':>9}")
        for r in sorted(rows["decode"], key=lambda r: (r.get("dtype", ""), r.get("d", 0), r.get("H", 0),
                                                        r.get("Hkv", 0), r.get("B", 0), r.get("Nk", 0))):
            t, cu = r.get("triton_gbs"), r.get("sdpa_cudnn_gbs")
            out.append(f"{r.get('dtype', '?'):>8} {r.get('B', '?'):>3} {r.get('H', '?'):>3} {r.get('Hkv', '?'):>3} "
                       f"{r.get('Nk', '?'):>7} {r.get('d', '?'):>4} {_f(t):>7} {_f(_graph_gbs(r)):>7} {_f(cu):>7} "
                       f"{_ratio(t, cu):>9}")
    else:
        out.append(f"  {NOT_MEASURED}")
    return "\n".join(out)


def _timing(res, section) -> str:
    """The statistic of a section (its ``<section>_meta["timing"]``), "" when absent."""
    meta = (res or {}).get(f"{section}_meta") or {}
    return meta.get("timing", "")


def _span(xs) -> str:
    return f"{min(xs):.2f}x to {max(xs):.2f}x" if xs else "—"


def serving_summary(res) -> str:
    """What the three serving sections say, in a few lines (each ratio a range or a geometric mean over the
    rows named), each section's label (GPU, versions, date) and statistic after its lines."""
    rows = serving_results(res)
    out = []
    v = rows["varlen"]
    if v:
        mixes = sorted({r.get("mix") or "?" for r in v})
        pad = {m: [r["triton_tflops"] / r["sdpa_padded_tflops"] for r in v
                   if (r.get("mix") or "?") == m and r.get("triton_tflops") and r.get("sdpa_padded_tflops")]
               for m in mixes}
        dense = {m: [r["triton_tflops"] / r["dense_triton_tflops"] for r in v
                     if (r.get("mix") or "?") == m and r.get("triton_tflops") and r.get("dense_triton_tflops")]
                 for m in mixes}
        out.append("varlen prefill / SDPA on the padded batch, by mix: "
                   + "; ".join(f"{m} {_span(pad[m])}" for m in mixes))
        out.append("varlen prefill / the dense kernel on equal lengths of the same tokens, by mix: "
                   + "; ".join(f"{m} {_span(dense[m])}" for m in mixes))
        out.append(f"  {len(v)} rows · {results_label(res, 'varlen')} · {_timing(res, 'varlen')}")
    else:
        out.append(f"varlen prefill: {NOT_MEASURED}")
    pg = rows["paged"]
    if pg:
        sizes = sorted({r["block_size"] for r in pg})
        by = {b: [r["triton_gbs"] / r["contig_triton_gbs"] for r in pg
                  if r["block_size"] == b and r.get("triton_gbs") and r.get("contig_triton_gbs")] for b in sizes}
        out.append("paged decode / the contiguous cache, by block size: "
                   + "; ".join(f"{b}: {_span(by[b])}" for b in sizes))
        out.append(f"  {len(pg)} rows · {results_label(res, 'paged')} · {_timing(res, 'paged')}")
    else:
        out.append(f"paged decode: {NOT_MEASURED}")
    d = rows["decode"]
    if d:
        big = [r for r in d if r.get("cache_mib", 0) >= 256]
        small = sorted((r for r in d if r.get("cache_mib", 0) < 256), key=lambda r: r["cache_mib"])
        cu = [r["triton_gbs"] / r["sdpa_cudnn_gbs"] for r in big if r.get("triton_gbs") and r.get("sdpa_cudnn_gbs")]
        g = [r["triton_gbs"] / _graph_gbs(r) for r in big if r.get("triton_gbs") and _graph_gbs(r)]
        out.append(f"decode, caches of 256 MiB or more ({len(big)} rows): Triton / cuDNN {_span(cu)}, "
                   f"do_bench / CUDA graph {_span(g)}")
        for r in small:
            out.append(f"decode, a {r['cache_mib']:.0f} MiB cache: Triton / cuDNN "
                       f"{r['triton_gbs'] / r['sdpa_cudnn_gbs']:.2f}x, do_bench / CUDA graph "
                       f"{r['triton_gbs'] / _graph_gbs(r):.2f}x")
        out.append(f"  {len(d)} rows · {results_label(res, 'decode')} · {_timing(res, 'decode')}")
    else:
        out.append(f"decode: {NOT_MEASURED}")
    return "\n".join(out)
