"""What the loop, the composition point and the tools may ask of an optimizer, written down.

An optimizer here is two parts:

- a gradient synchroniser (`GradientSynchroniser`): it makes each rank's gradients the sums
  over the data axes (bucketed all-reduce, or ZeRO's reduce-scatter), runs the gradient
  finalizers the strategies registered, and knows where the parameters live (ZeRO-3 gathers
  them around their use);
- the AdamW update (`TrainingOptimizer` without the synchroniser): master weights, Adam's
  moments, clipping by the global norm, the update arithmetic and its checkpoint state.

`TrainingOptimizer` is the whole interface callers use: every method a caller may call is
declared here, and every implementation (`optim.ReplicatedAdamW`, `data_parallel.DataParallelAdamW`,
`zero.ZeroAdamW`) satisfies it, checked by mypy in tests/test_types.py. Nothing probes an
optimizer with getattr or hasattr.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from .sharding import Placement, ShardSpec

class HoldsTensors(Protocol):
    """What memory accounting asks of an optimizer (every TrainingOptimizer is one)."""

    def held_tensors(self) -> dict[str, list[torch.Tensor]]: ...

    def padding_bytes(self) -> dict[str, int]: ...


GradFinalizer = Callable[[], None]  # completes local gradients (sums over tp, tied embeddings over pp)


@dataclass(frozen=True)
class ParamFinalizer:
    """A gradient finalizer that names the parameters whose .grad it reads and writes.

    ZeRO-2/3 keep only those gradients full until the finalizer has run (in buckets of their
    own); every other gradient is reduce-scattered, and dropped, during the backward. The
    parameters are looked up when asked (`params()`), not held: materialisation replaces the
    meta parameters after the strategies have named them.
    """

    run: Callable[[], None]
    params: Callable[[], Sequence[torch.Tensor]]  # the parameters

    def __call__(self) -> None:
        self.run()


# {parameter name: {state key ("exp_avg", "exp_avg_sq", "param"): (this rank's tensor, where it sits)}}
ShardedState = dict[str, dict[str, tuple[torch.Tensor, Placement | ShardSpec]]]


class ShardReader(Protocol):
    """What loading optimizer state needs from a checkpoint (fivefold.checkpoint.CheckpointReader)."""

    def read_into(self, tensor: torch.Tensor, target: ShardSpec | Placement, state: str = "param") -> None: ...


class GradientSynchroniser(HoldsTensors, Protocol):
    """Sums gradients over the data axes and keeps the parameters where the update expects them.

    `grad_finalizers` run once per step on the complete local gradients, in registration
    order; they are linear sums over other axes, so they commute with the data-parallel sum.
    A ZeRO synchroniser is told its `ParamFinalizer`s when it is built (it buckets their
    parameters apart); a finalizer appended to the list afterwards names nothing, so ZeRO-2/3
    then keep every gradient full until the end of the step.
    `held_tensors` gives the parameter and gradient storage the synchroniser owns ("params",
    "grads"); `padding_bytes` the padding of every kind its shard geometry adds.
    """

    grad_finalizers: list[GradFinalizer]

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside, backward accumulates local gradients and (stage < 2) communicates nothing."""
        ...

    def finish(self) -> None:
        """Complete every reduction of this step and run the finalizers."""
        ...

    def zero_grad(self) -> None: ...

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Inside, every parameter holds its full local value (ZeRO-3 gathers; others hold them)."""
        ...

    def wait_for_parameters(self) -> None:
        """Make the parameters this rank holds current: ZeRO-1/2 leave the all-gathers of the
        updated parameters in flight after the step (the next forward waits for each bucket just
        before it reads it); anything else that reads or writes parameters calls this first."""
        ...


class CheckpointState(Protocol):
    """The optimizer's part of a checkpoint (what fivefold/checkpoint/ saves and loads)."""

    steps: int  # completed updates (Adam's bias correction); saved and restored by the checkpoint

    @property
    def owns_parameter_shards(self) -> bool:
        """True when the saved parameters come from the optimizer ("param" entries), not the modules."""
        ...

    def sharded_state(self) -> ShardedState: ...

    def load_sharded_state(self, reader: ShardReader) -> None: ...


class TrainingOptimizer(CheckpointState, HoldsTensors, Protocol):
    """Everything a caller may ask of the optimizer of one rank, whatever the ZeRO stage."""

    @property
    def sync(self) -> GradientSynchroniser: ...

    @property
    def grad_finalizers(self) -> list[GradFinalizer]:
        """The synchroniser's finalizers: parallelize() registers every strategy's here."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def finish_grad_sync(self) -> None: ...

    def gathered(self) -> contextlib.AbstractContextManager[None]: ...

    def wait_for_parameters(self) -> None: ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients to a global norm of at most max_norm (0: no clipping); return the norm."""
        ...

    def step(self, lr: float) -> None: ...

    def zero_grad(self) -> None: ...
