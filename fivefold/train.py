"""The training loop: one step = forward/backward over the micro-batches, sync, clip, update.

The loss of a step is the mean token loss of the global batch: every micro-batch adds its
sum of token losses divided by the number of tokens in the global batch, and its summed
per-sequence MoE auxiliary loss divided by the number of sequences. Gradients are then
summed (not averaged) over data-parallel ranks, which makes every layout compute the
gradient of the same scalar.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .data.sources import Sampler, TokenData, micro_batches
from .observe.held_memory import held_memory
from .parallel.mesh import Mesh
from .model.moe import MoE
from .observe.metrics import PhaseClock, flatten_scalars, mfu
from .parallel import comm
from .parallel.optim import lr_at
from .parallelize import ParallelModel, parallelize
from .model.step import MicroBatch, autocast_for, sequence_scale, token_scale


@dataclass
class StepResult:
    step: int
    loss: float  # mean token loss of the global batch (without auxiliary losses)
    aux_loss: float  # MoE auxiliary losses, averaged over the global batch's sequences
    grad_norm: float
    lr: float
    seconds: float
    tokens: int
    moe: dict[str, Any] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)  # wire bytes per comm.py axis, training only
    held_bytes: dict[str, int] = field(default_factory=dict)  # params/grads/optimizer held after the reduction (measure_held)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the step (PhaseClock)


def local_micro_batches(model: ParallelModel, sampler: Sampler, step: int) -> list[MicroBatch]:
    """This rank's micro-batches of step `step`: its data-parallel rows, its sequence segment(s)."""
    mesh, layout = model.mesh, model.config.layout
    inputs, targets, documents = sampler.local_rows_at(step, mesh.dp.rank, mesh.dp.size)
    device = model.device
    return [
        model.shard_sequence(*(t.to(device) for t in rows))
        for rows in micro_batches(inputs, targets, layout.grad_accum, documents)
    ]


def forward_backward(model: ParallelModel, batches: list[MicroBatch], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient accumulation without a pipeline. Returns this rank's (loss sum, aux sum), detached.

    The sums stay on the device (no host sync per micro-batch); the step reads them once,
    after its one reporting collective (`_report_sums`)."""
    train = model.config.train
    tokens, sequences = token_scale(train), sequence_scale(train)
    chunk = model.chunks[0]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(batches):
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if last else model.optimizer.no_sync()
        with sync:
            with autocast_for(model.config, device):
                logits, aux = chunk(mb.inputs, mb.positions, mb.documents)
                ce = model.loss_fn(logits, mb.targets)
            loss = ce * tokens
            if aux is not None:
                loss = loss + aux * sequences
                aux_sum += aux.detach().double()
            loss.backward()
        loss_sum += ce.detach().double()
    return loss_sum, aux_sum


def _report_sum(value: torch.Tensor, mesh: Mesh, contributes: bool) -> float:
    """Sum a per-rank value over the ranks that own distinct parts of it."""
    return _report_sums([(value, contributes)], mesh)[0]


def _report_sums(values: list[tuple[torch.Tensor, bool]], mesh: Mesh) -> list[float]:
    """Several per-rank scalars (value, whether this rank contributes it), summed over the
    world in one collective: one wait for the slowest rank instead of one per value."""
    stacked = torch.stack([v if contributes else torch.zeros_like(v) for v, contributes in values])
    comm.all_reduce(stacked, mesh.world)
    return stacked.tolist()


@dataclass
class RoutedTokens:
    """One MoE layer's routing in this step, summed over the ranks that route distinct tokens."""

    moe: MoE
    per_expert: torch.Tensor  # (E,) float64: token-slots routed to each expert, whole global batch
    dropped: torch.Tensor  # () float64: token-slots over capacity, whole global batch
    local: torch.Tensor  # (E,) float64: this rank's own counts (zero on tp ranks but the first)


def routed_tokens(model: ParallelModel) -> dict[str, RoutedTokens]:
    """Read and reset every MoE layer's routing counters, summed over the whole step.

    dp x cp ranks route distinct tokens (expert parallel or not) and are summed; tp ranks
    route the same tokens, so only tp rank 0 contributes.
    """
    routed: dict[str, RoutedTokens] = {}
    mesh = model.mesh
    for chunk in model.chunks:
        for name, moe in chunk.moe_layers().items():
            counts = torch.cat([moe.tokens_per_expert, moe.dropped_slots.reshape(1)]).double()
            moe.tokens_per_expert.zero_()
            moe.dropped_slots.zero_()
            if mesh.tp.rank != 0:
                counts.zero_()
            local = counts[:-1].clone()
            comm.all_reduce(counts, mesh.dp_cp)
            comm.all_reduce(counts, mesh.tp)
            routed[f"layer{name}"] = RoutedTokens(moe, counts[:-1], counts[-1], local)
    return routed


def balance_routers(model: ParallelModel, routed: dict[str, RoutedTokens]) -> None:
    """The post-step hook of auxiliary-loss-free balancing (DeepSeek-V3): after the optimizer
    step, move each sigmoid router's expert bias towards the experts this step under-used.

    Training, not reporting: the next step routes with the new biases.
    """
    rate = model.config.model.bias_update_rate
    if not rate:
        return
    for layer in routed.values():
        if layer.moe.router.kind == "sigmoid":
            layer.moe.router.update_bias(layer.per_expert.float(), rate)


def moe_statistics(routed: dict[str, RoutedTokens], mesh: Mesh) -> dict[str, Any]:
    """Tokens per expert, imbalance (max / mean) and dropped fraction per MoE layer, this step;
    with expert parallelism also the tokens every ep rank sent to every other.

    Every layer's numbers reach the host in one read (one sync per step, not a few per layer)."""
    if not routed:
        return {}
    ep = mesh.ep.size
    parts = [torch.cat([layer.per_expert, layer.dropped.reshape(1)]) for layer in routed.values()]
    if ep > 1:
        parts += [_ep_token_matrix(layer.local, mesh).reshape(-1) for layer in routed.values()]
    host = _split_list(torch.cat(parts).tolist(), [p.numel() for p in parts])  # the one read
    stats: dict[str, Any] = {}
    for i, name in enumerate(routed):
        *per_expert, dropped = host[i]
        total = sum(per_expert)
        stats[name] = {
            "tokens_per_expert": [int(c) for c in per_expert],
            "imbalance": max(per_expert) / (total / len(per_expert)) if total else 0.0,
            "dropped_fraction": dropped / total if total else 0.0,
        }
        if ep > 1:
            matrix = host[len(routed) + i]
            stats[name]["all_to_all_tokens"] = [[int(v) for v in matrix[r * ep : (r + 1) * ep]] for r in range(ep)]
    return stats


def _split_list(values: list[float], sizes: list[int]) -> list[list[float]]:
    """`values` cut into consecutive pieces of `sizes`."""
    ends = list(itertools.accumulate(sizes))
    return [values[end - size : end] for size, end in zip(sizes, ends)]


def _ep_token_matrix(local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """(ep, ep) float64 on the device: token-slots ep rank i routed to the experts ep rank j
    holds, over all ep groups.

    `local` (E,) is this rank's routing count per global expert; ep rank j holds the j-th
    contiguous block of E / ep experts. Dropped slots are included (they were routed).
    """
    rows = comm.all_gather(local.reshape(1, -1), mesh.ep, dim=0)  # (ep, E)
    comm.all_reduce(rows, mesh.edp)
    comm.all_reduce(rows, mesh.tp)
    ep = mesh.ep.size
    return rows.reshape(ep, ep, -1).sum(-1)


def _wire_since(before: dict[tuple[str, str], int], mesh: Mesh) -> dict[str, int]:
    """Wire bytes per axis counted by comm.py since the snapshot `before`."""
    out: dict[str, int] = {}
    for (axis, op), nbytes in mesh.stats.wire.items():
        delta = nbytes - before.get((axis, op), 0)
        if delta:
            out[axis] = out.get(axis, 0) + delta
    return out


def train_step(model: ParallelModel, sampler: Sampler, step: int, *, measure_held: bool = False) -> StepResult:
    """One optimizer step on the global batch of `step`.

    `measure_held` fills `held_bytes` (a walk over every parameter, gradient and optimizer
    tensor, about a millisecond on the small preset): runs report it once, at their first step.
    """
    start = time.perf_counter()
    wire_before = dict(model.mesh.stats.wire)
    device = model.device
    clock = PhaseClock(device)
    batches = local_micro_batches(model, sampler, step)
    if model.runner is not None:
        loss_sum, aux_sum = model.runner.run(batches)
    else:
        loss_sum, aux_sum = forward_backward(model, batches, device)
    clock.lap("forward_backward")  # compute, tp/cp/ep/pp communication, pipeline bubble
    model.optimizer.finish_grad_sync()
    clock.lap("grad_sync")  # the data-parallel reduction not hidden behind the backward
    held: dict[str, int] = {}
    if measure_held:
        held = held_memory(model.chunks, model.optimizer).without_padding()
        clock.lap("statistics")
    grad_norm = model.optimizer.clip_grad_norm(model.config.train.grad_clip)
    clock.lap("grad_norm")
    lr = lr_at(step, model.config.train)
    model.optimizer.step(lr)
    clock.lap("optimizer")  # with ZeRO, also the parameter all-gather
    wire = _wire_since(wire_before, model.mesh)  # before the reporting collectives below
    model.optimizer.zero_grad()
    mesh, train = model.mesh, model.config.train
    owns_loss = model.is_last_stage and mesh.tp.rank == 0
    owns_aux = mesh.tp.rank == 0 and model.aux_owner
    loss_total, aux_total = _report_sums([(loss_sum, owns_loss), (aux_sum, owns_aux)], mesh)
    loss, aux = loss_total / (train.global_batch * train.seq_len), aux_total / train.global_batch
    routed = routed_tokens(model) if model.config.model.is_moe else {}
    balance_routers(model, routed)  # the post-step hook (training), before the next step routes
    moe = moe_statistics(routed, mesh)
    clock.lap("statistics")  # loss and MoE statistics reductions
    seconds = time.perf_counter() - start
    tokens = train.global_batch * train.seq_len
    return StepResult(step, loss, aux, grad_norm, lr, seconds, tokens, moe, wire, held, clock.laps)


@torch.no_grad()
def evaluate(model: ParallelModel, data: TokenData, batches: int) -> float:
    """Mean token loss on the validation split (the first `batches` global batches of it)."""
    train = model.config.train
    sampler = data.validation_sampler(train.seq_len, train.global_batch, train.seed + 1)
    device = model.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for step in range(batches):
        mbs = local_micro_batches(model, sampler, step)
        if model.runner is not None:
            total += model.runner.evaluate(mbs)
        else:
            for mb in mbs:
                with autocast_for(model.config, device):
                    logits, _ = model.chunks[0](mb.inputs, mb.positions, mb.documents)
                    total += model.loss_fn(logits, mb.targets).double()
    owns = model.is_last_stage and model.mesh.tp.rank == 0
    return _report_sum(total, model.mesh, owns) / (batches * train.global_batch * train.seq_len)


class MetricsLog:
    """Appends one JSON object per step to metrics.jsonl, and to TensorBoard when installed."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for tag, value in flatten_scalars(record).items():
                self.tb.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def step_record(result: StepResult, flops_per_token: float = 0.0, peak_flops: float = 0.0) -> dict[str, Any]:
    """The metrics.jsonl line of a step; "mfu" when the model FLOPs and the devices' peak are known.

    flops_per_token: fivefold.observe.metrics.model_flops_per_token; peak_flops: of all devices of the run.
    """
    record: dict[str, Any] = {
        "step": result.step,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "step_seconds": result.seconds,
        "tokens_per_s": result.tokens / result.seconds if result.seconds else 0.0,
    }
    if flops_per_token and peak_flops and result.seconds:
        record["mfu"] = mfu(record["tokens_per_s"], flops_per_token, peak_flops)
    if result.phases:
        record["phase_seconds"] = result.phases
    if result.moe:
        record["aux_loss"] = result.aux_loss
        record["moe"] = result.moe
    return record


def build(config: Config, mesh: Mesh, device: torch.device) -> ParallelModel:
    return parallelize(config, mesh, device)
