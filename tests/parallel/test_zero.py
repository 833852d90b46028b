"""Data parallel and ZeRO 1-3: parity with one process, memory held per stage, bytes moved per step, bad input."""

from __future__ import annotations

import pytest
import torch

from fivefold.observe.held_memory import zero_formula_bytes
from fivefold.parallel.zero import ZeroStage3Sync
from fivefold.rules.volumes import dp_comm_bytes_per_step
from test_data_parallel import STEPS, check_parity_and_norms, run_matrix, tiny, train_configs_on_rank


def check_memory_and_comm(config, per_rank: list[dict]) -> None:
    """Held bytes (storage) match the ZeRO formulas within 1%; dp bytes match the ring volumes exactly."""
    layout = config.layout
    n, stage = layout.dp, layout.zero
    for result in per_rank:
        psi = result["psi"]
        held = result["memory"].without_padding()
        for kind, expected in zero_formula_bytes(psi, n, stage).items():
            assert abs(held[kind] - expected) <= 0.01 * expected, (layout, kind, held, expected)
        assert result["bucket_elements"] == psi  # the tiny model needs no padding for n <= 8
        kept = kept_for_backward_elements(config) if stage == 3 else 0
        analytic = dp_comm_bytes_per_step(result["bucket_elements"], n, stage, layout.grad_accum, kept_elements=kept)
        assert result["dp_bytes"] == STEPS * analytic, (layout, result["dp_bytes"], analytic)


def kept_for_backward_elements(config) -> int:
    """ZeRO-3 keeps the root (embedding, final norm, head) and the last block gathered from
    each forward to its backward, so the backward's all-gathers leave them out."""
    from fivefold.model import build_model

    last = f"layers.{config.model.layers - 1}."
    named = build_model(config.model, config.train.seed).named_parameters()
    return sum(p.numel() for name, p in named if not name.startswith("layers.") or name.startswith(last))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_parity_memory_and_communication(pools, world):
    """dp in {2,4,8} x zero in {0,1,2,3} x grad_accum in {1,4}, in one pool call per world size.

    Per config: loss per step, gradient norm per step and final weights match the
    single-process run; held bytes match the ZeRO formulas; dp bytes match the ring volumes.
    """
    for config, per_rank in run_matrix(pools, world, zeros=[0, 1, 2, 3]):
        check_memory_and_comm(config, per_rank)


def test_bf16_trains_close_to_fp32(pools):
    """bf16 autocast over fp32 parameters: every stage stays close to the fp32 run and learns."""
    steps = 4
    configs = [tiny(dp=2, zero=z).replace() for z in (0, 3)]
    configs = [c.replace(train=_with(c.train, dtype="bf16", steps=steps)) for c in configs]
    fp32 = pools.run(2, train_configs_on_rank, [tiny(dp=2, zero=3)], steps)[0][0]["trace"]
    for result in pools.run(2, train_configs_on_rank, configs, steps)[0]:
        losses = result["trace"].losses
        assert all(abs(a - b) < 0.03 for a, b in zip(losses, fp32.losses)), (losses, fp32.losses)
        assert losses[-1] < losses[0]


def test_finalizers_see_full_gradients_in_every_stage(pools):
    """Stages 2-3 drop full gradients after reducing; with finalizers they reduce after them."""
    configs = [tiny(dp=2, zero=z, grad_accum=2) for z in (0, 1, 2, 3)]
    results = pools.run(2, train_configs_on_rank, configs, STEPS, probe_finalizers=True)
    for config, result in zip(configs, results[0]):
        assert result["finalizer_saw_full_grads"] == [True] * STEPS, config.layout
        check_parity_and_norms(config, result)


def _with(section, **changes):
    import dataclasses

    return dataclasses.replace(section, **changes)


def _sharded_state(ctx) -> dict:
    from fivefold.rules.layout import validate
    from fivefold.parallel.sharding import full_shapes, gather_full_state
    from fivefold.train import build

    config = validate(tiny(dp=2, zero=3, bucket_mb=0.05), 2)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    opt = model.optimizer
    storage_while_free = sum(p.untyped_storage().nbytes() for p in model.chunks[0].parameters())
    with opt.gathered():
        full = gather_full_state(model.chunks, model.mesh, full_shapes(config.model))
    # what a checkpoint saves: per parameter name, this rank's flat piece (offset, length)
    pieces = {name: [entry["exp_avg"][1].flat] for name, entry in opt.sharded_state().items()}
    return {"free": storage_while_free, "full": full, "pieces": pieces}


def test_zero3_parameters_are_freed_and_state_is_named(pools):
    from fivefold.model import build_model

    results = pools.run(2, _sharded_state)
    assert results[0]["free"] == 0  # between steps a rank holds only its shards
    config = tiny()
    expected = dict(build_model(config.model, config.train.seed).named_parameters())
    for name, value in results[0]["full"].items():
        assert torch.equal(value, expected[name].detach()), name
    # the two ranks' optimizer pieces tile every parameter exactly once
    for name, p in expected.items():
        spans = sorted(s for r in results for s in r["pieces"].get(name, []))
        covered = 0
        for offset, numel in spans:
            assert offset == covered, name
            covered += numel
        assert covered == p.numel(), name


def test_bad_zero_layouts_are_explained():
    from fivefold.rules.layout import LayoutError, validate

    with pytest.raises(LayoutError, match="dp x cp = 1"):
        validate(tiny(zero=2), 1)
    with pytest.raises(LayoutError, match="not a ZeRO stage"):
        validate(tiny(dp=2, zero=4), 2)
    for zero in (1, 2, 3):  # every stage composes with pipelines
        validate(tiny(dp=2, pp=2, zero=zero), 4)


def _gathers_ahead_into_flat_storage(ctx) -> dict:
    """One ZeRO-3 forward/backward, noting at every block's forward what was gathered where."""
    from fivefold.rules.layout import validate
    from fivefold.train import build

    config = validate(tiny(dp=2, zero=3, bucket_mb=0.05), 2)
    mesh = ctx.mesh(config.layout)
    model = build(config, mesh, torch.device("cpu"))
    optimizer, chunk = model.optimizer, model.chunks[0]
    flight = mesh.stats.flight
    axis = optimizer.buckets[0].axis.name
    issued_before = flight.issued.get(axis, 0)  # sequence numbers: the bounded record list may wrap
    seen: list[dict] = []

    def note(unit):
        def hook(module, args) -> None:  # registered after the gatherer's: runs once it is done
            newest = flight.newest()
            seen.append({
                "unit": unit.name,
                "gathers_issued": flight.issued[axis] - issued_before,  # forward: all-gathers only
                "newest": newest.op,
                "views": all(
                    seg.param.untyped_storage().data_ptr() == b.params.untyped_storage().data_ptr()
                    and b.params.untyped_storage().nbytes() == b.numel * b.params.element_size()
                    for b in unit.buckets
                    for seg in b.segments
                ),
            })

        return hook

    for unit in optimizer.sync.units:
        if unit.module is not chunk:
            unit.module.register_forward_pre_hook(note(unit))
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(ctx.rank))
    logits, _ = chunk(tokens)
    logits.float().pow(2).mean().backward()
    optimizer.finish_grad_sync()
    return {"seen": seen, "units": [u.name for u in optimizer.sync.units]}


def test_zero3_gathers_the_next_block_before_this_one_runs_straight_into_flat_storage(pools):
    """Units in forward order: the root (embedding, norm, head), then the blocks. When block j
    runs, the all-gathers of the root and blocks 0..j+1 have been issued (block j+1's ahead
    of block j's forward), and every parameter of block j views its bucket's full flat storage
    (gathered in place: no copy)."""
    result = pools.run(2, _gathers_ahead_into_flat_storage)[0]
    blocks = result["units"][1:]
    assert [s["unit"] for s in result["seen"]] == blocks and len(blocks) >= 2
    for j, s in enumerate(result["seen"]):
        ahead = 1 if j + 1 < len(blocks) else 0
        assert s["gathers_issued"] == 1 + (j + 1) + ahead, (s, j)
        assert s["newest"] == "all_gather", s
        assert s["views"], s


def _zero_lands_in_place(ctx, stage: int) -> dict:
    """After one ZeRO-1/2 step: where the gradient shard and the updated parameters live."""
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.rules.layout import validate
    from fivefold.train import build, train_step

    config = validate(tiny(dp=2, zero=stage, bucket_mb=0.05), 2)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    optimizer = model.optimizer
    shards_in_place = []
    finish = optimizer.finish_grad_sync

    def probed_finish() -> None:
        finish()
        if stage == 1:  # stage 2 holds no full gradient buffer to land in
            shards_in_place.extend(
                g.data_ptr() == b.grads[lo:hi].data_ptr()
                for g, b, (lo, hi) in zip(optimizer.sync.grad_shards, optimizer.buckets, optimizer.ranges)
            )

    optimizer.finish_grad_sync = probed_finish
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    train_step(model, Sampler(data.train, config.train.seq_len, config.train.global_batch, 0), 0)
    optimizer.wait_for_parameters()  # the step leaves its all-gathers in flight
    masters_are_flat = all(
        m.data_ptr() == b.params[lo:hi].data_ptr()
        for m, b, (lo, hi) in zip(optimizer.masters, optimizer.buckets, optimizer.ranges)
    )
    params_view_flat = all(
        seg.param.untyped_storage().data_ptr() == b.params.untyped_storage().data_ptr()
        for b in optimizer.buckets
        for seg in b.segments
    )
    return {"shards_in_place": shards_in_place, "masters_are_flat": masters_are_flat, "views": params_view_flat,
            "flat": torch.cat([b.params for b in optimizer.buckets])}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_reduces_and_gathers_in_place(pools, stage):
    """ZeRO-1 reduce-scatters into this rank's slice of the flat gradients; stages 1-2 update
    (fp32) that slice of the flat parameters and all-gather in place, with no copy of the
    shard: the parameters still view the flat storage and both ranks hold the same values."""
    results = pools.run(2, _zero_lands_in_place, stage)
    for r in results:
        assert r["masters_are_flat"] and r["views"]
        if stage == 1:
            assert r["shards_in_place"] and all(r["shards_in_place"])
    assert torch.equal(results[0]["flat"], results[1]["flat"])


def _buffers_in_a_backward(ctx, stage: int) -> dict:
    """A ZeRO-2/3 step, then a forward and backward: the scratch buffers (and stage 3's spares)
    after it, and which units hold their full parameters right after the forward."""
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.rules.layout import validate
    from fivefold.train import build, train_step

    config = validate(tiny(dp=2, zero=stage, bucket_mb=0.05), 2)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    sync = model.optimizer.sync
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, 0)

    train_step(model, sampler, 0)
    full_after_forward = {}
    units = sync.units if isinstance(sync, ZeroStage3Sync) else []
    if units:
        tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(ctx.rank))
        logits, _ = model.chunks[0](tokens)
        full_after_forward = {
            u.name: all(b.params.untyped_storage().nbytes() > 0 for b in u.buckets) for u in units
        }
    else:
        logits, _ = model.chunks[0](torch.randint(0, 256, (1, 16)))
    logits.float().pow(2).mean().backward()
    model.optimizer.finish_grad_sync()
    spares = len(sync.unit_gatherer.spares) if units else 0
    return {"scratch": len(sync.scratch.free), "buckets": len(sync.buckets), "lent": len(sync.scratch.lent),
            "spares": spares, "full_after_forward": full_after_forward, "units": [u.name for u in units]}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero23_reuse_their_buffers_and_keep_root_and_last_block_for_backward(pools, stage):
    """The reductions of a backward share a few packing and receive buffers (one of each per
    reduction in flight, not one per bucket; none stays lent), stage 3 keeps at most two freed
    unit buffers, and after a forward only the root and the last block are still gathered
    (their backward follows)."""
    from fivefold.parallel.zero import MAX_REDUCTIONS_IN_FLIGHT

    for r in pools.run(2, _buffers_in_a_backward, stage):
        assert r["lent"] == 0 and 0 < r["scratch"] <= 2 * (MAX_REDUCTIONS_IN_FLIGHT + 1), r
        assert stage == 3 or r["scratch"] < 2 * r["buckets"], r  # stage 2 here has many small buckets
        assert r["spares"] <= 2
        if stage == 3:
            root, *blocks = r["units"]
            kept = {name for name, full in r["full_after_forward"].items() if full}
            assert kept == {root, blocks[-1]}, kept


def _gathers_waited_at_first_read(ctx, stage: int) -> dict:
    """A ZeRO-1/2 step, then a forward: which buckets are still being gathered when each read
    point runs (noted by hooks registered after the waiting ones), and the values a reader sees."""
    from fivefold.checkpoint.state import shard_entries
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.rules.layout import validate
    from fivefold.parallel.zero import forward_read_points
    from fivefold.train import build, train_step

    config = validate(tiny(dp=2, zero=stage, bucket_mb=0.05), 2)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    sync, chunk = model.optimizer.sync, model.chunks[0]
    bucket_of = {id(seg.param): b.index for b in sync.buckets for seg in b.segments}
    seen: list[dict] = []

    def note(params):
        def record(*_) -> None:
            read = {bucket_of[id(p)] for p in params}
            seen.append({"read_in_flight": sorted(read & set(sync.gathers.works)),
                         "others_in_flight": len(set(sync.gathers.works) - read)})
        return record

    for module, when, params in forward_read_points(chunk):
        if when == "before":
            module.register_forward_pre_hook(note(params))
        else:
            module.register_forward_hook(note(params))
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, 0)
    train_step(model, sampler, 0)
    in_flight_before_save = len(sync.gathers.works)
    shard_entries(model)  # what a checkpoint saves: it must wait first
    in_flight_after_save = len(sync.gathers.works)
    train_step(model, sampler, 1)
    in_flight_after_step = sorted(sync.gathers.works)
    seen.clear()
    with torch.no_grad():  # an evaluation forward reads them too
        chunk(torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)))
    model.optimizer.wait_for_parameters()
    return {"save": (in_flight_before_save, in_flight_after_save), "after_step": in_flight_after_step, "order": sync.gathers.order, "buckets": len(sync.buckets),
            "seen": seen, "flat": torch.cat([b.params for b in sync.buckets])}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_gathers_overlap_the_next_forward(pools, stage):
    """The step returns with every bucket's all-gather in flight, issued in the order the next
    forward reads the buckets; each read point (embedding, each block, the head after the last
    block) finds its own buckets landed while later ones are still in flight; a checkpoint's
    save waits for all of them first, and after the explicit wait both ranks hold the same
    parameters."""
    results = pools.run(2, _gathers_waited_at_first_read, stage)
    for r in results:
        assert r["save"] == (r["buckets"], 0), r["save"]
        assert r["after_step"] == sorted(range(r["buckets"])) and r["buckets"] > 2, r
        assert sorted(r["order"]) == list(range(r["buckets"])) and r["order"] != sorted(r["order"])
        assert all(not s["read_in_flight"] for s in r["seen"]), r["seen"]
        assert r["seen"][0]["others_in_flight"] > 0, r["seen"]  # the first reader did not wait for all
    assert torch.equal(results[0]["flat"], results[1]["flat"])
