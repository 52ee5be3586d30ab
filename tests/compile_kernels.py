"""Every ``@triton.jit`` kernel the course launches, compiled for one GPU target by Triton's own compiler, no GPU.

    python -m tests.compile_kernels 90 ["dense forward" ...]     # prints one JSON line per compile
    python -m tests.compile_kernels --drive OUT_DIR 2 '{"90": [...], "75": [...]}'   # two workers share every target

Run by tests/test_compile_targets.py in the background: Triton decides between its interpreter and its compiler
when a kernel is decorated, so these processes start with TRITON_INTERPRET off (tests/conftest.py turns it on for
the test process itself). Each job is ``triton.compile(ASTSource(fn, signature, constexprs, attrs),
target=GPUTarget("cuda", cc, 32))`` with the launch options the course uses (num_warps, num_stages), as
bench/compile_decode_sm90.py does for the decode kernel: TTIR, TTGIR, LLVM IR, PTX and a cubin through the
ptxas that ships in Triton's wheel. What the interpreter lets through and the compiler rejects (a constexpr
that is not one, a bf16 conversion, a layout) fails here.

Which configurations: on every target, each configuration the launcher would try there
(``helpers.kernels.common.launch_configs`` prunes the autotune sets by the GPU's shared memory) in fp16 at
d = 128, the fixed ones of the teaching launchers, the kernels defined in the worked notebooks' cells (taken
from solutions/*.ipynb, as the tests take them) and the checker's probe. Every variant (masks, score mods,
dropout, odd head dims, layouts, d = 64) once, on sm_80 (``VARIANT_TARGETS``): a constexpr branch is the same
code on every target and an sm_80 compile is the cheapest with tensor cores; what is Hopper's own (TMA, the
tiles only sm_90 keeps, bf16 with every configuration's shared-memory proof) on sm_90. A test's planted-bug
kernels run only in the maintainers' GPU test runs (an H200), so they compile for sm_90 only.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
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


def _configs(kind, d, dtype, cc):
    """The configurations the launcher of ``kind`` would try on a GPU of compute capability ``cc``."""
    from helpers.kernels import common as kc
    if os.environ.get("COMPILE_EVERY_CONFIG"):  # what pruning leaves out too: to see what fits where
        return kc.launch_configs(kind, d, _torch_dtype(dtype))
    return kc.launch_configs(kind, d, _torch_dtype(dtype), (cc // 10, cc % 10), TARGETS[cc]["smem"])


def _meta(kind, cfg, d, dtype, cc, **kw):
    """What the test checks beyond compiling: the launcher's estimate of the shared memory (an upper bound)."""
    from helpers.kernels import common as kc
    elt = 4 if dtype == "fp32" else 2
    return dict(d=d, estimate=kc.smem_estimate(kind, cfg, d, elt, (cc // 10, cc % 10), **kw))


def _use_tma(cc, dtype):
    from helpers.kernels import common as kc
    return kc.use_tma_for((cc // 10, cc % 10), _torch_dtype(dtype))


def _bd(d):
    from helpers.kernels.common import head_block
    return head_block(d)


PADDED_D = 80  # a head dim that is not a power of two (computed 128 wide, masked along d): on VARIANT_TARGETS


def _padded(cc, kind, variant):
    """On VARIANT_TARGETS, one compile at d = PADDED_D in the first configuration the launcher keeps there."""
    return [("fp16", PADDED_D, _configs(kind, PADDED_D, "fp16", cc)[0], variant)] if cc in VARIANT_TARGETS else []


def _cfg_label(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items())


# ------------------------------------------------------------------ the tuned kernels (helpers/triton_*.py)
# Every variant (masks, score mods, dropout, odd head dims, layouts) is compiled on one target, sm_80: a constexpr
# branch is the same code on every target, and an sm_80 compile takes a third of an sm_90 one. What is Hopper's own
# (TMA, the tiles only sm_90 keeps) is compiled on sm_90, with bf16 and every configuration's shared-memory proof;
# every variant also runs natively there in `make check-gpu`.
VARIANT_TARGETS = (80,)
HOPPER = 90
# Every configuration the launcher keeps is compiled where shared memory prunes them and no test runs natively:
# sm_86 (99 KB, as sm_89) and sm_80 (163 KB). Elsewhere the first configuration: sm_90's configurations all run
# natively in `make check-gpu` on the H200, sm_89 has sm_86's limits, sm_75 keeps one configuration anyway.
ALL_CONFIG_TARGETS = (86, 80)
BF16_TARGETS = (90,)  # bf16 too, on a Hopper (its shared memory and code paths are fp16's elsewhere: one dtype suffices there)


def _plan(cc, kind, variants, plain_extras=True):
    """(dtype, d, cfg, variant) to compile: the configurations the launcher keeps on sm_cc (fp16, d = 128,
    the first variant: the shared-memory proof; all of them on ALL_CONFIG_TARGETS); on VARIANT_TARGETS also each other variant and d = 64, on
    BF16_TARGETS bf16, at the first configuration. (All of them everywhere would take CI many minutes.)
    ``plain_extras=False``: no d = 64 and no bf16 of the plain kernel, where the kernel's window and score-mod jobs
    already compile a bf16 kernel at d = 64 and its padded job d = 80 (the same code paths: once is the proof)."""
    some = (lambda cfgs: cfgs) if cc in ALL_CONFIG_TARGETS else (lambda cfgs: cfgs[:1])
    try:
        plan = [("fp16", 128, cfg, variants[0]) for cfg in some(_configs(kind, 128, "fp16", cc))]
    except ValueError:  # nothing fits at d = 128 (the backward on a T4): the launcher says so; compile d = 64
        plan = [("fp16", 64, cfg, variants[0]) for cfg in some(_configs(kind, 64, "fp16", cc))]
    first = plan[0][2]
    if cc in VARIANT_TARGETS:
        plan += [("fp16", 128, first, v) for v in variants[1:]]
        if plain_extras:
            plan += [("fp16", 64, _configs(kind, 64, "fp16", cc)[0], variants[0])]
    if cc in BF16_TARGETS and plain_extras:
        plan += [("bf16", 128, first, variants[0])]
    return plan


# The FlashAttention library's window_size / softcap / alibi_slopes in the dense kernels (tests/test_triton_mods.py):
# (WINDOW, SCORE_MOD) with SCORE_MOD 0 none, 1 softcap, 2 ALiBi. On VARIANT_TARGETS a window with softcap (fp16,
# d = 128) and with ALiBi (bf16, d = 64) in the first configuration; the windowed forward also on MODS_FWD_TARGETS.
# (Not sm_75: a T4's compile of a variant takes ptxas 15 to 40 s, and its code is sm_80's constexpr branch.)
MODS_FWD_TARGETS = (80,)
_MOD_NAMES = {0: "", 1: " softcap", 2: " ALiBi", 3: " softcap + ALiBi"}


def _mods_plan(cc, kind, variant, fwd=False):
    """(dtype, d, cfg, variant + (WINDOW, SCORE_MOD)) for the window and the score mods on sm_cc."""
    if cc in VARIANT_TARGETS:
        return [("fp16", 128, _configs(kind, 128, "fp16", cc)[0], (*variant, True, 1)),
                ("bf16", 64, _configs(kind, 64, "bf16", cc)[0], (*variant, True, 2))]
    if fwd and cc in MODS_FWD_TARGETS:  # d = 64 on a T4: without tensor cores d = 128 takes ptxas 45 s
        d = 128 if cc >= 80 else 64
        return [("fp16", d, _configs(kind, d, "fp16", cc)[0], (*variant, True, 0))]
    return []


# The dense kernels' newest switches: softcap with ALiBi (SCORE_MOD 3), dropout (DROPOUT) and a head dim that is not a
# multiple of 8 (ODD_D: computed 64 wide, strides unaligned), on NEW_VARIANT_TARGETS in the first configuration.
NEW_VARIANT_TARGETS = (80,)
ODD_D = 59


def _new_plan(cc, kind, variant, dtype="fp16"):
    """(dtype, d, cfg, variant + (WINDOW, SCORE_MOD, DROPOUT)) on NEW_VARIANT_TARGETS: softcap with ALiBi and dropout
    at d = 128 (64 on a T4, where nothing of the backward fits at 128); on VARIANT_TARGETS also a window with softcap
    and ALiBi at ODD_D."""
    if cc not in NEW_VARIANT_TARGETS:
        return []
    d = 128 if cc >= 80 else 64
    plan = [(dtype, d, _configs(kind, d, dtype, cc)[0], (*variant, False, 3, True))]
    if cc in VARIANT_TARGETS:  # ODD_D's code is the padded d's (d = 80, compiled everywhere) with other strides
        plan.append((dtype, ODD_D, _configs(kind, ODD_D, dtype, cc)[0], (*variant, True, 3, False)))
    return plan


def _new_label(d, dropout):
    return (" dropout" if dropout else "") + (" unaligned" if d % 8 else "")


def _mods_sig(window, mod):
    """The new arguments' part of a signature: the slopes pointer (None: not ALiBi), the constexpr switches."""
    if mod & 2:
        return dict(SLOPES="fp32"), dict(WINDOW=window, SCORE_MOD=mod)
    return {}, dict(WINDOW=window, SCORE_MOD=mod, SLOPES=None)


def _mods_label(window, mod):
    return (" window" if window else "") + _MOD_NAMES[mod]


def fwd_jobs(cc, dtypes):
    from helpers.kernels import forward as kf
    plan = _plan(cc, "fwd", [(True, False), (False, False)], plain_extras=False)  # (causal, TMA)
    plan += _padded(cc, "fwd", (True, False))
    if _use_tma(cc, "fp16"):  # TMA keeps Q and more K/V tiles in shared memory: the largest configuration
        cfgs = _configs("fwd", 128, "fp16", cc)
        plan += [("fp16", 128, max(cfgs, key=lambda c: _meta("fwd", c, 128, "fp16", cc)["estimate"]), (True, True))]
    plan = [(dt, d, cfg, (*v, False, 0)) for dt, d, cfg, v in plan] + _mods_plan(cc, "fwd", (True, False), fwd=True)
    plan = [(dt, d, cfg, (*v, False)) for dt, d, cfg, v in plan] + _new_plan(cc, "fwd", (True, False))
    if cc == HOPPER:  # the drop-in's TMA path (token-major K, V) is the TMA kernel; with dropout once more
        plan.append(("bf16", 128, _configs("fwd", 128, "bf16", cc)[0], (False, True, False, 3, True)))
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
        jobs.append(Job("dense forward", f"{dtype} d={d} {'causal' if causal else 'full'}{_mods_label(window, mod)}"
                        f"{_new_label(d, dropout)}{' TMA' if tma else ''} {_cfg_label(cfg)}", build,
                        _meta("fwd", cfg, d, dtype, cc)))
    return jobs


def decode_jobs(cc, dtypes):
    from helpers.kernels import decode as kd
    # (name, HEAD_MAJOR, PAGE, VARLEN, CAUSAL, DIRECT, group, nq, WINDOW, SCORE_MOD): the kvcache variants and
    # flash_decode_triton
    variants = [("kvcache paged 16", False, 16, True, True, False, 4, 1, False, 0),
                ("flash_decode", True, 0, False, False, False, 4, 1, False, 0),
                ("kvcache contiguous, causal Nq=4 x group 8", False, 0, True, True, False, 8, 4, False, 0),
                ("kvcache paged 256, one split", False, 256, True, True, True, 4, 1, False, 0)]
    plan = _plan(cc, "decode", variants, plain_extras=False) + _padded(cc, "decode", variants[0])
    # window_size, softcap, alibi_slopes (SCORE_MOD bits 1, 2): at the first configuration, on sm_90 and on sm_80
    # (the other shared-memory budget); their tiles are the plain kernel's, so these prove the code paths compile
    mods = {90: [("fp16", ("kvcache paged 16, window + softcap", False, 16, True, False, False, 4, 1, True, 1)),
                 ("bf16", ("kvcache paged 16, window + softcap", False, 16, True, False, False, 4, 1, True, 1)),
                 ("fp16", ("kvcache contiguous Nq=4 x group 8, ALiBi", False, 0, True, True, False, 8, 4, False, 2))],
            80: [("fp16", ("kvcache paged 256, window + softcap + ALiBi", False, 256, True, False, False, 4, 1,
                           True, 3))]}
    plan += [(dtype, 128, _configs("decode", 128, dtype, cc)[0], v) for dtype, v in mods.get(cc, [])]
    if cc in VARIANT_TARGETS:  # flash_attn_with_kvcache takes any head dim: one not a multiple of 8
        plan.append(("fp16", ODD_D, _configs("decode", ODD_D, "fp16", cc)[0],
                     ("kvcache paged 16, softcap + ALiBi", False, 16, True, True, False, 4, 1, False, 3)))
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


def _wide(cc, kind, variant):
    """The backward at d = 256 (its own tile set) in the first configuration the launcher keeps on sm_cc; none
    where nothing fits (a T4: the launcher raises a clear error, tests/test_compile_targets.py checks it)."""
    try:
        return [("fp16", 256, _configs(kind, 256, "fp16", cc)[0], variant)]
    except ValueError:
        return []


def bwd_jobs(cc, dtypes):
    import helpers.kernels.backward as tb
    jobs = []
    for dtype in dtypes:
        for d in (64, 128, PADDED_D) if cc in VARIANT_TARGETS and dtype == "fp16" else (128,):
            def pre(d=d, dtype=dtype):
                fn = tb._bwd_preprocess
                sig, const, attrs = signature(fn, dict(O=dtype, DO=dtype, LSE="fp32", DELTA="fp32", LSE2="fp32"),
                                              (), dict(HEAD_DIM=d, BLOCK_M=tb._PRE_BLOCK_M, BLOCK_D=_bd(d)))
                return fn, sig, const, attrs, dict(num_warps=4, num_stages=3)
            jobs.append(Job("backward preprocess", f"{dtype} d={d} BLOCK_M={tb._PRE_BLOCK_M}", pre))
        for d in ((128, ODD_D) if cc in VARIANT_TARGETS else (128,)) if cc in NEW_VARIANT_TARGETS and dtype == "fp16" \
                else ():
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

    # (causal, atomic dQ, EVEN): EVEN = N, Nk multiples of the tiles (known when compiled: no ragged loops)
    variants = [(True, False, True), (False, False, True), (True, False, False), (True, True, True)]
    plan = _plan(cc, "dkdv", variants, plain_extras=False) + _padded(cc, "dkdv", (True, True, False)) + _wide(cc, "dkdv", variants[0])
    plan = [(dt, d, cfg, (*v, False, 0)) for dt, d, cfg, v in plan] + _mods_plan(cc, "dkdv", (True, False, False))
    plan = [(dt, d, cfg, (*v, False)) for dt, d, cfg, v in plan] + _new_plan(cc, "dkdv", (True, False, False))
    if cc in VARIANT_TARGETS:  # dropout with the atomic dQ (its fp32 tiles in shared memory too)
        plan.append(("fp16", 128, _configs("dkdv", 128, "fp16", cc)[0], (False, True, True, False, 1, True)))
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
        jobs.append(Job("backward dK/dV", f"{dtype} d={d} {'causal' if causal else 'full'}{_mods_label(window, mod)}"
                        f"{_new_label(d, dropout)}{' atomic dQ' if atomic else ''}{'' if even else ' ragged'} "
                        f"{_cfg_label(cfg)}", dkdv, _meta("dkdv", cfg, d, dtype, cc, atomic=atomic)))
    variants = [(True, True), (False, True), (True, False)]
    plan = _plan(cc, "dq", variants, plain_extras=False) + _padded(cc, "dq", (True, False)) + _wide(cc, "dq", variants[0])
    plan = [(dt, d, cfg, (*v, False, 0)) for dt, d, cfg, v in plan] + _mods_plan(cc, "dq", (True, False))
    plan = [(dt, d, cfg, (*v, False)) for dt, d, cfg, v in plan] + _new_plan(cc, "dq", (True, False))
    for dtype, d, cfg, (causal, even, window, mod, dropout) in plan:
        def dq(cfg=cfg, d=d, dtype=dtype, causal=causal, even=even, window=window, mod=mod, dropout=dropout):
            fn = tb._bwd_dq
            mod_ptrs, consts = _mods_sig(window, mod)
            ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", DQ=dtype, **mod_ptrs)
            sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, EVEN=even,
                DROPOUT=dropout, **consts), ints16=("N", "Nk") if even else (), aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("backward dQ", f"{dtype} d={d} {'causal' if causal else 'full'}{_mods_label(window, mod)}"
                        f"{_new_label(d, dropout)}{'' if even else ' ragged'} {_cfg_label(cfg)}", dq,
                        _meta("dq", cfg, d, dtype, cc)))
    return jobs


def varlen_jobs(cc, dtypes):
    import helpers.kernels.varlen as tv
    plan = _plan(cc, "varlen", [False]) + _padded(cc, "varlen", False)  # TMA
    if _use_tma(cc, "fp16"):  # the dense forward's body: its TMA path is compiled in every configuration above
        plan += [("fp16", 128, plan[0][2], True)]
    plan = [(dt, d, cfg, (tma, False, 0, False)) for dt, d, cfg, tma in plan]
    if cc in VARIANT_TARGETS:  # the window with softcap: the dense body's lower band and score mod, packed
        plan += [("fp16", 128, plan[0][2], (False, True, 1, False))]
    if cc == HOPPER:  # a batch of short documents' extra tiles (the launcher adds them from sm_90)
        plan += [("fp16", 128, cfg, (_use_tma(cc, "fp16"), False, 0, False)) for cfg in _short_configs("varlen", 128, cc)]
    # the newest switches, packed: softcap with ALiBi and dropout (d = 128; 64 on a T4), and on VARIANT_TARGETS a
    # window with both at ODD_D (unaligned strides, the pointer path)
    plan += [(dt, d, cfg, (False, window, mod, dropout)) for dt, d, cfg, (_, window, mod, dropout)
             in _new_plan(cc, "varlen", (True,))]
    plan = [(dt, d, cfg, (*v, False)) for dt, d, cfg, v in plan]  # (..., PAGED)
    if cc in NEW_VARIANT_TARGETS:  # paged K/V (block_table): a page lookup per key tile, one masked loop
        d = 128 if cc >= 80 else 64
        cfg = _configs("varlen", d, "fp16", cc)[0]
        plan.append(("fp16", d, cfg, (False, False, 0, False, True)))
        if cc in VARIANT_TARGETS:  # with every option
            plan.append(("fp16", d, cfg, (False, True, 3, True, True)))
    jobs = []
    for dtype, d, cfg, (tma, window, mod, dropout, paged) in plan:
        def build(cfg=cfg, d=d, dtype=dtype, tma=tma, window=window, mod=mod, dropout=dropout, paged=paged):
            fn = tv._attn_fwd_varlen
            bn = cfg["BLOCK_N"]
            desc = f"tensordesc<{dtype}[{bn}, {d}]>" if tma else None
            mod_ptrs, consts = _mods_sig(window, mod)
            ptrs = dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32", SEQ_IDX="i32", Q_START="i32",
                        CU_Q="i32", CU_K="i32", **mod_ptrs, **(dict(BT="i32") if paged else {}))
            sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                desc_k=desc, desc_v=desc, HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, CAUSAL=True,
                USE_TMA=tma, DROPOUT=dropout, PAGED=paged, **({} if paged else dict(BT=None)), **consts),
                aligned_strides=d % 8 == 0)
            return fn, sig, const, attrs, cfg
        jobs.append(Job("varlen forward", f"{dtype} d={d} causal{_mods_label(window, mod)}{_new_label(d, dropout)}"
                        f"{' paged' if paged else ''}{' TMA' if tma else ''} {_cfg_label(cfg)}", build,
                        _meta("varlen", cfg, d, dtype, cc)))
    return jobs


def _short_configs(kind, d, cc, smem_kind="varlen"):
    """The configurations a batch of short documents adds to ``kind``'s set (``SHAPES[kind + "_short"]``, the
    launchers' ``class_configs``) that fit sm_cc's shared memory (none may fit)."""
    from helpers.kernels import common as kc
    extra = kc.SHAPES[f"{kind}_short"](d)
    try:
        return kc.fitting_configs(smem_kind, extra, d, _torch_dtype("fp16"), (cc // 10, cc % 10), TARGETS[cc]["smem"])
    except ValueError:
        return []


VARLEN_BWD_TARGETS = (90, 86, 75)  # where the candidates that fit differ: all of them (sm_86/89 and a T4 prune)


def varlen_bwd_jobs(cc, dtypes):
    """The packed backward's two kernels in every configuration ``varlen_bwd_configs`` may time on sm_cc (those of
    the varlen backward's sets that fit, and on sm_90 of its short sets): d = 128, or d = 64 where nothing fits at
    128 (a T4)."""
    import helpers.kernels.varlen_backward as tvb
    from helpers.kernels import common as kc
    if cc not in VARIANT_TARGETS + VARLEN_BWD_TARGETS:
        return []
    jobs = []
    for kind, fn, label in (("dkdv", tvb._bwd_dkdv_varlen, "varlen backward dK/dV"),
                            ("dq", tvb._bwd_dq_varlen, "varlen backward dQ")):
        fits = lambda d: kc.fitting_configs(kind, kc.SHAPES[f"varlen_{kind}"](d), d, _torch_dtype("fp16"),  # noqa: E731
                                            (cc // 10, cc % 10), TARGETS[cc]["smem"])
        try:
            d, cfgs = 128, fits(128)
        except ValueError:
            d, cfgs = 64, fits(64)
        if cc >= 90:  # and a batch of short documents' extra tiles (the launcher adds them from sm_90)
            cfgs = cfgs + _short_configs(f"varlen_{kind}", d, cc, kind)
        # the library's options: none; on VARIANT_TARGETS also the window with ALiBi in the dK/dV kernel (the dQ
        # kernel's body is the dense one's, compiled with them in bwd_jobs: 9 s of ptxas saved)
        plan = [(d, cfg, False, 0, False) for cfg in cfgs]
        if cc in VARIANT_TARGETS and kind == "dkdv":
            plan.append((d, cfgs[0], True, 2, False))
        # the newest switches, packed, in the first configuration: softcap with ALiBi and dropout (at d as above);
        # on VARIANT_TARGETS a window with both at ODD_D
        if cc in NEW_VARIANT_TARGETS:
            plan.append((d, cfgs[0], False, 3, True))
        if cc in VARIANT_TARGETS:
            plan.append((ODD_D, fits(ODD_D)[0], True, 3, False))
        for d, cfg, window, mod, dropout in plan:
            def build(fn=fn, cfg=cfg, d=d, kind=kind, dtype="fp16", window=window, mod=mod, dropout=dropout):
                mod_ptrs, consts = _mods_sig(window, mod)
                ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, LSE2="fp32", DELTA="fp32", SEQ_IDX="i32", CU_Q="i32",
                            CU_K="i32", **(dict(DK=dtype, DV=dtype, K_START="i32") if kind == "dkdv"
                                           else dict(DQ=dtype, Q_START="i32")), **mod_ptrs)
                sig, const, attrs = signature(fn, ptrs, ("qk_scale", "sm_scale", "cap", "p_drop"), dict(
                    HEAD_DIM=d, BLOCK_D=_bd(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=True,
                    DROPOUT=dropout, **consts), aligned_strides=d % 8 == 0)
                return fn, sig, const, attrs, cfg
            jobs.append(Job(label, f"fp16 d={d} causal{_mods_label(window, mod)}{_new_label(d, dropout)} "
                            f"{_cfg_label(cfg)}", build, _meta(kind, cfg, d, "fp16", cc)))
    return jobs


def block_sparse_jobs(cc, dtypes):
    """Lesson 12's block-sparse forward: every configuration its launcher keeps on sm_cc (fp16, d = 128, the
    sliding window: the shared-memory proof), on VARIANT_TARGETS the other masks and score mods and d = 64, on
    BF16_TARGETS bf16. Its configurations are pruned with the dense forward's estimate (block_sparse.SMEM_KIND)."""
    import helpers.kernels.block_sparse as kb
    from helpers.kernels import common as kc
    some = (lambda cfgs: cfgs) if cc in ALL_CONFIG_TARGETS else (lambda cfgs: cfgs[:1])
    fits = lambda d: kb.launch_configs_block_sparse(d, _torch_dtype("fp16"), (cc // 10, cc % 10), TARGETS[cc]["smem"])  # noqa: E731
    variants = [(1, 0), (2, 1), (3, 2), (0, 0)]  # (MASK, SCORE_MOD): window, document + softcap, prefix-LM + ALiBi, none
    plan = [("fp16", 128, cfg, variants[0]) for cfg in some(fits(128))]
    first = plan[0][2]
    if cc in VARIANT_TARGETS:
        plan += [("fp16", 128, first, v) for v in variants[1:]]
        plan += [("fp16", 64, fits(64)[0], variants[0])]
    plan = [(*p, False) for p in plan]  # (..., TMA)
    if cc in BF16_TARGETS:
        plan += [("bf16", 128, first, variants[1], False)]
    if _use_tma(cc, "fp16"):  # the launcher's TMA path, in the configuration of the first tile with the most shared memory
        same = [c for c in fits(128) if (c["BLOCK_M"], c["BLOCK_N"]) == (first["BLOCK_M"], first["BLOCK_N"])]
        big = max(same, key=lambda c: kc.smem_estimate(kb.SMEM_KIND, c, 128, 2, (cc // 10, cc % 10)))
        plan += [("fp16", 128, big, variants[0], True), ("bf16", 128, first, variants[1], True)]
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
        meta = dict(d=d, estimate=kc.smem_estimate(kb.SMEM_KIND, cfg, d, elt, (cc // 10, cc % 10)))
        jobs.append(Job("block-sparse forward", f"{dtype} d={d} MASK={mask} SCORE_MOD={mod}{' TMA' if tma else ''} "
                        f"{_cfg_label(cfg)}", build, meta))
    if cc >= 80:  # the backward: at block_sparse_tiles(backward=True)'s tile, bwd_configs' options (none fits sm_75)
        for dtype, d, (mask, mod) in [("fp16", 128, (2, 1)), ("fp16", 64, (1, 2))][:2 if cc in VARIANT_TARGETS else 1]:
            bm_, bn_ = kb._tiles_for(d, _torch_dtype(dtype), (cc // 10, cc % 10), TARGETS[cc]["smem"], True)
            tile = next(c for c in kb.SHAPES["block_sparse"](d) if (c["BLOCK_M"], c["BLOCK_N"]) == (bm_, bn_))
            cfg = kb.bwd_configs(tile, d, _torch_dtype(dtype), (cc // 10, cc % 10), TARGETS[cc]["smem"])
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
                meta = dict(d=d, estimate=kc.smem_estimate(kind, cfg, d, 2, (cc // 10, cc % 10)))
                jobs.append(Job("block-sparse backward", f"{kind} {dtype} d={d} MASK={mask} SCORE_MOD={mod} "
                                f"{_cfg_label(cfg)}", bwd, meta))
    return jobs


# ------------------------------------------------------------------ the teaching kernels and the worked notebooks
def notebook_ns(name):
    from tests.conftest import notebook_namespace
    return notebook_namespace(name)


def lesson07_jobs(cc, dtypes):
    ns = notebook_ns("07_triton_gpu")
    jobs = []
    more = cc in VARIANT_TARGETS
    for dtype in dtypes:
        # the benchmark's d (64), and on VARIANT_TARGETS the checker's largest (32) and the full mask too
        for d, causal in ((64, True), (64, False), (32, True)) if more and dtype == "fp16" else ((64, True),):
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
    more = cc in VARIANT_TARGETS
    for dtype in dtypes:
        for d in (32, 64) if more and dtype == "fp16" else (32,):  # the checker's largest d (32); 64
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


def planted_jobs(cc, dtypes):
    """The tests' planted-bug and written-another-way kernels, inside the notebook's launcher."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the test modules import `conftest`
    import test_idea_checks as ti
    import test_lesson07 as t7
    jobs = []
    inners = {f"inner BUG={b}": t7.inner_with(b) for b in range(6)}
    inners.update(inner_other_way=t7.inner_other_way, inner_no_safe_max=ti.inner_no_safe_max)
    combines = {f"combine BUG={b}": t7.combine_with(b) for b in range(3)}
    combines.update(combine_other_way=t7.combine_other_way)
    dtype = dtypes[0]
    for name, inner in inners.items():
        def fwd(inner=inner, d=32):
            ns = t7._ns(attn_inner=inner)
            fn = ns["attn_fwd"]
            cfg = _notebook_fwd_config(ns, d)
            sig, const, attrs = signature(fn, dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32"), ("qk_scale",),
                                          dict(D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=True))
            return fn, sig, const, attrs, cfg
        jobs.append(Job("planted kernels of the tests", f"{name} in attn_fwd {dtype} d=32", fwd))
    for name, comb in combines.items():
        def combine(comb=comb):
            sig, const, attrs = signature(comb, dict(O_part="fp32", LSE_part="fp32", O=dtype), (),
                                          dict(BLOCK_S=8, D=32))
            return comb, sig, const, attrs, dict(num_warps=4, num_stages=3)
        jobs.append(Job("planted kernels of the tests", f"{name} {dtype} D=32", combine))
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
    "planted kernels of the tests": planted_jobs,
}
ONLY_SM90 = {"planted kernels of the tests"}  # run only in the maintainers' GPU test runs (an H200)
SOME_TARGETS = {"varlen backward dK/dV": VARLEN_BWD_TARGETS, "varlen backward dQ": VARLEN_BWD_TARGETS}
# no tile of it fits a T4's 64 KB: its launcher refuses clearly there (tests/test_compile_targets.py checks the message)
FROM_SM80 = {"block-sparse backward"}


def kernels_for(cc):
    return [k for k in KERNELS if (cc == 90 or k not in ONLY_SM90) and cc in SOME_TARGETS.get(k, (cc,))
            and (cc >= 80 or k not in FROM_SM80)]


def jobs_for(cc, kernels):
    dtypes = ["fp16", "bf16"] if TARGETS[cc]["bf16"] and cc in BF16_TARGETS else ["fp16"]
    jobs = []
    for fn in dict.fromkeys(KERNELS[k] for k in kernels if k in kernels_for(cc)):  # each function once, in order
        listed = fn(cc, dtypes)
        unknown = {j.kernel for j in listed} - set(KERNELS)
        assert not unknown, f"jobs for kernels no test asks for: {unknown} (add them to KERNELS)"
        jobs += [j for j in listed if j.kernel in kernels]
    return jobs


def _cpu():  # this process's CPU time and its finished children's (ptxas)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def compile_job(cc, job):
    """Compile one job for sm_cc: a result dict (kernel, config, cc, ok, shared or error, seconds, cpu_seconds, and
    the job's meta); never raises for a kernel's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    t0, c0 = time.perf_counter(), _cpu()
    res = dict(kernel=job.kernel, config=job.config, cc=cc, **job.meta)
    try:
        fn, sig, const, attrs, cfg = job.build()
        opts = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
        k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32), options=opts)
        res.update(shared=k.metadata.shared, ok=True)
    except Exception as e:  # noqa: BLE001 - reported to the test, which names kernel, config and target
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        res.update(ok=False, error=f"{type(e).__name__}: {msg[-3000:]}")
    res.update(seconds=round(time.perf_counter() - t0, 2), cpu_seconds=round(_cpu() - c0, 2))
    return res


def main(argv):
    cc = int(argv[0])
    for job in jobs_for(cc, argv[1:] or kernels_for(cc)):
        print(json.dumps(compile_job(cc, job)), flush=True)


# The driver and its workers. Each worker imports torch, Triton and the notebooks once and lists every target's
# jobs; the driver hands out the jobs one at a time, slowest target first (sm_75: no tensor cores, each forward
# ~15 CPU-s), so both workers stay busy to the end and no target waits on a tail. Their lines start with RESULT
# (ptxas's errors print to stdout too).
RESULT = "@@compile_kernels@@ "
ORDER = (75, 90, 80, 86, 89)  # the order the targets' jobs are handed out (and their results complete)


def serve(plan):
    """A worker: lists the jobs of ``plan`` ({cc: [kernel, ...]}) and prints them ({cc: [[kernel, config], ...]}),
    then compiles the job each stdin line names ("cc index"), printing its result."""
    jobs = {cc: jobs_for(cc, kernels) for cc, kernels in plan.items()}
    print(RESULT + json.dumps({str(cc): [[j.kernel, j.config] for j in js] for cc, js in jobs.items()}), flush=True)
    for line in sys.stdin:
        cc, i = map(int, line.split())
        print(RESULT + json.dumps(dict(compile_job(cc, jobs[cc][i]), index=i)), flush=True)


def drive(out_dir, plan, parallel):
    """Compile ``plan`` ({cc: [kernel, ...]}) in ``parallel`` workers that share every target's jobs. Each target's
    results land in out_dir/compile_sm<cc>.jsonl (in its jobs' order) when its last job is done, or a worker's error
    output in compile_sm<cc>.failed (a worker that dies in a job is replaced; that job is reported failed)."""
    import subprocess
    import threading

    lock = threading.Lock()
    state = dict(todo=None, counts=None)
    results = {cc: {} for cc in plan}

    def finish(cc):
        out = os.path.join(out_dir, f"compile_sm{cc}")
        with open(out + ".tmp", "w") as f:
            f.writelines(json.dumps(results[cc][i]) + "\n" for i in range(state["counts"][cc]))
        os.replace(out + ".tmp", out + ".jsonl")

    def fail_all(why):
        for cc in plan:
            if state["counts"] is None or len(results[cc]) < state["counts"][cc]:
                out = os.path.join(out_dir, f"compile_sm{cc}")
                with open(out + ".tmp", "w") as f:
                    f.write(why)
                os.replace(out + ".tmp", out + ".failed")

    def record(cc, i, res):
        with lock:
            results[cc][i] = res
            if len(results[cc]) == state["counts"][cc]:
                finish(cc)

    def read_result(proc):
        for line in proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        return None

    def worker(n):
        log = os.path.join(out_dir, f"compile_worker{n}.log")
        for _ in range(3):  # a worker that dies in a job is replaced (twice)
            with open(log, "w") as err:
                proc = subprocess.Popen([sys.executable, "-m", "tests.compile_kernels", "--serve", json.dumps(plan)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            listed = read_result(proc)
            if listed is None:  # it could not list the jobs (an import error): nothing will compile
                proc.wait()
                with lock:
                    fail_all(f"exit {proc.returncode}\n{open(log).read()[-4000:]}")
                return
            listed = {int(cc): js for cc, js in listed.items()}
            counts = {cc: len(js) for cc, js in listed.items()}
            with lock:
                if state["counts"] is None:
                    state["counts"] = counts
                    state["todo"] = [(cc, i) for cc in sorted(plan, key=lambda c: ORDER.index(c))
                                     for i in range(counts[cc])]
                    for cc in plan:
                        if counts[cc] == 0:
                            finish(cc)
            while True:
                with lock:
                    if not state["todo"]:
                        proc.stdin.close()
                        proc.wait()
                        return
                    cc, i = state["todo"].pop(0)
                proc.stdin.write(f"{cc} {i}\n")
                proc.stdin.flush()
                res = read_result(proc)
                if res is None:  # the worker died in this job
                    proc.wait()
                    kernel, config = listed[cc][i]
                    record(cc, i, dict(kernel=kernel, config=config, cc=cc, ok=False, seconds=0, cpu_seconds=0,
                                       error=f"the compiling process died (exit {proc.returncode}):\n"
                                             f"{open(log).read()[-3000:]}"))
                    break
                record(cc, i, {k: v for k, v in res.items() if k != "index"})
        with lock:
            fail_all(f"the compiling processes kept dying: {open(log).read()[-4000:]}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y"):
        sys.exit("tests/compile_kernels.py compiles for GPUs: run it with TRITON_INTERPRET unset")
    os.environ["TRITON_INTERPRET"] = "0"  # tests/conftest.py (imported for the notebooks) must not turn it on
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if sys.argv[1] == "--drive":  # --drive OUT_DIR PARALLEL PLAN_JSON
        drive(sys.argv[2], {int(k): v for k, v in json.loads(sys.argv[4]).items()}, int(sys.argv[3]))
    elif sys.argv[1] == "--serve":  # --serve PLAN_JSON (a worker of drive)
        serve({int(k): v for k, v in json.loads(sys.argv[2]).items()})
    else:
        main(sys.argv[1:])
