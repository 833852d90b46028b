"""Data parallel: bucketed gradient all-reduce overlapped with the backward pass.

Every data-parallel rank holds the whole (local) model and takes its rows of the global
batch. Gradients are summed over the data-parallel group (each rank's loss is already
divided by the tokens of the whole global batch, so the sum is the gradient of the global
mean loss). Parameters and gradients live in flat buckets (buckets.py), each all-reduced as
soon as backward has completed it; the update is the flat AdamW (flat_adamw.py) over whole
buckets. ZeRO (zero.py) shares both and shards them.

Gradients are summed in the precision policy's reduction dtype (a cast copy when it differs
from the parameters') and stored back in theirs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from . import comm
from .buckets import (
    MB,
    BucketReducer,
    FlatBucket,
    Pending,
    check_replicas_identical,
    flat_grads,
    flat_params,
    plan_buckets,
    trainable,
)
from .flat_adamw import FlatAdamW
from .mesh import Mesh
from .optim import AdamWSettings
from .protocols import GradFinalizer

from .._moved import moved_names

__getattr__ = moved_names(__name__, {
    **{name: "fivefold.parallel.buckets" for name in (
        "MB", "DATA_AXES", "Segment", "FlatBucket", "reduction_axis", "local_axis", "trainable", "group_by_axis",
        "make_bucket", "plan_buckets", "TAIL_FRACTION", "split_tail", "check_replicas_identical", "Pending",
        "BucketReducer", "flat_params", "flat_grads")},
    **{name: "fivefold.parallel.flat_adamw" for name in (
        "flat_adamw_", "scale_", "clip_coefficient", "FlatSynchroniser", "FlatAdamW", "holds_every_gradient",
        "squared_grad_sum", "flat_sharded_state", "load_flat_sharded_state")},
})


class BucketAllReduce:
    """Data-parallel gradient synchronisation: every parameter replicated over its data axis.

    Parameters and gradients live in one flat buffer per bucket (the parameters and their
    .grad are views), so a bucket is reduced with one collective. Gradients accumulate in
    place across micro-batches; inside `no_sync()` nothing is communicated, so accumulation
    then one reduction equals one large batch.
    """

    sharded = False
    shards_parameters = False

    def __init__(
        self, chunks: list[nn.Module], mesh: Mesh, settings: AdamWSettings, bucket_mb: float = 25.0
    ) -> None:
        self.settings = settings
        self.buckets = plan_buckets(trainable(chunks), mesh, int(bucket_mb * MB), pad_to_axis=False)
        check_replicas_identical(self.buckets)
        for bucket in self.buckets:
            bucket.flatten_params_()
        self.ranges = [(0, b.numel) for b in self.buckets]
        self._initial: list[torch.Tensor] = [flat_params(b) for b in self.buckets]  # fp32, before the cast
        for bucket in self.buckets:
            bucket.cast_params_(settings.param_dtype)
            bucket.attach_grad_views_()
        self.grad_finalizers: list[GradFinalizer] = []
        self.reducer = BucketReducer(self.buckets, self._launch)

    def take_initial_values(self) -> list[torch.Tensor]:
        initial, self._initial = self._initial, []
        return initial

    def _launch(self, bucket: FlatBucket) -> Pending:
        bucket.fill_missing_grads_()  # unused parameters: zeros, not last step's values
        grads = flat_grads(bucket)
        wire = grads.to(self.settings.reduce_dtype)  # the gradients themselves when the dtypes agree
        work = comm.all_reduce(wire, bucket.axis, async_op=True)
        if wire is grads:
            return Pending(work)

        def land() -> None:  # the sum, stored back in the gradients' dtype
            grads.copy_(wire)

        return Pending(work, land, keep=(wire,))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.reducer.no_sync()

    def finish(self) -> None:
        self.reducer.finish()
        for finalize in self.grad_finalizers:
            finalize()

    def reduced_grads(self) -> list[torch.Tensor | None]:
        return [b.grads for b in self.buckets]

    def publish(self, weights: list[torch.Tensor]) -> None:
        for bucket, weight in zip(self.buckets, weights):
            if weight is not bucket.params:
                flat_params(bucket).copy_(weight)

    def zero_grad(self) -> None:
        for bucket in self.buckets:  # the next backward's first gradients overwrite the buffer
            bucket.release_grads_()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        yield  # every rank holds its whole local parameters

    def wait_for_parameters(self) -> None:
        pass  # every rank updates its whole parameters in place: nothing in flight

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [flat_params(b) for b in self.buckets], "grads": [flat_grads(b) for b in self.buckets]}

    def padding_bytes(self) -> dict[str, int]:
        return {"params": 0, "grads": 0, "optimizer": 0}


class DataParallelAdamW(FlatAdamW):
    """AdamW with every parameter replicated over its data axis; gradients summed in buckets."""

    def __init__(
        self, chunks: list[nn.Module], mesh: Mesh, settings: AdamWSettings, bucket_mb: float = 25.0
    ) -> None:
        super().__init__(BucketAllReduce(chunks, mesh, settings, bucket_mb), mesh, settings)
