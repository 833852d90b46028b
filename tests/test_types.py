"""The optimizer and gradient-synchroniser protocols hold: mypy checks them, their
implementations and their callers, and finds no error.

Checked (errors reported): the whole fivefold package and this file, whose `_conformance`
function assigns every implementation to the protocol it must satisfy. Third-party modules
are analysed for their types without reporting errors of their own, except transformers and
deepspeed, which pyproject.toml's [tool.mypy] tells mypy not to follow (analysing
transformers alone more than doubles the check's time; fivefold calls them in few places).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

from fivefold.parallel.data_parallel import BucketAllReduce, DataParallelAdamW
from fivefold.parallel.flat_adamw import FlatSynchroniser
from fivefold.parallel.optim import LocalGradients, ReplicatedAdamW
from fivefold.parallel.protocols import CheckpointState, GradientSynchroniser, HoldsTensors, TrainingOptimizer
from fivefold.parallel.zero import ZeroAdamW, ZeroStage1Sync, ZeroStage2Sync, ZeroStage3Sync

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [
    "fivefold",  # the whole package: the protocols, their implementations and every caller
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
    flat_classes: list[type[FlatSynchroniser]] = [BucketAllReduce, ZeroStage1Sync, ZeroStage2Sync, ZeroStage3Sync]
    del optimizers, checkpointed, measured, synchronisers, local, flat, flat_classes


def test_protocols_and_their_users_type_check():
    command = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
               "--no-error-summary", "--hide-error-context", *CHECKED]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
