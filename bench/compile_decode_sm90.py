"""Compile the decode kernel (helpers/kernels/decode.py, ``_decode_kernel``) for an H100/H200 (sm_90a) on any
machine, GPU or not, and print what the compiler made of each variant: registers, spills, shared memory, the
atomics and barriers of the in-kernel merge, the asynchronous copies of the pipelined K/V loads.

    python3 bench/compile_decode_sm90.py

Nothing is launched. It catches what the interpreter does not (a construct the GPU compiler rejects) and shows
whether a paged variant keeps as many K/V tiles in flight as the contiguous one (shared memory equal for the
same BLOCK_N and num_stages). Uses the ptxas bundled with Triton.
"""

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)  # a real JITFunction, not the interpreter's
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

from helpers.kernels import decode as kd  # noqa: E402

RUNTIME_INTS = ("Nk", "stride_kb", "max_blocks", "num_splits", "win_left", "win_right", "stride_sb")
RUNTIME_FLOATS = ("qk_scale", "sm_scale", "softcap")


def compile_variant(dtype="fp16", page=0, head_major=False, varlen=True, causal=True, direct=False, block_n=128,
                    nq=1, group=4, num_warps=4, num_stages=3, d=128, hkv=8):
    fn = kd._decode_kernel
    block_h, num_rb = kd._decode_rows(group, nq)
    ptrs = {"Q": dtype, "K": dtype, "V": dtype, "O": dtype, "O_part": "fp32", "LSE_part": "fp32",
            "Counter": "i32", "SeqLens": "i32", "BlockTable": "i32", "Slopes": "fp32"}
    sig = {n: ("*" + ptrs[n]) if n in ptrs else "i32" if n in RUNTIME_INTS else "fp32" if n in RUNTIME_FLOATS
           else "constexpr" for n in fn.arg_names}
    const = dict(HKV=hkv, GROUP=group, NQ=nq, NUM_RB=num_rb, BLOCK_H=block_h, BLOCK_N=block_n, HEAD_DIM=d, BLOCK_D=d,
                 HEAD_MAJOR=head_major, PAGE=page, VARLEN=varlen, CAUSAL=causal, DIRECT=direct, WINDOW=False, SCORE_MOD=0)
    # what Triton's launcher would specialise: 16-byte aligned pointers, stride_kb a multiple of 16
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in list(ptrs) + ["stride_kb"]}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_info(ptx):
    binary = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next((os.path.join(binary, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(binary, n))), None)
    if ptxas is None:
        return "?", "?"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", err)
    spills = re.findall(r"(\d+) bytes spill stores", err)
    return (regs[0] if regs else "?"), (spills[0] if spills else "?")


VARIANTS = [
    ("flash_decode_triton (head-major, S > 1)", dict(head_major=True, varlen=False, causal=False)),
    ("contiguous cache", dict()),
    ("paged 256", dict(page=256)),
    ("paged 16 (gathered rows)", dict(page=16)),
    ("paged 64, BLOCK_N 64, 4 stages", dict(page=64, block_n=64, num_stages=4)),
    ("contiguous, BLOCK_N 64, 4 stages", dict(block_n=64, num_stages=4)),
    ("Nq 4 x group 4, causal", dict(nq=4)),
    ("one split (DIRECT)", dict(direct=True)),
    ("bf16 paged 16, BLOCK_N 128, 8 warps", dict(dtype="bf16", page=16, num_warps=8)),
]


def main():
    print(f"triton {triton.__version__}, target sm_90a")
    print(f"{'variant':42s} {'regs':>5s} {'spill':>6s} {'shared':>8s}  atomics / barriers / cp.async / ld.cg")
    for name, kw in VARIANTS:
        k = compile_variant(**kw)
        ptx = k.asm["ptx"]
        regs, spills = ptxas_info(ptx)
        atomics = sorted(set(re.findall(r"atom\.[a-z0-9_.]+", ptx)))
        print(f"{name:42s} {regs:>5s} {spills:>6s} {k.metadata.shared:>8d}  {','.join(atomics) or '-'} / "
              f"{ptx.count('bar.sync')} / {len(re.findall(r'cp[.]async[.]c[ag][.]', ptx))} / "
              f"{len(re.findall(r'ld[.]global[.]cg', ptx))}")


if __name__ == "__main__":
    main()
