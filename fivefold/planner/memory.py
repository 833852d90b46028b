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
(master + momentum) in mixed precision and K = 4 in fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .errors import UnknownNameError, choices

OPTIMIZERS = ("adam", "adamw", "sgd")


class StateBytes(NamedTuple):
    param: int      # bytes per parameter of the working weights
    grad: int       # bytes per parameter of the gradient
    optimizer: int  # K: bytes per parameter of optimizer state (incl. master weights)


def state_bytes(precision: str, optimizer: str = "adam") -> StateBytes:
    """Bytes per parameter for weights, gradients and optimizer state (module docstring)."""
    opt = optimizer.lower()
    if opt not in OPTIMIZERS:
        raise UnknownNameError(f"optimizer={optimizer!r} is unknown; use one of {choices(OPTIMIZERS)}")
    if precision == "fp32":
        return StateBytes(4, 4, 4 if opt == "sgd" else 8)
    if precision in ("bf16", "fp16"):
        return StateBytes(2, 2, 8 if opt == "sgd" else 12)
    raise UnknownNameError(f"precision={precision!r} is unknown; use one of bf16, fp16, fp32")


class ModelStates(NamedTuple):
    params: int
    grads: int
    optimizer: int


def zero_model_states(psi: float, n: int, zero: int, sb: StateBytes) -> ModelStates:
    """Per-device bytes for ``psi`` parameters sharded over ``n`` ranks at ZeRO ``zero``."""
    shard = lambda nbytes: math.ceil(nbytes / n)  # noqa: E731
    p, g, k = sb.param * psi, sb.grad * psi, sb.optimizer * psi
    if zero == 0:
        return ModelStates(math.ceil(p), math.ceil(g), math.ceil(k))
    if zero == 1:
        return ModelStates(math.ceil(p), math.ceil(g), shard(k))
    if zero == 2:
        return ModelStates(math.ceil(p), shard(g), shard(k))
    return ModelStates(shard(p), shard(g), shard(k))
