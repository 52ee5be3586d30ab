"""The FlashAttention library's interface over the course's kernels (helpers/kernels/interface.py), tested in the
library's spirit.

* Signatures: every function has the library's argument names, order and defaults (``LIBRARY``, read from
  flash_attn/flash_attn_interface.py of Dao-AILab/flash-attention at commit 0251105; tests/test_lesson06_facts.py
  holds the same names).
* A library-style grid of our own (``grid()``): the six attention forms (dense, kvpacked, qkvpacked, and their
  varlen forms), head dims that are not multiples of 8, N != Nk both ways, ragged packed lengths, MHA/MQA/GQA,
  causal, windows drawn at random, ALiBi [B, H], softcap, both together, dropout; seeded. The library's error rule
  on each case: the output's max error against a float64 reference at most twice that of a PyTorch reference
  computed in the input dtype (with its operations reordered, as the library's ``attention_ref(upcast=False,
  reorder_ops=True)``), every gradient's at most three times; the lse against float64. With dropout, the mask is
  read back from S_dmask's signs (the library's way), both references use it, and it is the kernels' own mask
  (``dropout_keep_mask``; packed, sequence b's mask is the dense one of batch entry b). The varlen forms' paged K/V
  (``block_table``) is forward only, as the library's: those cases check the output alone. What the course does not
  take is refused with a message the case names (``refusal``: nothing in the grid, now). Under the interpreter: a
  small grid in fp16 (fp16 is the library's dtype; the interpreter's dots accumulate in fp32 as a GPU's); natively
  in ``make check-gpu``: a larger one in fp16 and bf16.
* Dropout statistically: the kept fraction, per stripe of rows and columns, reproducibility under
  ``torch.manual_seed`` and the (seed, offset) that name a mask.
* The KV cache: new keys and values appended in place, rotary embeddings (interleaved and not), a paged cache and
  ``cache_batch_idx``, against a torch reference.
* What is refused, and bad arguments.
"""
from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass

import pytest
import torch

from kernel_env import DEVICE, ON_GPU  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers.kernels import interface as fa  # noqa: E402
from helpers.kernels.common import draw_rng_state  # noqa: E402
from helpers.kernels.forward import dropout_keep_mask, flash_attn_triton  # noqa: E402

_ = inspect.Parameter.empty
# The library's public functions: (argument, default) in order, from flash_attn/flash_attn_interface.py (0251105).
LIBRARY = {
    "flash_attn_func": [("q", _), ("k", _), ("v", _), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
                        ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
                        ("return_attn_probs", False)],
    "flash_attn_kvpacked_func": [("q", _), ("kv", _), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
                                 ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                                 ("deterministic", False), ("return_attn_probs", False)],
    "flash_attn_qkvpacked_func": [("qkv", _), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
                                  ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                                  ("deterministic", False), ("return_attn_probs", False)],
    "flash_attn_varlen_func": [("q", _), ("k", _), ("v", _), ("cu_seqlens_q", _), ("cu_seqlens_k", _),
                               ("max_seqlen_q", _), ("max_seqlen_k", _), ("dropout_p", 0.0), ("softmax_scale", None),
                               ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                               ("deterministic", False), ("return_attn_probs", False), ("block_table", None)],
    "flash_attn_varlen_kvpacked_func": [("q", _), ("kv", _), ("cu_seqlens_q", _), ("cu_seqlens_k", _),
                                        ("max_seqlen_q", _), ("max_seqlen_k", _), ("dropout_p", 0.0),
                                        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                        ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
                                        ("return_attn_probs", False)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _), ("cu_seqlens", _), ("max_seqlen", _), ("dropout_p", 0.0),
                                         ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                         ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
                                         ("return_attn_probs", False)],
    "flash_attn_with_kvcache": [("q", _), ("k_cache", _), ("v_cache", _), ("k", None), ("v", None),
                                ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}


# ------------------------------------------------------------------ signatures
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_signature_is_the_librarys(name):
    params = list(inspect.signature(getattr(fa, name)).parameters.values())
    assert [(p.name, p.default) for p in params] == LIBRARY[name]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params), "every argument positional or keyword, as there"
    assert name in fa.__all__


def test_signatures_agree_with_lesson06s_record():
    from test_lesson06_facts import LIBRARY_PACKED_SIGNATURES, LIBRARY_SIGNATURES
    recorded = {**LIBRARY_SIGNATURES, **LIBRARY_PACKED_SIGNATURES}
    assert sorted(recorded) == sorted(LIBRARY)
    for name, args in recorded.items():
        assert [a for a, _ in LIBRARY[name]] == args, name


# ------------------------------------------------------------------ references (the library's attention_ref)
def attention_ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, keep=None, dropout_p=0.0,
                  upcast=True, reorder=False, scale=None):
    """q [B, N, H, d], k, v [B, Nk, Hkv, d] -> (out [B, N, H, d] in q's dtype, lse [B, H, N]). upcast: in float64
    (the library's reference upcasts to fp32; float64 here); else in the input dtype, with the scale applied to k
    instead of q (reorder: the library's estimate of a PyTorch implementation's error). Causal and the window
    bottom-right; softcap on the scaled score, then the ALiBi bias -slope * |i + Nk - N - j|; rows that see no key
    give 0; keep [B, H, N, Nk]: the dropout mask, kept entries scaled by 1 / (1 - dropout_p)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    B, N, H, d = q.shape
    Nk, g = k.shape[1], H // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)  # [B, Nk, H, d]
    if reorder:
        s = torch.einsum("bthd,bshd->bhts", q, k * scale)  # [B, H, N, Nk]
    else:
        s = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(N, device=q.device)[:, None]
    j = torch.arange(Nk, device=q.device)[None, :]
    left, right = window[0], 0 if causal else window[1]
    seen = torch.ones(N, Nk, dtype=torch.bool, device=q.device)
    if right >= 0:
        seen &= j <= i + Nk - N + right
    if left >= 0:
        seen &= j >= i + Nk - N - left
    s = s.masked_fill(~seen, float("-inf"))
    if slopes is not None:
        s = s - (slopes.to(s.dtype).expand(B, H)[:, :, None, None] * (i + Nk - N - j).abs().to(s.dtype))
    lse = torch.logsumexp(s.double(), -1)  # [B, H, N]
    p = torch.softmax(s, -1).nan_to_num(0.0).masked_fill(~seen.any(1)[:, None], 0.0)  # [B, H, N, Nk]
    if keep is not None:
        p = p.masked_fill(~keep, 0.0)
    out = torch.einsum("bhts,bshd->bthd", p.to(v.dtype), v * (1.0 / (1.0 - dropout_p)))
    return out.to(dtype), lse


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------ the grid
KINDS = ("func", "kvpacked", "qkvpacked", "varlen", "varlen_kvpacked", "varlen_qkvpacked")


@dataclass(frozen=True)
class Case:
    kind: str
    dtype: str  # "fp16" or "bf16"
    d: int
    lens_q: tuple  # per sequence (dense: B copies of N)
    lens_k: tuple
    H: int
    Hkv: int
    causal: bool
    window: tuple
    alibi: bool
    softcap: float
    dropout: float
    deterministic: bool
    paged: int = 0  # varlen with block_table: K/V in pages of this many rows (0: packed)

    @property
    def id(self):
        mods = "".join([" causal" * self.causal, f" window{self.window}" * (self.window != (-1, -1)),
                        " alibi" * self.alibi, f" softcap{self.softcap:g}" * (self.softcap > 0),
                        f" dropout{self.dropout:g}" * (self.dropout > 0), f" paged{self.paged}" * bool(self.paged)])
        lens = f"N={self.lens_q[0]} Nk={self.lens_k[0]}" if "varlen" not in self.kind else \
            f"lens={list(self.lens_q)}/{list(self.lens_k)}"
        return f"{self.kind} {self.dtype} d={self.d} {lens} H={self.H}/{self.Hkv}{mods}"


def refusal(case):
    """The message the interface refuses this case with, or None: what the course's kernels do not take yet
    (nothing, now: every case of the grid runs)."""
    return None


# (causal, local, alibi, softcap, dropout): the option sets each form is tried with under the interpreter, a covering
# design: in every form each option on and off, ALiBi with softcap and without; over the grid every pair of options
# in all four combinations (causal with a window aside: causal sets the window's right edge); dropout, the costly
# option under the interpreter (a Philox draw per tile), once per form (test_grid_covers_the_options holds all this)
_T, _F = True, False
FEATURES = {"func": [(_T, _F, _T, _F, _F), (_F, _T, _T, _T, _F), (_F, _F, _F, _F, _T)],
            "kvpacked": [(_T, _F, _T, _F, _F), (_F, _T, _F, _T, _F), (_T, _F, _T, _T, _T)],
            "qkvpacked": [(_T, _F, _T, _F, _F), (_F, _T, _T, _T, _F), (_F, _T, _F, _F, _T)],
            "varlen": [(_T, _F, _T, _F, _F), (_F, _T, _T, _T, _F), (_T, _F, _F, _T, _T)],
            "varlen_kvpacked": [(_T, _F, _T, _F, _F), (_F, _T, _F, _T, _F), (_F, _T, _T, _T, _T)],
            "varlen_qkvpacked": [(_T, _F, _T, _F, _F), (_F, _T, _T, _T, _F), (_F, _F, _F, _F, _T)]}


def grid(native=ON_GPU, seed=0):
    """The seeded grid. Under the interpreter: every form with its option sets of FEATURES, the rest (d, lengths,
    heads, window) drawn, the first of each form at a head dim that is no multiple of 8, and 4 query heads where
    they are grouped (GQA 4/2), 2 otherwise; natively: a seeded sample of the whole product (the library's head dims
    and lengths)."""
    rng = random.Random(seed)
    if native:
        dims = (32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
        pairs = [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
                 (1023, 1024), (1024, 1023)]
        dtypes, max_len = ("fp16", "bf16"), 300
        options = [(c, lo, a, s, p) for c in (False, True) for lo in (False, True) for a in (False, True)
                   for s in (False, True) for p in (False, True)]
        plan = [(kind, rng.choice(options)) for kind in KINDS for _ in range(20)]
    else:
        dims = (5, 16, 40, 59, 64, 111)
        pairs = [(1, 23), (17, 31), (31, 17), (24, 24), (33, 20), (8, 40)]
        dtypes, max_len = ("fp16",), 40
        plan = [(kind, f) for kind in KINDS for f in FEATURES[kind]]
    cases = []
    for i, (kind, (causal, local, alibi, softcap, dropout)) in enumerate(plan):
        first = not native and (i == 0 or plan[i - 1][0] != kind)
        d = rng.choice([x for x in dims if x % 8] if first else dims)
        mha = rng.choice(("mha", "mqa", "gqa")) if "qkvpacked" not in kind else "mha"
        H = 6 if native else 4 if mha == "gqa" else 2
        Hkv = {"mha": H, "mqa": 1, "gqa": H // 2 if native else 2}[mha]
        if "varlen" in kind:
            B = rng.choice((2, 3))
            lens_q = tuple(1 if rng.random() < 0.2 else rng.randint(2, max_len) for _ in range(B))
            lens_k = lens_q if "qkvpacked" in kind or rng.random() < 0.3 else \
                tuple(rng.randint(1, max_len) for _ in range(B))
        else:
            B = 2
            N, Nk = rng.choice(pairs)
            if kind == "qkvpacked":
                Nk = N = max(N, Nk)
            lens_q, lens_k = (N,) * B, (Nk,) * B
        window = (rng.randint(0, max(lens_k)), rng.randint(0, max(lens_k))) if local else (-1, -1)
        cases.append(Case(kind, rng.choice(dtypes), d, lens_q, lens_k, H, Hkv, causal, window, alibi,
                          rng.choice((5.0, 30.0)) if softcap else 0.0, 0.17 if dropout else 0.0,
                          rng.random() < 0.5))
    # paged K/V (flash_attn_varlen_func's block_table, forward only): pages of 8 rows, and of 12 (the library asks
    # for multiples of 256; the kernel's lookup is per key, any size works), shuffled; with the score mods, dropout
    cases += [Case("varlen", "fp16", 64, (17, 5), (30, 9), 4, 2, True, (-1, -1), False, 0.0, 0.0, False, paged=8),
              Case("varlen", "fp16", 59, (3, 20), (40, 13), 4, 1, False, (7, 2), True, 5.0, 0.17, False, paged=12)]
    return cases


CASES = grid()


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _make(case, seed):
    """The case's inputs in the library's layout (leaves that require grad) and how to call it: returns (call, leaves,
    refs) where call() runs the interface with return_attn_probs=True, leaves are the tensors the gradients are of,
    and refs(leaves, **ref_kw) computes the reference output with the same packing (autograd through it)."""
    g = torch.Generator().manual_seed(seed)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    B, H, Hkv, d = len(case.lens_q), case.H, case.Hkv, case.d
    rand = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    slopes = (torch.rand(B, H, generator=g) * 0.3).to(DEVICE) if case.alibi else None
    kw = dict(dropout_p=case.dropout, causal=case.causal, window_size=case.window, softcap=case.softcap,
              alibi_slopes=slopes, deterministic=case.deterministic, return_attn_probs=True)
    ref_kw = dict(causal=case.causal, window=case.window, softcap=case.softcap)
    if "varlen" not in case.kind:
        N, Nk = case.lens_q[0], case.lens_k[0]
        if case.kind == "qkvpacked":
            qkv = rand(B, N, 3, H, d).requires_grad_()
            return (lambda: fa.flash_attn_qkvpacked_func(qkv, **kw)), [qkv], \
                lambda ls, **r: attention_ref(*ls[0].unbind(2), slopes=slopes, **ref_kw, **r), slopes
        q = rand(B, N, H, d).requires_grad_()
        if case.kind == "kvpacked":
            kv = rand(B, Nk, 2, Hkv, d).requires_grad_()
            return (lambda: fa.flash_attn_kvpacked_func(q, kv, **kw)), [q, kv], \
                lambda ls, **r: attention_ref(ls[0], *ls[1].unbind(2), slopes=slopes, **ref_kw, **r), slopes
        k, v = rand(B, Nk, Hkv, d).requires_grad_(), rand(B, Nk, Hkv, d).requires_grad_()
        return (lambda: fa.flash_attn_func(q, k, v, **kw)), [q, k, v], \
            lambda ls, **r: attention_ref(*ls, slopes=slopes, **ref_kw, **r), slopes
    cu_q, cu_k = _cu(case.lens_q), _cu(case.lens_k)
    mq, mk = max(case.lens_q), max(case.lens_k)
    tq, tk = sum(case.lens_q), sum(case.lens_k)

    def per_sequence(q, k, v, **r):  # the dense reference on each sequence, packed again
        outs, lses = [], []
        for b in range(B):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            keep = r.get("keep")
            rb = r if keep is None else dict(r, keep=keep[b:b + 1, :, :case.lens_q[b], :case.lens_k[b]])
            o, lse = attention_ref(q[qs][None], k[ks][None], v[ks][None], slopes=None if slopes is None
                                   else slopes[b:b + 1], **ref_kw, **rb)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, 1)  # [total_q, H, d], [H, total_q]

    if case.kind == "varlen_qkvpacked":
        qkv = rand(tq, 3, H, d).requires_grad_()
        return (lambda: fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q, mq, **kw)), [qkv], \
            lambda ls, **r: per_sequence(*ls[0].unbind(1), **r), slopes
    q = rand(tq, H, d).requires_grad_()
    if case.kind == "varlen_kvpacked":
        kv = rand(tk, 2, Hkv, d).requires_grad_()
        return (lambda: fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, **kw)), [q, kv], \
            lambda ls, **r: per_sequence(ls[0], *ls[1].unbind(1), **r), slopes
    k, v = rand(tk, Hkv, d).requires_grad_(), rand(tk, Hkv, d).requires_grad_()
    if case.paged:  # the packed keys' pages, shuffled, and a spare page of NaN no table names
        page = case.paged
        counts = [-(-n // page) for n in case.lens_k]  # pages per sequence
        order = torch.randperm(sum(counts) + 1, generator=g).tolist()
        table = torch.zeros(B, max(counts), dtype=torch.int32)
        pages = [torch.full((sum(counts) + 1, page, Hkv, d), float("nan"), dtype=dtype, device=DEVICE)
                 for _ in range(2)]
        used = 0
        for b, n in enumerate(case.lens_k):
            for j in range(counts[b]):
                rows = slice(int(cu_k[b]) + j * page, int(cu_k[b]) + min((j + 1) * page, n))
                table[b, j] = order[used]
                for dst, src in zip(pages, (k, v)):
                    dst[order[used], :rows.stop - rows.start] = src.detach()[rows]
                used += 1
        table = table.to(DEVICE)
        return (lambda: fa.flash_attn_varlen_func(q, *pages, cu_q, cu_k, mq, mk, **kw, block_table=table)), \
            [q, k, v], lambda ls, **r: per_sequence(*ls, **r), slopes
    return (lambda: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)), [q, k, v], \
        lambda ls, **r: per_sequence(*ls, **r), slopes


def _floor(ref, dtype):
    """The rule's one addition to the library's: one unit in the last place of the dtype at the reference's largest
    magnitude. At the small sizes of the interpreter's grid PyTorch's own error is a single rounding of the output
    (half an ulp, or 0 where rows see one key: P = 1), and without it the rule would be decided by which side of a
    rounding the largest entry fell on; at the library's sizes its errors are many ulps and this changes nothing."""
    return torch.finfo(dtype).eps * ref.abs().max().item()


def _dropout_mask(case, S_dmask):
    """The keep mask from S_dmask's signs (the library's test reads it so): [B, H, N, Nk] bool."""
    return S_dmask >= 0


def run_case(case, seed=0):
    call, leaves, ref, slopes = _make(case, seed)
    why = refusal(case)
    if why is not None:
        with pytest.raises(NotImplementedError, match=why.replace("(", r"\(").replace(")", r"\)")):
            call()
        return
    out, lse, S_dmask = call()
    keep = None
    if case.dropout > 0:
        # dense [B, H, N, Nk]; varlen [B, H, max_seqlen_q, max_seqlen_k], sequence b in its top-left corner
        assert S_dmask is not None and S_dmask.shape == (len(case.lens_q), case.H, max(case.lens_q), max(case.lens_k))
        keep = _dropout_mask(case, S_dmask)
    else:
        assert S_dmask is None
    r = dict(keep=keep, dropout_p=case.dropout)
    out_ref, lse_ref = ref(leaves, **r)
    out_pt, _ = ref(leaves, upcast=False, reorder=True, **r)
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype and out.is_contiguous()
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), ~seen), f"{case.id}: rows that see no key: lse = -inf exactly"
    assert _err(lse[seen], lse_ref[seen]) < 2e-2, f"{case.id}: lse"
    e, e_pt = _err(out, out_ref), _err(out_pt, out_ref)
    assert e <= 2 * e_pt + _floor(out_ref, out.dtype), f"{case.id}: output error {e:.3g} > 2 x PyTorch's {e_pt:.3g}"
    if keep is not None:
        assert S_dmask.dtype == out.dtype
    if case.paged:  # forward only, as the library's paged varlen
        assert not out.requires_grad
        return
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grads = torch.autograd.grad(out, leaves, gout)
    grads_ref = torch.autograd.grad(out_ref, leaves, gout)
    grads_pt = torch.autograd.grad(out_pt, leaves, gout)
    for i, (gk, gr, gp) in enumerate(zip(grads, grads_ref, grads_pt)):
        e, e_pt = _err(gk, gr), _err(gp, gr)
        assert gk.shape == leaves[i].shape
        assert e <= 3 * e_pt + _floor(gr, gk.dtype), f"{case.id}: gradient {i} error {e:.3g} > 3 x PyTorch's {e_pt:.3g}"


@pytest.fixture
def pinned_tiles(monkeypatch):
    """Natively, the grid's launches in the first configuration each launcher keeps for the GPU, not autotuned:
    every case is a new shape class (head dim, masks, score mod, dropout), and timing every candidate of each would
    take the grid many minutes of compiling. (The autotuned path runs in the other tests here.) Under the
    interpreter the launchers have one fixed configuration anyway."""
    if not ON_GPU:
        return
    from helpers.kernels import common as kc
    from helpers.kernels.varlen import SHAPES, candidates
    from helpers.kernels.varlen_backward import varlen_bwd_configs

    def fits(kind, q):
        cap, smem = kc._device_limits(q.device)
        return kc.launch_configs(kind, q.shape[-1], q.dtype, cap, smem)[0]
    fwd, bwd = fa._flash_fwd, fa._flash_bwd
    vfwd, vbwd = fa.flash_attn_varlen_triton, fa.flash_attn_varlen_bwd_triton
    monkeypatch.setattr(fa, "_flash_fwd", lambda q, *a, **kw: fwd(q, *a, config=fits("fwd", q), **kw))
    monkeypatch.setattr(fa, "_flash_bwd", lambda do, q, *a, **kw: bwd(do, q, *a, **kw, config=dict(
        dkdv=fits("dkdv", q), dq=fits("dq", q))))
    monkeypatch.setattr(fa, "flash_attn_varlen_triton", lambda q, *a, **kw: vfwd(q, *a, **kw, config=candidates(
        "varlen", SHAPES["varlen"](q.shape[-1]), q.shape[-1], q.dtype, q.device)[0]))
    monkeypatch.setattr(fa, "flash_attn_varlen_bwd_triton", lambda do, q, *a, **kw: vbwd(do, q, *a, **kw, config=dict(
        zip(("dkdv", "dq"), (c[0] for c in varlen_bwd_configs(q.shape[-1], q))))))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_library_rule_on_the_grid(case, pinned_tiles):
    run_case(case, seed=CASES.index(case))


@pytest.mark.parametrize("native", [False, True], ids=["interpreter", "native"])
def test_grid_covers_the_options(native):
    """Both grids: every form meets every option, and the head dims that are not multiples of 8, N > Nk and
    N < Nk, MQA and GQA."""
    cases = grid(native)
    for kind in KINDS:
        mine = [c for c in cases if c.kind == kind]
        assert any(c.d % 8 for c in mine), kind
        assert any(c.causal for c in mine) and any(c.window != (-1, -1) for c in mine), kind
        assert any(c.alibi and c.softcap for c in mine) and any(c.dropout for c in mine), kind
        assert any(c.alibi and not c.softcap and refusal(c) is None for c in mine), kind
    dense = [c for c in cases if "varlen" not in c.kind]
    assert any(c.lens_q[0] > c.lens_k[0] for c in dense) and any(c.lens_q[0] < c.lens_k[0] for c in dense)
    assert {c.Hkv == 1 for c in cases} == {True, False} and any(1 < c.Hkv < c.H for c in cases)
    assert any(c.paged for c in cases)

    def blind(c):  # a row that sees no key: bottom-right, row i sees keys j <= i + Nk - N + right (right >= 0)
        right = 0 if c.causal else c.window[1]
        return any(n and (not nk or right >= 0 and n - nk - right > 0) for n, nk in zip(c.lens_q, c.lens_k))
    assert any(blind(c) for c in dense) and any(blind(c) for c in cases if "varlen" in c.kind)
    if native:
        return
    # the interpreter's covering design: in every form each option both on and off; every pair of options in all
    # four combinations over the grid (but causal with a window)
    opts = lambda c: (c.causal, c.window != (-1, -1), c.alibi, c.softcap > 0, c.dropout > 0)  # noqa: E731
    for kind in KINDS:
        assert all({opts(c)[i] for c in cases if c.kind == kind} == {True, False} for i in range(5)), kind
    for i in range(5):
        for j in range(i + 1, 5):
            want = 3 if (i, j) == (0, 1) else 4
            assert len({(opts(c)[i], opts(c)[j]) for c in cases}) == want, (i, j)


def grid_counts(cases=None):
    """(cases, run against the references, {refusal message: cases}) of the grid: the closing note's counts."""
    cases = CASES if cases is None else cases
    refused = {}
    for c in cases:
        why = refusal(c)
        if why:
            refused[why] = refused.get(why, 0) + 1
    return len(cases), len(cases) - sum(refused.values()), refused


# ------------------------------------------------------------------ dropout
def test_dropout_mask_statistics():
    """The kept fraction of a large mask is 1 - p within 4 standard deviations, in the whole mask and in each of 16
    stripes of rows and of columns (a counter that ignored the row or the column would show); the mask is a
    function of (seed, offset) alone: the same pair gives the same mask, another seed or offset another one."""
    B, H, N, Nk, p = 1, 2, 128, 128, 0.17
    keep = dropout_keep_mask(B, H, N, Nk, p, (1234, 0), DEVICE).cpu()
    n = keep.numel()
    frac = keep.float().mean().item()
    assert abs(frac - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n), frac
    for dim in (2, 3):
        stripes = keep.float().unflatten(dim, (16, -1)).movedim(dim, 0).reshape(16, -1).mean(1)  # [16]
        m = n // 16
        assert (stripes - (1 - p)).abs().max() < 4.5 * math.sqrt(p * (1 - p) / m), stripes
    assert torch.equal(keep, dropout_keep_mask(B, H, N, Nk, p, (1234, 0), DEVICE).cpu())
    other = dropout_keep_mask(B, H, N, Nk, p, (1235, 0), DEVICE).cpu()
    shifted = dropout_keep_mask(B, H, N, Nk, p, (1234, 1), DEVICE).cpu()
    for m in (other, shifted):
        agree = (m == keep).float().mean().item()  # independent masks agree on p^2 + (1-p)^2 of the entries
        assert abs(agree - (p * p + (1 - p) ** 2)) < 0.01
    assert not torch.equal(keep[0, 0], keep[0, 1]), "each head its own mask"
    assert not torch.equal(keep[0, 0], keep[0, 0].T), "the row and the column are different counters"
    assert torch.equal(dropout_keep_mask(B, H, 40, Nk, p, (1234, 0), DEVICE, row0=70).cpu(), keep[:, :, 70:110])


def test_dropout_keep_fraction_on_visible_entries():
    """The library's own check on a call: the fraction of visible entries of P kept, read from S_dmask's signs, is
    1 - p within 0.01 (0.025 with a window in the library: here with causal, over enough entries: 33 024 under the
    interpreter, where 0.01 is 4.8 standard deviations)."""
    B, N, H, d, p = 1 if not ON_GPU else 2, 128 if not ON_GPU else 512, 4, 16, 0.17
    g = torch.Generator().manual_seed(3)
    dtype = torch.float16
    q, k, v = (torch.randn(B, N, H, d, generator=g).to(DEVICE, dtype) for _ in range(3))
    out, lse, S = fa.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    seen = torch.arange(N)[None, :] <= torch.arange(N)[:, None]
    probs = S.float().abs().cpu()[:, :, seen]
    nonzero = probs > 0  # an entry of P that is 0 has no sign to read
    frac = (S.float().cpu()[:, :, seen] >= 0)[nonzero].float().mean().item()
    assert abs(frac - (1 - p)) <= 0.01


def test_dropout_is_reproducible_under_manual_seed():
    B, N, H, d = 1, 33, 2, 16
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, N, H, d, generator=g).to(DEVICE, torch.float16).requires_grad_() for _ in range(3))
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        o = fa.flash_attn_func(q, k, v, 0.3, causal=True)
        outs.append((o.detach(), torch.autograd.grad(o, (q, k, v), torch.ones_like(o)) if seed == 5 else None))
    assert torch.equal(outs[0][0], outs[1][0]) and all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    assert not torch.equal(outs[0][0], outs[2][0])
    torch.manual_seed(5)
    state = draw_rng_state()  # what the call drew: the rng_state flash_attn_triton takes
    o2, _ = flash_attn_triton(*(t.detach().transpose(1, 2) for t in (q, k, v)), True, align="bottom_right",
                              dropout_p=0.3, rng_state=state)
    assert torch.equal(o2.transpose(1, 2), outs[0][0])
    torch.manual_seed(5)
    _, _, S = fa.flash_attn_func(q, k, v, 0.3, causal=True, return_attn_probs=True)
    keep = dropout_keep_mask(B, H, N, N, 0.3, state, DEVICE)  # the mask S_dmask's signs encode is the kernels' own
    nonzero = S != 0
    assert nonzero.sum() > N * N and torch.equal((S >= 0)[nonzero], keep[nonzero])


def test_dropout_with_every_score_mod_against_the_kernels_own_mask():
    """The reference built from dropout_keep_mask (the rng_state passed explicitly), through the course's
    flash_attention: softcap with ALiBi, a window, GQA, an odd head dim; forward and gradients in float64."""
    from helpers.kernels.backward import flash_attention
    B, H, Hkv, N, Nk, d, p = 2, 4, 2, 29, 37, 59, 0.25
    g = torch.Generator().manual_seed(8)
    q = torch.randn(B, N, H, d, generator=g).to(DEVICE, torch.float32)
    k, v = (torch.randn(B, Nk, Hkv, d, generator=g).to(DEVICE, torch.float32) for _ in range(2))
    slopes = torch.rand(B, H, generator=g).to(DEVICE)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mods = dict(window_size=(9, 3), softcap=8.0, alibi_slopes=slopes)
    o = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False, align="bottom_right",
                        dropout_p=p, rng_state=(77, 5), **mods)
    keep = dropout_keep_mask(B, H, N, Nk, p, (77, 5), DEVICE)
    o_ref, _ = attention_ref(q, k, v, window=(9, 3), softcap=8.0, slopes=slopes, keep=keep, dropout_p=p)
    tol = 1e-2 if ON_GPU else 1e-4   # natively float32's dots run on TF32 tensor cores (10-bit mantissa)
    assert _err(o.transpose(1, 2), o_ref) < tol                     # a wrong mask is off by O(0.1) or more
    gout = torch.randn_like(o_ref)
    got = torch.autograd.grad(o.transpose(1, 2), (q, k, v), gout)
    want = torch.autograd.grad(o_ref, (q, k, v), gout)
    for a, b in zip(got, want):
        assert _err(a, b) < tol * max(1.0, b.abs().max().item())


# ------------------------------------------------------------------ layouts: nothing copied
def test_dense_forms_read_their_inputs_in_place(monkeypatch):
    """flash_attn_func and the packed forms hand the kernels views of their inputs (no .contiguous() copy), the
    output is a contiguous [B, N, H, d], and dqkv / dkv are single packed tensors."""
    import helpers.kernels.interface as mod
    seen = []
    real = mod._flash_fwd

    def spy(q, k, v, *a, **kw):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr()))
        return real(q, k, v, *a, **kw)
    monkeypatch.setattr(mod, "_flash_fwd", spy)
    B, N, H, d = 1, 20, 2, 16
    qkv = torch.randn(B, N, 3, H, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    elt = qkv.element_size()
    assert seen[-1] == (qkv.data_ptr(), qkv.data_ptr() + H * d * elt, qkv.data_ptr() + 2 * H * d * elt)
    assert out.shape == (B, N, H, d) and out.is_contiguous()
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape
    q = torch.randn(B, N, H, d, device=DEVICE, dtype=torch.float16)
    kv = torch.randn(B, N, 2, 1, d, device=DEVICE, dtype=torch.float16)
    fa.flash_attn_kvpacked_func(q, kv)
    assert seen[-1] == (q.data_ptr(), kv.data_ptr(), kv.data_ptr() + d * elt)


def test_varlen_forms_read_their_inputs_in_place(monkeypatch):
    """The varlen forms hand the varlen kernels views of the packed qkv and kv (no .contiguous() copy, no padding
    of an odd head dim), forward and backward; the gradient of qkv is one [total, 3, H, d] tensor."""
    import helpers.kernels.interface as mod
    seen = []
    fwd, bwd = mod.flash_attn_varlen_triton, mod.flash_attn_varlen_bwd_triton
    monkeypatch.setattr(mod, "flash_attn_varlen_triton", lambda q, k, v, *a, **kw: seen.append(
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape[-1])) or fwd(q, k, v, *a, **kw))
    monkeypatch.setattr(mod, "flash_attn_varlen_bwd_triton", lambda do, q, k, v, *a, **kw: seen.append(
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape[-1])) or bwd(do, q, k, v, *a, **kw))
    H, d = 2, 13
    cu = _cu([5, 9])
    qkv = torch.randn(14, 3, H, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 9, causal=True)
    out.float().sum().backward()
    elt = qkv.element_size()
    want = (qkv.data_ptr(), qkv.data_ptr() + H * d * elt, qkv.data_ptr() + 2 * H * d * elt, d)
    assert seen == [want, want] and out.shape == (14, H, d) and qkv.grad.shape == qkv.shape
    q = torch.randn(14, H, d, device=DEVICE, dtype=torch.float16)
    kv = torch.randn(14, 2, 1, d, device=DEVICE, dtype=torch.float16)
    fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 9, 9)
    assert seen[-1] == (q.data_ptr(), kv.data_ptr(), kv.data_ptr() + d * elt, d)


def test_varlen_batch_is_prepared_once_per_batch(monkeypatch):
    """The same cu_seqlens tensors in every layer: cu_seqlens goes to the host once; a changed tensor is read again."""
    import helpers.kernels.interface as mod
    calls = []
    real = mod.prepare_varlen
    monkeypatch.setattr(mod, "prepare_varlen", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    cu = _cu([5, 9])
    q, k, v = (torch.randn(14, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    assert len(calls) == 1
    cu[1:] = torch.tensor([7, 14], dtype=torch.int32)  # in place: a new batch
    fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert len(calls) == 2
    batch = fa.prepare_varlen(cu)
    o1 = fa.flash_attn_varlen_func(q, k, v, batch, None, None, None)
    o2 = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert torch.equal(o1, o2)


# ------------------------------------------------------------------ the KV cache
def _rotary_ref(x, cos, sin, pos, interleaved):
    """The library's apply_rotary_emb, written out in float64: x [B, N, H, d] at positions pos [B, N]."""
    rd = 2 * cos.shape[-1]
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]  # [B, N, 1, rd / 2]
    xr = x[..., :rd].double()
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        x2 = torch.stack([-xr[..., 1::2], xr[..., 0::2]], -1).flatten(-2)
    else:
        c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
        x2 = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return torch.cat([xr * c + x2 * s, x[..., rd:].double()], -1)


def _kvcache_ref(q, k_cache, v_cache, lens, causal, window=(-1, -1), softcap=0.0, slopes=None):
    """Sequence b: q[b] against its first lens[b] cached keys (the dense reference, bottom-right)."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        o, _ = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal, window, softcap,
                             None if slopes is None else slopes[b:b + 1])
        outs.append(o)
    return torch.cat(outs)


@pytest.mark.parametrize("paged, interleaved, causal", [(False, True, True), (True, False, False),
                                                        (True, True, True), (False, False, False)])
def test_kvcache_appends_rotates_and_attends(paged, interleaved, causal):
    B, Nq, H, Hkv, d, Nmax, rd = 2, 3, 4, 2, 40, 48, 16
    g = torch.Generator().manual_seed(11)
    dt = torch.float32 if not ON_GPU else torch.float16
    q = torch.randn(B, Nq, H, d, generator=g).to(DEVICE, dt)
    k_new, v_new = (torch.randn(B, Nq, Hkv, d, generator=g).to(DEVICE, dt) for _ in range(2))
    kc, vc = (torch.randn(B, Nmax, Hkv, d, generator=g).to(DEVICE, dt) for _ in range(2))
    lens = torch.tensor([7, 30], dtype=torch.int32, device=DEVICE)
    angle = torch.arange(Nmax, dtype=torch.float64)[:, None] * (1e-2 ** (torch.arange(rd // 2) / (rd // 2)))[None]
    cos, sin = angle.cos().to(DEVICE, dt), angle.sin().to(DEVICE, dt)
    pos_k = lens.long().cpu()[:, None] + torch.arange(Nq)[None]
    pos_q = pos_k if causal else lens.long().cpu()[:, None].expand(B, Nq)
    k_rot = _rotary_ref(k_new.cpu(), cos.cpu(), sin.cpu(), pos_k, interleaved)
    q_rot = _rotary_ref(q.cpu(), cos.cpu(), sin.cpu(), pos_q, interleaved)
    kc_want, vc_want = kc.cpu().double().clone(), vc.cpu().double().clone()
    for b in range(B):
        kc_want[b, int(lens[b]):int(lens[b]) + Nq] = k_rot[b]
        vc_want[b, int(lens[b]):int(lens[b]) + Nq] = v_new.cpu()[b].double()
    want = _kvcache_ref(q_rot, kc_want, vc_want, (lens + Nq).cpu(), causal)
    if paged:
        page = 16
        perm = torch.randperm(B * Nmax // page, generator=g)
        table = perm.view(B, Nmax // page).to(DEVICE, torch.int32)  # sequence b's pages, shuffled
        kp = torch.empty(B * Nmax // page, page, Hkv, d, device=DEVICE, dtype=dt)
        vp = torch.empty_like(kp)
        kp[table.long().flatten()] = kc.view(-1, page, Hkv, d)
        vp[table.long().flatten()] = vc.view(-1, page, Hkv, d)
        out = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cos, sin, lens, block_table=table, causal=causal,
                                         rotary_interleaved=interleaved)
        kc_got = kp[table.long().flatten()].view(B, Nmax, Hkv, d)
    else:
        out = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cos, sin, lens, causal=causal,
                                         rotary_interleaved=interleaved)
        kc_got = kc
    tol = 2e-3 if dt == torch.float32 else 2e-2
    assert _err(kc_got.cpu(), kc_want) < tol, "the new keys, rotated, written in place at cache_seqlens"
    assert _err(out.cpu(), want) < tol


def test_kvcache_batch_idx_odd_head_dim_and_mods():
    """cache_batch_idx over a contiguous cache (read as pages of it), d = 59, softcap with ALiBi, a window."""
    B, Nq, H, Hkv, d, Nmax = 2, 2, 4, 1, 59, 32
    g = torch.Generator().manual_seed(12)
    dt = torch.float32 if not ON_GPU else torch.float16
    q = torch.randn(B, Nq, H, d, generator=g).to(DEVICE, dt)
    kc, vc = (torch.randn(3, Nmax, Hkv, d, generator=g).to(DEVICE, dt) for _ in range(2))
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 31], dtype=torch.int32, device=DEVICE)
    slopes = torch.rand(B, H, generator=g).to(DEVICE)
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, causal=True,
                                     window_size=(5, 0), softcap=6.0, alibi_slopes=slopes)
    want = _kvcache_ref(q.cpu(), kc.cpu()[idx.long().cpu()], vc.cpu()[idx.long().cpu()], lens.cpu(), True, (5, 0),
                        6.0, slopes.cpu())
    assert _err(out.cpu(), want) < (2e-3 if dt == torch.float32 else 2e-2)
    full = fa.flash_attn_with_kvcache(q, kc[:2], vc[:2])  # cache_seqlens None: the whole cache
    assert _err(full.cpu(), _kvcache_ref(q.cpu(), kc.cpu()[:2], vc.cpu()[:2], [Nmax, Nmax], False)) < 2e-2


# ------------------------------------------------------------------ refused, and bad arguments
def test_refusals_name_what_is_missing():
    q = torch.randn(1, 4, 2, 16, device=DEVICE, dtype=torch.float16)
    kc = torch.randn(1, 16, 2, 16, device=DEVICE, dtype=torch.float16)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, cache_leftpad=lens)
    with pytest.raises(NotImplementedError, match="return_softmax_lse"):
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, return_softmax_lse=True)
    kc12 = torch.randn(2, 12, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="not a multiple of 16"):
        fa.flash_attn_with_kvcache(q, kc12, kc12, cache_seqlens=lens, cache_batch_idx=torch.tensor([1], device=DEVICE,
                                                                                                   dtype=torch.int32))
    with pytest.raises(ValueError, match="pass cache_seqlens with them"):
        fa.flash_attn_with_kvcache(q, kc, kc, q[:, :, :2], q[:, :, :2])


def test_bad_arguments():
    q = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    for kw, err, match in ((dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
                           (dict(dropout_p="0.1"), TypeError, "dropout_p must be a number"),
                           (dict(window_size=(2,)), TypeError, "window_size must be a pair"),
                           (dict(causal=1), TypeError, "causal must be True or False"),
                           (dict(deterministic=None), TypeError, "deterministic must be True or False"),
                           (dict(alibi_slopes=torch.rand(3, device=DEVICE)), ValueError, r"alibi_slopes must be \[H\]")):
        with pytest.raises(err, match=match):
            fa.flash_attn_func(q, q, q, **kw)
    with pytest.raises(ValueError, match=r"qkv must be \[B, N, 3, H, d\]"):
        fa.flash_attn_qkvpacked_func(q)
    with pytest.raises(ValueError, match=r"kv must be \[total_k, 2, Hkv, d\]"):
        fa.flash_attn_varlen_kvpacked_func(q[0], q[0], _cu([8]), _cu([8]), 8, 8)
    with pytest.raises(ValueError, match="head dimension d must be from 1 to 256"):
        x = torch.randn(1, 4, 1, 264, device=DEVICE, dtype=torch.float16)
        fa.flash_attn_func(x, x, x)
    with pytest.raises(TypeError, match="pass None for cu_seqlens_k"):
        fa.flash_attn_varlen_func(q[0], q[0], q[0], fa.prepare_varlen(_cu([8])), _cu([8]), 8, 8)
    pages = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)  # [num_blocks, page_block_size, Hkv, d]
    with pytest.raises(ValueError, match="block_table must have a row per sequence"):
        fa.flash_attn_varlen_func(q[0], pages, pages, _cu([8]), _cu([8]), 8, 8,
                                  block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="block_table's 1 pages of 8 hold 8"):
        fa.flash_attn_varlen_func(q[0], pages, pages, _cu([8]), _cu([9]), 8, 9,
                                  block_table=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE))
