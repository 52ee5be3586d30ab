"""Attention against a KV cache, contiguous or paged, in Triton (lesson 10).

``flash_attn_with_kvcache_triton(q, k_cache, v_cache, cache_seqlens, block_table=None,
causal=False, num_splits=None, sm_scale=None, *, window_size=(-1, -1), softcap=0.0,
alibi_slopes=None) -> O`` takes the FlashAttention library's layout and meaning
(``flash_attn_with_kvcache``, without its in-place cache update):

* q ``[B, Nq, H, d]``: Nq new tokens per sequence (decode: Nq = 1; a short chunk: Nq <= 16 or so).
* The cache, ``[B, Nmax, Hkv, d]`` (contiguous), or ``[num_blocks, block_size, Hkv, d]`` (paged)
  with ``block_table`` int32 ``[B, max_blocks]``: token t of sequence b lives in page
  ``block_table[b, t // block_size]``, row ``t % block_size``.
* ``cache_seqlens`` int32 ``[B]``: sequence b holds that many tokens, the Nq new ones included.
* causal (bottom-right, the library's convention; off by default, as in the library): new
  token i sees keys ``j <= cache_seqlens[b] - Nq + i``; not causal: all ``cache_seqlens[b]``
  keys. A row that sees no key gets O = 0.
* window_size (left, right), bottom-right per sequence: new token i sits at position
  ``p = cache_seqlens[b] - Nq + i`` and sees keys ``p - left <= j <= p + right``; -1 is
  unbounded, causal sets right = 0.
* softcap > 0: the scaled score s becomes ``softcap * tanh(s / softcap)`` (Gemma 2);
  alibi_slopes float32 [H] or [B, H]: ``s -= slope * |p - j|``. Both before the mask.
* GQA: query head h reads KV head ``h // (H // Hkv)``.
* Any head dim from 1 to 256 (the decode kernel masks its loads and stores along d).

The kernel is the decode kernel of helpers/kernels/decode.py (``_decode_kernel``): split-KV,
one program per (split, sequence, KV head) holding the Nq x H/Hkv query rows of that head as one
tile, the page looked up once per K/V tile (or per row when a page is smaller than a tile), and
the splits merged inside the same launch. Written for this course; figures in bench/NOTES.md.
"""

import torch

from .common import _check_alibi_slopes, _check_head_dim, _check_qkv, _check_softcap, _check_window
from .decode import _decode_launch

__all__ = ["flash_attn_with_kvcache_triton"]


def _check_index_tensor(name, x, ndim, device):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (as in the FlashAttention library), got {str(x.dtype).replace('torch.', '')}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def flash_attn_with_kvcache_triton(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=False,
                                   num_splits=None, sm_scale=None, *, window_size=(-1, -1), softcap=0.0,
                                   alibi_slopes=None, config=None):
    """Attention of Nq new tokens per sequence against its cache: returns O [B, Nq, H, d] in q's dtype.

    q: [B, Nq, H, d]. k_cache, v_cache: [B, Nmax, Hkv, d], or with block_table (int32
    [B, max_blocks]) pages [num_blocks, block_size, Hkv, d], block_size a power of two >= 16.
    cache_seqlens: int32 [B] (or an int for all), tokens held per sequence, new ones included.
    causal: bottom-right (new token i sees keys j <= cache_seqlens[b] - Nq + i); False by
    default, like flash_attn_with_kvcache (for Nq = 1 both see every cached key).
    window_size: (left, right), new token i at p = cache_seqlens[b] - Nq + i sees keys
    p - left <= j <= p + right (-1: unbounded; causal sets right = 0); splits cover only the keys
    some row sees, so a short window over a long cache reads only the window's tiles. softcap: 0.0 off,
    > 0: s = softcap * tanh(s / softcap) on the scaled score s = q.k * sm_scale. alibi_slopes:
    float32 [H] or [B, H] on q's device, s -= slope[h] * |p - j|. Both come before the mask and
    the running max (softcap first). A row that sees no key gets O = 0. num_splits:
    pieces each sequence's keys are cut into; None picks from B*Hkv, the SM count and the capacity
    (with a window's left >= 0, the at most left + Nq keys a sequence's rows see). sm_scale: 1/sqrt(d) by default. ``config`` (BLOCK_N, num_warps, num_stages) is for
    benchmarks.

    Contract on a GPU (checked on the CPU, where it costs no device sync): 0 <= cache_seqlens[b]
    <= capacity (Nmax, or max_blocks * block_size) and every page a sequence uses is in
    [0, num_blocks). On a GPU a length past the capacity is clamped to it (never read out of
    bounds); a bad page index is the caller's error, as in the FlashAttention library.
    """
    _check_qkv(q, k_cache, v_cache, (4, 4, 4), names=("q", "k_cache", "v_cache"))
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    B, Nq, H, d = q.shape
    n0, n1, Hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache's head dimension is {dk}, q's is {d}")
    _check_head_dim(d, any_d=True)
    if B == 0 or Nq == 0 or H == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads")

    if block_table is None:
        if n0 != B:
            raise ValueError(f"a contiguous cache must be [B, Nmax, Hkv, d] with B = {B}, got {tuple(k_cache.shape)}"
                             " (for a paged cache pass block_table)")
        page, capacity, max_blocks, stride_kb = 0, n1, 0, n1 * Hkv * d
    else:
        _check_index_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must be [B, max_blocks] with B = {B}, got {tuple(block_table.shape)}")
        page = n1
        if page < 16 or page & (page - 1):
            raise ValueError(f"block_size (k_cache.shape[1]) must be a power of two >= 16, got {page}")
        max_blocks = block_table.shape[1]
        capacity, stride_kb = max_blocks * page, page * Hkv * d

    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    _check_index_tensor("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens must be [B] = [{B}], got {tuple(cache_seqlens.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    window_size = _check_window(window_size)
    softcap = _check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = _check_alibi_slopes(alibi_slopes, B, H, q.device)

    if q.device.type == "cpu":  # free here: no device to wait for
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > capacity:
            b = int(torch.argmax(cache_seqlens) if hi > capacity else torch.argmin(cache_seqlens))
            where = "Nmax" if block_table is None else "max_blocks * block_size"
            raise ValueError(f"cache_seqlens[{b}] = {int(cache_seqlens[b])} is outside [0, {capacity}] "
                             f"(capacity = {where})")
        if block_table is not None:
            used = torch.arange(max_blocks)[None, :] < ((cache_seqlens + page - 1) // page)[:, None]  # [B, max_blocks]
            pages = block_table[used]
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= n0):
                bad = ((block_table < 0) | (block_table >= n0)) & used
                b, j = (int(t) for t in bad.nonzero()[0])
                raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache "
                                 f"(num_blocks = {n0})")

    o = torch.empty_like(q)  # [B, Nq, H, d]
    if capacity == 0:  # nothing cached anywhere: every row sees no key
        return o.zero_()
    return _decode_launch(q, k_cache, v_cache, o, cache_seqlens, block_table, B=B, Hkv=Hkv, group=H // Hkv,
                          nq=Nq, d=d, Nk=capacity, stride_kb=stride_kb, max_blocks=max_blocks, head_major=False,
                          page=page, causal=causal, num_splits=num_splits, sm_scale=sm_scale, config=config,
                          window=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
