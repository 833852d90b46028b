"""Model FLOPs, model FLOPs utilisation (MFU) and a measured matmul peak.

Model FLOPs per token follow PaLM's definition, 6 N + 12 L H Q T, written once in
`fivefold.rules.flops` (the planner's MFU uses the same count).

    MFU = tokens/s * model FLOPs per token / peak FLOP/s

where tokens/s and the peak refer to the same devices (divide by the number of devices, or
multiply the peak by it). On CPUs there is no datasheet peak worth the name, so fivefold
uses the FLOP/s of a large GEMM measured on the same machine (`measure_matmul_flops`): an
achievable peak, which makes a CPU MFU an upper-bound-style ratio rather than a datasheet one.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .._moved import moved_names
from ..planner.hardware import matmul_operands, measure_matmul_flops  # noqa: F401  (one measurement, re-exported)
from ..rules.volumes import planner_axis_bytes

__getattr__ = moved_names(__name__, {
    "parameter_count": "fivefold.rules.params:total_params", "moe_layer_count": "fivefold.rules.params",
    **{name: "fivefold.rules.flops" for name in (
        "active_params_per_token", "attention_flops_per_token", "model_flops_per_token")},
})

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.dtype -> matmul dtype


def machine_memory_bytes(device: str = "cpu") -> tuple[int, str]:
    """Memory one machine offers a run, and what it is: the memory of its GPUs, or its RAM."""
    import os

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        count = torch.cuda.device_count()
        total = sum(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return total, f"{count} GPU(s)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak FLOP/s of the same devices."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops_for_log(dtype: torch.dtype, device: torch.device, world_size: int) -> float:
    """A cheap (~0.2 s) measured peak of all `world_size` devices, for the MFU of training logs.

    A 512-cube GEMM on CPU (quick even on a loaded machine), 4096 on accelerators (large
    enough to reach their matmul peak). Measured while the machine does whatever else it
    does, so on a shared CPU the logged MFU is indicative; `fivefold bench single`
    measures the peak alongside the model for a stated number.
    """
    size = 512 if device.type == "cpu" else 4096
    return world_size * measure_matmul_flops(dtype, size=size, seconds=0.2, device=device)


# ------------------------------------------------------------------ measured per step, per rank


class PhaseClock:
    """Wall time of the consecutive phases of a step: `lap(name)` closes the phase running since
    the previous lap. On CUDA each lap synchronises the device first, so a phase is charged with
    its own kernels rather than with whatever the next blocking call waits for.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        _sync(self.device)
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: the CUDA allocator's peak on GPUs, peak RSS on CPU.

    RSS includes the Python interpreter and torch's own libraries (a few hundred MiB), which a
    planner's prediction of training state does not model.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def per_rank_values(values: list[float], mesh) -> list[list[float]]:
    """Every rank's `values` (the same length on each rank), gathered in rank order on the world axis."""
    from ..parallel import comm

    mine = torch.tensor([values], dtype=torch.float64, device=mesh.world.device_type)  # (1, k), where the world's collectives run
    if mesh.world_size == 1:
        return mine.tolist()
    return comm.all_gather(mine, mesh.world, dim=0).tolist()  # (world, k)


def rank_measurements(model, result, device: torch.device, with_held: bool) -> dict[str, Any]:
    """Per-rank measurements of a step for metrics.jsonl (a collective: every rank calls it).

    - peak_memory_bytes: one value per rank (see `peak_memory_bytes`);
    - comm_bytes: bytes per planner axis sent in this step's training collectives by the
      busiest rank of each axis, the number the planner predicts (its busiest stage);
    - held_bytes (when `with_held`): params / grads / optimizer bytes held per rank after the
      gradient reduction.
    """
    axes = ("dp", "tp", "pp", "cp", "ep")
    mine = planner_axis_bytes(result.comm_bytes)
    values = [float(peak_memory_bytes(device))] + [float(mine.get(a, 0)) for a in axes]
    held_kinds = ("params", "grads", "optimizer")
    if with_held:
        values += [float(result.held_bytes.get(k, 0)) for k in held_kinds]
    rows = per_rank_values(values, model.mesh)
    out: dict[str, Any] = {
        "peak_memory_bytes": [int(r[0]) for r in rows],
        "comm_bytes": {a: int(max(r[1 + i] for r in rows)) for i, a in enumerate(axes) if any(r[1 + i] for r in rows)},
    }
    if with_held:
        out["held_bytes"] = [{k: int(r[6 + i]) for i, k in enumerate(held_kinds)} for r in rows]
    return out


def flatten_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number of a metrics record under a slash-separated tag, for TensorBoard.

    {"moe": {"layer1": {"imbalance": 1.2}}} -> {"moe/layer1/imbalance": 1.2}; lists become one
    tag per index ("peak_memory_bytes/rank0", "moe/layer1/tokens_per_expert/3"); "step" is the
    x axis, not a scalar.
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key == "step":
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, dict):
            out.update(flatten_scalars(value, f"{tag}/"))
        elif isinstance(value, list) and value:
            label = "rank" if key in ("peak_memory_bytes", "held_bytes") else ""
            out.update(flatten_scalars({f"{label}{i}": v for i, v in enumerate(value)}, f"{tag}/"))
    return out


# ----------------------------------------------------------------------------- train.profile


class StepProfiler:
    """`train.profile`: a torch.profiler trace of each chosen step, one Chrome trace per rank.

    Files: RUN_DIR/profile/step{S}-rank{R}.json (open in ui.perfetto.dev or chrome://tracing).
    CPU activity always, CUDA kernels too on GPUs; shapes and memory are recorded.
    """

    def __init__(self, steps: tuple[int, ...], run_dir, rank: int, device: torch.device, total_steps: int) -> None:
        self.steps, self.rank, self.device = set(steps), rank, device
        self.folder = run_dir / "profile"
        outside = sorted(s for s in self.steps if not 0 <= s < total_steps)
        if outside and rank == 0:
            print(f"warning: train.profile steps {outside} are outside 0..{total_steps - 1}: they are not recorded")

    def step(self, step: int):
        """A context manager that profiles `step` if it was chosen, else does nothing."""
        import contextlib

        if step not in self.steps:
            return contextlib.nullcontext()
        return self._profile(step)

    def _profile(self, step: int):
        import contextlib

        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])

        @contextlib.contextmanager
        def recording():
            with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
                yield
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"step{step}-rank{self.rank}.json"
            prof.export_chrome_trace(str(path))
            if self.rank == 0:
                print(f"profile of step {step}: {self.folder}/step{step}-rank*.json")

        return recording()
