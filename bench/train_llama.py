"""A Llama-style model trained on packed documents with the course's varlen kernels, with FlexAttention and with SDPA,
from the same seed.

    python3 bench/train_llama.py [--steps 200] [--out DIR]       # on a CUDA GPU (bf16 autocast)
    python3 bench/train_llama.py --cpu --tiny --out DIR           # a tiny run under the Triton interpreter

The model: RMSNorm, rotary position embeddings (RoPE, positions restart at every document), grouped-query
attention (4 query heads per KV head, head dim 128), a SwiGLU MLP, untied output head; 8 layers at context 4096
on a GPU. Data: the bytes of the course's own text (bench/common.py's ``corpus_bytes``) cut into documents of
mixed length (lognormal: median 256 bytes on a GPU, 8 in the tiny run, which has documents of length 1), packed
end to end into rows of T tokens, a row never splitting a document across rows (the last one is cut). Each token
predicts the next one of its own document; a document's last token predicts nothing.

The three runs differ only in the attention call and in what each builds once per step for all layers:

* ``course``: the batch as one packed stream, q ``[B*T, H, d]``, k, v ``[B*T, Hkv, d]``,
  ``helpers.kernels.varlen_backward.flash_attention_varlen(q, k, v, batch, causal=True)`` with ``batch =
  prepare_varlen(cu_seqlens)`` made once per step from the host's cu_seqlens (no sync; the FlashAttention
  library's ``flash_attn_varlen_func`` layout): no padding, no mask tensor, K and V never repeated;
* ``flex``: ``[B, H, T, d]``, ``torch.compile(flex_attention)`` with a document mask (same document and j <= i),
  its block mask from ``create_block_mask`` once per step, ``enable_gqa=True`` (what a user of PyTorch picks
  for packed documents);
* ``sdpa``: ``[B, H, T, d]`` with a boolean document mask ``[B, 1, T, T]`` made once per step, K and V repeated
  to H heads, ``F.scaled_dot_product_attention`` with its default dispatch (the flash backend takes no mask, so
  PyTorch picks another).

Same seed, same initial weights, same batches. After each run, the attention's share of a step: one layer's
attention forward and backward on that step's shapes and documents (do_bench), times the layers, plus the
per-step build, over the run's mean step time. Writes <out>/train_llama.json (loss per step, tokens per second,
the share, settings, versions) and <out>/train_llama.png (the loss curves). The tiny CPU run trains the course
and SDPA (FlexAttention has no backward on a CPU) and checks FlexAttention's forward loss on the first batch.
"""

import math
import os
import sys
import time

if "--cpu" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import (adamw_cosine, bench_ms, corpus_bytes, log, run_meta, save_figure, subplots,  # noqa: E402
                    train_step, training_cli, why, write_json)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helpers.kernels.varlen_backward import flash_attention_varlen, prepare_varlen  # noqa: E402

ATTENTIONS = ("course", "flex", "sdpa")

GPU_CONFIG = dict(n_layer=8, n_head=16, n_kv_head=4, head_dim=128, T=4096, batch=4, steps=200, lr=6e-4, warmup=20,
                  doc_median=256)
TINY_CONFIG = dict(n_layer=1, n_head=2, n_kv_head=1, head_dim=16, T=32, batch=2, steps=2, lr=3e-3, warmup=1,
                   doc_median=8)


# ----------------------------------------------------------------------------- data: packed documents


def documents(data: torch.Tensor, median: int, seed: int) -> list[tuple[int, int]]:
    """Cut the byte stream into consecutive documents of lognormal lengths: [(start, length)]."""
    g = torch.Generator().manual_seed(seed)
    docs, pos = [], 0
    while pos < len(data) - 1:
        n = max(1, int(math.exp(math.log(median) + 1.0 * torch.randn((), generator=g).item())))
        n = min(n, len(data) - 1 - pos)
        docs.append((pos, n))
        pos += n
    return docs


def packed_batches(data, docs, T, batch, steps, seed, device):
    """(x, y, pos, doc_id, cu_seqlens, max_len) per step, the same for both runs. x, y, pos, doc_id: [batch, T];
    y = -100 where a token has no next token in its document; cu_seqlens int32 [segments + 1] over the flat
    batch (row after row); doc_id numbers the segments of the flat batch."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        xs, ys, ps, ids, lens = [], [], [], [], []
        for _row in range(batch):
            i = int(torch.randint(0, len(docs), (), generator=g))
            filled = 0
            x, y, p, d = [], [], [], []
            while filled < T:
                start, n = docs[i % len(docs)]
                n = min(n, T - filled)                     # the row's last document is cut
                seg = data[start:start + n + 1].tolist()   # n tokens and the one after them
                x += seg[:n]
                y += seg[1:n] + [-100]                     # the last token of a segment predicts nothing
                p += list(range(n))
                d += [len(lens)] * n
                lens.append(n)
                filled += n
                i += 1
            xs.append(x), ys.append(y), ps.append(p), ids.append(d)
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
        yield (torch.tensor(xs, device=device), torch.tensor(ys, device=device), torch.tensor(ps, device=device),
               torch.tensor(ids, device=device), cu.to(device), max(lens))


# ----------------------------------------------------------------------------- the model


def rope(x, pos, base=10000.0):
    """Rotary embedding of x [..., T, heads, d] at positions pos [..., T] (pairs (i, i + d/2) rotated)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) / (d // 2))  # [d/2]
    ang = pos.float()[..., None] * inv                                                         # [..., T, d/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]                                # [..., T, 1, d/2]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


def _document_mask_mod():
    """FlexAttention's mask_mod for packed causal documents, reading the step's document ids ``holder[0]`` [B, T]:
    one function for every step, so that a new batch is no new compile (dynamo guards the ids' shape only)."""
    holder = [None]

    def mask_mod(b, h, q_idx, kv_idx):
        doc = holder[0]
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)
    return holder, mask_mod


_DOC_IDS, _doc_mask_mod = _document_mask_mod()
_flex = {}  # the compiled flex_attention, made on first use


def flex_fn(device):
    from torch.nn.attention.flex_attention import flex_attention
    if device != "cuda":  # eager on a CPU (forward only there)
        return flex_attention
    if "fn" not in _flex:
        _flex["fn"] = torch.compile(flex_attention, dynamic=False)
    return _flex["fn"]


def step_context(attn, doc_id, cu, max_len, device):
    """What one step builds once for every layer: the course's prepared batch (from the host's cu_seqlens: no sync),
    FlexAttention's block mask, SDPA's dense mask [B, 1, T, T] (same document and j <= i)."""
    B, T = doc_id.shape
    if attn == "course":
        return prepare_varlen(cu, device=device)
    if attn == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        _DOC_IDS[0] = doc_id
        return create_block_mask(_doc_mask_mod, B, None, T, T, device=device)
    i = torch.arange(T, device=doc_id.device)
    return ((doc_id[:, :, None] == doc_id[:, None, :]) & (i[None, :] <= i[:, None])[None])[:, None]


def attention(attn, q, k, v, ctx):
    """Causal attention within each document: q [B, T, H, d], k, v [B, T, Hkv, d] -> [B, T, H * d]."""
    B, T, H, d = q.shape
    if attn == "course":
        flat = [t.reshape(B * T, t.shape[2], d).contiguous() for t in (q, k, v)]  # [B*T, heads, d]
        return flash_attention_varlen(*flat, ctx, causal=True).view(B, T, H * d)
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, d]
    if attn == "flex":
        y = flex_fn(q.device.type)(qs, ks, vs, block_mask=ctx, enable_gqa=True)
    else:
        g = H // k.shape[2]
        y = F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1),
                                           attn_mask=ctx)
    return y.transpose(1, 2).reshape(B, T, H * d)


class Block(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        C, self.H, self.Hkv, self.d = cfg["n_head"] * cfg["head_dim"], cfg["n_head"], cfg["n_kv_head"], cfg["head_dim"]
        self.attn = attn
        self.n1, self.n2 = nn.RMSNorm(C), nn.RMSNorm(C)
        self.wq = nn.Linear(C, self.H * self.d, bias=False)
        self.wkv = nn.Linear(C, 2 * self.Hkv * self.d, bias=False)
        self.wo = nn.Linear(self.H * self.d, C, bias=False)
        hidden = 256 * math.ceil(8 * C / 3 / 256)
        self.w13 = nn.Linear(C, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, C, bias=False)

    def forward(self, x, pos, ctx):
        B, T, C = x.shape
        h = self.n1(x)
        q = rope(self.wq(h).view(B, T, self.H, self.d), pos)                     # [B, T, H, d]
        k, v = self.wkv(h).view(B, T, 2, self.Hkv, self.d).unbind(2)             # each [B, T, Hkv, d]
        k = rope(k, pos)
        x = x + self.wo(attention(self.attn, q, k, v, ctx))
        a, b = self.w13(self.n2(x)).chunk(2, -1)
        return x + self.w2(F.silu(a) * b)


class Llama(nn.Module):
    def __init__(self, cfg, attn, vocab=256):
        super().__init__()
        C = cfg["n_head"] * cfg["head_dim"]
        self.tok = nn.Embedding(vocab, C)
        self.blocks = nn.ModuleList(Block(cfg, attn) for _ in range(cfg["n_layer"]))
        self.norm = nn.RMSNorm(C)
        self.head = nn.Linear(C, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg["n_layer"]) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x, y, pos, doc_id, cu, max_len):
        ctx = step_context(self.blocks[0].attn, doc_id, cu, max_len, x.device.type)  # once per step, every layer
        h = self.tok(x)
        for blk in self.blocks:
            h = blk(h, pos, ctx)
        logits = self.head(self.norm(h))                                          # [B, T, vocab]
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)


# ----------------------------------------------------------------------------- training


def train(attn, cfg, data, docs, device, dtype, seed=1234):
    torch.manual_seed(seed)
    model = Llama(cfg, attn).to(device)
    opt, sched = adamw_cosine(model, cfg)
    losses, t_start, timed_tokens, segments = [], None, 0, []
    skip = min(10, cfg["steps"] // 4)  # steps left out of the rate (compilation, autotuning)
    steps = list(packed_batches(data, docs, cfg["T"], cfg["batch"], cfg["steps"], seed, "cpu"))  # built before timing
    step_s, seen = [], None  # each timed step's wall time (train_step ends in a sync); the kernels' state at skip
    for step, (x, y, pos, doc_id, cu, max_len) in enumerate(steps):
        x, y, pos, doc_id = (t.to(device, non_blocking=True) for t in (x, y, pos, doc_id))  # cu: on the host
        if step == skip:
            if device == "cuda":
                torch.cuda.synchronize()
            t_start = t_last = time.perf_counter()
            seen = _kernel_state() if device == "cuda" else None
        losses.append(train_step(model, opt, sched, device, dtype, x, y, pos, doc_id, cu, max_len))
        segments.append(len(cu) - 1)
        if step >= skip:
            timed_tokens += x.numel()
            step_s.append(time.perf_counter() - t_last)
            t_last = time.perf_counter()
        if (step + 1) % max(1, cfg["steps"] // 10) == 0:
            log(f"  {attn:>6} step {step + 1:>4} loss {losses[-1]:.4f}")
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t_start
    out = {"loss": [round(v, 5) for v in losses], "tokens_per_s": round(timed_tokens / seconds, 1),
           "timed_steps": cfg["steps"] - skip, "documents_per_step": round(sum(segments) / len(segments), 1),
           "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}
    if step_s:
        ordered = sorted(step_s)
        out.update(step_ms_median=round(1e3 * ordered[len(ordered) // 2], 2), step_ms_max=round(1e3 * ordered[-1], 2))
    if seen is not None:  # what the timed steps compiled or timed anew (each costs seconds: none expected)
        now = _kernel_state()
        out.update({f"{name}_while_timed": (now[name] - seen[name] if None not in (now[name], seen[name]) else None)
                    for name in now})
    if device == "cuda":
        out.update(attention_share(attn, cfg, steps[-1], seconds / (cfg["steps"] - skip), device, dtype))
    return out


def _kernel_state():
    """{"varlen_compiles": compiled variants Triton holds of the packed kernels, "varlen_tile_choices": shape classes
    whose tiles were timed}: taken when the timing starts and at the end of a run."""
    from helpers.kernels import varlen as kv, varlen_backward as kb
    try:
        dev = torch.cuda.current_device()
        compiles = sum(len(fn.device_caches[dev][0]) for fn in (kv._attn_fwd_varlen, kb._bwd_dkdv_varlen,
                                                                kb._bwd_dq_varlen, kb._bwd_preprocess))
    except (AttributeError, IndexError, KeyError, TypeError):  # another Triton's cache layout
        compiles = None
    return {"varlen_compiles": compiles, "varlen_tile_choices": len(kv.chosen_configs())}


def attention_share(attn, cfg, step, step_s, device, dtype):
    """The attention's part of a step: one layer's attention forward and backward (do_bench, on this step's
    documents and shapes, random q, k, v), times the layers, plus the step's build (batch, block mask or mask)."""
    x, _, _, doc_id, cu, max_len = step
    B, T = x.shape
    g = torch.Generator(device=device).manual_seed(0)
    shape = lambda heads: (B, T, heads, cfg["head_dim"])  # noqa: E731
    q = torch.randn(shape(cfg["n_head"]), device=device, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(shape(cfg["n_kv_head"]), device=device, dtype=dtype, generator=g).requires_grad_()
            for _ in range(2))
    dy = torch.randn(B, T, cfg["n_head"] * cfg["head_dim"], device=device, dtype=dtype, generator=g)
    doc_id = doc_id.to(device)
    ctx = step_context(attn, doc_id, cu, max_len, device)
    layer_ms = bench_ms(lambda: attention(attn, q, k, v, ctx).backward(dy), grad_to_none=[q, k, v])
    def build():  # the step's set-up; the course's batch with the maps its kernels used (built on first use)
        made = step_context(attn, doc_id, cu, max_len, device)
        for key in (ctx.built_maps() if attn == "course" else ()):
            made.block_map(*key)
    build_ms = bench_ms(build)
    per_step = cfg["n_layer"] * layer_ms + build_ms
    return {"attention_ms_per_layer": round(layer_ms, 4), "step_build_ms": round(build_ms, 4),
            "step_ms": round(1e3 * step_s, 3), "attention_share": round(per_step / (1e3 * step_s), 4)}


def flex_forward_check(cfg, data, docs, device):
    """The first batch's loss with FlexAttention's document mask, forward only, beside SDPA's (same weights): the
    tiny CPU run's check of the flex path (FlexAttention has no backward on a CPU)."""
    batch = next(packed_batches(data, docs, cfg["T"], cfg["batch"], 1, 1234, device))
    out = {}
    with torch.no_grad():
        for attn in ("flex", "sdpa"):
            torch.manual_seed(1234)
            out[attn] = Llama(cfg, attn).to(device)(*batch).item()
    return round(abs(out["flex"] - out["sdpa"]), 7)


def plot(res, path):
    fig, ax = subplots(figsize=(7, 4))
    for name, style, label in (("course", "-", "course flash_attention_varlen (Triton)"),
                               ("flex", ":", "FlexAttention, document block mask"),
                               ("sdpa", "--", "SDPA, dense document mask")):
        r = res["runs"].get(name)
        if r is None:
            continue
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], style, lw=1,
                label=f"{label}: {r['tokens_per_s'] / 1e3:.0f}k tokens/s")
    c = res["config"]
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(f"Llama-style {c['n_layer']}L H={c['n_head']} Hkv={c['n_kv_head']} d={c['head_dim']} T={c['T']} "
                 f"B={c['batch']}, packed documents ({res['device_name']}, {res['date']})", fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main():
    args, device, cfg, dtype = training_cli(__doc__, "train_llama.py", GPU_CONFIG, TINY_CONFIG,
                                            "the tiny configuration (1 layer, T = 32, 2 steps)")
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    docs = documents(data, cfg["doc_median"], seed=7)
    meta = run_meta(torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)")
    res = {"config": cfg, "dtype": str(dtype).replace("torch.", ""), "device": device,
           "device_name": meta["gpu"], "torch": meta["torch"], "triton": meta["triton"], "date": meta["date"],
           "corpus_bytes": len(data), "documents": len(docs),
           "document_lengths": {"min": min(n for _, n in docs), "median": sorted(n for _, n in docs)[len(docs) // 2],
                                "max": max(n for _, n in docs)},
           "parameters": sum(p.numel() for p in Llama(cfg, "course").parameters()), "runs": {}}
    runs = ATTENTIONS if device == "cuda" else ("course", "sdpa")  # FlexAttention has no backward on a CPU
    for attn in runs:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            res["runs"][attn] = train(attn, cfg, data, docs, device, dtype)
        except Exception as e:  # noqa: BLE001 - recorded; the other runs still go
            if device != "cuda":
                raise
            import traceback
            log(f"{attn}: {why(e, 300)}\n{traceback.format_exc()[-2000:]}")
            res.setdefault("errors", {})[attn] = why(e, 300)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            continue
        log(f"{attn}: final loss {res['runs'][attn]['loss'][-1]:.4f}, {res['runs'][attn]['tokens_per_s']:.0f} tokens/s"
            + (f", attention {100 * res['runs'][attn]['attention_share']:.1f}% of a step"
               if "attention_share" in res["runs"][attn] else ""))
        write_json(os.path.join(args.out, "train_llama.json"), res)  # after every run
    if not {"course", "sdpa"} <= set(res["runs"]):
        write_json(os.path.join(args.out, "train_llama.json"), res)
        sys.exit(f"train_llama.py: a run failed: {res.get('errors')}")
    if device != "cuda":
        res["flex_forward_loss_diff_vs_sdpa"] = flex_forward_check(cfg, data, docs, device)
    a, b = res["runs"]["course"]["loss"], res["runs"]["sdpa"]["loss"]
    res["max_loss_diff"] = round(max(abs(x - y) for x, y in zip(a, b)), 6)
    tail = max(1, len(a) // 10)
    res["last_tenth_mean_loss"] = {name: round(sum(r["loss"][-tail:]) / tail, 5) for name, r in res["runs"].items()}
    res["speedup_tokens_per_s"] = round(res["runs"]["course"]["tokens_per_s"] / res["runs"]["sdpa"]["tokens_per_s"], 3)
    if "flex" in res["runs"]:
        f = res["runs"]["flex"]["loss"]
        res["max_loss_diff_flex"] = round(max(abs(x - y) for x, y in zip(a, f)), 6)
        res["max_loss_diff_flex_vs_sdpa"] = round(max(abs(x - y) for x, y in zip(f, b)), 6)
        res["speedup_vs_flex_tokens_per_s"] = round(res["runs"]["course"]["tokens_per_s"]
                                                    / res["runs"]["flex"]["tokens_per_s"], 3)
    write_json(os.path.join(args.out, "train_llama.json"), res)
    plot(res, os.path.join(args.out, "train_llama.png"))
    log(f"max |loss_course - loss_sdpa| over steps: {res['max_loss_diff']}; mean loss over the last tenth: "
        f"{res['last_tenth_mean_loss']}")
    log(f"{'run':>7} {'tokens/s':>10} {'x course':>9} {'attention share':>16} {'final loss':>11}")
    for name, r in res["runs"].items():
        share = f"{100 * r['attention_share']:.1f}%" if "attention_share" in r else "-"
        log(f"{name:>7} {r['tokens_per_s']:>10.0f} {res['runs']['course']['tokens_per_s'] / r['tokens_per_s']:>9.3f} "
            f"{share:>16} {r['loss'][-1]:>11.4f}")
    if "flex" in res["runs"]:
        log(f"course / flex tokens per second: {res['speedup_vs_flex_tokens_per_s']} (target >= 1.0); max loss "
            f"difference course-flex {res['max_loss_diff_flex']}, flex-sdpa {res['max_loss_diff_flex_vs_sdpa']} "
            f"(run-to-run noise: the bf16 runs differ by about the latter)")


if __name__ == "__main__":
    main()
