"""What every kernel of ``helpers/kernels/`` shares: constants, input checks, and what a GPU can run.

* ``LOG2E``, ``LN2``: ``tl.constexpr`` constants, usable inside ``@triton.jit`` code and, as ``LOG2E.value``, on
  the host. Every kernel works in base 2: ``qk_scale = sm_scale * log2(e)`` makes each exponential one
  ``exp2``, and a base-2 lse times ``ln(2)`` is the natural-log lse the launchers return.
* ``_check_qkv`` and its parts: the checks every entry point makes of q, k and v (types, one device, ranks,
  dtypes the device can run, contiguity, or with ``strided=True`` only a unit stride along d), ``HEAD_DIMS``
  (multiples of 8) and ``ANY_HEAD_DIMS`` (1 to 256, the dense kernels'); ``head_block(d)``: the padded width the
  kernels compute in (``tl.arange`` needs a power of two), and ``_load_d``, the load of an unmasked tile, masked
  along d only when d is padded.
* ``SHAPES``, ``smem_estimate``, ``fitting_configs``, ``launch_configs``, ``prune_for_device``: each kernel
  module registers its tile configurations, and the launchers keep those that fit the GPU's shared memory.
* ``use_tma_for``, ``check_dtype_for``: TMA from sm_90, bf16 from sm_80.
* The FlashAttention library's options every family takes: ``_check_window``, ``_check_softcap``,
  ``_check_alibi_slopes`` (host checks), ``_tanh`` and ``_score_mod`` (softcap, ALiBi or both on a tile of
  scores); dropout: ``_check_dropout``, ``draw_rng_state`` (a seed and offset from torch's generator) and
  ``_dropout_keep`` (the keep mask of a tile, a function of the seed, offset, head, row and column alone, so the
  backward regenerates the forward's mask).

Written for this course.
"""

import math

import torch
import triton
import triton.language as tl

from ..reference import LN2 as _LN2, LOG2E as _LOG2E
from ..triton_mode import interpreting

try:  # host-side TMA descriptors (Hopper and newer); absent in old Triton
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

LOG2E = tl.constexpr(_LOG2E)  # log2(e) (helpers.reference.LOG2E): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(_LN2)  # ln(2): a base-2 log times LN2 is the natural log


# ----------------------------------------------------------------------------
# Input checks every entry point makes
# ----------------------------------------------------------------------------

_DTYPES_GPU = (torch.float16, torch.bfloat16, torch.float32)
_DTYPES_CPU = (torch.float16, torch.float32)


def _check_tensor(name, x, ndim, dtypes, strided=False):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; expected one of: {names}")
    if strided:
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(f"{name} must have a unit stride along its last dim (the head dim), got strides "
                             f"{tuple(x.stride())} (call .contiguous() first)")
    elif not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_device(*tensors, names=("q", "k", "v")):
    dev = tensors[0].device
    for name, t in zip(names, tensors):
        if t.device != dev:
            raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must be on one device; "
                             f"{name} is on {t.device}, {names[0]} on {dev}")
    if interpreting():
        if dev.type != "cpu":
            raise ValueError("with TRITON_INTERPRET=1 the tensors must be on the CPU")
        return _DTYPES_CPU
    if dev.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device (or set TRITON_INTERPRET=1 for the CPU), got {dev}")
    return _DTYPES_GPU


HEAD_DIMS = tuple(range(8, 257, 8))  # every multiple of 8 up to 256 (the varlen and decode kernels)
ANY_HEAD_DIMS = tuple(range(1, 257))  # the dense forward and backward: any d up to 256, as the library takes


def head_block(d):
    """The width the kernels compute in for head dim d: the next power of two (tl.arange needs one), at least 16
    (tl.dot's smallest K). Loads and stores along d are masked with the real d; nothing is copied or padded in
    memory. d = 80 computes in 128 columns, 48 of them zeros."""
    return max(16, _next_pow2(d))


def _check_head_dim(d, any_d=False):
    """d a multiple of 8 (rows stay 16-byte aligned in fp16, so loads are vectorised) in [8, 256]; with ``any_d``
    any d from 1 to 256 (a d that is not a multiple of 8 loads its rows unvectorised, masked along d)."""
    if any_d:
        if d not in ANY_HEAD_DIMS:
            raise ValueError(f"head dimension d must be from 1 to 256, got {d}")
        return
    if d not in HEAD_DIMS:
        raise ValueError(f"head dimension d must be a multiple of 8 from 8 to 256 (8, 16, ..., 80, 96, ..., 256); "
                         f"got {d}")


@triton.jit
def _load_d(ptrs, d_ok, PAD_D: tl.constexpr):
    """Load a tile that needs no mask along its rows: masked along d only when the head dim is padded
    (PAD_D: HEAD_DIM < BLOCK_D; d_ok [BLOCK_D] says which columns are real), so the power-of-two case is the
    unmasked load it always was."""
    if PAD_D:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


def _check_qkv(q, k, v, ndims, names=("q", "k", "v"), strided=False):
    """The checks every entry point makes of its three tensors, in this order: each a tensor, one device
    (the CPU under the interpreter, CUDA otherwise), ranks ``ndims`` (q's, k's and v's), an allowed dtype,
    contiguous (``strided=True``: any strides with a unit stride along d, for kernels that take strides), one
    dtype for all three."""
    tensors = (q, k, v)
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = _check_device(*tensors, names=names)
    for name, x, ndim in zip(names, tensors, ndims):
        _check_tensor(name, x, ndim, dtypes, strided)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{', '.join(names)} must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "cuda" and not interpreting():
        check_dtype_for(_device_limits(q.device)[0], q.dtype)



def _check_dense_kv(q, k, v, any_d=False):
    """k, v ``[B, Hkv, Nk, d]`` for q ``[B, H, ..., d]`` (the dense forward's and decode's layout), H a multiple of
    Hkv (grouped-query attention), a head dim the kernels compile for (``any_d``: 1 to 256). Returns (Hkv, Nk)."""
    B, H, d = q.shape[0], q.shape[1], q.shape[-1]
    Bk, Hkv, Nk, dk = k.shape
    if (Bk, dk) != (B, d):
        raise ValueError(f"k must be [B, Hkv, Nk, d] = [{B}, Hkv, Nk, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"H = {H} query heads must be a multiple of Hkv = {Hkv} KV heads (k is {tuple(k.shape)})")
    _check_head_dim(d, any_d)
    return Hkv, Nk

# ----------------------------------------------------------------------------
# Small host helpers (triton.cdiv and triton.next_power_of_2 cost ~5 us a call on the host, Triton 3.9)
# ----------------------------------------------------------------------------


def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


_sm_count = {}


def _num_sms(device):
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def _capturing(device):
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------
# What a GPU can run: shared memory per configuration, TMA, bf16
# ----------------------------------------------------------------------------


# kind -> f(d) -> [config dict (BLOCK_M, BLOCK_N, num_warps, num_stages; no BLOCK_M for decode)]: each kernel
# module registers its configurations here when it is imported, so this module never imports them back
# (tests/test_layout.py: no cycles).
SHAPES = {}


def tile_configs(shapes):
    """[(BLOCK_M, BLOCK_N, num_warps, num_stages)] -> the config dicts the launchers and ``SHAPES`` use."""
    return [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


def _shapes(kind, d):
    """The launcher's configurations of ``kind`` for head dim d, as dicts."""
    if kind not in SHAPES:
        raise ValueError(f"unknown kernel kind {kind!r} (is the module that launches it imported?)")
    return SHAPES[kind](d)


# Shared memory one configuration takes, in bytes: upper bounds fitted to what Triton 3.9 lays out when it
# compiles the kernels for sm_90 and sm_8x (tests/test_compile_targets.py checks them against every compiled
# configuration). Mostly the pipelined tiles: num_stages of them in flight. Before sm_80 Triton neither
# pipelines nor uses tensor cores, and the launchers keep only their smallest configuration there.
_SMEM_SLACK = 2048  # barriers and small scratch


def smem_estimate(kind, cfg, d, elt, capability, block_h=64, atomic=False):
    """Shared memory (bytes) of kernel ``kind`` in configuration ``cfg`` for head dim d and elt-byte inputs on a
    GPU of this (major, minor); ``block_h``: the decode kernel's query rows per program; ``atomic``: the dK/dV
    kernel adds dQ atomically (fp32 tiles of dQ and dS^T on their way to the atomics)."""
    bm, bn, stages = cfg.get("BLOCK_M", 0), cfg["BLOCK_N"], cfg["num_stages"]
    d = head_block(d)  # the tiles are the padded width wide
    hopper = capability[0] >= 9
    if capability < (8, 0):  # no pipelining, dots on CUDA cores: the operands of the dots staged in shared memory
        outer, inner = (block_h if kind == "decode" else bm), bn
        if kind == "dkdv":  # one program owns BLOCK_N keys and streams the BLOCK_M query rows
            outer, inner = bn, bm
        tiles = 2 * outer + inner if kind in ("dkdv", "dq") else outer + inner
        return max(tiles * 2 * d * elt, 8 * outer * inner)  # d-wide tiles, or (small d) the fp32 scores
    if kind in ("fwd", "varlen"):  # K, V tiles in flight; Q too on sm_90 (wgmma's operand)
        return stages * 2 * bn * d * elt + (bm * d * elt if hopper else 0) + _SMEM_SLACK
    if kind == "decode":  # K, V tiles in flight; the query tile and P
        return (stages - 1) * 2 * bn * d * elt + block_h * (d + bn) * elt + _SMEM_SLACK
    if kind == "dkdv":  # q, dO tiles in flight; K, V
        return stages * 2 * bm * d * elt + 2 * bn * d * elt + (bm * (d + bn) * 4 if atomic else 0) + _SMEM_SLACK
    if kind == "dq":  # K, V tiles in flight; q, dO
        return stages * 2 * bn * d * elt + 2 * bm * d * elt + _SMEM_SLACK
    raise ValueError(f"unknown kernel kind {kind!r}")


def fitting_configs(kind, configs, d, dtype, capability, smem, **shape):
    """The configurations (dicts) of ``configs`` a launcher tries on a GPU of this capability with ``smem`` bytes
    of shared memory per block: those that fit; before sm_80 only the first that fits (no pipelining there, and
    each compile of these kernels takes a CPU about a minute without tensor cores)."""
    elt = torch.empty((), dtype=dtype).element_size()
    keep = [c for c in configs if smem_estimate(kind, c, d, elt, capability, **shape) <= smem]
    if capability < (8, 0):
        keep = keep[:1]
    if not keep:
        raise ValueError(f"no configuration of the {kind} kernel fits this GPU's {smem // 1024} KB of shared memory "
                         f"per block at head dim {d} (sm_{capability[0]}{capability[1]}): use a smaller head dim")
    return keep


def launch_configs(kind, d, dtype, capability=None, smem=None):
    """The configurations the launcher of ``kind`` tries for head dim d and ``dtype``: every one (capability
    None), or those ``fitting_configs`` keeps on a GPU of this capability and shared memory."""
    configs = _shapes(kind, d)
    return configs if capability is None else fitting_configs(kind, configs, d, dtype, capability, smem)


def _config_dict(c):
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def prune_for_device(kind, configs, nargs, kwargs):
    """triton.autotune's early_config_prune: the triton.Configs that fit the GPU of the query tensor Q."""
    args = {**nargs, **kwargs}
    q = args["Q"]
    if q.device.type != "cuda" or interpreting():
        return configs
    cap, smem = _device_limits(q.device)
    fixed = {"BLOCK_M": args["BLOCK_M"]} if "BLOCK_M" in args else {}  # the varlen kernel's, fixed per head dim
    as_dict = {id(c): {**fixed, **_config_dict(c)} for c in configs}
    keep = fitting_configs(kind, list(as_dict.values()), args["HEAD_DIM"], q.dtype, cap, smem,
                           atomic=bool(args.get("DQ_ATOMIC", False)))
    return [c for c in configs if as_dict[id(c)] in keep]


_limits = {}  # device index -> ((major, minor), shared memory per block in bytes)


def _device_limits(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _limits:
        props = torch.cuda.get_device_properties(idx)
        _limits[idx] = ((props.major, props.minor), props.shared_memory_per_block_optin)
    return _limits[idx]


def use_tma_for(capability, dtype, d=None):
    """Whether the forward kernels load K and V through TMA descriptors on a GPU of this (major, minor) for head
    dim d: not for a d that is not a power of two (the tile is padded to head_block(d) columns, and a TMA box
    that wide would read the next head's columns; those take the pointer path, masked along d)."""
    if d is not None and head_block(d) != d:
        return False
    return TensorDescriptor is not None and capability[0] >= 9 and dtype != torch.float32


def check_dtype_for(capability, dtype):
    """Raise a ValueError naming the way out when a GPU of this (major, minor) cannot run ``dtype`` here:
    bf16 before sm_80 (a T4 is sm_75: no bf16 arithmetic; Triton would emulate it, slowly, if it compiles)."""
    if dtype == torch.bfloat16 and capability < (8, 0):
        raise ValueError(f"bfloat16 needs a GPU of compute capability 8.0 or newer (A100, RTX 30/40, L4, H100); "
                         f"this one is sm_{capability[0]}{capability[1]} (a T4 is sm_75): use torch.float16")


# ----------------------------------------------------------------------------
# The FlashAttention library's options: window_size, softcap, alibi_slopes
# ----------------------------------------------------------------------------


def _check_window(window_size):
    """window_size=(left, right): ints >= 0, or -1 for unbounded on that side; returns (left, right)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 meaning unbounded; got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size=({left}, {right}): each side is >= 0, or -1 for unbounded")
    return left, right


def _check_softcap(softcap):
    """softcap: a finite number >= 0, 0.0 meaning off; returns it as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (0.0 = off), got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0.0 = off), got {softcap!r}")
    return float(softcap)


def _check_alibi_slopes(slopes, batch, H, device, batch_name="B", name="alibi_slopes"):
    """ALiBi slopes: a float32 tensor [H] or [batch, H] on q's device; returns it contiguous. ``batch_name``: what
    the leading dim is called (B, or num_seqs for a packed batch); ``name``: the argument's name in the message."""
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        got = str(slopes.dtype).replace("torch.", "") if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise TypeError(f"{name} must be a float32 torch.Tensor [H] or [{batch_name}, H], got {got}")
    if slopes.device != device:
        raise ValueError(f"{name} must be on q's device: {name} is on {slopes.device}, q on {device}")
    if tuple(slopes.shape) not in ((H,), (batch, H)):
        raise ValueError(f"{name} must be [H] = [{H}] or [{batch_name}, H] = [{batch}, {H}], got {tuple(slopes.shape)}")
    return slopes.contiguous()


@triton.jit
def _tanh(x):
    # tanh from one exp2, exact at both saturations: 2 / (1 + e^(-2x)) - 1
    e = tl.math.exp2(x * (-2.0 * LOG2E))  # e^(-2x)
    return 2.0 / (1.0 + e) - 1.0


@triton.jit
def _score_mod(qk, rows, cols, sm_scale, cap, slope, alibi_diag, SCORE_MOD: tl.constexpr):
    """The score modification of a tile of raw scores ``qk``: returns (the modified score in base-2 units, its
    derivative with respect to the scaled score s = qk * sm_scale). rows, cols: query and key indices shaped to
    broadcast against qk ([M, 1] and [1, N], or transposed). SCORE_MOD bit 1: softcap, ``cap * tanh(s / cap)``
    (Gemma 2); bit 2: ALiBi, ``- slope * |i + alibi_diag - j|``; 3: both, the softcap first, then the bias (the
    library's order: its reference caps the scores, then adds the bias). Computed in natural units, then times
    log2(e)."""
    s = qk * sm_scale  # natural units
    dmod = 1.0
    if SCORE_MOD & 1:
        t = _tanh(s / cap)
        s = cap * t
        dmod = 1.0 - t * t  # d(cap tanh(s / cap)) / ds (the bias adds nothing to it)
    if SCORE_MOD & 2:
        s = s - slope * tl.abs(rows + alibi_diag - cols).to(tl.float32)
    return s * LOG2E, dmod


# ----------------------------------------------------------------------------
# Dropout: the library's semantics (the mask on P after the softmax, kept entries scaled by 1 / (1 - p), the lse
# that of the undropped P), with Philox counters so the backward regenerates the forward's mask
# ----------------------------------------------------------------------------


def _check_dropout(p):
    """dropout_p: a number in [0, 1); returns it as a float."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {type(p).__name__}")
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1) (0.0 = off), got {p!r}")
    return float(p)


def draw_rng_state():
    """(seed, offset): two ints in [0, 2^31) from torch's default (CPU) generator, so that ``torch.manual_seed``
    makes a dropout mask reproducible; drawn on the host, nothing waits for the GPU."""
    seed, offset = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64).tolist()
    return int(seed), int(offset)


def _check_rng_state(rng_state):
    if (not isinstance(rng_state, (tuple, list)) or len(rng_state) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in rng_state)):
        raise ValueError(f"rng_state must be (seed, offset), two ints in [0, 2^31) (draw_rng_state() makes one), "
                         f"got {rng_state!r}")
    return int(rng_state[0]), int(rng_state[1])


@triton.jit
def _dropout_keep(seed, offset, bh, rows, cols, p_drop):
    """Which entries of a tile of P are kept: True with probability 1 - p_drop. rows, cols: query and key indices
    shaped to broadcast ([M, 1] and [1, N], or transposed); bh: the query head (b * H + h). Entry (bh, i, j) is
    Philox-4x32 of the counter (j, i, bh, offset) under the key ``seed``: one random number per entry, the same
    whichever tile, kernel or orientation asks, so the backward's transposed tiles see the forward's mask."""
    zero = (rows + cols) * 0  # [M, N] int32: the tile's shape
    c0 = (cols + zero).to(tl.uint32)
    c1 = (rows + zero).to(tl.uint32)
    c2 = (zero + bh).to(tl.uint32)
    c3 = (zero + offset).to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(r) >= p_drop
