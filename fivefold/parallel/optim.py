"""AdamW written element-wise, the global gradient norm, and the optimizer of replicated weights.

The update is one element-wise function shared by every layout: ZeRO applies it to flat
shards, the plain optimizer to whole tensors, and both compute bit-for-bit the same numbers
for the same elements. It runs torch's fused multi-tensor AdamW kernel (one pass over the
parameters, gradients and moments) so that every element takes the kernel's vector path,
whatever slice of a buffer a layout hands it. Gradients arrive already reduced (summed over
data-parallel ranks, since each rank's loss is already divided by the tokens of the whole
global batch).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn as nn

from ..config import TrainConfig
from .mesh import Axis, Mesh
from ..rules.precision import PrecisionPolicy
from . import comm
from .protocols import GradFinalizer, GradientSynchroniser, ShardedState, ShardReader
from .sharding import get_placement, replica_count


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class AdamWSettings:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    precision: PrecisionPolicy = PrecisionPolicy()  # what the parameters, gradients and reductions use

    @classmethod
    def from_train(cls, train: TrainConfig) -> "AdamWSettings":
        return cls(train.beta1, train.beta2, train.eps, train.weight_decay, PrecisionPolicy.from_train(train))

    @property
    def param_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.precision.params]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.precision.reduce]


def master_copy(weights: torch.Tensor, settings: AdamWSettings) -> torch.Tensor:
    """The fp32 weights the update runs on: `weights` themselves in fp32, else a new fp32 copy."""
    if settings.precision.has_master_weights:
        return weights.detach().float().clone()
    return weights


def decays(ndim: int) -> bool:
    """Weight decay applies to matrices (ndim >= 2), not to vectors: norm weights and biases.

    The rule reads the shape only, so a tensor-parallel or ZeRO shard of a parameter decays
    exactly when the whole parameter does. (The router's balancing bias is a buffer, not a
    parameter: the optimizer never sees it.)
    """
    return ndim >= 2


# The fused CPU kernel runs whole vectors and then a scalar tail, which computes in double
# and so rounds differently; its thread split (at::parallel_for, chunk = ceil(n / threads))
# adds a tail per chunk. Handing it only lengths that are multiples of LANES x threads puts
# every element through the vector path, so an element's update does not depend on how a
# layout slices the buffers (a bucket, a ZeRO shard, one tensor). 64 is a multiple of every
# vector width (fp32 lanes: 4 to 16).
FUSED_LANES = 64


@torch.no_grad()
def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    settings: AdamWSettings,
    weight_decay: bool,
) -> None:
    """One decoupled-weight-decay Adam step (Loshchilov & Hutter 2019), in place, fp32 state."""
    adamw_multi_update_([param], [grad], [exp_avg], [exp_avg_sq], step, lr, settings, weight_decay)


@torch.no_grad()
def adamw_multi_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    settings: AdamWSettings,
    weight_decay: bool,
) -> None:
    """`adamw_update_` over lists of tensors with one weight-decay rule.

    One fused multi-tensor kernel (torch._fused_adamw_, one pass over param, grad and both
    moments) runs every element through its vector path: the bulk of each tensor in place,
    the remainders (and any non-contiguous tensor whole) packed into one zero-padded scratch
    block, whose zeros update to zeros, and copied back.
    """
    unit = FUSED_LANES * torch.get_num_threads()
    bulks: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    tails: list[tuple[torch.Tensor, ...]] = []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = g.to(m.dtype).contiguous()  # bf16 gradients: the update runs in the fp32 of the state
        if not (p.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            tails.append((p, g, m, v))  # updated through the scratch block, whole
            continue
        cut = p.numel() - p.numel() % unit
        if cut == p.numel():  # the whole tensor, as it is (no view to make)
            for out, t in zip(bulks, (p, g, m, v)):
                out.append(t)
        elif cut:
            for out, t in zip(bulks, (p, g, m, v)):
                out.append(t.view(-1)[:cut])
        if cut < p.numel():
            tails.append(tuple(t.view(-1)[cut:] for t in (p, g, m, v)))
    scratch = _padded_tails(tails, unit, params[0].dtype) if tails else None
    if scratch is not None:
        for out, row in zip(bulks, scratch):
            out.append(row)
    if bulks[0]:
        steps = [torch.tensor(float(step), device=params[0].device)] * len(bulks[0])
        no_amsgrad: list[torch.Tensor] = []
        torch._fused_adamw_(
            bulks[0], bulks[1], bulks[2], bulks[3], no_amsgrad, steps, lr=lr, beta1=settings.beta1,
            beta2=settings.beta2, weight_decay=settings.weight_decay if weight_decay else 0.0, eps=settings.eps,
            amsgrad=False, maximize=False,
        )
    if scratch is not None:
        _unpack_tails(tails, scratch)


def _padded_tails(tails: list[tuple[torch.Tensor, ...]], unit: int, dtype: torch.dtype) -> torch.Tensor:
    """(4, k * unit) zeros holding the tails' param, grad, exp_avg, exp_avg_sq back to back."""
    total = sum(t[0].numel() for t in tails)
    scratch = torch.zeros(4, -(-total // unit) * unit, dtype=dtype, device=tails[0][0].device)
    start = 0
    for tail in tails:
        n = tail[0].numel()
        for row, t in zip(scratch, tail):
            row[start : start + n].copy_(t.reshape(-1))
        start += n
    return scratch


def _unpack_tails(tails: list[tuple[torch.Tensor, ...]], scratch: torch.Tensor) -> None:
    start = 0
    for p, _, m, v in tails:
        n = p.numel()
        for t, row in ((p, scratch[0]), (m, scratch[2]), (v, scratch[3])):
            t.copy_(row[start : start + n].view(t.shape))
        start += n


_FP32 = torch.finfo(torch.float32)


class SquaredNormShare:
    """This rank's share of the squared gradient norm, computed on the device without a host sync.

    `tensors[i]` counts 1/copies[i] of its sum of squares, so that one sum over the world
    counts every element once. One fused multi-tensor kernel (torch._foreach_norm) takes every
    tensor's fp32 norm: a single pass over the gradients, no fp64 copy (twenty times slower
    on CPU), on the model's gradients within ~1e-7 of the exact fp64 sum. Each norm is
    squared and added in float64 on the device.

    fp32 cannot hold a sum of squares above its largest value (elements from about 1e19)
    nor tell it apart from rounding below numel x its smallest normal (squares of 1e-25 flush
    to 0). `sums()` counts those out-of-range tensors beside the sum, so the one host read
    the caller makes anyway (clipping needs the norm) says whether `widened()` must take them
    again in fp64; fp64 holds the square of any fp32 value. A tensor of zeros counts as out of
    range too (its fp32 sum cannot tell zeros from flushed squares): a step with one, such as
    an expert no token reached, takes the second round.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], copies: Sequence[int], device: torch.device | str) -> None:
        self.tensors = [t.reshape(-1) for t in tensors]
        self.copies = torch.tensor(list(copies), dtype=torch.float64).to(device)
        norms = list(torch._foreach_norm(self.tensors, 2, dtype=torch.float32)) if self.tensors else []
        self.squares = torch.stack(norms).double().square() if norms else self.copies.new_zeros(0)
        numels = torch.tensor([t.numel() for t in self.tensors], dtype=torch.float64).to(device)
        self.in_range = (self.squares >= numels * _FP32.tiny) & (self.squares <= _FP32.max)

    def sums(self) -> torch.Tensor:
        """(2,) float64 on the device: the share of the squared norm, and how many tensors'
        fp32 sums fell outside fp32's range (their squares are left out of the share)."""
        share = torch.where(self.in_range, self.squares / self.copies, 0.0).sum()
        return torch.stack([share, (~self.in_range).sum().double()])

    def widened(self) -> torch.Tensor:
        """`sums()` with the out-of-range tensors taken again in fp64 (a host read of which)."""
        out = [t for t, ok in zip(self.tensors, self.in_range.tolist()) if not ok]
        squares = torch.where(self.in_range, self.squares, 0.0)
        if out:
            wide = torch.stack(torch._foreach_norm(out, 2, dtype=torch.float64)).square()
            squares = squares.masked_scatter(~self.in_range, wide)
        return torch.stack([(squares / self.copies).sum(), squares.new_zeros(())])


def reduced_norm(share: SquaredNormShare, axis: Axis | None) -> float:
    """sqrt of the share summed over `axis` (None: the share is the whole norm), read once.

    One collective of two numbers and one host read (clipping and the step's report need the
    norm on the host). Every rank sees the same out-of-range count after the sum, so all of
    them, or none, take the widened second round.
    """
    sums = share.sums()
    if axis is not None and axis.size > 1:
        comm.all_reduce(sums, axis)
    squares, out_of_range = sums.tolist()
    if out_of_range:
        sums = share.widened()
        if axis is not None and axis.size > 1:
            comm.all_reduce(sums, axis)
        squares = sums[0].item()
    return math.sqrt(squares)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor clipping applies (1.0 when it does not), as every optimizer computes it."""
    if max_norm <= 0:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1 else 1.0


def scale_(tensors: Sequence[torch.Tensor | None], coef: float) -> None:
    """Multiply each tensor by `coef` in place, one tensor at a time: torch._foreach_mul_
    rounds a Python scalar to a bf16 tensor's dtype first (a clip coefficient off by up to
    2**-9), mul_ multiplies in fp32 and rounds the product only."""
    for t in tensors:
        if t is not None:
            t.mul_(coef)


def global_grad_norm(named: Sequence[tuple[str, torch.Tensor]], mesh: Mesh) -> float:
    """sqrt of the sum of squared gradients of the full model, each element counted once.

    A shard replicated on r ranks adds 1/r of its square on each, then one sum over the world.
    """
    with_grads = [(name, p, p.grad) for name, p in named if p.grad is not None]
    grads = [grad.detach() for _, _, grad in with_grads]
    copies = [replica_count(get_placement(p, name), mesh) for name, p, _ in with_grads]
    return reduced_norm(SquaredNormShare(grads, copies, mesh.world.device_type), mesh.world)


class LocalGradients:
    """The synchroniser of a rank without data-parallel replicas: nothing to sum, only finalizers.

    The gradients stay the parameters' own .grad; the modules hold parameters and gradients.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self.named = named
        self.grad_finalizers: list[GradFinalizer] = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        for finalize in self.grad_finalizers:
            finalize()

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        yield  # every parameter is whole already

    def wait_for_parameters(self) -> None:
        pass  # the update writes the parameters in place: nothing in flight

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [], "grads": []}  # the modules' own parameters and .grad

    def padding_bytes(self) -> dict[str, int]:
        return {"params": 0, "grads": 0, "optimizer": 0}


class Synchronised:
    """The synchroniser's half of TrainingOptimizer, forwarded to `self.sync`.

    The loop, the pipeline and the composition point ask the optimizer; the work is the
    synchroniser's (see fivefold/parallel/protocols.py).
    """

    sync: GradientSynchroniser

    @property
    def grad_finalizers(self) -> list[GradFinalizer]:
        return self.sync.grad_finalizers

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.sync.no_sync()

    def finish_grad_sync(self) -> None:
        self.sync.finish()

    def zero_grad(self) -> None:
        self.sync.zero_grad()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return self.sync.gathered()

    def wait_for_parameters(self) -> None:
        self.sync.wait_for_parameters()


class ReplicatedAdamW(Synchronised):
    """AdamW over whole tensors, per parameter: the update of a rank without data parallelism.

    Used when dp x cp = 1 (its synchroniser only runs the finalizers); the data-parallel and
    ZeRO optimizers replace it otherwise.
    """

    def __init__(self, modules: list[nn.Module], mesh: Mesh, settings: AdamWSettings) -> None:
        self.mesh, self.settings = mesh, settings
        self.named = [(n, p) for m in modules for n, p in m.named_parameters() if p.requires_grad]
        self.sync = LocalGradients(self.named)
        # fp32 master weights (the parameters themselves in fp32), then the parameters in their dtype
        self.masters = {id(p): master_copy(p.data, settings) for _, p in self.named}
        for _, p in self.named:
            p.data = p.data.to(settings.param_dtype)
        self.state = {id(p): (torch.zeros_like(w), torch.zeros_like(w)) for p, w in self._with_masters()}
        self.steps = 0

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = global_grad_norm(self.named, self.mesh)
        coef = clip_coefficient(norm, max_norm)
        if coef < 1:
            scale_([p.grad for _, p in self.named], coef)
        return norm

    def _with_masters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, self.masters[id(p)]) for _, p in self.named]

    def step(self, lr: float) -> None:
        """One fused multi-tensor call per weight-decay rule (an element's update does not
        depend on which tensors share the call), then the new weights into bf16 parameters."""
        self.steps += 1
        grads = {id(p): p.grad for _, p in self.named if p.grad is not None}
        updated = [p for _, p in self.named if id(p) in grads]
        for weight_decay in (True, False):
            group = [p for p in updated if decays(p.dim()) == weight_decay]
            if group:
                adamw_multi_update_(
                    [self.masters[id(p)] for p in group], [grads[id(p)] for p in group],
                    [self.state[id(p)][0] for p in group], [self.state[id(p)][1] for p in group],
                    self.steps, lr, self.settings, weight_decay,
                )
        for p in updated:
            master = self.masters[id(p)]
            if master is not p.data:
                p.data.copy_(master)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank stores, by kind, for memory accounting (fivefold.observe.held_memory)."""
        own = [w for p, w in self._with_masters() if w is not p.data]  # fp32 masters count as optimizer state
        return {**self.sync.held_tensors(), "optimizer": [t for pair in self.state.values() for t in pair] + own}

    def padding_bytes(self) -> dict[str, int]:
        return self.sync.padding_bytes()

    # Checkpoint (fivefold/checkpoint/): each state tensor sits where its parameter does.
    # With master weights the optimizer owns the parameters: the fp32 masters are saved as "param".
    @property
    def owns_parameter_shards(self) -> bool:
        return self.settings.precision.has_master_weights

    def sharded_state(self) -> ShardedState:
        out: ShardedState = {}
        for name, p in self.named:
            m, v = self.state[id(p)]
            placement = get_placement(p, name)
            out[name] = {"exp_avg": (m, placement), "exp_avg_sq": (v, placement)}
            if self.owns_parameter_shards:
                out[name]["param"] = (self.masters[id(p)], placement)
        return out

    def load_sharded_state(self, reader: ShardReader) -> None:
        for name, p in self.named:
            placement = get_placement(p, name)
            for key, tensor in zip(("exp_avg", "exp_avg_sq"), self.state[id(p)]):
                reader.read_into(tensor, placement, key)
            if self.owns_parameter_shards:
                reader.read_into(self.masters[id(p)], placement, "param")
                p.data.copy_(self.masters[id(p)])


def lr_at(step: int, train: TrainConfig) -> float:
    """Linear warm-up to train.lr, then cosine decay to train.min_lr at the last step."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(train.steps - train.warmup_steps, 1)
    progress = min((step - train.warmup_steps) / span, 1.0)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))
