"""Expert parallelism: parity with the single-process MoE model, exact all-to-all accounting,
tensor-parallel composition at the layer level, and bad-input rejection.

ep > 1 needs dp x cp > 1, hence the data-parallel optimizer. While
`fivefold.parallel.data_parallel` is not importable, the pool functions here patch
`fivefold.parallelize.build_optimizer` with `PlacementReducingAdamW`, a test-only stand-in
that sums each gradient over the axis its Placement replicates it on ("edp" for experts,
"dp_cp" otherwise). Once the real data-parallel optimizer exists, it is used unchanged.
"""

from __future__ import annotations

import contextlib
import re
import dataclasses

import pytest
import torch

from fivefold.config import load_config
from fivefold.rules.layout import LayoutError, group_ranks, validate
from fivefold.parallel import comm
from fivefold.parallel.optim import ReplicatedAdamW
from fivefold.parallel.sharding import get_placement
from fivefold.tools.parity import assert_parity, with_layout


class PlacementReducingAdamW(ReplicatedAdamW):
    """Test-only data-parallel stand-in: sums every gradient over its replica axis, then steps."""

    def finish_grad_sync(self) -> None:
        for name, p in self.named:
            over = get_placement(p, name).replicated_over
            axis = "edp" if "edp" in over else "dp_cp" if "dp_cp" in over else None
            if p.grad is not None and axis is not None:
                comm.all_reduce(p.grad, self.mesh[axis])
        super().finish_grad_sync()


@contextlib.contextmanager
def data_parallel_optimizer():
    """Use the real DataParallelAdamW when it exists, the stand-in otherwise."""
    import fivefold.parallelize as parallelize

    try:
        import fivefold.parallel.data_parallel  # noqa: F401

        yield
        return
    except ImportError:
        pass
    original = parallelize.build_optimizer

    def build(chunks, mesh, config):
        if mesh.dp_cp.size == 1:
            return original(chunks, mesh, config)
        from fivefold.parallel.optim import AdamWSettings

        return PlacementReducingAdamW(list(chunks), mesh, AdamWSettings.from_train(config.train))

    parallelize.build_optimizer = build
    try:
        yield
    finally:
        parallelize.build_optimizer = original


def moe_config(*overrides: str, **layout):
    """tiny-moe with Adam's eps at 1e-6 for parity runs.

    Adam's update g / (|g| + eps) has slope lr / eps at g = 0: with eps = 1e-8 and lr = 1e-2 a
    rounding difference of 1e-11 in a gradient element that happens to be near zero (common in
    experts that received one or two tokens) moves that weight by 1e-5 after one step, in any
    layout that sums gradients in another order (plain dp = 2 included). eps = 1e-6 keeps that
    slope at 1e4, so the stated parameter bound tests the parallelism, not this amplification.
    """
    return with_layout(load_config("tiny-moe", ["train.eps=1e-6", *overrides]), **layout)


# ----------------------------------------------------------------------------- parity + accounting


def _train_with_ep(ctx, configs, steps):
    """Train each config; return rank 0's traces and every rank's routing counts and ep bytes."""
    import fivefold.tools.parity as parity
    from fivefold.parallel.expert_parallel import moe_dispatchers

    out = []
    built = []
    original_build = parity.build

    def capture(config, mesh, device):
        built.append(original_build(config, mesh, device))
        return built[-1]

    parity.build = capture
    try:
        with data_parallel_optimizer():
            for config in configs:
                resolved = validate(config, ctx.world_size)
                mesh = ctx.mesh(resolved.layout)
                trace = parity.train_trace(resolved, mesh, steps)
                dispatchers = moe_dispatchers(built[-1].chunks)
                routing = {n: (d.sent_counts.clone(), d.calls) for n, d in dispatchers.items()}
                wire = mesh.stats.wire.get(("ep", "all_to_all"), 0)
                out.append((trace if ctx.rank == 0 else None, routing, wire, len(dispatchers)))
    finally:
        parity.build = original_build
    return out


def _check_accounting(config, per_rank) -> None:
    """Measured ep all-to-all bytes of every rank == the analytic volume of the routing counts."""
    from fivefold.rules.volumes import FP32, all_to_all_wire_bytes

    layout = validate(config).layout
    hidden = config.model.hidden
    for group in group_ranks(layout, "ep"):
        for layer in per_rank[group[0]][1]:
            sent = torch.stack([per_rank[r][1][layer][0] for r in group])  # (ep, E)
            calls = per_rank[group[0]][1][layer][1]
            for i, r in enumerate(group):
                per_rank[r][1][layer] = all_to_all_wire_bytes(sent, i, hidden, FP32, calls)
    for rank, (_, analytic, measured, n_layers) in enumerate(per_rank):
        assert n_layers == config.model.layers
        assert measured == sum(analytic.values()), (rank, measured, analytic)


ROUTING = ("tokens_per_expert", "imbalance", "dropped_fraction")  # what one process measures too


def _routing(moe: list[dict]) -> list[dict]:
    """Per step and layer, the routing statistics (a layout also logs its ep all-to-all matrix)."""
    return [{layer: {k: stats[k] for k in ROUTING} for layer, stats in step.items()} for step in moe]


def _check_routing_identical(reference, trace, capacity: bool) -> None:
    assert _routing(trace.moe) == _routing(reference.moe)  # tokens per expert, imbalance and dropped fraction, exactly
    dropped = [layer["dropped_fraction"] for step in trace.moe for layer in step.values()]
    assert (max(dropped) > 0) == capacity


def _ep_parity(pools, reference, configs, steps=2):
    world = configs[0].layout.world_size
    results = pools.run(world, _train_with_ep, configs, steps)
    for i, config in enumerate(configs):
        trace = results[0][i][0]
        ref = reference(config, steps)
        assert_parity(ref, trace)
        _check_routing_identical(ref, trace, capacity=not config.model.dropless)
        _check_accounting(config, [r[i] for r in results])


def test_ep2_parity_top2_dropless_and_top1_capacity(pools, reference):
    _ep_parity(pools, reference, [
        moe_config(dp=2, ep=2),
        moe_config("model.top_k=1", "model.dropless=false", "model.capacity_factor=1.0", dp=2, ep=2, grad_accum=2),
    ])


def test_ep4_parity_ep_equals_dp_and_ep_below_dp(pools, reference):
    _ep_parity(pools, reference, [
        moe_config("model.dropless=false", "model.capacity_factor=1.0", dp=4, ep=4),
        moe_config("model.top_k=1", "model.router=sigmoid", "model.bias_update_rate=0.01", dp=4, ep=2),
    ])


def test_ep8_parity(pools, reference):
    _ep_parity(pools, reference, [
        moe_config("model.top_k=1", "model.dropless=false", "model.capacity_factor=1.0", dp=8, ep=8),
    ])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, layout, message",
    [
        (["model.num_experts=6"], dict(dp=4, ep=4), "ep=4 does not divide 6 experts"),
        ([], dict(dp=2, ep=4), "ep=4 must divide dp x cp = 2"),
        (["model.top_k=9"], dict(dp=2, ep=2), "top_k=9 must be between 1 and num_experts=8"),
        (["model.capacity_factor=0", "model.dropless=false"], dict(dp=2, ep=2), "capacity_factor=0.0 must be > 0"),
        (["model.capacity_factor=-1"], {}, "capacity_factor=-1.0 must be > 0"),
        (["model.num_experts=0", "model.shared_experts=1"], {}, "MoE options"),
        (["model.num_experts=0", "model.shared_experts=0"], dict(dp=2, ep=2), "ep=2 needs a Mixture-of-Experts"),
        (["model.bias_update_rate=0.01"], {}, "bias_update_rate=0.01 needs model.router='sigmoid'"),
    ],
)
def test_bad_moe_input_is_rejected_before_launch(overrides, layout, message):
    config = moe_config(*overrides, **layout)
    with pytest.raises(LayoutError, match=re.escape(message)):
        validate(config, config.layout.world_size)
