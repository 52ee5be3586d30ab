"""A small GPT trained with the course's ``flash_attention`` and, from the same seed, with SDPA.

    python3 bench/train_gpt.py [--steps 400] [--out DIR]        # on a CUDA GPU (bf16 autocast)
    python3 bench/train_gpt.py --cpu --tiny --out DIR            # a tiny run under the Triton interpreter

The model is a plain pre-norm decoder (token + position embeddings, ``n_layer`` blocks of causal
self-attention and a 4x MLP, tied output head), in the spirit of nanoGPT. The only difference between
the two runs is the attention call: ``helpers.kernels.backward.flash_attention(q, k, v, causal=True)``
or ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``. Same seed, same initial weights, same
batches. Data: the bytes of the course's own text (README, bench notes, the worked notebooks' cells),
read from this repository; no network. Writes <out>/train_gpt.json (loss per step, validation loss,
tokens per second, settings, versions) and <out>/train_gpt.png (both loss curves on one figure).
"""

import math
import os
import sys
import time

if "--cpu" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (TIMING, adamw_cosine, bench_ms, corpus_bytes, log, run_meta, save_figure, subplots,  # noqa: E402
                    train_step, training_cli, write_json)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helpers.kernels.backward import flash_attention  # noqa: E402

GPU_CONFIG = dict(n_layer=6, n_head=12, d_model=768, T=2048, batch=16, steps=300, lr=1e-3, warmup=30, eval_every=50,
                  eval_batches=4)
TINY_CONFIG = dict(n_layer=1, n_head=2, d_model=32, T=16, batch=2, steps=2, lr=3e-3, warmup=1, eval_every=2, eval_batches=1)


class Block(nn.Module):
    def __init__(self, d_model, n_head, attn):
        super().__init__()
        self.n_head, self.attn = n_head, attn
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=False), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model, bias=False))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # each [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2).contiguous()
                   for t in (q, k, v))  # each [B, H, T, d]
        if self.attn == "flash":
            y = flash_attention(q, k, v, causal=True)  # [B, H, T, d]
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, d]
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, d_model, T, attn, vocab=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(T, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, attn) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # [B, T, C]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))  # [B, T, vocab]
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def batches(data, T, batch, steps, seed, device):
    """The same list of (x, y) batches for both runs."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - T - 1, (steps, batch), generator=g)
    for row in starts:
        x = torch.stack([data[s:s + T] for s in row.tolist()])
        y = torch.stack([data[s + 1:s + T + 1] for s in row.tolist()])
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train(attn, cfg, data, val, device, dtype, seed=1234):
    torch.manual_seed(seed)
    model = GPT(cfg["n_layer"], cfg["n_head"], cfg["d_model"], cfg["T"], attn).to(device)
    opt, sched = adamw_cosine(model, cfg)
    use_amp = device == "cuda"
    losses, vals, t_start, timed_tokens, train_s = [], [], None, 0, 0.0
    skip = min(10, cfg["steps"] // 4)  # steps left out of the rate (compilation, autotuning)

    def evaluate():
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=use_amp):
            tot = [model(x, y).item() for x, y in batches(val, cfg["T"], cfg["batch"], cfg["eval_batches"], seed + 1, device)]
        model.train()
        return sum(tot) / len(tot)

    for step, (x, y) in enumerate(batches(data, cfg["T"], cfg["batch"], cfg["steps"], seed, device)):
        if step == skip:
            if device == "cuda":
                torch.cuda.synchronize()
            t_start = time.perf_counter()
        losses.append(train_step(model, opt, sched, device, dtype, x, y))
        if step >= skip:
            timed_tokens += x.numel()
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            if t_start is not None:  # evaluation stays out of the training rate
                if device == "cuda":
                    torch.cuda.synchronize()
                train_s += time.perf_counter() - t_start
            vals.append([step + 1, evaluate()])
            if t_start is not None:
                t_start = time.perf_counter()
            log(f"  {attn:>5} step {step + 1:>4} loss {losses[-1]:.4f} val {vals[-1][1]:.4f}")
    return {"loss": [round(v, 5) for v in losses], "val": [[s, round(v, 5)] for s, v in vals],
            "tokens_per_s": round(timed_tokens / train_s, 1), "timed_steps": cfg["steps"] - skip}


def attention_ms(cfg, dtype):
    """ms of one layer's attention, forward alone and forward + backward, at the training shape (CUDA)."""
    B, H, T = cfg["batch"], cfg["n_head"], cfg["T"]
    d = cfg["d_model"] // H
    q, k, v, do = (torch.randn(B, H, T, d, device="cuda", dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = {}
    for name, fn in (("flash", lambda: flash_attention(q, k, v, causal=True)),
                     ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
        fwd = bench_ms(fn)
        both = bench_ms(lambda: fn().backward(do), grad_to_none=[q, k, v])
        out[name] = {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both, 4)}
    return out


def plot(res, path):
    fig, ax = subplots(figsize=(7, 4))
    for name, style, label in (("flash", "-", "course flash_attention (Triton)"), ("sdpa", "--", "SDPA")):
        r = res["runs"][name]
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], style, lw=1,
                label=f"{label}: {r['tokens_per_s'] / 1e3:.0f}k tokens/s")
        if r["val"]:
            ax.plot(*zip(*r["val"]), "o" if name == "flash" else "x", ms=4, label=f"{label}, validation")
    c = res["config"]
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(f"GPT {c['n_layer']}L {c['n_head']}H d_model={c['d_model']} T={c['T']} B={c['batch']} "
                 f"({res['device_name']}, {res['date']})", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main():
    args, device, cfg, dtype = training_cli(__doc__, "train_gpt.py", GPU_CONFIG, TINY_CONFIG,
                                            "the tiny configuration (1 layer, T = 16, 2 steps)")
    raw = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    cut = int(0.9 * len(raw))
    data, val = raw[:cut], raw[cut:]
    meta = run_meta(torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)")
    res = {"config": cfg, "dtype": str(dtype).replace("torch.", ""), "device": device,
           "device_name": meta["gpu"], "torch": meta["torch"], "triton": meta["triton"], "date": meta["date"],
           "corpus_bytes": len(raw), "runs": {}}
    for attn in ("flash", "sdpa"):
        res["runs"][attn] = train(attn, cfg, data, val, device, dtype)
        log(f"{attn}: final loss {res['runs'][attn]['loss'][-1]:.4f}, "
              f"{res['runs'][attn]['tokens_per_s']:.0f} tokens/s")
    if device == "cuda":
        res["attention_ms_one_layer"] = attention_ms(cfg, dtype)
        log("attention, one layer at the training shape:", res["attention_ms_one_layer"])
    a, b = res["runs"]["flash"]["loss"], res["runs"]["sdpa"]["loss"]
    res["max_loss_diff"] = round(max(abs(x - y) for x, y in zip(a, b)), 6)
    res["speedup_tokens_per_s"] = round(res["runs"]["flash"]["tokens_per_s"] / res["runs"]["sdpa"]["tokens_per_s"], 3)
    if device == "cuda":
        res["attention_timing"] = TIMING
    write_json(os.path.join(args.out, "train_gpt.json"), res)
    plot(res, os.path.join(args.out, "train_gpt.png"))
    log(f"max |loss_flash - loss_sdpa| over steps: {res['max_loss_diff']}; tokens/s ratio flash/sdpa: "
          f"{res['speedup_tokens_per_s']}")


if __name__ == "__main__":
    main()
