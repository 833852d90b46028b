"""Model-state memory (parameters, gradients, optimizer state) under ZeRO stages.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Section 3.1 and Figure 1: mixed-precision Adam keeps 2 bytes (fp16/bf16 weights)
+ 2 bytes (gradients) + K = 12 bytes (fp32 master weights, momentum, variance) per
parameter. Per device, with N data-parallel ranks sharing the states:

    ZeRO-0 (plain DP): (2 + 2 + K) Psi
    ZeRO-1 (Pos):       2 Psi + 2 Psi + K Psi / N
    ZeRO-2 (Pos+g):     2 Psi + (2 + K) Psi / N
    ZeRO-3 (Pos+g+p):   (2 + 2 + K) Psi / N

fp32 training derives the same way: 4-byte weights, 4-byte gradients and K = 8 (Adam's two
fp32 moments; the weights are their own master copy). SGD with momentum keeps K = 4 + 4
(master + momentum) in mixed precision and K = 4 in fp32. The rule is the runtime's
(fivefold.rules.precision): ``precision`` names a policy, e.g. "bf16" or, for bf16 autocast over
fp32 weights as `train.dtype = "bf16"` alone runs, "bf16,params=fp32,reduce=fp32".
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..rules import volumes
from ..rules.fp8 import base_policy
from ..rules.precision import PrecisionError, parse_policy
from .errors import UnknownNameError


class StateBytes(NamedTuple):
    param: int      # bytes per parameter of the working weights
    grad: int       # bytes per parameter of the gradient
    optimizer: int  # K: bytes per parameter of optimizer state (incl. master weights)
    reduce_bytes: int | None = None  # per gradient element in data-parallel sums; None: grad

    @property
    def reduce(self) -> int:
        return self.grad if self.reduce_bytes is None else self.reduce_bytes


def state_bytes(precision: str, optimizer: str = "adam") -> StateBytes:
    """Bytes per parameter for weights, gradients and optimizer state (module docstring)."""
    try:
        policy = parse_policy(base_policy(precision))
        return StateBytes(policy.param_bytes, policy.grad_bytes, policy.optimizer_bytes(optimizer),
                          policy.reduce_bytes)
    except PrecisionError as err:
        raise UnknownNameError(str(err)) from None


class ModelStates(NamedTuple):
    params: int
    grads: int
    optimizer: int


def zero_model_states(psi: float, n: int, zero: int, sb: StateBytes, finalized: float = 0.0, pp: int = 1,
                      gather: str = "micro_batch") -> ModelStates:
    """Per-device bytes for ``psi`` parameters sharded over ``n`` ranks at ZeRO ``zero``.

    ``finalized`` of the ``psi`` parameters have gradients completed by gradient finalizers:
    ZeRO-2/3 hold those full until the end of the step (`fivefold.rules.volumes.zero_reduction`).
    ZeRO-3 gathering once per step (``gather="step"``) holds the full parameters besides its shard.
    """
    shard = lambda nbytes: math.ceil(nbytes / n)  # noqa: E731
    p, g, k = sb.param * psi, sb.grad * psi, sb.optimizer * psi
    full = volumes.held_full_grad_bytes(zero, g, sb.grad * finalized, pp)
    grads = math.ceil(full) + (shard(g - full) if full < g else 0)
    if zero == 0:
        return ModelStates(math.ceil(p), grads, math.ceil(k))
    if zero in (1, 2):
        return ModelStates(math.ceil(p), grads, shard(k))
    held = math.ceil(p) if volumes.zero3_gathers_once_per_step(gather) else 0
    return ModelStates(shard(p) + held, grads, shard(k))
