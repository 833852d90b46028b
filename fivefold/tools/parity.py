"""Parity: train a layout and the single-process reference from the same seed and data, compare.

The reference is the same config with the trivial layout. A parity check compares the loss
of every step and every parameter at the end, gathered to full tensors (docs/architecture.md):
per-step loss within rtol=1e-5, atol=1e-6; parameters within PARAM_ATOL + PARAM_RTOL * |ref|.

The parameter bound is stated, not tuned. Gradients differ between layouts by rounding
(sums over ranks run in another order), about 1e-7 relative. Adam turns a gradient error
dg into an update error of about lr * dg / (sqrt(v) + eps): small for ordinary elements, but
at elements whose gradient is itself near zero the slope is lr / eps. The test presets
(tiny, tiny-moe) therefore use eps = 1e-5, which bounds that amplification to about
lr * 1e-10 / 1e-5 = 1e-7 per step at lr = 1e-2; over a few steps parameters then agree
within PARAM_ATOL = 1e-5 (plus PARAM_RTOL = 1e-4 relative), with an order of magnitude to spare.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config, Layout
from ..data.loader import open_training_data
from ..rules.layout import validate
from ..parallel.mesh import Mesh
from ..train import build, train_step

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5


@dataclass
class TrainTrace:
    losses: list[float]
    aux_losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    moe: list[dict] = field(default_factory=list)


def reference_config(config: Config) -> Config:
    """The same run on one process: every parallel degree 1, same micro-batching."""
    layout = config.layout
    single = Layout(
        micro_batch=0, grad_accum=0, recompute="none", pp_schedule="1f1b", cp_algorithm=layout.cp_algorithm
    )
    return config.replace(layout=single)


def train_trace(config: Config, mesh: Mesh, steps: int, keep_params: bool = True) -> TrainTrace:
    """Train `steps` steps of `config` on this rank's part of `mesh` (on the mesh's device);
    gather the full weights."""
    config = validate(config, mesh.world_size)
    _, sampler = open_training_data(config)
    model = build(config, mesh, mesh.device)
    trace = TrainTrace([], [], [])
    mesh.stats.reset()
    for step in range(steps):
        result = train_step(model, sampler, step)
        trace.losses.append(result.loss)
        trace.aux_losses.append(result.aux_loss)
        trace.grad_norms.append(result.grad_norm)
        trace.moe.append(result.moe)
    trace.comm_bytes = mesh.stats.by_axis()
    if keep_params:
        full = model.full_parameters()
        trace.params = full if mesh.rank == 0 else {}
    return trace


def run_reference(config: Config, steps: int) -> TrainTrace:
    ref = reference_config(config)
    return train_trace(ref, Mesh.single(validate(ref).layout), steps)


@dataclass
class ParityReport:
    loss_diffs: list[float]
    worst_param: str
    worst_param_diff: float
    ok: bool
    failures: list[str]

    def summary(self) -> str:
        steps = ", ".join(f"{d:.2e}" for d in self.loss_diffs)
        status = "OK" if self.ok else "DIVERGED"
        return f"{status}: loss diff per step [{steps}]; worst parameter {self.worst_param} differs by {self.worst_param_diff:.2e}"


def compare(reference: TrainTrace, other: TrainTrace) -> ParityReport:
    failures = []
    diffs = []
    for step, (a, b) in enumerate(zip(reference.losses, other.losses)):
        diff = abs(a - b)
        diffs.append(diff)
        if diff > LOSS_ATOL + LOSS_RTOL * abs(a):
            failures.append(f"step {step}: loss {b:.8f} vs reference {a:.8f} (diff {diff:.2e})")
    worst_name, worst = "", 0.0
    for name, ref in reference.params.items():
        got = other.params.get(name)
        if got is None:
            failures.append(f"parameter {name} missing")
            continue
        excess = ((got - ref).abs() - PARAM_RTOL * ref.abs()).max().item()
        diff = (got - ref).abs().max().item()
        if diff > worst:
            worst_name, worst = name, diff
        if excess > PARAM_ATOL:
            failures.append(f"parameter {name}: max diff {diff:.2e}")
    return ParityReport(diffs, worst_name, worst, not failures, failures)


def assert_parity(reference: TrainTrace, other: TrainTrace) -> ParityReport:
    report = compare(reference, other)
    assert report.ok, report.summary() + "\n" + "\n".join(report.failures[:10])
    return report


def with_layout(config: Config, **layout: Any) -> Config:
    return config.replace(layout=dataclasses.replace(config.layout, **layout))
