"""Plain functions behind lesson 08's GPU section: the float64 gradient reference, the recorded H200
backward benchmark and the GPT training record.

Nothing here imports Triton at module level (``helpers.lesson08.check_gpu`` imports this file whenever
a notebook runs ``from helpers import check``). The recorded results are ``bench/results/h200.json``
(rows under ``"backward"`` and ``"backward_gqa"``, written by ``bench/bench_bwd.py``), ``bench/results/train_gpt.json``
(written by ``bench/train_gpt.py``) and ``bench/results/train_llama.json`` (``bench/train_llama.py``); each table
and summary here names the GPU, versions, date and statistic of its record.
"""
from __future__ import annotations

from .. import reference, triton_mode
from ..results import RESULTS, RESULTS_DIR, load_json, load_results, plot_tflops, results_label, section_rows
from ..results import fmt as _f
from ..results import geomean_ratio as _geomean_ratio

__all__ = ["NO_TRITON", "require_triton", "LOG2E", "reference_grads", "load_results", "load_training", "results_label", "backward_rows",
           "backward_table", "geomean_ratio", "plot_backward", "plot_training", "training_summary",
           "backward_summary", "gqa_summary", "load_llama", "llama_summary", "RESULTS", "TRAINING", "LLAMA"]

LOG2E = reference.LOG2E  # log2(e): the kernels' scores and lse are in base 2


def reference_grads(q, k, v, do, causal=False, sm_scale=None):
    """(O, dq, dk, dv) in float64 by autograd, on the CPU, q ``[B, H, N, d]``, k, v ``[B, H, Nk, d]``; causal top-left.

    A row that sees no key has O = 0 and zero gradients (the course's convention), never NaN.
    ``helpers.reference.attention_grads`` does the work.
    """
    q, k, v, do = (t.detach().cpu() for t in (q, k, v, do))
    mask = reference.causal_mask(q.shape[-2], k.shape[-2]) if causal else None     # [N, Nk]
    o, _, dq, dk, dv = reference.attention_grads(q, k, v, do, mask=mask, scale=sm_scale)
    return o, dq, dk, dv


# ------------------------------------------------------------------ recorded results
def backward_rows(res, dtype=None, d=None, causal=None):
    return section_rows(res, "backward", dtype, d, causal)


def geomean_ratio(res, other: str, min_N: int = 2048, **filters):
    """Geometric mean over backward rows with N >= min_N of triton_tflops / ``other`` (None if none)."""
    return _geomean_ratio(res, "backward", other, min_N, **filters)


_IMPLS = [("triton_tflops", "Triton (course)", "-o"), ("sdpa_flash_tflops", "SDPA flash", "--s"),
          ("sdpa_cudnn_tflops", "SDPA cuDNN", "--^"), ("flex_tflops", "FlexAttention", ":v")]


def plot_backward(res):
    """TFLOP/s of the backward against N, one panel per (dtype, d, causal)."""
    return plot_tflops(res, "backward", _IMPLS, "no backward rows in these results (run bench/bench_bwd.py on a GPU)")


def plot_training(rec):
    """Both loss curves of the GPT training record on one figure, tokens/s in the legend."""
    import matplotlib.pyplot as plt
    if not rec or "runs" not in rec:
        raise ValueError("no training record (run bench/train_gpt.py on a GPU)")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, style, label in (("flash", "-", "course flash_attention"), ("sdpa", "--", "SDPA")):
        r = rec["runs"][name]
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], style, lw=1,
                label=f"{label} ({r['tokens_per_s'] / 1e3:.0f}k tokens/s)")
        if r.get("val"):
            ax.plot(*zip(*r["val"]), "o" if name == "flash" else "x", ms=4, label=f"{label}, validation")
    c = rec["config"]
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(f"GPT {c['n_layer']} layers, {c['n_head']} heads, d_model {c['d_model']}, context {c['T']} · "
                 f"{rec['device_name']} · torch {rec['torch']} · triton {rec['triton']} · {rec['date']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def training_summary(rec) -> str:
    f, s = rec["runs"]["flash"], rec["runs"]["sdpa"]
    return (f"final loss {f['loss'][-1]:.4f} (flash_attention) vs {s['loss'][-1]:.4f} (SDPA); largest per-step "
            f"difference {rec['max_loss_diff']:.4f}; {f['tokens_per_s']:.0f} vs {s['tokens_per_s']:.0f} tokens/s "
            f"({rec['speedup_tokens_per_s']:.2f}x" + (f", over the last {f['timed_steps']} steps" if f.get("timed_steps") else "")
            + f"); {rec.get('device_name', '?')}, torch {rec.get('torch', '?')}, "
            f"triton {rec.get('triton', '?')}, {rec.get('date', '?')}")


# ------------------------------------------------------------------ without Triton (macOS, Windows)
NO_TRITON = ("Triton is not installed in this Python (PyPI has it for Linux only, not for macOS or Windows), "
             "so this section's kernels cannot run here: below are the backward results and the training run "
             "recorded on an NVIDIA H200, and README.md (section 3) says how to run the kernels on Linux or in WSL2.")


def require_triton():
    """Return if Triton can run here; otherwise say so, show the recorded H200 backward results
    and training run, and stop Run All (``helpers.triton_mode.require_triton``: one line, no traceback)."""
    triton_mode.require_triton(NO_TRITON, _show_recorded, what="the rest of this section")


def _show_recorded():
    res, rec, llama = load_results(), load_training(), load_llama()
    if res is not None and res.get("backward"):
        print()
        print(backward_summary(res))
        print(gqa_summary(res))
        print()
        print(backward_table(res))
    if rec is not None:
        print()
        print(training_summary(rec))
    if llama is not None:
        print(llama_summary(llama))


TRAINING = RESULTS_DIR / "train_gpt.json"
LLAMA = RESULTS_DIR / "train_llama.json"


def load_training(path=TRAINING):
    """The GPT training record (bench/train_gpt.py), or None when none is recorded."""
    return load_json(path)


# lesson 08: the backward
def backward_table(res) -> str:
    """A plain-text table of the backward rows: TFLOP/s (FLOPs = 2.5 x 4BHN²d, halved when causal)."""
    lines = ["backward alone, TFLOP/s (FLOPs = 2.5·4·B·H·N²·d, halved when causal); " + results_label(res, "backward"),
             f"{'dtype':>8} {'d':>4} {'causal':>6} {'N':>6} {'triton':>7} {'flash':>6} {'cudnn':>6} {'flex':>6} "
             f"{'t/flash':>7} {'t/cudnn':>7} {'err/sdpa':>8} {'ok':>3}"]
    for r in section_rows(res, "backward"):
        t, f, c = r.get("triton_tflops"), r.get("sdpa_flash_tflops"), r.get("sdpa_cudnn_tflops")
        lines.append(f"{r['dtype']:>8} {r['d']:>4} {str(bool(r['causal'])):>6} {r['N']:>6} {_f(t):>7} {_f(f):>6} "
                     f"{_f(c):>6} {_f(r.get('flex_tflops')):>6} {_f(t / f if t and f else None, 2):>7} "
                     f"{_f(t / c if t and c else None, 2):>7} {_f(r.get('err_ratio'), 2):>8} "
                     f"{'✓' if r.get('pass') else '✗':>3}")
    return "\n".join(lines)


def _meta(res, section) -> str:
    meta = (res or {}).get(f"{section}_meta") or {}
    return results_label(res, section) + (f" · {meta['timing']}" if meta.get("timing") else "")


def backward_summary(res, min_N: int = 2048) -> str:
    """The backward rows in a few lines: geometric means over N >= min_N of Triton / SDPA flash and Triton / SDPA
    cuDNN, how many of all the rows Triton is the faster on, and the label and statistic."""
    rows = backward_rows(res)
    if not rows:
        return "backward: no rows in this record (not measured yet)"
    n_long = sum(r["N"] >= min_N for r in rows)
    lines = [f"backward alone, geomean over N >= {min_N} ({n_long} rows; fp16 and bf16, d 64 and 128, causal and not):"]
    for other, name in (("sdpa_flash_tflops", "flash"), ("sdpa_cudnn_tflops", "cuDNN")):
        g = geomean_ratio(res, other, min_N)
        pairs = [(r["triton_tflops"], r[other]) for r in rows if r.get("triton_tflops") and r.get(other)]
        lines.append(f"  Triton / SDPA {name}: " + ("—" if g is None else f"{g:.2f}x")
                     + f"; Triton the faster on {sum(t > o for t, o in pairs)} of {len(pairs)} rows (all N)")
    lines.append(f"  every row checked first: {sum(bool(r.get('pass')) for r in rows)} of {len(rows)} within the rule")
    lines.append("  " + _meta(res, "backward"))
    return "\n".join(lines)


def gqa_summary(res) -> str:
    """The GQA backward rows (``"backward_gqa"``): their shapes, the range of Triton / SDPA's flash backward with
    ``enable_gqa=True`` and of Triton / the course's own backward on K and V repeated to H heads; label, statistic."""
    rows = (res or {}).get("backward_gqa") or []
    if not rows:
        return "GQA backward: no rows in this record (not measured yet)"
    sdpa = [r["triton_tflops"] / r["sdpa_flash_gqa_tflops"] for r in rows]
    rep = [r["triton_tflops"] / r["triton_repeated_kv_tflops"] for r in rows]
    shape = (f"H = {'/'.join(str(h) for h in sorted({r['H'] for r in rows}))}, Hkv = "
             f"{' or '.join(str(h) for h in sorted({r['Hkv'] for r in rows}))}, d = "
             f"{'/'.join(str(d) for d in sorted({r['d'] for r in rows}))}, "
             f"{'/'.join(sorted({r['dtype'] for r in rows}))}, N {min(r['N'] for r in rows)} to "
             f"{max(r['N'] for r in rows)}, causal and not; {len(rows)} rows, {sum(bool(r['pass']) for r in rows)} pass")
    return (f"GQA backward ({shape}):\n"
            f"  Triton / SDPA flash with enable_gqa=True: {min(sdpa):.2f}x to {max(sdpa):.2f}x\n"
            f"  Triton / the course's backward on K and V repeated to H heads: {min(rep):.2f}x to {max(rep):.2f}x\n"
            f"  " + _meta(res, "backward_gqa"))


def load_llama(path=LLAMA):
    """The Llama-style training record (bench/train_llama.py), or None when none is recorded."""
    return load_json(path)


def llama_summary(rec) -> str:
    """One paragraph of the Llama-style training record: the model, the run, tokens/s of each attention (the course's
    packed path, FlexAttention's document mask, SDPA's dense document mask), each attention's share of a step, the
    loss gaps."""
    if not rec or "runs" not in rec:
        return "Llama-style training: no record (run bench/train_llama.py on a GPU)"
    c, runs = rec["config"], rec["runs"]
    f, s, x = runs["course"], runs["sdpa"], runs.get("flex")
    share = lambda r: f", attention {r['attention_share']:.0%} of a step" if r.get("attention_share") else ""  # noqa: E731
    text = (f"Llama-style model: {c['n_layer']} layers, {rec['parameters'] / 1e6:.0f}M parameters, "
            f"GQA {c['n_head']}:{c['n_kv_head']}, d = {c['head_dim']}, context {c['T']}, {rec['dtype']}, "
            f"{c['steps']} steps on packed documents, over the last {f['timed_steps']} steps: flash_attention_varlen "
            f"{f['tokens_per_s'] / 1e3:.0f}k tokens/s{share(f)}")
    if x:
        text += (f"; FlexAttention with a document block mask {x['tokens_per_s'] / 1e3:.0f}k{share(x)} (the course "
                 f"{f['tokens_per_s'] / x['tokens_per_s']:.2f}x)")
    text += (f"; SDPA with a boolean document mask {s['tokens_per_s'] / 1e3:.0f}k{share(s)} (the course "
             f"{rec['speedup_tokens_per_s']:.2f}x); losses within {rec['max_loss_diff']:.3f} nats/byte of SDPA's at every "
             f"step; one run each; {rec['device_name']}, torch {rec['torch']}, triton {rec['triton']}, {rec['date']}")
    return text