"""The weights at the end of a run, written by many ranks at once without any of them holding the
whole model.

`write_final_weights(model, run_dir, step)` writes the run's final weights as a Hugging Face-style
set of safetensors files (`sets.py`: `model.safetensors`, or `model-0000k-of-0000N.safetensors`
with `model.safetensors.index.json`), fp32 and under the full model's names. Every rank calls it.

The plan (`plan_final_weights`) is a function of the config alone, so every rank computes the
same one without asking the others: the full model's tensors in order, the pipeline rank that
holds each (the first stage of a tied embedding), the files (split by size as huggingface_hub
splits a state dict), and the rank that writes each file, spread over the ranks of the pipeline
stage that holds most of the file's bytes.

Then every rank walks the tensors in that order. For each one:

1. the ranks of the stage that holds it assemble it on their device: a tensor every rank of the
   stage holds whole (data-parallel replicas, norms) is used as it is; a split one (tensor-
   parallel or expert-parallel parts, ZeRO-3's flat ranges) is summed into a full-size buffer
   over the axes that split it, each part written by exactly one of its replicas and every other
   element left at -0.0, the additive identity of IEEE floats (x + -0.0 = x for every x, +0.0 and
   -0.0 included), so the sum is exact;
2. when the file's writer sits in another pipeline stage, the rank of the holding stage in the
   writer's pipeline group sends it there (point to point);
3. the writer moves it to the host, one tensor at a time, and hands it to its writing thread,
   which streams the file: header first (known from the plan), then each tensor's bytes.

So besides its own shards a rank holds one full tensor being assembled on its device, and a
writer at most one file's worth of host tensors waiting for its thread, whatever the model's
size. The thread lets the writers of a stage write at the same time although the stage
assembles one tensor after another; writers of different stages, and of tensors that need no
assembly, never wait for each other. Every shape in the walk is known from the plan, so the same
code runs on the meta device under torch's fake process group (as `fivefold dryrun` runs a
training step), where nothing has values and nothing is written. The number of elements each tensor received is checked once
at the end (one all-reduce per kind of assembly): a part written by two replicas, or by none, is
refused before anything is committed.

All writers write into `RUN_DIR/.tmp_final_weights/`; once every rank has succeeded (one
all-reduce), rank 0 writes the index and replaces the previous set (`sets.replace_set`). A full
disk or a failed writer leaves the previous final weights as they were. Like checkpoints, this
needs every rank to see the same run folder (a shared file system across nodes).

Why not stage through the checkpoint format (each rank writes its shards, writers then assemble
files from them with `regions.assemble`)? That writes the model to disk twice and reads it once
more, writes every replicated tensor from one rank only (with plain data parallelism, rank 0
writes the whole model alone), and needs the file system to carry what the network carries
faster. The walk above moves every split tensor once over the same links training uses (the
sum costs about what one ZeRO-3 forward's gathers cost) and writes it once.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Config, ModelConfig
from ..job.rundir import describe_write_error, write_errors
from ..model import Transformer
from ..model.init import canonical_name
from ..parallel import comm
from ..parallel.buckets import reduction_axis
from ..parallel.pipeline import stage_layer_ids
from ..parallel.sharding import Placement, ShardSpec, get_placement, repeats
from ..rules.layout import Coords, rank_to_coords
from ..rules.placement import placement_of, rank_of_stage
from .errors import CheckpointError
from .format import checkpoint_root, list_checkpoints
from .resume import agree_max
from .sets import (
    DEFAULT_MAX_FILE_BYTES,
    TensorFileWriter,
    TensorInfo,
    TensorSet,
    describe,
    file_names,
    replace_set,
    restore_interrupted_replace,
    set_metadata,
    split_into_files,
    write_index,
)
from .state import RUNTIME_BUFFERS

STAGING_DIR = ".tmp_final_weights"
# A pipeline stage's ranks are dp_cp x tp; these axes all lie within dp_cp (ep and edp split it,
# and so do the shard and replicate axes of hybrid sharding).
_WITHIN_DP_CP = ("dp_cp", "dp", "cp", "ep", "edp", "dp_cp_shard", "dp_cp_rep", "edp_shard", "edp_rep")


class FinalWeightsError(CheckpointError):
    """Final weights that could not be written; the previous ones are kept."""


# ----------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class FinalWeightsPlan:
    """What every rank agrees on before the walk: tensors in order, files, and their writers."""

    tensors: list[TensorInfo]
    owners: dict[str, int]  # tensor name -> the pipeline rank whose stage holds (or first holds) it
    files: list[list[TensorInfo]]
    writers: list[int]  # global rank writing each file
    file_of: dict[str, int]  # tensor name -> index of its file

    def writer_of(self, name: str) -> int:
        return self.writers[self.file_of[name]]

    @property
    def names(self) -> list[str]:
        return file_names(len(self.files))

    @property
    def largest_file_bytes(self) -> int:
        return max(sum(t.nbytes for t in members) for members in self.files)


def saved_tensors(model: ModelConfig) -> list[TensorInfo]:
    """The full model's parameters and persistent buffers, in module order (what a run saves)."""
    with torch.device("meta"):
        full = Transformer(model)
    return [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in full.state_dict(keep_vars=True).items()
            if not n.endswith(RUNTIME_BUFFERS)]


def pipeline_owners(config: Config) -> dict[str, int]:
    """The pipeline rank holding each tensor; a tied embedding belongs to the first stage's rank."""
    pp, ids = config.layout.pp, stage_layer_ids(config)
    placement = placement_of(config.layout.pp_schedule)
    owners: dict[str, int] = {}
    for stage, layer_ids in enumerate(ids):
        with torch.device("meta"):
            chunk = Transformer(config.model, layer_ids=layer_ids, with_embedding=stage == 0, with_head=stage == len(ids) - 1)
        for name in chunk.state_dict(keep_vars=True):
            owners.setdefault(canonical_name(name, config.model), rank_of_stage(stage, pp, placement))
    return owners


def plan_final_weights(config: Config, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> FinalWeightsPlan:
    tensors = saved_tensors(config.model)
    owners = pipeline_owners(config)
    files = split_into_files(tensors, max_file_bytes)
    layout = config.layout
    stage_ranks: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        stage_ranks.setdefault(rank_to_coords(rank, layout).pp, []).append(rank)
    given: Counter[int] = Counter()
    writers = []
    for members in files:
        by_stage: Counter[int] = Counter()
        for info in members:
            by_stage[owners[info.name]] += info.nbytes
        stage = min(by_stage, key=lambda s: (-by_stage[s], s))  # most of the file's bytes live there
        ranks = stage_ranks[stage]
        writers.append(ranks[given[stage] % len(ranks)])
        given[stage] += 1
    file_of = {info.name: i for i, members in enumerate(files) for info in members}
    return FinalWeightsPlan(tensors, owners, files, writers, file_of)


# ----------------------------------------------------------------------- this rank's tensors


@dataclass
class HeldTensor:
    """One full-model tensor as this rank holds it: the module's tensor and where it sits, and
    the optimizer's flat ranges of it when the optimizer holds the parameters (ZeRO-3)."""

    placement: Placement
    tensor: torch.Tensor
    flat_pieces: list[tuple[ShardSpec, torch.Tensor]] | None = None


def held_tensors(model: Any) -> dict[str, HeldTensor]:
    """Every tensor this rank holds a part of, by its full-model name."""
    config, optimizer = model.config.model, model.optimizer
    optimizer.wait_for_parameters()  # ZeRO-1/2 may still be gathering the last update
    owned = optimizer.owns_parameter_shards
    flat: dict[str, list[tuple[ShardSpec, torch.Tensor]]] = {}
    # Without ZeRO, an optimizer with fp32 masters (bf16 parameters) keeps each master whole, in
    # the parameter's own placement: the master is written in the parameter's place, as ZeRO's
    # flat masters are, so the final weights hold the same precision in every layout.
    masters: dict[str, torch.Tensor] = {}
    if owned:
        for states in optimizer.sharded_state().values():
            tensor, spec = states["param"]
            if isinstance(spec, ShardSpec):  # ZeRO's flat ranges
                flat.setdefault(canonical_name(spec.name, config), []).append((spec, tensor))
            else:
                masters[canonical_name(spec.name, config)] = tensor
    held: dict[str, HeldTensor] = {}
    for chunk in model.chunks:
        for name, param in chunk.named_parameters():
            placement = get_placement(param, name)
            full_name = canonical_name(placement.name, config)
            if full_name in masters:
                held[full_name] = HeldTensor(placement, masters[full_name])
            else:
                held[full_name] = HeldTensor(placement, param, flat.get(full_name, []) if owned else None)
        for name, buf in chunk.named_buffers():
            if not name.endswith(RUNTIME_BUFFERS):
                placement = get_placement(buf, name)
                held[canonical_name(placement.name, config)] = HeldTensor(placement, buf)
    return held


# ----------------------------------------------------------------------- assembling one tensor


@dataclass(frozen=True)
class Assembly:
    """How the ranks of a stage assemble one tensor: over which axes, and which parts count."""

    reduce: tuple[str, ...]  # axes summed over, in order ("dp_cp", "tp")
    repeats: dict[str, int]  # axis -> k: runs of k ranks hold the same part (a repeated kv head)
    padded_shape: tuple[int, ...]
    whole: bool  # every rank of the stage holds the tensor whole: nothing to assemble


def assembly_of(held: HeldTensor, mesh: Any) -> Assembly:
    """The same answer on every rank of a stage: it depends on the placement and the mesh only.

    The axes summed over are those of the stage (dp_cp, tp) whose ranks do not hold copies:
    the axes that split the tensor.
    """
    placement = held.placement
    over = placement.replicated_over
    if held.flat_pieces is not None:  # ZeRO-3: no longer a copy over the axis it shards over
        over = tuple(a for a in over if a != reduction_axis(placement))
    reduce = tuple(a for a in ("dp_cp", "tp") if a not in over and mesh[a].size > 1)
    padded = tuple(placement.padded_shape or placement.global_shape)
    _, shape = placement.box()
    whole = (not reduce and held.flat_pieces is None and padded == tuple(placement.global_shape)
             and tuple(shape) == padded)
    return Assembly(reduce, repeats(placement), padded, whole)


def contributes(assembly: Assembly, replicated_over: tuple[str, ...], mesh: Any) -> bool:
    """Whether this rank writes its part into the sum: the first of its copies inside the summed axes.

    Copies over an axis that is not summed (a tensor-parallel part replicated over dp_cp) are
    assembled by each replica group on its own, so each counts there.
    """
    inside = set(_WITHIN_DP_CP if "dp_cp" in assembly.reduce else ()) | ({"tp"} if "tp" in assembly.reduce else set())
    first_copy = all(mesh[a].rank == 0 for a in replicated_over if a in inside)
    first_repeat = all(mesh[a].rank % k == 0 for a, k in assembly.repeats.items() if a in inside)
    return first_copy and first_repeat


def place(buffer: torch.Tensor, spec: ShardSpec, part: torch.Tensor) -> None:
    """Copy a part (a box, or a flat range of a box) into the full-size buffer, on its device."""
    box = buffer[tuple(slice(o, o + n) for o, n in zip(spec.offsets, spec.shape))]
    part = part.detach().to(buffer.dtype)
    if spec.flat is None:
        box.copy_(part.reshape(box.shape))
        return
    start, length = spec.flat
    if box.is_contiguous():
        box.view(-1)[start : start + length].copy_(part.reshape(-1))
        return
    flat = box.contiguous()  # a flat range inside a box of a row-parallel split: via one box copy
    flat.view(-1)[start : start + length].copy_(part.reshape(-1))
    box.copy_(flat)


def assemble(info: TensorInfo, held: HeldTensor, model: Any) -> tuple[torch.Tensor, Assembly, int]:
    """The full tensor on this rank's device, its assembly, and the elements this rank put in."""
    mesh = model.mesh
    how = assembly_of(held, mesh)
    if how.whole:
        return held.tensor.detach().to(info.dtype), how, 0
    buffer = torch.full(how.padded_shape, -0.0, dtype=info.dtype, device=model.device)
    if held.flat_pieces is not None:
        parts = held.flat_pieces
    else:
        parts = [(ShardSpec.from_placement(held.placement), held.tensor)]
    written = 0
    for spec, part in parts:
        if contributes(how, spec.replicated_over, mesh):
            # ZeRO-3's parts are its fp32 masters: rounded as the parameters are (bf16 param_dtype),
            # the weights are the same whatever the layout.
            place(buffer, spec, part.to(held.tensor.dtype))
            written += part.numel()
    for axis in how.reduce:
        comm.all_reduce(buffer, mesh[axis])
    return buffer[tuple(slice(0, n) for n in info.shape)], how, written


# --------------------------------------------------------------------------------- the writers


class FileSink:
    """This rank's files, written by a thread of their own while the walk goes on.

    The walk hands each tensor over on the host (`write`); the thread appends it to its file,
    opened at its first tensor and flushed and closed at its last. At most `budget` bytes
    (one file's worth; a larger tensor alone) wait for the thread, so a rank holds at most
    that plus the tensor being assembled, and the writers of one stage write at the same time
    although the stage assembles one tensor after the other. After a failed write the thread
    drops what follows while the walk goes on (the other ranks' collectives need this rank);
    `finish` waits for the thread and says what went wrong.
    """

    def __init__(self, plan: FinalWeightsPlan, staging: Path, rank: int, step: int, budget: int) -> None:
        self.plan, self.staging, self.rank, self.step, self.budget = plan, staging, rank, step, budget
        self.failure = ""
        self._queue: deque[tuple[TensorInfo, torch.Tensor]] = deque()
        self._waiting = 0  # bytes handed over and not yet written
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="final-weights-writer", daemon=True)
        self._thread.start()

    def write(self, info: TensorInfo, value: torch.Tensor) -> None:
        host = value.detach().to("cpu")  # a device tensor reaches the host here, one at a time
        with self._changed:
            self._changed.wait_for(lambda: self._waiting == 0 or self._waiting + info.nbytes <= self.budget)
            self._queue.append((info, host))
            self._waiting += info.nbytes
            self._changed.notify_all()

    def finish(self) -> str:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        return self.failure

    def _run(self) -> None:
        current: TensorFileWriter | None = None
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    break
                info, host = self._queue[0]
            if not self.failure:
                current = self._append(current, info, host)
            with self._changed:
                self._queue.popleft()
                self._waiting -= info.nbytes
                self._changed.notify_all()
            del host
        if current is not None:  # a file left unfinished by a failure
            current.discard()

    def _append(self, current: TensorFileWriter | None, info: TensorInfo, host: torch.Tensor) -> TensorFileWriter | None:
        index = self.plan.file_of[info.name]
        try:
            if current is None:
                path = self.staging / self.plan.names[index]
                current = TensorFileWriter(path, self.plan.files[index], set_metadata(self.step))
            current.write(info.name, host)
            if current.done:
                current.close()
                current = None
        except Exception as err:  # noqa: BLE001 - reported to every rank by the walk's agreement
            self.failure = f"rank {self.rank} could not write {self.plan.names[index]} of the final weights: {_reason(err)}"
            if current is not None:
                current.discard()
            current = None
        return current


class DrySink:
    """On the meta device nothing has values: check what would be written, write nothing."""

    failure = ""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def write(self, info: TensorInfo, value: torch.Tensor) -> None:
        if value.device != self.device or tuple(value.shape) != info.shape or value.dtype != info.dtype:
            raise FinalWeightsError(f"{info.name} arrived as {value.dtype} {list(value.shape)} on {value.device}, "
                                    f"expected {info.dtype} {list(info.shape)} on {self.device}")

    def finish(self) -> str:
        return ""


# ------------------------------------------------------------------------------------- the walk


def _same_group_in_stage(rank: Coords, other: Coords) -> bool:
    return (rank.dp, rank.cp, rank.tp) == (other.dp, other.cp, other.tp)


def _hand_over(info: TensorInfo, value: torch.Tensor | None, owner: int, writer: int, model: Any) -> torch.Tensor | None:
    """The tensor at its writer: sent along the pipeline axis when the writer's stage does not hold it."""
    mesh = model.mesh
    to = rank_to_coords(writer, mesh.layout)
    if to.pp == owner:
        return value
    if mesh.rank == writer:
        value = torch.empty(info.shape, dtype=info.dtype, device=model.device)
        works = comm.send_recv(mesh.pp, recvs=[(value, owner)], op_name="final_weights")
    elif mesh.pp.rank == owner and _same_group_in_stage(mesh.coords, to):
        assert value is not None  # every rank of the owning stage assembled it
        works = comm.send_recv(mesh.pp, sends=[(value.contiguous(), to.pp)], op_name="final_weights")
    else:
        return None
    for work in works:
        work.wait()
    return value


def _check_counts(counts: dict[tuple[str, ...], list[tuple[TensorInfo, Assembly, int]]], model: Any, dry: bool) -> str:
    """Each tensor's assembling group received every element exactly once; else what went wrong."""
    for axes, entries in sorted(counts.items()):
        written = torch.tensor([n for _, _, n in entries], dtype=torch.int64, device=model.device)
        for axis in axes:
            comm.all_reduce(written, model.mesh[axis])
        if dry:  # no values on the meta device
            continue
        for (info, how, _), got in zip(entries, written.tolist()):
            expected = int(torch.Size(how.padded_shape).numel())
            if got != expected:
                return f"{info.name} was assembled from {got} elements, expected {expected}: parts overlap or are missing"
    return ""


def _walk(plan: FinalWeightsPlan, model: Any, sink: FileSink | DrySink) -> str:
    """Every tensor to its writer, in the plan's order; returns the first failure on this rank."""
    mesh, held = model.mesh, held_tensors(model)
    counts: dict[tuple[str, ...], list[tuple[TensorInfo, Assembly, int]]] = {}
    with torch.no_grad():
        for info in plan.tensors:
            owner, writer = plan.owners[info.name], plan.writer_of(info.name)
            value = None
            if mesh.pp.rank == owner:
                value, how, written = assemble(info, held[info.name], model)
                if not how.whole:
                    counts.setdefault(how.reduce, []).append((info, how, written))
            value = _hand_over(info, value, owner, writer, model)
            if mesh.rank == writer:
                assert value is not None
                sink.write(info, value)
            del value
    return sink.finish() or _check_counts(counts, model, isinstance(sink, DrySink))


def write_final_weights(model: Any, run_dir: Path, step: int, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Path | None:
    """Write the model's full weights into `run_dir` as a safetensors set recording `step`.

    Every rank calls this. Returns the set's head (model.safetensors or the index) on rank 0,
    None elsewhere and on the meta device (which has no values to write). Raises
    FinalWeightsError when any rank failed; the previous final weights are then untouched.
    """
    run_dir, mesh = Path(run_dir), model.mesh
    plan = plan_final_weights(model.config, max_file_bytes)
    if model.device.type == "meta":  # shapes only: the walk's collectives, nothing to write or agree on
        _walk(plan, model, DrySink(model.device))
        return None
    staging = run_dir / STAGING_DIR
    failure = _prepare_staging(run_dir, staging) if mesh.rank == 0 else ""
    if agree_max(1 if failure else 0, model):  # nobody writes before the staging folder exists
        raise FinalWeightsError(failure or "rank 0 could not prepare the final weights' folder")
    failure = _walk(plan, model, FileSink(plan, staging, mesh.rank, step, budget=plan.largest_file_bytes))
    failed = agree_max(mesh.rank + 1 if failure else 0, model)  # the last rank that failed, plus one
    if failed:
        _discard(staging, mesh.rank)
        raise FinalWeightsError(failure or f"rank {failed - 1} could not write its files of the final weights "
                                "(its own message says why)")
    if mesh.rank == 0:
        failure = _commit(plan, staging, run_dir, step)
    if agree_max(1 if failure else 0, model):
        _discard(staging, mesh.rank)
        raise FinalWeightsError(failure or "rank 0 could not commit the final weights")
    return run_dir / ("model.safetensors.index.json" if len(plan.files) > 1 else plan.names[0]) if mesh.rank == 0 else None


def _prepare_staging(run_dir: Path, staging: Path) -> str:
    try:
        restore_interrupted_replace(run_dir)
        shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted save
        staging.mkdir(parents=True)
    except Exception as err:  # noqa: BLE001 - every rank must learn of it (the agreement), not only rank 0
        return f"could not prepare {staging}: {_reason(err)}"
    return ""


def _commit(plan: FinalWeightsPlan, staging: Path, run_dir: Path, step: int) -> str:
    try:
        if len(plan.files) > 1:
            write_index(staging, plan.files, step)
        replace_set(staging, run_dir)
    except Exception as err:  # noqa: BLE001 - every rank must learn of it (the agreement), not only rank 0
        return f"could not commit the final weights in {run_dir}: {_reason(err)}"
    return ""


def _reason(err: Exception) -> str:
    return describe_write_error(err) if isinstance(err, write_errors()) else repr(err)


def _discard(staging: Path, rank: int) -> None:
    """Rank 0 removes the unfinished files (frees a full disk); no reader ever saw them."""
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)


def what_is_kept(run_dir: Path) -> str:
    """For a message after a failed save: the final weights and newest checkpoint the run still has."""
    try:
        previous = TensorSet.locate(run_dir)
        weights = (f"the previous final weights, {describe(previous)}, are kept" if previous
                   else "there are no earlier final weights")
    except CheckpointError:
        weights = "the earlier final weights are unreadable"
    found = list_checkpoints(checkpoint_root(run_dir))
    newest = f"the newest checkpoint is {found[0]}" if found else "there is no checkpoint (set checkpoint.interval)"
    return f"{weights}; {newest}"
