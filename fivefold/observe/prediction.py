"""The planner's prediction for a run's own layout, and its comparison with what the run measured.

At the start of a run `predict_run` asks the planner (`fivefold.planner.estimate`) for the
step time, its breakdown, the memory per device and the bytes per axis of exactly this model,
layout and batch; the run writes it to `prediction.json` beside `metrics.jsonl`. After a few
steps `drift_warnings` holds the measurement against it and names every quantity that is off
by more than `train.drift_margin` (a ratio: 0.25 warns below 0.8x or above 1.25x). On a CPU
that was never calibrated the step time is predicted from rates measured at start and is
shown, not warned about.

What is compared, and why these measurements:
- model-state bytes (parameters + gradients + optimizer state, by tensor storage on every rank)
  against the planner's; they agree within 1% by construction (tests/test_planner_agreement).
- bytes per axis per step, the busiest rank of each axis (the planner reports the busiest
  stage); exact for every axis but ep, whose all-to-all follows the actual routing.
- step time: measured median against predicted; on a shared CPU this is indicative only.
Peak process memory (RSS on CPU, the CUDA allocator's peak on GPUs) is logged beside the
prediction but not warned about: it includes the Python and torch runtime, which the planner
does not model.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .._moved import moved_names
from ..config import Config

__getattr__ = moved_names(__name__, {"PLANNER_AXIS": "fivefold.rules.volumes", "planner_axis_bytes": "fivefold.rules.volumes"})

# The planner's hardware name for a CPU never calibrated, planned with rates measured at start.
CPU_MEASURED_AT_START = "cpu (matmul and copy rates measured at start; `fivefold plan --calibrate` measures the rest)"


def hardware_for(device: torch.device) -> str:
    """The planner's hardware name for the device a run uses: "cpu", or the CUDA preset of the
    same family (A100, H100, ...) whose memory is closest to the device's. An unknown GPU is
    planned as an H100-80GB; prediction.json names the hardware used.
    """
    if device.type != "cuda":
        return "cpu"
    from ..planner import HARDWARE

    name = torch.cuda.get_device_name(device).upper()
    memory = torch.cuda.get_device_properties(device).total_memory
    family = [p for p in HARDWARE if p != "cpu" and p.split("-")[0].upper() in name]
    if not family:
        return "H100-80GB"
    return min(family, key=lambda p: abs(HARDWARE[p].memory_bytes - memory))


def planner_hardware(device: torch.device, dtype: str) -> Any:
    """What the planner costs this run on: a GPU preset; the saved CPU calibration; or, on a
    CPU that was never calibrated, the conservative defaults with the matmul rate and the copy
    bandwidth measured now (~0.4 s). Without them the defaults (20 GFLOP/s, 5 GB/s) predict
    steps several times slower than current CPUs run them, and every first run warned of drift.
    """
    import dataclasses

    from ..planner.hardware import CPU_DEFAULT, load_calibration, measure_copy_bandwidth, measure_matmul_flops

    name = hardware_for(device)
    if name != "cpu":
        return name
    calibrated = load_calibration()
    if calibrated is not None:
        return calibrated
    rate = measure_matmul_flops("bfloat16" if dtype == "bf16" else "float32", size=512, seconds=0.2)
    return dataclasses.replace(CPU_DEFAULT, name=CPU_MEASURED_AT_START,
                               peak_flops=rate, peak_flops_fp32=rate, hbm_bw=measure_copy_bandwidth(16, 0.2))


def predict_run(config: Config, device: torch.device) -> dict[str, Any]:
    """The planner's estimate of one step of `config` (already validated), as plain JSON values.

    Returns {"error": reason} when the planner cannot cost this layout, so a run never fails
    for want of a prediction.
    """
    from ..planner import PlanError, estimate
    from ..planner.bridge import layout_spec, model_spec

    layout, train = config.layout, config.train
    hardware = planner_hardware(device, train.dtype)
    try:
        spec = layout_spec(layout, train.global_batch)  # pp_layers included: the split the run builds
        precision = "bf16" if train.dtype == "bf16" else "fp32"
        e = estimate(model_spec(config.model, train.seq_len), spec, hardware=hardware, precision=precision)
    except (PlanError, ValueError) as err:
        return {"error": f"the planner cannot cost this layout: {err}"}
    except Exception as err:  # a planner bug must not stop a training run; say what happened instead
        return {"error": f"the planner failed on this layout ({type(err).__name__}: {err})"}
    mem = e.memory
    return {
        "hardware": e.hardware.name,
        # False on a CPU that `fivefold plan --calibrate` never measured: the step time then
        # rests on two rates measured at start and defaults, and is not held against the run.
        "step_time_calibrated": e.hardware.name != CPU_MEASURED_AT_START,
        "precision": e.precision,
        "step_time_s": e.step_time_s,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "bubble_fraction": e.bubble_fraction,
        "breakdown_s": {
            "compute": e.compute_time_s,
            "bubble": e.bubble_time_s,
            "optimizer": e.optimizer_time_s,
            **{f"exposed {axis}": t for axis, t in e.comm_exposed_s.items() if t},
        },
        "memory_bytes": {
            "params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
            "activations": mem.activations, "buffers": mem.buffers, "total": mem.total,
            "model_states": mem.model_states,
        },
        "stage_memory_bytes": list(e.stage_memory),
        "comm_bytes": {axis: int(v) for axis, v in e.comm_bytes.items() if v},
    }


def _ratio_off(measured: float, predicted: float, margin: float) -> bool:
    if predicted <= 0:
        return measured > 0
    ratio = measured / predicted
    return ratio > 1 + margin or ratio < 1 / (1 + margin)


def drift_warnings(prediction: dict[str, Any], records: list[dict[str, Any]], margin: float) -> list[str]:
    """One line per quantity whose measurement is off the prediction by more than `margin`.

    The first step is left out of the time (allocator and thread-pool warm-up).
    """
    if not prediction or "error" in prediction or not records:
        return []
    out = []
    steady = [r["step_seconds"] for r in records[1:] if "step_seconds" in r] or [records[0].get("step_seconds", 0.0)]
    measured_time = statistics.median(steady)
    if prediction.get("step_time_calibrated", True) and _ratio_off(measured_time, prediction["step_time_s"], margin):
        hint = (" (the planner's CPU rates come from `fivefold plan --calibrate --model llama3-8b`; "
                "other processes on the machine slow steps down)"
                if prediction.get("hardware", "").startswith("cpu") else "")
        out.append(f"step time {measured_time:.3g} s measured vs {prediction['step_time_s']:.3g} s predicted{hint}")
    held = records[0].get("held_bytes")
    if held:
        worst = max(sum(rank.values()) for rank in held)
        predicted = prediction["memory_bytes"]["model_states"]
        if _ratio_off(worst, predicted, margin):
            out.append(f"model states {worst / 2**20:.1f} MiB held vs {predicted / 2**20:.1f} MiB predicted")
    measured_bytes = records[-1].get("comm_bytes", {})
    for axis, predicted in prediction.get("comm_bytes", {}).items():
        got = measured_bytes.get(axis, 0)
        if _ratio_off(got, predicted, margin):
            out.append(f"{axis} bytes per step {got:,} measured vs {predicted:,} predicted")
    return [f"measurement drifts from the planner's prediction by more than {margin:.0%}: {line}" for line in out]


DRIFT_CHECK_STEP = 3  # steps measured before the drift check (the first one warms up)


def summary(prediction: dict[str, Any]) -> str:
    """One line for the start of a run."""
    if "error" in prediction:
        return f"planner: {prediction['error']}"
    mem = prediction["memory_bytes"]
    return (f"planner predicts for this layout on {_step_time_text(prediction)}, "
            f"{mem['total'] / 2**20:.1f} MiB per device ({mem['model_states'] / 2**20:.1f} MiB model states, "
            f"{mem['activations'] / 2**20:.1f} MiB activations), bytes per step "
            + (", ".join(f"{a} {v:,}" for a, v in prediction["comm_bytes"].items()) or "none"))


def _step_time_text(prediction: dict[str, Any]) -> str:
    """"HARDWARE: T s/step", or for a CPU never calibrated a time marked as the guess it is."""
    time = f"{prediction['step_time_s']:.3g} s/step"
    if prediction.get("step_time_calibrated", True):
        return f"{prediction['hardware']}: {time}"
    return f"cpu: {time} uncalibrated (often 10-100x off; `fivefold plan --calibrate` measures this CPU)"


def write_prediction(config: Config, device: torch.device, run_dir) -> dict[str, Any]:
    """Predict this run, write RUN_DIR/prediction.json and print the summary line (rank 0 only)."""
    import json

    prediction = predict_run(config, device)
    prediction["drift_margin"] = config.train.drift_margin
    (run_dir / "prediction.json").write_text(json.dumps(prediction, indent=2))
    print(summary(prediction))
    return prediction


def check_drift(prediction: dict[str, Any], records: list[dict[str, Any]], margin: float, steps_in_run: int) -> None:
    """Print the drift warnings once, after DRIFT_CHECK_STEP steps (or all of a shorter run)."""
    if len(records) != min(DRIFT_CHECK_STEP, steps_in_run):
        return
    for line in drift_warnings(prediction, records, margin):
        print(f"warning: {line}")
