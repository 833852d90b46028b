"""ZeRO-3 inside each pipeline stage: parameters gathered per block around each micro-batch's
forward and backward, for every schedule; parity with one process, the tied embedding included."""

from __future__ import annotations

from fivefold.config import load_config

from helpers import many_layout_parity


def _cfg(*extra: str, preset: str = "tiny", **layout):
    return load_config(preset, ["train.seq_len=16", *extra, *(f"layout.{k}={v}" for k, v in layout.items())])


def _moe(*extra: str, **layout):
    return _cfg(*extra, preset="tiny-moe", **layout)


SCHEDULES = [
    _cfg(pp=2, dp=2, zero=3, pp_schedule="gpipe", grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="1f1b", grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="interleaved", vpp=2, grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="zb-h1", grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="dualpipev", vpp=2, grad_accum=4),
    _cfg("model.tied_embeddings=true", pp=2, dp=2, zero=3, pp_schedule="1f1b", grad_accum=4),
]


def test_zero3_in_every_pipeline_schedule_matches_one_process(pools, reference):
    many_layout_parity(pools, reference, SCHEDULES)


def test_zero3_in_a_pipeline_with_hybrid_sharding_matches_one_process(pools, reference):
    """Each stage's ZeRO-3 shard groups of 2 neighbouring ranks, replicated twice."""
    many_layout_parity(pools, reference, [_cfg(pp=2, dp=4, dp_shard=2, zero=3, pp_schedule="1f1b", grad_accum=2)])


def test_zero3_in_a_pipeline_with_tensor_and_sequence_parallel_matches_one_process(pools, reference):
    """Each stage's blocks hold tp-sharded matrices, themselves ZeRO-3-sharded over dp."""
    many_layout_parity(pools, reference, [
        _cfg(pp=2, dp=2, tp=2, sequence_parallel=True, zero=3, pp_schedule="1f1b", grad_accum=2),
        _cfg(pp=2, dp=2, tp=2, sequence_parallel=True, zero=3, pp_schedule="interleaved", vpp=2, grad_accum=4),
    ])


def test_zero3_in_a_pipeline_with_expert_parallel_matches_one_process(pools, reference):
    """Experts sharded over ep ranks, then ZeRO-3-sharded over their expert-data-parallel copies."""
    many_layout_parity(pools, reference, [_moe(pp=2, dp=2, ep=2, zero=3, pp_schedule="1f1b", grad_accum=2)])
    # dp=4: each expert has two copies, so its parameters are sharded too
    many_layout_parity(pools, reference, [_moe(pp=2, dp=4, ep=2, zero=3, pp_schedule="gpipe", grad_accum=2)])


def test_plan_compare_shows_zero3_with_and_without_pipeline_stages(capsys):
    """Flat ZeRO-3 first, then ZeRO-3 inside 2, 4, 8 stages: a stage keeps its whole gradients
    through the step, so its states shrink with more stages but never to flat ZeRO-3's."""
    from fivefold.planner import load_model
    from fivefold.planner.hardware import get_hardware
    from fivefold.planner.model_states import state_bytes
    from fivefold.tools.plan_cli import run_plan_cli
    from fivefold.tools.plan_compare import zero3_pp_rows

    model = load_model("llama3-70b")
    rows = zero3_pp_rows(model, 64, get_hardware("H100-80GB"), "bf16", 512)
    assert [(r["estimate"].layout.pp, r["estimate"].layout.dp) for r in rows] == [(1, 64), (2, 32), (4, 16), (8, 8)]
    grad_bytes, psi = state_bytes("bf16", "adam").grad, model.num_params()
    flat, *staged = [r["estimate"] for r in rows]
    assert flat.memory.grads < 1.1 * grad_bytes * psi / 64 and flat.bubble_fraction == 0
    for e in staged:
        assert e.memory.grads >= 0.9 * grad_bytes * psi / e.layout.pp  # the stage's gradients, unsharded
        assert e.bubble_fraction > 0 and e.comm_bytes["pp"] > 0
    states = [e.memory.params + e.memory.grads + e.memory.optimizer for e in (flat, *staged)]
    assert states[0] < states[3] < states[2] < states[1]

    assert run_plan_cli(["--compare", "zero3-pp", "--model", "llama3-70b", "--gpus", "64"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if "zero=3" in line]
    assert [[item.strip() for item in line.split("│")[1].split(",")[:3]] for line in table] == [
        ["dp=64", "tp=1", "pp=1"], ["dp=32", "tp=1", "pp=2"], ["dp=16", "tp=1", "pp=4"], ["dp=8", "tp=1", "pp=8"]]


def test_zero3_gathering_once_per_step_matches_one_process(pools, reference):
    """layout.zero3_gather="step": each unit gathered at its first forward of the step and kept
    through the step's micro-batches; the same numbers as gathering per micro-batch."""
    many_layout_parity(pools, reference, [
        _cfg(pp=2, dp=2, zero=3, zero3_gather="step", pp_schedule="1f1b", grad_accum=4),
        _cfg(pp=2, dp=2, zero=3, zero3_gather="step", pp_schedule="interleaved", vpp=2, grad_accum=4),
        _cfg("model.tied_embeddings=true", pp=2, dp=2, zero=3, zero3_gather="step", pp_schedule="zb-h1",
             grad_accum=4),
        _cfg(dp=4, zero=3, zero3_gather="step", grad_accum=2),
    ])


def test_a_gather_policy_without_zero3_or_unknown_is_refused():
    import pytest

    from fivefold.rules.layout import LayoutError, validate

    with pytest.raises(LayoutError, match="zero3_gather='step' chooses when ZeRO-3 gathers parameters but zero=2"):
        validate(_cfg(dp=2, zero=2, zero3_gather="step"))
    with pytest.raises(LayoutError, match="zero3_gather='always' is unknown; use one of micro_batch, step"):
        validate(_cfg(dp=2, zero=3, zero3_gather="always"))


def test_zero3_in_three_pipeline_stages_matches_one_process(pools, reference):
    """An odd number of stages on 6 ranks, the tiny model's 4 layers cut 1, 2, 1 (the first and
    last stages also hold the embedding and the head): every stage's dp pair shards its own
    blocks, under both gather policies."""
    many_layout_parity(pools, reference, [
        _cfg(pp=3, dp=2, zero=3, pp_schedule="1f1b", grad_accum=4),
        _cfg(pp=3, dp=2, zero=3, zero3_gather="step", pp_schedule="1f1b", grad_accum=4),
    ])
