"""Rules the planner and the runtime share, pinned against what the runtime does.

Each fact (pipeline split, micro-batches in flight, bubble, model FLOPs, context-parallel
sequence segments, the vpp/schedule rule) is written once; these tests check that the
planner's prediction is what the runtime builds, runs or counts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fivefold.config import load_config
from fivefold.rules.layout import LayoutError, validate
from fivefold.rules.flops import model_flops_per_token
from fivefold.parallel.context_parallel import local_positions
from fivefold.parallel.pipeline import build_stage_chunks
from fivefold.rules.schedules import ActionKind, build_schedule, simulate
from fivefold.planner import LayoutSpec, PlanError, estimate, estimate_run, load_model
from fivefold.planner.bridge import layout_spec, model_spec
from fivefold.planner.pipeline import bubble_fraction, in_flight, in_flight_embedding, stage_layers
from fivefold.observe.timeline import bubble_formula

# (preset, overrides): uneven cost-balanced cuts, interleaved chunks, explicit pp_layers, MoE
SPLIT_CASES = [
    ("tiny", ["layout.pp=2"]),
    ("tiny", ["model.layers=7", "layout.pp=3", "layout.grad_accum=4", "layout.micro_batch=2"]),
    ("small", ["layout.pp=2", "layout.vpp=2", "layout.pp_schedule=interleaved", "layout.grad_accum=4"]),
    ("small", ["layout.pp=4", "train.seq_len=1024", "train.global_batch=4"]),
    ("tiny", ["model.layers=6", "layout.pp=3", "layout.pp_layers=1,3,2"]),
    ("tiny", ["model.layers=8", "layout.pp=2", "layout.vpp=2", "layout.pp_schedule=interleaved",
              "layout.grad_accum=4", "layout.pp_layers=1,3,2,2"]),
    ("tiny-moe", ["model.layers=6", "model.moe_every=2", "layout.pp=4", "layout.grad_accum=4",
                  "layout.micro_batch=2"]),
    ("llama3-8b", ["layout.pp=8", "layout.vpp=2", "layout.pp_schedule=interleaved", "train.seq_len=4096",
                   "train.global_batch=8", "layout.grad_accum=8"]),
]


def _rank_layers(config, rank: int) -> list[int]:
    """The layer indices pipeline rank `rank` builds (all of its chunks, on the meta device)."""
    mesh = SimpleNamespace(pp=SimpleNamespace(rank=rank))  # the builder reads the pp rank only
    chunks = build_stage_chunks(config, mesh)
    return sorted(int(i) for chunk in chunks for i in chunk.layers.keys())


@pytest.mark.parametrize("preset, overrides", SPLIT_CASES)
def test_planner_stage_split_is_the_layers_each_rank_builds(preset, overrides):
    config = validate(load_config(preset, overrides))
    spec = model_spec(config.model, config.train.seq_len)
    lay = layout_spec(config.layout, config.train.global_batch)
    predicted = stage_layers(spec, lay)
    built = [_rank_layers(config, r) for r in range(config.layout.pp)]
    assert predicted == built
    # the estimate is of that split: one memory total per pipeline rank
    assert len(estimate_run(config).stage_memory) == config.layout.pp


def test_the_split_is_uneven_where_the_head_is_costly():
    # Llama 3 8B's output layer (128256 x 4096) costs more than two layers: over 4 stages the
    # runtime gives the last one fewer layers, where an even split (8 each) mispredicts.
    config = validate(load_config("llama3-8b", ["layout.pp=4", "train.global_batch=4", "train.seq_len=4096"]))
    sizes = [len(_rank_layers(config, r)) for r in range(4)]
    assert sum(sizes) == 32 and sizes[-1] < 8 < max(sizes)
    spec = model_spec(config.model, config.train.seq_len)
    assert [len(ids) for ids in stage_layers(spec, layout_spec(config.layout, 4))] == sizes


def _held_chunk_forwards(name: str, pp: int, m: int, vpp: int, rank: int, chunk: int | None = None) -> int:
    """Peak number of (micro-batch, chunk) forwards whose activations `rank` holds in the table."""
    held = peak = 0
    for action in build_schedule(name, pp, m, vpp)[rank]:
        if chunk is not None and action.chunk != chunk:
            continue
        if action.kind == ActionKind.FORWARD:
            held += 1
            peak = max(peak, held)
        elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            held -= 1
    return peak


SCHEDULE_CASES = [(name, pp, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for pp, m in ((2, 1), (4, 2), (4, 8), (3, 7))]
SCHEDULE_CASES += [("interleaved", pp, m, v) for pp, m in ((2, 4), (4, 4), (4, 8), (3, 9)) for v in (1, 2, 3)]


@pytest.mark.parametrize("name, pp, m, vpp", SCHEDULE_CASES)
def test_in_flight_is_what_the_runtime_table_holds(name, pp, m, vpp):
    lay = LayoutSpec(pp=pp, vpp=vpp, schedule=name, global_batch=m)
    for stage in range(pp):
        assert in_flight(lay, stage) == pytest.approx(_held_chunk_forwards(name, pp, m, vpp, stage) / vpp)
    assert in_flight_embedding(lay) == _held_chunk_forwards(name, pp, m, vpp, 0, chunk=0)


@pytest.mark.parametrize("name, pp, m, vpp", SCHEDULE_CASES)
def test_planner_bubble_is_the_simulated_idle_share(name, pp, m, vpp):
    """The planner's bubble (in micro-batch units) and the timeline's formula are one rule, and
    it is the idle share of the runtime's table with backward = 2 x forward."""
    lay = LayoutSpec(pp=pp, vpp=vpp, schedule=name, global_batch=m)
    units = bubble_fraction(lay) * m
    assert bubble_formula(name, pp, m, vpp) == pytest.approx(units / (m + units), abs=1e-12)
    result = simulate(build_schedule(name, pp, m, vpp), pp, f_time=1.0, b_time=2.0)
    assert 1 - result.ideal / result.makespan == pytest.approx(units / (m + units), abs=1e-9)


@pytest.mark.parametrize("preset, seq_len", [("tiny", 32), ("tiny-moe", 64), ("small-moe", 128), ("llama3-8b", 8192),
                                             ("mixtral-8x7b", 4096), ("deepseek-v3", 4096)])
def test_planner_model_flops_are_the_runtime_count(preset, seq_len):
    model = load_config(preset).model
    batch = 4
    e = estimate(model_spec(model, seq_len), LayoutSpec(global_batch=batch), "H100-80GB")
    assert e.flops_per_step == batch * seq_len * model_flops_per_token(model, seq_len)
    assert e.hardware_flops_per_step >= e.flops_per_step


def test_planner_model_flops_of_tied_embeddings_count_the_head_once():
    model = load_config("tiny", ["model.tied_embeddings=true"]).model
    e = estimate(model_spec(model, 32), LayoutSpec(global_batch=2), "H100-80GB")
    assert e.flops_per_step == 2 * 32 * model_flops_per_token(model, 32)


@pytest.mark.parametrize("algorithm", ("allgather", "ring", "ulysses"))
@pytest.mark.parametrize("cp", (2, 4))
def test_sequence_rule_is_what_context_parallel_can_cut(algorithm, cp):
    """validate accepts a sequence length exactly when every cp rank gets an equal share of
    whole segments covering the sequence once (ring: 2 x cp zigzag segments)."""
    for seq_len in range(cp, 8 * cp + 1):
        config = load_config("tiny", [f"layout.cp={cp}", f"layout.cp_algorithm={algorithm}", "layout.dp=1",
                                      f"train.seq_len={seq_len}"])
        try:
            validate(config)
            accepted = True
        except LayoutError:
            accepted = False
        shares = [local_positions(algorithm, cp, r, seq_len).tolist() for r in range(cp)]
        covers = sorted(p for share in shares for p in share) == list(range(seq_len))
        assert accepted == covers, (algorithm, cp, seq_len)


def test_vpp_rule_is_the_runtimes_in_both():
    with pytest.raises(PlanError, match="vpp=2 needs schedule='interleaved'"):
        LayoutSpec(pp=2, vpp=2, global_batch=2)
    with pytest.raises(LayoutError, match="vpp=2 needs layout.pp_schedule='interleaved'"):
        validate(load_config("tiny", ["layout.pp=2", "layout.vpp=2"]))
    # interleaved with one chunk runs in the runtime, so the planner accepts and estimates it
    config = validate(load_config("tiny", ["layout.pp=2", "layout.pp_schedule=interleaved", "layout.grad_accum=4"]))
    lay = layout_spec(config.layout, config.train.global_batch)
    assert lay.vpp == 1 and lay.schedule == "interleaved"
    assert estimate_run(config).bubble_fraction == pytest.approx(1 / 4)


def test_pp_layers_round_trip_between_planner_and_runtime():
    model = load_model("llama3-8b")
    lay = LayoutSpec(pp=4, global_batch=8, pp_layers=(9, 8, 8, 7))
    counts = [len(ids) for ids in stage_layers(model, lay)]
    assert counts == [9, 8, 8, 7]
    with pytest.raises(PlanError, match="sum to the model's 32 layers"):
        estimate(model, LayoutSpec(pp=4, global_batch=8, pp_layers=(9, 8, 8, 8)))


@pytest.mark.parametrize("preset", ("tiny", "tiny-moe", "small-moe", "llama3-8b"))
@pytest.mark.parametrize("tied", (False, True))
def test_planner_parameter_count_is_the_runtime_models(preset, tied):
    import torch

    from fivefold.model import Transformer, count_parameters

    model = load_config(preset, [f"model.tied_embeddings={str(tied).lower()}"]).model
    with torch.device("meta"):
        built = Transformer(model)
    assert model_spec(model, 128).num_params() == count_parameters(built)


def test_vocab_split_rule_is_the_tensor_parallel_padding():
    """validate refuses a tp exactly when the padded vocab-parallel split leaves the last rank
    only padding rows (the rows the runtime's embedding and head hold)."""
    from fivefold.parallel.tensor_parallel import padded_vocab
    from fivefold.rules.volumes import vocab_rows_per_rank

    for vocab in (8, 9, 10, 13, 256, 259):
        for tp in (2, 4, 8):
            rows = vocab_rows_per_rank(vocab, tp)
            assert padded_vocab(vocab, tp) == rows * tp >= vocab
            config = load_config("tiny", [f"model.vocab_size={vocab}", f"layout.tp={tp}", "model.heads=8",
                                          "model.kv_heads=8"])
            try:
                validate(config)
                accepted = True
            except LayoutError:
                accepted = False
            assert accepted == (vocab > (tp - 1) * rows), (vocab, tp)


def test_the_planner_and_the_shared_rules_import_no_torch():
    """The shared modules sit low in the import order: the planner loads them without torch.
    A fresh interpreter is the only place where this can be seen (this one has torch loaded)."""
    import subprocess
    import sys

    code = ("import sys, fivefold.planner, fivefold.planner.estimate, fivefold.rules.stages, fivefold.rules.flops, "
            "fivefold.rules.volumes; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_runs_pp_layers_reach_the_planners_prediction():
    import torch

    from fivefold.observe.prediction import predict_run

    first_heavy = validate(load_config("tiny", ["layout.pp=2", "layout.pp_layers=3,1"]))
    last_heavy = validate(load_config("tiny", ["layout.pp=2", "layout.pp_layers=1,3"]))
    assert layout_spec(first_heavy.layout, 8).pp_layers == (3, 1)
    heavy, light = estimate_run(first_heavy).stage_memory, estimate_run(last_heavy).stage_memory
    assert heavy[0] > light[0] and heavy[1] < light[1]
    logged = predict_run(first_heavy, torch.device("cpu"))
    assert "error" not in logged
