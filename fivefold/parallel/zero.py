"""ZeRO stages 1-3 (Rajbhandari et al. 2020) over the data-parallel group.

Every bucket (see buckets.py) is a flat buffer padded to a multiple of its axis size
n; data-parallel rank r owns the contiguous r-th 1/n of every bucket. It keeps the Adam
moments of those elements only, receives their gradient sum by reduce-scatter, updates
them, and (stages 1-2) all-gathers the updated parameters into the flat buffer. Those
all-gathers are left in flight after the step: the next forward waits for each bucket just
before it first reads it (UpdatedParameterGathers), and every other reader of parameters calls
`wait_for_parameters` first.

- Stage 1: full gradients live in each bucket's flat buffer (the .grad are views); the
  reduce-scatter lands in this rank's slice of it.
- Stage 2: gradients are produced by autograd per parameter; when a bucket is complete they
  are packed, reduce-scattered and dropped, and the result is added to this rank's sharded
  gradient buffer. This happens for every backward, micro-batches of an accumulated step
  included, so a rank never holds more than one backward's full gradients (but those of the
  parameters gradient finalizers read, see below).
- Stage 3: parameters are sharded too. Each transformer block, plus the rest of a chunk
  (embedding, final norm, head) as its "root" unit, is gathered before its forward and
  freed after it, gathered again when the gradient reaches its output, and freed once all
  its parameter gradients are in (which launches their reduce-scatter). The root and the
  last block stay gathered from their forward to their backward, which follows at once.
  The next unit's gather is prefetched while the current one computes. Freeing moves the
  flat storage's memory into a kept spare and leaves the storage empty, so tensors saved for
  backward that view it are refilled by the next gather (UnitGatherer).

Precision (fivefold.rules.precision): the flat parameter buffers, the gathered parameters and
the gradients are in the policy's parameter dtype. The update runs on fp32 master weights:
with fp32 parameters these are the parameters (stages 1-2: this rank's slice of the flat
buffer; stage 3: its shard), with bf16 parameters a separate fp32 copy of this rank's
shard, kept with Adam's moments (the ZeRO paper's 2 + 2 + 12 bytes per parameter, all
sharded at stage 3). Stage 3 keeps its shard in the parameters' dtype too, as the source of
its all-gathers. Gradients are reduce-scattered in the policy's reduction dtype.

Gradient accumulation: stage 1 accumulates whole gradients in its flat buffers inside
`no_sync()` and reduces once per step; stages 2-3 reduce-scatter after every backward (the
planner, like DeepSpeed, assumes the same), so their communication grows with the number
of micro-batches while their memory stays sharded.

Gradient finalizers (summing sequence-parallel norm weights, MoE routers and kv heads shared
by tp ranks over tp; the tied embedding over the pipeline ends) complete a parameter's local
gradient with partial gradients held on other ranks, so they need its full local .grad, once
per step. Each finalizer names its parameters (`ParamFinalizer`), and those parameters get
buckets of their own ("deferred", built the same way on every rank, `split_finalized`): they
keep their full .grad, accumulated over the micro-batches, until finish_grad_sync runs the
finalizers and then reduce-scatters them, once per step. Every other bucket is reduced during
each backward as without finalizers, so only the finalized parameters' gradients (norm
weights and routers: a few thousand elements per layer; a tied embedding) are held full. The
finalizers are linear sums over other axes and commute with the data-parallel sum; running
them before it keeps them independent of the shard layout, which differs between the two
pipeline stages holding a tied embedding. A finalizer added to `grad_finalizers` after
construction names no parameters: every bucket is then deferred (plain data parallel runs its
finalizers after its all-reduce, on the .grad views).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from .mesh import Mesh
from . import comm
from .buckets import (
    MB,
    BucketReducer,
    FlatBucket,
    Pending,
    bucket_axes,
    check_replicas_identical,
    flat_grads,
    flat_params,
    group_by_axis,
    make_bucket,
    plan_buckets,
    trainable,
)
from .flat_adamw import FlatAdamW
from .optim import AdamWSettings
from .protocols import GradFinalizer, ParamFinalizer
from ..rules.volumes import reduces_once_per_step, zero3_gathers_once_per_step, zero3_keeps_ends_gathered


class ZeroAdamW(FlatAdamW):
    """AdamW with optimizer state (stage 1), gradients (2) and parameters (3) sharded over dp x cp.

    The flat AdamW update over this rank's shard of every bucket, fed by the stage's
    `ZeroGradientSync`.
    """

    sync: ZeroGradientSync

    def __init__(
        self, chunks: list[nn.Module], mesh: Mesh, settings: AdamWSettings, stage: int, bucket_mb: float = 25.0,
        finalizers: Sequence[ParamFinalizer] = (),
    ) -> None:
        super().__init__(zero_sync(chunks, mesh, settings, stage, bucket_mb, finalizers), mesh, settings)


def zero_sync(
    chunks: list[nn.Module], mesh: Mesh, settings: AdamWSettings, stage: int, bucket_mb: float = 25.0,
    finalizers: Sequence[ParamFinalizer] = (),
) -> ZeroGradientSync:
    """The gradient synchroniser of ZeRO stage `stage`."""
    stages: dict[int, type[ZeroGradientSync]] = {1: ZeroStage1Sync, 2: ZeroStage2Sync, 3: ZeroStage3Sync}
    if stage not in stages:
        raise ValueError(f"ZeRO stage {stage} does not exist; use 1, 2 or 3 (0 is DataParallelAdamW)")
    return stages[stage](chunks, mesh, settings, bucket_mb, finalizers)


class ZeroGradientSync(ABC):
    """What every ZeRO stage shares: this rank owns a shard of every bucket, receives the
    gradient sum of that shard by reduce-scatter, and runs the gradient finalizers before the
    reduction of the buckets they read. Stages 1-2 keep whole parameters in the flat buffers
    and all-gather the updated shards after the step (`UpdatedParameterGathers`); stage 3
    overrides that.

    Expert parameters (Placement replicated over "edp") are sharded over the expert data
    parallel group instead; nothing here names a layer type, so modules swapped in by other
    strategies are handled like any other.
    """

    sharded = True
    shards_parameters = False
    stage = 0
    per_backward = False  # stages 2-3 reduce every backward, micro-batches included (but stage 3 in a pipeline)

    def __init__(
        self, chunks: list[nn.Module], mesh: Mesh, settings: AdamWSettings, bucket_mb: float = 25.0,
        finalizers: Sequence[ParamFinalizer] = (),
    ) -> None:
        self.settings = settings
        self.per_backward = not reduces_once_per_step(self.stage, mesh.pp.size)
        finalized = {id(p) for finalize in finalizers for p in finalize.params()}
        self.buckets = self._plan_buckets(chunks, mesh, int(bucket_mb * MB), finalized)
        check_replicas_identical(self.buckets)
        for bucket in self.buckets:
            bucket.flatten_params_()
        self.ranges = [b.shard_range() for b in self.buckets]
        self._initial = [self._initial_shard(b, lo, hi) for b, (lo, hi) in zip(self.buckets, self.ranges)]
        for bucket in self.buckets:
            bucket.cast_params_(settings.param_dtype)
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.grad_finalizers: list[GradFinalizer] = list(finalizers)
        self.declared_finalizers: list[GradFinalizer] = list(finalizers)  # their parameters are bucketed apart
        self._prepare(chunks)
        self.reducer = BucketReducer(self.buckets, self._launch, self._bucket_complete, self._deferred,
                                     per_backward=self.per_backward)

    # ------------------------------------------------------------------ what a stage decides

    def _plan_buckets(self, chunks: list[nn.Module], mesh: Mesh, bucket_bytes: int,
                      finalized: AbstractSet[int]) -> list[FlatBucket]:
        return plan_chunk_buckets(chunks, mesh, bucket_bytes, finalized)

    def _initial_shard(self, bucket: FlatBucket, lo: int, hi: int) -> torch.Tensor:
        """This rank's fp32 values, taken before the flat buffer is cast: with fp32 parameters
        stages 1-2 update a view of the flat buffer."""
        return flat_params(bucket)[lo:hi]

    def _prepare(self, chunks: list[nn.Module]) -> None:
        """After the buckets are built and cast, before the reducer hooks in."""
        self.gathers = UpdatedParameterGathers(chunks, self.buckets)

    @abstractmethod
    def _launch(self, bucket: FlatBucket) -> Pending:
        """Start the reduction of a bucket whose gradients are complete."""

    @abstractmethod
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The parameter and gradient storage this rank holds (observe/held_memory.py)."""

    def _bucket_complete(self, bucket: FlatBucket) -> None:
        """Every gradient of `bucket` has arrived in this backward (reduced or not)."""

    # ------------------------------------------------------------------ gradient reduction

    def take_initial_values(self) -> list[torch.Tensor]:
        initial, self._initial = self._initial, []
        return initial

    def _deferred(self, bucket: FlatBucket) -> bool:
        """Whether `bucket` is reduced once per step, after the finalizers: it holds parameters a
        finalizer reads, or a finalizer was added after construction (its parameters unknown)."""
        return bucket.extra.get("deferred", False) or any(
            all(f is not known for known in self.declared_finalizers) for f in self.grad_finalizers
        )

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.reducer.no_sync()

    def finish(self) -> None:
        # Finalizers (tp sums, tied embeddings) work on the full local .grad of their parameters,
        # which the deferred buckets still hold: they run first, then those buckets are reduced.
        for finalize in self.grad_finalizers:
            finalize()
        self.reducer.finish()
        self._sum_over_replicas()
        # The update next writes this rank's slice, which a gather no forward waited for may still be sending.
        self.wait_for_parameters()

    def _sum_over_replicas(self) -> None:
        """Hybrid sharding: each shard group has summed its own ranks' gradients into its shards;
        the copies of a shard in the other replicas add theirs, once per step, after the last
        micro-batch (all buckets in flight together)."""
        pending = []
        for bucket, shard in zip(self.buckets, self.grad_shards):
            if shard is None or bucket.replicas is None or bucket.replicas.size == 1:
                continue
            wire = shard.to(self.settings.reduce_dtype)  # the shard itself when the dtypes agree
            pending.append((comm.all_reduce(wire, bucket.replicas, async_op=True), wire, shard))
        for work, wire, shard in pending:
            work.wait()
            if wire is not shard:
                shard.copy_(wire)  # the sum, stored back in the gradients' dtype

    def reduced_grads(self) -> list[torch.Tensor | None]:
        return self.grad_shards

    # ------------------------------------------------------------------ parameters

    def publish(self, masters: list[torch.Tensor]) -> None:
        """Make the parameters the (cast) master weights: issue their all-gathers, which the next
        forward waits for (see UpdatedParameterGathers)."""
        self.gathers.wait_all()  # a bucket that no forward read since the last step
        for i in self.gathers.order:  # the buckets the next forward reads first are gathered first
            bucket, master, (lo, hi) = self.buckets[i], masters[i], self.ranges[i]
            flat = flat_params(bucket)
            own = flat[lo:hi]
            if master.data_ptr() != own.data_ptr():  # bf16 parameters: the fp32 master, cast into place
                own.copy_(master)
            # In place: every rank's slice of the flat storage is already where it belongs.
            self.gathers.issue(i, comm.all_gather_into(flat, own, bucket.axis, async_op=True))

    def wait_for_parameters(self) -> None:
        self.gathers.wait_all()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Inside, every parameter holds its full local value; e.g. for gather_full_state."""
        self.wait_for_parameters()
        yield

    def zero_grad(self) -> None:
        self.grad_shards = [None] * len(self.buckets)

    def padding_bytes(self) -> dict[str, int]:
        """Bytes of the held tensors that are padding, not parameters."""
        padding = self._padding_elements()
        precision = self.settings.precision
        return {"params": padding["params"] * precision.param_bytes, "grads": padding["grads"] * precision.grad_bytes,
                "optimizer": padding["shard"] * precision.optimizer_bytes()}  # Adam's moments (+ the fp32 master)

    def _padding_elements(self) -> dict[str, int]:
        """Padding elements: of the whole buckets, of this rank's shards, of the held gradients."""
        full = sum(b.padding for b in self.buckets)
        shard = sum(self._shard_padding())
        return {"params": full, "shard": shard, "grads": full}

    def _shard_padding(self) -> list[int]:
        return [max(0, hi - max(lo, b.used)) for b, (lo, hi) in zip(self.buckets, self.ranges)]


class ZeroStage1Sync(ZeroGradientSync):
    """Stage 1: full gradients live in each bucket's flat buffer (the .grad are views), are
    accumulated there over the micro-batches inside `no_sync()`, and are reduce-scattered once
    per step into this rank's slice of that buffer."""

    stage = 1

    def _prepare(self, chunks: list[nn.Module]) -> None:
        for bucket in self.buckets:
            bucket.attach_grad_views_()
        super()._prepare(chunks)

    def _launch(self, bucket: FlatBucket) -> Pending:
        i = bucket.index
        bucket.fill_missing_grads_()  # unused parameters: zeros, not last step's values
        wire = flat_grads(bucket).to(self.settings.reduce_dtype)  # the buffer itself when the dtypes agree
        lo, hi = self.ranges[i]
        # In place: the sum lands in this rank's slice of the buffer it was summed from; the next
        # backward overwrites every slice (see release_grads_), so the collective may overwrite them.
        work = comm.reduce_scatter_into(wire[lo:hi], wire, bucket.axis, async_op=True, overwrite_input=True)

        def land() -> None:
            own = flat_grads(bucket)[lo:hi]
            if wire is not bucket.grads:
                own.copy_(wire[lo:hi])  # the sum, stored back in the gradients' dtype
            self.grad_shards[i] = own

        return Pending(work, land, keep=(wire,))

    def finish(self) -> None:
        for bucket in self.buckets:  # finalizers write .grad in place: it must view the buffer
            if self._deferred(bucket):
                bucket.fill_missing_grads_()
        super().finish()

    def zero_grad(self) -> None:
        super().zero_grad()
        for bucket in self.buckets:
            bucket.release_grads_()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The parameter and gradient storage this rank holds (observe/held_memory.py)."""
        return {"params": [flat_params(b) for b in self.buckets], "grads": [flat_grads(b) for b in self.buckets]}


class ZeroStage2Sync(ZeroGradientSync):
    """Stage 2: gradients are produced by autograd per parameter; when a bucket is complete they
    are packed, reduce-scattered and dropped, and the result is added to this rank's kept
    gradient shard. This happens for every backward, micro-batches included, so a rank never
    holds more than one backward's full gradients (but those of the parameters gradient
    finalizers read, in deferred buckets)."""

    stage = 2

    def _prepare(self, chunks: list[nn.Module]) -> None:
        self._prepare_packing()
        super()._prepare(chunks)

    def _prepare_packing(self) -> None:
        # Where each bucket's reduced shard is kept (from its first reduction in a step to
        # zero_grad), and the packing/receive buffers their reductions reuse within a step.
        self.grad_store: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.scratch = ScratchBuffers()
        self.in_flight: list[Pending] = []
        self.packing: dict[int, tuple[torch.Tensor, set[int]]] = {}  # bucket index -> (buffer, segments packed)
        self._pack_on_arrival()  # registered before the reducer's hooks, which may launch the bucket

    def _pack_on_arrival(self) -> None:
        for bucket in self.buckets:
            for k in range(len(bucket.segments)):
                bucket.segments[k].param.register_post_accumulate_grad_hook(self._packer(bucket, k))

    def _packer(self, bucket: FlatBucket, k: int) -> Callable[[torch.Tensor], None]:
        """Copy each gradient into its bucket's packing buffer as soon as autograd has it and drop
        the .grad (as DeepSpeed's stage 2 does), so a bucket's worth of separate gradients never
        lives at once. Not in deferred buckets: finalizers need their full .grad until
        finish_grad_sync, and such a bucket is packed from .grad at launch then."""
        seg = bucket.segments[k]

        def hook(param: torch.Tensor) -> None:
            if self._deferred(bucket) or param.grad is None:
                return
            if bucket.index not in self.packing:
                self.packing[bucket.index] = (self.scratch.take(bucket.numel, bucket.dtype, bucket.device), set())
            packed, done = self.packing[bucket.index]
            target = packed[seg.start : seg.end]
            if k in done:  # a second accumulation in one backward: add, as .grad would have
                target.add_(param.grad.reshape(-1))
            else:
                target.copy_(param.grad.reshape(-1))
                done.add(k)
            param.grad = None

        return hook

    def _packed_grads(self, bucket: FlatBucket) -> torch.Tensor:
        """The bucket's gradients packed flat: what arrived by hook, the rest from .grad or zeros."""
        packed, done = self.packing.pop(bucket.index, (None, set()))
        if packed is None:
            return bucket.gather_grads(out=self.scratch.take(bucket.numel, bucket.dtype, bucket.device))
        packed[bucket.used :].zero_()
        for k, seg in enumerate(bucket.segments):
            if k in done:
                continue
            if seg.param.grad is not None:
                packed[seg.start : seg.end].copy_(seg.param.grad.reshape(-1))
            else:
                packed[seg.start : seg.end].zero_()
        return packed

    def _launch(self, bucket: FlatBucket) -> Pending:
        """Reduce-scatter the bucket's packed gradients (the .grad are dropped).

        The first backward of a step reduces straight into the kept shard; later ones (gradient
        accumulation) into a scratch shard that is then added. Packing and receive buffers come
        from `self.scratch` and go back once the reduction has landed; at most two reductions
        are in flight when a third launches, so the scratch holds two buckets' worth.
        """
        while len(self.in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:
            self.in_flight.pop(0).wait()  # long landed, as a rule: two buckets of backward ago
        i, reduce_dtype, shard_numel = bucket.index, self.settings.reduce_dtype, bucket.numel // bucket.axis.size
        packed = self._packed_grads(bucket)
        for seg in bucket.segments:
            seg.param.grad = None
        wire = packed
        if reduce_dtype != bucket.dtype:
            wire = self.scratch.take(bucket.numel, reduce_dtype, bucket.device).copy_(packed)
        first = self.grad_shards[i] is None
        store = self._kept_shard(i, shard_numel, bucket.device)
        dest = store if first and store.dtype == reduce_dtype else self.scratch.take(shard_numel, reduce_dtype, wire.device)
        # Two ranks on gloo exchange halves: the peer's copy of this shard lands in `received`.
        received = self.scratch.take(shard_numel, reduce_dtype, wire.device) if bucket.axis.size == 2 else None
        work = comm.reduce_scatter_into(dest, wire, bucket.axis, async_op=True, overwrite_input=True, scratch=received)
        lent = list({id(t): t for t in (packed, wire, dest, received) if t is not None and t is not store}.values())

        def land() -> None:
            if dest is not store and first:
                store.copy_(dest)  # the sum, stored in the parameters' dtype
            elif dest is not store:
                store.add_(dest)
            self.grad_shards[i] = store
            self.scratch.give(*lent)

        pending = Pending(work, _once(land))
        self.in_flight.append(pending)
        return pending

    def _kept_shard(self, i: int, numel: int, device: torch.device) -> torch.Tensor:
        store = self.grad_store[i]
        if store is None:
            store = self.grad_store[i] = torch.empty(numel, dtype=self.settings.param_dtype, device=device)
        return store

    def finish(self) -> None:
        super().finish()
        self.in_flight = []  # every reduction has landed (the reducer waited for all)

    def zero_grad(self) -> None:
        super().zero_grad()
        # The reduced shards and the scratch buffers are given up between steps, so that the
        # next forward (the activations' peak) runs without them.
        self.grad_store = [None] * len(self.buckets)
        self.scratch.free.clear()
        for bucket in self.buckets:
            for seg in bucket.segments:
                seg.param.grad = None

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The parameter and gradient storage this rank holds: the kept shards from their first
        reduction on (observe/held_memory.py)."""
        return {"params": [flat_params(b) for b in self.buckets], "grads": [g for g in self.grad_store if g is not None]}

    def _padding_elements(self) -> dict[str, int]:
        # Only the shards kept so far (a deferred bucket's is made at the end of the step).
        held = sum(n for n, g in zip(self._shard_padding(), self.grad_store) if g is not None)
        return {**super()._padding_elements(), "grads": held}


class ZeroStage3Sync(ZeroStage2Sync):
    """Stage 3: stage 2's gradients, and parameters sharded too. Each transformer block, plus
    the rest of a chunk (embedding, final norm, head) as its "root" unit, is gathered before
    its forward and freed after it, gathered again when the gradient reaches its output, and
    freed once all its parameter gradients are in (see `UnitGatherer`). This rank keeps its
    shard in the parameters' dtype, the source of the all-gathers."""

    stage = 3
    shards_parameters = True

    def _plan_buckets(self, chunks: list[nn.Module], mesh: Mesh, bucket_bytes: int,
                      finalized: AbstractSet[int]) -> list[FlatBucket]:
        self.units = build_units(chunks, mesh, finalized)
        self.keep_through_step = zero3_gathers_once_per_step(mesh.layout.zero3_gather)
        buckets = [b for unit in reversed(self.units) for b in unit.buckets]  # backward completes the last unit first
        for i, bucket in enumerate(buckets):
            bucket.index = i
        return buckets

    def _initial_shard(self, bucket: FlatBucket, lo: int, hi: int) -> torch.Tensor:
        return flat_params(bucket)[lo:hi].clone()  # apart: the flat buffer is freed between uses

    def _prepare(self, chunks: list[nn.Module]) -> None:
        self.param_shards = [m.to(self.settings.param_dtype) for m in self._initial]
        self._prepare_packing()
        self.unit_gatherer = UnitGatherer(self.units, self.param_shards, self.buckets, self.keep_through_step)
        self.unit_gatherer.free_all()

    def _bucket_complete(self, bucket: FlatBucket) -> None:
        self.unit_gatherer.bucket_complete(bucket)

    def _deferred(self, bucket: FlatBucket) -> bool:
        """In a pipeline every bucket is reduced once per step, after the last micro-batch
        (`reduces_once_per_step`): its .grad accumulate the micro-batches' gradients until then."""
        return not self.per_backward or super()._deferred(bucket)

    def finish(self) -> None:
        super().finish()
        self.unit_gatherer.free_all()

    def publish(self, masters: list[torch.Tensor]) -> None:
        """Refresh this rank's shards; the next forward gathers them around use."""
        for shard, master in zip(self.param_shards, masters):
            if shard is not master:
                shard.copy_(master)

    def wait_for_parameters(self) -> None:
        pass  # nothing is gathered after the step: units are gathered around their use

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        self.unit_gatherer.gather_all()
        try:
            yield
        finally:
            self.unit_gatherer.free_all()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        return {**held, "params": held["params"] + self.param_shards}

    def _padding_elements(self) -> dict[str, int]:
        padding = super()._padding_elements()
        return {**padding, "params": padding["shard"]}


class UpdatedParameterGathers:
    """Stages 1-2: the all-gathers of the updated parameters, left in flight after the step.

    Waiting for all of them at the end of the step would expose the whole gather; instead each
    bucket's is waited for just before the next forward first reads one of its parameters (a
    forward hook per read point, see `forward_read_points`), so the gathers of later buckets
    overlap the forward of earlier layers. `order` lists the buckets by their first read, the
    order in which they are gathered. Every other reader of parameters (checkpoints, full
    parameters, loading) calls `ZeroGradientSync.wait_for_parameters` first.
    """

    def __init__(self, chunks: list[nn.Module], buckets: list[FlatBucket]) -> None:
        self.works: dict[int, Any] = {}  # bucket index -> its all-gather in flight
        bucket_of = {id(seg.param): b.index for b in buckets for seg in b.segments}
        self.order: list[int] = []
        for module, when, params in (point for chunk in chunks for point in forward_read_points(chunk)):
            indices = list(dict.fromkeys(bucket_of[id(p)] for p in params if id(p) in bucket_of))
            if not indices:
                continue
            self.order += [i for i in indices if i not in self.order]
            if when == "before":
                module.register_forward_pre_hook(lambda _m, _args, i=indices: self.wait(i))
            else:
                module.register_forward_hook(lambda _m, _args, _out, i=indices: self.wait(i))
        self.order += [b.index for b in buckets if b.index not in self.order]

    def issue(self, index: int, work: Any) -> None:
        if work is not None:
            self.works[index] = work

    def wait(self, indices: list[int]) -> None:
        for i in indices:
            work = self.works.pop(i, None)
            if work is not None:
                work.wait()

    def wait_all(self) -> None:
        self.wait(list(self.works))


def forward_read_points(chunk: nn.Module) -> list[tuple[nn.Module, str, list[nn.Parameter]]]:
    """(module, "before" or "after" its forward, parameters first read there), in forward order.

    A chunk reads its embedding's parameters first, then each block reads its own, and the rest
    of the chunk's (final norm, head) are read after the last block. Blocks are the hook points
    because their forward stays eager under regional compilation (hooks inside a compiled
    region would break it); a chunk without blocks reads everything at its start.
    """
    layers = getattr(chunk, "layers", None)
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else []
    embed = getattr(chunk, "embed", None)
    first = list(embed.parameters()) if isinstance(embed, nn.Module) else []
    placed = {id(p) for p in first} | {id(p) for block in blocks for p in block.parameters()}
    rest = [p for p in chunk.parameters() if id(p) not in placed]
    points: list[tuple[nn.Module, str, list[nn.Parameter]]] = [(chunk, "before", first)]
    points += [(block, "before", list(block.parameters())) for block in blocks]
    points.append((blocks[-1], "after", rest) if blocks else (chunk, "before", rest))
    return points


MAX_REDUCTIONS_IN_FLIGHT = 2  # stages 2-3: a launch first waits for the oldest beyond this


class ScratchBuffers:
    """Flat buffers that the reductions of stages 2-3 borrow and give back, across the buckets of a step.

    Each reduction packs a bucket's gradients and receives the peer's copy of its shard. Fresh
    buffers for every bucket cost fresh pages (a page fault and a zeroed page each, thousands
    per step); these are reused instead, and given up at zero_grad. `take` lends the smallest free buffer that
    fits (a view of its first `numel` elements), or allocates one, dropping a free buffer that
    is too small for the request so the pool does not grow beyond what is lent at once.
    """

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.lent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a lent view -> (view, its buffer)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kind = [j for j, b in enumerate(self.free) if b.dtype == dtype and b.device == device]
        fits = [j for j in kind if self.free[j].numel() >= numel]
        if fits:
            buffer = self.free.pop(min(fits, key=lambda j: self.free[j].numel()))
        else:
            if kind:  # too small for this request: let it go rather than keep both
                self.free.pop(max(kind, key=lambda j: self.free[j].numel()))
            buffer = torch.empty(numel, dtype=dtype, device=device)
        view = buffer[:numel]
        self.lent[id(view)] = (view, buffer)  # by identity: meta tensors (dry runs) all share data_ptr 0
        return view

    def give(self, *views: torch.Tensor) -> None:
        for view in views:
            self.free.append(self.lent.pop(id(view))[1])


def _once(step: Callable[[], None]) -> Callable[[], None]:
    """`step`, run on the first call only (a reduction may be waited for early, then again by the reducer)."""
    done = [False]

    def run() -> None:
        if not done[0]:
            done[0] = True
            step()

    return run


def plan_chunk_buckets(
    chunks: list[nn.Module], mesh: Mesh, bucket_bytes: int, finalized: AbstractSet[int] = frozenset()
) -> list[FlatBucket]:
    """Padded buckets that never span model chunks (their "group" is the chunk's index).

    Under an interleaved pipeline one backward covers one chunk; stages 2-3 reduce what a
    backward touched, so each of its buckets must be complete by then. The parameters a
    gradient finalizer reads (ids in `finalized`) get deferred buckets of their own, after the
    chunk's others (see `split_finalized`).
    """
    buckets: list[FlatBucket] = []
    seen: set[int] = set()
    for c, chunk in enumerate(chunks):
        named = [(n, p) for n, p in trainable([chunk]) if id(p) not in seen]
        seen.update(id(p) for _, p in named)
        for members, deferred in split_finalized(named, finalized):
            for bucket in plan_buckets(members, mesh, bucket_bytes, pad_to_axis=True):
                bucket.extra.update(group=c, deferred=deferred)
                buckets.append(bucket)
    for i, bucket in enumerate(buckets):
        bucket.index = i
    return buckets


def split_finalized(
    named: list[tuple[str, nn.Parameter]], finalized: AbstractSet[int]
) -> list[tuple[list[tuple[str, nn.Parameter]], bool]]:
    """[(parameters, deferred)]: those no finalizer reads, then those one does (each part if any).

    Built the same way on every rank, so the buckets match over every data axis. A finalizer
    needs its parameters' full local gradients at the end of the step; only their buckets wait
    for it (deferred), every other bucket is reduced, and its full gradients dropped, during
    each backward.
    """
    parts = ([(n, p) for n, p in named if id(p) not in finalized], False), (
        [(n, p) for n, p in named if id(p) in finalized], True)
    return [(members, deferred) for members, deferred in parts if members]


# ----------------------------------------------------------------------------- stage 3


@dataclass
class GatherUnit:
    """Parameters gathered and freed together: one block, or a chunk's remaining parameters."""

    name: str
    module: nn.Module
    buckets: list[FlatBucket]
    next_forward: "GatherUnit | None" = None  # the unit whose forward follows, within the chunk
    next_backward: "GatherUnit | None" = None  # the unit to gather ahead when this one's backward begins
    kept_for_backward: bool = False  # stays gathered from its forward to its backward (see build_units)
    extra: dict = field(default_factory=dict)


def build_units(chunks: list[nn.Module], mesh: Mesh, finalized: AbstractSet[int] = frozenset()) -> list[GatherUnit]:
    """Units in forward order: per chunk its root (embedding, norm, head), then each block.

    A chunk without `layers` is one unit. Each unit has one padded bucket per data axis, and
    one more per axis for the parameters gradient finalizers read (`split_finalized`).
    In a pipeline nothing is kept (`zero3_keeps_ends_gathered`): other micro-batches' forwards
    run between a unit's forward and its backward.
    The root and the last block are kept gathered from their forward to their backward (as
    FSDP2 keeps its root): the root's forward ends the chunk's forward and its backward starts
    the chunk's backward, right after the last block's forward, so freeing either and gathering
    it again at once would be pure cost (the root is full through the whole forward and, with
    the embedding's gradient last, the whole backward anyway). The root's backward therefore
    gathers ahead the block before the last.
    """
    units: list[GatherUnit] = []
    keep = zero3_keeps_ends_gathered(mesh.pp.size)
    for c, chunk in enumerate(chunks):
        layers = getattr(chunk, "layers", None)
        blocks = dict(layers.items()) if isinstance(layers, nn.ModuleDict) else {}
        in_blocks = {id(p) for block in blocks.values() for p in block.parameters()}
        root = [(n, p) for n, p in trainable([chunk]) if id(p) not in in_blocks]
        members = [(f"chunk{c}.root", chunk, root)] if root else []
        for key, block in blocks.items():
            members.append((f"chunk{c}.layers.{key}", block, [(f"layers.{key}.{n}", p) for n, p in trainable([block])]))
        chunk_units = [GatherUnit(name, module, _unit_buckets(named, mesh, c, finalized))
                       for name, module, named in members if named]
        for a, b in zip(chunk_units, chunk_units[1:]):
            a.next_forward, b.next_backward = b, a
        if chunk_units and keep:
            chunk_units[-1].kept_for_backward = True
        if root and chunk_units and keep:
            chunk_units[0].kept_for_backward = True
            # the head's backward comes first, then the last block's (kept): gather the one before it
            chunk_units[0].next_backward = chunk_units[-2] if len(chunk_units) > 2 else None
        elif root and len(chunk_units) > 1:
            # Nothing kept: the root is gathered as the chunk's backward starts (its output is the
            # chunk's) and stays until its last gradient; the first block must not gather it ahead.
            chunk_units[0].next_backward = chunk_units[-1]  # the head's backward, then the last block's
            chunk_units[1].next_backward = None
        units += chunk_units
    return units


def _unit_buckets(
    named: list[tuple[str, nn.Parameter]], mesh: Mesh, chunk: int, finalized: AbstractSet[int]
) -> list[FlatBucket]:
    buckets = []
    for part, deferred in split_finalized(named, finalized):
        for (axis_name, _, _), members in group_by_axis(part, mesh).items():
            axis, replicas = bucket_axes(mesh, axis_name, sharded=True)
            buckets.append(make_bucket(members, axis, axis.size, axis_name, replicas))
            buckets[-1].extra.update(group=chunk, deferred=deferred)
    return buckets


KEPT_SPARES = 2  # freed unit buffers kept for reuse: the planner's ZeRO-3 buffers (current and prefetched layer)


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward first gathers the unit's parameters."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class UnitGatherer:
    """Gathers and frees stage-3 units around their forward and backward, with prefetch.

    A bucket is "free" (flat storage of size 0), "gathering" (an all-gather in flight) or
    "full". Hooks: before a unit's forward, issue the next unit's gather and then wait for
    this one (so the next is queued before this unit computes); after it, free it (unless it
    is kept for its backward) and hang `_GatherBeforeBackward` on its outputs; that backward makes the unit full again the same
    way, with the unit whose backward follows issued ahead. All-gathers write straight into
    the flat storage the parameters view. The reducer reports each bucket whose gradients have
    all arrived; a unit is freed once all its buckets are.

    Freeing moves the storage's memory into a spare (the storage object stays, with size 0,
    so every view and saved tensor keeps it), and a gather moves a spare of the right size
    back in. Up to `KEPT_SPARES` freed buffers are kept for the next gathers: giving them
    back to the allocator and asking again costs fresh pages every gather (page faults and
    zeroing, and heap trimming that makes the compute's own allocations fault too).

    With `keep_through_step` (layout.zero3_gather="step") a unit gathered for a training
    forward stays full until `free_all` at the end of the step: the step's later micro-batches
    find it gathered (forwards without a backward, e.g. evaluation, still free it).
    """

    def __init__(self, units: list[GatherUnit], shards: list[torch.Tensor], buckets: list[FlatBucket],
                 keep_through_step: bool = False) -> None:
        self.units = units
        self.keep_through_step = keep_through_step
        self.shard_of = {id(b): s for b, s in zip(buckets, shards)}
        self.status = {id(b): "full" for b in buckets}
        self.works: dict[int, Any] = {}
        self.spares: list[torch.UntypedStorage] = []  # freed units' memory, oldest first
        self.unit_of = {id(b): unit for unit in units for b in unit.buckets}
        self.completed: dict[int, set[int]] = {}  # id of a unit -> ids of its buckets whose gradients are all in
        for unit in units:
            unit.module.register_forward_pre_hook(self._pre_forward(unit))
            unit.module.register_forward_hook(self._post_forward(unit))

    def gather_async(self, unit: GatherUnit | None) -> None:
        if unit is None:
            return
        for b in unit.buckets:
            if self.status[id(b)] == "free":
                flat = flat_params(b)
                _swap_memory(flat.untyped_storage(), self._spare(b.numel * flat.element_size(), flat.device))
                self.works[id(b)] = comm.all_gather_into(flat, self.shard_of[id(b)], b.axis, async_op=True)
                self.status[id(b)] = "gathering"

    def ensure_full(self, unit: GatherUnit, then: GatherUnit | None = None) -> None:
        """Make `unit` full; `then` (the unit needed next) is issued before waiting, so its
        gather queues right behind this one's instead of after the computation that follows."""
        self.gather_async(unit)
        self.gather_async(then)
        for b in unit.buckets:
            self._wait(b)

    def _wait(self, b: FlatBucket) -> None:
        work = self.works.pop(id(b), None)
        if work is not None:
            work.wait()
        if self.status[id(b)] == "gathering":
            self.status[id(b)] = "full"

    def free_bucket(self, b: FlatBucket) -> None:
        self._wait(b)
        flat = flat_params(b)
        if flat.untyped_storage().nbytes():
            spare = torch.UntypedStorage(0, device=flat.device)
            _swap_memory(flat.untyped_storage(), spare)  # the memory moves into `spare`; the storage is empty
            self.spares.append(spare)
            del self.spares[:-KEPT_SPARES]
        self.status[id(b)] = "free"

    def _spare(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """A kept spare of exactly `nbytes` (the most recently freed), or new memory."""
        for j in reversed(range(len(self.spares))):
            if self.spares[j].nbytes() == nbytes and self.spares[j].device == device:
                return self.spares.pop(j)
        return torch.UntypedStorage(nbytes, device=device)

    def bucket_complete(self, b: FlatBucket) -> None:
        """All of `b`'s gradients are in: free its unit once every bucket of the unit is complete.

        A unit's buckets are freed together: the root's backward spans the chunk's (head first,
        embedding last), and freeing the bucket of its finalized parameters (the final norm) at
        their early gradient would make the prefetch before the embedding's backward gather it again.
        """
        if self.keep_through_step:
            return  # freed by `free_all` once the step's last backward is done
        unit = self.unit_of[id(b)]
        done = self.completed.setdefault(id(unit), set())
        done.add(id(b))
        if len(done) == len(unit.buckets):
            del self.completed[id(unit)]
            self.free_unit(unit)

    def free_unit(self, unit: GatherUnit) -> None:
        for b in unit.buckets:
            self.free_bucket(b)

    def free_all(self) -> None:
        self.completed.clear()
        for unit in self.units:
            self.free_unit(unit)

    def gather_all(self) -> None:
        for unit in self.units:
            self.gather_async(unit)
        for unit in self.units:
            self.ensure_full(unit)

    def _pre_forward(self, unit: GatherUnit) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.ensure_full(unit, then=unit.next_forward)

        return hook

    def _post_forward(self, unit: GatherUnit) -> Callable:
        def before_backward() -> None:
            self.ensure_full(unit, then=unit.next_backward)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            backward_follows = torch.is_grad_enabled() and _requires_grad(output)
            kept = unit.kept_for_backward or self.keep_through_step
            if not (kept and backward_follows):
                self.free_unit(unit)
            if backward_follows:
                return _wrap_outputs(output, before_backward)
            return output

        return hook


def _swap_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (pointer and size) of two storage objects; every tensor keeps its own
    storage object, so views of `a` see `b`'s former memory. A private torch method (no type stub)."""
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]


def _requires_grad(output: Any) -> bool:
    items = output if isinstance(output, (tuple, list)) else [output]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in items)


def _wrap_outputs(output: Any, callback: Callable[[], None]) -> Any:
    """Route every grad-requiring tensor of a (tuple) output through one gather-before-backward node."""
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    where = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return output
    wrapped = _GatherBeforeBackward.apply(callback, *[items[i] for i in where])
    for i, t in zip(where, wrapped):
        items[i] = t
    if isinstance(output, (tuple, list)):
        return type(output)(items)
    return items[0]
