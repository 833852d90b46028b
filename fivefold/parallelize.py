"""The one place that knows the order in which strategies are applied.

PP split -> per chunk: TP/SP -> EP -> CP -> activation recomputation -> (compilation) ->
materialisation; then DP/ZeRO over all of the rank's chunks, the gradient finalizers, the
pipeline runner.

The pipeline split comes first: it decides which layers this rank builds, on the meta
device. Every strategy then swaps modules or installs hooks from outside and returns the
gradient finalizers it needs; then the weights are materialised: each rank computes its
slice of the deterministic initial values, so every layout starts from the single-process
model's weights. The optimizer (data parallel or ZeRO over dp x cp) is built over the
materialised chunks, and every finalizer (the strategies', the pipeline's tied embedding) is
registered with it here, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn as nn

from .config import Config
from .parallel.mesh import Mesh
from .model import Transformer
from .model.llama import Block
from .parallel.optim import AdamWSettings, ReplicatedAdamW
from .parallel.protocols import ParamFinalizer, TrainingOptimizer
from .parallel.sharding import materialize
from .model.step import MicroBatch, cross_entropy_sum, whole_sequence
from .rules.placement import placement_of, rank_of_stage

if TYPE_CHECKING:
    from .parallel.pipeline import PipelineRunner


@dataclass
class ParallelModel:
    """Everything one rank needs to train its part of the model under a layout."""

    config: Config
    mesh: Mesh
    chunks: list[Transformer]  # model chunks on this rank (several with interleaved pipelines)
    optimizer: TrainingOptimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    shard_sequence: Callable[[torch.Tensor, torch.Tensor], MicroBatch] = whole_sequence
    device: torch.device = torch.device("cpu")  # where this rank's tensors live
    aux_owner: bool = True  # whether this rank reports its MoE auxiliary loss (one of the cp ranks holding it)
    runner: PipelineRunner | None = None  # runs the pipeline schedule when pp > 1
    data_position: Callable[[int], dict[str, Any]] | None = None  # where the data stands at a step (run.py)

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last virtual stage (the head and the loss): the last
        pipeline rank, or rank 0 under DualPipeV's V placement."""
        layout = self.config.layout
        last = layout.pp * layout.vpp - 1
        return rank_of_stage(last, layout.pp, placement_of(layout.pp_schedule)) == self.mesh.pp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.mesh.pp.rank == 0

    def modules(self) -> list[nn.Module]:
        return list(self.chunks)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model as full host tensors, on every rank (small models:
        parity checks; a run's final weights are written without gathering, checkpoint/final.py)."""
        from .parallel.sharding import full_shapes, gather_full_state

        with self.optimizer.gathered():  # ZeRO-3 shards parameters
            full = gather_full_state(list(self.chunks), self.mesh, full_shapes(self.config.model))
        return {name: tensor.cpu() for name, tensor in full.items()}


def build_chunks(config: Config, mesh: Mesh) -> list[Transformer]:
    """The (meta-device) model chunks this rank holds: the whole model without pipelining."""
    if config.layout.pp == 1:
        with torch.device("meta"):
            return [Transformer(config.model)]
    from .parallel.pipeline import build_stage_chunks

    return build_stage_chunks(config, mesh)


def apply_recompute(model: Transformer, mode: str) -> None:
    for block in model.layers.values():
        assert isinstance(block, Block)  # every layer is; the check tells the type checker
        block.recompute_full = mode == "full"
        block.attn.recompute_core = mode == "selective"


def parallelize(config: Config, mesh: Mesh, device: torch.device | str = "cpu") -> ParallelModel:
    """Apply the layout of `config` to a fresh model for this rank, in the order of this module's docstring."""
    layout = config.layout
    device = torch.device(device)
    chunks = build_chunks(config, mesh)
    finalizers: list[ParamFinalizer] = []
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
            from .parallel.compile import compile_blocks

            compile_blocks(chunk)
        materialize(chunk, config.model, config.train.seed, device)
    if layout.tp > 1:
        from .parallel.tensor_parallel import vocab_parallel_loss

        loss_fn = vocab_parallel_loss(mesh, config)
    if config.train.compile:
        from .parallel.compile import compile_model_end

        loss_fn = compile_model_end(chunks, loss_fn)
    if layout.cp > 1:
        from .parallel.context_parallel import sequence_sharder

        shard_sequence = sequence_sharder(mesh, config)
    if layout.pp > 1:
        from .parallel.pipeline import tied_gradient_finalizer

        tied = tied_gradient_finalizer(chunks, mesh, config.model)  # None unless the ends share the embedding
        finalizers += [tied] if tied is not None else []
    optimizer = build_optimizer(chunks, mesh, config, finalizers)
    # Every cp rank holds the same per-sequence auxiliary loss: one of them reports it.
    aux_owner = layout.cp == 1 or mesh.cp.rank == 0
    model = ParallelModel(config, mesh, chunks, optimizer, loss_fn, shard_sequence, device, aux_owner)
    if layout.pp > 1:
        from .parallel.pipeline import PipelineRunner

        model.runner = PipelineRunner(config, mesh, chunks, optimizer, model.loss_fn, device)
    return model


def build_optimizer(chunks: list[Transformer], mesh: Mesh, config: Config,
                    finalizers: Sequence[ParamFinalizer] = ()) -> TrainingOptimizer:
    """Data parallel (and ZeRO) over dp x cp, or the plain optimizer when there is one replica,
    with every strategy's gradient finalizers registered (ZeRO buckets their parameters apart)."""
    settings = AdamWSettings.from_train(config.train)
    optimizer: TrainingOptimizer
    if mesh.dp_cp.size == 1 and mesh.edp.size == 1:
        optimizer = ReplicatedAdamW(list(chunks), mesh, settings)
    elif config.layout.zero == 0:
        from .parallel.data_parallel import DataParallelAdamW

        optimizer = DataParallelAdamW(list(chunks), mesh, settings, bucket_mb=config.layout.bucket_mb)
    else:
        from .parallel.zero import ZeroAdamW

        return ZeroAdamW(list(chunks), mesh, settings, stage=config.layout.zero, bucket_mb=config.layout.bucket_mb,
                         finalizers=finalizers)
    optimizer.grad_finalizers.extend(finalizers)
    return optimizer
