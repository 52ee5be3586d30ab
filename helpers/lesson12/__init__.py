"""Lesson 12's plain functions: masks and score modifications as block sparsity.

A mask is a predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = query ``q_idx`` may see key
``kv_idx``) and a score modification a function ``score_mod(score, b, h, q_idx, kv_idx) -> score``:
FlexAttention's signatures (``torch.nn.attention.flex_attention``). Both are written with tensor ops
only, so that they run element by element on broadcast index tensors (``q_idx [Br, 1]``,
``kv_idx [1, Bc]``) as well as under ``torch.vmap`` (how ``create_block_mask`` calls them).

The masks follow the FlashAttention library's arguments (``flash_attn_func``'s docstring, and
``csrc/flash_attn/flash_api.cpp``): ``window_size=(left, right)`` lets query ``i`` see the keys
``[i + Nk - N - left, i + Nk - N + right]`` inclusive (bottom-right aligned), ``-1`` is unbounded on
that side, and ``causal=True`` sets ``right = 0``. ALiBi adds ``-slope_h * |i + Nk - N - j|``; softcap
replaces the *scaled* score ``s`` by ``cap * tanh(s / cap)`` (the library stores
``softmax_scale / softcap`` as its pre-tanh factor; FlexAttention applies ``score_mod`` after the scale too).

The block mask is FlexAttention's ``BlockMask`` layout for one head, checked against
``create_block_mask``: per Q block, ``kv_num_blocks`` partial KV blocks listed first in ``kv_indices``
(ascending), ``full_kv_num_blocks`` full ones in ``full_kv_indices``. As in ``create_block_mask``
(``_convert_mask_to_block_mask`` pads the mask with False to a multiple of the block), a ragged last
block counts its padding as masked: it is never full.
"""
from __future__ import annotations

import math

import torch

from ..results import load_json
from . import records

__all__ = ["MaskMod", "ScoreMod", "causal", "sliding_window", "document", "prefix_lm", "no_mask",
           "softcap", "alibi", "relative_bias", "alibi_slopes", "SKIP", "FULL", "PARTIAL", "CLASSES",
           "dense_mask", "tile_classes", "classes_from_block_mask", "build_block_mask_ref", "flex_block_mask",
           "attention_mods_ref", "flash_attn_block_sparse_ref", "every_tile_attention", "softcap_grad_ref",
           "tile_counts", "render_tile_classes", "plot_masks", "MASKS_RESULTS", "show_masks_results", "gpu_cases",
           "run_on_gpu", "tile_counts_from"]

SKIP, FULL, PARTIAL = 0, 1, 2
CLASSES = ("skip", "full", "partial")


# ------------------------------------------------------------------ masks: predicates with a readable name
class MaskMod:
    """A ``mask_mod(b, h, q_idx, kv_idx)`` that prints as what it is (a checker's case names it)."""

    def __init__(self, fn, label: str):
        self.fn, self.label = fn, label

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self):
        return self.label


class ScoreMod:
    """A ``score_mod(score, b, h, q_idx, kv_idx)`` that prints as what it is."""

    def __init__(self, fn, label: str):
        self.fn, self.label = fn, label

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)

    def __repr__(self):
        return self.label


def no_mask() -> MaskMod:
    """Every query sees every key."""
    return MaskMod(lambda b, h, q_idx, kv_idx: kv_idx >= 0, "no_mask()")


def causal(N: int, Nk: int) -> MaskMod:
    """The library's causal mask, bottom-right aligned: query i sees keys j <= i + Nk - N."""
    off = Nk - N
    return MaskMod(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + off, f"causal(N={N}, Nk={Nk})")


def sliding_window(N: int, Nk: int, window_size=(-1, -1), is_causal: bool = False) -> MaskMod:
    """``flash_attn_func(..., window_size=(left, right), causal=is_causal)``: query i sees keys
    ``i + Nk - N - left <= j <= i + Nk - N + right``; -1 is unbounded; causal sets right = 0."""
    left, right = window_size
    if is_causal:
        right = 0
    off = Nk - N
    big = N + Nk + 1                           # "unbounded": further than any key
    lo = left if left >= 0 else big
    hi = right if right >= 0 else big

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx + off - lo) & (kv_idx <= q_idx + off + hi)
    return MaskMod(mask_mod, f"sliding_window(N={N}, Nk={Nk}, window_size=({left}, "
                             f"{window_size[1]}){', causal' if is_causal else ''})")


def document(doc_ids: torch.Tensor, is_causal: bool = False) -> MaskMod:
    """Packed documents: query i sees key j when they belong to the same document (and j <= i if causal).
    ``doc_ids`` int [N]: the document of each token (self-attention, N = Nk)."""
    doc_ids = torch.as_tensor(doc_ids, dtype=torch.long)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return (same & (kv_idx <= q_idx)) if is_causal else same
    sizes = torch.unique_consecutive(doc_ids, return_counts=True)[1].tolist()
    return MaskMod(mask_mod, f"document(lengths={sizes}{', causal' if is_causal else ''})")


def prefix_lm(prefix: int) -> MaskMod:
    """Prefix-LM: the first ``prefix`` tokens are seen by every query (bidirectional), the rest causally."""
    return MaskMod(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < prefix), f"prefix_lm(prefix={prefix})")


# ------------------------------------------------------------------ score modifications
def softcap(cap: float) -> ScoreMod:
    """Gemma 2's logit softcapping of the scaled score: cap * tanh(score / cap)."""
    return ScoreMod(lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap), f"softcap({cap:g})")


def alibi_slopes(H: int) -> torch.Tensor:
    """ALiBi's per-head slopes for a power-of-two H: 2^(-8 (h + 1) / H)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)


def alibi(slopes, N: int, Nk: int) -> ScoreMod:
    """ALiBi as the library adds it: score - slopes[h] * |i + Nk - N - j| (bottom-right aligned)."""
    slopes = torch.as_tensor(slopes, dtype=torch.float64)
    off = Nk - N

    def score_mod(s, b, h, q_idx, kv_idx):
        return s - slopes[h].to(s.dtype) * (q_idx + off - kv_idx).abs().to(s.dtype)
    return ScoreMod(score_mod, f"alibi(slopes={[round(x, 4) for x in slopes.tolist()]}, N={N}, Nk={Nk})")


def relative_bias(table, max_distance: int) -> ScoreMod:
    """A learned relative-position bias (T5-like, without buckets): score + table[h, clamp(j - i)]."""
    table = torch.as_tensor(table, dtype=torch.float64)          # [H, 2 * max_distance + 1]
    R = max_distance

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + table[h][(kv_idx - q_idx).clamp(-R, R) + R].to(s.dtype)
    return ScoreMod(score_mod, f"relative_bias(max_distance={R})")


# ------------------------------------------------------------------ the element-level truth and the tile classes
def dense_mask(mask_mod, N: int, Nk: int, b: int = 0, h: int = 0) -> torch.Tensor:
    """bool [N, Nk]: the predicate evaluated on every (query, key) pair (the reference; a kernel never builds it)."""
    q_idx = torch.arange(N)[:, None]                                 # [N, 1]
    kv_idx = torch.arange(Nk)[None, :]                               # [1, Nk]
    return torch.as_tensor(mask_mod(b, h, q_idx, kv_idx)).expand(N, Nk).to(torch.bool)


def tile_classes(mask_mod, N: int, Nk: int, BLOCK_M: int, BLOCK_N: int, h: int = 0) -> torch.Tensor:
    """int [ceil(N/BLOCK_M), ceil(Nk/BLOCK_N)]: SKIP, FULL or PARTIAL per tile, the padding of a ragged
    block counting as masked (FlexAttention's convention), one tile's predicate at a time."""
    Tq, Tk = math.ceil(N / BLOCK_M), math.ceil(Nk / BLOCK_N)
    cls = torch.zeros(Tq, Tk, dtype=torch.int64)
    for a in range(Tq):
        q_idx = torch.arange(a * BLOCK_M, min((a + 1) * BLOCK_M, N))[:, None]          # [br, 1]
        for c in range(Tk):
            kv_idx = torch.arange(c * BLOCK_N, min((c + 1) * BLOCK_N, Nk))[None, :]   # [1, bc]
            keep = torch.as_tensor(mask_mod(0, h, q_idx, kv_idx)).expand(q_idx.shape[0], kv_idx.shape[1])
            n = int(keep.sum())
            cls[a, c] = SKIP if n == 0 else FULL if n == BLOCK_M * BLOCK_N else PARTIAL
    return cls


def _ordered(dense: torch.Tensor):
    """(num [Tq], indices [Tq, Tk]) int32: each row's listed blocks ascending, then the others ascending
    (what create_block_mask's stable argsort gives; a kernel reads only the first num entries)."""
    num = dense.sum(1).to(torch.int32)
    cols = torch.arange(dense.shape[1])
    rows = [torch.cat([cols[r], cols[~r]]) for r in dense.to(torch.bool)]
    idx = torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, dense.shape[1], dtype=torch.int32)
    return num, idx


def build_block_mask_ref(mask_mod, N, Nk, BLOCK_M=4, BLOCK_N=3):
    """The course's answer to the exercise: (kv_num_blocks [Tq], kv_indices [Tq, Tk], full_kv_num_blocks [Tq],
    full_kv_indices [Tq, Tk]), int32, in create_block_mask's layout for one head."""
    cls = tile_classes(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
    kv_num, kv_idx = _ordered(cls == PARTIAL)
    full_num, full_idx = _ordered(cls == FULL)
    return kv_num, kv_idx, full_num, full_idx


def flex_block_mask(mask_mod, N, Nk, BLOCK_M, BLOCK_N):
    """``torch.nn.attention.flex_attention.create_block_mask`` on the CPU (B = H = 1), as the exercise's
    4-tuple for the one head: the checker's reference."""
    from torch.nn.attention.flex_attention import create_block_mask
    fn = mask_mod.fn if isinstance(mask_mod, MaskMod) else mask_mod
    bm = create_block_mask(fn, 1, 1, N, Nk, device="cpu", BLOCK_SIZE=(BLOCK_M, BLOCK_N))
    return bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0], bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]


def classes_from_block_mask(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, Tk=None):
    """int [Tq, Tk]: the tile classes a block mask lists (SKIP where neither list holds the tile)."""
    Tq = kv_num_blocks.shape[0]
    Tk = kv_indices.shape[1] if Tk is None else Tk
    cls = torch.zeros(Tq, Tk, dtype=torch.int64)
    for a in range(Tq):
        for c in full_kv_indices[a, :int(full_kv_num_blocks[a])].tolist():
            cls[a, c] = FULL
        for c in kv_indices[a, :int(kv_num_blocks[a])].tolist():
            cls[a, c] = PARTIAL
    return cls


def tile_counts(mask_mod, N, Nk, BLOCK_M, BLOCK_N) -> dict:
    """How many tiles of each class, and the fraction of the N x Nk scores a block-sparse kernel computes
    (the listed tiles' clipped areas) and the fraction really visible."""
    cls = tile_classes(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
    h = torch.tensor([min(BLOCK_M, N - i0) for i0 in range(0, N, BLOCK_M)], dtype=torch.float64)
    w = torch.tensor([min(BLOCK_N, Nk - j0) for j0 in range(0, Nk, BLOCK_N)], dtype=torch.float64)
    area = h[:, None] * w[None, :]
    out = {name: int((cls == c).sum()) for c, name in enumerate(CLASSES)}
    out["computed"] = float(area[cls != SKIP].sum()) / (N * Nk)
    out["visible"] = float(dense_mask(mask_mod, N, Nk).sum()) / (N * Nk)
    return out


# ------------------------------------------------------------------ the float64 reference and the course's kernel
def _identity(s, b, h, q_idx, kv_idx):
    return s


def attention_mods_ref(q, k, v, mask_mod=None, score_mod=None, h=0, scale=None):
    """(O, lse) in float64, densely: S = q k^T * scale, then score_mod, then the mask (-inf), then softmax.
    A row that sees no key: O = 0, lse = -inf. The checkers' reference."""
    q, k, v = q.double(), k.double(), v.double()
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q_idx, kv_idx = torch.arange(N)[:, None], torch.arange(Nk)[None, :]
    S = q @ k.T * scale                                                  # [N, Nk]
    if score_mod is not None:
        S = score_mod(S, 0, h, q_idx, kv_idx)
    if mask_mod is not None:
        S = S.masked_fill(~dense_mask(mask_mod, N, Nk, h=h), -math.inf)
    lse = torch.logsumexp(S, 1)                                          # [N]
    empty = torch.isneginf(lse)
    P = torch.where(empty[:, None], 0.0, torch.exp(S - torch.where(empty, 0.0, lse)[:, None]))
    return P @ v, lse


def flash_attn_block_sparse_ref(q, k, v, block_mask, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
    """The course's answer to the tile-loop exercise: lesson 03's V2 loop over the listed tiles only,
    the mask on partial tiles only, the score_mod on every visited tile. Returns (O, lse) in q's dtype."""
    kv_num, kv_idx, full_num, full_idx = block_mask
    score_mod = score_mod or _identity
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    O = torch.zeros(N, v.shape[1], dtype=q.dtype)                         # [N, dv]
    lse = torch.full((N,), -math.inf, dtype=q.dtype)                      # [N]
    for a, i0 in enumerate(range(0, N, BLOCK_M)):
        Qi = q[i0:i0 + BLOCK_M]                                           # [Br, d]
        br = Qi.shape[0]
        q_idx = torch.arange(i0, i0 + br)[:, None]                        # [Br, 1]
        m = torch.full((br,), -math.inf, dtype=q.dtype)
        l = torch.zeros(br, dtype=q.dtype)
        acc = torch.zeros(br, v.shape[1], dtype=q.dtype)                  # [Br, dv]
        tiles = [(c, True) for c in kv_idx[a, :int(kv_num[a])].tolist()] + \
                [(c, False) for c in full_idx[a, :int(full_num[a])].tolist()]
        for c, partial in tiles:
            j0 = c * BLOCK_N
            Kj, Vj = k[j0:j0 + BLOCK_N], v[j0:j0 + BLOCK_N]               # [Bc, d]
            kv = torch.arange(j0, j0 + Kj.shape[0])[None, :]              # [1, Bc]
            S = score_mod(Qi @ Kj.T * scale, 0, h, q_idx, kv)             # [Br, Bc]: scale, then the mod
            if partial:
                S = S.masked_fill(~mask_mod(0, h, q_idx, kv), -math.inf)  # then the mask, partial tiles only
            m_new = torch.maximum(m, S.amax(1))
            m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
            P = torch.exp(S - m_safe[:, None])                            # [Br, Bc]
            alpha = torch.exp(m - m_safe)
            l = alpha * l + P.sum(1)
            acc = alpha[:, None] * acc + P @ Vj                           # [Br, dv]
            m = m_new
        l_safe = torch.where(l == 0, 1.0, l)
        O[i0:i0 + br] = acc / l_safe[:, None]
        lse[i0:i0 + br] = torch.where(l == 0, -math.inf, m + torch.log(l_safe))
    return O, lse


def every_tile_attention(q, k, v, mask_mod, score_mod=None, BLOCK_M=4, BLOCK_N=3, h=0):
    """The same loop with no block mask: every tile computed, every tile masked (the baseline to count against)."""
    N, Nk = q.shape[0], k.shape[0]
    Tq, Tk = math.ceil(N / BLOCK_M), math.ceil(Nk / BLOCK_N)
    every = torch.arange(Tk, dtype=torch.int32).expand(Tq, Tk)
    return flash_attn_block_sparse_ref(q, k, v, (torch.full((Tq,), Tk, dtype=torch.int32), every,
                                                 torch.zeros(Tq, dtype=torch.int32), every),
                                       mask_mod, score_mod, BLOCK_M, BLOCK_N, h)


def softcap_grad_ref(s, dT, cap):
    """dS for T = cap * tanh(s / cap): dT * (1 - tanh(s / cap)^2)."""
    t = torch.tanh(s / cap)
    return dT * (1 - t * t)


# ------------------------------------------------------------------ pictures
def render_tile_classes(mask_mod, N: int = 24, Nk: int = 24, BLOCK_M: int = 4, BLOCK_N: int = 4, ax=None,
                        title: str | None = None):
    """Heat map of the tile classes (grey skip, blue full, orange partial), visible scores as black squares."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    if ax is None:
        _, ax = plt.subplots(figsize=(4.4, 4.4))
    cls = tile_classes(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
    per_elem = cls.repeat_interleave(BLOCK_M, 0)[:N].repeat_interleave(BLOCK_N, 1)[:, :Nk]      # [N, Nk]
    ax.imshow(per_elem.numpy(), cmap=ListedColormap(["#eeeeee", "#4c9be8", "#f5a142"]), vmin=0, vmax=2,
              interpolation="nearest", aspect="equal")
    ys, xs = torch.nonzero(dense_mask(mask_mod, N, Nk), as_tuple=True)
    ax.scatter(xs.numpy(), ys.numpy(), s=max(2, 900 / max(N, Nk) ** 1.3), c="k", marker="s", linewidths=0)
    for i0 in range(0, N + 1, BLOCK_M):
        ax.axhline(min(i0, N) - 0.5, color="white", lw=1.2)
    for j0 in range(0, Nk + 1, BLOCK_N):
        ax.axvline(min(j0, Nk) - 0.5, color="white", lw=1.2)
    n = tile_counts(mask_mod, N, Nk, BLOCK_M, BLOCK_N)
    ax.set_title(f"{title or mask_mod!r}\nskip {n['skip']}, full {n['full']}, partial {n['partial']}; "
                 f"computes {n['computed']:.0%}, {n['visible']:.0%} visible", fontsize=8)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    return ax


def plot_masks(masks: dict, N: int, Nk: int, BLOCK_M: int, BLOCK_N: int):
    """One tile-class map per mask, side by side; returns the figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(masks), figsize=(4.2 * len(masks), 4.6))
    for ax, (name, mm) in zip(list(axes) if len(masks) > 1 else [axes], masks.items()):
        render_tile_classes(mm, N, Nk, BLOCK_M, BLOCK_N, ax=ax, title=name)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ on a GPU: the course's block-sparse Triton kernel
MASKS_RESULTS = records.MASKS_RESULTS                  # bench/bench_masks.py on an H200


def show_masks_results(path=MASKS_RESULTS) -> None:
    """Print a masks record in full (``records.masks_table``: the course vs FlexAttention vs SDPA with a dense mask,
    forward and backward, with its label), or say that none is recorded."""
    res = load_json(path)
    if res is None:
        print(f"No figures are recorded yet: {path.name} is missing (`python3 bench/bench_masks.py` on a CUDA GPU "
              "writes it).")
        return
    print(records.masks_table(res))


def gpu_cases(N: int, device, H: int = 4):
    """[(name, the kernel's MaskSpec, its score_mod, this lesson's mask_mod, its score_mod or None)]: the lesson's
    masks written twice, as the Triton kernel's constexpr variants and as this lesson's predicates."""
    from ..kernels import block_sparse as bs
    docs = torch.repeat_interleave(torch.arange(6), torch.tensor([N // 3, 1, N // 4, 1, N // 5, 0]))
    docs = torch.cat([docs, torch.full((N - docs.numel(),), 6)]).to(device)          # 7 documents, two of length 1
    slopes = alibi_slopes(H)
    return [
        ("causal", bs.causal_mask(), None, causal(N, N), None),
        ("sliding window (64, 0), causal", bs.sliding_window_mask((64, 0), causal=True), None,
         sliding_window(N, N, (64, 0), is_causal=True), None),
        ("documents, causal", bs.document_mask(docs, causal=True), None, document(docs.cpu(), is_causal=True), None),
        (f"prefix-LM {N // 4}", bs.prefix_lm_mask(N // 4), None, prefix_lm(N // 4), None),
        ("window (64, 0) + softcap 20", bs.sliding_window_mask((64, 0), causal=True), bs.SoftCap(20.0),
         sliding_window(N, N, (64, 0), is_causal=True), softcap(20.0)),
        ("causal + ALiBi", bs.causal_mask(), bs.ALiBi(slopes.float().to(device)), causal(N, N), alibi(slopes, N, N)),
    ]


def run_on_gpu(N: int = 1000, d: int = 64, H: int = 4, device=None, dtype=torch.float16) -> list:
    """On a CUDA GPU: the course's block-sparse Triton forward and backward on each of ``gpu_cases``, fp16, checked per
    head against ``attention_mods_ref`` in float64 (O, lse, and dq, dk, dv through autograd); prints a line per
    mask and raises AssertionError on a mismatch. Without one: says so in one line (the recorded figures are the
    lesson's "Going deeper", ``records``), returns []. (``device="cpu"``, ``dtype=torch.float32``: the same under Triton's interpreter, for the tests.)"""
    if device is None and not torch.cuda.is_available():
        print("No CUDA GPU here: the block-sparse Triton kernel runs only on one (its interpreter tests are "
              "tests/test_triton_block_sparse.py). The figures recorded on an H200 are in \"Going deeper\".")
        return []
    from .. import triton_mode
    triton_mode.require_triton("Triton is not installed in this Python: the block-sparse kernel cannot run here.",
                               show_masks_results)
    from ..kernels import block_sparse as bs
    dev = torch.device(device or "cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, H, N, d, generator=g) * s).to(dev, dtype) for s in (3, 3, 1))
    tiles = bs.block_sparse_tiles(d, dtype, dev, backward=True)
    do = torch.randn(1, H, N, d, generator=g).to(dev, dtype)
    out = []
    for name, spec, mod, mask_mod, score_mod in gpu_cases(N, dev, H):
        bm = bs.build_block_mask_triton(spec, N, N, *tiles, device=dev)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = bs.flash_attn_block_sparse(qg, kg, vg, bm, score_mod=mod)           # forward, then the backward
        grads = torch.autograd.grad(o, (qg, kg, vg), do)
        err = lse_err = grad_err = 0.0
        for h in range(H):
            q64, k64, v64 = (t[0, h].detach().double().cpu().requires_grad_() for t in (q, k, v))
            ro, rl = attention_mods_ref(q64, k64, v64, mask_mod, score_mod, h=h)
            want = torch.autograd.grad(ro, (q64, k64, v64), do[0, h].double().cpu())
            got_l = lse[0, h].double().cpu()
            assert torch.equal(torch.isneginf(got_l), torch.isneginf(rl)), f"{name}: the rows that see nothing differ"
            seen = torch.isfinite(rl)
            err = max(err, (o[0, h].double().cpu() - ro).abs().max().item())
            lse_err = max(lse_err, (got_l[seen] - rl[seen]).abs().max().item())
            for gr, w in zip(grads, want):                                          # relative to the largest entry
                grad_err = max(grad_err, ((gr[0, h].double().cpu() - w).abs().max() / w.abs().max()).item())
        ok = err < 1e-2 and lse_err < 1e-2 and grad_err < 2e-2
        n = tile_counts_from(bm)
        print(f"{'✅' if ok else '❌'} {name:30} |O - ref| {err:.1e}, |lse - ref| {lse_err:.1e}, dq/dk/dv {grad_err:.1e} "
              f"of the largest; tiles: {n['full']} full, {n['partial']} partial of {n['all']}")
        assert ok, (f"{name}: the block-sparse kernels differ from float64 by {err:.3g} (O), {lse_err:.3g} (lse), "
                    f"{grad_err:.3g} (gradients, relative)")
        out.append(dict(mask=name, err=err, lse_err=lse_err, grad_err=grad_err, **n))
    print(f"({tiles[0]} x {tiles[1]} tiles, N = {N}, d = {d}, H = {H}, {str(dtype).replace('torch.', '')})")
    return out


def tile_counts_from(bm) -> dict:
    """How many tiles a kernel's block mask lists as full and as partial, of all of them (first sequence)."""
    return dict(full=int(bm.full_kv_num_blocks[0].sum()), partial=int(bm.kv_num_blocks[0].sum()),
                all=int(bm.kv_indices[0, 0].numel()))
