"""What the worker pool runs for the final-weights tests, and the allocation tracker they use."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fivefold.checkpoint import write_final_weights
from fivefold.config import Config
from fivefold.data.loader import open_training_data
from fivefold.parallel import comm
from fivefold.rules.layout import validate
from fivefold.train import build, train_step


class AllocationTracker(TorchDispatchMode):
    """The most bytes of tensor storage allocated inside the block that were alive at once.

    Every op's outputs are looked at: a storage none of the op's inputs shares is new, and
    counts until the last tensor that uses it is gone (views keep it alive, as in the
    allocator). Storages that existed before the block (the model's own shards) never count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, list[weakref.ref]]] = {}  # storage pointer -> (bytes, its tensors)
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = _storage(t)
            if key in self.live:
                self.live[key][1].append(weakref.ref(t))
            elif key not in inputs and t.untyped_storage().nbytes():
                nbytes = t.untyped_storage().nbytes()
                self.live[key] = (nbytes, [weakref.ref(t)])
                self.largest = max(self.largest, nbytes)
        self._sweep()
        return out

    def _sweep(self) -> None:
        for key in [k for k, (_, refs) in self.live.items() if all(r() is None for r in refs)]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for n, _ in self.live.values()))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def save_before_and_after_training(ctx, config: Config, folder: str, steps: int, max_file_bytes: int) -> dict[str, Any]:
    """Write the initial weights (to folder/initial and folder/replaced), train, write the trained
    ones (to folder/trained, measured, and over folder/replaced); report what the saves allocated."""
    config = validate(config, ctx.world_size)
    mesh = ctx.mesh(config.layout)
    _, sampler = open_training_data(config)
    model = build(config, mesh, torch.device("cpu"))
    folders = {name: Path(folder) / name for name in ("initial", "replaced", "trained")}
    if mesh.rank == 0:
        for path in folders.values():
            path.mkdir(parents=True, exist_ok=True)
    comm.barrier(mesh.world)
    write_final_weights(model, folders["initial"], 0, max_file_bytes)
    write_final_weights(model, folders["replaced"], 0, max_file_bytes)
    for step in range(steps):
        train_step(model, sampler, step)
    with AllocationTracker() as save:
        write_final_weights(model, folders["trained"], steps, max_file_bytes)
    write_final_weights(model, folders["replaced"], steps, max_file_bytes)
    with AllocationTracker() as gather:
        full = model.full_parameters()  # the in-memory gather parity checks use: the whole model
    return {"save_peak": save.peak, "save_largest": save.largest, "gather_peak": gather.peak,
            "full": full if mesh.rank == 0 else None}


def save_with_a_full_disk_on_the_last_rank(ctx, config: Config, folder: str, max_file_bytes: int) -> str:
    """Save once, then again with writes beyond 1 kB failing on the last rank only; the error each rank got."""
    import resource
    import signal

    from fivefold.checkpoint import FinalWeightsError

    config = validate(config, ctx.world_size)
    mesh = ctx.mesh(config.layout)
    model = build(config, mesh, torch.device("cpu"))
    write_final_weights(model, Path(folder), 0, max_file_bytes)
    last = mesh.rank == mesh.world_size - 1
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN) if last else None
    if last:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        write_final_weights(model, Path(folder), 5, max_file_bytes)
    except FinalWeightsError as err:
        return str(err)
    finally:
        if last:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, previous)
    return ""
