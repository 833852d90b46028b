"""Deterministic kernels and fp32 matmul precision as process-wide run settings.

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

import contextlib
import os
from typing import Iterator

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


def runs_tf32(dtype: str, device_type: str, deterministic: bool) -> bool:
    """Whether a run's fp32 matmuls use TF32: fp32 runs on CUDA, unless `train.deterministic`.

    TF32 keeps fp32's range with a 10-bit mantissa and is what GPU users run fp32 at (several
    times the ieee matmul rate on tensor cores); bf16 runs gain nothing from it. A deterministic
    run keeps ieee fp32, so its bits can also be compared with the CPU's and other GPUs'.
    """
    return dtype == "fp32" and device_type == "cuda" and not deterministic


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """fp32 matmuls in TF32 (or ieee fp32) inside the block, the previous setting restored after.
    torch replaced `allow_tf32` by `fp32_precision` (2.9); mixing the two is an error in later
    releases, so the newer switch is used wherever it exists."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
        return
    before_flag = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = before_flag
