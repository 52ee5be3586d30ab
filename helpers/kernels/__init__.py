"""The course's GPU kernels, one module per kernel family (Triton; all but the Gluon one run under Triton's
interpreter without a GPU).

* ``forward``: ``flash_attn_triton`` — the FlashAttention-2 forward, dense, GQA, both causal alignments, the library's
  window, softcap, ALiBi and dropout, any head dim to 256 (lesson 07).
* ``decode``: ``flash_decode_triton`` — Flash-Decoding, split-KV with the merge in the same launch (lessons 07, 10).
* ``backward``: ``flash_attention`` (autograd) and ``flash_attn_bwd_triton`` — the FlashAttention-2 backward
  (lesson 08).
* ``varlen``: ``flash_attn_varlen_triton``, ``prepare_varlen`` (a packed batch checked once and shared by every
  layer: no host sync in the passes) and lesson 10's grid map ``varlen_block_map`` — packed variable-length
  sequences, the library's ``cu_seqlens`` layout (lesson 10; packed documents in pre-training, lesson 08).
* ``varlen_backward``: ``flash_attention_varlen`` (autograd, the library's ``flash_attn_varlen_func``) and
  ``flash_attn_varlen_bwd_triton`` — the backward over the packed layout, GQA included.
* ``kvcache``: ``flash_attn_with_kvcache_triton`` — a contiguous or paged KV cache (lesson 10).
* ``interface``: the FlashAttention library's public functions (``flash_attn_func``, its kvpacked and qkvpacked
  forms, ``flash_attn_varlen_func`` and its packed forms, ``flash_attn_with_kvcache``) with its names, argument
  order, defaults, layouts and returns, over the kernels above: a drop-in for ``flash_attn``.
* ``gluon_forward``: ``gluon_forward`` — lesson 11's forward in Gluon for Hopper (sm_90 only: TMA, mbarriers,
  ``warpgroup_mma``), non-causal; variants with one partition, a producer warp, and two consumer warpgroups with
  FA3's intra-warpgroup overlap and ping-pong. No interpreter: compile-only without an H100/H200.
* ``gluon_backward``: ``gluon_backward`` — the backward in Gluon for Hopper (a dK/dV kernel over TMA-fed query tiles,
  dQ in its own kernel or by the TMA's fp32 reduce-add), GQA, both causal alignments. Compile-only without an
  H100/H200; not yet run natively.
* ``common``: what they share: ``LOG2E``/``LN2``, the input checks, the tile configurations and what fits a GPU.

Import from the family's module (``from helpers.kernels.forward import flash_attn_triton``); this file imports
nothing, so importing one family compiles nothing of the others. Lessons' teaching kernels live with their
lessons (``helpers/lesson08/dkdv.py``).
"""
