"""A whole training run: processes, data, the loop with progress and metrics, final weights."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .config import Config
from .data import Sampler, TokenData, load_tokenizer, load_tokens
from .layout import validate
from .mesh import Mesh, device_for
from .metrics import DTYPES, model_flops_per_token, peak_flops_for_log
from .timeline import trace_step
from .train import MetricsLog, build, evaluate, step_record, train_step


# The process group's own timeout only backs up the watchdog (which fires first, with a report),
# e.g. for group creation, which does not go through fivefold.parallel.comm.
PROCESS_GROUP_TIMEOUT_MARGIN_S = 30.0


def init_distributed(config: Config) -> tuple[Mesh, torch.device]:
    """Join the torchrun job (if any) and build the mesh; NCCL on GPUs, gloo on CPUs."""
    device = device_for(config.train.device)
    if config.layout.world_size == 1:
        return Mesh.single(config.layout), device
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=config.train.collective_timeout_s + PROCESS_GROUP_TIMEOUT_MARGIN_S)
        dist.init_process_group(backend=backend, timeout=timeout)
    return Mesh.build(config.layout, device_type=device.type), device


@contextlib.contextmanager
def distributed_job(config: Config, flight_dir: Path) -> Iterator[tuple[Mesh, torch.device]]:
    """Join the job, watch its collectives, and leave it cleanly.

    The watchdog writes its flight record to $FIVEFOLD_FLIGHT_DIR when the launcher set it,
    else to `flight_dir`. A rank that finished waits for all others (a watched barrier, so
    no collective is in flight anywhere), stops the watchdog, destroys every process group
    and drops the mesh's references to them: the groups' gloo worker threads are joined
    here, while the interpreter is alive. Left to interpreter exit, they aborted finished
    jobs ("terminate called without an active exception"). After an exception the peers
    may never reach the barrier: a collective that failed because a peer went away ends the
    rank with its flight record and one line (no traceback); any other error keeps its
    traceback.
    """
    mesh, device = init_distributed(config)
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
    dist.destroy_process_group()
    mesh.release()
    gc.collect()  # the groups (held in reference cycles through the model too) and their threads, now


def new_run_dir(config: Config) -> Path:
    if config.train.run_dir:
        return Path(config.train.run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.model.name}-{stamp}"


def save_final_weights(model, run_dir: Path, config: Config) -> Path | None:
    """Gather the full model and write model.safetensors + config.json (rank 0)."""
    from safetensors.torch import save_file

    full = model.full_parameters()
    if model.mesh.rank != 0:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "model.safetensors"
    save_file({k: v.contiguous() for k, v in full.items()}, str(path))
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def resume_step(model, config: Config, run_dir: Path) -> int:
    """With checkpoint.resume, load the newest usable checkpoint of the run; the step to start at."""
    if not config.checkpoint.resume:
        return 0
    from .checkpoint import checkpoint_root, resume_latest

    step = resume_latest(model, checkpoint_root(run_dir))
    if model.mesh.rank == 0:
        print(f"resuming at step {step}" if step else f"no checkpoint in {checkpoint_root(run_dir)}: starting at step 0")
    return step


def checkpoint_due(config: Config, steps_done: int) -> bool:
    interval = config.checkpoint.interval
    return bool(interval) and (steps_done % interval == 0 or steps_done == config.train.steps)


def save_step(model, config: Config, run_dir: Path, steps_done: int) -> None:
    from .checkpoint import checkpoint_root, save_checkpoint

    path = save_checkpoint(model, steps_done, checkpoint_root(run_dir), keep=config.checkpoint.keep)
    if model.mesh.rank == 0:
        print(f"checkpoint {path}")


def load_data(config: Config) -> tuple[TokenData, Sampler]:
    tokenizer = load_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={config.model.vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    data = load_tokens(config.data, tokenizer)
    return data, Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)


def train_steps(model, config: Config, data: TokenData, sampler: Sampler, run_dir: Path, start: int, log, progress) -> tuple[list[dict], bool]:
    """Steps start..steps-1, checkpointing on schedule and on SIGTERM. Returns (records, stopped early)."""
    from .checkpoint import StopRequest, kill_hook_for_tests

    records, stop, stopping = [], StopRequest(), False
    flops_per_token = model_flops_per_token(config.model, config.train.seq_len)
    peak = peak_flops_for_log(DTYPES[config.train.dtype], model.extras["device"], model.mesh.world_size)  # ~0.2 s, once
    task = progress.add_task("train", total=config.train.steps, completed=start, loss=float("nan"), tps=0.0)
    try:
        traced_step = min(max(start, 2), config.train.steps - 1) if config.train.trace else -1  # after warm-up
        for step in range(start, config.train.steps):
            with trace_step(model, run_dir, enabled=step == traced_step):
                result = train_step(model, sampler, step)
            record = step_record(result, flops_per_token, peak)
            if config.train.eval_interval and (step + 1) % config.train.eval_interval == 0:
                record["val_loss"] = evaluate(model, data, config.train.eval_batches)
            records.append(record)
            log.write(record)
            progress.update(task, advance=1, loss=result.loss, tps=record["tokens_per_s"])
            kill_hook_for_tests(step + 1)
            stopping = stop.agreed(model)
            if checkpoint_due(config, step + 1) or stopping:
                save_step(model, config, run_dir, step + 1)
            if stopping:
                break
    finally:
        stop.close()
    return records, stopping


def run_training(config: Config, run_dir: Path | None = None, show_progress: bool = True) -> list[dict]:
    """Train `config` on this process's part of the layout; returns the per-step records."""
    config = validate(config, int(os.environ.get("WORLD_SIZE", config.layout.world_size)))
    run_dir = run_dir or new_run_dir(config)
    with distributed_job(config, run_dir / "flight_records") as (mesh, device):
        torch.manual_seed(config.train.seed)
        data, sampler = load_data(config)
        model = build(config, mesh, device)
        is_main = mesh.rank == 0
        start = resume_step(model, config, run_dir)  # before anything is written to the run directory
        log = MetricsLog(run_dir, enabled=is_main)
        if is_main:
            (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        with _progress(is_main and show_progress, config.train.steps) as progress:
            records, stopped = train_steps(model, config, data, sampler, run_dir, start, log, progress)
        path = None if stopped else save_final_weights(model, run_dir, config)
        log.close()
    if is_main and records:
        first, last = records[0]["loss"], records[-1]["loss"]
        where = f"weights: {path}" if path else "stopped by SIGTERM after a checkpoint"
        print(f"loss {first:.4f} -> {last:.4f} in {len(records)} steps; {where}; metrics: {log.path}")
    return records
