"""Lesson 06 (Flash-Decoding): the solutions pass, the stubs fail strict, planted bugs are named."""
import math

import numpy as np
import pytest
import torch

from conftest import notebook_namespace, rejects
from helpers import check
from helpers import lesson06 as L

NB = "06_flash_decoding"


@pytest.fixture(scope="module")
def sol():
    return notebook_namespace(NB)


# ------------------------------------------------------------------ solution, stubs
# ------------------------------------------------------------------ combine_splits: planted bugs
def combine_mean(o_parts, lse_parts):                       # planted: no LSE weights
    return o_parts.mean(0), torch.logsumexp(lse_parts, 0)


def combine_nan_when_all_empty(o_parts, lse_parts):         # planted: exp(-inf - -inf)
    lse = torch.logsumexp(lse_parts, 0)
    return (torch.exp(lse_parts - lse)[:, :, None] * o_parts).sum(0), lse


def combine_lse_max(o_parts, lse_parts):
    m = lse_parts.amax(0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_parts - m_safe)
    return (w[:, :, None] * o_parts).sum(0) / w.sum(0).clamp(min=1e-30)[:, None], m


def combine_no_max(o_parts, lse_parts):                     # exp(lse_s) overflows
    w = torch.exp(lse_parts)
    return (w[:, :, None] * o_parts).sum(0) / w.sum(0)[:, None], torch.log(w.sum(0))


def combine_other_way(o_parts, lse_parts):                  # correct: softmax over splits
    lse = torch.logsumexp(lse_parts, 0)                       # [H]
    w = torch.softmax(lse_parts, dim=0).nan_to_num(0.0)       # [S, H]
    return torch.einsum("sh,shd->hd", w, o_parts), lse


def test_combine_mean_rejected(sol):
    rejects(check.combine_splits, combine_mean, "plain mean", "exp(lse_s - lse)")


def test_combine_nan_all_empty_rejected(sol):
    rejects(check.combine_splits, combine_nan_when_all_empty, "every split", "NaN")


def test_combine_lse_max_rejected():
    rejects(check.combine_splits, combine_lse_max, "logsumexp")


def test_combine_overflow_rejected():
    rejects(check.combine_splits, combine_no_max, "subtract the largest lse_s")


def test_combine_other_way_passes(strict):
    check.combine_splits(combine_other_way)


# ------------------------------------------------------------------ flash_decode: planted bugs
def _decode(q, k, v, num_splits, combine, chunk_rule=None, kv_of=None, per_query_head=False, whole=False,
            guard=True):
    H, d = q.shape
    Hkv, Nk, _ = k.shape
    G = H // Hkv
    chunk = chunk_rule(Nk, num_splits) if chunk_rule else max(1, math.ceil(Nk / num_splits))
    o_parts = torch.zeros(num_splits, H, d)
    lse_parts = torch.full((num_splits, H), -math.inf)
    for s in range(num_splits):
        a, b = min(s * chunk, Nk), min((s + 1) * chunk, Nk)
        if whole:
            a, b = (0, Nk) if s == 0 else (0, 0)
        if a == b and guard:
            continue
        for h in range(H):
            kv = kv_of(h, H, Hkv) if kv_of else h // G
            Kj, Vj = k[kv, a:b], v[kv, a:b]
            S = q[h] @ Kj.T / math.sqrt(d)                     # [n]
            m = S.max()
            P = torch.exp(S - m)
            o_parts[s, h] = P @ Vj / P.sum()
            lse_parts[s, h] = m + torch.log(P.sum())
    return combine(o_parts, lse_parts)


def decode_floor_chunk(q, k, v, num_splits=4):              # planted: fails when num_splits > Nk
    Nk = k.shape[1]
    chunk = Nk // num_splits
    H, d = q.shape
    G = H // k.shape[0]
    o_parts, lse_parts = [], []
    for a in range(0, Nk, chunk):                            # step 0 when num_splits > Nk
        S = (q.reshape(k.shape[0], G, d) @ k[:, a:a + chunk].transpose(1, 2)) / math.sqrt(d)
        lse_parts.append(torch.logsumexp(S, -1).reshape(H))
        o_parts.append((torch.softmax(S, -1) @ v[:, a:a + chunk]).reshape(H, d))
    return combine_other_way(torch.stack(o_parts), torch.stack(lse_parts))


def test_more_splits_than_keys_rejected():
    rejects(check.flash_decode, decode_floor_chunk, "more splits than keys")


def test_no_guard_for_empty_splits_is_named():
    def no_guard(q, k, v, num_splits=4):                     # planted: an empty split's max raises
        return _decode(q, k, v, num_splits, combine_other_way, guard=False)
    msg = rejects(check.flash_decode, no_guard, "more splits than keys", "some splits hold nothing",
                  "if start >= end")
    assert "ragged" not in msg


def test_round_robin_rejected(sol):
    def rr(q, k, v, num_splits=4):
        return _decode(q, k, v, num_splits, sol["combine_splits"], kv_of=lambda h, H, Hkv: h % Hkv)
    rejects(check.flash_decode, rr, "round-robin", "h // (H // Hkv)")


def test_mean_combine_in_decode_rejected():
    def bad(q, k, v, num_splits=4):
        return _decode(q, k, v, num_splits, combine_mean)
    rejects(check.flash_decode, bad, "averaged")


def test_dropped_tail_rejected(sol):
    def bad(q, k, v, num_splits=4):
        return _decode(q, k, v, num_splits, sol["combine_splits"], chunk_rule=lambda n, s: max(1, n // s))
    rejects(check.flash_decode, bad, "dropped")


def test_per_query_head_reads_rejected(sol):
    """Right answers, but K and V re-read for every query head of a group: GQA's saving is lost."""
    def bad(q, k, v, num_splits=4):
        return _decode(q, k, v, num_splits, sol["combine_splits"])
    rejects(check.flash_decode, bad, "read once per split", "G times")


def test_no_split_rejected(sol):
    """Right answers, but the whole cache in one block per head: no split at all."""
    def bad(q, k, v, num_splits=4):
        H, d = q.shape
        G = H // k.shape[0]
        o, lse = [], []
        for g in range(k.shape[0]):
            S = q[g * G:(g + 1) * G] @ k[g].T / math.sqrt(d)   # [G, Nk]
            lse.append(torch.logsumexp(S, -1))
            o.append(torch.softmax(S, -1) @ v[g])
        return torch.cat(o), torch.cat(lse)
    rejects(check.flash_decode, bad, "whole cache")


def test_python_lists_rejected(sol):
    """Right answers from Python lists: splits, GQA groups and the merge, all in Python floats."""
    def lists(q, k, v, num_splits=4):
        H, d = q.shape
        Hkv, Nk, _ = k.shape
        G = H // Hkv
        Q, K, V = q.tolist(), k.tolist(), v.tolist()
        chunk = max(1, math.ceil(Nk / num_splits))
        O, L = [], []
        for h in range(H):
            parts = []
            for a in range(0, Nk, chunk):
                s = [sum(x * y for x, y in zip(Q[h], K[h // G][j])) / math.sqrt(d) for j in range(a, min(a + chunk, Nk))]
                m = max(s)
                p = [math.exp(x - m) for x in s]
                o = [sum(pj * V[h // G][a + j][c] for j, pj in enumerate(p)) / sum(p) for c in range(d)]
                parts.append((o, m + math.log(sum(p))))
            lse = max(l for _, l in parts)
            lse += math.log(sum(math.exp(l - lse) for _, l in parts))
            O.append([sum(math.exp(l - lse) * o[c] for o, l in parts) for c in range(d)])
            L.append(lse)
        return torch.tensor(O, dtype=q.dtype), torch.tensor(L, dtype=q.dtype)
    rejects(check.flash_decode, lists, "out of torch", "Python numbers")


def test_decode_other_way_passes(sol, strict):
    """Vectorised over KV heads (all groups at once) and torch.tensor_split for the splits."""
    def other(q, k, v, num_splits=4):
        H, d = q.shape
        Hkv, Nk, _ = k.shape
        Q = q.reshape(Hkv, H // Hkv, d)                         # [Hkv, G, d]
        o_parts = torch.zeros(num_splits, H, d)
        lse_parts = torch.full((num_splits, H), -math.inf)
        for s, idx in enumerate(torch.arange(Nk).tensor_split(num_splits)):
            if len(idx) == 0:
                continue
            a, b = int(idx[0]), int(idx[-1]) + 1
            S = Q @ k[:, a:b].transpose(1, 2) / math.sqrt(d)    # [Hkv, G, n]
            lse_parts[s] = torch.logsumexp(S, -1).reshape(H)
            o_parts[s] = (torch.softmax(S, -1) @ v[:, a:b]).reshape(H, d)
        return sol["combine_splits"](o_parts, lse_parts)
    check.flash_decode(other)


# ------------------------------------------------------------------ flash_decode_paged: planted bugs
def _paged(q, k_pages, v_pages, block_table, seqlen, num_splits, lookup, tail=True, gather_all=False):
    H, d = q.shape
    _, ps, Hkv, _ = k_pages.shape
    n_pages = math.ceil(seqlen / ps)
    rows_k, rows_v = [], []
    for p in range(n_pages):
        n = min(ps, seqlen - p * ps) if tail else ps
        rows_k.append(k_pages[lookup(block_table, p), :n])
        rows_v.append(v_pages[lookup(block_table, p), :n])
    K = torch.cat(rows_k).transpose(0, 1)                       # [Hkv, seqlen, d]: the whole cache
    V = torch.cat(rows_v).transpose(0, 1)
    Q = q.reshape(Hkv, H // Hkv, d)
    S = Q @ K.transpose(1, 2) / math.sqrt(d)
    return (torch.softmax(S, -1) @ V).reshape(H, d), torch.logsumexp(S, -1).reshape(H)


def test_wrong_page_lookup_rejected():
    def bad(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        return _paged(q, k_pages, v_pages, block_table, seqlen, num_splits, lookup=lambda t, p: p)
    rejects(check.flash_decode_paged, bad, "block_table[p]")


def test_junk_tail_rejected():
    def bad(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        return _paged(q, k_pages, v_pages, block_table, seqlen, num_splits,
                      lookup=lambda t, p: int(t[p]), tail=False)
    rejects(check.flash_decode_paged, bad, "last page")


def test_contiguous_copy_rejected():
    """Right answers, but the whole cache copied into one contiguous tensor first."""
    def bad(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        return _paged(q, k_pages, v_pages, block_table, seqlen, num_splits, lookup=lambda t, p: int(t[p]))
    rejects(check.flash_decode_paged, bad, "contiguous copy")


def paged_copied_with_numpy(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
    """Right answers: the pages gathered into a contiguous cache by numpy's fancy indexing, then decoded."""
    ps, Hkv, d = k_pages.shape[1:]
    pages = np.asarray(block_table[:-(-seqlen // ps)]).astype(np.int64)
    k, v = (torch.from_numpy(np.asarray(t)[pages].reshape(-1, Hkv, d)[:seqlen].transpose(1, 0, 2).copy())
            for t in (k_pages, v_pages))
    return L.flash_decode_ref(q, k, v, num_splits)


def paged_copied_page_by_page_with_numpy(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
    ps, Hkv, d = k_pages.shape[1:]
    k, v = (np.concatenate([t.numpy()[int(p)] for p in block_table[:-(-seqlen // ps)]])[:seqlen]
            for t in (k_pages, v_pages))
    return L.flash_decode_ref(q, *(torch.from_numpy(np.ascontiguousarray(t.transpose(1, 0, 2))) for t in (k, v)),
                              num_splits)


@pytest.mark.parametrize("fn", [paged_copied_with_numpy, paged_copied_page_by_page_with_numpy])
def test_contiguous_copy_made_by_numpy_rejected(fn):
    rejects(check.flash_decode_paged, fn, "as large as the whole sequence's K", "contiguous copy")


def test_paged_round_robin_rejected(sol):
    def bad(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        H, d = q.shape
        Hkv = k_pages.shape[2]
        perm = [h % Hkv * (H // Hkv) + h // Hkv for h in range(H)]   # head h gets KV head h % Hkv
        O, lse = sol["flash_decode_paged"](q[perm], k_pages, v_pages, block_table, seqlen, num_splits)
        inv = torch.argsort(torch.tensor(perm))
        return O[inv], lse[inv]
    rejects(check.flash_decode_paged, bad, "round-robin")


def test_paged_other_way_passes(sol, strict):
    """Online softmax page by page within each split (lesson 03 style), splits of whole pages."""
    def other(q, k_pages, v_pages, block_table, seqlen, num_splits=4):
        H, d = q.shape
        _, ps, Hkv, _ = k_pages.shape
        G = H // Hkv
        Q = q.reshape(Hkv, G, d)
        n_pages = -(-seqlen // ps)
        per = max(1, -(-n_pages // num_splits))
        o_parts = torch.zeros(num_splits, H, d)
        lse_parts = torch.full((num_splits, H), -math.inf)
        for s in range(num_splits):
            m = torch.full((Hkv, G), -math.inf)
            l = torch.zeros(Hkv, G)
            acc = torch.zeros(Hkv, G, d)
            pages = range(s * per, min((s + 1) * per, n_pages))
            for p in pages:
                n = min(ps, seqlen - p * ps)
                Kp = k_pages[int(block_table[p]), :n].transpose(0, 1)    # [Hkv, n, d]
                Vp = v_pages[int(block_table[p]), :n].transpose(0, 1)
                S = Q @ Kp.transpose(1, 2) / math.sqrt(d)               # [Hkv, G, n]
                m_new = torch.maximum(m, S.amax(-1))
                alpha = torch.exp(m - m_new)
                P = torch.exp(S - m_new[..., None])
                l = l * alpha + P.sum(-1)
                acc = acc * alpha[..., None] + P @ Vp
                m = m_new
            if len(pages):
                o_parts[s] = (acc / l[..., None]).reshape(H, d)
                lse_parts[s] = (m + torch.log(l)).reshape(H)
        return sol["combine_splits"](o_parts, lse_parts)
    check.flash_decode_paged(other)


# ------------------------------------------------------------------ plain functions behind plots/widgets
def test_split_bounds():
    assert L.split_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert L.split_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)] + [(3, 3)] * 5
    assert L.split_bounds(1, 1) == [(0, 1)]
    for Nk in (1, 7, 64, 65):
        for S in (1, 3, 8, 100):
            b = L.split_bounds(Nk, S)
            assert len(b) == S and b[0][0] == 0 and max(e for _, e in b) == Nk
            assert all(b[i][1] == b[i + 1][0] for i in range(S - 1))


def test_work_units_waves_and_splits():
    assert L.work_units(1, 32) == 32
    assert L.work_units(2, 32, num_splits=4) == 256
    assert L.work_units(1, 32, Nq=4096) == 32 * 32
    assert L.waves(132) == (1, 1.0)
    n, eff = L.waves(133)
    assert n == 2 and abs(eff - 133 / 264) < 1e-12
    assert L.suggest_splits(8, 32, 8192) == 1                  # 256 blocks already fill the SMs
    s = L.suggest_splits(1, 32, 8192)
    assert s > 1 and L.waves(32 * s)[1] > 0.8
    assert L.suggest_splits(1, 8, 100) == 1                    # one key block: nothing to split


def test_kv_bytes_and_time():
    cfg = L.MODELS["Llama-3-8B (GQA)"]
    assert L.kv_bytes_per_token(**cfg) == 2 * 32 * 8 * 128 * 2 == 131072
    t = L.decode_kv_time_s(8192, B=1, **cfg)
    assert abs(t - 8192 * 131072 / 4.8e12) < 1e-15


def test_make_paged_cache_roundtrip():
    k, v = torch.randn(2, 13, 3), torch.randn(2, 13, 3)
    kp, vp, table, seqlen = L.make_paged_cache(k, v, page_size=4, extra_pages=2, seed=1)
    assert kp.shape == (6, 4, 2, 3) and table.dtype == torch.int32 and seqlen == 13
    assert len(set(table.tolist())) == 4
    for t in range(13):
        assert torch.equal(kp[table[t // 4], t % 4], k[:, t])
        assert torch.equal(vp[table[t // 4], t % 4], v[:, t])
    assert (kp[table[3], 1:] == 50.0).all()                    # junk past seqlen


def test_render_explorer_and_plots():
    import matplotlib.pyplot as plt
    units, n_waves, eff, bounds = L.render_explorer(B=2, H=40, Nk=10, num_splits=4)
    assert units == 320 and n_waves == 3 and abs(eff - 320 / 396) < 1e-12
    assert bounds == L.split_bounds(10, 4)
    units, n_waves, _, bounds = L.render_explorer(B=1, H=1, Nk=3, num_splits=8)
    assert units == 8 and n_waves == 1 and sum(a == b for a, b in bounds) == 5
    L.plot_work_units()
    L.plot_decode_time()
    L.plot_paged_cache(torch.tensor([2, 0]), 5, 4, 4)
    w = L.plot_split_weights(torch.tensor([[0.0, -math.inf], [math.log(3.0), -math.inf]]), head=0)
    assert torch.allclose(w, torch.tensor([0.25, 0.75], dtype=torch.float64))
    w = L.plot_split_weights(torch.tensor([[0.0, -math.inf], [math.log(3.0), -math.inf]]), head=1)
    assert (w == 0).all()
    plt.close("all")


@pytest.mark.parametrize("name", ["combine_splits", "flash_decode", "flash_decode_paged"])
def test_course_references_pass_the_checkers(name, strict, capsys):
    """The references the notebook falls back on (yours_or_reference) are themselves right answers."""
    getattr(check, name)(getattr(L, f"{name}_ref"))
    assert f"✅ {name}" in capsys.readouterr().out
