"""Every pipeline stage's memory and traffic, on demand.

`estimate` reports the stage that needs the most memory and, per axis, the busiest stage;
a dry run of one rank (fivefold/tools/dryrun.py) compares that rank with its own stage instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from .estimate import MemoryBreakdown, _context, _stage_groups, _stage_memory, _stage_time
from .hardware import Hardware, get_hardware
from .spec import LayoutSpec, ModelSpec
from .validate import check_layout


@dataclass(frozen=True)
class StagePlan:
    """One device of a pipeline stage: its memory, the bytes it sends per axis in a step and
    the collectives behind them."""

    memory: MemoryBreakdown
    comm_bytes: dict
    collectives: tuple = ()


def stage_plans(model: ModelSpec, layout: LayoutSpec, hardware: str | Hardware = "A100-80GB",
                precision: str = "bf16", optimizer: str = "adam") -> list[StagePlan]:
    """`StagePlan` of every pipeline stage of ``layout``, in stage order (same model as `estimate`)."""
    hw = get_hardware(hardware)
    check_layout(model, layout)
    ctx = _context(model, layout, hw, precision, optimizer, None)
    plans = []
    for stage, n_dense, n_moe in _stage_groups(model, layout):
        memory = _stage_memory(ctx, stage, n_dense, n_moe)
        timing = _stage_time(ctx, stage, n_dense, n_moe, memory)
        plans.append(StagePlan(memory, dict(timing.volumes), tuple(timing.colls)))
    return plans
