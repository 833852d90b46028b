"""`--layout auto`: let the cost model choose the layout for this model, world size and device.

Nothing here encodes a rule of thumb: the search ranks every layout the runtime accepts by
predicted step time on the hardware the run will use, and the fastest one wins. A run on
CUDA devices plans for the device's preset (found by its name); a CPU run plans for this
machine's calibration, its memory shared by the processes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from ..config import Config
from ..rules.layout import validate
from ..planner.bridge import model_spec, runtime_layout
from ..planner.hardware import Hardware, calibrate, get_hardware, hardware_for_gpu, load_calibration
from ..planner.spec import ModelSpec
from ..rules.precision import PrecisionPolicy

__all__ = ["choose_layout", "default_world_size", "machine_hardware", "run_hardware", "model_spec",
           "layout_from_spec"]

layout_from_spec = runtime_layout  # the name this module has always exported


def machine_hardware(world_size: int, hardware: str | Hardware | None = None) -> Hardware:
    """This machine as the planner sees it: calibrated once, memory shared by the processes."""
    if hardware is not None:
        hw = get_hardware(hardware)
    else:
        hw = load_calibration() or calibrate(quick=True)
    if hw.name.lower().startswith("cpu"):  # every rank is a process on this one machine
        hw = dataclasses.replace(
            hw, memory_bytes=hw.memory_bytes // world_size,
            memory_reserved_bytes=hw.memory_reserved_bytes // world_size,
        )
    return hw


def _run_device(config: Config):
    """The device a rank of this run computes on (the rule the run itself uses)."""
    from ..parallel.mesh import device_for

    return device_for(config.train.device)


def run_hardware(config: Config, world_size: int, hardware: str | Hardware | None = None) -> Hardware:
    """The hardware a run of ``config`` computes on: ``hardware`` when given; else the preset
    of the CUDA device the run would use (`fivefold.parallel.mesh.device_for`), or this machine."""
    if hardware is None and _run_device(config).type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(_run_device(config).index or 0)
        return hardware_for_gpu(props.name, props.total_memory)
    return machine_hardware(world_size, hardware)


def default_world_size(config: Config) -> int:
    """Processes when none are asked for: one per local GPU on CUDA, else up to 8 CPU processes."""
    if _run_device(config).type == "cuda":
        import torch

        return torch.cuda.device_count()
    return min(os.cpu_count() or 1, 8)


def choose_layout(
    config: Config,
    world_size: int | None,
    hardware: str | Hardware | None = None,
    show: Callable[[object], None] | None = print,
) -> Config:
    """The config with the fastest predicted layout of `world_size` processes that fivefold accepts."""
    from ..planner.explain import explain
    from ..planner.search import search

    world = world_size or default_world_size(config)
    hw = run_hardware(config, world, hardware)
    precision = PrecisionPolicy.from_train(config.train).name  # e.g. "bf16,params=fp32,reduce=fp32"
    spec = model_spec(config.model, config.train.seq_len)
    candidates = search(spec, gpus=world, hardware=hw, global_batch=config.train.global_batch, precision=precision,
                        top=8)
    if show is not None:
        _show(spec, candidates, explain, show)
    # every candidate passed the runtime's validation inside the search; this resolves batching
    return validate(config.replace(layout=runtime_layout(candidates[0][0], config.layout)), world)


def _show(spec: ModelSpec, candidates, explain, show: Callable[[object], None]) -> None:
    from rich.console import Console

    from .plan_render import format_table

    console = Console()
    console.print(format_table(candidates, top=8))
    console.print(explain(spec, candidates))
