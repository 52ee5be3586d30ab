"""Every ``@triton.jit`` kernel the course launches, compiled for the GPUs learners have by Triton's own compiler, no GPU.

    python -m tests.compile_kernels 90 ["dense forward" ...]     # prints one JSON line per compile
    python -m tests.compile_kernels --drive OUT_DIR 2 '{"90": [...], "75": [...]}'   # two workers share every target

Run by tests/test_compile_targets.py in the background, through the driver and its workers of
tests/compile_driver.py. Triton decides between its interpreter and its compiler when a kernel is decorated,
so these processes start with TRITON_INTERPRET off (tests/conftest.py turns it on for the test process itself). Each job is ``triton.compile(ASTSource(fn, signature, constexprs, attrs),
target=GPUTarget("cuda", cc, 32))`` with the launch options the course uses (num_warps, num_stages), as
bench/compile_decode_sm90.py does for the decode kernel: TTIR, TTGIR, LLVM IR, PTX and a cubin through the
ptxas that ships in Triton's wheel. What the interpreter lets through and the compiler rejects (a constexpr
that is not one, a bf16 conversion, a layout) fails here.

Which compiles (each job exists for one of these reasons; a job that would prove nothing another does not is left
out):

* Every kernel on every target in its base form: its usual call (causal; the decode kernel on a paged cache; the
  block-sparse forward with a sliding window, its backward with documents and softcap) in fp16 at d = 128 (64
  where nothing fits: the backward on a T4), in the first configuration the launcher keeps there
  (``helpers.kernels.common.launch_configs`` prunes the autotune sets by the GPU's shared memory). The test checks
  its shared memory against the target's and the launcher's estimate.
* The shared-memory proof of every configuration a launcher keeps where shared memory prunes (sm_80: 163 KB,
  sm_86 and sm_89: 99 KB). Triton lowers sm_80, sm_86 and sm_89 alike (mma.sync and cp.async, the same passes;
  for these kernels the targets differ in ptxas's --gpu-name and in LLVM's SLP vectoriser, off for sm_80, both
  after shared memory is allocated), so one compile of a configuration gives its shared memory on all three (the
  test checks that the jobs compiled on several of them agree). sm_86 (``SMEM_TARGET``) compiles every
  configuration the 99 KB GPUs keep, sm_80 those only it keeps (estimated over 99 KB), sm_89 its base forms. A
  configuration whose num_warps another of the same list shares, with no smaller BLOCK_M, BLOCK_N or num_stages,
  is represented by that one: Triton's buffers grow with each, so its shared memory is no larger
  (``_undominated``). On sm_90 nothing is pruned (227 KB; its configurations run natively in `make check-gpu` on
  the H200): its base forms and the TMA paths in their largest configuration. The packed kernels' other
  candidates, which their launchers time on a batch's first call and leave out silently when one fails, are
  launched, every one, by a GPU test (tests/test_packed_documents.py, in `make check-gpu`).
* Every constexpr branch once on a tensor-core target, sm_80 (``VARIANT_TARGET``: a constexpr branch is the same
  code on every target, and an sm_80 compile is the cheapest with tensor cores). As covering sets: one compile
  turns on every switch that does not exclude another (full, not causal; a window; softcap with ALiBi; dropout;
  ragged tiles; atomic dQ; a head dim that is not a multiple of 8, ``ODD_D``, so padded and with unaligned
  strides; bf16), and only values that exclude each other (a page size under or over the tile, head-major or
  not, a mask kind) get jobs of their own. The padded head dim with aligned strides (``PADDED_D`` = 80, computed
  in 128-wide tiles: the shared memory and the estimate of d = 128) stands in for one of the configurations only
  sm_80 keeps. A block body several kernels share (forward._attn_fwd_rows, backward._bwd_dkdv_group and
  _bwd_dq_rows) has its branches compiled in the dense kernels' jobs; the packed kernels that call it compile
  their own code's (the sequence lookup, ALiBi's per-sequence slope, the paged loop).
* Hopper's own on sm_90: TMA (in the configuration with the most shared memory, and with the switches on in
  bf16), bf16 on wgmma.

Not here: the tests' planted-bug kernels, which only the maintainers' GPU test runs launch (`make check-gpu`
compiles them there).
"""
from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field

# Architectures the course's learners have, the largest shared memory one block may use on each (bytes, the
# "opt-in" maximum of NVIDIA's CUDA C++ Programming Guide, table of technical specifications per compute
# capability), and whether the GPU has bf16 tensor cores.
TARGETS = {
    90: dict(gpus="H100, H200", smem=227 * 1024, bf16=True),
    89: dict(gpus="RTX 40, L4", smem=99 * 1024, bf16=True),
    86: dict(gpus="RTX 30, A10", smem=99 * 1024, bf16=True),
    80: dict(gpus="A100", smem=163 * 1024, bf16=True),
    75: dict(gpus="T4", smem=64 * 1024, bf16=False),
}
HOPPER = 90
VARIANT_TARGET = 80  # every constexpr branch once (covering sets), and the configurations only it keeps
SMEM_TARGET = 86  # every configuration the 99 KB GPUs keep (sm_89 has sm_86's limit and lowering)
MMA_V2 = (80, 86, 89)  # lowered alike: a configuration's shared memory is the same on all three
PADDED_D = 80  # a head dim that is not a power of two (computed 128 wide, masked along d)
ODD_D = 59  # a head dim that is not a multiple of 8 (computed 64 wide, rows not 16-byte aligned: unvectorised)


@dataclass
class Job:
    """One compile: ``kernel`` (the test's name for it), ``config`` (what varies), and how to build it."""
    kernel: str
    config: str
    build: object  # () -> (JITFunction, signature, constexprs, attrs, options)
    meta: dict = field(default_factory=dict)


def signature(fn, ptrs, floats=(), constexprs=None, ints16=(), aligned_strides=True):
    """ASTSource's signature: ``ptrs`` name -> dtype ("fp16", ...), ``floats`` fp32 scalars, ``constexprs``
    (name -> value, a TensorDescriptor's signature string for a descriptor), every other argument an i32.
    Specialised as Triton's launcher specialises the course's launches: pointers 16-byte aligned, the strides
    and the ``ints16`` multiples of 16 (they decide whether loads are vectorised and pipelined, and so how
    much shared memory a kernel takes); ``aligned_strides=False``: the strides not (a head dim that is not a
    multiple of 8: rows of the library's [B, N, H, d] are not 16-byte aligned)."""
    constexprs = dict(constexprs or {})
    declared = {p.name for p in fn.params if p.is_constexpr}  # annotated tl.constexpr in the kernel's signature
    sig = {}
    for name in fn.arg_names:
        value = constexprs.get(name)
        if name in ptrs:
            sig[name] = "*" + ptrs[name]
        elif isinstance(value, str) and value.startswith("tensordesc"):
            sig[name] = constexprs.pop(name)
        elif name in constexprs and (name in declared or value is None or callable(value)):
            sig[name] = "constexpr"
        elif name in constexprs:  # a value for a parameter not declared constexpr: the launcher passes it at run time
            sig[name] = "i1" if isinstance(value, bool) else "i32"
            del constexprs[name]
            if value and not isinstance(value, bool) and value % 16 == 0:
                ints16 = (*ints16, name)
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    aligned = [n for n in fn.arg_names if n in ptrs or n in ints16
               or (aligned_strides and n.startswith("stride") and sig[n] == "i32")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return sig, constexprs, attrs


def _torch_dtype(name):
    import torch
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _cap(cc):
    return cc // 10, cc % 10


def _configs(kind, d, dtype, cc, **shape):
    """The configurations the launcher of ``kind`` would try on a GPU of compute capability ``cc`` (``shape``:
    smem_estimate's extra arguments, atomic=True for the dK/dV kernel with atomic dQ)."""
    from helpers.kernels import common as kc
    if os.environ.get("COMPILE_EVERY_CONFIG"):  # what pruning leaves out too: to see what fits where
        return kc.launch_configs(kind, d, _torch_dtype(dtype))
    return kc.fitting_configs(kind, kc._shapes(kind, d), d, _torch_dtype(dtype), _cap(cc), TARGETS[cc]["smem"],
                              **shape)


def _fits(kind):
    """``fits(d, cc)``: the fp16 configurations the launcher of ``kind`` keeps on sm_cc at head dim d."""
    return lambda d, cc: _configs(kind, d, "fp16", cc)


def _meta(kind, cfg, d, dtype, cc, **kw):
    """What the test checks beyond compiling: the launcher's estimate of the shared memory (an upper bound)."""
    from helpers.kernels import common as kc
    elt = 4 if dtype == "fp32" else 2
    return dict(d=d, estimate=kc.smem_estimate(kind, cfg, d, elt, _cap(cc), **kw))


def _use_tma(cc, dtype):
    from helpers.kernels import common as kc
    return kc.use_tma_for(_cap(cc), _torch_dtype(dtype))


def _bd(d):
    from helpers.kernels.common import head_block
    return head_block(d)


def _cfg_label(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _undominated(cfgs, also=()):
    """``cfgs`` less those another of ``cfgs`` or ``also`` represents: the same num_warps and no smaller BLOCK_M,
    BLOCK_N or num_stages. Triton's shared memory (the pipelined tiles, the layout conversions' scratch) grows with
    each, so that one's compile bounds this one's shared memory wherever both are kept."""
    def covers(r, c):
        return r != c and r["num_warps"] == c["num_warps"] and all(
            r.get(k, 0) >= c.get(k, 0) for k in ("BLOCK_M", "BLOCK_N", "num_stages"))
    out = []
    for c in cfgs:
        if c not in out and not any(covers(r, c) for r in (*cfgs, *also)):
            out.append(c)
    return out


def _proof_configs(cc, kept_on):
    """The configurations to compile on sm_cc, the launcher's first (the base form) first; ``kept_on(cc)``: those
    the launcher keeps on sm_cc. SMEM_TARGET: every one it keeps (sm_89 keeps the same); VARIANT_TARGET: those only
    it keeps (over 99 KB); both less those another represents (``_undominated``). Elsewhere the first: sm_89 is
    proven on sm_86, sm_75 keeps one, sm_90 prunes nothing."""
    kept = kept_on(cc)
    if os.environ.get("COMPILE_EVERY_CONFIG"):
        return kept
    first = kept[0]
    if cc == SMEM_TARGET:
        extra = kept
    elif cc == VARIANT_TARGET:
        try:
            small = kept_on(SMEM_TARGET)
        except ValueError:
            small = []
        extra = [c for c in kept if c not in small]
    else:
        extra = []
    return [first] + [c for c in _undominated(extra, (first,)) if c != first]


def _plan(cc, fits, variant, padded=True):
    """(dtype, d, cfg, variant) of the base form and the shared-memory proof on sm_cc: fp16, d = 128 (64 where
    nothing fits at 128: the launcher says so), ``_proof_configs``. ``fits(d, cc)``: the configurations kept. On
    VARIANT_TARGET with ``padded``, also PADDED_D: in place of the d = 128 compile of the last configuration only
    sm_80 keeps (d = 80 is computed in d = 128's tiles, head_block: the same shared memory and estimate), in the
    first where sm_80 keeps no other."""
    for d in (128, 64):
        try:
            cfgs = _proof_configs(cc, functools.partial(fits, d))
            break
        except ValueError:
            if d == 64:
                raise
    plan = [("fp16", d, cfg, variant) for cfg in cfgs]
    if padded and cc == VARIANT_TARGET and d == 128:
        cfg = plan[-1][2] if len(plan) > 1 else cfgs[0]
        assert cfg in fits(PADDED_D, cc), (cfg, PADDED_D)
        plan = plan[:-1] if len(plan) > 1 else plan
        plan.append(("fp16", PADDED_D, cfg, variant))
    return plan


def _wide(cc, kind, variant):
    """The backward at d = 256 (its own tile set) as ``_plan`` at d = 128: on sm_90, on sm_80 those only it keeps and
    on SMEM_TARGET those the 99 KB GPUs keep (sm_89's are sm_86's; nothing fits a T4: the launcher raises a clear
    error, tests/test_compile_targets.py checks it)."""
    if cc not in (HOPPER, VARIANT_TARGET, SMEM_TARGET):
        return []
    return [("fp16", 256, cfg, variant) for cfg in _proof_configs(cc, functools.partial(_fits(kind), 256))]


# ------------------------------------------------------------------ the tuned kernels (helpers/kernels/)
_MOD_NAMES = {0: "", 1: " softcap", 2: " ALiBi", 3: " softcap + ALiBi"}


def _mods_sig(window, mod):
    """The library's options' part of a signature: the slopes pointer (None: not ALiBi), the constexpr switches."""
    if mod & 2:
        return dict(SLOPES="fp32"), dict(WINDOW=window, SCORE_MOD=mod)
    return {}, dict(WINDOW=window, SCORE_MOD=mod, SLOPES=None)


def _mods_label(window, mod, d=128, dropout=False):
    return (" window" if window else "") + _MOD_NAMES[mod] + (" dropout" if dropout else "") + \
        (" unaligned" if d % 8 else "")


def fwd_jobs(cc, dtypes):
    """The dense forward. Its switches (CAUSAL, WINDOW, SCORE_MOD bits, DROPOUT) and a padded head dim (BLOCK_D >
    HEAD_DIM) are independent: on VARIANT_TARGET one compile has all of them on (CAUSAL off: the other side of its
    branches), beside the padded d with aligned strides. USE_TMA on sm_90."""
    from helpers.kernels import forward as kf
    plan = _plan(cc, _fits("fwd"), (True, False, False, 0, False))  # (causal, TMA, window, score mod, dropout)
    if cc == VARIANT_TARGET:
        plan.append(("bf16", ODD_D, _configs("fwd", ODD_D, "bf16", cc)[0], (False, False, True, 3, True)))
    if _use_tma(cc, "fp16"):  # TMA keeps Q and more K/V tiles in shared memory: the largest configuration; and the
        # library's drop-in path (token-major K, V through TMA) with the switches on (the window's is not TMA's:
        # on together they took 11 CPU-s, apart 6), in bf16
        big = max(_configs("fwd", 128, "fp16", cc), key=lambda c: _meta("fwd", c, 128, "fp16", cc)["estimate"])
        plan += [("fp16", 128, big, (True, True, False, 0, False)),
                 ("bf16", 128, _configs("fwd", 128, "bf16", cc)[0], (False, True, False, 3, True))]
    jobs = []
    for dtype, d, cfg, (causal, tma, window, mod, dropout) in plan:
        def build(cfg=cfg, d=d, dtype=dtype, tma=tma, causal=causal, window=window, mod=mod, dropout=dropout):
            fn = kf._attn_fwd
            bn = cfg["BLOCK_N"]
            desc = f"tensordesc<{dtype}[{bn}, {d}]>" if tma else None
            ptrs, consts = _mods_sig(window, mod)
            sig, const, attrs = signature(
                fn, dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32", **ptrs),
                ("qk_scale", "sm_scale", "cap", "p_drop"),
                dict(desc_k=desc, desc_v=desc, HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
                     CAUSAL=causal, USE_TMA=tma, DROPOUT=dropout, **consts), ints16=("N", "Nk"),
                aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("dense forward", f"{dtype} d={d} {'causal' if causal else 'full'}"
                        f"{_mods_label(window, mod, d, dropout)}{' TMA' if tma else ''} {_cfg_label(cfg)}", build,
                        _meta("fwd", cfg, d, dtype, cc)))
    return jobs


def decode_jobs(cc, dtypes):
    """The decode kernel (flash_decode_triton, flash_attn_with_kvcache). Values that exclude each other get a job
    each on VARIANT_TARGET: a page under the tile (the base form), none (head-major; token-major), over the tile;
    a window, causal or neither; the other switches ride along."""
    from helpers.kernels import decode as kd
    # (name, HEAD_MAJOR, PAGE, VARLEN, CAUSAL, DIRECT, group, nq, WINDOW, SCORE_MOD)
    plan = _plan(cc, _fits("decode"), ("kvcache paged 16", False, 16, True, True, False, 4, 1, False, 0))
    if cc == VARIANT_TARGET:
        cfg = _configs("decode", 128, "fp16", cc)[0]
        plan += [("fp16", 128, cfg, ("flash_decode", True, 0, False, False, False, 4, 1, False, 0)),
                 ("fp16", 128, cfg, ("kvcache contiguous, causal Nq=4 x group 8", False, 0, True, True, False, 8, 4,
                                     False, 0)),
                 ("bf16", ODD_D, _configs("decode", ODD_D, "bf16", cc)[0],
                  ("kvcache paged 256, one split, window + softcap + ALiBi", False, 256, True, False, True, 4, 1,
                   True, 3))]
    if cc == HOPPER:  # bf16 on sm_90, every switch of the base form's path on
        plan.append(("bf16", 128, _configs("decode", 128, "bf16", cc)[0],
                     ("kvcache paged 16, window + softcap + ALiBi", False, 16, True, False, False, 4, 1, True, 3)))
    jobs = []
    for dtype, d, cfg, (name, head_major, page, varlen, causal, direct, group, nq, window, score_mod) in plan:
        def build(cfg=cfg, d=d, dtype=dtype, head_major=head_major, page=page, varlen=varlen, causal=causal,
                  direct=direct, group=group, nq=nq, window=window, score_mod=score_mod):
            fn = kd._decode_kernel
            block_h, num_rb = kd._decode_rows(group, nq)
            ptrs = dict(Q=dtype, K=dtype, V=dtype, O=dtype, O_part="fp32", LSE_part="fp32", Counter="i32",
                        SeqLens="i32", BlockTable="i32", Slopes="fp32")
            sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "softcap"), dict(
                HKV=8, GROUP=group, NQ=nq, NUM_RB=num_rb, BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"],
                HEAD_DIM=d, BLOCK_D=_bd(d), HEAD_MAJOR=head_major, PAGE=page, VARLEN=varlen, CAUSAL=causal, DIRECT=direct,
                WINDOW=window, SCORE_MOD=score_mod),
                ints16=("Nk", "max_blocks"), aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("decode", f"{dtype} d={d} {name} {_cfg_label(cfg)}", build,
                        _meta("decode", cfg, d, dtype, cc, block_h=kd._decode_rows(group, nq)[0])))
    return jobs


def bwd_jobs(cc, dtypes):
    """The dense backward: the preprocess (contiguous, and strided: the dense backward's), the dK/dV and dQ
    kernels, the dQ cast. On VARIANT_TARGET each kernel once with every switch on (full, ragged, a window, softcap
    with ALiBi, dropout, atomic dQ, bf16 at ODD_D), the padded d, and atomic dQ at a power of two (the unmasked
    adds, its fp32 tiles in the estimate)."""
    import helpers.kernels.backward as tb
    jobs = []
    for dtype in dtypes:
        for d in (128, PADDED_D) if cc == VARIANT_TARGET and dtype == "fp16" else (128,):
            def pre(d=d, dtype=dtype):
                fn = tb._bwd_preprocess
                sig, const, attrs = signature(fn, dict(O=dtype, DO=dtype, LSE="fp32", DELTA="fp32", LSE2="fp32"),
                                              (), dict(HEAD_DIM=d, BLOCK_M=tb._PRE_BLOCK_M, BLOCK_D=_bd(d)))
                return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
            jobs.append(Job("backward preprocess", f"{dtype} d={d} BLOCK_M={tb._PRE_BLOCK_M}", pre))
        for d in ((128, ODD_D) if cc == VARIANT_TARGET else (128,)) if dtype == "fp16" else ():
            def pre_strided(d=d, dtype=dtype):  # the dense backward's: O and dO each with its own strides
                fn = tb._bwd_preprocess_strided
                sig, const, attrs = signature(fn, dict(O=dtype, DO=dtype, LSE="fp32", DELTA="fp32", LSE2="fp32"),
                                              (), dict(HEAD_DIM=d, BLOCK_M=tb._PRE_BLOCK_M, BLOCK_D=_bd(d)),
                                              aligned_strides=d % 8 == 0)
                return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
            jobs.append(Job("backward preprocess", f"{dtype} d={d} strided BLOCK_M={tb._PRE_BLOCK_M}", pre_strided))

        def cast(dtype=dtype):
            fn = tb._cast_rows
            sig, const, attrs = signature(fn, dict(SRC="fp32", DST=dtype), (), dict(BLOCK=1024), ints16=("numel",))
            return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
        jobs.append(Job("backward dQ cast", f"{dtype} BLOCK=1024", cast))

    # (causal, atomic dQ, EVEN, window, score mod, dropout); EVEN: N, Nk multiples of the tiles (no ragged loops)
    base = (True, False, True, False, 0, False)
    plan = _plan(cc, _fits("dkdv"), base) + _wide(cc, "dkdv", base)
    if cc == VARIANT_TARGET:
        plan += [("bf16", ODD_D, _configs("dkdv", ODD_D, "bf16", cc, atomic=True)[0], (False, True, False, True, 3, True)),
                 ("fp16", 128, _configs("dkdv", 128, "fp16", cc, atomic=True)[0], (True, True, True, False, 0, False))]
    for dtype, d, cfg, (causal, atomic, even, window, mod, dropout) in plan:
        def dkdv(cfg=cfg, d=d, dtype=dtype, causal=causal, atomic=atomic, even=even, window=window, mod=mod,
                 dropout=dropout):
            fn = tb._bwd_dkdv
            mod_ptrs, consts = _mods_sig(window, mod)
            ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", DK=dtype,
                        DV=dtype, DQ="fp32" if atomic else dtype, **mod_ptrs)
            sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
                DQ_ATOMIC=atomic, EVEN=even, DROPOUT=dropout, **consts), ints16=("N", "Nk") if even else (),
                aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("backward dK/dV", f"{dtype} d={d} {'causal' if causal else 'full'}"
                        f"{_mods_label(window, mod, d, dropout)}{' atomic dQ' if atomic else ''}"
                        f"{'' if even else ' ragged'} {_cfg_label(cfg)}", dkdv,
                        _meta("dkdv", cfg, d, dtype, cc, atomic=atomic)))
    base = (True, True, False, 0, False)  # (causal, EVEN, window, score mod, dropout)
    plan = _plan(cc, _fits("dq"), base) + _wide(cc, "dq", base)
    if cc == VARIANT_TARGET:
        plan.append(("bf16", ODD_D, _configs("dq", ODD_D, "bf16", cc)[0], (False, False, True, 3, True)))
    for dtype, d, cfg, (causal, even, window, mod, dropout) in plan:
        def dq(cfg=cfg, d=d, dtype=dtype, causal=causal, even=even, window=window, mod=mod, dropout=dropout):
            fn = tb._bwd_dq
            mod_ptrs, consts = _mods_sig(window, mod)
            ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", DQ=dtype, **mod_ptrs)
            sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, EVEN=even,
                DROPOUT=dropout, **consts), ints16=("N", "Nk") if even else (), aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("backward dQ", f"{dtype} d={d} {'causal' if causal else 'full'}"
                        f"{_mods_label(window, mod, d, dropout)}{'' if even else ' ragged'} {_cfg_label(cfg)}", dq,
                        _meta("dq", cfg, d, dtype, cc)))
    return jobs


def varlen_jobs(cc, dtypes):
    """The packed forward: the dense forward's block body (forward._attn_fwd_rows, its branches compiled in
    fwd_jobs) behind a sequence lookup, or with paged K/V its own masked loop (_attn_fwd_rows_paged). On
    VARIANT_TARGET its own code with the switches on: the paged loop with every one (and ALiBi's per-sequence
    slope), and paged, causal at the padded d; on sm_90 TMA in bf16 and every tile a batch of short documents
    adds."""
    import helpers.kernels.varlen as tv
    # (TMA, causal, window, score mod, dropout, paged)
    plan = _plan(cc, _fits("varlen"), (False, True, False, 0, False, False), padded=False)
    if cc == VARIANT_TARGET:
        plan += [("fp16", 128, plan[0][2], (False, False, True, 3, True, True)),
                 ("fp16", PADDED_D, _configs("varlen", PADDED_D, "fp16", cc)[0], (False, True, False, 0, False, True))]
    if cc == HOPPER:
        plan.append(("bf16", 128, plan[0][2], (True, True, False, 0, False, False)))
    jobs = []
    for dtype, d, cfg, (tma, causal, window, mod, dropout, paged) in plan:
        def build(cfg=cfg, d=d, dtype=dtype, tma=tma, causal=causal, window=window, mod=mod, dropout=dropout,
                  paged=paged):
            fn = tv._attn_fwd_varlen
            bn = cfg["BLOCK_N"]
            desc = f"tensordesc<{dtype}[{bn}, {d}]>" if tma else None
            mod_ptrs, consts = _mods_sig(window, mod)
            ptrs = dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32", SEQ_IDX="i32", Q_START="i32",
                        CU_Q="i32", CU_K="i32", **mod_ptrs, **(dict(BT="i32") if paged else {}))
            sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                desc_k=desc, desc_v=desc, HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
                CAUSAL=causal, USE_TMA=tma, DROPOUT=dropout, PAGED=paged, **({} if paged else dict(BT=None)),
                **consts), aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("varlen forward", f"{dtype} d={d} {'causal' if causal else 'full'}"
                        f"{_mods_label(window, mod, d, dropout)}{' paged' if paged else ''}{' TMA' if tma else ''} "
                        f"{_cfg_label(cfg)}", build, _meta("varlen", cfg, d, dtype, cc)))
    return jobs


def varlen_bwd_jobs(cc, dtypes):
    """The packed backward's two kernels (the dense backward's bodies, _bwd_dkdv_group and _bwd_dq_rows, their
    branches compiled in bwd_jobs, behind a sequence lookup): in the configurations ``varlen_bwd_configs`` may time,
    as ``_plan`` (d = 128, or 64 where nothing fits: a T4; on sm_90 the first, the GPU test launches the rest); on
    VARIANT_TARGET their own code's switch once, ALiBi's per-sequence slope (bf16 at ODD_D: their own loads
    unaligned)."""
    import helpers.kernels.varlen_backward as tvb
    from helpers.kernels import common as kc
    jobs = []
    for kind, fn, label in (("dkdv", tvb._bwd_dkdv_varlen, "varlen backward dK/dV"),
                            ("dq", tvb._bwd_dq_varlen, "varlen backward dQ")):
        def fits(d, c, kind=kind, dtype="fp16"):
            return kc.fitting_configs(kind, kc.SHAPES[f"varlen_{kind}"](d), d, _torch_dtype(dtype), _cap(c),
                                      TARGETS[c]["smem"])
        base = (True, False, 0, False)  # (causal, window, score mod, dropout)
        plan = _plan(cc, fits, base, padded=False)
        if cc == VARIANT_TARGET:
            plan.append(("bf16", ODD_D, fits(ODD_D, cc, dtype="bf16")[0], (True, False, 2, False)))
        for dtype, d, cfg, (causal, window, mod, dropout) in plan:
            def build(fn=fn, cfg=cfg, d=d, kind=kind, dtype=dtype, causal=causal, window=window, mod=mod,
                      dropout=dropout):
                mod_ptrs, consts = _mods_sig(window, mod)
                ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", SEQ_IDX="i32", CU_Q="i32",
                            CU_K="i32", **(dict(DK=dtype, DV=dtype, K_START="i32") if kind == "dkdv"
                                           else dict(DQ=dtype, Q_START="i32")), **mod_ptrs)
                sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                    HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
                    DROPOUT=dropout, **consts), aligned_strides=d % 8 == 0)
                return fn, sig, const, attrs, cfg
            jobs.append(Job(label, f"{dtype} d={d} {'causal' if causal else 'full'}"
                            f"{_mods_label(window, mod, d, dropout)} {_cfg_label(cfg)}", build,
                            _meta(kind, cfg, d, dtype, cc)))
    return jobs


def block_sparse_jobs(cc, dtypes):
    """Lesson 12's block-sparse forward and backward. Its configurations are pruned with the dense forward's
    estimate (block_sparse.SMEM_KIND): ``_plan`` with the sliding window (MASK 1). The mask kinds exclude each
    other, but MASK 1's test is MASK 2's too and MASK 0 has no code of its own: on VARIANT_TARGET MASK 2 with
    softcap (bf16) and MASK 3 with ALiBi (at d = 64, its own tiles) cover every branch; on sm_90 the TMA path with
    MASK 2 in bf16, in the configuration of the first tile with the most shared memory. The backward (from sm_80:
    no tile fits a T4) at block_sparse_tiles(backward=True)'s tile with bwd_configs' options: MASK 2 with softcap
    everywhere, MASK 3 with ALiBi at d = 64 on VARIANT_TARGET."""
    import helpers.kernels.block_sparse as kb
    from helpers.kernels import common as kc

    def fits(d, c):
        return kb.launch_configs_block_sparse(d, _torch_dtype("fp16"), _cap(c), TARGETS[c]["smem"])
    plan = [(dt, d, cfg, (1, 0), False) for dt, d, cfg, _ in _plan(cc, fits, None, padded=False)]  # (MASK, SCORE_MOD)
    first = plan[0][2]
    if cc == VARIANT_TARGET:
        plan += [("bf16", 128, first, (2, 1), False), ("fp16", 64, fits(64, cc)[0], (3, 2), False)]
    if _use_tma(cc, "fp16"):
        same = [c for c in fits(128, cc) if (c["BLOCK_M"], c["BLOCK_N"]) == (first["BLOCK_M"], first["BLOCK_N"])]
        big = max(same, key=lambda c: kc.smem_estimate(kb.SMEM_KIND, c, 128, 2, _cap(cc)))
        plan.append(("bf16", 128, big, (2, 1), True))
    jobs = []
    for dtype, d, cfg, (mask, mod), tma in plan:
        def build(cfg=cfg, d=d, dtype=dtype, mask=mask, mod=mod, tma=tma):
            fn = kb._attn_fwd_block_sparse
            ptrs = dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32", KV_NUM="i32", KV_IDX="i32", FULL_NUM="i32",
                        FULL_IDX="i32", DOC="i32", SLOPES="fp32")
            desc = f"tensordesc<{dtype}[{cfg['BLOCK_N']}, {d}]>" if tma else None
            sig, const, attrs = signature(fn, ptrs, ("sm_scale", "qk_scale", "cap"), dict(
                desc_k=desc, desc_v=desc, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], MASK=mask,
                SCORE_MOD=mod, USE_TMA=tma), ints16=("N", "Nk"))
            return fn, sig, const, attrs, cfg
        elt = 4 if dtype == "fp32" else 2
        meta = dict(d=d, estimate=kc.smem_estimate(kb.SMEM_KIND, cfg, d, elt, _cap(cc)))
        jobs.append(Job("block-sparse forward", f"{dtype} d={d} MASK={mask} SCORE_MOD={mod}{' TMA' if tma else ''} "
                        f"{_cfg_label(cfg)}", build, meta))
    if cc >= 80:
        for dtype, d, (mask, mod) in [("fp16", 128, (2, 1))] + ([("fp16", 64, (3, 2))] if cc == VARIANT_TARGET else []):
            bm_, bn_ = kb._tiles_for(d, _torch_dtype(dtype), _cap(cc), TARGETS[cc]["smem"], True)
            tile = next(c for c in kb.SHAPES["block_sparse"](d) if (c["BLOCK_M"], c["BLOCK_N"]) == (bm_, bn_))
            cfg = kb.bwd_configs(tile, d, _torch_dtype(dtype), _cap(cc), TARGETS[cc]["smem"])
            for kind, fn_name in (("dkdv", "_bwd_dkdv_block_sparse"), ("dq", "_bwd_dq_block_sparse")):
                def bwd(cfg=cfg, d=d, dtype=dtype, mask=mask, mod=mod, fn_name=fn_name, kind=kind):
                    fn = getattr(kb, fn_name)
                    lists = ("Q_NUM", "Q_IDX", "FULL_Q_NUM", "FULL_Q_IDX") if kind == "dkdv" else \
                        ("KV_NUM", "KV_IDX", "FULL_NUM", "FULL_IDX")
                    grads = dict(DK="fp32", DV="fp32") if kind == "dkdv" else dict(DQ=dtype)
                    ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", DOC="i32", SLOPES="fp32",
                                **grads, **{n: "i32" for n in lists})
                    sig, const, attrs = signature(fn, ptrs, ("sm_scale", "qk_scale", "cap"), dict(
                        HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], MASK=mask, SCORE_MOD=mod),
                        ints16=("N", "Nk"))
                    return fn, sig, const, attrs, cfg
                meta = dict(d=d, estimate=kc.smem_estimate(kind, cfg, d, 2, _cap(cc)))
                jobs.append(Job("block-sparse backward", f"{kind} {dtype} d={d} MASK={mask} SCORE_MOD={mod} "
                                f"{_cfg_label(cfg)}", bwd, meta))
    return jobs


# ------------------------------------------------------------------ the teaching kernels and the worked notebooks
@functools.lru_cache(maxsize=None)
def notebook_ns(name):  # read once per process (a worker lists every target's jobs)
    from tests.conftest import notebook_namespace
    return notebook_namespace(name)


def lesson07_jobs(cc, dtypes):
    ns = notebook_ns("07_triton_gpu")
    jobs = []
    more = cc == VARIANT_TARGET
    for dtype in dtypes:
        # the benchmark's d (64), and on VARIANT_TARGET the checker's largest (32) with the full mask (CAUSAL's
        # other side)
        for d, causal in ((64, True), (32, False)) if more and dtype == "fp16" else ((64, True),):
            def fwd(d=d, dtype=dtype, causal=causal):
                fn = ns["attn_fwd"]
                cfg = _notebook_fwd_config(ns, d)
                sig, const, attrs = signature(fn, dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32"), ("qk_scale",),
                                              dict(D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal),
                                              ints16=("N", "Nk"))
                return fn, sig, const, attrs, cfg
            jobs.append(Job("notebook 07 attn_fwd", f"{dtype} d={d} {'causal' if causal else 'full'}", fwd, dict(d=d)))

        def split(dtype=dtype, d=128):  # bench_decode_live's d
            fn = ns["decode_split"]
            sig, const, attrs = signature(fn, dict(Q=dtype, K=dtype, V=dtype, O_part="fp32", LSE_part="fp32"),
                                          ("qk_scale",), dict(D=d, BLOCK_N=64), ints16=("Nk", "keys_per_split"))
            return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
        jobs.append(Job("notebook 07 decode_split", f"{dtype} d=128 BLOCK_N=64", split))

        def combine(dtype=dtype, d=128):
            fn = ns["decode_combine"]
            sig, const, attrs = signature(fn, dict(O_part="fp32", LSE_part="fp32", O=dtype), (),
                                          dict(BLOCK_S=64, D=d))
            return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
        jobs.append(Job("notebook 07 decode_combine", f"{dtype} d=128 BLOCK_S=64", combine))

        def probe(dtype=dtype):
            from helpers.lesson07 import check as c7
            fn = c7._probe(ns["attn_inner"])
            sig, const, attrs = signature(fn, dict(Q=dtype, K=dtype, V=dtype, O="fp32", LSE="fp32", ROW0="i32"),
                                          ("qk_scale",), dict(D=16, BLOCK_M=16, BLOCK_N=16))
            return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
        jobs.append(Job("check.flash_attn_triton safe-max probe", f"{dtype} D=16 BLOCK_M=BLOCK_N=16", probe))
    return jobs


def _notebook_fwd_config(ns, d):
    cfg = ns["fwd_config"](d)  # the notebook's launcher reads interpreting(): False in this process
    return dict(cfg)


def lesson08_jobs(cc, dtypes):
    ns = notebook_ns("08_backward_pass")
    jobs = []
    for dtype in dtypes:
        for d in (32,):  # the checker's largest d (another d is the same code with other constants)
            def build(dtype=dtype, d=d):
                from helpers.lesson08.dkdv import _teach_dkdv as fn
                ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", DK=dtype, DV=dtype)
                sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale"), dict(
                    INNER=ns["dkdv_inner"], HEAD_DIM=d, BLOCK_M=64, BLOCK_N=64, CAUSAL=True), ints16=("N", "Nk"))
                return fn, sig, const, attrs, dict(num_warps=4, num_stages=2)  # dkdv_teaching's launch
            jobs.append(Job("lesson 08 dkdv_teaching + notebook dkdv_inner", f"{dtype} d={d} causal 64x64", build))

        def lo_probe(dtype=dtype):
            from helpers.lesson08 import check_gpu as c8
            fn = c8._lo_probe()
            ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", DK="fp32", DV="fp32")
            sig, const, attrs = signature(fn, ptrs, ("qk_scale",), dict(
                INNER=ns["dkdv_inner"], HEAD_DIM=16, BLOCK_M=16, BLOCK_N=16))
            return fn, sig, const, attrs, dict(num_warps=4, num_stages=2)
        jobs.append(Job("check.dkdv_inner lo probe", f"{dtype} D=16 BLOCK_M=BLOCK_N=16", lo_probe))
    return jobs


# kernel (the test's name for it) -> the function that lists its jobs for one target
KERNELS = {
    "dense forward": fwd_jobs,
    "decode": decode_jobs,
    "backward preprocess": bwd_jobs,
    "backward dK/dV": bwd_jobs,
    "backward dQ": bwd_jobs,
    "backward dQ cast": bwd_jobs,
    "varlen forward": varlen_jobs,
    "varlen backward dK/dV": varlen_bwd_jobs,
    "varlen backward dQ": varlen_bwd_jobs,
    "block-sparse forward": block_sparse_jobs,
    "block-sparse backward": block_sparse_jobs,
    "notebook 07 attn_fwd": lesson07_jobs,
    "notebook 07 decode_split": lesson07_jobs,
    "notebook 07 decode_combine": lesson07_jobs,
    "check.flash_attn_triton safe-max probe": lesson07_jobs,
    "lesson 08 dkdv_teaching + notebook dkdv_inner": lesson08_jobs,
    "check.dkdv_inner lo probe": lesson08_jobs,
}
# no tile of it fits a T4's 64 KB: its launcher refuses clearly there (tests/test_compile_targets.py checks the message)
FROM_SM80 = {"block-sparse backward"}


def kernels_for(cc):
    return [k for k in KERNELS if cc >= 80 or k not in FROM_SM80]


def jobs_for(cc, kernels):
    dtypes = ["fp16", "bf16"] if cc == HOPPER else ["fp16"]  # bf16 of the teaching kernels and casts on sm_90
    jobs = []
    for fn in dict.fromkeys(KERNELS[k] for k in kernels if k in kernels_for(cc)):  # each function once, in order
        listed = fn(cc, dtypes)
        unknown = {j.kernel for j in listed} - set(KERNELS)
        assert not unknown, f"jobs for kernels no test asks for: {unknown} (add them to KERNELS)"
        jobs += [j for j in listed if j.kernel in kernels]
    return jobs


def main(argv):
    from tests.compile_driver import compile_job
    cc = int(argv[0])
    for job in jobs_for(cc, argv[1:] or kernels_for(cc)):
        print(json.dumps(compile_job(cc, job)), flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y"):
        sys.exit("tests/compile_kernels.py compiles for GPUs: run it with TRITON_INTERPRET unset")
    os.environ["TRITON_INTERPRET"] = "0"  # tests/conftest.py (imported for the notebooks) must not turn it on
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from tests.compile_driver import drive, serve
    if sys.argv[1] == "--drive":  # --drive OUT_DIR PARALLEL PLAN_JSON
        drive(sys.argv[2], {int(k): v for k, v in json.loads(sys.argv[4]).items()}, int(sys.argv[3]))
    elif sys.argv[1] == "--serve":  # --serve PLAN_JSON (a worker of drive)
        serve({int(k): v for k, v in json.loads(sys.argv[2]).items()})
    else:
        main(sys.argv[1:])
