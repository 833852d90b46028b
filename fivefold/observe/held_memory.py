"""Memory a rank actually holds for training state, measured by tensor storage.

`held_memory` walks the model chunks and the optimizer's own tensors and adds up the bytes
of every distinct storage (views of one flat buffer count once; a storage resized to zero,
like a freed ZeRO-3 parameter buffer, counts nothing). `zero_formula_bytes` is the ZeRO
paper's per-stage model for comparison, with the bytes per parameter of the run's precision
policy (fivefold.rules.precision): 4 + 4 + 8 in fp32 (and under bf16 autocast over fp32 weights),
2 + 2 + 12 with bf16 parameters (the fp32 master weights count as optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from ..parallel.protocols import HoldsTensors
from ..rules.precision import PrecisionPolicy

FP32 = PrecisionPolicy()


@dataclass
class HeldMemory:
    """Bytes of distinct storages per kind; `padding` is the part of each that pads shards."""

    params: int
    grads: int
    optimizer: int
    padding: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def without_padding(self) -> dict[str, int]:
        return {k: getattr(self, k) - self.padding.get(k, 0) for k in ("params", "grads", "optimizer")}


def _storage_bytes(tensors: Sequence[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself: data_ptr is 0 for every meta tensor (dry runs)
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def held_memory(chunks: Sequence[nn.Module], optimizer: HoldsTensors) -> HeldMemory:
    """Parameters, gradients and optimizer state this rank holds right now, by storage."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    own = optimizer.held_tensors()
    seen: set[int] = set()
    param_bytes = _storage_bytes([*params, *own.get("params", [])], seen)
    grad_bytes = _storage_bytes([*(p.grad for p in params), *own.get("grads", [])], seen)
    state = own.get("optimizer")
    optimizer_bytes = _storage_bytes(state or [], seen)  # moments and any separate fp32 master weights
    padding = optimizer.padding_bytes()
    return HeldMemory(param_bytes, grad_bytes, optimizer_bytes, padding)


def zero_formula_bytes(psi: int, n: int, stage: int, policy: PrecisionPolicy = FP32) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes for psi parameters sharded over n data-parallel ranks."""
    shard = 1.0 / n
    return {
        "params": policy.param_bytes * psi * (shard if stage >= 3 else 1.0),
        "grads": policy.grad_bytes * psi * (shard if stage >= 2 else 1.0),
        "optimizer": policy.optimizer_bytes() * psi * (shard if stage >= 1 else 1.0),
    }
