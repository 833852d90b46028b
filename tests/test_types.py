"""The optimizer and gradient-synchroniser protocols hold: mypy checks them, their
implementations and their callers, and finds no error.

Checked (errors reported): the modules in CHECKED and this file, whose `_conformance`
function assigns every implementation to the protocol it must satisfy. Modules they import
are analysed for their types (so an implementation that drifts from its protocol fails
here) without reporting errors of their own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

from fivefold.held_memory import HoldsTensors
from fivefold.parallel.data_parallel import BucketAllReduce, DataParallelAdamW, FlatSynchroniser
from fivefold.parallel.optim import LocalGradients, ReplicatedAdamW
from fivefold.parallel.protocols import CheckpointState, GradientSynchroniser, TrainingOptimizer
from fivefold.parallel.zero import ZeroAdamW, ZeroGradientSync

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [
    "fivefold/parallel/protocols.py",  # the protocols
    "fivefold/parallel/optim.py",  # ReplicatedAdamW, LocalGradients, the AdamW arithmetic
    "fivefold/parallel/data_parallel.py",  # BucketAllReduce, FlatAdamW, DataParallelAdamW
    "fivefold/parallel/zero.py",  # ZeroGradientSync, ZeroAdamW, the parameter gatherer
    "fivefold/parallel/pipeline.py",  # the runner registers no finalizer of its own; W steps
    "fivefold/parallel/schedules.py",  # the schedule tables and their simulator
    "fivefold/parallel/comm.py",  # every collective
    "fivefold/checkpoint",  # calls CheckpointState directly
    "fivefold/tools/timeline.py",  # reads the pipeline runner
    "fivefold/parallelize.py",  # builds the optimizer, registers the finalizers, ParallelModel
    "fivefold/train.py",  # the loop
    "fivefold/held_memory.py",  # held_tensors / padding_bytes
    "fivefold/tools/diagnose.py",  # gathers gradients after finish_grad_sync
    "tests/test_types.py",  # the conformance assignments below
]


def _conformance(
    replicated: ReplicatedAdamW, data_parallel: DataParallelAdamW, zero: ZeroAdamW
) -> None:
    """Never run: mypy verifies that each implementation satisfies each protocol it claims."""
    optimizers: list[TrainingOptimizer] = [replicated, data_parallel, zero]
    checkpointed: Sequence[CheckpointState] = optimizers
    measured: list[HoldsTensors] = [replicated, data_parallel, zero, replicated.sync, data_parallel.sync, zero.sync]
    synchronisers: list[GradientSynchroniser] = [replicated.sync, data_parallel.sync, zero.sync]
    local: GradientSynchroniser = LocalGradients([])
    flat: list[FlatSynchroniser] = [data_parallel.sync, zero.sync]
    flat_classes: list[type[FlatSynchroniser]] = [BucketAllReduce, ZeroGradientSync]
    del optimizers, checkpointed, measured, synchronisers, local, flat, flat_classes


def test_protocols_and_their_users_type_check():
    command = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
               "--no-error-summary", "--hide-error-context", *CHECKED]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
