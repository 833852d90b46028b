"""`--layout auto`: the planner's search picks a layout that fivefold accepts."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import load_config
from fivefold.rules.layout import validate
from fivefold.planner import HARDWARE, PlanError
from fivefold.tools.auto_layout import choose_layout, model_spec


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


def test_auto_layout_plans_for_the_cuda_device_the_run_uses(monkeypatch):
    import types

    import torch

    import fivefold.parallel.mesh
    from fivefold.tools.auto_layout import default_world_size, run_hardware

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_000_000_000)
    monkeypatch.setattr(fivefold.parallel.mesh, "device_for", lambda preference: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    config = load_config("tiny")
    assert run_hardware(config, 8) == HARDWARE["H100-80GB"]  # the preset, whole device memory per rank
    assert default_world_size(config) == 4  # one process per GPU
    assert run_hardware(config, 8, hardware="cpu").name == "cpu"  # an explicit choice wins


def test_auto_layout_uses_the_cpu_calibration_for_cpu_runs(tmp_path, monkeypatch):
    from fivefold.tools.auto_layout import run_hardware
    from fivefold.planner.hardware import CPU_DEFAULT, save_calibration

    monkeypatch.setenv("FIVEFOLD_CACHE_DIR", str(tmp_path))
    save_calibration(CPU_DEFAULT)
    config = load_config("tiny", ["train.device=cpu"])
    hw = run_hardware(config, 4)
    assert hw.name == "cpu" and hw.memory_bytes == CPU_DEFAULT.memory_bytes // 4  # shared by 4 processes
