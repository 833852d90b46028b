"""Find where a layout diverges from the single-process model.

During the first step, forward hooks record the output of every module on the residual
stream (embedding, each block's attention, MLP and the block itself, the final norm) and,
after the gradients are complete, every parameter's gradient. Sharded values are gathered
into full tensors indexed by (global sequence, global position): data-parallel ranks hold
different sequences, context-parallel ranks different positions, sequence-parallel tp
ranks different slices of those, pipeline stages different modules. The first module, in
execution order, whose output differs from the reference beyond tolerance is the culprit;
gradients are compared next, in reverse execution order (the order backward runs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..config import Config
from ..parallel.mesh import Mesh
from ..parallel import comm
from ..parallel.sharding import full_shapes, gather_full_state
from ..parallelize import ParallelModel

# A value differs when its largest error exceeds this fraction of the reference's largest
# magnitude: rounding from another summation order stays near 1e-6; a missing or doubled
# reduction is of order one.
RELATIVE_TOLERANCE, ABSOLUTE_FLOOR = 1e-4, 1e-9


def stream_module_names(config: Config) -> list[str]:
    """Names of the residual-stream modules in execution order."""
    names = ["embed"]
    for i in range(config.model.layers):
        names += [f"layers.{i}.attn", f"layers.{i}.mlp", f"layers.{i}"]
    return names + ["norm"]


@dataclass
class Recording:
    """Outputs of one rank's modules for the micro-batches of one step, in call order."""

    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def hook(self, name: str, limit: int):
        def record(module: nn.Module, args, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            calls = self.outputs.setdefault(name, [])
            if len(calls) < limit and torch.is_tensor(out):  # recomputation re-runs forwards: keep the first
                calls.append(out.detach().float().clone())

        return record


@contextlib.contextmanager
def recording(model: ParallelModel, names: list[str]) -> Iterator[Recording]:
    rec = Recording()
    limit = model.config.layout.grad_accum
    handles = []
    for chunk in model.chunks:
        modules = dict(chunk.named_modules())
        for name in names:
            if name in modules and modules[name] is not None:
                handles.append(modules[name].register_forward_hook(rec.hook(name, limit)))
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def _place(full: torch.Tensor, local: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    full[rows[:, None], positions[None, :]] += local


def gather_stream(model: ParallelModel, rec: Recording, names: list[str], batches) -> dict[str, torch.Tensor]:
    """Full (global_batch, seq_len, hidden) outputs of every module, on every rank."""
    config, mesh = model.config, model.mesh
    train, layout = config.train, config.layout
    per_rank = train.global_batch // layout.dp
    full = {}
    for name in names:
        out = torch.zeros(train.global_batch, train.seq_len, config.model.hidden, device=mesh.device)
        for k, local in enumerate(rec.outputs.get(name, [])):
            rows = mesh.dp.rank * per_rank + k * layout.micro_batch + torch.arange(local.shape[0], device=mesh.device)
            positions = batches[k].sequence_positions
            if local.shape[1] == len(positions):
                if mesh.tp.rank != 0:
                    continue  # every tp rank holds the same values: one writes them
            elif local.shape[1] * mesh.tp.size == len(positions):
                positions = positions.chunk(mesh.tp.size)[mesh.tp.rank]  # sequence parallel
            else:
                continue
            _place(out, local, rows, positions)
        comm.all_reduce(out, mesh.world)
        full[name] = out
    return full


def gather_gradients(model: ParallelModel) -> dict[str, torch.Tensor]:
    """Full gradients of every parameter after the step's reduction (before clipping)."""
    return gather_full_state(list(model.chunks), model.mesh, full_shapes(model.config.model), values="grad")


@dataclass
class Divergence:
    kind: str  # "forward output" or "gradient"
    module: str
    tensor: str
    max_abs_diff: float
    max_abs_ref: float

    def describe(self) -> str:
        return (
            f"first divergence: {self.kind} of module '{self.module}' ({self.tensor}): max |diff| "
            f"{self.max_abs_diff:.3e} (reference magnitude {self.max_abs_ref:.3e})"
        )


def _differs(ref: torch.Tensor, got: torch.Tensor) -> tuple[bool, float]:
    if not ref.numel():
        return False, 0.0
    diff = float((got - ref).abs().max())
    return diff > ABSOLUTE_FLOOR + RELATIVE_TOLERANCE * float(ref.abs().max()), diff


def first_divergence(
    ref_outputs: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    ref_grads: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    names: list[str],
) -> Divergence | None:
    """The first forward output (execution order), else the first gradient (backward order)."""
    for name in names:
        if name in ref_outputs and name in outputs:
            bad, diff = _differs(ref_outputs[name], outputs[name])
            if bad:
                return Divergence("forward output", name, "output", diff, float(ref_outputs[name].abs().max()))
    for pname in reversed(list(ref_grads)):
        if pname in grads:
            bad, diff = _differs(ref_grads[pname], grads[pname])
            if bad:
                module, _, leaf = pname.rpartition(".")
                return Divergence("gradient", module, leaf + " gradient", diff, float(ref_grads[pname].abs().max()))
    return None


def probe_first_step(model: ParallelModel, sampler) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run step 0's forward and backward with recording; return full outputs and gradients.

    Leaves the model's gradients reduced but not applied; the caller discards the model.
    """
    from ..train import forward_backward, local_micro_batches

    names = stream_module_names(model.config)
    batches = local_micro_batches(model, sampler, 0)
    with recording(model, names) as rec:
        if model.runner is not None:
            model.runner.run(batches)
        else:
            forward_backward(model, batches, model.device)
    model.optimizer.finish_grad_sync()
    return gather_stream(model, rec, names, batches), gather_gradients(model)


def probe(
    config: Config, mesh: Mesh, after_build: Callable[[ParallelModel], None] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Build `config` on this rank and probe its first step.

    `after_build` may modify the parallel model before it runs (tests use it to break a
    collective on purpose and check that the divergence is found where it was made).
    """
    from ..rules.layout import validate
    from ..data.loader import open_training_data
    from ..train import build

    config = validate(config, mesh.world_size)
    _, sampler = open_training_data(config)
    model = build(config, mesh, mesh.device)
    if after_build is not None:
        after_build(model)
    return probe_first_step(model, sampler)
