"""Plain functions behind lesson 08 (the backward pass, CPU): the course's reference forward
and backward, the deterministic two-pass variant, an autograd Function over them, the
backward tile walk (schedule and picture), and a tiny character-level model trained with
any attention function.

The forward is lesson 03's V2 (``lesson03.flash_attn_v2_ref``) with lesson 04's tile
classes (``lesson04.tile_class``): invisible tiles skipped, partial tiles masked, a row
that sees no key gives O = 0 and lse = -inf. The backward follows FlashAttention-2's
Algorithm 2: KV blocks outside, Q blocks inside, P recomputed from the saved lse.

References: Dao 2023, "FlashAttention-2", Algorithm 2 (backward); the Triton fused-attention
tutorial (the separate preprocess kernel for D = rowsum(dO * O)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import lesson04

__all__ = ["flash_attn_fwd", "attn_bwd_preprocess_ref", "flash_attn_bwd_ref", "flash_attn_bwd_two_pass",
           "FlashAttentionRef", "attention_bhtd", "p_memory", "p_traffic_time", "measured_rates", "BwdStep", "bwd_schedule",
           "render_bwd_step", "make_text", "CharData", "TinyGPT", "train", "plot_losses"]

NEG_INF = -math.inf


def _partial_mask(i0, j0, n, c, N, Nk, align):
    """bool [n, c]: which keys of the tile (rows i0.., keys j0..) each query may see."""
    off = lesson04.offset(N, Nk, align)
    rows = torch.arange(i0, i0 + n)[:, None]                      # [n, 1]
    cols = torch.arange(j0, j0 + c)[None, :]                      # [1, c]
    return cols <= rows + off                                     # [n, c]


def _class(causal, i0, j0, Br, Bc, N, Nk, align):
    return lesson04.tile_class(i0, j0, Br, Bc, N, Nk, align) if causal else "full"


# ------------------------------------------------------------------ forward (03 + 04)
def flash_attn_fwd(q, k, v, Br=16, Bc=16, causal=False, align="top_left"):
    """V2 forward for one head, with causal tile classes: returns (O [N, d], lse [N]).

    causal=False computes what ``lesson03.flash_attn_v2_ref`` computes; causal=True skips the
    invisible tiles and masks the partial ones (lesson 04). Empty rows: O = 0, lse = -inf.
    """
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    O = torch.zeros(N, v.shape[1], dtype=q.dtype)                # [N, d]
    lse = torch.full((N,), NEG_INF, dtype=q.dtype)               # [N]
    for i in range(0, N, Br):
        Qi = q[i:i + Br]                                          # [Br, d]
        n = Qi.shape[0]
        acc = torch.zeros(n, v.shape[1], dtype=q.dtype)           # [Br, d]
        m = torch.full((n,), NEG_INF, dtype=q.dtype)              # [Br]
        l = torch.zeros(n, dtype=q.dtype)                         # [Br]
        for j in range(0, Nk, Bc):
            cls = _class(causal, i, j, Br, Bc, N, Nk, align)
            if cls == "skip":
                continue
            Kj, Vj = k[j:j + Bc], v[j:j + Bc]                     # [Bc, d]
            S = Qi @ Kj.T * scale                                 # [Br, Bc]
            if cls == "partial":
                S = S.masked_fill(~_partial_mask(i, j, n, Kj.shape[0], N, Nk, align), NEG_INF)
            m_new = torch.maximum(m, S.amax(dim=1))               # [Br]
            m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # a row with nothing yet: 0
            P = torch.exp(S - m_safe[:, None])                    # [Br, Bc]
            alpha = torch.exp(m - m_safe)                         # [Br]
            l = alpha * l + P.sum(dim=1)
            acc = alpha[:, None] * acc + P @ Vj                   # [Br, d]
            m = m_new
        seen = l > 0
        O[i:i + Br] = torch.where(seen[:, None], acc / torch.where(seen, l, 1.0)[:, None], 0.0)
        lse[i:i + Br] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), NEG_INF)
    return O, lse


# ------------------------------------------------------------------ backward
def attn_bwd_preprocess_ref(o, do):
    """D = rowsum(dO * O): [N]. The backward's one extra pass, before the tile loops."""
    return (do * o).sum(dim=1)                                    # [N]


def flash_attn_bwd_ref(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left", kv_order=None):
    """FlashAttention-2's backward for one head: returns (dq, dk, dv).

    KV blocks outside: K_j, V_j loaded once, dK_j, dV_j accumulated locally and written once.
    Q blocks inside: P recomputed from lse, dQ_i accumulated in HBM (atomic adds on a GPU).
    ``kv_order`` (KV block numbers) visits the KV blocks in that order, as a GPU's thread
    blocks may finish in any order: dQ's sums then come in another order.
    """
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    D = attn_bwd_preprocess_ref(o, do)                            # [N], once
    dq = torch.zeros_like(q)                                      # [N, d]  in HBM, += per tile
    dk = torch.empty_like(k)                                      # [Nk, d] written once per block
    dv = torch.empty_like(v)                                      # [Nk, d]
    for j in (range(0, Nk, Bc) if kv_order is None else [b * Bc for b in kv_order]):
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]                         # [Bc, d], loaded once
        dKj = torch.zeros_like(Kj)                                # [Bc, d] in SRAM
        dVj = torch.zeros_like(Vj)                                # [Bc, d] in SRAM
        for i in range(0, N, Br):
            cls = _class(causal, i, j, Br, Bc, N, Nk, align)
            if cls == "skip":
                continue
            Qi, dOi = q[i:i + Br], do[i:i + Br]                   # [Br, d]
            lse_i, D_i = lse[i:i + Br], D[i:i + Br]               # [Br]
            S = Qi @ Kj.T * scale                                 # [Br, Bc]
            P = torch.exp(S - lse_i[:, None])                     # [Br, Bc], no max, no sum
            if cls == "partial":                                  # 0 where hidden (and on empty rows)
                P = torch.where(_partial_mask(i, j, Qi.shape[0], Kj.shape[0], N, Nk, align), P, 0.0)
            dVj += P.T @ dOi                                      # [Bc, d]
            dP = dOi @ Vj.T                                       # [Br, Bc]
            dS = P * (dP - D_i[:, None])                          # [Br, Bc]
            dq[i:i + Br] += dS @ Kj * scale                       # [Br, d], HBM read-add-write
            dKj += dS.T @ Qi * scale                              # [Bc, d]
        dk[j:j + Bc] = dKj                                        # written once
        dv[j:j + Bc] = dVj
    return dq, dk, dv


def flash_attn_bwd_two_pass(q, k, v, o, lse, do, Br=4, Bc=3, causal=False, align="top_left"):
    """The deterministic variant: a dK/dV pass (KV outside) and a separate dQ pass (Q outside).

    dQ_i lives in SRAM for its whole row and is written once: no atomics, the same bits on
    every run. The price: S and dP are computed twice (7 matmuls per tile instead of 5).
    """
    N, d = q.shape
    Nk = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    D = attn_bwd_preprocess_ref(o, do)                            # [N]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def tile(i, j, Qi, Kj, Vj, dOi):
        S = Qi @ Kj.T * scale                                     # [Br, Bc]
        P = torch.exp(S - lse[i:i + Br, None])                    # [Br, Bc]
        if _class(causal, i, j, Br, Bc, N, Nk, align) == "partial":
            P = torch.where(_partial_mask(i, j, Qi.shape[0], Kj.shape[0], N, Nk, align), P, 0.0)
        dP = dOi @ Vj.T                                           # [Br, Bc]
        return P, P * (dP - D[i:i + Br, None])                    # P, dS

    for j in range(0, Nk, Bc):                                    # pass 1: dK, dV
        Kj, Vj = k[j:j + Bc], v[j:j + Bc]
        dKj, dVj = torch.zeros_like(Kj), torch.zeros_like(Vj)
        for i in range(0, N, Br):
            if _class(causal, i, j, Br, Bc, N, Nk, align) == "skip":
                continue
            Qi, dOi = q[i:i + Br], do[i:i + Br]
            P, dS = tile(i, j, Qi, Kj, Vj, dOi)
            dVj += P.T @ dOi
            dKj += dS.T @ Qi * scale
        dk[j:j + Bc], dv[j:j + Bc] = dKj, dVj
    for i in range(0, N, Br):                                     # pass 2: dQ
        Qi, dOi = q[i:i + Br], do[i:i + Br]
        dQi = torch.zeros_like(Qi)                                # [Br, d] in SRAM
        for j in range(0, Nk, Bc):
            if _class(causal, i, j, Br, Bc, N, Nk, align) == "skip":
                continue
            Kj, Vj = k[j:j + Bc], v[j:j + Bc]
            _, dS = tile(i, j, Qi, Kj, Vj, dOi)
            dQi += dS @ Kj * scale
        dq[i:i + Br] = dQi                                        # written once
    return dq, dk, dv


class FlashAttentionRef(torch.autograd.Function):
    """The course's autograd Function: ``FlashAttentionRef.apply(q, k, v, causal, Br, Bc)``, one head."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, Br=16, Bc=16):
        o, lse = flash_attn_fwd(q, k, v, Br, Bc, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.Br, ctx.Bc = causal, Br, Bc
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd_ref(q, k, v, o, lse, do.contiguous(), ctx.Br, ctx.Bc, ctx.causal)
        return dq, dk, dv, None, None, None


def attention_bhtd(fn_class, q, k, v, causal=True, Br=16, Bc=16):
    """Apply a one-head Function to every (batch, head): q, k, v ``[B, H, T, d]`` -> ``[B, H, T, d]``."""
    B, H = q.shape[:2]
    return torch.stack([torch.stack([fn_class.apply(q[b, h], k[b, h], v[b, h], causal, Br, Bc)
                                     for h in range(H)]) for b in range(B)])


# ------------------------------------------------------------------ why not store P
def p_memory(N: int, heads: int = 32, d: int = 128, bytes_per=2, lse_bytes=4) -> dict:
    """Bytes per sequence and layer: the probabilities P [heads, N, N] against O [heads, N, d] + lse [heads, N]."""
    return dict(P=heads * N * N * bytes_per, O=heads * N * d * bytes_per, lse=heads * N * lse_bytes)


def p_traffic_time(d: int = 128, bytes_per=2, flops=None, bytes_per_s=None) -> dict:
    """Time per score (one element of the N x Nk matrix, one head), in seconds, at a FLOP rate and a bandwidth.

    ``matmul_fwd``: the forward's two matmuls, 4·d FLOPs per score; ``matmul_bwd``: the backward's five, 10·d.
    ``p_round_trip``: writing P once and reading it back once (2 accesses of ``bytes_per`` bytes).
    ``standard_fwd``: the N x N traffic of standard attention's forward (FlashAttention paper, Algorithm 0:
    S written, S read, P written, P read: 4 accesses). Defaults: the H200 datasheet (lesson 06's figures).
    """
    from ..lesson06 import H200_BF16_FLOPS, H200_BYTES_PER_S
    flops = H200_BF16_FLOPS if flops is None else flops
    bytes_per_s = H200_BYTES_PER_S if bytes_per_s is None else bytes_per_s
    return dict(matmul_fwd=4 * d / flops, matmul_bwd=10 * d / flops,
                p_round_trip=2 * bytes_per / bytes_per_s, standard_fwd=4 * bytes_per / bytes_per_s)


def measured_rates(res=None) -> dict:
    """The H200's measured bf16 matmul rate (FLOP/s) and copy bandwidth (bytes/s, read plus written), from the
    ceilings ``bench/bench.py`` records in ``bench/results/h200.json``, with that record's label; None if absent."""
    from ..results import load_results, results_label
    res = load_results() if res is None else res
    ceil = (res or {}).get("ceilings") or {}
    if not ceil.get("bf16_matmul_tflops") or not ceil.get("copy_gbs_read_plus_write"):
        return None
    return dict(flops=ceil["bf16_matmul_tflops"] * 1e12, bytes_per_s=ceil["copy_gbs_read_plus_write"] * 1e9,
                label=f"{results_label(res)} · {res.get('timing', '?')}")


# ------------------------------------------------------------------ the backward tile walk
@dataclass
class BwdStep:
    j: int             # KV block (outer loop)
    i: int             # Q block (inner loop)
    rows: range        # query rows of the tile
    cols: range        # key columns of the tile
    cls: str           # 'full' or 'partial' (skipped tiles are not steps)
    first: bool        # the first step of this KV block: K_j, V_j loaded now
    last: bool         # the last step of this KV block: dK_j, dV_j written now
    reads: dict        # running HBM element counts after this step
    writes: dict


def bwd_schedule(N: int, Nk: int, d: int, Br: int, Bc: int, causal: bool = False,
                 align: str = "top_left") -> list[BwdStep]:
    """Every computed tile of the backward, in order (KV outside, Q inside), with HBM element counts.

    Before the loops the preprocess reads O and dO and writes D (counted in the first step).
    Per KV block: read K_j, V_j; per tile: read Q_i, dO_i, lse_i, D_i and dQ_i, write dQ_i;
    at the block's end: write dK_j, dV_j. A KV block with no visible tile writes zeros.
    """
    reads = dict(o=N * d, do=N * d, q=0, k=0, v=0, lse=0, D=0, dq=0)
    writes = dict(D=N, dq=0, dk=0, dv=0)
    steps = []
    for bj, j0 in enumerate(range(0, Nk, Bc)):
        c = min(Bc, Nk - j0)
        tiles = [(bi, i0) for bi, i0 in enumerate(range(0, N, Br))
                 if _class(causal, i0, j0, Br, Bc, N, Nk, align) != "skip"]
        if tiles:
            reads["k"] += c * d
            reads["v"] += c * d
        for n_, (bi, i0) in enumerate(tiles):
            r = min(Br, N - i0)
            reads["q"] += r * d
            reads["do"] += r * d
            reads["lse"] += r
            reads["D"] += r
            reads["dq"] += r * d
            writes["dq"] += r * d
            last = n_ == len(tiles) - 1
            if last:
                writes["dk"] += c * d
                writes["dv"] += c * d
            steps.append(BwdStep(bj, bi, range(i0, i0 + r), range(j0, j0 + c),
                                 _class(causal, i0, j0, Br, Bc, N, Nk, align), n_ == 0, last,
                                 dict(reads), dict(writes)))
        if not tiles:
            writes["dk"] += c * d
            writes["dv"] += c * d
    return steps


def render_bwd_step(step: int, N: int = 10, Nk: int = 10, d: int = 4, Br: int = 4, Bc: int = 3,
                    causal: bool = True, align: str = "top_left"):
    """Draw the backward at ``step``: the tiles of dS (done, now, to do, skipped), dQ's rows
    (HBM, updated), dK/dV's columns (SRAM, accumulating), and what lives where. Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    steps = bwd_schedule(N, Nk, d, Br, Bc, causal, align)
    if not steps:
        raise ValueError("no tile is visible: nothing to draw")
    step = max(0, min(int(step), len(steps) - 1))
    s = steps[step]
    done = {(p.i, p.j) for p in steps[:step]}
    computed = {(p.i, p.j) for p in steps}
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw=dict(width_ratios=[1, 1.1]))
    for bi, i0 in enumerate(range(0, N, Br)):
        for bj, j0 in enumerate(range(0, Nk, Bc)):
            h, w = min(Br, N - i0), min(Bc, Nk - j0)
            if (bi, bj) == (s.i, s.j):
                fc, a, label = "tab:orange", 0.9, "dS now"
            elif (bi, bj) in done:
                fc, a, label = "tab:blue", 0.35, "done"
            elif (bi, bj) in computed:
                fc, a, label = "white", 1.0, ""
            else:
                fc, a, label = "lightgrey", 0.6, "skip"
            ax.add_patch(Rectangle((j0, i0), w, h, facecolor=fc, alpha=a, edgecolor="black", lw=1.2,
                                   hatch="//" if label == "skip" else None))
            ax.text(j0 + w / 2, i0 + h / 2, f"({bi},{bj})\n{label}", ha="center", va="center", fontsize=7)
    # dQ strip on the left (HBM), dK/dV strip below (SRAM while the block is live)
    ax.add_patch(Rectangle((-1.6, 0), 1, N, facecolor="white", edgecolor="black", lw=1))
    ax.add_patch(Rectangle((-1.6, s.rows.start), 1, len(s.rows), facecolor="tab:red", alpha=0.7))
    ax.text(-1.1, N + 0.6, "dQ\nHBM +=", ha="center", va="top", fontsize=7)
    ax.add_patch(Rectangle((0, N + 0.6), Nk, 1, facecolor="white", edgecolor="black", lw=1))
    if s.cols.start:                                  # the KV blocks before: dK, dV already written
        ax.add_patch(Rectangle((0, N + 0.6), s.cols.start, 1, facecolor="tab:green", alpha=0.25))
    ax.add_patch(Rectangle((s.cols.start, N + 0.6), len(s.cols), 1, facecolor="tab:green", alpha=0.7))
    ax.text(Nk + 0.2, N + 1.1, "dK, dV\n(SRAM; pale:\nwritten)", ha="left", va="center", fontsize=7)
    if causal:
        off = lesson04.offset(N, Nk, align)
        xs = [max(0, -off), min(Nk, N + off)]
        ax.plot(xs, [x - off for x in xs], color="black", lw=1, ls="--")
    ax.set_xlim(-1.8, Nk + 2.6)
    ax.set_ylim(N + 1.8, -0.8)
    ax.set_aspect("equal")
    ax.set_xlabel("key column (KV block j: outer loop)")
    ax.set_ylabel("query row (Q block i: inner loop)")
    ax.set_title(f"backward step {step + 1}/{len(steps)}: KV block j = {s.j}, Q block i = {s.i} ({s.cls})",
                 fontsize=9)
    rows, cols = f"{s.rows.start}:{s.rows.stop}", f"{s.cols.start}:{s.cols.stop}"
    r, c = len(s.rows), len(s.cols)
    lines = [
        "SRAM (this KV block):",
        f"  Kj, Vj = k[{cols}], v[{cols}]  [{c}, {d}]" + ("  loaded now" if s.first else "  kept"),
        f"  dKj, dVj  [{c}, {d}]  accumulating" + ("; written now" if s.last else ""),
        "SRAM (this tile):",
        f"  Qi, dOi = q[{rows}], do[{rows}]  [{r}, {d}]",
        f"  lse_i, D_i  [{r}]",
        f"  S, P = exp(S - lse_i){' masked' if s.cls == 'partial' else ''}, dP, dS  [{r}, {c}]",
        "this step:",
        "  dVj += P.T @ dOi          (SRAM)",
        "  dKj += dS.T @ Qi * scale  (SRAM)",
        f"  dq[{rows}] += dS @ Kj * scale  (HBM: read, add, write)",
        "",
        "HBM so far (elements):",
        "  read   q {q}  do {do}  o {o}  k {k}  v {v}".format(**s.reads),
        "  read   lse {lse}  D {D}  dq {dq}".format(**s.reads),
        "  write  D {D}  dq {dq}  dk {dk}  dv {dv}".format(**s.writes),
    ]
    tx.axis("off")
    tx.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8.5)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ train a tiny model
_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "her brother",
             "the fox", "our neighbour", "a tired child"]
_VERBS = ["sees", "likes", "follows", "finds", "helps", "watches", "calls", "meets"]
_OBJECTS = ["the ball", "a red box", "the river", "an apple", "the garden", "a green door", "the moon",
            "his hat", "the market"]
_ENDS = [".", " today.", " again.", " at night.", " in the rain."]


def make_text(n_sentences: int = 3000, seed: int = 0) -> str:
    """The training text, generated by the course (no file, no network): sentences from a tiny
    grammar, ``subject verb object ending``, drawn with a seeded generator."""
    g = torch.Generator().manual_seed(seed)

    def pick(words):
        return words[int(torch.randint(len(words), (1,), generator=g))]
    return " ".join(f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}{pick(_ENDS)}"
                    for _ in range(n_sentences))


class CharData:
    """Characters to integers, and seeded random batches of ``T + 1`` consecutive characters."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batches(self, steps: int, B: int, T: int, seed: int = 0):
        """``steps`` pairs (x, y) of ``[B, T]`` token ids, y shifted by one; the same for the same seed."""
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            ix = torch.randint(len(self.data) - T - 1, (B,), generator=g)
            x = torch.stack([self.data[i:i + T] for i in ix.tolist()])          # [B, T]
            y = torch.stack([self.data[i + 1:i + T + 1] for i in ix.tolist()])  # [B, T]
            yield x, y


def sdpa_causal(q, k, v):
    """PyTorch's attention, causal: q, k, v ``[B, H, T, d]``."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class TinyGPT(torch.nn.Module):
    """A small decoder-only transformer: token + position embeddings, ``layers`` pre-LN blocks
    (causal self-attention through ``attn(q, k, v)`` on ``[B, H, T, d]``, then an MLP), a head."""

    def __init__(self, vocab: int, T: int = 32, d_model: int = 32, heads: int = 2, layers: int = 2, attn=None):
        super().__init__()
        nn = torch.nn
        self.heads, self.attn = heads, attn or sdpa_causal
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(T, d_model)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(d_model), qkv=nn.Linear(d_model, 3 * d_model), proj=nn.Linear(d_model, d_model),
                ln2=nn.LayerNorm(d_model), mlp=nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                             nn.Linear(4 * d_model, d_model)))))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x):
        B, T = x.shape
        h = self.tok(x) + self.pos(torch.arange(T))                   # [B, T, C]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).chunk(3, dim=-1)      # [B, T, C] each
            q, k, v = (t.reshape(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
            a = self.attn(q, k, v)                                    # [B, H, T, d]
            h = h + blk["proj"](a.transpose(1, 2).reshape(B, T, -1))  # [B, T, C]
            h = h + blk["mlp"](blk["ln2"](h))
        return self.head(self.ln(h))                                  # [B, T, vocab]


def train(attn, data: CharData, steps: int = 200, B: int = 8, T: int = 32, lr: float = 3e-3, seed: int = 0,
          **model_kw) -> list[float]:
    """Train a fresh TinyGPT (weights from ``seed``) with ``attn``; the loss at every step.

    Two calls with the same seed and data start from the same weights and see the same
    batches: only the attention function differs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tensors this small gain nothing from threads, and lose a lot on a busy machine
    try:
        torch.manual_seed(seed)
        model = TinyGPT(data.vocab, T=T, attn=attn, **model_kw)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for x, y in data.batches(steps, B, T, seed=seed):
            logits = model(x)                                         # [B, T, vocab]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, data.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    finally:
        torch.set_num_threads(threads)


def plot_losses(ours, sdpa, label="your FlashAttentionFunction"):
    """Both loss curves on one axes, and their difference below."""
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw=dict(height_ratios=[2, 1]))
    steps = range(1, len(ours) + 1)
    a1.plot(steps, sdpa, lw=3, color="tab:blue", alpha=0.5, label="SDPA")
    a1.plot(steps, ours, lw=1, color="tab:orange", label=label)
    a1.set_ylabel("training loss (nats/char)")
    a1.legend()
    a1.set_title("a 2-layer character model, same seed, same batches")
    diff = [abs(a - b) for a, b in zip(ours, sdpa)]
    a2.semilogy(steps, [max(x, 1e-9) for x in diff], color="black", lw=1)
    a2.set_ylabel("|difference|\n(0 drawn at 1e-9)", fontsize=8)
    a2.set_xlabel("step")
    fig.tight_layout()
    return fig
