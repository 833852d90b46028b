"""`fivefold report RUN_DIR`: one self-contained HTML page and PNG figures of a training run.

Reads what a run leaves in its folder: config.json, metrics.jsonl (one record per step),
prediction.json (the planner's estimate for the run's layout) and trace.json (the measured
pipeline timeline of one step, `--train.trace true`). Draws whatever of it exists:

  loss         training and validation loss per step
  throughput   tokens/s and MFU per step
  step_time    measured step time beside the planner's breakdown (compute, bubble, exposed
               communication per axis, optimizer)
  comm         bytes per axis per step, measured (busiest rank) against the analytic volume
  memory       peak memory and held model-state bytes per rank against the prediction
  moe_*        tokens per expert per layer over steps, dropped fraction and imbalance, and the
               ep-rank x ep-rank all-to-all matrix
  pipeline     the measured Gantt chart of one step beside the ideal one of the schedule

A section that does not apply to the run's layout says so; a missing file, a crashed run's
partial metrics or an old run without the newer fields is reported as missing, never raised.
The page embeds every figure as a base64 PNG and loads nothing from the network.
"""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MiB = 2**20
MAX_MOE_LAYERS = 8  # heatmaps drawn; the page names the layers left out


class ReportError(ValueError):
    """The run folder cannot be reported on at all (it does not exist)."""


@dataclass
class RunData:
    run_dir: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    prediction: dict[str, Any]
    pipeline_rows: list | None
    missing: list[str] = field(default_factory=list)

    def section(self, name: str) -> dict[str, Any]:
        return self.config.get(name, {}) if isinstance(self.config.get(name), dict) else {}


@dataclass
class Figure:
    name: str  # PNG file stem
    title: str
    png: bytes


@dataclass
class Section:
    title: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------- reading


def _read_json(path: Path, missing: list[str], what: str) -> dict[str, Any]:
    if not path.exists():
        missing.append(f"{path.name} is absent: {what}")
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        missing.append(f"{path.name} cannot be read ({err}): {what}")
        return {}
    if not isinstance(value, dict):
        missing.append(f"{path.name} does not hold a JSON object: {what}")
        return {}
    return value


def read_metrics(path: Path, missing: list[str]) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl; lines a crash cut short are skipped and reported."""
    if not path.exists():
        missing.append("metrics.jsonl is absent: no per-step figures (was the run started with this folder?)")
        return []
    records, bad = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad.append(number)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            bad.append(number)
    if bad:
        missing.append(f"metrics.jsonl lines {bad} are not step records (a run stopped while writing?): skipped")
    if not records and not bad:
        missing.append("metrics.jsonl holds no steps yet")
    return latest_row_per_step(records)


def latest_row_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, in step order: where a resumed run trained a step again (files written
    before resuming superseded earlier rows), its later row is the one the weights went on from."""
    by_step = {record["step"]: record for record in records}
    return [by_step[step] for step in sorted(by_step)]


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; give the run folder a training run wrote (runs/<name>)")
    check_not_a_parent_of_runs(run_dir)
    missing: list[str] = []
    config = _read_json(run_dir / "config.json", missing, "the layout is unknown, layout-specific sections are skipped")
    records = read_metrics(run_dir / "metrics.jsonl", missing)
    prediction = _read_json(run_dir / "prediction.json", missing,
                            "no planner prediction to compare with (runs before prediction logging)")
    if "error" in prediction:
        missing.append(f"prediction.json: {prediction['error']}")
        prediction = {}
    return RunData(run_dir, config, records, prediction, _read_pipeline(run_dir, missing), missing)


def check_not_a_parent_of_runs(folder: Path) -> None:
    """Refuse a folder that holds run folders but is not a run itself (runs/ rather than runs/<name>)."""
    from ..job.rundir import looks_like_run

    if looks_like_run(folder):
        return
    runs = sorted(p.name for p in folder.iterdir() if p.is_dir() and looks_like_run(p))
    if runs:
        shown = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
        raise ReportError(f"{folder} holds {len(runs)} run folder(s) ({shown}), not a run; report one of them, "
                          f"e.g. fivefold report {folder / runs[-1]}")


def _read_pipeline(run_dir: Path, missing: list[str]) -> list | None:
    path = run_dir / "trace.json"
    if not path.exists():
        return None
    from ..observe.timeline import read_chrome_trace

    try:
        return read_chrome_trace(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        missing.append(f"trace.json cannot be read ({err}): no measured pipeline timeline")
        return None


# ---------------------------------------------------------------------------------- drawing


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")  # legends placed outside the axes stay in
    _pyplot().close(fig)
    return buffer.getvalue()


def series(records: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where `get` finds a number."""
    steps, values = [], []
    for r in records:
        try:
            value = get(r)
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(r["step"])
            values.append(float(value))
    return steps, values


def _field(*path: str) -> Callable[[dict[str, Any]], Any]:
    """A getter of record[path[0]][path[1]]...; a missing key raises KeyError, which `series` skips."""
    def get(record: dict[str, Any]) -> Any:
        value: Any = record
        for key in path:
            value = value[key]
        return value

    return get


def _axis_bytes(axis: str) -> Callable[[dict[str, Any]], int]:
    """Bytes of `axis` in a record; runs log only the axes that moved bytes, so absent means 0."""
    return lambda record: record["comm_bytes"].get(axis, 0)


def _steps_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def byte_unit(largest: float) -> tuple[str, float]:
    """("KiB", 1024) etc.: the binary unit that keeps `largest` between 1 and 1024."""
    for name, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if largest >= size:
            return name, size
    return "bytes", 1.0


def logged_series(section: Section, run: RunData, key: str, missing: str) -> tuple[list[int], list[float]]:
    """The per-step series `key`; when no step logged it, the section says so and it is empty."""
    steps, values = series(run.records, lambda r: r[key])
    if not steps:
        section.notes.append(f"{missing}: nothing to draw")
    return steps, values


def loss_section(run: RunData) -> Section:
    section = Section("Loss")
    steps, loss = logged_series(section, run, "loss", "no step has a loss yet")
    if not steps:
        return section
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, loss, label="training loss")
    val_steps, val = series(run.records, lambda r: r["val_loss"])
    if val_steps:
        ax.plot(val_steps, val, "o-", label="validation loss")
    else:
        section.notes.append("no validation loss logged (train.eval_interval is 0 or larger than the steps run)")
    _steps_axis(ax)
    ax.set_ylabel("mean token loss")
    ax.legend()
    section.figures.append(Figure("loss", "training and validation loss", _png(fig)))
    return section


def throughput_section(run: RunData) -> Section:
    section = Section("Throughput")
    steps, tps = logged_series(section, run, "tokens_per_s", "no tokens/s logged")
    if not steps:
        return section
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, tps, color="#4c72b0", label="tokens/s")
    _steps_axis(ax)
    ax.set_ylabel("tokens/s")
    mfu_steps, mfu = series(run.records, lambda r: r["mfu"])
    if mfu_steps:
        right = ax.twinx()
        right.plot(mfu_steps, [100 * v for v in mfu], color="#dd8452", label="MFU")
        right.set_ylabel("MFU (%)", color="#dd8452")
    else:
        section.notes.append("MFU not logged by this run")
    predicted = drawn_prediction(section, run, "tokens_per_s", "tokens/s")
    if predicted:
        ax.axhline(predicted, color="#4c72b0", linestyle="--", label="planner's tokens/s")
    ax.legend(loc="lower right")
    section.figures.append(Figure("throughput", "tokens/s and MFU per step", _png(fig)))
    section.notes.append("MFU against a matmul peak measured at the start of the run (fivefold/observe/metrics.py)")
    return section


def drawn_prediction(section: Section, run: RunData, key: str, unit: str) -> float | None:
    """The planner's time-based value `key` to draw beside the measured one, or None.

    On a CPU that `fivefold plan --calibrate` never measured the planner's times rest on two
    rates and defaults and are often 10-100x off: drawn, they would set the chart's scale and
    flatten the measured curve. They are left out, and the section says so.
    """
    predicted = run.prediction.get(key)
    if predicted and not run.prediction.get("step_time_calibrated", True):
        section.notes.append(f"the planner's {predicted:.3g} {unit} is not drawn: its step time is uncalibrated "
                             "on this CPU (`fivefold plan --calibrate` measures it); the chart shows the measurement")
        return None
    return predicted


def step_time_section(run: RunData) -> Section:
    section = Section("Step time")
    steps, seconds = logged_series(section, run, "step_seconds", "no step time logged")
    if not steps:
        return section
    measured = statistics.median(seconds[1:] or seconds)  # the first step warms up
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5), gridspec_kw={"width_ratios": [2, 1]})
    left.plot(steps, seconds, label="measured")
    predicted = drawn_prediction(section, run, "step_time_s", "s/step")
    if predicted:
        left.axhline(predicted, color="grey", linestyle="--", label="planner")
    _steps_axis(left)
    left.set_ylabel("seconds per step")
    left.legend()
    breakdown = run.prediction.get("breakdown_s", {}) if predicted else {}
    _stack(right, "planner", breakdown, "planner: ")
    phases = _median_phases(run.records)
    if phases:
        _stack(right, "measured\n(median)", phases, "measured: ", hatch="//")
    else:
        right.bar("measured\n(median)", measured, color="#555555", label="measured step")
        section.notes.append("no per-phase times logged (runs before phase timing): the measured bar is the whole step")
    bubble = _measured_bubble(run)
    if bubble is not None:  # the traced step's idle share, applied to the median pipeline time
        pipeline_time = phases.get("forward_backward", measured)
        right.bar("measured\nbubble", bubble * pipeline_time, color="#cccccc",
                  label=f"measured: bubble, {bubble:.0%} of forward_backward")
    right.set_ylabel("seconds")
    right.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    section.figures.append(Figure("step_time", "step time: measured and the planner's breakdown", _png(fig)))
    if not run.prediction.get("breakdown_s"):
        section.notes.append("no planner breakdown (prediction.json missing)")
    section.notes.append(
        "Measured phases: forward_backward holds compute, tensor/context/expert/pipeline communication and "
        "the bubble; grad_sync the data-parallel reduction left after the backward; optimizer the update "
        "(and ZeRO's parameter gathers); statistics the loss and MoE reductions and the memory walk. "
        "Exposed communication per axis is the planner's split; the runtime does not time collectives one by one. "
        "The measured bubble share comes from the traced step (--train.trace true, pp > 1)."
    )
    return section


def _stack(ax, label: str, parts: dict[str, float], prefix: str, hatch: str | None = None) -> None:
    bottom = 0.0
    for name, value in parts.items():
        ax.bar(label, value, bottom=bottom, label=prefix + name, hatch=hatch)
        bottom += value


def _median_phases(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of each step phase over the steps after the first (warm-up)."""
    timed = [r["phase_seconds"] for r in records if isinstance(r.get("phase_seconds"), dict)]
    timed = timed[1:] or timed
    names = list(dict.fromkeys(name for phases in timed for name in phases))
    return {name: statistics.median(p.get(name, 0.0) for p in timed) for name in names}


def _measured_bubble(run: RunData) -> float | None:
    if not run.pipeline_rows:
        return None
    from ..observe.timeline import bubble_fraction

    return bubble_fraction(run.pipeline_rows)


def comm_section(run: RunData) -> Section:
    section = Section("Communication per axis")
    with_bytes = [r for r in run.records if isinstance(r.get("comm_bytes"), dict)]
    if not with_bytes:
        section.notes.append("no bytes per axis logged (runs before per-step communication logging)")
        return section
    predicted = run.prediction.get("comm_bytes", {})
    axes = sorted({a for r in with_bytes for a in r["comm_bytes"]} | set(predicted))
    if not axes:
        section.notes.append("no collective ran: a single-process layout moves no bytes")
        return section
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    largest = max([v for r in with_bytes for v in r["comm_bytes"].values()] + list(predicted.values()) + [1])
    unit, size = byte_unit(largest)
    for i, axis in enumerate(axes):
        colour = f"C{i}"
        steps, values = series(with_bytes, _axis_bytes(axis))
        ax.plot(steps, [v / size for v in values], "o-", color=colour, label=f"{axis} measured")
        if axis in predicted:
            ax.axhline(predicted[axis] / size, color=colour, linestyle="--", label=f"{axis} analytic")
    _steps_axis(ax)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set_ylabel(f"{unit} sent per step (busiest rank)")
    ax.legend(fontsize=7)
    section.figures.append(Figure("comm", "bytes per axis per step against the analytic volume", _png(fig)))
    section.notes.append("Wire bytes under the ring algorithm, counted by fivefold/parallel/comm.py; the ep "
                         "all-to-all follows the actual routing, the analytic volume assumes balanced experts. "
                         "A traced pipeline step adds one 4-byte all-reduce that lines the stages' clocks up.")
    return section


def memory_section(run: RunData) -> Section:
    section = Section("Memory per rank")
    peaks = _last(run.records, "peak_memory_bytes")
    held = _last(run.records, "held_bytes")
    if peaks is None and held is None:
        section.notes.append("no per-rank memory logged (runs before memory logging)")
        return section
    plt = _pyplot()
    panels = [p for p in (peaks, held) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    predicted = run.prediction.get("memory_bytes", {})
    column = 0
    if peaks is not None:
        ax = axes[0][column]
        ax.bar(range(len(peaks)), [p / MiB for p in peaks], color="#4c72b0")
        if predicted.get("total"):
            ax.axhline(predicted["total"] / MiB, color="black", linestyle="--", label="planner: training state")
            ax.legend(fontsize=7)
        ax.set_title("peak memory (RSS on CPU, allocator peak on CUDA)", fontsize=9)
        _rank_axis(ax, len(peaks))
        column += 1
    if held is not None:
        ax = axes[0][column]
        bottom = [0.0] * len(held)
        for kind in ("params", "grads", "optimizer"):
            values = [rank.get(kind, 0) / MiB for rank in held]
            ax.bar(range(len(held)), values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values)]
        if predicted.get("model_states"):
            ax.axhline(predicted["model_states"] / MiB, color="black", linestyle="--", label="planner")
        ax.set_title("model states held after the gradient reduction", fontsize=9)
        ax.legend(fontsize=7)
        _rank_axis(ax, len(held))
    section.figures.append(Figure("memory", "memory per rank against the planner's prediction", _png(fig)))
    section.notes.append("Process RSS includes the Python interpreter and torch (a few hundred MiB) that the "
                         "planner does not model; the held model states compare like with like.")
    return section


def _last(records: list[dict[str, Any]], key: str) -> list | None:
    for r in reversed(records):
        value = r.get(key)
        if isinstance(value, list) and value:
            return value
    return None


def _rank_axis(ax, n: int) -> None:
    ax.set_xticks(range(n), [str(i) for i in range(n)])
    ax.set_xlabel("rank")
    ax.set_ylabel("MiB")


def moe_section(run: RunData) -> Section:
    section = Section("Mixture of Experts")
    model = run.section("model")
    if model and not model.get("num_experts"):
        section.notes.append("dense model (model.num_experts = 0): no experts, no all-to-all")
        return section
    with_moe = [r for r in run.records if isinstance(r.get("moe"), dict) and r["moe"]]
    if not with_moe:
        section.notes.append("no expert statistics logged" + ("" if model else " (and config.json is missing)"))
        return section
    layers = sorted({name for r in with_moe for name in r["moe"]}, key=lambda n: int("".join(c for c in n if c.isdigit()) or 0))
    if len(layers) > MAX_MOE_LAYERS:
        section.notes.append(f"heatmaps of the first {MAX_MOE_LAYERS} of {len(layers)} MoE layers; "
                             "metrics.jsonl and TensorBoard hold all of them")
    section.figures.append(_expert_heatmaps(with_moe, layers[:MAX_MOE_LAYERS]))
    section.figures.append(_moe_lines(with_moe, layers))
    matrix = _summed_matrix(with_moe)
    if matrix is None:
        ep = run.section("layout").get("ep", 1)
        section.notes.append(f"ep={ep}: every rank holds every expert, so no all-to-all matrix")
    else:
        section.figures.append(_matrix_figure(matrix))
    return section


def _expert_heatmaps(records: list[dict[str, Any]], layers: list[str]) -> Figure:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(layers), figsize=(3 * len(layers) + 1, 3.2), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        rows = [r["moe"][layer]["tokens_per_expert"] for r in records if layer in r["moe"]]
        steps = [r["step"] for r in records if layer in r["moe"]]
        image = ax.imshow(list(map(list, zip(*rows))), aspect="auto", cmap="viridis", interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows[0]) - 0.5, -0.5))
        ax.set_title(layer, fontsize=9)
        _steps_axis(ax)
        ax.set_ylabel("expert")
        fig.colorbar(image, ax=ax, fraction=0.05)
    return Figure("moe_tokens", "tokens routed to each expert, per layer and step", _png(fig))


def _moe_lines(records: list[dict[str, Any]], layers: list[str]) -> Figure:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    for layer in layers:
        steps, imbalance = series(records, _field("moe", layer, "imbalance"))
        left.plot(steps, imbalance, label=layer)
        steps, dropped = series(records, _field("moe", layer, "dropped_fraction"))
        right.plot(steps, [100 * d for d in dropped], label=layer)
    left.set_title("imbalance (max / mean tokens per expert)", fontsize=9)
    right.set_title("dropped token-slots (%)", fontsize=9)
    for ax in (left, right):
        _steps_axis(ax)
    left.legend(fontsize=6)
    return Figure("moe_balance", "expert imbalance and dropped fraction per layer", _png(fig))


def _summed_matrix(records: list[dict[str, Any]]) -> list[list[float]] | None:
    total: list[list[float]] | None = None
    for r in records:
        for stats in r["moe"].values():
            matrix = stats.get("all_to_all_tokens")
            if not matrix:
                continue
            if total is None:
                total = [[0.0] * len(row) for row in matrix]
            for i, row in enumerate(matrix):
                for j, v in enumerate(row):
                    total[i][j] += v
    return total


def _matrix_figure(matrix: list[list[float]]) -> Figure:
    plt = _pyplot()
    n = len(matrix)
    fig, ax = plt.subplots(figsize=(4.2 + 0.3 * n, 3.4 + 0.3 * n))
    image = ax.imshow(matrix, cmap="magma", interpolation="nearest")
    middle = (max(map(max, matrix)) + min(map(min, matrix))) / 2
    for i in range(n):
        for j in range(n):
            colour = "black" if matrix[i][j] > middle else "white"  # readable on bright and dark cells
            ax.text(j, i, f"{matrix[i][j]:,.0f}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("to ep rank (holder of the experts)")
    ax.set_ylabel("from ep rank")
    ax.set_title("token-slots, all layers and steps", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    return Figure("moe_all_to_all", "ep-rank x ep-rank all-to-all token matrix", _png(fig))


def pipeline_section(run: RunData) -> Section:
    section = Section("Pipeline")
    layout = run.section("layout")
    pp = layout.get("pp", 1)
    if not layout:
        section.notes.append("layout unknown (config.json missing): no pipeline section")
        return section
    if pp == 1:
        section.notes.append("pp=1: no pipeline, no bubble")
        return section
    from ..observe.timeline import bubble_fraction, draw_rows, ideal_rows

    schedule, vpp = layout.get("pp_schedule", "1f1b"), layout.get("vpp", 1)
    m = layout.get("grad_accum") or 1
    try:
        ideal = ideal_rows(schedule, pp, m, vpp)
    except ValueError as err:
        section.notes.append(f"the schedule simulator cannot run {schedule} with pp={pp}, m={m}: {err}")
        ideal = None
    measured = run.pipeline_rows
    if measured is None:
        section.notes.append("no measured timeline: run with --train.trace true to record one step (trace.json)")
    panels = [(rows, title, scale, unit) for rows, title, scale, unit in (
        (measured, "measured", 1e3, "ms since step start"),
        (ideal, "ideal (simulator, backward = 2 x forward)", 1.0, "forward times"),
    ) if rows]
    if not panels:
        return section
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, (0.55 * pp + 1.3) * len(panels)), squeeze=False)
    for ax, (rows, title, scale, unit) in zip(axes[:, 0], panels):
        draw_rows(ax, rows, scale, unit)
        ax.set_title(f"{title}: {schedule}, pp={pp}, vpp={vpp}, m={m}, bubble {bubble_fraction(rows):.1%}", fontsize=9)
    section.figures.append(Figure("pipeline", "pipeline Gantt chart, measured and ideal", _png(fig)))
    return section


SECTIONS: tuple[Callable[[RunData], Section], ...] = (
    loss_section, throughput_section, step_time_section, comm_section, memory_section, moe_section,
    pipeline_section,
)


# ---------------------------------------------------------------------------------- writing


def build_sections(run: RunData) -> list[Section]:
    """Every section; one that fails to draw says why instead of stopping the report."""
    sections = []
    for make in SECTIONS:
        try:
            sections.append(make(run))
        except Exception as err:  # a malformed field of one old or partial record must not lose the rest
            name = make.__name__.replace("_section", "")
            sections.append(Section(name, notes=[f"could not draw from this run's data: {type(err).__name__}: {err}"]))
    return sections


def _layout_line(run: RunData) -> str:
    layout, model = run.section("layout"), run.section("model")
    if not layout:
        return "layout unknown"
    axes = ", ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) > 1) or "one process"
    extras = [f"zero={layout['zero']}"] if layout.get("zero") else []
    if layout.get("pp", 1) > 1:
        extras.append(f"schedule {layout.get('pp_schedule')}")
    return f"model {model.get('name', '?')}; layout {axes}" + (f" ({', '.join(extras)})" if extras else "")


def _prediction_lines(run: RunData) -> list[str]:
    """The planner's summary for this run and the drift warnings the run printed (recomputed)."""
    if not run.prediction:
        return []
    from ..observe.prediction import DRIFT_CHECK_STEP, drift_warnings, summary

    margin = run.prediction.get("drift_margin", 0.25)
    try:
        return [summary(run.prediction)] + drift_warnings(run.prediction, run.records[:DRIFT_CHECK_STEP], margin)
    except (KeyError, TypeError, ValueError) as err:
        return [f"prediction.json lacks a field the summary needs ({err})"]


def render_html(run: RunData, sections: list[Section]) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>fivefold report: {esc(run.run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "img{max-width:100%;border:1px solid #ddd}.note{color:#555}.missing{color:#a33}</style>",
        "</head><body>",
        f"<h1>Run {esc(run.run_dir.name)}</h1>",
        f"<p>{esc(_layout_line(run))}; {len(run.records)} steps in metrics.jsonl.</p>",
    ]
    parts += [f"<p>{esc(line)}</p>" for line in _prediction_lines(run)]
    if run.missing:
        parts.append("<h2>Missing</h2><ul class='missing'>")
        parts += [f"<li>{esc(line)}</li>" for line in run.missing]
        parts.append("</ul>")
    for section in sections:
        parts.append(f"<section><h2>{esc(section.title)}</h2>")
        for fig in section.figures:
            data = base64.b64encode(fig.png).decode()
            parts.append(f"<figure><img class='figure' alt='{esc(fig.title)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{esc(fig.title)} ({esc(fig.name)}.png)</figcaption></figure>")
        parts += [f"<p class='note'>{esc(note)}</p>" for note in section.notes]
        parts.append("</section>")
    parts.append(f"<script>{FIGURE_CHECK}</script></body></html>")
    return "\n".join(parts)


# Once the page has loaded, count the figures the browser decoded (data-figures-loaded on <body>),
# so a headless browser's DOM dump shows whether every figure rendered.
FIGURE_CHECK = (
    "window.addEventListener('load', function () {"
    " var images = Array.prototype.slice.call(document.querySelectorAll('img.figure'));"
    " var loaded = images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;"
    " document.body.setAttribute('data-figures-loaded', String(loaded));"
    " document.body.setAttribute('data-figures', String(images.length)); });"
)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write report.html and one PNG per figure into `out_dir` (default RUN_DIR/report); the HTML path."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections = build_sections(run)
    for section in sections:
        for fig in section.figures:
            (out / f"{fig.name}.png").write_bytes(fig.png)
    page = out / "report.html"
    page.write_text(render_html(run, sections))
    return page


def run_report_cli(argv: list[str]) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="fivefold report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the folder a training run wrote (runs/<name>)")
    parser.add_argument("--out", default=None, help="folder for report.html and the PNGs (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        page = write_report(args.run_dir, args.out)
    except (ReportError, OSError) as err:
        print(f"fivefold report: error: {err}", file=sys.stderr)
        return 2
    print(f"report: {page} (figures as PNG beside it)")
    return 0
