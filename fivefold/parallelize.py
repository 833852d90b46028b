"""The one place that knows the order in which strategies are applied.

TP/SP -> EP -> CP -> activation recomputation -> PP split -> DP/ZeRO per stage.

The model is built on the meta device (the pipeline split decides which layers this rank
builds), every strategy swaps modules or installs hooks from outside, then the weights are
materialised: each rank computes its slice of the deterministic initial values, so every
layout starts from the single-process model's weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from .config import Config
from .mesh import Mesh
from .model import Transformer
from .parallel.optim import AdamWSettings, ReplicatedAdamW, TrainingOptimizer
from .parallel.sharding import materialize
from .step import MicroBatch, cross_entropy_sum, whole_sequence


@dataclass
class ParallelModel:
    """Everything one rank needs to train its part of the model under a layout."""

    config: Config
    mesh: Mesh
    chunks: list[Transformer]  # model chunks on this rank (several with interleaved pipelines)
    optimizer: TrainingOptimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    shard_sequence: Callable[[torch.Tensor, torch.Tensor], MicroBatch] = whole_sequence
    runner: object | None = None  # a pipeline runner when pp > 1
    extras: dict = field(default_factory=dict)

    @property
    def is_last_stage(self) -> bool:
        return self.mesh.pp.rank == self.mesh.pp.size - 1

    @property
    def is_first_stage(self) -> bool:
        return self.mesh.pp.rank == 0

    def modules(self) -> list[nn.Module]:
        return list(self.chunks)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model as full tensors, on every rank (small models)."""
        from .parallel.sharding import full_shapes, gather_full_state

        gathered = getattr(self.optimizer, "gathered", contextlib.nullcontext)  # ZeRO-3 shards parameters
        with gathered():
            return gather_full_state(self.chunks, self.mesh, full_shapes(self.config.model))


def build_chunks(config: Config, mesh: Mesh) -> list[Transformer]:
    """The (meta-device) model chunks this rank holds: the whole model without pipelining."""
    if config.layout.pp == 1:
        with torch.device("meta"):
            return [Transformer(config.model)]
    from .parallel.pipeline import build_stage_chunks

    return build_stage_chunks(config, mesh)


def apply_recompute(model: Transformer, mode: str) -> None:
    for block in model.layers.values():
        block.recompute_full = mode == "full"
        block.attn.recompute_core = mode == "selective"


def parallelize(config: Config, mesh: Mesh, device: torch.device | str = "cpu") -> ParallelModel:
    """Apply the layout of `config` to a fresh model for this rank, in DESIGN.md's order."""
    layout = config.layout
    chunks = build_chunks(config, mesh)
    finalizers: list[Callable[[], None]] = []
    loss_fn: Callable = cross_entropy_sum
    shard_sequence: Callable = whole_sequence
    for chunk in chunks:
        if layout.tp > 1:
            from .parallel.tensor_parallel import apply_tensor_parallel

            finalizers += apply_tensor_parallel(chunk, mesh, config)
        if layout.ep > 1:
            from .parallel.expert_parallel import apply_expert_parallel

            finalizers += apply_expert_parallel(chunk, mesh, config)
        if layout.cp > 1:
            from .parallel.context_parallel import apply_context_parallel

            finalizers += apply_context_parallel(chunk, mesh, config)
        apply_recompute(chunk, layout.recompute)
        if config.train.compile:
            from .regional_compile import compile_blocks

            compile_blocks(chunk)
        materialize(chunk, config.model, config.train.seed, device)
    if layout.tp > 1:
        from .parallel.tensor_parallel import vocab_parallel_loss

        loss_fn = vocab_parallel_loss(mesh, config)
    if layout.cp > 1:
        from .parallel.context_parallel import sequence_sharder

        shard_sequence = sequence_sharder(mesh, config)
    optimizer = build_optimizer(chunks, mesh, config)
    for finalize in finalizers:
        optimizer.grad_finalizers.append(finalize)
    model = ParallelModel(config, mesh, chunks, optimizer, loss_fn, shard_sequence)
    if layout.cp > 1:  # every cp rank holds the same per-sequence auxiliary loss: one reports it
        model.extras["aux_owner"] = mesh.cp.rank == 0
    if layout.pp > 1:
        from .parallel.pipeline import PipelineRunner

        model.runner = PipelineRunner(model)
    return model


def build_optimizer(chunks: list[Transformer], mesh: Mesh, config: Config) -> TrainingOptimizer:
    """Data parallel (and ZeRO) over dp x cp, or the plain optimizer when there is one replica."""
    settings = AdamWSettings.from_train(config.train)
    if mesh.dp_cp.size == 1 and mesh.edp.size == 1:
        return ReplicatedAdamW(list(chunks), mesh, settings)
    if config.layout.zero == 0:
        from .parallel.data_parallel import DataParallelAdamW

        return DataParallelAdamW(list(chunks), mesh, settings, bucket_mb=config.layout.bucket_mb)
    from .parallel.zero import ZeroAdamW

    return ZeroAdamW(list(chunks), mesh, settings, stage=config.layout.zero, bucket_mb=config.layout.bucket_mb)
