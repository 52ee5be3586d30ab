"""Packed causal documents, the way LLMs are pre-trained: the prepared batch (helpers/kernels/varlen.py's
``prepare_varlen``), its program maps, and the forward and backward on it.

* The batch checks cu_seqlens once and keeps its own copies; its maps cover every block exactly once, heaviest
  first by the work the kernels do.
* With a batch, the forward and the backward read no value of cu_seqlens (or of the maps) on the host: every
  value-reading method of torch.Tensor is watched during the calls (Triton's interpreter, which runs the kernels
  on the CPU here, is allowed to read them: that is the kernel reading its arguments).
* Correctness against float64 per document, forward and gradients, on harsh mixes: empty documents, documents of
  length 1, one document longer than the rest together, lengths that are no multiple of the block, GQA and MQA,
  causal and not, and tiles other than the default.
* The tile choice (``tuned_launch``): the fastest candidate kept per key, nothing timed or kept during a capture.
* On a GPU only: a training step's attention (forward and backward over several layers) captured in a CUDA graph
  and replayed, equal to the eager step; and the eager step run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

import math
import sys
from types import SimpleNamespace

import pytest
import torch

from kernel_env import DEVICE, DTYPES, ON_GPU, TOL  # noqa: E402  (sets TRITON_INTERPRET first)
from helpers import reference  # noqa: E402
from helpers.kernels import varlen as kv  # noqa: E402
from helpers.kernels.varlen import VarlenBatch, flash_attn_varlen_triton, prepare_varlen  # noqa: E402
from helpers.kernels.varlen_backward import (flash_attention_varlen, flash_attn_varlen_bwd_triton,  # noqa: E402
                                             varlen_bwd_configs)


def _cu(lengths, device=DEVICE):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(device, torch.int32)  # [B + 1]


def _inputs(lens_q, lens_k, H, Hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sum(lens_q), H, d, generator=g) * 2).to(DEVICE, dtype)  # [total_q, H, d]
    k = (torch.randn(sum(lens_k), Hkv, d, generator=g) * 2).to(DEVICE, dtype)  # [total_k, Hkv, d]
    v = torch.randn(sum(lens_k), Hkv, d, generator=g).to(DEVICE, dtype)  # [total_k, Hkv, d]
    do = torch.randn(sum(lens_q), H, d, generator=g).to(DEVICE, dtype)  # [total_q, H, d]
    return q, k, v, do


def _reference(q, k, v, do, lens_q, lens_k, causal):
    """float64 O [total_q, H, d], lse [H, total_q] and (dq, dk, dv), sequence by sequence (autograd through the
    masked softmax of helpers.reference, K and V repeated to the query heads, their gradients summed back)."""
    H, Hkv, d = q.shape[1], k.shape[1], q.shape[2]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    cq, ck = [0], [0]
    for n, nk in zip(lens_q, lens_k):
        cq.append(cq[-1] + n)
        ck.append(ck[-1] + nk)
    for b, (n, nk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if n == 0 or nk == 0:
            continue  # nothing seen: O = 0, lse = -inf, gradients 0
        qq, dd = (t[rq].double().cpu().transpose(0, 1)[None] for t in (q, do))  # [1, H, n, d]
        kk, vv = (t[rk].double().cpu().transpose(0, 1)[None].repeat_interleave(H // Hkv, 1) for t in (k, v))
        mask = reference.causal_mask(n, nk, "bottom_right") if causal else None  # [n, nk]
        ob, lb, dq, dk, dv = reference.attention_grads(qq, kk, vv, dd, mask=mask, scale=1.0 / math.sqrt(d))
        o[rq] = ob[0].transpose(0, 1)
        lse[:, rq] = lb[0]
        grads[0][rq] = dq[0].transpose(0, 1)
        grads[1][rk] = dk[0].view(Hkv, H // Hkv, nk, d).sum(1).transpose(0, 1)
        grads[2][rk] = dv[0].view(Hkv, H // Hkv, nk, d).sum(1).transpose(0, 1)
    return o, lse, grads


def _close(name, got, want, tol):
    got = got.double().cpu()
    assert not torch.isnan(got).any(), f"{name}: NaN at {torch.isnan(got).nonzero()[0].tolist()}"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: -inf exactly where the reference has it"
    err = (got[finite] - want[finite]).abs()
    if err.numel() and err.max() > tol:
        i = int(err.argmax())
        pytest.fail(f"{name}: max err {err.max():.3g} > {tol} (ref {want[finite][i]:.5g}, got {got[finite][i]:.5g})")


# ------------------------------------------------------------------ the batch


def test_prepare_varlen_checks_once_and_keeps_its_own_copy():
    cu = _cu([3, 0, 5])
    batch = prepare_varlen(cu)
    assert isinstance(batch, VarlenBatch) and batch.num_seqs == 3 and batch.total_q == batch.total_k == 8
    assert batch.max_seqlen_q == batch.max_seqlen_k == 5 and batch.device == cu.device
    assert batch.cu_seqlens_q.dtype == torch.int32 and batch.cu_seqlens_q.tolist() == [0, 3, 3, 8]
    cu[1] = 1  # the caller's tensor changes later: the batch does not
    assert batch.cu_seqlens_q.tolist() == batch.cu_seqlens_k.tolist() == [0, 3, 3, 8]
    assert prepare_varlen([0, 2, 2], [0, 4, 5], device=DEVICE).lengths_k.tolist() == [4, 1]  # lists: no host copy
    # the length class: the document an average token sits in (sum n^2 / sum n) against SHORT_DOCUMENTS = 256
    assert prepare_varlen(_cu([1000] + [1] * 20)).length_class == "long"  # (10^6 + 20) / 1020 = 980
    assert prepare_varlen(_cu([32] * 30 + [600])).length_class == "short"  # 390720 / 1560 = 250
    assert [prepare_varlen(_cu([n])).length_class for n in (1, 255, 256, 9000)] == ["short", "short", "long", "long"]
    bad = [
        (ValueError, "must start at 0", dict(cu_seqlens_q=[1, 3])),
        (ValueError, "must not decrease", dict(cu_seqlens_q=[0, 4, 3])),
        (ValueError, "same B sequences", dict(cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 2, 4])),
        (ValueError, "max_seqlen_q = 3 is smaller than sequence 1's length 4", dict(cu_seqlens_q=[0, 1, 5],
                                                                                   max_seqlen_q=3)),
        (TypeError, "max_seqlen_k must be an int", dict(cu_seqlens_q=[0, 1], max_seqlen_k=1.0)),
        (TypeError, "int32", dict(cu_seqlens_q=torch.tensor([0.0, 1.0]))),
        (ValueError, "1-D", dict(cu_seqlens_q=torch.zeros(2, 2, dtype=torch.int32))),
        (ValueError, "at least one sequence", dict(cu_seqlens_q=[0])),
        (TypeError, "list of ints", dict(cu_seqlens_q="0,1")),
    ]
    for exc, msg, kw in bad:
        with pytest.raises(exc, match=msg):
            prepare_varlen(**kw)


@pytest.mark.parametrize("lens_q,lens_k", [([0, 1, 16, 17, 40, 0, 33], None), ([130, 5, 0, 64, 1], [90, 7, 3, 64, 0]),
                                           ([0, 0], None)])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("kind", ["q", "k"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_work_maps_cover_every_block_once_heaviest_first(lens_q, lens_k, block, kind, causal):
    lens_k = lens_k or lens_q
    batch = prepare_varlen(_cu(lens_q), _cu(lens_k))
    seq, start = (t.cpu().tolist() for t in batch.block_map(block, kind, causal))
    lens = lens_q if kind == "q" else lens_k
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    assert len(seq) == sum(-(-n // block) for n in lens), "one entry per block with rows: no spares"
    hits = [0] * cu[-1]
    work = []
    for b, s in zip(seq, start):
        assert cu[b] <= s < cu[b + 1] and (s - cu[b]) % block == 0
        for i in range(s, min(s + block, cu[b + 1])):
            hits[i] += 1
        n, nk, j = lens_q[b], lens_k[b], (s - cu[b]) // block
        if kind == "q":  # keys [0, band_hi) visited by query block j
            rows = range(j * block, j * block + block)
            work.append(max((sum(1 for c in range(nk) if c <= i + nk - n) for i in rows), default=0) if causal else nk)
        else:  # rows that see some key of key block j
            keys = range(j * block, min((j + 1) * block, nk))
            work.append(sum(1 for i in range(n) if any(c <= i + nk - n for c in keys)) if causal else n)
    assert hits == [1] * cu[-1], "every packed row (or key) belongs to exactly one entry"
    assert work == sorted(work, reverse=True), f"heaviest first: {work}"
    assert batch.block_map(block, kind, causal)[0] is batch.block_map(block, kind, causal)[0], "built once, cached"


def test_every_tensor_a_batch_gives_the_kernels_starts_on_16_bytes():
    """Triton compiles a kernel per combination of which pointer arguments are 16-byte aligned: a map or a
    cu_seqlens that started 4 or 8 bytes into a shared buffer for some numbers of blocks or documents made a
    training run compile every kernel again whenever a batch had such a number (seconds each, while timed)."""
    import random
    rng = random.Random(0)
    for num_seqs in range(1, 10):
        lens = [rng.randint(0, 300) for _ in range(num_seqs)]
        batch = prepare_varlen(_cu(lens))
        tensors = [batch.cu_seqlens_q, batch.cu_seqlens_k]
        for block in (16, 32, 64, 128):
            for kind in ("q", "k"):
                tensors += batch.block_map(block, kind, True)
        for t in tensors:
            assert t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() % 16 == 0, (lens, t.numel())


def test_a_layer_after_the_first_reuses_its_plan(monkeypatch):
    """The first call of a shape on a batch checks the inputs and builds the launch plans (the forward's, and on its
    first backward the backward's); the other layers' calls, with new tensors of the same shapes, only allocate
    their outputs and launch. Another shape, dtype, layout or option is checked again, so a bad input still fails."""
    lens = [7, 0, 30, 3]
    batch = prepare_varlen(_cu(lens))
    checked = []
    real_check = kv._check_packed
    monkeypatch.setattr(kv, "_check_packed", lambda *a: checked.append(1) or real_check(*a))
    layers = [tuple(t.clone().requires_grad_() for t in _inputs(lens, lens, 2, 1, 16, DTYPES[0], seed=i)[:3])
              for i in range(3)]
    do = _inputs(lens, lens, 2, 1, 16, DTYPES[0], seed=9)[3]
    outs = [flash_attention_varlen(q, k, v, batch, causal=True) for q, k, v in layers]
    torch.autograd.backward(outs, [do] * len(outs))
    assert len(checked) == 1 and len(batch._plans) == 1
    plan = next(iter(batch._plans.values()))
    assert plan.bwd is not None and plan.parts is not None, "both plans built, the tile kept"
    flash_attn_varlen_triton(*(t.detach() for t in layers[0]), batch, causal=True)  # the same plan, not autograd
    assert len(checked) == 1
    flash_attention_varlen(*layers[0], batch, causal=False)  # another option: checked, a second plan
    assert len(checked) == 2 and len(batch._plans) == 2
    q, k, v = (t.detach() for t in layers[0])
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides: checked, a plan of its own
    assert torch.equal(flash_attn_varlen_triton(qt, k, v, batch, causal=True)[0],
                       flash_attn_varlen_triton(q, k, v, batch, causal=True)[0])
    assert len(checked) == 3 and len(batch._plans) == 3
    with pytest.raises(ValueError, match="unit stride along its last dim"):  # not unit along d: checked, refused
        flash_attention_varlen(q.permute(2, 1, 0).contiguous().permute(2, 1, 0), k, v, batch, causal=True)
    with pytest.raises(TypeError, match="must share a dtype"):
        flash_attention_varlen(q, k.to(DTYPES[1]), v, batch, causal=True)
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attention_varlen(q, k, v, batch, causal=1)
    ref = flash_attn_varlen_triton(q, k, v, prepare_varlen(_cu(lens)), causal=True)  # a fresh batch: same result
    assert torch.equal(ref[0], outs[0].detach())


def test_a_batch_is_freed_with_its_step():
    """The batch keeps its plans and the plans reach back to it only weakly: once a step's outputs and the batch are
    dropped, the batch, its maps and its plans go at once (a reference cycle would keep every step's maps on the
    GPU until Python's cycle collector ran); the autograd graph keeps the batch alive until its backward."""
    import weakref
    lens = [5, 17, 0, 9]
    q, k, v, do = _inputs(lens, lens, 2, 1, 16, DTYPES[0], seed=3)
    qg = q.clone().requires_grad_()
    batch = prepare_varlen(_cu(lens))
    o = flash_attention_varlen(qg, k, v, batch, causal=True)
    alive = weakref.ref(batch)
    del batch
    assert alive() is not None, "the graph holds the batch for its backward"
    o.backward(do)
    del o
    assert alive() is None, "freed without the cycle collector"


# ------------------------------------------------------------------ nothing read on the host


_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__index__", "__float__", "__iter__", "__array__",
          "__repr__", "__format__")


class _Watch:
    """Raise when any of ``tensors`` has a value read through a torch.Tensor method called from outside Triton."""

    def __init__(self, monkeypatch, tensors):
        self.ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.reads = []
        for name in _READS:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        def method(t, *a, **kw):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.ptrs
                    and not caller.startswith("triton")):
                self.reads.append(f"{name} from {caller}")
                raise AssertionError(f"a value of cu_seqlens or a map was read on the host: Tensor.{name} from "
                                     f"{caller}")
            return orig(t, *a, **kw)
        return method


def test_forward_and_backward_read_no_value_of_cu_seqlens_on_the_host(monkeypatch):
    lens = [7, 0, 1, 40, 3]
    q, k, v, do = _inputs(lens, lens, 2, 1, 16, DTYPES[0], seed=1)
    cu = _cu(lens)
    batch = prepare_varlen(cu)
    for kind in ("q", "k"):  # the maps the calls use are built where the batch is made (or by a warm-up step)
        batch.block_map(kv._INTERPRETER_VARLEN_CONFIG["BLOCK_M"], kind, True)
    watched = [cu, batch.cu_seqlens_q, batch.cu_seqlens_k] + [t for m in batch._maps.values() for t in m]
    watch = _Watch(monkeypatch, watched)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = flash_attention_varlen(qg, kg, vg, batch, causal=True)
    o.backward(do)
    o2, lse2 = flash_attn_varlen_triton(q, k, v, batch, causal=True)
    flash_attn_varlen_bwd_triton(do, q, k, v, o2, lse2, batch, causal=True)
    flash_attn_varlen_triton(q, k, v, cu, cu, 40, 40, causal=True, validate=False)  # the library's form, unchecked
    assert watch.reads == []
    with pytest.raises(AssertionError, match="read on the host: Tensor.tolist"):  # the watch sees a read
        flash_attention_varlen(q, k, v, cu, cu, 40, 40, causal=True)  # the library's form, checked: the slow path
    monkeypatch.undo()
    assert torch.equal(o.detach(), o2)


def test_the_batch_path_is_the_library_path():
    """A batch, the library's checked arguments and the unchecked ones (lesson 10's map, built on the device) give
    the same O and lse: the maps' order changes who runs first, not what anyone computes."""
    lens_q, lens_k = [9, 1, 0, 30, 4], [12, 1, 5, 30, 0]
    q, k, v, do = _inputs(lens_q, lens_k, 4, 1, 32, DTYPES[0], seed=2)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    batch = prepare_varlen(cu_q, cu_k)
    # one tile for all (the paths' shape classes differ: on a GPU each could time another tile)
    fwd = kv.candidates("varlen", kv.SHAPES["varlen"](32), 32, q.dtype, q.device)[0]
    bwd = dict(zip(("dkdv", "dq"), (c[0] for c in varlen_bwd_configs(32, q))))
    a = flash_attn_varlen_triton(q, k, v, batch, causal=True, config=fwd)
    b = flash_attn_varlen_triton(q, k, v, cu_q, cu_k, 30, 30, causal=True, config=fwd)
    c = flash_attn_varlen_triton(q, k, v, cu_q, cu_k, 30, 30, causal=True, validate=False, config=fwd)
    for other in (b, c):
        assert torch.equal(a[0], other[0]) and torch.equal(a[1], other[1])
    g_a = flash_attn_varlen_bwd_triton(do, q, k, v, *a, batch, causal=True, config=bwd)
    g_c = flash_attn_varlen_bwd_triton(do, q, k, v, *a, cu_q, cu_k, 30, 30, causal=True, validate=False, config=bwd)
    assert all(torch.equal(x, y) for x, y in zip(g_a, g_c))


def test_batch_path_bad_inputs():
    lens = [3, 5]
    q, k, v, _ = _inputs(lens, lens, 2, 1, 16, DTYPES[0], seed=0)
    batch = prepare_varlen(_cu(lens))
    with pytest.raises(TypeError, match="pass no cu_seqlens_k or max_seqlen"):
        flash_attn_varlen_triton(q, k, v, batch, _cu(lens), 5, 5)
    with pytest.raises(TypeError, match="pass no cu_seqlens_k or max_seqlen"):
        flash_attention_varlen(q, k, v, batch, True)  # causal must be a keyword after a batch
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 8 must equal total_q \(q.shape\[0\]\) = 7"):
        flash_attention_varlen(q[:7].contiguous(), k, v, batch, causal=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] = 8 must equal total_k"):
        flash_attention_varlen(q, k[:6].contiguous(), v[:6].contiguous(), batch, causal=True)
    with pytest.raises(ValueError, match="the VarlenBatch is on meta"):
        flash_attention_varlen(q, k, v, prepare_varlen([0, 3, 8], device="meta"), causal=True)
    with pytest.raises(TypeError, match="cu_seqlens_k, max_seqlen_q and max_seqlen_k are the library's"):
        flash_attention_varlen(q, k, v, _cu(lens), causal=True)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \[H\] = \[2\] or \[num_seqs, H\] = \[2, 2\]"):
        flash_attention_varlen(q, k, v, batch, causal=True, alibi_slopes=torch.ones(3, 2).to(DEVICE))


# ------------------------------------------------------------------ correctness on harsh mixes


MIXES = {
    # lens_q, lens_k (None: the same), H, Hkv, d, causal. Each mix with one mask: the batch path is the library's
    # bit for bit (test_the_batch_path_is_the_library_path), and tests/test_triton_varlen.py runs the library's path
    # forward on its mixes both ways and backward on the causal n != nk GQA mix (this file's fourth, causal), a full
    # MHA one and a causal MQA one with n > nk.
    "empty and length-1 documents, GQA 4/2": ([5, 0, 1, 0, 1, 23, 1, 17], None, 4, 2, 16, False),
    "one document longer than the rest together, MQA 4/1": ([3, 40, 1, 9, 0, 2, 16, 5], None, 4, 1, 32, True),
    "ragged lengths, none a multiple of 16, MHA": ([15, 17, 31, 33, 1], None, 2, 2, 16, False),
    "n != nk both ways (rows that see nothing), GQA 4/2": ([5, 0, 1, 33, 12, 3], [9, 3, 0, 40, 4, 3], 4, 2, 16, False),
    "a batch of one document": ([57], None, 2, 1, 16, True),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_packed_documents_match_float64(mix):
    """O, lse and dq, dk, dv through flash_attention_varlen on a prepared batch, every document against float64
    autograd on that document alone."""
    lens_q, lens_k, H, Hkv, d, causal = MIXES[mix]
    lens_k = lens_k or lens_q
    dtype = DTYPES[0]
    q, k, v, do = _inputs(lens_q, lens_k, H, Hkv, d, dtype, seed=len(mix))
    batch = prepare_varlen(_cu(lens_q), _cu(lens_k))
    o_ref, lse_ref, grads_ref = _reference(q, k, v, do, lens_q, lens_k, causal)
    o, lse = flash_attn_varlen_triton(q, k, v, batch, causal=causal)
    _close("O", o, o_ref, TOL[dtype])
    _close("lse", lse, lse_ref, 5 * TOL[dtype])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention_varlen(qg, kg, vg, batch, causal=causal).backward(do)
    for name, got, want in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), grads_ref):
        scale = want.abs().max().item() + 1e-6
        _close(name, got / scale, want / scale, 3 * TOL[dtype])


@pytest.mark.skipif(ON_GPU, reason="fixed interpreter tiles; on a GPU the tuned tiles run in the test above")
def test_other_tiles_on_a_batch():
    """Tiles the interpreter does not default to, with BLOCK_M != BLOCK_N: each kernel's map is the batch's for its
    own block (the forward's and dQ's by BLOCK_M, dK/dV's by BLOCK_N), so they differ between the kernels."""
    lens = [40, 1, 0, 23, 70, 2]
    q, k, v, do = _inputs(lens, lens, 4, 2, 16, DTYPES[0], seed=7)
    batch = prepare_varlen(_cu(lens))
    o_ref, _, grads_ref = _reference(q, k, v, do, lens, lens, True)
    fwd = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    bwd = {"dkdv": dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1),
           "dq": dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)}
    o, lse = flash_attn_varlen_triton(q, k, v, batch, causal=True, config=fwd)
    _close("O", o, o_ref, TOL[DTYPES[0]])
    grads = flash_attn_varlen_bwd_triton(do, q, k, v, o, lse, batch, causal=True, config=bwd)
    assert {key[:2] for key in batch._maps} == {(32, "q"), (32, "k")}
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        scale = want.abs().max().item() + 1e-6
        _close(name, got / scale, want / scale, 3 * TOL[DTYPES[0]])


# ------------------------------------------------------------------ the tile choice


def test_tuned_launch_keeps_the_fastest_and_times_nothing_in_a_capture(monkeypatch):
    times = {16: 3.0, 32: 1.0, 64: 2.0}
    launched = []
    monkeypatch.setattr(kv, "interpreting", lambda: False)
    monkeypatch.setattr(kv, "_chosen", {})
    monkeypatch.setattr(kv.triton.testing, "do_bench", lambda fn, **kw: (fn(), times[launched[-1]["BLOCK_N"]])[1])
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    gpu = SimpleNamespace(type="cuda", index=0)
    configs = [dict(BLOCK_N=bn) for bn in (16, 32, 64)]
    assert kv.tuned_launch("key", configs, launched.append, gpu) == dict(BLOCK_N=32)
    assert launched[-1] == dict(BLOCK_N=32) and len(launched) == 4  # three timed, then the chosen one
    assert kv.tuned_launch("key", configs, launched.append, gpu) == dict(BLOCK_N=32) and len(launched) == 5
    capturing[0] = True
    assert kv.tuned_launch("other", configs, launched.append, gpu) == dict(BLOCK_N=16)  # the first, not timed
    assert len(launched) == 6 and "other" not in kv.chosen_configs()

    def too_big(cfg):
        if cfg["BLOCK_N"] == 64:
            raise kv.triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        launched.append(cfg)
    capturing[0] = False
    times[16] = 0.5
    assert kv.tuned_launch("third", configs, too_big, gpu) == dict(BLOCK_N=16)


def test_short_documents_add_small_tiles_to_the_candidates(monkeypatch):
    """On a GPU (an H200's limits here), a batch of short documents times its set and the short set after it
    (smaller tiles, two stages), in the forward and both backward kernels; a batch of long documents (and the
    unchecked library layout, which knows no lengths) its set alone."""
    monkeypatch.setattr(kv, "interpreting", lambda: False)
    monkeypatch.setattr(kv, "_device_limits", lambda device: ((9, 0), 227 * 1024))
    gpu = torch.device("cuda", 0)
    for kind, smem_kind in (("varlen", "varlen"), ("varlen_dkdv", "dkdv"), ("varlen_dq", "dq")):
        for d in (64, 128):
            long, short = kv.SHAPES[kind](d), kv.SHAPES[kind + "_short"](d)
            assert short and not any(c in long for c in short)
            assert all(c["BLOCK_M"] <= 64 and c["BLOCK_N"] <= 64 and c["num_stages"] == 2 for c in short)
            got = {cls: kv.class_candidates(kind, smem_kind, d, torch.bfloat16, gpu, cls) for cls in ("long", "short")}
            assert got["long"] == kv.class_candidates(kind, smem_kind, d, torch.bfloat16, gpu, None) == long
            assert got["short"] == long + short
    assert kv.SHAPES["varlen_short"](128)[-1] == dict(BLOCK_M=32, BLOCK_N=32, num_warps=2, num_stages=2)
    batch = prepare_varlen(_cu([30] * 20), device="meta")  # a short batch's forward key and candidates
    q, k = (torch.empty(600, h, 128, dtype=torch.bfloat16, device="meta") for h in (16, 4))
    plan = kv._FwdPlan(q, k, k, batch, kv._check_mods(True, (-1, -1), 0.0, None, 16, 20, "meta"), None,
                       use_tma=False)
    plan.device = gpu  # the device its candidates are listed for
    assert plan.key[8] == "short" and plan._configs() == kv.SHAPES["varlen"](128) + kv.SHAPES["varlen_short"](128)


def test_no_map_is_built_during_a_capture(monkeypatch):
    """Building a map copies host values to the device: not inside a CUDA graph (the copy would replay from a host
    buffer long gone). The batch says what to do instead."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture: run one forward and backward"):
        kv._to_device([[0, 1]], torch.device("cuda", 0))


# ------------------------------------------------------------------ on a GPU: a step in a CUDA graph, no sync


def _step_inputs(layers=3):
    torch.manual_seed(0)
    lens = [9, 4291, 1, 0, 700, 3000, 256, 129, 1]
    H, Hkv, d = 16, 4, 128  # bench/train_llama.py's and the packed rows' heads: the kernels they compile
    T = sum(lens)
    x = [(torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
          torch.randn(T, Hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
          torch.randn(T, Hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)) for _ in range(layers)]
    do = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16)
    return lens, x, do


def _attention_step(batch, x, do):
    """Each layer's attention, forward and backward, as a training step runs them (one batch for all layers)."""
    outs = [flash_attention_varlen(q, k, v, batch, causal=True) for q, k, v in x]
    torch.autograd.backward(outs, [do] * len(outs))
    return outs


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_a_training_steps_attention_captured_in_a_cuda_graph():
    lens, x, do = _step_inputs()
    batch = prepare_varlen([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")  # from the host: no sync
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, chooses the tiles, builds the maps
        for _ in range(2):
            for t in (t for qkv in x for t in qkv):
                t.grad = None
            eager = [o.detach().clone() for o in _attention_step(batch, x, do)]
    torch.cuda.current_stream().wait_stream(side)
    eager_grads = [t.grad.clone() for qkv in x for t in qkv]
    for t in (t for qkv in x for t in qkv):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _attention_step(batch, x, do)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, eager):
        assert torch.equal(a, b), "the replayed forward is the eager one"
    for g, e in zip((t.grad for qkv in x for t in qkv), eager_grads):
        assert torch.equal(g, e), "the replayed backward is the eager one (deterministic: no atomics)"


@pytest.mark.skipif(not ON_GPU, reason="launches every candidate tile on a CUDA GPU")
def test_every_candidate_tile_compiles_and_launches_here():
    """The launchers time their candidates on a batch's first call and leave out, silently, one that fails to
    compile or launch (``varlen.rejected_configs``): here every candidate of the forward and both backward kernels
    runs, for each length class and both head-dim classes, and none is left out. (CI compiles each kernel's base
    form for every target; this GPU run is where a candidate of its own would fail.)"""
    batches = {"short": [30] * 20 + [7], "long": [600, 300, 45]}
    for d in (64, 128):
        for cls, lens in batches.items():
            batch = prepare_varlen(_cu(lens, "cpu").tolist(), device="cuda")
            assert batch.length_class == cls, (lens, batch.length_class)
            T = sum(lens)
            q = torch.randn(T, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(T, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            flash_attention_varlen(q, k, v, batch, causal=True).backward(torch.randn_like(q))
    torch.cuda.synchronize()
    assert kv.rejected_configs() == {}, kv.rejected_configs()
    timed = {(key[0], key[1], cls) for key in kv.chosen_configs() for cls in batches if cls in key}
    assert {(kind, d, cls) for kind in ("varlen", "varlen dkdv", "varlen dq") for d in (64, 128)
            for cls in batches} <= timed, timed


def _load_bench(name):
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiled_variants():
    """How many compiled variants Triton holds for the packed kernels on this GPU (a new one: a compile)."""
    from helpers.kernels import varlen_backward as kb
    dev = torch.cuda.current_device()
    return {fn.__name__: len(fn.device_caches[dev][0])
            for fn in (kv._attn_fwd_varlen, kb._bwd_dkdv_varlen, kb._bwd_dq_varlen, kb._bwd_preprocess)}


@pytest.mark.skipif(not ON_GPU, reason="sync debug mode needs a CUDA GPU")
def test_a_training_step_waits_for_nothing_and_compiles_nothing_new():
    """bench/train_llama.py's course run, step by step as train() runs it: the inputs on the GPU, cu_seqlens on the
    host; in the step, prepare_varlen from the host's cu_seqlens (train_llama's step_context), 8 layers' attention
    forward among the model's other work, the backward through all of them, gradient clipping and AdamW (all but
    the loss's .item(), train_step's one sync). After a first step (compiles, times the tiles), the next steps run
    under set_sync_debug_mode("error") and compile nothing: batches with every residue of the number of
    documents mod 4, which moved the maps' and cu_seqlens' alignment when they shared a buffer."""
    tl = _load_bench("train_llama")
    cfg = dict(tl.GPU_CONFIG, batch=1, steps=4)  # 8 layers, H 16, Hkv 4, d 128, T 4096, one row per step
    data = torch.frombuffer(bytearray(tl.corpus_bytes()), dtype=torch.uint8).long()
    docs = tl.documents(data, cfg["doc_median"], seed=7)
    picked = {}
    for x, y, pos, doc_id, cu, max_len in tl.packed_batches(data, docs, cfg["T"], cfg["batch"], 64, 1234, "cpu"):
        picked.setdefault(len(cu) % 4, (x, y, pos, doc_id, cu, max_len))
    assert len(picked) == 4, "batches of every residue"
    steps = [(*(t.cuda() for t in s[:4]), *s[4:]) for s in picked.values()]  # cu: on the host, as in train()
    torch.manual_seed(0)
    model = tl.Llama(cfg, "course").cuda()
    opt, _ = tl.adamw_cosine(model, cfg)

    def step(x, y, pos, doc_id, cu, max_len):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y, pos, doc_id, cu, max_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    step(*steps[0])
    torch.cuda.synchronize()
    variants = _compiled_variants()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(*s) for s in steps[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(loss) for loss in losses)
    assert _compiled_variants() == variants, "a new batch compiled a kernel again"


# ------------------------------------------------------------------ the benchmark's document mixes
# (its --smoke run, both sections at once: tests/test_bench_scripts.py's test_bench_varlen_smoke_merges_rows)


def test_bench_document_mixes_sum_to_the_row():
    import importlib.util
    import os
    import random
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_varlen", os.path.join(root, "bench", "bench_varlen.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for mix, T, d, Hkv, causal in bench.packed_cases(False, False):
        lens = bench.doc_lengths(mix, T, random.Random(f"{mix}-{T}"))
        assert sum(lens) == T and min(lens) >= 1, mix
        if mix == "one longer than the rest":
            assert max(lens) > T - max(lens)
        if mix == "16 random":
            assert len(lens) == 16
