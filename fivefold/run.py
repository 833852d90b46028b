"""A whole training run: processes, data, the loop with progress and metrics, final weights."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import math
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .job.cluster import check_same_job, record_hosts
from .config import Config
from .data.sources import Sampler, TokenData
from .data.packing import data_position
from .rules.precision import PrecisionPolicy
from .rules.layout import validate
from .job.malloc import MallocState, apply_malloc
from .job.determinism import apply_determinism, runs_tf32, tf32
from .parallel.mesh import Mesh, device_for, unavailable_device
from .observe.metrics import (
    DTYPES,
    StepProfiler,
    machine_memory_bytes,
    peak_flops_for_log,
    rank_measurements,
)
from .parallel import comm
from .observe.prediction import check_drift, write_prediction
from .job.rundir import (
    RunFolderError,
    RunLock,
    claim,
    continues_a_checked_job,
    default_run_dir,
    supersede_metrics,
    write_json,
)
from .observe.timeline import trace_step
from .rules.flops import model_flops_per_token
from .rules.params import total_params
from .train import MetricsLog, build, evaluate, step_record, train_step


# The process group's own timeout only backs up the watchdog (which fires first, with a report),
# e.g. for group creation, which does not go through fivefold.parallel.comm.
PROCESS_GROUP_TIMEOUT_MARGIN_S = 30.0


def init_distributed(config: Config, device: torch.device | None = None) -> tuple[Mesh, torch.device]:
    """Join the torchrun job (if any) and build the mesh; NCCL on GPUs, gloo on CPUs.

    `device` replaces train.device's choice: the meta device, under a fake process group
    that a caller joined (see tests/parallel/test_device_discipline.py).
    """
    device = device or device_for(config.train.device)
    if config.layout.world_size == 1:
        return Mesh.single(config.layout, device.type), device
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=config.train.collective_timeout_s + PROCESS_GROUP_TIMEOUT_MARGIN_S)
        dist.init_process_group(backend=backend, timeout=timeout)
        check_same_job(config)  # before the mesh: nodes with other layouts would wait for each other's groups
    return Mesh.build(config.layout, device_type=device.type), device


class RunError(RuntimeError):
    """A run that had to stop; the message says why, and what was kept."""


@contextlib.contextmanager
def distributed_job(
    config: Config, flight_dir: Path, device: torch.device | None = None
) -> Iterator[tuple[Mesh, torch.device]]:
    """Join the job, watch its collectives, and leave it cleanly.

    The watchdog writes its flight record to $FIVEFOLD_FLIGHT_DIR when the launcher set it,
    else to `flight_dir`. A rank that finished waits for all others (a watched barrier, so
    no collective is in flight anywhere), stops the watchdog, destroys every process group
    and drops the mesh's references to them: the groups' gloo worker threads are joined
    here, while the interpreter is alive. Left to interpreter exit, they aborted finished
    jobs ("terminate called without an active exception"). After an exception the peers
    may never reach the barrier: a collective that failed because a peer went away ends the
    rank with its flight record and one line (no traceback); any other error keeps its
    traceback. A process group that was there before (a test harness's, a caller's own) is
    the caller's to keep: only one this call joined is destroyed.
    """
    owns_process_group = not dist.is_initialized()
    mesh, device = init_distributed(config, device)
    if not mesh.is_distributed:
        yield mesh, device
        return
    from .parallel import comm

    folder = Path(os.environ.get(comm.FLIGHT_DIR_ENV) or flight_dir)
    watchdog = comm.CollectiveWatchdog(mesh.stats.flight, mesh.rank, config.train.collective_timeout_s, folder).start()
    try:
        yield mesh, device
    except BaseException as err:
        watchdog.stop()
        watchdog.end_if_peer_lost(err)
        raise
    comm.barrier(mesh.world)
    watchdog.stop()
    if owns_process_group:
        dist.destroy_process_group()
        mesh.release()
        gc.collect()  # the groups (held in reference cycles through the model too) and their threads, now


def new_run_dir(config: Config) -> Path:
    if config.train.run_dir:
        return Path(config.train.run_dir)
    return default_run_dir(config.model.name)


def save_final_weights(model, run_dir: Path, config: Config, step: int) -> Path | None:
    """The end of a run: the full weights after `step` steps as a safetensors set, then config.json.

    Every rank calls this and writes its share (fivefold/checkpoint/final.py: no rank gathers
    the model). Returns the set's head on rank 0 (None elsewhere, and on the meta device,
    where nothing has values). A failed write keeps the previous final weights and says so.
    """
    from .checkpoint import FinalWeightsError, what_is_kept, write_final_weights

    try:
        path = write_final_weights(model, run_dir, step)
    except FinalWeightsError as err:
        raise RunError(f"{err}; {what_is_kept(run_dir)}") from None
    if path is not None:
        write_json(run_dir / "config.json", config.to_dict())
    return path


def check_machine(config: Config) -> None:
    """What the layout alone cannot tell: the device exists, and the training state can fit.

    The state is fp32 weights, gradients and Adam moments (sharded at best over all ranks,
    which on this many machines still share their memory): a lower bound, so a refusal here
    is a run that could never start, not a guess.
    """
    device = config.train.device
    missing = unavailable_device(device)
    if missing:
        raise RunError(f"train.device={device} but {missing}; use train.device=cpu or auto")
    check_gpus_per_host(config)
    machines = max(int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    params = total_params(config.model)
    policy = PrecisionPolicy.from_train(config.train)  # the run's own bytes per parameter
    needed = params * (policy.param_bytes + policy.grad_bytes + policy.optimizer_bytes())
    available, what = machine_memory_bytes(device)
    if needed > available * machines:
        m = config.model
        raise RunError(
            f"the model (model.hidden={m.hidden}, model.layers={m.layers}, model.vocab_size={m.vocab_size}, "
            f"model.num_experts={m.num_experts}) has {params:,} parameters; their weights, gradients and "
            f"optimizer state ({policy.name}) need {_gb(needed)}, but {machines} machine(s) with {_gb(available)} of {what} each "
            "cannot hold them; choose a smaller model"
        )


def ranks_on_this_host(config: Config) -> int:
    """Ranks of the job that run on this machine: torchrun's per-node count when it started us,
    else every rank of the layout (the built-in launcher starts them all here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", config.layout.world_size))


def check_gpus_per_host(config: Config) -> None:
    """Each rank of a GPU run needs a GPU of its own: NCCL cannot put two ranks on one device,
    and rank r on a host uses cuda:r (LOCAL_RANK), which must exist."""
    if device_for(config.train.device).type != "cuda":
        return
    ranks, gpus = ranks_on_this_host(config), torch.cuda.device_count()
    if ranks > gpus:
        raise RunError(
            f"the layout runs {ranks} ranks on this machine but it has {gpus} GPU(s), and each rank needs "
            f"its own GPU (NCCL cannot share one); use --train.device cpu, or a layout of at most {gpus} "
            "ranks per machine"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),  # text: "-" until the first step has a loss
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def add_train_task(progress: Any, total: int, start: int) -> Any:
    """The bar of steps start..total; its loss reads "-" until the first step has one."""
    return progress.add_task("train", total=total, completed=start, loss="-", tps=0.0)


def resume_step(model, config: Config, run_dir: Path) -> int:
    """With checkpoint.resume, load the newest usable checkpoint of the run; the step to start at.

    The metrics rows of the steps from there on are dropped: they are trained again (a run that
    stopped or crashed after its last checkpoint), and metrics.jsonl never repeats a step.
    """
    if not config.checkpoint.resume:
        return 0
    from .checkpoint import checkpoint_root, resume_newest

    root = checkpoint_root(run_dir)
    step, loaded = resume_newest(model, root)
    if model.mesh.rank == 0:  # step 0 is a checkpoint too: the weights `convert import` wrote
        print(f"resuming at step {step} from {loaded}" if loaded else f"no checkpoint in {root}: starting at step 0")
        dropped = supersede_metrics(run_dir, step)
        if dropped:
            print(f"note: {dropped} metrics.jsonl rows of steps from {step} on are superseded by this run")
    return step


def check_steps_left(config: Config) -> None:
    """Refuse to resume a run whose weights already hold train.steps steps: it would train nothing
    (or, without a checkpoint, train again from step 0) and log its steps a second time."""
    if not config.checkpoint.resume or not config.train.run_dir:
        return
    from .checkpoint import steps_trained

    done = steps_trained(Path(config.train.run_dir))
    if done and done >= config.train.steps:
        raise RunFolderError(
            f"the run in {config.train.run_dir} has finished {done} steps (train.steps={config.train.steps}); "
            f"to continue it give --train.steps N with N larger than {done}"
        )


def checkpoint_due(config: Config, steps_done: int) -> bool:
    interval = config.checkpoint.interval
    return bool(interval) and (steps_done % interval == 0 or steps_done == config.train.steps)


def save_step(model, config: Config, run_dir: Path, steps_done: int) -> None:
    from .checkpoint import CheckpointError, checkpoint_root, list_checkpoints, save_checkpoint

    root = checkpoint_root(run_dir)
    try:
        path = save_checkpoint(model, steps_done, root, keep=config.checkpoint.keep)
    except CheckpointError as err:
        found = list_checkpoints(root)
        kept = f"the previous checkpoint, {found[0]}, is kept" if found else "no earlier checkpoint exists"
        raise RunError(f"{err}; {kept}") from None
    if model.mesh.rank == 0:
        print(f"checkpoint {path}")


def load_data(config: Config) -> tuple[TokenData, Sampler]:
    from .data.loader import open_training_data

    return open_training_data(config)


def finite_or_null(value: Any) -> Any:
    """A metrics value with every NaN or infinity replaced by None (JSON null): metrics.jsonl stays JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def check_finite(record: dict, config: Config, run_dir: Path) -> None:
    """Stop the run at the first step whose loss or gradient norm is NaN or infinite.

    Both are all-reduced, so every rank sees the same value and stops at the same step; the
    step's update is not checkpointed, so the newest checkpoint is the last good state.
    """
    bad = [key for key in ("loss", "grad_norm") if not math.isfinite(record[key])]
    if not bad:
        return
    from .checkpoint import checkpoint_root, list_checkpoints

    found = list_checkpoints(checkpoint_root(run_dir))
    kept = f"the last good checkpoint, {found[0]}, is kept" if found else "no checkpoint was written before it"
    values = ", ".join(f"{key} {record[key]}" for key in bad)
    raise RunError(
        f"training diverged at step {record['step']} ({values}); stopped without saving that step, {kept}. "
        f"Lower train.lr (now {config.train.lr}) or set train.grad_clip (now {config.train.grad_clip}), "
        "then continue with --resume"
    )


def train_steps(model, config: Config, data: TokenData, sampler: Sampler, run_dir: Path, start: int, log, progress,
                prediction: dict | None = None) -> tuple[list[dict], int]:
    """Steps start..steps-1, checkpointing on schedule and on SIGTERM or Ctrl-C.

    Returns (records, the signal that stopped the run early after its checkpoint, else 0); a
    rank stopped because another rank was signalled reports SIGTERM, which the launcher sends."""
    from .checkpoint import StopRequest

    records, stop, stopping = [], StopRequest(), False
    flops_per_token = model_flops_per_token(config.model, config.train.seq_len)
    peak = peak_flops_for_log(DTYPES[config.train.dtype], model.device, model.mesh.world_size)  # ~0.2 s, once
    device = model.device
    profiler = StepProfiler(config.train.profile, run_dir, model.mesh.rank, device, config.train.steps)
    task = add_train_task(progress, config.train.steps, start)
    try:
        traced_step = min(max(start, 2), config.train.steps - 1) if config.train.trace else -1  # after warm-up
        for step in range(start, config.train.steps):
            with trace_step(model, run_dir, enabled=step == traced_step), profiler.step(step):
                result = train_step(model, sampler, step, measure_held=step == start)
            record = step_record(result, flops_per_token, peak)
            record.update(rank_measurements(model, result, device, with_held=step == start))
            if config.train.eval_interval and (step + 1) % config.train.eval_interval == 0:
                record["val_loss"] = evaluate(model, data, config.train.eval_batches)
            records.append(record)
            log.write(finite_or_null(record))
            check_finite(record, config, run_dir)
            if prediction is not None:
                check_drift(prediction, records, config.train.drift_margin, config.train.steps - start)
            progress.update(task, advance=1, loss=f"{result.loss:.4f}", tps=record["tokens_per_s"])
            stopping = stop.agreed(model)
            if checkpoint_due(config, step + 1) or stopping:
                save_step(model, config, run_dir, step + 1)
            if stopping:
                break
    finally:
        stop.close()
    return records, (stop.signum or signal.SIGTERM) if stopping else 0


def claim_run_dir(run_dir: Path, config: Config, mesh: Mesh, device: torch.device, overwrite: bool) -> RunLock | None:
    """Rank 0 locks the run folder and checks what it holds; every rank learns whether that worked."""
    lock, failure = None, None
    if mesh.rank == 0:
        try:
            lock = claim(run_dir, config.checkpoint.resume, overwrite, check=not continues_a_checked_job())
        except ValueError as err:
            failure = err
    flag = torch.tensor([1.0 if failure else 0.0], device=device)
    comm.all_reduce(flag, mesh.world, op="max")
    if failure is not None:
        raise failure
    if flag.item():
        raise RunError(f"rank 0 could not use run folder {run_dir}; see its message")
    return lock


def record_malloc(run_dir: Path, state: MallocState, mesh: Mesh) -> None:
    """malloc.json in the run folder: the allocator setting each rank runs under and whether it
    took effect there (ranks on other machines may have another C library)."""
    states: list[Any] = [state.to_dict()]
    if mesh.is_distributed:
        states = [None] * mesh.world_size
        dist.all_gather_object(states, state.to_dict())
    if mesh.rank == 0:
        write_json(run_dir / "malloc.json", [{"rank": rank} | s for rank, s in enumerate(states)])
        if state.setting != "default" or not state.in_effect:
            print(f"malloc={state.setting}: {state.detail}")


class TrainedRecords(list):
    """The per-step records of a run, and `stopped_by`: the signal (SIGTERM, SIGINT) that stopped
    it after a checkpoint, 0 when it ran to its last step. A list, so callers that only want the
    records need not know."""

    def __init__(self, records: list[dict], stopped_by: int = 0) -> None:
        super().__init__(records)
        self.stopped_by = stopped_by


def run_training(
    config: Config, run_dir: Path | None = None, show_progress: bool = True, overwrite: bool = False,
    device: torch.device | None = None,
) -> TrainedRecords:
    """Train `config` on this process's part of the layout; returns the per-step records.

    `overwrite` replaces a previous run in `run_dir`; without it (or checkpoint.resume) a
    folder that holds anything is refused. `device` replaces train.device's choice (see
    `init_distributed`).
    """
    config = validate(config, int(os.environ.get("WORLD_SIZE", config.layout.world_size)))
    check_machine(config)
    malloc = apply_malloc(config.train.malloc)  # before the model and the data are allocated
    apply_determinism(config.train.deterministic)  # before CUDA starts: cuBLAS reads its workspace setting once
    run_dir = Path(run_dir or new_run_dir(config))
    with distributed_job(config, run_dir / "flight_records", device) as (mesh, device):
        lock = claim_run_dir(run_dir, config, mesh, device, overwrite)
        try:
            with tf32(runs_tf32(config.train.dtype, device.type, config.train.deterministic)):
                return _train_in(config, run_dir, mesh, device, malloc, show_progress)
        finally:
            if lock is not None:
                lock.release()


def _train_in(
    config: Config, run_dir: Path, mesh: Mesh, device: torch.device, malloc: MallocState, show_progress: bool
) -> TrainedRecords:
    torch.manual_seed(config.train.seed)
    data, sampler = load_data(config)
    model = build(config, mesh, device)
    model.data_position = functools.partial(data_position, sampler)  # recorded in checkpoints
    is_main = mesh.rank == 0
    for note in getattr(data, "notes", []) if is_main else []:
        print(f"note: {note}")
    start = resume_step(model, config, run_dir)  # before anything is written to the run directory
    log = MetricsLog(run_dir, enabled=is_main)
    if is_main:
        write_json(run_dir / "config.json", config.to_dict())
    record_malloc(run_dir, malloc, mesh)
    prediction = write_prediction(config, device, run_dir) if is_main else None
    record_hosts(run_dir, is_main)
    try:
        with _progress(is_main and show_progress, config.train.steps) as progress:
            records, stopped_by = train_steps(model, config, data, sampler, run_dir, start, log, progress, prediction)
        path = None if stopped_by else save_final_weights(model, run_dir, config, max(start, config.train.steps))
    finally:
        log.close()
    if is_main and records:
        first, last = records[0]["loss"], records[-1]["loss"]
        where = (f"weights: {path}" if path else f"stopped by {signal.Signals(stopped_by).name} after a checkpoint"
                 if stopped_by
                 else f"no weights written: nothing has values on the {device} device")
        print(f"loss {first:.4f} -> {last:.4f} in {len(records)} steps; {where}; metrics: {log.path}")
    return TrainedRecords(records, stopped_by)
