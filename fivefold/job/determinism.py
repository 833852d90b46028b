"""Deterministic kernels as a process-wide run setting (`train.deterministic`).

Two runs of the same config on the same machine give the same losses bit for bit only when
every kernel sums in a fixed order. On CUDA, some kernels (atomics in index_add, scatter_add,
some convolution and attention backward paths) and cuBLAS's split-K workspaces do not. torch
switches to deterministic implementations, or raises naming the operation that has none,
under `torch.use_deterministic_algorithms(True)`; cuBLAS needs `CUBLAS_WORKSPACE_CONFIG` set
before it creates its first handle, so this runs before the model is built, in every rank.
On CPU, torch's kernels are already deterministic for a fixed number of threads: the setting
changes nothing there but the check for operations without a deterministic version.
"""

from __future__ import annotations

import os

import torch

# cuBLAS's documented deterministic workspace settings: 8 buffers of 4 MiB (or of 16 KiB).
CUBLAS_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def apply_determinism(enabled: bool) -> bool:
    """Make this process deterministic when `enabled`; returns whether it now is.

    A user's own deterministic cuBLAS workspace setting is kept; any other value is replaced,
    since it would make cuBLAS non-deterministic while torch believes it is not.
    """
    if not enabled:
        return torch.are_deterministic_algorithms_enabled()
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACES[0]
    torch.use_deterministic_algorithms(True)
    return True
