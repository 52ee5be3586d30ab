"""The Gluon backward for Hopper (helpers/kernels/gluon_backward.py) without a GPU: it compiles for sm_90 with the
design it claims (read off the PTX), and its host checks say what is wrong before any GPU work. Its numbers come
from ``python -m helpers.kernels.gluon_backward`` on an sm_90 GPU, not from here."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, LaunchRecorder
from test_lesson11_gluon import _gluon_hopper_api

_COMPILE = """
import json
from helpers.kernels.gluon_backward import compile_backward_for_sm90
feats = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity", "ex2.approx",
         "wgmma.wait_group.sync.aligned 1", "%nctaid.x", "atom.")
reduce = "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add"
flip = {"dkdv": {"PIPELINE": True}, "dq": {"PIPELINE": False}}     # the other loop of each kernel at d = 128
out = {}
for d, dt, causal, mode, cfg in ((128, "fp16", False, "separate", None), (64, "fp16", True, "separate", None),
                                 (128, "bf16", True, "separate", flip),
                                 (128, "bf16", True, "atomic", None), (64, "fp16", False, "atomic", None)):
    for kind, ptx in compile_backward_for_sm90(d=d, dtype=dt, causal=causal, dq_mode=mode, config=cfg).items():
        key = f"{d} {dt}{' causal' if causal else ''} {mode}{' flip' if cfg else ''} {kind}"
        out[key] = [f for f in feats + (reduce,) if f in ptx]
print(json.dumps(out))
"""


@pytest.mark.skipif(bool(_gluon_hopper_api()), reason=_gluon_hopper_api() or "ok")
def test_gluon_backward_compiles_for_sm90():
    """Triton's compiler, no GPU, in a child process with the interpreter off: the preprocess (the course's tl
    kernel), the dK/dV kernel and the dQ kernel for d = 64 and 128, bf16 and fp16, causal and not. Both Gluon
    kernels load by TMA through mbarriers, run wgmma asynchronously with a wait that leaves one group in flight (S
    or S^T done while dP or dP^T still runs), take one ex2 per score and use no atomics (dQ is its own kernel:
    deterministic). Causal dQ counts its query block from the grid's end (heaviest first). Both loops of each kernel
    (PIPELINE on and off: the default at d = 128, d = 64's and the flip) compile, each with its causal band. With
    dq_mode="atomic" there is no dQ kernel: the dK/dV kernel adds its fp32 dQ tiles by the TMA's reduce, still no
    per-element atomics. (Every branch of the kernels is compiled by one of these five; dtype and d are no
    branches: bf16 at d = 64, or causal at d = 128 with the default loops, would compile nothing new.)"""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    gluon = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity", "ex2.approx",
             "wgmma.wait_group.sync.aligned 1"]
    want = {}
    for cfg in ("128 fp16 separate", "64 fp16 causal separate", "128 bf16 causal separate flip"):
        want[f"{cfg} preprocess"] = []
        want[f"{cfg} dkdv"] = gluon
        want[f"{cfg} dq"] = gluon + (["%nctaid.x"] if "causal" in cfg else [])
    for cfg in ("128 bf16 causal", "64 fp16"):
        want[f"{cfg} atomic preprocess"] = []
        want[f"{cfg} atomic dkdv"] = gluon + ["cp.reduce.async.bulk.tensor.2d.global.shared::cta.add"]
    assert found == want, found


# ------------------------------------------------------------------ the host checks, on the CPU
def _module():
    why = _gluon_hopper_api()
    if why:
        pytest.skip(why)
    from helpers.kernels import gluon_backward
    return gluon_backward


@pytest.mark.parametrize("case, kwargs, err, words", [
    ("list q", {}, TypeError, "q must be a torch.Tensor"),
    ("float32", {}, TypeError, "bfloat16 or float16"),
    ("d = 96", {}, ValueError, "must be one of 64, 128"),
    ("3 KV heads for 2", {}, ValueError, "H = 2 query heads must be a multiple of Hkv = 3 KV heads"),
    ("v shape", {}, ValueError, "v must have k's shape"),
    ("o shape", {}, ValueError, "o must be a tensor of q's shape (1, 2, 8, 64)"),
    ("do dtype", {}, TypeError, "do must have q's dtype"),
    ("lse float64", {}, ValueError, "lse must be a float32 tensor of shape (1, 2, 8)"),
    ("lse shape", {}, ValueError, "lse must be a float32 tensor of shape (1, 2, 8)"),
    ("cpu", {}, ValueError, "gluon_backward needs an sm_90 GPU"),
    ("cpu", {"causal": 1}, TypeError, "causal must be True or False"),
    ("cpu", {"causal": True, "align": "bottom-right"}, ValueError, "align must be 'top_left' or 'bottom_right'"),
    ("cpu", {"sm_scale": "0.1"}, TypeError, "sm_scale must be a Python number"),
])
def test_gluon_backward_says_what_is_wrong_before_any_gpu_work(case, kwargs, err, words):
    import torch
    G = _module()
    bf = dict(dtype=torch.bfloat16)
    q, k, v, o, do = (torch.zeros(1, 2, 8, 64, **bf) for _ in range(5))
    lse = torch.zeros(1, 2, 8)
    inputs = {"list q": (do, [[0.0]], k, v, o, lse),
              "float32": (do.float(), q.float(), k.float(), v.float(), o.float(), lse),
              "d = 96": tuple(torch.zeros(1, 2, 8, 96, **bf) for _ in range(5)) + (lse,),
              "3 KV heads for 2": (do, q, torch.zeros(1, 3, 8, 64, **bf), torch.zeros(1, 3, 8, 64, **bf), o, lse),
              "v shape": (do, q, k, torch.zeros(1, 2, 9, 64, **bf), o, lse),
              "o shape": (do, q, k, v, o[:, :, :7], lse), "do dtype": (do.half(), q, k, v, o, lse),
              "lse float64": (do, q, k, v, o, lse.double()), "lse shape": (do, q, k, v, o, lse[:, :1]),
              "cpu": (do, q, k, v, o, lse)}[case]
    with pytest.raises(err, match=re.escape(words)) as e:
        G.gluon_backward(*inputs, **kwargs)
    assert str(e.value).startswith("gluon_backward"), str(e.value)


@pytest.mark.parametrize("config, words", [
    ({"dkdv": {"BLOCK_N": 96}}, "config['dkdv']['BLOCK_N'] must be a power of two in [16, 256], got 96"),
    ({"dq": {"BLOCK_M": 64, "num_warps": 8}}, "num_warps must be 4 or 8 and divide BLOCK_M = 64"),
    ({"dkdv": {"BLOCK_M": 128, "NUM_STAGES": 4}}, "KiB of shared memory at d = 128"),
    ({"dkdv": {"block_m": 64}}, "takes BLOCK_M, BLOCK_N, NUM_STAGES, num_warps, PIPELINE"),
    ({"dq": {"NUM_STAGES": 1}}, "must be 1..8 (2..8 with PIPELINE), got 1"),
    ({"dq": {"PIPELINE": 1}}, "config['dq']['PIPELINE'] must be True or False"),
    ({"fwd": {}}, "config keys are 'dkdv' and 'dq'"),
    ({"dkdv": {"NUM_STAGES": 4}, "dq_mode": "atomic"}, "KiB of shared memory at d = 128 with atomic dQ"),
    ({"dkdv": {"BLOCK_M": 32}, "dq_mode": "atomic"}, "dq_mode='atomic' needs config['dkdv']['BLOCK_M'] >= 64"),
    ({"dq_mode": "atomics"}, "dq_mode must be one of 'separate', 'atomic' or None"),
])
def test_tile_overrides_are_checked_on_the_host(config, words):
    G = _module()
    config = dict(config)
    mode = config.pop("dq_mode", None)
    with pytest.raises(ValueError, match=re.escape(words)):
        G._tiles(128, config, mode)


def test_default_tiles_fit_sm90_and_an_override_replaces_only_what_it_names():
    G = _module()
    for d in G.BLOCKS:
        tiles = G._tiles(d)
        for kind, (bm, bn, st, warps, _) in tiles.items():
            assert G._smem_bytes(kind, d, bm, bn, st) <= G.SMEM_LIMIT
            assert warps == (bn if kind == "dkdv" else bm) // 16      # one warp per 16 accumulator rows
    t = G._tiles(128, {"dkdv": {"NUM_STAGES": 2, "PIPELINE": True}})
    assert t["dkdv"] == (64, 128, 2, 8, True) and t["dq"] == G._tiles(128)["dq"]
    assert G._tiles(128, {"dq": {"NUM_STAGES": 1, "PIPELINE": False}})["dq"][2:] == (1, 8, False)
    for d in G.BLOCKS:                                    # atomic dQ's dS^T and two fp32 dQ tiles fit too
        bm, bn, st, _, pipe = G._tiles(d, dq_mode="atomic")["dkdv"]
        assert G._smem_bytes("dkdv", d, bm, bn, st, atomic=True) <= G.SMEM_LIMIT
        assert not pipe and not G._tiles(d, {"dkdv": {"PIPELINE": True}}, "atomic")["dkdv"][4]   # never defers
    # the arithmetic the BLOCKS comment states, d = 128: 160 KiB for both kernels, 208 for dK/dV with atomic dQ
    assert [G._smem_bytes(kind, 128, *G.BLOCKS[128][kind][:3]) // 1024 for kind in ("dkdv", "dq")] == [160, 160]
    assert G._smem_bytes("dkdv", 128, *G.BLOCKS[128]["dkdv_atomic"][:3], atomic=True) // 1024 == 208


# ------------------------------------------------------------------ the self-test's harness, with a stand-in kernel
def test_selftest_harness_passes_exact_gradients_and_fails_wrong_ones(monkeypatch):
    """gluon_backward_selftest on the CPU with gluon_backward replaced: float64 gradients rounded to the dtype pass
    every case (rows that see no key included), gradients off by a little fail, and a mode that raises is a failed
    row while the other mode's rows still run."""
    import torch
    G = _module()
    cases = [(1, 2, 2, 9, 9, False, "top_left"), (1, 4, 2, 13, 5, True, "bottom_right"),   # 8 rows see no key
             (1, 4, 1, 5, 13, True, "top_left")]

    def exact(do, q, k, v, o, lse, causal=False, sm_scale=None, align="top_left", dq_mode=None, config=None):
        _, _, dq, dk, dv = G._grads_reference(q, k, v, do, causal, align)
        if dq_mode == "atomic":
            raise RuntimeError("planted")
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    monkeypatch.setattr(G, "gluon_backward", exact)
    res = G.gluon_backward_selftest(shapes=cases, dims=(16,), dtypes=(torch.bfloat16,), device="cpu")
    rows = {(r["dq_mode"], r["shape"]): r for r in res["rows"]}
    assert res["cases"] == 6 and not res["ok"]
    for c in cases:
        assert rows[("separate", c[:5])]["ok"], rows[("separate", c[:5])]
        assert rows[("atomic", c[:5])]["error"] == "RuntimeError: planted"
    assert rows[("separate", cases[1][:5])]["empty_rows"] == 4 * 8 and rows[("separate", cases[1][:5])]["empty_ok"]
    assert all(res["worst"][n] <= 1 for n in ("dq", "dk", "dv"))
    lines = [G._fmt(r) for r in res["rows"]]                # the lines `python -m ...gluon_backward` prints
    assert sum(x.startswith("ok  ") for x in lines) == 3 and sum(x.startswith("FAIL") for x in lines) == 3
    assert "empty rows 32 (dq 0)" in lines[res["rows"].index(rows[("separate", cases[1][:5])])]

    def off(*args, **kwargs):
        dq, dk, dv = exact(*args, **{**kwargs, "dq_mode": None})
        return dq, dk, dv + 0.1

    monkeypatch.setattr(G, "gluon_backward", off)
    res = G.gluon_backward_selftest(shapes=cases, dims=(16,), dtypes=(torch.bfloat16,), device="cpu",
                                    dq_modes=["separate"])
    assert not res["ok"] and all(not r["ok"] and r["dq_ok"] and r["dk_ok"] and not r["dv_ok"] for r in res["rows"])


# ------------------------------------------------------------------ the host path up to the launches, on the CPU
@pytest.mark.parametrize("causal, mode", [(False, "separate"), (True, "separate"), (True, "atomic")])
def test_host_path_binds_every_kernel_argument(monkeypatch, causal, mode):
    """gluon_backward's launches, with the kernels replaced by recorders and the device check skipped (CPU tensors):
    every parameter of each kernel is bound exactly once, the grids are the documented ones (causal: heaviest
    first), the TMA descriptors' boxes are the tiles, and atomic dQ launches no dQ kernel and returns the cast of a
    zeroed fp32 buffer."""
    import torch
    from helpers.kernels import backward
    G = _module()
    calls = []
    monkeypatch.setattr(G, "_check_backward_inputs", lambda *a: None)
    for mod, name in ((G, "_bwd_dkdv"), (G, "_bwd_dq"), (backward, "_bwd_preprocess")):
        monkeypatch.setattr(mod, name, LaunchRecorder(getattr(mod, name).fn, calls))
    B, H, Hkv, N, Nk, d = 2, 8, 2, 1000, 300, 128
    bf = dict(dtype=torch.bfloat16)
    q, o, do = (torch.zeros(B, H, N, d, **bf) for _ in range(3))
    k, v = (torch.zeros(B, Hkv, Nk, d, **bf) for _ in range(2))
    dq, dk, dv = G.gluon_backward(do, q, k, v, o, torch.zeros(B, H, N), causal=causal, align="bottom_right",
                                  dq_mode=mode)
    assert dq.shape == q.shape and dq.dtype == q.dtype and dk.shape == dv.shape == k.shape
    names = [c[0] for c in calls]
    assert names == ["_bwd_preprocess", "_bwd_dkdv"] + (["_bwd_dq"] if mode == "separate" else [])
    tiles = G._tiles(d, dq_mode=mode)
    _, grid, a = calls[1]
    bm, bn, st, warps, pipe = tiles["dkdv"]
    assert grid == (3, B * Hkv)                                               # cdiv(300, 128) key blocks
    assert (a["BLOCK_M"], a["BLOCK_N"], a["NUM_STAGES"], a["num_warps"], a["PIPELINE"]) == (bm, bn, st, warps, pipe)
    assert (a["N"], a["Nk"], a["group"], a["diag"], a["CAUSAL"]) == (N, Nk, 4, Nk - N if causal else 0, causal)
    assert a["q_desc"].block_shape == [bm, d] and a["k_desc"].block_shape == [bn, d]
    assert a["q_desc"].shape == (B * H * N, d) and a["k_desc"].shape == (B * Hkv * Nk, d)
    assert a["DQ_ATOMIC"] == (mode == "atomic") and (a["dq_desc"] is None) == (mode == "separate")
    if mode == "atomic":
        assert a["dq_desc"].block_shape == [bm, d] and a["dq_desc"].shape == (B * H * N, d)
        assert torch.equal(dq, torch.zeros_like(q))                          # nothing added: the kernel is a stub
    else:
        _, grid, a = calls[2]
        bm, bn, st, warps, pipe = tiles["dq"]
        assert grid == (8, B * H)                                             # cdiv(1000, 128) query blocks
        assert a["q_desc"].block_shape == [bm, d] and a["k_desc"].block_shape == [bn, d] and a["PIPELINE"] == pipe
