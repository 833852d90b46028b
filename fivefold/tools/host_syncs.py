"""Count the points where the host waits for the device: a test's `set_sync_debug_mode` on CPU.

On a GPU the host runs ahead of the device until it needs a value the device computes: a
scalar read (`.item()`, `int(t)`, `float(t)`, `bool(t)`), a list (`.tolist()`), a copy to host
memory (`.cpu()`, `.numpy()`). Each such read stalls the host until every queued kernel has
run, so the hot path of a step keeps them to a documented few. `torch.cuda.set_sync_debug_mode`
reports them on CUDA only; `HostSyncs` counts the same reads on any device, CPU included, so
tests on a CPU machine can pin the number of syncs per step.

Two observers, so that each read is counted once whatever the device:
- the dispatcher sees `aten._local_scalar_dense` (every scalar read, CPU or not) and copies
  from a device to the host (`.cpu()`, `.tolist()`, `.numpy()` of a GPU tensor);
- Python's method calls see `.tolist()`, `.numpy()` and `.cpu()` of a CPU tensor, which
  dispatch nothing (the data is already on the host) but are host copies on a GPU.
`.to("cpu")` of a CPU tensor is not counted: on a CPU run it cannot be told apart from moving
host data onto the run's device; code that means a host copy says `.cpu()`.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Methods that read a CPU tensor to the host without dispatching an operator.
_HOST_READ_METHODS = ("tolist", "numpy", "cpu")
_TORCH_ROOT = str(Path(torch.__file__).parent)
_THIS_FILE = __file__


@dataclass
class HostSyncs:
    """A context manager that records every host sync in its body, with where it happened.

    `count` is the number of syncs; `sites` counts them by "file (function) kind" of the first
    caller outside torch, so a test can name each one (no line number: it moves with edits).
    """

    sites: Counter = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def record(self, what: str) -> None:
        self.sites[f"{_caller()} {what}"] += 1

    def __enter__(self) -> "HostSyncs":
        self._modes: list[TorchFunctionMode | TorchDispatchMode] = [_MethodReads(self), _DispatchedReads(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def summary(self) -> str:
        """One line per call site, for an assertion message."""
        return "\n".join(f"{n} x {site}" for site, n in sorted(self.sites.items()))


def _caller() -> str:
    """file (function) of the innermost frame outside torch and this module."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _THIS_FILE and not name.startswith(_TORCH_ROOT):
            return f"{Path(name).name} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"


class _MethodReads(TorchFunctionMode):
    """`.tolist()`, `.numpy()`, `.cpu()` of CPU tensors: no operator is dispatched for them."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.syncs.record(name)
        return func(*args, **(kwargs or {}))


class _DispatchedReads(TorchDispatchMode):
    """Scalar reads on any device, and copies from a device to the host."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.record("scalar read")
        elif _copies_to_host(func, args, kwargs):
            self.syncs.record("copy to host")
        return func(*args, **kwargs)


def _copies_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """aten._to_copy to the CPU, or copy_ into a CPU tensor, of a tensor on another device."""
    if func is torch.ops.aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu"
    if func is torch.ops.aten.copy_.default:
        dest, source = args[0], args[1]
        return dest.device.type == "cpu" and isinstance(source, torch.Tensor) and source.device.type != "cpu"
    return False
