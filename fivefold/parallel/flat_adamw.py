"""The AdamW update over flat buckets, shared by data parallel and ZeRO.

`FlatAdamW` keeps fp32 master weights and Adam's moments for the elements of each bucket
(buckets.py) this rank owns: the whole bucket under data parallel, its shard under ZeRO. Its
gradient synchroniser (`FlatSynchroniser`: `BucketAllReduce` in data_parallel.py,
`ZeroGradientSync` in zero.py) delivers the summed gradients of those elements and publishes
the updated weights back into the parameters. Also here: the global gradient norm over flat
ranges (each element counted once, whatever its copies) and the checkpoint state of flat
ranges.

Precision (rules/precision.py, carried by AdamWSettings): the flat parameter and gradient
buffers are in the policy's parameter dtype; with bf16 parameters the optimizer updates an
fp32 master copy and writes the result back into the parameters.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from . import comm
from .buckets import FlatBucket, Segment
from .mesh import Mesh
from .optim import (
    AdamWSettings, SquaredNormShare, Synchronised, adamw_multi_update_, clip_coefficient, master_copy, reduced_norm,
    scale_,
)
from .protocols import GradientSynchroniser, ShardedState, ShardReader
from .sharding import Placement, ShardSpec, replica_count


@torch.no_grad()
def flat_adamw_(
    bucket: FlatBucket,
    lo: int,
    hi: int,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    step: int,
    lr: float,
    settings: AdamWSettings,
) -> None:
    """AdamW on the elements [lo, hi) of a bucket; param/grad/state are (hi - lo,) tensors.

    One multi-tensor kernel call per weight-decay rule, over the runs of consecutive
    parameters that share it (the kernel's result per element does not depend on the runs).
    """
    exp_avg, exp_avg_sq = state
    for decay in (True, False):
        runs = [(start - lo, end - lo) for start, end, d in _decay_runs(bucket, lo, hi) if d == decay]
        if runs:
            pieces = ([t[a:b] for a, b in runs] for t in (param, grad, exp_avg, exp_avg_sq))
            params, grads, exp_avgs, exp_avg_sqs = pieces
            adamw_multi_update_(params, grads, exp_avgs, exp_avg_sqs, step, lr, settings, decay)


def _decay_runs(bucket: FlatBucket, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    runs: list[tuple[int, int, bool]] = []
    for seg, start, end in bucket.runs(lo, hi):
        if runs and runs[-1][2] == seg.decays and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, seg.decays)
        else:
            runs.append((start, end, seg.decays))
    return runs


class FlatSynchroniser(GradientSynchroniser, Protocol):
    """A synchroniser over flat buckets, as the flat AdamW update (`FlatAdamW`) uses it.

    The update owns elements `ranges[i]` of bucket i (the whole bucket, or a ZeRO shard).
    """

    buckets: list[FlatBucket]
    ranges: list[tuple[int, int]]
    sharded: bool  # True when each rank's range is its own shard of the bucket's axis (ZeRO)
    shards_parameters: bool  # True when the parameters live as shards with the optimizer (ZeRO-3)

    def take_initial_values(self) -> list[torch.Tensor]:
        """Once, for the update's master weights: each range's values in fp32, taken before the
        parameters were cast (views of the parameters where those stay fp32)."""
        ...

    def reduced_grads(self) -> list[torch.Tensor | None]:
        """The summed gradient of each range after finish() (None: no gradient this step)."""
        ...

    def publish(self, weights: list[torch.Tensor]) -> None:
        """Make the parameters the updated weights of every range (cast to their dtype)."""
        ...


class FlatAdamW(Synchronised):
    """The AdamW update over flat buckets: fp32 master weights and Adam's moments for the
    elements of each bucket this rank owns (`sync.ranges`), clipping by the global norm.

    Shared by plain data parallel (each rank owns whole buckets) and ZeRO (each rank owns its
    shard); the synchroniser says which, delivers the summed gradients and publishes the
    updated weights back into the parameters.
    """

    sync: FlatSynchroniser

    def __init__(self, sync: FlatSynchroniser, mesh: Mesh, settings: AdamWSettings) -> None:
        self.sync, self.mesh, self.settings = sync, mesh, settings
        self.buckets, self.ranges = sync.buckets, sync.ranges
        self.masters = [master_copy(w, settings) for w in sync.take_initial_values()]
        self.state = [(torch.zeros_like(m), torch.zeros_like(m)) for m in self.masters]
        self.steps = 0
        self._holds_every_gradient = holds_every_gradient(sync, mesh)

    def clip_grad_norm(self, max_norm: float) -> float:
        grads = self.sync.reduced_grads()
        if self._holds_every_gradient:  # the norm is local: no collective, no wait for the other ranks
            share = squared_grad_sum(self.buckets, grads, self.ranges, self.mesh, sharded=False, divide=False)
            norm = reduced_norm(share, None)
        else:
            share = squared_grad_sum(self.buckets, grads, self.ranges, self.mesh, sharded=self.sync.sharded)
            norm = reduced_norm(share, self.mesh.world)
        coef = clip_coefficient(norm, max_norm)
        if coef < 1:
            scale_(grads, coef)
        return norm

    def step(self, lr: float) -> None:
        self.steps += 1
        for i, (bucket, grad) in enumerate(zip(self.buckets, self.sync.reduced_grads())):
            if grad is None:
                grad = torch.zeros_like(self.masters[i])
            lo, hi = self.ranges[i]
            flat_adamw_(bucket, lo, hi, self.masters[i], grad, self.state[i], self.steps, lr, self.settings)
        self.sync.publish(self.masters)

    def _separate_masters(self) -> list[torch.Tensor]:
        """The fp32 masters that are not also the parameters (bf16 parameters)."""
        return self.masters if self.settings.precision.has_master_weights else []

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank stores, by kind, for memory accounting (fivefold.observe.held_memory)."""
        optimizer = [t for pair in self.state for t in pair] + self._separate_masters()  # fp32 masters count here
        return {**self.sync.held_tensors(), "optimizer": optimizer}

    def padding_bytes(self) -> dict[str, int]:
        return self.sync.padding_bytes()

    # Checkpoint (fivefold/checkpoint/): with ZeRO-3, and with master weights, the optimizer
    # owns the parameters' shards; the fp32 masters are saved as the parameters.
    @property
    def owns_parameter_shards(self) -> bool:
        return self.sync.shards_parameters or self.settings.precision.has_master_weights

    def sharded_state(self) -> ShardedState:
        shards = self.masters if self.owns_parameter_shards else None
        return flat_sharded_state(self.buckets, self.state, self.ranges, self.sync.sharded, param_shards=shards)

    def load_sharded_state(self, reader: ShardReader) -> None:
        shards = self.masters if self.owns_parameter_shards else None
        load_flat_sharded_state(reader, self.buckets, self.state, self.ranges, self.sync.sharded, param_shards=shards)
        if self.owns_parameter_shards:
            self.sync.publish(self.masters)
            self.sync.wait_for_parameters()  # loading is rare: nothing to overlap, and the caller may read them


def holds_every_gradient(sync: FlatSynchroniser, mesh: Mesh) -> bool:
    """True when this rank's reduced gradients are the whole model's, replicated on every rank
    of the world (plain data parallel without tp, pp, ep or cp sharding): the global norm is
    then this rank's own, and each rank computes the same value with no collective."""
    if sync.sharded:
        return False
    world = mesh.world.size
    return all(replica_count(seg.placement, mesh) == world for b in sync.buckets for seg in b.segments)


def squared_grad_sum(
    buckets: list[FlatBucket],
    grads: list[torch.Tensor | None],
    ranges: list[tuple[int, int]],
    mesh: Mesh,
    sharded: bool,
    divide: bool = True,
) -> SquaredNormShare:
    """This rank's share of the squared gradient norm of the full model, each element counted once.

    `grads[i]` holds elements ranges[i] of bucket i. Replicated (not sharded) gradients are
    held by every rank of the bucket's axis and by the axes their placement names; a ZeRO
    shard is owned by one rank of the bucket's axis and may still be replicated over other
    axes (e.g. tp for a norm weight). Dividing by the number of copies makes one sum over
    the world count every element once. Runs of parameters with the same number of copies
    are views of the flat gradient, normed together by one fused fp32 kernel and added in
    float64 on the device (see SquaredNormShare). With `divide=False` each element counts
    once here (`holds_every_gradient`: the sum is the whole norm, not a share).
    """
    runs: list[torch.Tensor] = []
    copies: list[int] = []
    for bucket, grad, (lo, hi) in zip(buckets, grads, ranges):
        if grad is None:
            continue
        for start, end, count in _copy_runs(bucket, lo, hi, mesh, sharded):
            runs.append(grad[start - lo : end - lo])
            copies.append(count if divide else 1)
    return SquaredNormShare(runs, copies, mesh.world.device_type)


def _copy_runs(bucket: FlatBucket, lo: int, hi: int, mesh: Mesh, sharded: bool) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for seg, start, end in bucket.runs(lo, hi):
        copies = replica_count(seg.placement, mesh)
        if sharded and bucket.data_axis in seg.placement.replicated_over:
            copies //= bucket.axis.size  # a shard's copies: those on its replicas (hybrid sharding) only
        if runs and runs[-1][2] == copies and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, copies)
        else:
            runs.append((start, end, copies))
    return runs


def sharded_replication(over: tuple[str, ...], bucket: FlatBucket) -> tuple[str, ...]:
    """The axes that hold copies of a ZeRO shard of a parameter replicated over `over`: its
    bucket's data axis no longer (the shards split it), but the replicate axis of hybrid sharding."""
    if bucket.data_axis not in over:
        return over
    rest = tuple(a for a in over if a != bucket.data_axis)
    replicas = bucket.replicas
    return rest + ((replicas.name,) if replicas is not None and replicas.size > 1 else ())


def _flat_runs(
    buckets: list[FlatBucket], ranges: list[tuple[int, int]], sharded: bool
) -> Iterator[tuple[int, Segment, int, int, ShardSpec]]:
    """(bucket index, segment, [start, end) in this rank's range, ShardSpec) of every owned run."""
    for i, (bucket, (lo, hi)) in enumerate(zip(buckets, ranges)):
        for seg, start, end in bucket.runs(lo, hi):
            placement = seg.placement
            over = placement.replicated_over
            if sharded:  # a ZeRO shard is no longer replicated over the axis it is sharded on
                over = sharded_replication(over, bucket)
            spec = ShardSpec.from_placement(placement, flat=(start - seg.start, end - start), replicated_over=over)
            yield i, seg, start - lo, end - lo, spec


def flat_sharded_state(
    buckets: list[FlatBucket],
    states: list[tuple[torch.Tensor, torch.Tensor]],
    ranges: list[tuple[int, int]],
    sharded: bool,
    param_shards: list[torch.Tensor] | None = None,
) -> ShardedState:
    """The checkpoint protocol's `sharded_state` for flat buffers (see fivefold/checkpoint/).

    Each parameter's run inside this rank's range of its bucket is one flat piece of the
    parameter's (TP-local) box; `param_shards` adds the parameters themselves (ZeRO-3).
    """
    out: ShardedState = {}
    for i, seg, a, b, spec in _flat_runs(buckets, ranges, sharded):
        m, v = states[i]
        entry: dict[str, tuple[torch.Tensor, Placement | ShardSpec]]
        entry = {"exp_avg": (m[a:b], spec), "exp_avg_sq": (v[a:b], spec)}
        if param_shards is not None:
            entry["param"] = (param_shards[i][a:b], spec)
        out[seg.name] = entry
    return out


def load_flat_sharded_state(
    reader: ShardReader,
    buckets: list[FlatBucket],
    states: list[tuple[torch.Tensor, torch.Tensor]],
    ranges: list[tuple[int, int]],
    sharded: bool,
    param_shards: list[torch.Tensor] | None = None,
) -> None:
    """Fill this rank's flat pieces from a checkpoint of any layout (box intersection)."""
    for i, _seg, a, b, spec in _flat_runs(buckets, ranges, sharded):
        m, v = states[i]
        reader.read_into(m[a:b], spec, "exp_avg")
        reader.read_into(v[a:b], spec, "exp_avg_sq")
        if param_shards is not None:
            reader.read_into(param_shards[i][a:b], spec, "param")
