"""Configuration loading and layout validation: pure functions, no processes."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fivefold.config import ConfigError, Layout, load_config, parse_overrides, preset_names
from fivefold.rules.layout import (
    Coords,
    LayoutError,
    coords_to_rank,
    edp_index,
    ep_index,
    group_ranks,
    rank_to_coords,
    validate,
)


def test_presets_load_and_validate():
    names = preset_names()
    for required in ("tiny", "tiny-moe", "small", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3"):
        assert required in names
    for name in names:
        validate(load_config(name))


def test_small_preset_is_the_cpu_demo_size():
    from fivefold.model import Transformer
    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(load_config("small").model).parameters())
    assert 10e6 <= params <= 30e6


def test_dotted_overrides_are_typed():
    config = load_config("tiny", ["train.steps=7", "layout.tp=2", "layout.sequence_parallel=true", "train.lr=0.5"])
    assert config.train.steps == 7 and config.layout.tp == 2
    assert config.layout.sequence_parallel is True and config.train.lr == 0.5
    layers = load_config("tiny", ["layout.pp=2", "layout.pp_layers=1,3"]).layout.pp_layers
    assert layers == (1, 3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stepz=3"], "unknown key 'train.stepz'"),
        (["trian.steps=3"], "unknown section 'trian'"),
        (["train.steps=many"], "train.steps: expected an integer"),
        (["layout.sequence_parallel=maybe"], "expected true or false"),
        (["train.lr=fast"], "train.lr: expected a number"),
        (["steps=3"], "must be section.key"),
    ],
)
def test_bad_config_keys_are_rejected_with_their_path(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError, match="presets: .*tiny"):
        load_config("tinyy")


def test_missing_config_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))


def test_override_without_equals():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["train.steps"])


BAD_LAYOUTS = [
    ({"layout.tp": 3}, "tp=3 does not divide 8 attention heads; use one of 1, 2, 4, 8"),
    ({"layout.tp": 16}, "tp=16 does not divide 8 attention heads"),
    ({"layout.zero": 4}, "not a ZeRO stage; use 0, 1, 2 or 3"),
    ({"layout.zero": 1}, "dp x cp = 1"),
    ({"layout.dp": 3}, "global_batch=8 does not split over dp=3"),
    ({"layout.pp": 8}, "only 4 layers"),
    ({"layout.pp": 2, "layout.pp_layers": "1,2"}, "must be positive and sum to the model's 4 layers"),
    ({"layout.pp": 2, "layout.pp_layers": "4"}, "lists 1 stages but pp x vpp = 2"),
    ({"layout.pp": 2, "layout.vpp": 2}, "needs layout.pp_schedule='interleaved'"),
    ({"layout.pp_schedule": "magic"}, "pp_schedule='magic' is unknown"),
    ({"layout.pp": 2, "layout.pp_schedule": "interleaved", "layout.vpp": 2, "layout.grad_accum": 1},
     "multiple of pp=2, got 1; use grad_accum in [2, 4, 8] with micro_batch = 8 / grad_accum"),
    # every value it suggests is accepted: none that the batch cannot split
    ({"layout.pp": 2, "layout.pp_schedule": "interleaved", "layout.vpp": 2, "layout.grad_accum": 3,
      "train.global_batch": 6}, "use grad_accum in [2, 6]"),
    ({"layout.pp": 2, "layout.pp_schedule": "interleaved", "layout.vpp": 2, "layout.grad_accum": 1,
      "train.global_batch": 3}, "no grad_accum can: the 3 sequences per data-parallel rank are not a multiple of "
     "pp=2; use a train.global_batch that is a multiple of dp x pp = 2"),
    ({"layout.pp": 2, "layout.pp_schedule": "dualpipev"}, "places two chunks on each pipeline rank in a V; set vpp=2"),
    ({"layout.pp": 2, "layout.pp_schedule": "dualpipev", "layout.vpp": 2, "layout.grad_accum": 2},
     "needs at least 2 x pp - 1 = 3 micro-batches, got 2; use grad_accum >= 3"),
    ({"layout.pp": 2, "layout.pp_schedule": "dualpipev", "layout.vpp": 2, "layout.grad_accum": 4,
      "model.tied_embeddings": True}, "set model.tied_embeddings=false or use another pp_schedule"),
    ({"layout.cp_algorithm": "teleport"}, "cp_algorithm='teleport' is unknown"),
    ({"layout.cp": 2, "train.seq_len": 30}, "seq_len=30 is not divisible by 4"),
    ({"layout.ep": 2, "layout.dp": 2}, "needs a Mixture-of-Experts model"),
    ({"layout.sequence_parallel": True}, "sequence_parallel needs tp > 1"),
    ({"layout.tp": 2, "layout.sequence_parallel": True, "train.seq_len": 33}, "multiple of 2"),
    ({"layout.micro_batch": 3}, "micro_batch=3 does not divide the 8 sequences"),
    ({"layout.micro_batch": 2, "layout.grad_accum": 2}, "but global_batch=8"),
    ({"layout.recompute": "some"}, "recompute='some' is unknown"),
    ({"train.dtype": "fp8"}, "dtype='fp8' is unknown"),
    ({"train.seq_len": 1000}, "exceeds model.max_seq_len"),
    ({"model.capacity_factor": 2.0, "model.dropless": False}, "MoE options"),
    ({"layout.dp": 0}, "must be at least 1"),
]


@pytest.mark.parametrize("overrides, message", BAD_LAYOUTS)
def test_bad_layouts_are_rejected_with_a_fix(overrides, message):
    config = load_config("tiny", [f"{k}={v}" for k, v in overrides.items()])
    with pytest.raises(LayoutError, match=re.escape(message)):
        validate(config)


BAD_MOE = [
    ({"layout.ep": 3, "layout.dp": 4, "train.global_batch": 12}, "ep=3 must divide dp x cp = 4"),
    ({"layout.ep": 4, "layout.dp": 4, "model.num_experts": 6}, "ep=4 does not divide 6 experts"),
    ({"model.top_k": 9}, "top_k=9 must be between 1 and num_experts=8"),
    ({"model.capacity_factor": 0.0, "model.dropless": False}, "capacity_factor=0.0 must be > 0"),
    ({"model.router": "argmax"}, "router='argmax' is unknown"),
]


@pytest.mark.parametrize("overrides, message", BAD_MOE)
def test_bad_moe_layouts_are_rejected(overrides, message):
    config = load_config("tiny-moe", [f"{k}={v}" for k, v in overrides.items()])
    with pytest.raises(LayoutError, match=message):
        validate(config)


def test_world_size_mismatch_is_reported():
    with pytest.raises(LayoutError, match="needs pp x dp x cp x tp = 1x2x1x2 = 4 processes but 8 were started"):
        validate(load_config("tiny", ["layout.dp=2", "layout.tp=2"]), world_size=8)


def test_batching_is_resolved():
    layout = validate(load_config("tiny", ["layout.dp=2", "layout.micro_batch=2"])).layout
    assert (layout.micro_batch, layout.grad_accum) == (2, 2)
    layout = validate(load_config("tiny", ["layout.dp=4"])).layout
    assert (layout.micro_batch, layout.grad_accum) == (2, 1)


def test_rank_coordinates_round_trip_in_design_order():
    layout = Layout(pp=2, dp=2, cp=2, tp=2)
    for rank in range(layout.world_size):
        assert coords_to_rank(rank_to_coords(rank, layout), layout) == rank
    assert rank_to_coords(1, layout) == Coords(pp=0, dp=0, cp=0, tp=1)  # tp fastest
    assert rank_to_coords(2, layout) == Coords(pp=0, dp=0, cp=1, tp=0)
    assert rank_to_coords(4, layout) == Coords(pp=0, dp=1, cp=0, tp=0)
    assert rank_to_coords(8, layout) == Coords(pp=1, dp=0, cp=0, tp=0)  # pp slowest


def test_groups_partition_the_world():
    layout = Layout(pp=2, dp=2, cp=2, tp=2, ep=2)
    for axis in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp"):
        groups = group_ranks(layout, axis)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(16)), axis
    assert [0, 1] in group_ranks(layout, "tp")
    assert [0, 2, 4, 6] in group_ranks(layout, "dp_cp")
    assert [0, 2] in group_ranks(layout, "ep")  # consecutive members of dp x cp
    assert [0, 4] in group_ranks(layout, "edp")


def test_expert_indices():
    layout = Layout(dp=4, ep=2)
    assert [ep_index(rank_to_coords(r, layout), layout) for r in range(4)] == [0, 1, 0, 1]
    assert [edp_index(rank_to_coords(r, layout), layout) for r in range(4)] == [0, 0, 1, 1]


def test_layout_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout().dp = 2  # type: ignore[misc]


@pytest.mark.parametrize("pp", [2, 4])
def test_every_grad_accum_the_interleaved_refusal_suggests_is_accepted(pp):
    import ast

    for global_batch in range(1, 17):
        for dp in (1, 2):
            if global_batch % dp:
                continue
            base = ["model.layers=8", f"layout.pp={pp}", f"layout.dp={dp}", "layout.pp_schedule=interleaved",
                    "layout.vpp=2", f"train.global_batch={global_batch}"]
            refused = [acc for acc in range(1, global_batch // dp + 1) if (global_batch // dp) % acc == 0 and acc % pp]
            for acc in refused:
                with pytest.raises(LayoutError) as err:
                    validate(load_config("tiny", [*base, f"layout.grad_accum={acc}"]))
                found = re.search(r"use grad_accum in (\[[0-9, ]+\])", str(err.value))
                if found is None:
                    assert f"multiple of dp x pp = {dp * pp}" in str(err.value)
                    continue
                for suggested in ast.literal_eval(found.group(1)):
                    validate(load_config("tiny", [*base, f"layout.grad_accum={suggested}"]))
