"""Context parallelism: exact attention across sequence chunks, training parity, bytes, memory.

Every cp run with cp > 1 has dp x cp > 1, so it needs the data-parallel optimizer
(`fivefold.parallel.data_parallel.DataParallelAdamW`). Until that module exists, the pool
functions here install `SummingAdamW` (below, test-only): the replicated AdamW plus a plain
sum of every gradient over dp x cp (expert parameters: over expert data parallel). As soon
as data_parallel is importable the real optimizer is used and the stand-in is never touched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import Layout, load_config
from fivefold.layout import LayoutError, validate
from fivefold.parallel.context_parallel import (
    CORES,
    analytic_cp_bytes,
    block_backward,
    block_forward,
    capacity_slot_offsets,
    chunk_count,
    local_chunks,
    local_positions,
    merge_block,
)

# ----------------------------------------------------------------------------- pure logic


def test_zigzag_and_contiguous_positions_cover_the_sequence_once():
    for algorithm in CORES:
        for cp in (2, 3, 4):
            seq = 2 * cp * 5
            parts = [local_positions(algorithm, cp, r, seq) for r in range(cp)]
            assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))
            assert all(len(p) == seq // cp for p in parts)
    assert local_positions("ring", 2, 0, 8).tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of 4
    assert local_positions("ring", 2, 1, 8).tolist() == [2, 3, 4, 5]
    assert local_positions("allgather", 2, 1, 8).tolist() == [4, 5, 6, 7]


def _reference_attention(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


def test_online_softmax_blocks_match_full_attention():
    """Blocks of keys merged by log-sum-exp, and their backward, equal one causal attention."""
    torch.manual_seed(0)
    B, Hq, Hkv, T, d, n = 2, 4, 2, 12, 8, 3
    q, k, v = (torch.randn(B, h, T, d, dtype=torch.float64, requires_grad=True) for h in (Hq, Hkv, Hkv))
    ref = _reference_attention(q, k, v)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    blocks = [slice(i * T // n, (i + 1) * T // n) for i in range(n)]
    with torch.no_grad():
        out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
        pairs = [(i, j) for i in range(n) for j in range(i + 1)]
        for i, j in pairs:
            o, l = block_forward(q[:, :, blocks[i]], k[:, :, blocks[j]], v[:, :, blocks[j]], causal=i == j)
            merge_block(out[:, :, blocks[i]], lse[:, :, blocks[i]], o, l)
        delta = (grad * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i, j in pairs:
            r, c = blocks[i], blocks[j]
            a, b, e = block_backward(q[:, :, r], k[:, :, c], v[:, :, c], grad[:, :, r], lse[:, :, r], delta[:, :, r], i == j)
            dq[:, :, r] += a
            dk[:, :, c] += b
            dv[:, :, c] += e
    for got, want in ((out, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_capacity_offsets_reproduce_single_sequence_dropping():
    """Each rank's keep mask, from per-chunk counts of the whole sequence, is the full one's slice."""
    from fivefold.model.moe import capacity_keep

    torch.manual_seed(1)
    B, T, k, E, capacity = 3, 24, 2, 4, 5
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(B * T)]).reshape(B, T, k)
    full_keep = capacity_keep(ids, E, capacity)
    assert not full_keep.all()  # the test must actually drop something
    for algorithm in ("ring", "allgather"):
        for cp in (2, 3):
            G = chunk_count(algorithm, cp)
            size = T // G
            one_hot = F.one_hot(ids, E)
            counts = torch.stack([one_hot[:, g * size : (g + 1) * size].sum(1) for g in range(G)])  # (G, B, k, E)
            for rank in range(cp):
                pos = local_positions(algorithm, cp, rank, T)
                offsets = capacity_slot_offsets(counts, local_chunks(algorithm, cp, rank), size)
                keep = capacity_keep(ids[:, pos], E, capacity, offsets)
                assert torch.equal(keep, full_keep[:, pos]), (algorithm, cp, rank)


# ----------------------------------------------------------------------------- one attention layer, many ranks


def _core_cases(ctx, cases):
    """Run each distributed core on this rank's chunk of random q, k, v (float64) and compare
    output and gradients with full causal attention; count the cp bytes of forward+backward."""
    from fivefold.parallel.context_parallel import CORES

    results = []
    for algorithm, cp, B, Hq, Hkv, T, d in cases:
        mesh = ctx.mesh(Layout(cp=cp, dp=ctx.world_size // cp))
        gen = torch.Generator().manual_seed(T * 100 + Hq)
        q, k, v, grad = (torch.randn(B, h, T, d, generator=gen, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = _reference_attention(q, k, v)
        ref.backward(grad)
        pos = local_positions(algorithm, cp, mesh.cp.rank, T)
        local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        mesh.stats.reset()
        out = CORES[algorithm](mesh.cp)(*local)
        out.backward(grad[:, :, pos])
        errors = [(out - ref[:, :, pos]).abs().max().item()]
        errors += [(t.grad - full.grad[:, :, pos]).abs().max().item() for t, full in zip(local, (q, k, v))]
        sent = mesh.stats.axis_bytes("cp")
        results.append((max(errors), sent, analytic_cp_bytes(algorithm, cp, B, T // cp, Hq, Hkv, d, elem_bytes=8)))
    return results


def test_cores_exact_against_full_attention_with_exact_bytes(pools):
    """Every algorithm, cp 2 and 4, GQA head counts that tp=1 and tp=2 leave on a rank."""
    cases = []
    for algorithm in CORES:
        for cp in (2, 4):
            for Hq, Hkv in ((8, 2), (4, 1)):
                T = 24 if cp == 2 else 40
                cases.append((algorithm, cp, 2, Hq, Hkv, T, 8))
    for rank_results in pools.run(4, _core_cases, cases):
        for case, (error, sent, expected) in zip(cases, rank_results):
            assert error < 1e-12, case
            assert sent == expected, (case, sent, expected)
