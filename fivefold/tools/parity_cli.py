"""`fivefold parity --layout "dp=2,tp=2,pp=2" [--steps K] [--config tiny]`.

Trains the single-process reference (in this process) and the layout (ranks started by
fivefold.job.launch),
prints the per-step loss difference and, when a tolerance is exceeded, names the first
module whose forward output or parameter gradient differs and by how much.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from ..config import Config
from ..job.launch import Job, run_job
from ..rules.layout import config_from_args, validate
from ..parallel.mesh import Mesh, device_for
from .parity import compare, reference_config, train_trace


def reference_file(config: Config, steps: int, path: Path) -> None:
    """Train and probe the reference; save what the ranks compare against (tensors only)."""
    from .diagnose import probe

    ref = validate(reference_config(config))
    device_type = device_for(config.train.device).type  # the layout's device: same kernels on both sides
    trace = train_trace(ref, Mesh.single(ref.layout, device_type), steps)
    outputs, grads = probe(ref, Mesh.single(ref.layout, device_type))
    torch.save(
        {
            "losses": torch.tensor(trace.losses, dtype=torch.float64),
            "params": trace.params,
            "outputs": outputs,
            "grads": grads,
        },
        path,
    )


def print_losses(ref_losses: list[float], losses: list[float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per-step loss: layout vs single process")
    for col in ("step", "reference", "layout", "|diff|"):
        table.add_column(col, justify="right")
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        table.add_row(str(step), f"{a:.8f}", f"{b:.8f}", f"{abs(a - b):.2e}")
    Console().print(table)


def check_layout(config: Config, mesh: Mesh, steps: int, ref_path: Path) -> int:
    """Run on every rank: train the layout, compare with the reference, locate a divergence."""
    from .diagnose import first_divergence, probe, stream_module_names
    from .parity import TrainTrace

    saved = torch.load(ref_path, weights_only=True, map_location=mesh.device)
    reference = TrainTrace(saved["losses"].tolist(), [], [], saved["params"])
    trace = train_trace(config, mesh, steps)
    report = compare(reference, trace) if mesh.rank == 0 else None
    diverged = torch.tensor([0 if report is None or report.ok else 1], device=mesh.device)
    if mesh.world.size > 1:
        from ..parallel import comm

        comm.all_reduce(diverged, mesh.world)
    if report is not None:  # rank 0
        print_losses(reference.losses, trace.losses)
        print(report.summary())
    if not int(diverged):
        return 0
    outputs, grads = probe(config, mesh)
    if mesh.rank == 0:
        found = first_divergence(saved["outputs"], outputs, saved["grads"], grads, stream_module_names(config))
        print(found.describe() if found else "no module-level difference found in step 0; the difference starts later")
    return 1


def run_parity_cli(args: argparse.Namespace, overrides: list[str]) -> int:

    from ..run import RunError, check_machine

    config = validate(config_from_args(args.config, args.layout, overrides))
    try:
        check_machine(config)  # the device exists, each rank has a GPU of its own: before anything starts
    except RunError as err:
        print(f"fivefold: error: {err}", file=sys.stderr)
        return 2
    world = config.layout.world_size
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = Path(tmp) / "reference.pt"
        print(f"training the single-process reference for {args.steps} steps ...")
        reference_file(config, args.steps, ref_path)
        if world == 1:
            return check_layout(config, Mesh.single(config.layout, device_for(config.train.device).type), args.steps, ref_path)
        print(f"training layout {args.layout} on {world} processes ...")
        job = Job(
            world_size=world,
            command=("-m", "fivefold.tools.parity_cli", str(ref_path), str(args.steps), args.config, args.layout, *overrides),
            max_restarts=config.train.max_restarts,
            collective_timeout_s=config.train.collective_timeout_s,
            stop_grace_s=config.train.stop_grace_s,
            flight_dir=Path(tmp) / "flight_records",
        )
        return 1 if run_job(job) else 0


def _worker_main(argv: list[str]) -> int:
    """Entry point of each torchrun rank: reference path, steps, config, layout, overrides."""
    from ..run import distributed_job

    ref_path, steps, config_name, layout, *overrides = argv
    config = validate(config_from_args(config_name, layout, overrides), int(os.environ["WORLD_SIZE"]))
    with distributed_job(config, Path(ref_path).parent / "flight_records") as (mesh, _):
        return check_layout(config, mesh, int(steps), Path(ref_path))


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
