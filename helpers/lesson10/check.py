"""Checkers of lesson 10, serving: the varlen grid's program map and the paged cache's page lookup.

References: the program map of the course's varlen kernel (``helpers.kernels.varlen.varlen_block_map``;
``helpers.lesson10.varlen_block_map_ref`` restates it without Triton, and a test keeps the three equal);
the checker's own expectation is a plain loop over (sequence, block) with knobs for the bugs. The page lookup
is checked against the contiguous cache the pool was filled from, never against a lookup; a right answer must
also have read no padding entry of the table (the entries are followed through the learner's torch ops) and
done no arithmetic on the pool (a one-hot matmul). Block sizes include non-powers of two, as the lesson allows.
Layouts (the library's): ``cu_seqlens`` int32 ``[B + 1]``; pools ``[num_blocks, block_size, Hkv, d]``,
``block_table`` int32 ``[B, max_blocks]``, ``cache_seqlens`` int32 ``[B]``.
"""
from __future__ import annotations

import torch

from ..checking import Case, exercise
from ..lesson10 import BlockAllocator, cu_seqlens_from_lengths, long_tailed_lengths
from ..cases import gen


# ------------------------------------------------------------------ exercise 1: varlen_block_map
def _cdiv(n, bm):
    return -(-n // bm)


def _map_model(cu, BLOCK_M, *, n_blocks=_cdiv, start=None, order="largest first", P=None, spare=-1,
               lengths=None):
    """(seq_idx, q_start) int32 by a plain loop over (sequence, block), with knobs for learners' mistakes.

    n_blocks(n, BLOCK_M): blocks of a sequence of n tokens; start(b, m, cu, BLOCK_M): the entry's
    q_start (default the packed row cu[b] + m * BLOCK_M); order: "largest first" (block index m
    descending, ties in sequence order), "sequence" (sequence, then block) or "smallest first";
    P(total, B, BLOCK_M): the number of entries (default the bound); spare: the value of unused
    entries; lengths(cu): the lengths (default the differences of cu).
    """
    cu_l = [int(x) for x in cu.tolist()]
    B = len(cu_l) - 1
    ns = lengths(cu_l) if lengths else [cu_l[i + 1] - cu_l[i] for i in range(B)]
    start = start or (lambda b, m, cu_l, bm: cu_l[b] + m * bm)
    pairs = [(b, m) for b in range(B) for m in range(n_blocks(ns[b], BLOCK_M))]   # sequence by sequence
    if order == "largest first":
        pairs.sort(key=lambda bm: -bm[1])                                         # stable: ties keep sequence order
    elif order == "smallest first":
        pairs.sort(key=lambda bm: bm[1])
    n = (P or (lambda t, B, bm: (t + B * (bm - 1)) // bm))(cu_l[-1], B, BLOCK_M)
    pairs = pairs[:n]
    seq_idx = [b for b, _ in pairs] + [spare] * (n - len(pairs))
    q_start = [start(b, m, cu_l, BLOCK_M) for b, m in pairs] + [spare] * (n - len(pairs))
    return torch.tensor(seq_idx, dtype=torch.int32), torch.tensor(q_start, dtype=torch.int32)


def _map_case(name, lengths, BLOCK_M, note=""):
    return Case(name, cu_seqlens_from_lengths(lengths), BLOCK_M, note=note)


def _map_cases():
    rng = gen(101)
    random12 = torch.randint(0, 71, (12,), generator=rng).tolist()
    return [
        _map_case("the lesson's example: lengths [5, 0, 12, 3], BLOCK_M = 4", [5, 0, 12, 3], 4),
        _map_case("one sequence, ragged last block", [37], 16),
        _map_case("every length a multiple of BLOCK_M", [16, 32, 48], 16,
                  note="no ragged block: cdiv(n, BLOCK_M) == n // BLOCK_M here, and (n + BLOCK_M) // BLOCK_M is "
                       "one too many"),
        _map_case("empty first and last sequences", [0, 9, 0, 0, 20, 0], 8,
                  note="a sequence of 0 tokens has no query block and no program"),
        _map_case("every sequence empty", [0, 0, 0], 4, note="no real block: every entry is a spare (-1, -1)"),
        _map_case("BLOCK_M = 1 (one program per token)", [3, 1, 0, 2], 1),
        _map_case("BLOCK_M larger than every sequence", [7, 3, 12], 64),
        _map_case("BLOCK_M = 3 (an int >= 1, not a power of two)", [7, 0, 9, 2, 12], 3,
                  note="cdiv by shifts ((n + 3 - 1) >> 1) is wrong here: divide"),
        _map_case("random: 12 sequences of 0..70 tokens, BLOCK_M = 16", random12, 16),
        _map_case("long-tailed: 40 sequences, BLOCK_M = 32",
                  long_tailed_lengths(40, seed=7, median=24, max_len=300), 32),
    ]


_P_RULE = ("P = (total_q + B * (BLOCK_M - 1)) // BLOCK_M entries, total_q = cu_seqlens[-1]: every sequence's "
           "last block leaves at most BLOCK_M - 1 rows empty, so this bounds the real blocks without reading "
           "the lengths, which live on the GPU (the host sizes the grid before any of them is read)")


def _map_bugs():
    return [
        ("the ragged last block of each sequence is missing: a sequence of n tokens needs cdiv(n, BLOCK_M) = "
         "(n + BLOCK_M - 1) // BLOCK_M blocks, not n // BLOCK_M", dict(n_blocks=lambda n, bm: n // bm)),
        ("an empty sequence got a block: a sequence of 0 tokens has cdiv(0, BLOCK_M) = 0 blocks and no program "
         "(max(1, ...) gives it one, and that program would own the next sequence's rows)",
         dict(n_blocks=lambda n, bm: max(1, _cdiv(n, bm)))),
        ("one block too many when n is a multiple of BLOCK_M: cdiv(n, BLOCK_M) is (n + BLOCK_M - 1) // BLOCK_M, "
         "not (n + BLOCK_M) // BLOCK_M", dict(n_blocks=lambda n, bm: (n + bm) // bm)),
        ("q_start is the block's first row in the packed tensor, cu_seqlens[b] + m * BLOCK_M, not its row "
         "inside the sequence (m * BLOCK_M): the program loads q[q_start:q_start + BLOCK_M]",
         dict(start=lambda b, m, cu, bm: m * bm)),
        ("q_start is a row, cu_seqlens[b] + m * BLOCK_M, not a block number",
         dict(start=lambda b, m, cu, bm: cu[b] + m)),
        ("the entries are in sequence order: the kernel's order is by block index m, largest first (ties in "
         "sequence order), so the causal blocks with the most keys start first. Sort the (b, m) pairs by -m "
         "with a stable sort", dict(order="sequence")),
        ("the entries are sorted smallest block index first: the kernel starts the largest m first (a causal "
         "block m sees about (m + 1) * BLOCK_M keys: the longest work goes first, the short blocks fill in)",
         dict(order="smallest first")),
        ("no spare entries: the map has " + _P_RULE + "; the entries past the real blocks are (-1, -1)",
         None),                       # its model is _no_spares (see _bug_models)
        ("the spare entries past the real blocks must be (-1, -1), so their programs do nothing; 0 would make "
         "them redo rows 0.. of sequence 0", dict(spare=0)),
        ("P = cdiv(total_q, BLOCK_M) is too small: every sequence can leave a partly empty last block, so "
         "blocks are lost. " + _P_RULE, dict(P=lambda t, B, bm: _cdiv(t, bm))),
        ("cu_seqlens holds prefix sums: sequence b's length is cu_seqlens[b + 1] - cu_seqlens[b], not "
         "cu_seqlens[b + 1]", dict(lengths=lambda cu: cu[1:])),
    ]


def _no_spares(cu, BLOCK_M):
    """The map without its spare entries: exactly the real blocks."""
    seq_idx, q_start = _map_model(cu, BLOCK_M)
    keep = seq_idx >= 0
    return seq_idx[keep], q_start[keep]


def _bug_models(cu, BLOCK_M):
    for hint, kw in _map_bugs():
        if "no spare entries" in hint:
            yield hint, lambda: _no_spares(cu, BLOCK_M)
        else:
            yield hint, lambda kw=kw: _map_model(cu, BLOCK_M, **kw)


def _plain_tensor(g, t, what):
    """A tensor with its numbers in memory: ``expect_tensor`` gives a sparse or meta one a verdict, not a traceback."""
    return g.expect_tensor(t, what)


def _int32_1d(g, t, what):
    _plain_tensor(g, t, what)
    if t.dtype != torch.int32:
        g.fail(f"`{what}` has dtype {t.dtype}, expected torch.int32",
               hint="the kernel's program map is int32, like cu_seqlens: convert with .to(torch.int32) "
                    "(or build it with dtype=torch.int32)")
    if t.dim() != 1:
        g.fail(f"`{what}` has shape {list(t.shape)}, expected a 1-D tensor [P]",
               hint="one entry per program: flatten the (sequence, block) pairs into one list")
    return t


def _same_pair(got, want):
    return all(a.shape == b.shape and torch.equal(a.long(), b.long()) for a, b in zip(got, want))


def _check_map(g, out, case):
    cu, BLOCK_M = case.args
    want = _map_model(cu, BLOCK_M)
    seq_idx, q_start = g.expect_tuple(out, 2, "(seq_idx, q_start)")
    _int32_1d(g, seq_idx, "seq_idx")
    _int32_1d(g, q_start, "q_start")
    got = (seq_idx.detach().cpu(), q_start.detach().cpu())
    if _same_pair(got, want):
        return
    hint = next((h for h, model in _bug_models(cu, BLOCK_M) if _same_pair(got, model())), "")
    n_want = want[0].numel()
    if got[0].numel() != got[1].numel():
        g.fail(f"seq_idx has {got[0].numel()} entries and q_start {got[1].numel()}: they must be equal, one "
               "pair per program", hint=hint)
    if got[0].numel() != n_want:
        g.fail(f"{got[0].numel()} entries, expected P = {n_want}", hint=hint or _P_RULE)
    bad = [i for i in range(n_want) if (int(got[0][i]), int(got[1][i])) != (int(want[0][i]), int(want[1][i]))]
    i = bad[0]
    g.fail(f"entry {i}: got (seq_idx, q_start) = ({int(got[0][i])}, {int(got[1][i])}), expected "
           f"({int(want[0][i])}, {int(want[1][i])}); {len(bad)} of {n_want} entries wrong",
           hint=hint or "list the real blocks (b, m) with q_start = cu_seqlens[b] + m * BLOCK_M, order them by m, "
                        "largest first (a stable sort keeps sequences in order within one m), then pad to P "
                        "entries with (-1, -1)")


@exercise("varlen_block_map", arg_names=["cu_seqlens", "BLOCK_M"])
def varlen_block_map(g):
    for case in _map_cases():
        out = g.call(case, error_hint="" if "empty" not in case.name else
                     "empty sequences (and a batch with no tokens at all) must work: give them no block, and build "
                     "the result so that zero real blocks still works (torch.cat of an empty list raises; "
                     "torch.tensor([], dtype=torch.int32) does not)")
        _check_map(g, out, case)
        g.count()
    return f"{g.cases} cases match the kernel's program map (largest block index first, spares -1)"


# ------------------------------------------------------------------ exercise 2: gather_kv
JUNK = 50.0     # unused rows of a block, and blocks nobody owns: reading them changes the answer


def _pool_case(name, lengths, b, block_size, Hkv=2, d=4, seed=0, extra_blocks=3, max_blocks=None,
               pad="out of range", note=""):
    """A shuffled pool holding every sequence's cache; the expected answer is sequence b's own k."""
    rng = gen(seed)
    n_blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(n_blocks) + extra_blocks
    max_blocks = max(max(n_blocks), 1) if max_blocks is None else max_blocks
    alloc = BlockAllocator(num_blocks, seed=seed)
    k_pages = torch.full((num_blocks, block_size, Hkv, d), JUNK)
    if pad == "out of range":   # padding entries that point nowhere: reading them is an error, not junk
        table = (num_blocks + 1000 + torch.arange(len(lengths) * max_blocks)).reshape(len(lengths), max_blocks)
    else:
        table = torch.full((len(lengths), max_blocks), int(pad))
    table = table.to(torch.int32)
    truth = []
    for s, n in enumerate(lengths):
        k = torch.randn(n, Hkv, d, generator=rng)                       # [n, Hkv, d] the sequence's keys
        blocks = alloc.allocate(n_blocks[s])
        table[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for p, blk in enumerate(blocks):
            rows = k[p * block_size:(p + 1) * block_size]
            k_pages[blk, :rows.shape[0]] = rows
        truth.append(k)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    c = Case(name, k_pages, table, seqlens, b, note=note)
    c.want = truth[b]
    return c


def _gather_cases():
    return [
        _pool_case("4 sequences, sequence 1 (27 tokens in blocks of 8), padding entries 0", [13, 27, 40, 5], 1,
                   block_size=8, max_blocks=8, pad=0, seed=1,
                   note="the library leaves padding entries of block_table to the caller: here they are 0, "
                        "a real block of another sequence"),
        _pool_case("the last sequence of the batch, ragged last block, padded table", [6, 3, 21], 2, block_size=4,
                   max_blocks=8, seed=2, note="entries 6 and 7 of the row are padding (out of range here)"),
        _pool_case("cache length a multiple of block_size", [16, 32, 8], 1, block_size=8, seed=3),
        _pool_case("an empty sequence (cache_seqlens[b] = 0)", [9, 0, 12], 1, block_size=4, seed=4,
                   note="no tokens, no blocks: the answer is a [0, Hkv, d] tensor"),
        _pool_case("one token", [1, 30], 0, block_size=16, seed=5),
        _pool_case("block_size 1 (a block per token)", [5, 7], 1, block_size=1, seed=6),
        _pool_case("one sequence (B = 1), block_table row longer than its blocks", [45], 0, block_size=16,
                   max_blocks=6, seed=7, note="entries 3..5 of the row are padding (out of range here)"),
        _pool_case("many small blocks, MQA (Hkv = 1), d = 8", [30, 11, 50], 2, block_size=2, Hkv=1, d=8,
                   max_blocks=25, seed=8),
        _pool_case("block_size 3 (not a power of two), padding entries 0", [10, 17, 4], 1, block_size=3,
                   max_blocks=9, pad=0, seed=9, note="t >> 1 and t & 2 are not t // 3 and t % 3: only the division "
                                                      "is right for every block size"),
        _pool_case("block_size 6, padded table", [13, 25], 1, block_size=6, max_blocks=7, seed=10),
    ]


def _gather_model(*, page=None, row=None, seq_row=None, shift=0):
    """What a mistaken lookup returns: token t read from block table[seq_row(b), page(t)], row row(t)."""
    def model(c):
        k_pages, table, seqlens, b = c.args
        bs = k_pages.shape[1]
        t = torch.arange(int(seqlens[b])) + shift
        pg = page(t, bs, table, b) if page else table[seq_row(b) if seq_row else b, t // bs].long()
        rw = row(t, bs) if row else t % bs
        if (pg < 0).any() or (pg >= k_pages.shape[0]).any() or (rw >= bs).any():
            raise IndexError("the mistake reads out of range here")
        return k_pages[pg, rw]
    return model


def _gather_bugs():
    from ..checking import Bug
    return [
        Bug("the block index was used directly, as if block p of the sequence were block p of the pool: look it "
            "up, block_table[b, t // block_size]", _gather_model(page=lambda t, bs, tab, b: t // bs)),
        Bug("t // block_size and t % block_size are swapped: the block is block_table[b, t // block_size] "
            "and the row inside it t % block_size",
            _gather_model(page=lambda t, bs, tab, b: tab[b, t % bs].long(), row=lambda t, bs: t // bs)),
        Bug("off by one at a block boundary: token t is in logical block floor(t / block_size) (ceil moves every "
            "token but the first of a block into the next block)",
            _gather_model(page=lambda t, bs, tab, b: tab[b, -(-t // bs)].long())),
        Bug("off by one token: positions run from 0 to cache_seqlens[b] - 1 (torch.arange(n)), so every token "
            "came from its neighbour", _gather_model(shift=1)),
        Bug("the wrong row of block_table: sequence b's blocks are in block_table[b]", _gather_model(seq_row=lambda b: 0)),
        Bug("t >> log2(block_size) and t & (block_size - 1) are t // block_size and t % block_size only for a power "
            "of two; block sizes need not be one: divide, t // block_size and t % block_size",
            _gather_model(page=lambda t, bs, tab, b: tab[b, t >> (bs.bit_length() - 1)].long(),
                          row=lambda t, bs: t & (bs - 1))),
    ]


_INDEX_HINT = ("an index ran past the table or the pool. Token t of sequence b is in block "
               "block_table[b, t // block_size] at row t % block_size; only the first cdiv(cache_seqlens[b], "
               "block_size) entries of block_table[b] are the sequence's blocks: the rest are padding, which "
               "may hold anything (here, on purpose, numbers past the pool). Read no entry past them")
_EMPTY_HINT = ("an empty sequence (cache_seqlens[b] = 0) has no blocks: return a [0, Hkv, d] tensor. torch.cat "
               "of an empty list raises; indexing with torch.arange(0) gives the empty result")


def _check_gather(g, out, case):
    k_pages, table, seqlens, b = case.args
    want = case.want
    n, bs = int(seqlens[b]), k_pages.shape[1]
    _plain_tensor(g, out, "k")
    if tuple(out.shape) != tuple(want.shape):
        rows = out.shape[0] if out.dim() == 3 else None
        if rows == -(-n // bs) * bs and rows != n:
            hint = ("the whole last block was read, its unused rows too: only cache_seqlens[b] - p * block_size "
                    "rows of the last block are real")
        elif rows == table.shape[1] * bs:
            hint = ("every entry of block_table[b] was read: the entries past cdiv(cache_seqlens[b], block_size) "
                    "are padding, not blocks of this sequence")
        else:
            hint = "one row per token of sequence b: [cache_seqlens[b], Hkv, d]"
        g.fail(f"`k` has shape {list(out.shape)}, expected {list(want.shape)}", hint=hint)
    g.expect_tensor(out, "k", dtype=k_pages.dtype)
    g.compare(out, want, "k", rtol=0, atol=0, bugs=_gather_bugs(),
              hint="token t of sequence b is row t % block_size of block block_table[b, t // block_size]")


# ops that move elements without computing with them, and ops that look elements up in their first argument
_COPIES = {"_to_copy", "clone", "contiguous", "copy_", "alias", "lift_fresh", "detach", "_unsafe_view"}
_LOOKUPS = {"index", "index_select", "gather", "take", "_unsafe_index"}
_PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "mv", "dot", "matmul", "einsum", "tensordot"}


def _watch_class():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Watch(TorchDispatchMode):
        """Follows the entries of ``block_table`` (and whole copies of them) through the learner's torch ops:
        ``padding_read`` names the first op that computed with, or looked blocks up by, a padding entry of
        row b; ``pool_math`` the first product or pointwise op on the pool (a one-hot matmul reads it all).
        A lookup ``table[b, idx]`` reads only the entries ``idx`` picks (the answer's origin: the same op
        applied to the origin map)."""

        def __init__(self, table, padding, pages):
            super().__init__()
            self.origins, self.padding = {}, padding          # storage -> (itemsize, int64 origin per element)
            self.pages = pages.untyped_storage().data_ptr()
            self.padding_read = self.pool_math = None
            self.add(table, torch.arange(table.numel()).reshape(table.shape))

        def add(self, t, idx):
            st = t.untyped_storage()
            n = st.nbytes() // t.element_size()
            origin = torch.full((n,), -1, dtype=torch.int64)
            if t.numel():
                origin.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(idx.reshape(t.shape))
            self.origins[st.data_ptr()] = (t.element_size(), origin, t)

        def origin(self, t):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
                return None
            hit = self.origins.get(t.untyped_storage().data_ptr())
            if hit is None or hit[0] != t.element_size() or t.numel() == 0:
                return None
            try:
                return hit[1].as_strided(t.shape, t.stride(), t.storage_offset())
            except RuntimeError:
                return None

        def reads_padding(self, idx):
            idx = idx[idx >= 0]
            return bool(self.padding[idx].any()) if idx.numel() else False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if func.is_view:
                return out
            if self.pool_math is None and (name in _PRODUCTS or torch.Tag.pointwise in func.tags
                                           or torch.Tag.reduction in func.tags):
                if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.pages
                       for t in tree_flatten((args, kwargs))[0]):
                    self.pool_math = name
            first = args[0] if args else None
            o_first = self.origin(first)
            if name in _COPIES and o_first is not None and isinstance(out, torch.Tensor) and name != "copy_":
                self.add(out, o_first)
                return out
            if name == "copy_" and len(args) > 1 and self.origin(args[1]) is not None:
                self.add(args[0], self.origin(args[1]).expand(args[0].shape))
                return out
            if name in _LOOKUPS and o_first is not None and isinstance(out, torch.Tensor):
                picked = func(o_first, *args[1:], **kwargs)        # the same lookup, on the origin map
                if picked.shape == out.shape:
                    self.add(out, picked)
                rest = tree_flatten((args[1:], kwargs))[0]
            else:
                rest = tree_flatten((args, kwargs))[0]
            if self.padding_read is None:
                for t in rest:
                    o = self.origin(t)
                    if o is not None and self.reads_padding(o.reshape(-1)):
                        self.padding_read = name
                        break
            return out

    return Watch


def _watched(g, case, seen):
    """The learner's function on the case's copies, under the table watch (``seen[0]``: the watch)."""
    k_pages, table, seqlens, b = case.args
    padding = torch.zeros(table.shape, dtype=torch.bool)
    padding[b, -(-int(seqlens[b]) // k_pages.shape[1]):] = True

    def run(k_pages, block_table, cache_seqlens, b):
        with _watch_class()(block_table, padding.reshape(-1), k_pages) as w:
            seen[:] = [w]
            return g.fn(k_pages, block_table, cache_seqlens, b)
    run.__name__ = getattr(g.learner_fn, "__name__", "gather_kv")
    return run


def _check_reads(g, w, case):
    """After a right answer: it read no padding entry of the table and did no arithmetic on the pool."""
    k_pages, table, seqlens, b = case.args
    n_blocks = -(-int(seqlens[b]) // k_pages.shape[1])
    if w.padding_read is not None:
        g.fail(f"your function read the padding entries of block_table[{b}] (entries {n_blocks}.."
               f"{table.shape[1] - 1}; the sequence has {n_blocks} blocks) in aten.{w.padding_read}",
               hint="only the first cdiv(cache_seqlens[b], block_size) entries of block_table[b] are the "
                    "sequence's blocks; the rest are padding and may hold anything. Making them valid "
                    "(clamp, % num_blocks) and dropping their rows afterwards still reads them: look up "
                    "block_table[b, t // block_size] for the real tokens t only")
    if w.pool_math is not None:
        g.fail(f"your function computed with the whole pool k_pages (aten.{w.pool_math})",
               hint="a gather is a lookup, not arithmetic: a one-hot matrix times the pool reads every "
                    "block of every sequence (num_blocks * block_size rows) to keep n. Index it: "
                    "k_pages[blocks, t % block_size]")


@exercise("gather_kv", arg_names=["k_pages", "block_table", "cache_seqlens", "b"],
          reference="the contiguous cache the pool was filled from")
def gather_kv(g):
    for case in _gather_cases():
        seen = []
        out = g.call(case, fn=_watched(g, case, seen), error_hint=_EMPTY_HINT if "empty" in case.name else _INDEX_HINT)
        _check_gather(g, out, case)
        _check_reads(g, seen[0], case)
        g.count()
    return f"{g.cases} cases match the contiguous cache, bit for bit (shuffled pools, padded tables)"
