"""`--layout auto`: let the cost model choose the layout for this model, world size and machine.

Nothing here encodes a rule of thumb: the search ranks every valid layout by predicted step
time on the calibrated machine (memory per process = the machine's memory shared by the
processes), and the first one fivefold's own validation accepts wins.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from ..config import Config, Layout, ModelConfig
from ..layout import LayoutError, validate
from ..precision import PrecisionPolicy
from .errors import PlanError
from .hardware import Hardware, calibrate, get_hardware, load_calibration
from .spec import LayoutSpec, ModelSpec


def model_spec(model: ModelConfig, seq_len: int) -> ModelSpec:
    """The planner's view of a fivefold model (arch "llama": RMSNorm, SwiGLU, GQA, MoE)."""
    return ModelSpec(
        layers=model.layers, hidden=model.hidden, heads=model.heads, vocab=model.vocab_size, seq_len=seq_len,
        ffn_hidden=model.ffn, kv_heads=model.n_kv_heads, arch="llama", num_experts=model.num_experts,
        top_k=model.top_k if model.is_moe else 1, expert_ffn_hidden=model.expert_ffn if model.is_moe else None,
        moe_every=model.moe_every, shared_experts=model.shared_experts, tied_embeddings=model.tied_embeddings,
        first_dense_layers=model.first_dense_layers, name=model.name,
    )


def layout_from_spec(spec: LayoutSpec, base: Layout) -> Layout:
    return dataclasses.replace(
        base, dp=spec.dp, tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep, zero=spec.zero, vpp=spec.vpp,
        pp_schedule=spec.schedule, sequence_parallel=spec.sequence_parallel, recompute=spec.recompute,
        cp_algorithm=spec.cp_kind, micro_batch=spec.micro_batch, grad_accum=0, pp_layers=(),
    )


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


def choose_layout(
    config: Config,
    world_size: int | None,
    hardware: str | Hardware | None = None,
    show: Callable[[object], None] | None = print,
) -> Config:
    """The config with the fastest predicted layout of `world_size` processes that fivefold accepts."""
    from .explain import explain
    from .search import search

    world = world_size or min(os.cpu_count() or 1, 8)
    hw = machine_hardware(world, hardware)
    precision = PrecisionPolicy.from_train(config.train).name  # e.g. "bf16,params=fp32,reduce=fp32"
    spec = model_spec(config.model, config.train.seq_len)
    candidates = search(spec, gpus=world, hardware=hw, global_batch=config.train.global_batch, precision=precision, top=None)
    accepted = []
    for layout_spec, est in candidates:
        try:
            chosen = validate(config.replace(layout=layout_from_spec(layout_spec, config.layout)), world)
        except LayoutError:
            continue
        accepted.append((layout_spec, est, chosen))
    if not accepted:
        raise PlanError(f"no layout of {world} processes that fivefold accepts fits {config.model.name}; "
                        "try another --world-size or a smaller global batch")
    if show is not None:
        _show(spec, [(l, e) for l, e, _ in accepted], explain, show)
    return accepted[0][2]


def _show(spec: ModelSpec, candidates, explain, show: Callable[[object], None]) -> None:
    from rich.console import Console

    from .render import format_table

    console = Console()
    console.print(format_table(candidates, top=8))
    console.print(explain(spec, candidates))
