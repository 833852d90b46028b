"""Context parallelism: exact attention across sequence segments, training parity, bytes, memory.

Every cp run with cp > 1 has dp x cp > 1, so it needs the data-parallel optimizer
(`fivefold.parallel.data_parallel.DataParallelAdamW`). Until that module exists, the pool
functions here install `SummingAdamW` (below, test-only): the replicated AdamW plus a plain
sum of every gradient over dp x cp (expert parameters: over expert data parallel). As soon
as data_parallel is importable the real optimizer is used and the stand-in is never touched.
"""

from __future__ import annotations

import contextlib
import math
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import Layout, load_config
from fivefold.rules.layout import LayoutError, validate
from fivefold.parallel.context_parallel import (
    CORES,
    block_backward,
    block_backward_reference,
    block_forward,
    block_forward_reference,
    capacity_slot_offsets,
    sequence_segments,
    local_segments,
    local_positions,
    merge_block,
)
from fivefold.rules.volumes import analytic_cp_bytes

# ----------------------------------------------------------------------------- pure logic


def test_zigzag_and_contiguous_positions_cover_the_sequence_once():
    for algorithm in CORES:
        for cp in (2, 3, 4):
            seq = 2 * cp * 5
            parts = [local_positions(algorithm, cp, r, seq) for r in range(cp)]
            assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))
            assert all(len(p) == seq // cp for p in parts)
    assert local_positions("ring", 2, 0, 8).tolist() == [0, 1, 6, 7]  # segments 0 and 3 of 4
    assert local_positions("ring", 2, 1, 8).tolist() == [2, 3, 4, 5]
    assert local_positions("allgather", 2, 1, 8).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["layout.cp=4", "layout.cp_algorithm=ring", "train.seq_len=36"], "not divisible by 8 (zigzag"),
        (["layout.cp=4", "layout.cp_algorithm=allgather", "train.seq_len=30"], "not divisible by 4 (cp splits"),
        (["layout.cp=3", "layout.cp_algorithm=ulysses", "train.seq_len=24"], "Ulysses splits attention heads"),
        (["layout.cp=4", "layout.tp=4", "layout.cp_algorithm=ulysses"], "Ulysses splits attention heads"),
        (["layout.cp=2", "layout.cp_algorithm=striped"], "cp_algorithm='striped' is unknown"),
    ],
)
def test_bad_context_parallel_layouts_are_rejected_before_launch(overrides, message):
    config = load_config("tiny", overrides)
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        validate(config, config.layout.world_size)


def test_ulysses_accepts_fewer_kv_heads_than_cp_when_cp_is_a_multiple():
    validate(load_config("tiny", ["layout.cp=8", "layout.cp_algorithm=ulysses", "train.seq_len=40"]), 8)
    validate(load_config("tiny", ["layout.cp=2", "layout.tp=2", "layout.cp_algorithm=ulysses"]), 4)


def _reference_attention(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


@pytest.mark.parametrize("fused", [True, False])
def test_online_softmax_blocks_match_full_attention(fused):
    """Blocks of keys merged by log-sum-exp, and their backward, equal one causal attention,
    with the fused CPU kernel and with the plain-tensor version used on other devices."""
    torch.manual_seed(0)
    B, Hq, Hkv, T, d, n = 2, 4, 2, 12, 8, 3
    q, k, v = (torch.randn(B, h, T, d, dtype=torch.float64, requires_grad=True) for h in (Hq, Hkv, Hkv))
    ref = _reference_attention(q, k, v)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    blocks = [slice(i * T // n, (i + 1) * T // n) for i in range(n)]
    pairs = [(i, j) for i in range(n) for j in range(i + 1)]
    forward = block_forward if fused else block_forward_reference
    with torch.no_grad():
        out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
        for i, j in pairs:
            o, l = forward(q[:, :, blocks[i]], k[:, :, blocks[j]], v[:, :, blocks[j]], causal=i == j)
            merge_block(out[:, :, blocks[i]], lse[:, :, blocks[i]], o, l)
        delta = (grad * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i, j in pairs:
            r, c = blocks[i], blocks[j]
            qkv = (q[:, :, r], k[:, :, c], v[:, :, c], grad[:, :, r])
            if fused:
                a, b, e = block_backward(*qkv, out[:, :, r].contiguous(), lse[:, :, r].contiguous(), i == j)
            else:
                a, b, e = block_backward_reference(*qkv, lse[:, :, r], delta[:, :, r], i == j)
            dq[:, :, r] += a
            dk[:, :, c] += b
            dv[:, :, c] += e
    for got, want in ((out, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_capacity_offsets_reproduce_single_sequence_dropping():
    """Each rank's keep mask, from per-segment counts of the whole sequence, is the full one's slice."""
    from fivefold.model.moe import capacity_keep

    torch.manual_seed(1)
    B, T, k, E, capacity = 3, 24, 2, 4, 5
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(B * T)]).reshape(B, T, k)
    full_keep = capacity_keep(ids, E, capacity)
    assert not full_keep.all()  # the test must actually drop something
    for algorithm in ("ring", "allgather"):
        for cp in (2, 3):
            G = sequence_segments(algorithm, cp)
            size = T // G
            one_hot = F.one_hot(ids, E)
            counts = torch.stack([one_hot[:, g * size : (g + 1) * size].sum(1) for g in range(G)])  # (G, B, k, E)
            for rank in range(cp):
                pos = local_positions(algorithm, cp, rank, T)
                offsets = capacity_slot_offsets(counts, local_segments(algorithm, cp, rank), size)
                keep = capacity_keep(ids[:, pos], E, capacity, offsets)
                assert torch.equal(keep, full_keep[:, pos]), (algorithm, cp, rank)


# ----------------------------------------------------------------------------- one attention layer, many ranks


def _core_cases(ctx, cases):
    """Run each distributed core on this rank's segment of random q, k, v (float64) and compare
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


def _ring_in_bf16_and_fp32(ctx):
    """Ring attention on bf16 q, k, v and on their exact fp32 casts, with an output gradient
    that bf16 holds exactly: (outputs, input gradients, cp bytes, bytes saved for backward) of each."""
    from fivefold.parallel.context_parallel import CORES, saved_activation_bytes

    mesh = ctx.mesh(Layout(cp=2, dp=ctx.world_size // 2))
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, T, d = 2, 8, 2, 16, 8
    q, k, v, grad = (torch.randn(B, h, T, d, generator=gen).to(torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        inputs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        mesh.stats.reset()
        out = CORES["ring"](mesh.cp)(*inputs)
        out.backward(grad.to(dtype))
        sent = mesh.stats.axis_bytes("cp")
        saved = saved_activation_bytes(lambda: CORES["ring"](mesh.cp)(*inputs))
        runs[dtype] = (out.detach(), [t.grad for t in inputs], sent, saved)
    return runs, analytic_cp_bytes("ring", 2, B, T, Hq, Hkv, d, elem_bytes=2), q.numel() + 2 * k.numel()


def test_ring_attention_circulates_bf16_kv_and_computes_exactly_as_in_fp32(pools):
    """bf16 inputs: K/V travel in bf16 and are cast up where each block is used (the cast is
    exact), so output and gradients are the fp32 computation's, rounded once; the dK/dV
    accumulators travel in fp32 (`volumes.ring_accumulator_bytes`). q, K and V are saved for
    backward in bf16 (the fp32 output and log-sum-exp as in fp32)."""
    for runs, expected_bytes, qkv_elements in pools.run(2, _ring_in_bf16_and_fp32):
        (out16, grads16, sent16, saved16), (out32, grads32, sent32, saved32) = runs[torch.bfloat16], runs[torch.float32]
        assert out16.dtype == torch.bfloat16 and torch.equal(out16, out32.to(torch.bfloat16))
        for g16, g32 in zip(grads16, grads32):
            assert g16.dtype == torch.bfloat16 and torch.equal(g16, g32.to(torch.bfloat16))
        assert sent16 == expected_bytes < sent32, (sent16, expected_bytes, sent32)
        assert saved16 == saved32 - 2 * qkv_elements, (saved16, saved32)


# ----------------------------------------------------------------------------- training parity


def _sum_gradients_over_replicas(optimizer) -> None:
    from fivefold.parallel import comm
    from fivefold.parallel.sharding import get_placement

    for name, p in optimizer.named:
        axes = get_placement(p, name).replicated_over
        axis = "dp_cp" if "dp_cp" in axes else "edp" if "edp" in axes else None
        if axis is not None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, optimizer.mesh[axis])


def _summing_adamw(chunks, mesh, config):
    """Test-only stand-in for DataParallelAdamW: replicated AdamW + gradient sum over replicas."""
    from fivefold.parallel.optim import AdamWSettings, ReplicatedAdamW

    optimizer = ReplicatedAdamW(list(chunks), mesh, AdamWSettings.from_train(config.train))
    finalizers = optimizer.grad_finalizers

    def finish_grad_sync() -> None:
        _sum_gradients_over_replicas(optimizer)
        for finalize in finalizers:
            finalize()

    optimizer.finish_grad_sync = finish_grad_sync
    return optimizer


@contextlib.contextmanager
def _data_parallel_optimizer():
    """Use the stand-in optimizer only while fivefold.parallel.data_parallel does not exist."""
    import fivefold.parallelize as parallelize

    if importlib.util.find_spec("fivefold.parallel.data_parallel") is not None:
        yield
        return
    original = parallelize.build_optimizer

    def build(chunks, mesh, config):
        if mesh.dp_cp.size == 1 and mesh.edp.size == 1:
            return original(chunks, mesh, config)
        return _summing_adamw(chunks, mesh, config)

    parallelize.build_optimizer = build
    try:
        yield
    finally:
        parallelize.build_optimizer = original


def _train_configs(ctx, configs, steps):
    """Train each config on this rank; rank 0 returns the traces, every rank its cp bytes."""
    from fivefold.tools.parity import train_trace

    out = []
    with _data_parallel_optimizer():
        for config in configs:
            resolved = validate(config, ctx.world_size)
            trace = train_trace(resolved, ctx.mesh(resolved.layout), steps)
            cp_bytes = trace.comm_bytes.get("cp", 0)
            out.append((trace if ctx.rank == 0 else None, cp_bytes))
    return out


def _tiny(preset: str = "tiny", seq: int = 24, moe_capacity: bool = False, **layout):
    """The tiny preset with two layers and Adam's eps at 1e-4 (see PARITY_EPS), on a layout."""
    overrides = [f"train.seq_len={seq}", "model.layers=2", f"train.eps={PARITY_EPS}"]
    overrides += [f"layout.{k}={v}" for k, v in layout.items()]
    if moe_capacity:  # drop tokens, so capacity priorities across segments are exercised
        overrides += ["model.dropless=false", "model.capacity_factor=1.0"]
    return load_config(preset, overrides)


# Parameters are compared after Adam steps. Adam divides each gradient by its own magnitude plus
# eps, so at an element whose gradient is near zero a rounding difference dg (from summing in
# another order: about 1e-7 of a tensor's largest gradient, ~1e-8 here) moves the parameter by
# up to lr * dg / eps. With the default eps = 1e-8 that is up to lr itself (1e-2): plain dp=2
# measurably exceeds the 1e-5 parameter bound that way, without any context parallelism.
# eps = 1e-4 bounds the effect to lr * 1e-4 = 1e-6, so the comparison measures the layout.
PARITY_EPS = 1e-4


def _expected_cp_bytes(config, steps: int) -> int:
    resolved = validate(config, config.layout.world_size).layout
    m = config.model
    heads, kv = m.heads // resolved.tp, max(m.n_kv_heads // resolved.tp, 1)
    per_layer = analytic_cp_bytes(
        resolved.cp_algorithm, resolved.cp, resolved.micro_batch, config.train.seq_len // resolved.cp, heads, kv, m.head_dim
    )
    return steps * resolved.grad_accum * m.layers * per_layer


HAS_TP = importlib.util.find_spec("fivefold.parallel.tensor_parallel") is not None


def _check_parity_and_bytes(results, configs, reference, steps: int) -> None:
    from fivefold.tools.parity import assert_parity

    for i, config in enumerate(configs):
        trace = results[0][i][0]
        assert_parity(reference(config, steps), trace)
        if config.model.is_moe:
            ref_aux = reference(config, steps).aux_losses
            assert all(abs(a - b) <= 1e-6 + 1e-5 * abs(a) for a, b in zip(ref_aux, trace.aux_losses)), trace.aux_losses
            assert any(layer["dropped_fraction"] > 0 for layer in trace.moe[0].values())  # capacity really drops
        else:
            expected = _expected_cp_bytes(config, steps)
            assert all(r[i][1] == expected for r in results), (config.layout, [r[i][1] for r in results], expected)


def test_training_parity_and_cp_bytes_4_ranks(pools, reference):
    """cp 2 and 4, alone and with dp=2, every algorithm, lengths that are not powers of two,
    gradient accumulation, and MoE with capacity drops across segments."""
    configs = [
        _tiny(cp=4, cp_algorithm="ring", seq=40),
        _tiny(cp=4, cp_algorithm="ulysses", seq=24),  # 2 key/value heads repeated to 4
        _tiny(cp=2, dp=2, cp_algorithm="allgather", seq=24, grad_accum=2),
        _tiny("tiny-moe", cp=2, dp=2, cp_algorithm="ring", seq=24, moe_capacity=True),
    ]
    steps = 2
    _check_parity_and_bytes(pools.run(4, _train_configs, configs, steps), configs, reference, steps)


def test_training_parity_and_cp_bytes_8_ranks(pools, reference):
    """cp 8 for each algorithm (Ulysses: one query head and a repeated kv head per rank), cp=4 x
    dp=2, and tp=2 x cp=2 x dp=2 where tensor parallel exists."""
    configs = [
        _tiny(cp=8, cp_algorithm="ring", seq=48),
        _tiny(cp=8, cp_algorithm="ulysses", seq=40),
        _tiny(cp=4, dp=2, cp_algorithm="allgather", seq=40),
        _tiny("tiny-moe", cp=4, dp=2, cp_algorithm="allgather", seq=40, moe_capacity=True),
    ]
    if HAS_TP:
        configs += [_tiny(tp=2, cp=2, dp=2, cp_algorithm=a, seq=24) for a in CORES]
    steps = 2
    _check_parity_and_bytes(pools.run(8, _train_configs, configs, steps), configs, reference, steps)


# ----------------------------------------------------------------------------- activation memory


def _attention_memory(ctx, seq: int, cases):
    """Saved-for-backward bytes of one attention core call per rank, for each (algorithm, cp)."""
    from fivefold.parallel.context_parallel import CORES, saved_activation_bytes

    out = {}
    B, Hq, Hkv, d = 1, 8, 2, 8
    for algorithm, cp in cases:
        mesh = ctx.mesh(Layout(cp=cp, dp=ctx.world_size // cp))
        T = seq // cp
        q, k, v = (torch.randn(B, h, T, d, requires_grad=True) for h in (Hq, Hkv, Hkv))
        core = CORES[algorithm](mesh.cp)
        out[(algorithm, cp)] = saved_activation_bytes(lambda: core(q, k, v))
    return out


def test_ring_attention_activation_memory_scales_as_s_over_cp(pools):
    """Ring attention keeps O(s/cp) per rank: exactly half at cp=2, a quarter at cp=4, of cp=1.
    The all-gather variant keeps the whole sequence's K/V (and its mask) on every rank."""
    seq = 1024
    cases = [(a, cp) for a in ("ring", "allgather") for cp in (1, 2, 4)]
    memory = pools.run(4, _attention_memory, seq, cases)[0]
    ring = [memory[("ring", cp)] for cp in (1, 2, 4)]
    assert ring[1] * 2 == ring[0] and ring[2] * 4 == ring[0], ring
    gathered = [memory[("allgather", cp)] for cp in (1, 2, 4)]
    assert all(g > r for g, r in zip(gathered[1:], ring[1:])), (gathered, ring)
    kv_full = 2 * 2 * seq * 8 * 4  # K and V of the whole sequence, fp32
    assert all(g >= kv_full for g in gathered), gathered


def _saved_attention_shapes(ctx, Hq: int, Hkv: int, T: int, d: int):
    """Shapes of every tensor each attention core saves for backward (the single-process core
    and every cp=2 core), without and with packed documents, on this rank's segment."""
    from fivefold.model.attention import AttentionCore

    B = 2
    documents = torch.arange(T).div(T // 3, rounding_mode="floor").expand(B, T)  # three documents
    mesh = ctx.mesh(Layout(cp=2, dp=ctx.world_size // 2))
    cores = {"single": (AttentionCore(), T)} | {name: (core(mesh.cp), T // 2) for name, core in CORES.items()}
    shapes = {}
    for name, (core, local) in cores.items():
        for docs in (None, documents):
            q, k, v = (torch.randn(B, h, local, d, requires_grad=True) for h in (Hq, Hkv, Hkv))
            saved: list[tuple[int, ...]] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
                core(q, k, v, docs)
            shapes[(name, docs is not None)] = saved
    return shapes


def test_attention_saves_grouped_kv_never_repeated_to_query_heads(pools):
    """Grouped-query attention hands K/V to SDPA (enable_gqa) and to the fused ring kernel with
    their own heads: every core saves exactly two tensors at query-head count (q and the
    output; with documents, their pieces per document) and K/V at the rank's key/value heads,
    whose elements are those of K and V once."""
    Hq, Hkv, T, d = 8, 2, 48, 4
    shapes = pools.run(2, _saved_attention_shapes, Hq, Hkv, T, d)[0]
    for (name, with_documents), saved in shapes.items():
        heads = [s for s in saved if len(s) == 4 and s[-1] == d]  # (B, heads, tokens, d) tensors
        hq, hkv = (Hq // 2, Hkv // 2) if name == "ulysses" else (Hq, Hkv)  # Ulysses splits heads over cp=2
        at_query_heads = [s for s in heads if s[1] == hq]
        grouped = [s for s in heads if s[1] != hq]
        kv_tokens = {"single": T, "allgather": T, "ulysses": T, "ring": T // 2}[name]  # keys attended per rank
        q_tokens = T // 2 if name in ("allgather", "ring") else T
        q_elements = sum(math.prod(s) for s in at_query_heads)
        if with_documents and name != "ring":  # per document: each document's q and output pieces
            # all-gather pads the queries of a document begun on an earlier rank, up to its keys
            assert 2 * 2 * hq * q_tokens * d <= q_elements <= 2 * 2 * hq * kv_tokens * d, (name, saved)
        else:
            assert len(at_query_heads) == 2, (name, with_documents, saved)
        kv_elements = sum(math.prod(s) for s in grouped)
        if with_documents and name == "allgather":  # only the keys of documents holding its queries
            assert kv_elements <= 2 * 2 * hkv * kv_tokens * d, (name, saved)
        else:
            assert kv_elements == 2 * 2 * hkv * kv_tokens * d, (name, with_documents, saved)
        assert all(s[1] in (hkv, 2 * hkv) for s in grouped), (name, saved)  # K, V or the ring's K|V buffer
