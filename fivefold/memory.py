"""Memory a rank actually holds for training state, measured by tensor storage.

`held_memory` walks the model chunks and the optimizer's own tensors and adds up the bytes
of every distinct storage (views of one flat buffer count once; a storage resized to zero,
like a freed ZeRO-3 parameter buffer, counts nothing). `zero_formula_bytes` is the ZeRO
paper's per-stage model for comparison, with fivefold's dtypes: fp32 parameters (they are
also the master weights: bf16 runs autocast over them), fp32 gradients, and two fp32 Adam
moments (K = 8 bytes of optimizer state per parameter, instead of the paper's 12 for mixed
precision with a separate fp32 copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 4, 4, 8  # per parameter, fivefold's dtypes


class HoldsTensors(Protocol):
    def held_tensors(self) -> dict[str, list[torch.Tensor]]: ...

    def padding_bytes(self) -> dict[str, int]: ...


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


def _storage_bytes(tensors: list[torch.Tensor | None], seen: set[int]) -> int:
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


def held_memory(chunks: list[nn.Module], optimizer: object) -> HeldMemory:
    """Parameters, gradients and optimizer state this rank holds right now, by storage."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    own = optimizer.held_tensors() if hasattr(optimizer, "held_tensors") else {}
    seen: set[int] = set()
    param_bytes = _storage_bytes(params + own.get("params", []), seen)
    grad_bytes = _storage_bytes([p.grad for p in params] + own.get("grads", []), seen)
    state = own.get("optimizer")
    if state is None and hasattr(optimizer, "state"):  # ReplicatedAdamW: {id: (exp_avg, exp_avg_sq)}
        state = [t for pair in optimizer.state.values() for t in pair]
    optimizer_bytes = _storage_bytes(state or [], seen)
    padding = optimizer.padding_bytes() if hasattr(optimizer, "padding_bytes") else {}
    return HeldMemory(param_bytes, grad_bytes, optimizer_bytes, padding)


def zero_formula_bytes(psi: int, n: int, stage: int) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes for psi parameters sharded over n data-parallel ranks."""
    shard = 1.0 / n
    return {
        "params": PARAM_BYTES * psi * (shard if stage >= 3 else 1.0),
        "grads": GRAD_BYTES * psi * (shard if stage >= 2 else 1.0),
        "optimizer": OPTIMIZER_BYTES * psi * (shard if stage >= 1 else 1.0),
    }


def dp_comm_bytes_per_step(param_bytes: int, n: int, stage: int, micro_batches: int = 1) -> int:
    """Analytic ring bytes one rank sends on the data-parallel axis in one optimizer step.

    Stages 0-2: 2(n-1)/n of the gradient bytes (one all-reduce, or reduce-scatter then
    all-gather). Stage 3: (n-1)/n for each gather (forward and backward of every micro-batch)
    plus one reduce-scatter. `param_bytes` includes any padding to a multiple of n.
    """
    passes = 2 if stage < 3 else 2 * micro_batches + 1
    return passes * (n - 1) * param_bytes // n
