"""Rendering for the command line: rich tables and JSON."""

from __future__ import annotations

import dataclasses
import json

from rich.console import Group
from rich.table import Table

from ..planner.estimate import Estimate
from ..planner.hardware import GiB
from ..planner.spec import LayoutSpec


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def wrappable(layout_text: str) -> str:
    """A layout string as a table cell: a space after each comma, so a narrow terminal wraps it
    between items and never inside one (`parse_layout` and --layout ignore the spaces)."""
    return layout_text.replace(",", ", ")


def format_table(candidates: list[tuple[LayoutSpec, Estimate]], top: int = 10) -> Table:
    """Ranked layouts: layout string, memory, time, throughput, MFU, bubble."""
    table = Table(title="fivefold plan: best layouts first")
    table.add_column("#", justify="right")
    table.add_column("layout", overflow="fold", ratio=1)
    for col in ("GiB", "step s", "tokens/s", "TFLOP/s", "MFU", "bubble"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, (lay, e) in enumerate(candidates[:top], 1):
        table.add_row(str(i), wrappable(lay.short()), _gib(e.memory.total), f"{e.step_time_s:.3g}",
                      f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_device:.0f}", f"{e.mfu:.1%}",
                      f"{e.bubble_fraction:.1%}")
    return table


def estimate_to_dict(e: Estimate) -> dict:
    """Plain-JSON view of an `Estimate` (bytes, seconds, FLOPs)."""
    mem = dataclasses.asdict(e.memory)
    mem["total"] = e.memory.total
    return {
        "layout": dataclasses.asdict(e.layout),
        "model": e.model.name,
        "hardware": e.hardware.name,
        "precision": e.precision,
        "optimizer": e.optimizer,
        "fits": e.fits,
        "memory_bytes": mem,
        "stage_memory_bytes": list(e.stage_memory),
        "flops_per_step": e.flops_per_step,
        "hardware_flops_per_step": e.hardware_flops_per_step,
        "bubble_fraction": e.bubble_fraction,
        "comm_bytes": e.comm_bytes,
        "comm_bytes_by_kind": e.comm_bytes_by_kind,
        "comm_time_s": e.comm_time_s,
        "comm_exposed_s": e.comm_exposed_s,
        "compute_time_s": e.compute_time_s,
        "bubble_time_s": e.bubble_time_s,
        "optimizer_time_s": e.optimizer_time_s,
        "step_time_s": e.step_time_s,
        "tokens_per_s": e.tokens_per_s,
        "tflops_per_device": e.tflops_per_device,
        "hardware_tflops_per_device": e.hardware_tflops_per_device,
        "mfu": e.mfu,
        "hfu": e.hfu,
    }


def to_json(candidates: list[tuple[LayoutSpec, Estimate]] | Estimate, top: int | None = None,
            explanation: str | None = None) -> str:
    """JSON text for ranked candidates (or a single estimate)."""
    if isinstance(candidates, Estimate):
        payload: dict = {"estimate": estimate_to_dict(candidates)}
    else:
        chosen = candidates[:top] if top else candidates
        payload = {"candidates": [dict(rank=i, layout_string=lay.short(), **estimate_to_dict(e))
                                  for i, (lay, e) in enumerate(chosen, 1)]}
    if explanation is not None:
        payload["explanation"] = explanation
    return json.dumps(payload, indent=2)


def format_breakdown(e: Estimate) -> Group:
    """Memory breakdown of one layout's worst stage, plus time and communication."""
    mem = Table(title=f"memory per device (stage {e.memory.stage} of {e.layout.pp})",
                caption=e.layout.short())
    mem.add_column("component")
    mem.add_column("GiB", justify="right")
    mem.add_column("share", justify="right")
    total = max(e.memory.total, 1)
    for name in ("params", "grads", "optimizer", "activations", "buffers"):
        v = getattr(e.memory, name)
        mem.add_row(name, _gib(v), f"{v / total:.0%}")
    mem.add_row("total", _gib(e.memory.total), "100%")
    mem.add_row("usable", _gib(e.memory.capacity), "fits" if e.fits else "DOES NOT FIT")

    time = Table(title="time per step")
    time.add_column("part")
    time.add_column("seconds", justify="right")
    time.add_row("compute (slowest stage)", f"{e.compute_time_s:.4g}")
    time.add_row(f"pipeline bubble ({e.bubble_fraction:.1%})", f"{e.bubble_time_s:.4g}")
    for axis, t in e.comm_exposed_s.items():
        if t:
            time.add_row(f"exposed {axis} communication", f"{t:.4g}")
    time.add_row("optimizer update", f"{e.optimizer_time_s:.4g}")
    time.add_row("step", f"{e.step_time_s:.4g}")
    time.add_row("tokens/s", f"{e.tokens_per_s:,.0f}")
    time.add_row("TFLOP/s per device (model / hardware)",
                 f"{e.tflops_per_device:.1f} / {e.hardware_tflops_per_device:.1f}")
    time.add_row("MFU / HFU", f"{e.mfu:.1%} / {e.hfu:.1%}")

    comm = Table(title="communication per device per step")
    comm.add_column("axis")
    comm.add_column("kind")
    comm.add_column("MiB", justify="right")
    for axis, kinds in e.comm_bytes_by_kind.items():
        for kind, v in kinds.items():
            comm.add_row(axis, kind, f"{v / (1 << 20):,.1f}")
    return Group(mem, time, comm)
