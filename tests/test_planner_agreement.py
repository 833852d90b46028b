"""The planner agrees with the runtime: model-state bytes within 1%, communication bytes exactly.

Each layout trains one step of the tiny model on the worker pool; the runtime's held memory
(by tensor storage, after the gradients are reduced) and its per-axis wire bytes (counted by
comm.py) are compared with `fivefold.planner.estimate` for the same layout. The "world"
axis (loss reporting, the global gradient norm) is not a parallel axis and is left out.
Expert parallelism's all-to-all volume depends on the actual routing, which the planner
assumes balanced: there the runtime's number of all-to-alls equals the planner's, and its
bytes equal the planner's calls applied to the routing it really had. Full recomputation is
covered for ZeRO-3 (no extra gather), tp (the recomputed pass stops before the MLP exit), cp,
pp and ep (the combine is recomputed: the expert weighting after it saves its output).
These runs are fp32; bf16 with
fp32 master weights is checked the same way in test_precision.py.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import load_config
from fivefold.layout import validate
from fivefold.planner import LayoutSpec, estimate
from fivefold.planner.auto import model_spec
from fivefold.precision import PrecisionPolicy

AXIS_NAMES = {"dp_cp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "edp": "dp"}


def _train_one_step(ctx, config):
    """One step of `config` on this rank: (model, mesh, held memory after the reduction)."""
    from fivefold.data import Sampler, load_tokenizer, load_tokens
    from fivefold.held_memory import held_memory
    from fivefold.train import build, forward_backward, local_micro_batches

    config = validate(config, ctx.world_size)
    mesh = ctx.mesh(config.layout)
    data = load_tokens(config.data, load_tokenizer("bytes"))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    model = build(config, mesh, torch.device("cpu"))
    mesh.stats.reset()
    batches = local_micro_batches(model, sampler, 0)
    if model.runner is not None:
        model.runner.run(batches)
    else:
        forward_backward(model, batches, torch.device("cpu"))
    model.optimizer.finish_grad_sync()
    held = held_memory(model.chunks, model.optimizer)
    model.optimizer.clip_grad_norm(config.train.grad_clip)
    model.optimizer.step(1e-3)
    return model, mesh, held


def _wire_by_planner_axis(mesh) -> dict[str, int]:
    wire: dict[str, int] = {}
    for (axis, _op), nbytes in mesh.stats.wire.items():
        if axis != "world":
            wire[AXIS_NAMES[axis]] = wire.get(AXIS_NAMES[axis], 0) + nbytes
    return wire


def _measure_one_step(ctx, config):
    _, mesh, held = _train_one_step(ctx, config)
    return _wire_by_planner_axis(mesh), held.without_padding()


def _planner(config):
    layout = config.layout
    spec = LayoutSpec(
        dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, zero=layout.zero, vpp=layout.vpp,
        micro_batch=layout.micro_batch, global_batch=config.train.global_batch, schedule=layout.pp_schedule,
        sequence_parallel=layout.sequence_parallel, cp_kind=layout.cp_algorithm, recompute=layout.recompute,
    )
    precision = PrecisionPolicy.from_train(config.train).name
    return estimate(model_spec(config.model, config.train.seq_len), spec, hardware="cpu", precision=precision)


LAYOUTS = {
    2: [
        {"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3},
        {"dp": 2, "zero": 1, "grad_accum": 2}, {"dp": 2, "grad_accum": 2}, {"dp": 2, "zero": 2, "grad_accum": 2},
        {"dp": 2, "zero": 3, "grad_accum": 2}, {"tp": 2}, {"tp": 2, "sequence_parallel": True},
        {"pp": 2, "grad_accum": 2}, {"cp": 2, "cp_algorithm": "ring"}, {"cp": 2, "cp_algorithm": "allgather"},
        {"cp": 2, "cp_algorithm": "ulysses"}, {"dp": 2, "zero": 3, "recompute": "full"},
        {"dp": 2, "zero": 3, "recompute": "selective"}, {"tp": 2, "sequence_parallel": True, "recompute": "full"},
        {"tp": 2, "recompute": "full"}, {"cp": 2, "cp_algorithm": "ring", "recompute": "full"},
        {"pp": 2, "grad_accum": 2, "recompute": "full"},
    ],
    4: [{"dp": 2, "tp": 2, "zero": 2}, {"tp": 2, "cp": 2, "cp_algorithm": "ring", "sequence_parallel": True},
        {"tp": 4}],  # tiny has 2 kv heads: tp=4 repeats each on 2 ranks
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_planner_matches_runtime_memory_and_communication(pools, world):
    configs = [validate(load_config("tiny", [f"layout.{k}={v}" for k, v in lay.items()])) for lay in LAYOUTS[world]]
    measured = pools.run(world, _measure_batch, configs)[0]
    for config, (wire, held) in zip(configs, measured):
        predicted = _planner(config)
        label = str({k: v for k, v in config.layout.__dict__.items() if v not in (0, 1, False, (), "none")})
        for kind in ("params", "grads", "optimizer"):
            expected = getattr(predicted.memory, kind)
            assert abs(held[kind] - expected) <= 0.01 * expected, (label, kind, held[kind], expected)
        planned = {axis: int(v) for axis, v in predicted.comm_bytes.items() if v}
        assert wire == planned, (label, wire, planned)


def _measure_batch(ctx, configs):
    return [_measure_one_step(ctx, config) for config in configs]


# Expert parallelism with each recomputation mode. The all-to-alls follow the routing, which
# the planner assumes balanced, so the runtime is held exactly to the planner's calls (their
# number) and to the same calls over the routing it really had (their bytes).
EP_LAYOUTS = [
    {"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "recompute": "full"}, {"dp": 2, "ep": 2, "recompute": "selective"},
    {"dp": 2, "ep": 2, "grad_accum": 2, "recompute": "full"},
]


def _measure_ep_batch(ctx, configs):
    from fivefold.parallel.expert_parallel import moe_dispatchers

    out = []
    for config in configs:
        model, mesh, held = _train_one_step(ctx, config)
        routing = {name: (d.sent_counts.clone(), d.calls) for name, d in moe_dispatchers(model.chunks).items()}
        calls = mesh.stats.calls.get(("ep", "all_to_all"), 0)
        out.append((_wire_by_planner_axis(mesh), held.without_padding(), calls, routing))
    return out


def _routed_ep_bytes(config, per_rank: list, rank: int) -> int:
    """`rank`'s ep all-to-all bytes from the routing its ep group really had, with the
    planner's forward passes per micro-batch."""
    from fivefold.layout import group_ranks
    from fivefold.volumes import all_to_all_wire_bytes, forward_passes

    (group,) = [g for g in group_ranks(config.layout, "ep") if rank in g]
    total = 0
    for layer, (_, dispatches) in per_rank[rank][3].items():
        sent = torch.stack([per_rank[r][3][layer][0] for r in group])  # (ep, E)
        total += all_to_all_wire_bytes(sent, group.index(rank), config.model.hidden, 4, dispatches,
                                       forward_passes=forward_passes(config.layout.recompute))
    return total


def test_planner_matches_runtime_under_expert_parallel_with_every_recomputation(pools):
    configs = [validate(load_config("tiny-moe", [f"layout.{k}={v}" for k, v in lay.items()])) for lay in EP_LAYOUTS]
    measured = pools.run(2, _measure_ep_batch, configs)
    for i, config in enumerate(configs):
        per_rank = [rank_results[i] for rank_results in measured]
        predicted = _planner(config)
        label = str({k: v for k, v in config.layout.__dict__.items() if v not in (0, 1, False, (), "none")})
        planned_calls = sum(c.calls for c in predicted.collectives if c.axis == "ep")
        planned = {axis: int(v) for axis, v in predicted.comm_bytes.items() if v and axis != "ep"}
        for rank, (wire, held, calls, _) in enumerate(per_rank):
            assert calls == planned_calls, (label, rank, calls, planned_calls)
            assert wire.pop("ep") == _routed_ep_bytes(config, per_rank, rank), (label, rank)
            assert wire == planned, (label, rank, wire, planned)
            for kind in ("params", "grads", "optimizer"):
                expected = getattr(predicted.memory, kind)
                assert abs(held[kind] - expected) <= 0.01 * expected, (label, kind, held[kind], expected)
