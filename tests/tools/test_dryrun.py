"""`fivefold dryrun`: real-size layouts built on one CPU with fake groups and meta tensors.

Each case builds one rank of a published-size layout, runs one training step's code, and
holds the rank's bytes against the planner's estimate for its pipeline stage: parameters,
gradients and optimizer state within 1%, bytes per axis exactly (MoE layouts included:
the planner counts the slots per expert each dispatch exchanges first). Activation bytes
are within 5% of the planner's (see `_check_activations` for what differs); the dense case
also checks them against the per-layer derivation (fivefold/tools/saved_activations.py). Global batches are cut to a
few micro-batches per rank to keep the cases fast; the 405B case is the published one.
"""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.tools.saved_activations import activation_bytes_per_layer
from fivefold.cli import config_from_args, main
from fivefold.tools.dryrun import DryRunError, dry_run


def _dry_run(preset: str, layout: str, world: int, *overrides: str, ranks=None):
    config = config_from_args(preset, layout, list(overrides))
    return dry_run(config, world, ranks)


def _rows(report, result) -> dict:
    return {row.label: row for row in report.rows(result)}


def _check_states(rows: dict) -> None:
    for label in ("parameters", "gradients", "optimizer state"):
        row = rows[label]
        assert row.planned and abs(row.difference) <= 0.01, (label, row.measured, row.planned)


def _comm(rows: dict) -> dict[str, tuple[int, int]]:
    return {label[5:]: (row.measured, row.planned) for label, row in rows.items() if label.startswith("comm ")}


def _check_activations(rows: dict) -> None:
    """Saved activations within 5% of the planner (in practice within 0.2%). Both come from the
    one saved-tensor list (fivefold/planner/activations.py); what the planner leaves out is the
    rotary cos/sin tables every layer of a stage shares (2 s d fp32 per micro-batch), the loss's
    per-token targets and statistics, and a sigmoid router's two per-token sums."""
    row = rows["activations saved"]
    assert row.planned and abs(row.difference) <= 0.05, (row.measured, row.planned, row.difference)


@pytest.mark.parametrize(
    "preset, layout, world",
    [("tiny", "tp=4", 4), ("tiny", "tp=4,sequence_parallel=true", 4), ("tiny", "cp=2,cp_algorithm=allgather", 2),
     ("tiny", "cp=2,cp_algorithm=ulysses", 2), ("tiny-moe", "tp=2,sequence_parallel=true,dp=2,ep=2", 4),
     ("tiny", "pp=2", 2)],
)
def test_saved_activations_of_every_rank_follow_the_planner(preset, layout, world):
    """Every rank of small layouts the published cases do not cover (kv heads < tp, sequence
    parallel, all-gather and Ulysses context parallel, MoE with tp, SP and ep, both pipeline
    stages): within 1%, the rest being the tables and loss statistics `_check_activations` names."""
    report = _dry_run(preset, layout, world, "--train.global_batch=4", ranks=list(range(world)))
    for result in report.results:
        row = _rows(report, result)["activations saved"]
        assert abs(row.difference) <= 0.01, (result.rank, row.measured, row.planned)


def _check_comm_exact(rows: dict) -> None:
    for axis, (measured, planned) in _comm(rows).items():
        assert measured == planned, (axis, measured, planned)


def test_llama3_8b_data_parallel_matches_planner_and_own_derivation():
    report = _dry_run("llama3-8b", "dp=8", 8, "--train.global_batch=8")
    (result,) = report.results
    rows = _rows(report, result)
    _check_states(rows)
    _check_activations(rows)
    _check_comm_exact(rows)
    assert set(_comm(rows)) == {"dp"}
    config = report.config
    layers = config.model.layers * activation_bytes_per_layer(config.model, config.layout, 1, config.train.seq_len)
    # Outside the layers: the final norm (input, rstd, normalised), the head input and the
    # cross-entropy's fp32 log-probabilities (b s V).
    s, h, v = config.train.seq_len, config.model.hidden, config.model.vocab_size
    outside = 4 * (3 * s * h + s + s * v)
    assert abs(result.saved_peak - (layers + outside)) <= 0.01 * (layers + outside)
    assert result.peak == sum(result.held.values()) + result.saved_peak


def test_llama3_70b_tp8_pp4_dp2_zero1_bf16():
    """The preset trains in bf16: autocast over fp32 weights. The dry run checks the state a bf16
    run keeps (fp32 weights and gradients, fp32 Adam moments sharded by ZeRO-1) and steps with
    fp32 activations, since autocast does not run on the meta device (the report says so)."""
    report = _dry_run("llama3-70b", "tp=8,pp=4,dp=2,zero=1", 64, "--train.global_batch=8")
    assert report.config.train.dtype == "fp32" and "bf16" in report.note
    (result,) = report.results
    rows = _rows(report, result)
    _check_states(rows)
    _check_activations(rows)
    # ZeRO-1 over dp=2: 8 bytes of Adam moments per parameter, half of them here = the 4-byte weights
    assert abs(rows["optimizer state"].measured - rows["parameters"].measured) <= 0.01 * rows["parameters"].measured
    _check_comm_exact(rows)
    assert set(_comm(rows)) == {"dp", "pp", "tp"}


def test_llama3_405b_published_layout_on_16384_ranks():
    report = _dry_run("llama3-405b", "tp=8,pp=16,dp=128", 16384, ranks=[16383])
    (result,) = report.results
    assert result.stage == 15  # the last pipeline stage: head and loss
    rows = _rows(report, result)
    _check_states(rows)
    _check_activations(rows)
    _check_comm_exact(rows)
    assert set(_comm(rows)) == {"dp", "pp", "tp"}
    assert rows["activations saved"].measured > 0


@pytest.mark.slow  # builds two 405B stages on the meta device (minutes)
@pytest.mark.parametrize("layout", ["tp=8,pp=16,dp=128,zero=3", "tp=8,pp=16,dp=128,dp_shard=8,zero=3"])
def test_llama3_405b_zero3_inside_pipeline_stages_flat_and_hybrid_on_16384_ranks(layout):
    """ZeRO-3 inside each of 16 stages, sharded over all 128 dp ranks or over shard groups of 8
    replicated 16 times: the first and last stage agree with the planner."""
    report = _dry_run("llama3-405b", layout, 16384, ranks=[0, 16383])
    assert [r.stage for r in report.results] == [0, 15]
    for result in report.results:
        rows = _rows(report, result)
        _check_states(rows)
        _check_activations(rows)
        _check_comm_exact(rows)
        assert set(_comm(rows)) == {"dp", "pp", "tp"}
        assert abs(rows["peak held + saved"].difference) <= 0.01


@pytest.mark.parametrize(
    "preset, layout, world, overrides",
    [
        ("mixtral-8x7b", "dp=8,ep=8", 8, ["--train.global_batch=8"]),
        ("deepseek-v3", "dp=64,ep=64", 64, ["--train.global_batch=64", "--model.layers=5"]),
    ],
)
def test_moe_expert_parallel(preset, layout, world, overrides):
    report = _dry_run(preset, layout, world, *overrides)
    (result,) = report.results
    rows = _rows(report, result)
    _check_states(rows)
    _check_activations(rows)
    comm = _comm(rows)
    assert set(comm) == {"dp", "ep"}
    assert comm["dp"][0] == comm["dp"][1]
    assert comm["ep"][0] == comm["ep"][1], comm["ep"]  # the tokens and the slots per expert


def test_long_context_ring_attention_cp16():
    report = _dry_run(
        "llama3-8b", "cp=16,tp=8", 128, "--train.global_batch=1", "--train.seq_len=131072",
        "--model.max_seq_len=131072", "--model.layers=4",
    )
    (result,) = report.results
    rows = _rows(report, result)
    _check_states(rows)
    _check_activations(rows)
    _check_comm_exact(rows)
    assert set(_comm(rows)) == {"cp", "dp", "tp"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layout", "tp=3,dp=2"], "tp=3 does not divide"),
        (["--layout", "tp=8,dp=2", "--world-size", "8"], "16 processes but 8"),
        (["--layout", "dp=8", "--rank", "8"], "rank 8 is outside the world of 8 ranks"),
        (["--layout", "dp=8", "--hardware", "B300"], "--hardware 'B300' is unknown; use one of"),
        (["--layout", "dp=2097152", "--train.global_batch=2097152"], "dry-run a layout with the same per-rank shape"),
        (["--layout", "dp=1,micro_batch=1", "--train.global_batch=1000000"], "raise layout.micro_batch or pp"),
    ],
)
def test_bad_input_names_the_fix(argv, message, capsys):
    assert main(["dryrun", "--config", "llama3-8b", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_rank_is_refused_before_building():
    config = config_from_args("llama3-8b", "dp=8", [])
    with pytest.raises(DryRunError, match="use --rank between 0 and 7"):
        dry_run(config, 8, [-1])


# ----------------------------------------------------------------------------- shard initialisation


def test_a_shard_initialises_alone_to_the_slice_of_the_full_tensor():
    from fivefold.config import load_config
    from fivefold.model.init import initial_value
    from fivefold.parallel.sharding import Placement, Split, initial_shard

    model = load_config("tiny").model
    full = initial_value("layers.0.mlp.up.weight", (600, 300), 7, model)
    for splits in [(Split(0, 2, 4),), (Split(1, 1, 3),), (Split(0, 1, 3), Split(1, 0, 2))]:
        placement = Placement("layers.0.mlp.up.weight", (600, 300), splits)
        assert torch.equal(initial_shard(placement, model, 7), placement.take(full))
    # a vocabulary padded to a multiple of tp: the last rank's padding rows are zeros
    padded = Placement("embed.weight", (601, 300), (Split(0, 3, 4),), padded_shape=(604, 300))
    full = initial_value("embed.weight", (601, 300), 7, model)
    assert torch.equal(initial_shard(padded, model, 7), padded.take(full))


def test_shard_initialisation_draws_in_proportion_to_the_shard():
    """A tp=8 row of Llama 3 405B's MLP (53248 x 16384): the tiles it draws hold its own
    elements plus at most one partial tile along each cut edge, never the full tensor."""
    from fivefold.model.init import tiles

    shape, tp = (53248, 16384), 8
    for rank in (0, 5):
        offsets, box = (rank * shape[0] // tp, 0), (shape[0] // tp, shape[1])
        drawn = sum(math.prod(extent) for _, _, extent in tiles(shape, offsets, box))
        assert drawn == math.prod(box)  # 6656 rows: whole tiles
    offsets, box = (0, 3 * 16384 // 7), (53248, 16384 // 7)  # a cut that tiles do not align with
    drawn = sum(math.prod(extent) for _, _, extent in tiles(shape, offsets, box))
    assert math.prod(box) < drawn <= math.prod(box) + 2 * 256 * 53248


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_runs_on_the_meta_device_and_saves_less(recompute):
    """Recomputation runs the checkpointed forward again inside the backward; there attention must
    take the same fused kernel as in the forward, or the checkpoint refuses the recomputed tensors."""
    saved = {}
    for mode in ("none", recompute):
        report = _dry_run("tiny", f"tp=2,pp=2,recompute={mode}", 4, "--train.global_batch=4", ranks=[0])
        saved[mode] = _rows(report, report.results[0])["activations saved"]
    assert saved[recompute].measured < saved["none"].measured
    if recompute == "selective":  # the attention core's scores and outputs are no longer saved
        assert abs(saved[recompute].difference) <= 0.05, (saved[recompute].measured, saved[recompute].planned)
    else:
        assert "recompute=full" in report.render()


def test_parameters_kept_gathered_that_cannot_fit_are_refused_before_building(capsys):
    """zero3_gather=step holds a stage's whole parameters through the step: llama3-70b without
    pipeline stages cannot, and the refusal names the policy that fits."""
    argv = ["--config", "llama3-70b", "--layout", "dp=64,zero=3,zero3_gather=step,recompute=full,micro_batch=1",
            "--train.global_batch=64"]
    assert main(["dryrun", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "zero3_gather=step keeps every parameter of a stage gathered" in err
    assert "use zero3_gather=micro_batch (needs" in err and "or more pp or tp" in err
