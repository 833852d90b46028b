"""Saving a run's state during training, resuming from the newest usable checkpoint, and
stopping cleanly on SIGTERM or Ctrl-C.

The data sampler is a pure function of the step (fivefold/data/sources.py) and the learning rate a
pure function of the step and the train config, so saving the step restores both. RNG
states (CPU, and CUDA when present) are restored per rank when the world size is unchanged.
Every decision that ranks must take together (a failed write, a corrupt checkpoint, a stop
request) is agreed by one all-reduce of a status code, so all ranks take the same branch.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import torch

from ..parallel import comm
from ..parallel.sharding import get_placement
from ..job.rundir import describe_write_error, write_errors
from .errors import CheckpointError, CorruptCheckpoint, IncompatibleCheckpoint
from .format import commit, list_checkpoints, prune, read_manifest, staging_dir, step_dir, write_rank_files
from .reader import CheckpointReader, check_compatible
from .state import module_state_tensors, rng_states, set_rng_states, shard_entries, spec_of


def agree_max(value: int, model: Any) -> int:
    """The largest of every rank's `value` (a status code), so all ranks take the same branch."""
    flag = torch.tensor([float(value)], device=model.device)
    comm.all_reduce(flag, model.mesh.world, op="max")
    return int(flag.item())


def save_checkpoint(model: Any, step: int, root: Path, keep: int = 3) -> Path:
    """Every rank writes its shards in parallel; rank 0 commits once all succeeded.

    `step` is the number of optimizer steps done: a run resumed from it continues at step
    index `step`. Returns the committed directory.
    """
    mesh, root = model.mesh, Path(root)
    tmp, final = staging_dir(root, step), step_dir(root, step)
    if mesh.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted attempt at the same step
    agree_max(0, model)  # nobody writes before the stale directory is gone
    failure = ""
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write_rank_files(tmp, mesh.rank, shard_entries(model), rng_states())
    except write_errors() as err:  # a full disk surfaces from safetensors as its own error type
        failure = f"rank {mesh.rank} could not write its shards of checkpoint {final}: {describe_write_error(err)}"
    if agree_max(1 if failure else 0, model):
        _discard(tmp, mesh.rank)
        raise CheckpointError(failure or f"another rank failed to write checkpoint {final}; nothing was committed")
    if mesh.rank == 0:
        try:
            commit(tmp, final, mesh.world_size, checkpoint_meta(model, step))
            prune(root, keep)
        except write_errors() as err:
            failure = f"could not commit checkpoint {final}: {describe_write_error(err)}"
    if agree_max(1 if failure else 0, model):
        _discard(tmp, mesh.rank)
        raise CheckpointError(failure or f"rank 0 could not commit checkpoint {final}")
    return final


def _discard(tmp: Path, rank: int) -> None:
    """Rank 0 removes an uncommitted write (frees a full disk); it was never visible to a reader."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_meta(model: Any, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "optimizer_steps": int(model.optimizer.steps),
        "has_optimizer": True,
        "config": model.config.to_dict(),
        # Where the data stands (the batch of a step is a function of the step and these).
        "data": model.data_position(step) if model.data_position is not None else {},
    }


def load_into(model: Any, path: Path, manifest: dict[str, Any]) -> int:
    """Overwrite this rank's parameters, optimizer state and RNG from a checkpoint; return its step."""
    reader = CheckpointReader(path, manifest)
    config = model.config.model
    optimizer = model.optimizer
    optimizer.wait_for_parameters()  # no gather of an earlier update may land on what is read here
    for chunk in model.chunks:
        for name, tensor in module_state_tensors(chunk, optimizer):
            reader.read_into(tensor, spec_of(get_placement(tensor, name), config), "param")
    reader.skip_optimizer_state = not reader.has_optimizer  # imported weights: fresh moments
    optimizer.load_sharded_state(reader)
    optimizer.steps = int(manifest["optimizer_steps"])
    if manifest["world_size"] == model.mesh.world_size:
        try:
            set_rng_states(reader.rng_states(model.mesh.rank))
        except RuntimeError as err:  # a generator state of the wrong length
            raise CorruptCheckpoint(f"{path}: the random generator state of rank {model.mesh.rank} is unusable ({err})") from None
    return int(manifest["step"])


# Status codes ranks agree on (the largest wins): ok, try an older checkpoint, stop.
_OK, _CORRUPT, _INCOMPATIBLE = 0, 1, 2


def _attempt(model: Any, path: Path) -> tuple[int, str, int]:
    try:
        manifest = read_manifest(path)
        notes = check_compatible(manifest, model.config, path)
        step = load_into(model, path, manifest)
        notes += _data_notes(manifest, model, step)
    except CorruptCheckpoint as err:
        return _CORRUPT, str(err), -1
    except CheckpointError as err:  # another model, or an optimizer that cannot load state
        return _INCOMPATIBLE, str(err), -1
    if notes and model.mesh.rank == 0:
        print(f"note: resuming {path} with settings changed since it was saved: {', '.join(notes)}")
    return _OK, "", step


def _data_notes(manifest: dict[str, Any], model: Any, step: int) -> list[str]:
    """The data a checkpoint was trained on, where it differs from the data the run resumes on."""
    if model.data_position is None or not manifest.get("data"):
        return []
    now, saved = model.data_position(step), manifest["data"]
    return [f"data {key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in now if saved.get(key) != now[key]]


def resume_latest(model: Any, root: Path) -> int:
    """Load the newest usable checkpoint under `root`; return its step (0 if there is none)."""
    return resume_newest(model, root)[0]


def resume_newest(model: Any, root: Path) -> tuple[int, Path | None]:
    """Load the newest usable checkpoint under `root`; return its step and folder ((0, None) if there is none).

    A corrupt checkpoint (on any rank) is reported and the previous one tried; a checkpoint
    of another model, or none usable among existing ones, stops the run before it writes.
    """
    failures = []
    candidates = list_checkpoints(Path(root))
    for path in candidates:
        status, reason, step = _attempt(model, path)
        worst = agree_max(status, model)
        if worst == _OK:
            return step, path
        reason = reason or "unusable on another rank (see its log)"
        if worst == _INCOMPATIBLE:
            raise IncompatibleCheckpoint(reason)
        failures.append(reason)
        if model.mesh.rank == 0:
            print(f"warning: skipping checkpoint {path.name}: {reason}")
    if candidates:
        raise CheckpointError(f"no usable checkpoint in {root}: " + "; ".join(failures))
    return 0, None


class StopRequest:
    """Turns SIGTERM and SIGINT (Ctrl-C) into a request to checkpoint and stop after the current step.

    Ranks may receive the signal at different steps, so `agreed` takes the maximum over the
    world: all ranks stop after the same step, and all take part in the final checkpoint.
    A second Ctrl-C raises KeyboardInterrupt at once, as the launcher kills at a second signal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0  # the first signal received; 0 while none
        self._previous: dict[int, Any] = {}
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. inside a test harness): no handler
                pass

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop without waiting for the checkpoint
        self.signum = self.signum or signum

    def agreed(self, model: Any) -> bool:
        return bool(agree_max(int(self.requested), model))

    def close(self) -> None:
        for sig, previous in self._previous.items():
            if previous is not None:  # None: a handler installed outside Python, which cannot be restored
                signal.signal(sig, previous)
