"""`--layout auto`: the planner's search picks a layout that fivefold accepts."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import load_config
from fivefold.layout import validate
from fivefold.planner import HARDWARE, PlanError
from fivefold.planner.auto import choose_layout, model_spec


def test_model_spec_counts_the_same_parameters_as_the_model():
    import torch

    from fivefold.model import Transformer

    for preset in ("tiny", "tiny-moe", "small-moe"):
        config = load_config(preset)
        with torch.device("meta"):
            real = sum(p.numel() for p in Transformer(config.model).parameters())
        assert model_spec(config.model, config.train.seq_len).num_params() == real


def test_auto_layout_is_valid_and_uses_the_world():
    config = choose_layout(load_config("tiny"), 4, hardware="cpu", show=None)
    assert config.layout.world_size == 4
    validate(config, 4)


def test_auto_layout_shards_experts_for_moe():
    config = choose_layout(load_config("tiny-moe"), 8, hardware="cpu", show=None)
    assert config.layout.ep > 1  # from the cost model: expert weights need not be replicated


def test_auto_layout_shards_state_when_memory_is_short():
    small = dataclasses.replace(HARDWARE["cpu"], memory_bytes=int(2.2e8), memory_reserved_bytes=0)
    config = choose_layout(load_config("small"), 2, hardware=small, show=None)
    assert config.layout.zero > 0 or config.layout.tp > 1 or config.layout.pp > 1


def test_auto_layout_reports_when_nothing_fits():
    tiny_memory = dataclasses.replace(HARDWARE["cpu"], memory_bytes=1000, memory_reserved_bytes=0)
    with pytest.raises(PlanError):
        choose_layout(load_config("small"), 2, hardware=tiny_memory, show=None)
