"""Data parallel: buckets, hooks that overlap the reduction with backward, parity with one process."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from fivefold.config import Layout, load_config
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.buckets import TAIL_FRACTION, plan_buckets, trainable
from fivefold.parallel.data_parallel import DataParallelAdamW
from fivefold.parallel.flat_adamw import flat_adamw_
from fivefold.parallel.optim import AdamWSettings, adamw_update_, decays
from fivefold.tools.parity import PARAM_ATOL, PARAM_RTOL, TrainTrace, assert_parity

STEPS = 2
SETTINGS = AdamWSettings(0.9, 0.95, 1e-8, 0.1)


GLOBAL_BATCH = 32  # dp=8 x grad_accum=4 x one sequence per micro-batch


def tiny(**layout) -> object:
    overrides = [f"layout.{k}={v}" for k, v in layout.items()]
    # Two layers of 16 tokens keep the 24-layout matrix fast; every stage still has several
    # buckets, and ZeRO-3 still gathers layer by layer.
    return load_config("tiny", [f"train.global_batch={GLOBAL_BATCH}", "train.seq_len=16", "model.layers=2", *overrides])


@functools.lru_cache(maxsize=None)
def _single_process(config, steps: int) -> TrainTrace:
    from fivefold.rules.layout import validate
    from fivefold.tools.parity import train_trace

    return train_trace(config, Mesh.single(validate(config).layout), steps)


def matched_reference(config, steps: int) -> TrainTrace:
    """The single-process run with the layout's micro-batch size (so its micro-batches match).

    Per micro-batch the forward and backward are then the same computation as on a
    data-parallel rank; only the order in which micro-batch gradients are added differs.
    A reference that takes the whole batch at once differs by more: Adam divides each
    gradient by its own magnitude, so an element whose gradient nearly cancels (|g| ~ 1e-9
    against a typical 1e-4) turns the rounding of a differently blocked sum into an update
    difference of up to lr * |dg| / eps -- enough to cross the parameter bound with
    grad_accum=4 even in a single process.
    """
    from fivefold.rules.layout import validate

    resolved = validate(config, config.layout.world_size).layout
    single = Layout(grad_accum=resolved.dp * resolved.grad_accum)
    return _single_process(config.replace(layout=single), steps)


def tiny_model():
    from fivefold.model import Transformer
    from fivefold.parallel.sharding import materialize

    config = load_config("tiny")
    with torch.device("meta"):
        model = Transformer(config.model)
    return materialize(model, config.model, seed=0)


# ----------------------------------------------------------------------------- pool functions


def train_configs_on_rank(ctx, configs: list, steps: int, probe_finalizers: bool = False) -> list[dict]:
    """Train each config in turn on these ranks; per config, what the tests check.

    Every rank returns comm bytes on the data-parallel axis, memory held just before the last
    zero_grad (gradients still there) and the bucket sizes; rank 0 adds the trace with the
    full parameters.
    """
    from fivefold.rules.layout import validate

    return [_train_one(ctx, validate(config, ctx.world_size), steps, probe_finalizers) for config in configs]


def _train_one(ctx, config, steps: int, probe_finalizers: bool = False) -> dict:
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.observe.held_memory import held_memory
    from fivefold.train import build, train_step

    mesh = ctx.mesh(config.layout)
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    model = build(config, mesh, torch.device("cpu"))
    optimizer, memory = model.optimizer, {}
    zero_grad = optimizer.zero_grad

    def measured_zero_grad() -> None:
        memory["held"] = held_memory(model.chunks, optimizer)
        zero_grad()

    optimizer.zero_grad = measured_zero_grad
    if probe_finalizers:  # a finalizer (as TP/PP register) must see every full local gradient
        seen = memory.setdefault("finalizer_saw_full_grads", [])
        named = trainable(model.chunks)
        optimizer.grad_finalizers.append(lambda: seen.append(all(p.grad is not None for _, p in named)))
    mesh.stats.reset()
    trace = TrainTrace([], [], [])
    for step in range(steps):
        result = train_step(model, sampler, step)
        trace.losses.append(result.loss)
        trace.grad_norms.append(result.grad_norm)
    out = {
        "dp_bytes": mesh.stats.axis_bytes("dp_cp"),
        "memory": memory["held"],
        "psi": sum(p.numel() for _, p in trainable(model.chunks)),
        "bucket_elements": sum(b.numel for b in optimizer.buckets),
        "buckets": len(optimizer.buckets),
        "finalizer_saw_full_grads": memory.get("finalizer_saw_full_grads"),
    }
    gathered = getattr(optimizer, "gathered", contextlib.nullcontext)
    with gathered():
        trace.params = model.full_parameters()
    if ctx.rank == 0:
        out["trace"] = trace
    return out


def check_parity_and_norms(config, result: dict) -> None:
    ref = matched_reference(config, STEPS)
    report = assert_parity(ref, result["trace"])
    for a, b in zip(ref.grad_norms, result["trace"].grad_norms):
        assert abs(a - b) <= 1e-5 * abs(a), (config.layout, ref.grad_norms, result["trace"].grad_norms)
    return report


def run_matrix(pools, world: int, zeros: list[int], accums=(1, 4)) -> list[tuple]:
    """Train every (zero, accum) of one world size in one pool call; check parity of each."""
    configs = [tiny(dp=world, zero=z, grad_accum=a) for z in zeros for a in accums]
    results = pools.run(world, train_configs_on_rank, configs, STEPS)
    for i, config in enumerate(configs):
        check_parity_and_norms(config, results[0][i])
    return [(config, [r[i] for r in results]) for i, config in enumerate(configs)]


# The parity matrix dp {2,4,8} x zero {0..3} x grad_accum {1,4} runs in tests/parallel/test_zero.py,
# one pool call per world size for all eight (zero, accumulation) pairs.


# ----------------------------------------------------------------------------- hooks and buckets


def _overlap_and_views(ctx) -> dict:
    from fivefold.train import build

    config = tiny(dp=2, bucket_mb=0.05)  # ~50 KB buckets: several per model
    from fivefold.rules.layout import validate

    config = validate(config, 2)
    mesh = ctx.mesh(config.layout)
    model = build(config, mesh, torch.device("cpu"))
    optimizer: DataParallelAdamW = model.optimizer
    reducer = optimizer.sync.reducer
    torch.manual_seed(ctx.rank)
    tokens = torch.randint(0, 256, (2, 32))

    def backward() -> None:
        logits, _ = model.chunks[0](tokens)
        logits.float().pow(2).mean().backward()

    with optimizer.no_sync():
        backward()
    launched_in_no_sync = sum(reducer.launched)
    backward()
    launched_during_backward = sum(reducer.launched)
    views = all(
        seg.param.grad.untyped_storage().data_ptr() == b.grads.untyped_storage().data_ptr()
        and seg.param.untyped_storage().data_ptr() == b.params.untyped_storage().data_ptr()
        for b in optimizer.buckets
        for seg in b.segments
    )
    optimizer.finish_grad_sync()
    grads = torch.cat([b.grads for b in optimizer.buckets])
    return {
        "buckets": len(optimizer.buckets),
        "no_sync": launched_in_no_sync,
        "backward": launched_during_backward,
        "views": views,
        "grads": grads,
        "sizes": [b.numel * 4 for b in optimizer.buckets],
    }


def test_buckets_launch_during_backward_and_grads_view_flat_buffers(pools):
    results = pools.run(2, _overlap_and_views)
    first = results[0]
    assert first["buckets"] >= 3
    assert first["no_sync"] == 0  # accumulation micro-batches communicate nothing
    assert first["backward"] == first["buckets"]  # every bucket launched from a hook, before finish
    assert first["views"]
    assert torch.equal(results[0]["grads"], results[1]["grads"])  # reduced: identical on both ranks
    limit = 0.05 * (1 << 20)
    largest_param = 256 * 64 * 4
    assert all(s <= max(limit, largest_param) for s in first["sizes"])


def _released_grads_and_unused_parameters(ctx, zero: int) -> dict:
    """One step through the whole model, then a backward that reaches only the embedding."""
    from fivefold.rules.layout import validate
    from fivefold.train import build

    config = validate(tiny(dp=2, zero=zero, bucket_mb=0.05), 2)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    optimizer, chunk = model.optimizer, model.chunks[0]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(ctx.rank))
    logits, _ = chunk(tokens)
    logits.float().pow(2).mean().backward()
    optimizer.finish_grad_sync()
    optimizer.step(1e-3)
    optimizer.zero_grad()
    released = all(p.grad is None for _, p in trainable(model.chunks))
    chunk.embed(tokens).sum().backward()  # d/d(embedding row) = its count in the batch, every column
    optimizer.finish_grad_sync()
    embed_sum, others_max = 0.0, 0.0
    for bucket, grad, (lo, hi) in zip(optimizer.buckets, optimizer.sync.reduced_grads(), optimizer.ranges):
        for seg, start, end in bucket.runs(lo, hi):
            values = grad[start - lo : end - lo]
            if seg.param is chunk.embed.weight:
                embed_sum += float(values.sum())
            else:
                others_max = max(others_max, float(values.abs().max()))
    views = all(seg.param.grad is not None and seg.param.grad.data_ptr() == b.grad_view(seg).data_ptr()
                for b in optimizer.buckets for seg in b.segments) if zero < 2 else True
    return {"released": released, "embed_sum": embed_sum, "others_max": others_max, "views": views,
            "hidden": config.model.hidden}


@pytest.mark.parametrize("zero", [0, 1])
def test_zero_grad_releases_gradients_and_unused_parameters_reduce_as_zeros(pools, zero):
    """zero_grad leaves .grad None (the next backward's gradients are copied into the flat
    buffer, nothing is zeroed in advance); a parameter without a gradient in a step must then
    be reduced as zeros, not as the stale values of the step before."""
    results = pools.run(2, _released_grads_and_unused_parameters, zero)
    for r in results:
        assert r["released"] and r["views"]
        assert r["others_max"] == 0.0
    owners = 1 if zero else 2  # ZeRO-1: each rank holds its shard of the sum; dp: every rank all of it
    tokens_both_ranks = 2 * 2 * 16
    assert sum(r["embed_sum"] for r in results) == owners * tokens_both_ranks * results[0]["hidden"]


def _world_collectives_per_step(ctx, zero: int) -> int:
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.rules.layout import validate
    from fivefold.train import build, train_step

    config = validate(tiny(dp=2, zero=zero), 2)
    mesh = ctx.mesh(config.layout)
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    model = build(config, mesh, torch.device("cpu"))
    train_step(model, sampler, 0)
    before = mesh.stats.calls.get(("world", "all_reduce"), 0)
    train_step(model, sampler, 1)
    return mesh.stats.calls.get(("world", "all_reduce"), 0) - before


def test_plain_data_parallel_step_waits_on_the_world_once(pools):
    """Plain dp: every rank holds the whole summed gradient, so the clipping norm is local; the
    loss and auxiliary loss are reported in one collective. ZeRO-1 still sums the norm's shards."""
    assert pools.run(2, _world_collectives_per_step, 0) == [1, 1]
    assert pools.run(2, _world_collectives_per_step, 1) == [2, 2]


def _different_weights(ctx) -> str:
    from fivefold.rules.layout import validate
    from fivefold.parallelize import build_chunks
    from fivefold.parallel.sharding import materialize

    config = validate(tiny(dp=2), 2)
    mesh = ctx.mesh(config.layout)
    chunks = build_chunks(config, mesh)
    materialize(chunks[0], config.model, seed=0)
    if ctx.rank == 1:
        with torch.no_grad():
            chunks[0].layers["1"].mlp.up.weight[3, 5] += 1e-3
    try:
        DataParallelAdamW(chunks, mesh, SETTINGS)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_replicas_that_start_apart_are_refused(pools):
    message = pools.run(2, _different_weights)[0]
    assert "different weights" in message and "layers.1.mlp.up.weight" in message


def test_bucket_plan_covers_every_parameter_once_in_reverse_order():
    model = tiny_model()
    named = trainable([model])
    buckets = plan_buckets(named, Mesh.single(), bucket_bytes=60_000, pad_to_axis=False)
    names = [seg.name for b in buckets for seg in b.segments]
    assert names == [n for n, _ in reversed(named)]
    for b in buckets:
        assert b.numel == b.used
        assert b.numel * 4 <= 60_000 or len(b.segments) == 1
        starts = [seg.start for seg in b.segments]
        assert starts == sorted(starts) and starts[0] == 0


@pytest.mark.parametrize("bucket_bytes", [60_000, 200_000, 1 << 30])
def test_bucket_completed_last_is_cut_to_a_quarter(bucket_bytes):
    """The bucket backward completes last (the first layers, the embedding) cannot overlap any
    backward: it holds at most a quarter of bucket_bytes (or one parameter). A model that fits
    in that quarter is one bucket."""
    named = trainable([tiny_model()])
    buckets = plan_buckets(named, Mesh.single(), bucket_bytes=bucket_bytes, pad_to_axis=False)
    total = sum(p.numel() * 4 for _, p in named)
    last = buckets[-1]
    if total <= bucket_bytes // TAIL_FRACTION:
        assert len(buckets) == 1
        return
    assert last.numel * 4 <= bucket_bytes // TAIL_FRACTION or len(last.segments) == 1
    assert all(b.numel * 4 <= bucket_bytes or len(b.segments) == 1 for b in buckets)
    assert [seg.name for b in buckets for seg in b.segments] == [n for n, _ in reversed(named)]


def test_flat_update_equals_per_parameter_update():
    """The flat AdamW over a bucket changes every element exactly as the per-tensor update."""
    model = tiny_model()
    named = trainable([model])
    torch.manual_seed(0)
    expected = {}
    for name, p in named:
        grad = torch.randn_like(p)
        p.grad = grad
        ref, m, v = p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)
        for step in (1, 2):
            adamw_update_(ref, grad, m, v, step, 1e-2, SETTINGS, decays(p.dim()))
        expected[name] = ref
    grads = {name: p.grad.clone() for name, p in named}
    (bucket,) = plan_buckets(named, Mesh.single(), bucket_bytes=1 << 30, pad_to_axis=False)
    bucket.flatten_params_()
    flat_grad = torch.cat([grads[seg.name].reshape(-1) for seg in bucket.segments])
    state = (torch.zeros(bucket.numel), torch.zeros(bucket.numel))
    for step in (1, 2):
        flat_adamw_(bucket, 0, bucket.numel, bucket.params, flat_grad, state, step, 1e-2, SETTINGS)
    for name, p in named:
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-7)


def _per_op_adamw_(p, g, m, v, step: int, lr: float, settings: AdamWSettings, decay: bool) -> None:
    """The element-wise AdamW the fused kernel replaced, one torch op per line (fp32)."""
    m.lerp_(g, 1 - settings.beta1)
    v.mul_(settings.beta2).addcmul_(g, g, value=1 - settings.beta2)
    denom = (v / (1 - settings.beta2**step)).sqrt_().add_(settings.eps)
    if decay:
        p.mul_(1 - lr * settings.weight_decay)
    p.addcdiv_(m, denom, value=-lr / (1 - settings.beta1**step))


def _adam_inputs(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    return [p, g, torch.zeros(n), torch.zeros(n)]


def test_fused_update_equals_per_op_arithmetic_within_fp32_rounding():
    """Three steps of the fused kernel against the per-op update it replaced: every element
    within a few fp32 roundings of the update (the two round in another order)."""
    fused, per_op = _adam_inputs(10_007), _adam_inputs(10_007)
    start = fused[0].clone()
    for step in (1, 2, 3):
        adamw_update_(*fused, step, 1e-2, SETTINGS, True)
        _per_op_adamw_(*per_op, step, 1e-2, SETTINGS, True)
    moved = (per_op[0] - start).abs()
    assert float(moved.min()) > 1e-3  # every element really moved (lr 1e-2, three steps)
    torch.testing.assert_close(fused[0], per_op[0], rtol=0, atol=1e-6)  # 8 ulp of |p| < 2
    for a, b in zip(fused[2:], per_op[2:]):  # the moments
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_update_of_any_slice_equals_the_whole_tensor_bit_for_bit(threads):
    """An element's update does not depend on the slice it is updated in, nor on the thread
    count: what lets a ZeRO shard, a bucket and one tensor give the same bits."""
    previous = torch.get_num_threads()
    whole = _adam_inputs(5_003)
    torch.set_num_threads(threads)
    try:
        for step in (1, 2):
            adamw_update_(*whole, step, 1e-2, SETTINGS, True)
        gen = torch.Generator().manual_seed(threads)
        for _ in range(20):
            a, b = sorted(torch.randint(0, 5_004, (2,), generator=gen).tolist())
            if a == b:
                continue
            torch.set_num_threads(int(torch.randint(1, 4, (1,), generator=gen)))
            pieces = [t[a:b].clone() for t in _adam_inputs(5_003)]
            for step in (1, 2):
                adamw_update_(*pieces, step, 1e-2, SETTINGS, True)
            for got, ref in zip(pieces, whole):
                assert torch.equal(got, ref[a:b]), (a, b)
    finally:
        torch.set_num_threads(previous)


def test_fused_update_of_a_non_contiguous_tensor_lands_in_place():
    """A strided (transposed) parameter and its moments are updated where they are, to the
    same bits as their contiguous copies."""
    base = [t.reshape(70, 50) for t in _adam_inputs(3_500)]
    contiguous = [t.clone() for t in base]
    strided = [t.t().contiguous().t() for t in base]  # the same values, column-major
    assert not strided[0].is_contiguous()
    for step in (1, 2):
        adamw_update_(*contiguous, step, 1e-2, SETTINGS, True)
        adamw_update_(*strided, step, 1e-2, SETTINGS, True)
    for a, b in zip(contiguous, strided):
        assert torch.equal(a, b)


def test_single_rank_data_parallel_matches_replicated_optimizer():
    """With one replica the data-parallel optimizer is the plain one, update for update."""
    from fivefold.parallel.optim import ReplicatedAdamW

    models = [tiny_model(), tiny_model()]
    opts = [
        ReplicatedAdamW([models[0]], Mesh.single(), SETTINGS),
        DataParallelAdamW([models[1]], Mesh.single(), SETTINGS, bucket_mb=0.02),
    ]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    norms = []
    for model, opt in zip(models, opts):
        for _ in range(2):
            logits, _ = model(tokens)
            logits.pow(2).mean().backward()
            opt.finish_grad_sync()
            norms.append(opt.clip_grad_norm(0.01))
            opt.step(1e-2)
            opt.zero_grad()
    assert norms[:2] == pytest.approx(norms[2:], rel=1e-6)  # fp32 norms per run vs float64 per tensor
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        # the norms differ in rounding, so the updates differ within the parity bound
        torch.testing.assert_close(a, b, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=n)


def test_optimizer_state_round_trips_by_parameter_name(tmp_path):
    """Flat optimizer state is named per parameter and survives a real checkpoint save and resume."""
    from fivefold.checkpoint import resume_latest, save_checkpoint
    from fivefold.parallelize import ParallelModel

    def data_parallel_model() -> ParallelModel:
        model = tiny_model()
        return ParallelModel(load_config("tiny"), Mesh.single(), [model], DataParallelAdamW([model], Mesh.single(), SETTINGS, 0.02))

    saved = data_parallel_model()
    opt = saved.optimizer
    for b, (m, v) in zip(opt.buckets, opt.state):
        m.copy_(torch.randn(b.numel))
        v.copy_(torch.rand(b.numel))
    state = opt.sharded_state()
    assert set(state) == {n for n, _ in saved.chunks[0].named_parameters()}
    _, spec = state["layers.0.attn.wq.weight"]["exp_avg"]
    assert spec.flat == (0, 64 * 64) and spec.shape == (64, 64)
    save_checkpoint(saved, 1, tmp_path)
    other = data_parallel_model()
    assert resume_latest(other, tmp_path) == 1
    for (m1, v1), (m2, v2) in zip(opt.state, other.optimizer.state):
        assert torch.equal(m1, m2) and torch.equal(v1, v2)


def test_layout_single_replica_zero_is_refused():
    from fivefold.rules.layout import LayoutError, validate

    with pytest.raises(LayoutError, match="dp x cp = 1"):
        validate(tiny(zero=1), 1)
