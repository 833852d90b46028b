"""Per-rank timelines of one training step: record, gather, measure the bubble, draw.

A `Timeline` records when each compute action (forward, backward, ...) of a pipeline stage
ran, and when the rank waited on point-to-point transfers. Gathered over the pipeline ranks
it gives the measured bubble (the share of the step a stage is not computing), a Chrome
trace (chrome://tracing, ui.perfetto.dev) and a Gantt chart with one row per stage.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from ..rules.stages import bubble_share

if TYPE_CHECKING:
    from ..parallelize import ParallelModel

# Event kinds; compute kinds are what counts as busy. The codes travel in a float tensor.
KINDS = ("F", "B", "I", "W", "comm")
COMPUTE_KINDS = frozenset({"F", "B", "I", "W"})
_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)", "comm": "p2p"}
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#937860", "comm": "#cccccc"}


@dataclass(frozen=True)
class Event:
    kind: str  # one of KINDS
    microbatch: int
    chunk: int
    start: float  # seconds since the start of the step on this rank
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    """Records events of one step on one rank; `start()` sets time zero."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.origin = time.perf_counter()
        self.span = 0.0

    def start(self) -> None:
        self.events.clear()
        self.origin = time.perf_counter()
        self.span = 0.0

    def stop(self) -> None:
        self.span = time.perf_counter() - self.origin

    @contextlib.contextmanager
    def record(self, kind: str, microbatch: int, chunk: int) -> Iterator[None]:
        start = time.perf_counter() - self.origin
        try:
            yield
        finally:
            self.events.append(Event(kind, microbatch, chunk, start, time.perf_counter() - self.origin))


def busy_seconds(events: list[Event]) -> float:
    return sum(e.seconds for e in events if e.kind in COMPUTE_KINDS)


def bubble_fraction(rows: list[list[Event]], span: float | None = None) -> float:
    """Idle share of the step over all stages: 1 - busy / (stages x step time).

    The step time is the latest end of any event unless given.
    """
    if span is None:
        span = max((e.end for row in rows for e in row), default=0.0)
    if span <= 0:
        return 0.0
    busy = sum(busy_seconds(row) for row in rows)
    return 1.0 - busy / (span * len(rows))


def bubble_formula(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Idle share of the step the papers predict, with backward = 2 x forward
    (`stages.bubble_share`, the planner's bubble as a share of the step)."""
    return bubble_share(schedule, pp, num_microbatches, vpp)


# ------------------------------------------------------------------------------ transport


def to_tensor(events: list[Event], rows: int) -> torch.Tensor:
    """Pack events into a (rows, 5) float64 tensor (kind code, mb, chunk, start, end); -1 pads."""
    packed = torch.full((rows, 5), -1.0, dtype=torch.float64)
    for i, e in enumerate(events[:rows]):
        packed[i] = torch.tensor([KINDS.index(e.kind), e.microbatch, e.chunk, e.start, e.end], dtype=torch.float64)
    return packed


def from_tensor(packed: torch.Tensor) -> list[Event]:
    return [
        Event(KINDS[int(k)], int(mb), int(c), float(s), float(e))
        for k, mb, c, s, e in packed.tolist()
        if k >= 0
    ]


def gather_rows(timeline: Timeline, axis) -> list[list[Event]]:
    """Every rank of `axis` (a mesh Axis) gets every rank's events, in axis order."""
    from ..parallel import comm

    count = torch.tensor([float(len(timeline.events))], dtype=torch.float64, device=axis.device_type)
    comm.all_reduce(count, axis, op="max")
    packed = to_tensor(timeline.events, int(count.item())).to(axis.device_type)  # (rows, 5), where the axis's collectives run
    gathered = comm.all_gather(packed, axis, dim=0)  # (size * rows, 5)
    return [from_tensor(part) for part in gathered.chunk(axis.size, dim=0)]


# ------------------------------------------------------------------------------- outputs


def chrome_trace(rows: list[list[Event]], row_name: str = "stage") -> dict:
    """Chrome trace-event JSON: one thread per row, times in microseconds."""
    events = []
    for tid, row in enumerate(rows):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"{row_name} {tid}"}})
        for e in row:
            events.append({
                "name": f"{e.kind}{e.microbatch}" + (f".{e.chunk}" if e.chunk else ""),
                "cat": _NAMES[e.kind],
                "ph": "X",
                "pid": 0,
                "tid": tid,
                "ts": e.start * 1e6,
                "dur": max(e.seconds, 0.0) * 1e6,
                "args": {"microbatch": e.microbatch, "chunk": e.chunk},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(rows: list[list[Event]], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(rows)))
    return path


def read_chrome_trace(path: str | Path) -> list[list[Event]]:
    """The rows written by `write_chrome_trace`, back as events (one row per stage)."""
    kinds = {name: kind for kind, name in _NAMES.items()}
    rows: dict[int, list[Event]] = {}
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e.get("ph") == "M":
            rows.setdefault(int(e["tid"]), [])
        elif e.get("ph") == "X" and e.get("cat") in kinds:
            start = e["ts"] / 1e6
            event = Event(kinds[e["cat"]], int(e["args"]["microbatch"]), int(e["args"]["chunk"]), start, start + e["dur"] / 1e6)
            rows.setdefault(int(e["tid"]), []).append(event)
    return [rows[tid] for tid in sorted(rows)]


def ideal_rows(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
               forward: float = 1.0, backward: float = 2.0) -> list[list[Event]]:
    """The schedule table run by the simulator on an ideal machine (no communication time).

    `forward` and `backward` are the times of a whole stage's layers (in the caller's unit); an
    interleaved chunk holds 1/vpp of them, so it takes 1/vpp of the time. A split backward
    (zero-bubble) spends half of `backward` on the input gradient and half on the weight
    gradient, as `simulate` does.
    """
    from ..rules.schedules import build_schedule, placement_of, simulate

    table = build_schedule(schedule, pp, num_microbatches, vpp)
    result = simulate(table, pp, forward / vpp, backward / vpp, placement=placement_of(schedule))
    return [
        [Event(i.action.kind.value, i.action.microbatch, i.action.chunk, i.start, i.end) for i in row]
        for row in result.timelines
    ]


def draw_rows(ax, rows: list[list[Event]], scale: float = 1e3, xlabel: str = "ms since step start") -> None:
    """Draw a Gantt chart of `rows` on a matplotlib axis: one bar per event, gaps are the bubble."""
    from matplotlib.patches import Patch

    span = max((e.end for row in rows for e in row), default=1.0)
    for y, row in enumerate(rows):
        for e in row:
            ax.broken_barh([(e.start * scale, e.seconds * scale)], (y - 0.4, 0.8), facecolors=_COLOURS[e.kind],
                           edgecolor="white", linewidth=0.3)
            if e.kind in COMPUTE_KINDS and e.seconds > span / 80:
                ax.text((e.start + e.seconds / 2) * scale, y, str(e.microbatch), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [f"stage {i}" for i in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    used = sorted({e.kind for row in rows for e in row}, key=KINDS.index)
    ax.legend(handles=[Patch(color=_COLOURS[k], label=_NAMES[k]) for k in used], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)


def draw_gantt(rows: list[list[Event]], path: str | Path, title: str = "") -> Path:
    """PNG Gantt chart: one row per stage, forward / backward coloured, gaps are the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    draw_rows(ax, rows)
    ax.set_title(title or f"pipeline step, bubble {bubble_fraction(rows):.1%}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@contextlib.contextmanager
def trace_step(model: ParallelModel, run_dir: Path, enabled: bool) -> Iterator[None]:
    """Record the pipeline timeline of the step run inside; rank 0 writes timeline.png and trace.json.

    Rows are the pipeline stages of the first (dp, cp, tp) replica. Needs a pipeline (pp > 1).
    """
    runner = model.runner
    if not enabled or runner is None:
        if enabled and model.mesh.rank == 0:
            print("train.trace records pipeline stages; nothing to trace with pp=1")
        yield
        return
    with runner.recording(Timeline()) as timeline:
        yield
    rows = gather_rows(timeline, model.mesh.pp)
    if model.mesh.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        layout = model.config.layout
        title = (f"{layout.pp_schedule}, pp={layout.pp}, vpp={layout.vpp}, m={layout.grad_accum}: "
                 f"bubble {bubble_fraction(rows):.1%} (formula "
                 f"{bubble_formula(layout.pp_schedule, layout.pp, layout.grad_accum, layout.vpp):.1%})")
        draw_gantt(rows, run_dir / "timeline.png", title)
        write_chrome_trace(rows, run_dir / "trace.json")
        print(f"timeline of one step: {run_dir / 'timeline.png'}, {run_dir / 'trace.json'}")
