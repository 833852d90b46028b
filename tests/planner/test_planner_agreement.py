"""The planner agrees with the runtime on every rank: model-state bytes within 1%, communication bytes exactly.

Each layout trains one step of a tiny preset on the worker pool. Every rank's per-axis wire
bytes (counted by comm.py, up to the optimizer update: the loss and MoE statistics the
training loop reports afterwards are not part of the step) and its held model states are
compared with the planner's plan for that rank's own pipeline stage
(`fivefold.planner.stages.stage_plans`), so the stages `estimate` does not report (it names
the busiest) are checked too. The "world" axis (the global gradient norm) is not a parallel
axis and is left out (`fivefold.rules.volumes.PLANNER_AXIS`), as the dry run and the logged
metrics leave it out.

Held memory is taken at the end of the backward and again after the gradient reduction, and
each kind is held to the planner at the larger of the two, as the dry run does: ZeRO-2/3 keep
the gradients that gradient finalizers complete (sums over tp, the tied embedding over the
pipeline ends) full until the end of the step, the others sharded.

Expert parallelism's all-to-all volume depends on the actual routing, which the planner
assumes balanced: there the runtime's number of all-to-alls equals the planner's, and its
bytes equal the planner's calls applied to the routing it really had. Most runs are fp32; the
bf16 ones check which activations travel in which dtype (`fivefold.rules.volumes.ElementBytes`);
bf16 data parallelism and ZeRO with fp32 master weights are checked in test_precision.py too.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from fivefold.config import load_config
from fivefold.rules.layout import validate
from fivefold.planner.bridge import layout_spec, model_spec
from fivefold.planner.stages import StagePlan, stage_plans
from fivefold.rules.precision import PrecisionPolicy
from fivefold.tools.dryrun import bytes_per_planner_axis, held_at_peak

MODEL_STATES = ("params", "grads", "optimizer")


class RankStep(NamedTuple):
    """What one rank measured in one training step."""

    stage: int  # its pipeline stage
    wire: dict[str, int]  # bytes sent per planner axis
    held: dict[str, int]  # model-state bytes, padding left out
    ep_calls: int  # expert-parallel all-to-alls
    routing: dict[str, tuple[torch.Tensor, int]]  # MoE layer -> (slots sent to each expert, dispatches)


def _train_one_step(ctx, config) -> RankStep:
    """One step of `config` on this rank, measured (see the module docstring)."""
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.observe.held_memory import held_memory
    from fivefold.parallel.expert_parallel import moe_dispatchers
    from fivefold.train import build, forward_backward, local_micro_batches

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
    held = [held_memory(model.chunks, model.optimizer)]  # the end of the backward
    model.optimizer.finish_grad_sync()
    held.append(held_memory(model.chunks, model.optimizer))  # after the reduction
    model.optimizer.clip_grad_norm(config.train.grad_clip)
    model.optimizer.step(1e-3)
    routing = {name: (d.sent_counts.clone(), d.calls) for name, d in moe_dispatchers(model.chunks).items()}
    return RankStep(mesh.pp.rank, bytes_per_planner_axis(mesh.stats.wire), held_at_peak(held),
                    mesh.stats.calls.get(("ep", "all_to_all"), 0), routing)


def _stage_plans(config) -> list[StagePlan]:
    precision = PrecisionPolicy.from_train(config.train).name
    return stage_plans(model_spec(config.model, config.train.seq_len),
                       layout_spec(config.layout, config.train.global_batch), hardware="cpu", precision=precision)


def _routed_ep_bytes(config, per_rank: list[RankStep], rank: int) -> int:
    """`rank`'s ep all-to-all bytes from the routing its ep group really had, with the
    planner's forward passes per micro-batch."""
    from fivefold.rules.layout import group_ranks
    from fivefold.rules.volumes import all_to_all_wire_bytes, forward_passes

    (group,) = [g for g in group_ranks(config.layout, "ep") if rank in g]
    element_bytes = PrecisionPolicy.from_train(config.train).element_bytes()
    total = 0
    for layer, (_, dispatches) in per_rank[rank].routing.items():
        sent = torch.stack([per_rank[r].routing[layer][0] for r in group])  # (ep, E)
        total += all_to_all_wire_bytes(sent, group.index(rank), config.model.hidden, element_bytes, dispatches,
                                       forward_passes=forward_passes(config.layout.recompute))
    return total


class Case(NamedTuple):
    preset: str
    world: int
    overrides: tuple[str, ...]


def _case(preset: str, world: int, **layout) -> Case:
    return Case(preset, world, tuple(f"{k if '.' in k else 'layout.' + k}={v}" for k, v in layout.items()))


CASES = [
    *(_case("tiny", 2, **lay) for lay in (
        {"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3},
        {"dp": 2, "zero": 1, "grad_accum": 2}, {"dp": 2, "grad_accum": 2}, {"dp": 2, "zero": 2, "grad_accum": 2},
        {"dp": 2, "zero": 3, "grad_accum": 2}, {"tp": 2}, {"tp": 2, "sequence_parallel": True},
        {"pp": 2, "grad_accum": 2}, {"cp": 2, "cp_algorithm": "ring"}, {"cp": 2, "cp_algorithm": "allgather"},
        {"cp": 2, "cp_algorithm": "ulysses"}, {"dp": 2, "zero": 3, "recompute": "full"},
        {"dp": 2, "zero": 3, "recompute": "selective"}, {"tp": 2, "sequence_parallel": True, "recompute": "full"},
        {"tp": 2, "recompute": "full"}, {"cp": 2, "cp_algorithm": "ring", "recompute": "full"},
        {"pp": 2, "grad_accum": 2, "recompute": "full"},
        # selective recomputation repeats the attention core's cp collectives
        {"cp": 2, "cp_algorithm": "ring", "recompute": "selective"},
        {"cp": 2, "cp_algorithm": "allgather", "recompute": "selective"},
        {"cp": 2, "cp_algorithm": "ulysses", "recompute": "selective"},
        {"cp": 2, "cp_algorithm": "ulysses", "recompute": "full"},
    )),
    *(_case("tiny", 4, **lay) for lay in (
        {"dp": 2, "tp": 2, "zero": 2}, {"tp": 2, "cp": 2, "cp_algorithm": "ring", "sequence_parallel": True},
        {"tp": 4},  # tiny has 2 kv heads: tp=4 repeats each on 2 ranks
        # finalizers (SP norms; the tied embedding over the pipeline ends) defer their gradients' ZeRO-2/3 reduction
        {"dp": 2, "tp": 2, "zero": 2, "sequence_parallel": True, "grad_accum": 2},
        {"pp": 2, "dp": 2, "zero": 2, "grad_accum": 2, "model.tied_embeddings": "true"},
        {"pp": 2, "tp": 2, "grad_accum": 2, "model.tied_embeddings": "true"},
    )),
    *(_case("tiny-moe", 2, **lay) for lay in (
        {"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "recompute": "full"}, {"dp": 2, "ep": 2, "recompute": "selective"},
        {"dp": 2, "ep": 2, "grad_accum": 2, "recompute": "full"},
        # bf16 autocast: attention in bf16, the MoE statistics in fp32
        {"cp": 2, "cp_algorithm": "ulysses", "model.dropless": "false", "train.dtype": "bf16",
         "recompute": "selective"},
    )),
    *(_case("tiny-moe", 4, **lay) for lay in (
        {"dp": 2, "ep": 2, "tp": 2}, {"pp": 2, "tp": 2, "grad_accum": 2},  # no MoE statistics over tp in the step
        # each MoE layer sums its per-sequence statistics over cp; without dropless, gathers slot counts
        {"dp": 2, "cp": 2, "ep": 2}, {"dp": 2, "cp": 2, "ep": 2, "model.dropless": "false"},
        {"cp": 2, "pp": 2, "grad_accum": 2, "cp_algorithm": "allgather", "model.dropless": "false",
         "recompute": "full"},
        # router gradients summed over tp: ZeRO-2/3 reduce them once per step and hold them full
        {"dp": 2, "ep": 2, "tp": 2, "zero": 2, "grad_accum": 2},
        {"dp": 2, "ep": 2, "tp": 2, "zero": 3, "grad_accum": 2},
    )),
    # ZeRO-3 in a pipeline: every unit gathered around each micro-batch, gradients reduced once per
    # step (zb-h1: test_zero3_zb_h1_gathers_at_most_what_the_planner_counts)
    *(_case("tiny", 4, pp=2, dp=2, zero=3, grad_accum=4, **lay) for lay in (
        {"pp_schedule": "gpipe"}, {"pp_schedule": "1f1b"},
        {"pp_schedule": "interleaved", "vpp": 2}, {"pp_schedule": "1f1b", "model.tied_embeddings": "true"},
    )),
    # ZeRO-3 gathering once per step (layout.zero3_gather="step"): one all-gather per unit, the
    # full parameters held through the step; with and without a pipeline
    _case("tiny", 4, pp=2, dp=2, zero=3, grad_accum=4, pp_schedule="1f1b", zero3_gather="step"),
    _case("tiny", 2, dp=2, zero=3, grad_accum=2, zero3_gather="step"),
    # hybrid sharding: ZeRO inside shard groups of neighbouring ranks, shard sums over the replicas
    *(_case(preset, world, **lay) for preset, world, lay in (
        ("tiny", 4, {"dp": 4, "dp_shard": 2, "zero": 1, "grad_accum": 2}),
        ("tiny", 4, {"dp": 4, "dp_shard": 2, "zero": 2, "grad_accum": 2}),
        ("tiny", 4, {"dp": 4, "dp_shard": 2, "zero": 3}),
        ("tiny", 4, {"dp": 2, "dp_shard": 1, "cp": 2, "zero": 3, "cp_algorithm": "ring"}),
        ("tiny", 8, {"dp": 4, "dp_shard": 2, "tp": 2, "zero": 3, "sequence_parallel": True}),
        ("tiny", 8, {"dp": 4, "dp_shard": 2, "pp": 2, "zero": 2, "grad_accum": 2, "model.tied_embeddings": "true"}),
        ("tiny", 6, {"dp": 6, "dp_shard": 2, "zero": 3, "train.global_batch": 12}),
        ("tiny-moe", 4, {"dp": 4, "dp_shard": 2, "ep": 2, "zero": 2}),
        ("tiny-moe", 4, {"dp": 4, "dp_shard": 2, "ep": 4, "zero": 3}),  # experts: replicas only
    )),
    # bf16 autocast over fp32 weights: the residual stream (embedding and norm outputs, what the
    # pipeline sends, the MoE dispatch) stays fp32, matmul outputs are bf16; ring attention's
    # dK/dV accumulators are fp32
    *(_case(preset, world, **lay, **{"train.dtype": "bf16"}) for preset, world, lay in (
        ("tiny", 2, {"tp": 2}), ("tiny", 2, {"tp": 2, "sequence_parallel": True}),
        ("tiny", 2, {"tp": 2, "sequence_parallel": True, "tp_overlap": True}),
        ("tiny", 2, {"tp": 2, "recompute": "full"}), ("tiny", 2, {"pp": 2, "grad_accum": 2}),
        ("tiny", 2, {"cp": 2, "cp_algorithm": "ring"}), ("tiny", 2, {"cp": 2, "cp_algorithm": "allgather"}),
        ("tiny", 2, {"dp": 2, "zero": 3}), ("tiny-moe", 2, {"dp": 2, "ep": 2}),
        ("tiny-moe", 4, {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}),
    )),
    # bf16 weights: every activation in bf16 but ring attention's accumulators
    *(_case(preset, world, **lay, **{"train.dtype": "bf16", "train.param_dtype": "bf16"}) for preset, world, lay in (
        ("tiny", 2, {"tp": 2, "sequence_parallel": True}), ("tiny", 2, {"pp": 2, "grad_accum": 2}),
        ("tiny", 2, {"cp": 2, "cp_algorithm": "ring"}), ("tiny-moe", 2, {"dp": 2, "ep": 2}),
    )),
]


def _case_id(case: Case) -> str:
    return f"{case.preset}-" + ",".join(o.removeprefix("layout.") for o in case.overrides)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_rank_matches_the_plan_of_its_stage(pools, case):
    config = validate(load_config(case.preset, list(case.overrides)), case.world)
    per_rank = pools.run(case.world, _train_one_step, config)
    plans = _stage_plans(config)
    assert {r.stage for r in per_rank} == set(range(len(plans)))
    for rank, measured in enumerate(per_rank):
        plan = plans[measured.stage]
        where = (_case_id(case), "rank", rank, "stage", measured.stage)
        planned = {axis: int(v) for axis, v in plan.comm_bytes.items() if v}
        wire = dict(measured.wire)
        if config.layout.ep > 1:
            planned_calls = sum(c.calls for c in plan.collectives if c.axis == "ep")
            assert measured.ep_calls == planned_calls, (*where, measured.ep_calls, planned_calls)
            assert wire.pop("ep", 0) == _routed_ep_bytes(config, per_rank, rank), where
            planned.pop("ep", None)
        assert wire == planned, (*where, wire, planned)
        for kind in MODEL_STATES:
            expected = getattr(plan.memory, kind)
            assert abs(measured.held[kind] - expected) <= 0.01 * expected, (*where, kind, measured.held[kind], expected)



def _logged_comm_bytes(ctx, config) -> dict[str, int]:
    """The per-axis bytes a training run logs for step 0 (metrics.jsonl's `comm_bytes`)."""
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.observe.metrics import rank_measurements
    from fivefold.train import build, train_step

    mesh = ctx.mesh(config.layout)
    data = load_tokens(config.data, load_tokenizer("bytes"))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    model = build(config, mesh, torch.device("cpu"))
    result = train_step(model, sampler, 0)
    return rank_measurements(model, result, torch.device("cpu"), with_held=False)["comm_bytes"]


def test_logged_bytes_per_axis_count_the_tied_embedding_over_the_pipeline(pools):
    """metrics.jsonl's bytes per axis are the planner's, the tied embedding's gradient sum
    between the first and last stage (axis pp_ends) included in pp, as the planner counts it."""
    config = validate(load_config("tiny", ["model.tied_embeddings=true", "layout.pp=2", "layout.grad_accum=2"]), 2)
    logged = pools.run(2, _logged_comm_bytes, config)[0]
    busiest = {axis: max(int(plan.comm_bytes.get(axis, 0)) for plan in _stage_plans(config)) for axis in ("pp", "dp")}
    assert logged == {axis: v for axis, v in busiest.items() if v}


def test_zero3_zb_h1_gathers_at_most_what_the_planner_counts(pools):
    """ZeRO-3 under zb-h1: a block's gradients complete in its weight step (W), so the block stays
    gathered from its input-gradient step (B) to W, and a forward that runs in between finds it
    gathered. The planner counts a gather for every forward and backward of every micro-batch, an
    upper bound: exact on the stage where no forward falls between a B and its W, above elsewhere.
    Model states agree within 1% on every rank."""
    case = _case("tiny", 4, pp=2, dp=2, zero=3, grad_accum=4, pp_schedule="zb-h1")
    config = validate(load_config(case.preset, list(case.overrides)), case.world)
    per_rank = pools.run(case.world, _train_one_step, config)
    plans = _stage_plans(config)
    measured = {rank: r.wire["dp"] for rank, r in enumerate(per_rank)}
    planned = {rank: int(plans[r.stage].comm_bytes["dp"]) for rank, r in enumerate(per_rank)}
    print("zb-h1 + ZeRO-3 dp bytes per rank, measured vs planned:", measured, planned)
    assert all(measured[r] <= planned[r] for r in measured), (measured, planned)
    assert any(measured[r] == planned[r] for r in measured) and any(measured[r] < planned[r] for r in measured)
    for rank, r in enumerate(per_rank):
        assert r.wire["pp"] == int(plans[r.stage].comm_bytes["pp"]), rank
        for kind in MODEL_STATES:
            expected = getattr(plans[r.stage].memory, kind)
            assert abs(r.held[kind] - expected) <= 0.01 * expected, (rank, kind, r.held[kind], expected)
