"""The kernels of a train step that no compiler removes, recorded and replayed on their own.

A compiler fuses the element-wise work of a step (norms, activations, rotary embedding, the
loss, residual adds) and drops copies; it runs the matrix multiplications, the attention
kernel and the fused optimizer update as the same ATen kernels eager mode calls. Replaying
exactly those kernels of one recorded step (same shapes, strides and arguments, on fresh
tensors) times the step with everything else free: eager time / floor time is the largest
speed-up any compilation of that step can reach on this machine, measured in the same
alternating rounds as the cases it bounds.

    python benchmarks/bench_single.py --compile --floor
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# ATen kernels that any compilation of a dense Llama step keeps: the GEMMs, the attention
# kernel (forward and backward) and the multi-tensor AdamW update.
FLOOR_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    torch.ops.aten._fused_adamw_.default,
}


class TensorSpec:
    """What a recorded call needs to rebuild one tensor argument: shape, strides, dtype.

    Built once: calls that passed the same tensor (a weight, an activation read by two GEMMs)
    share one replay tensor, so the replay reuses memory and caches as the step did."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype
        self.tensor: torch.Tensor | None = None

    def build(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
            if self.dtype.is_floating_point:
                # Positive, normal values: an AdamW second moment must not be negative, and
                # zeros or denormals could change a kernel's work.
                self.tensor.copy_(torch.rand(self.shape, dtype=self.dtype) + 0.5)
            else:
                self.tensor.zero_()
        return self.tensor


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []
        self.specs: dict[tuple, TensorSpec] = {}

    def spec(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
        return self.specs.setdefault(key, TensorSpec(x))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FLOOR_OPS:
            self.calls.append((func, tree_map(self.spec, args), tree_map(self.spec, kwargs)))
        return func(*args, **kwargs)


def record_floor(step: Callable[[], None]) -> list[tuple[Any, tuple, dict]]:
    """The floor kernels one call of `step` runs, in order, with their argument specs."""
    with _Recorder() as recorder:
        step()
    if not recorder.calls:
        raise SystemExit("step_floor: the step ran none of the recorded kernels (different ATen ops?)")
    return recorder.calls


def floor_case(step: Callable[[], None]) -> Callable[[], None]:
    """A case that replays the floor kernels of one call of `step`."""
    calls = record_floor(step)
    built = lambda x: x.build() if isinstance(x, TensorSpec) else x  # noqa: E731
    replays = [(func, tree_map(built, args), tree_map(built, kwargs)) for func, args, kwargs in calls]

    def run() -> None:
        for func, args, kwargs in replays:
            func(*args, **kwargs)

    return run


def floor_ratios(seconds: dict[str, list[float]]) -> dict[str, float]:
    """Per case, the median over rounds of its time / the floor's time in the same round:
    for the eager peer, the largest speed-up a compiled step could reach over it."""
    floor = seconds["floor"]
    return {
        name: sorted(t / f for t, f in zip(times, floor))[len(floor) // 2]
        for name, times in seconds.items()
        if name != "floor"
    }
