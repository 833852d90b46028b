"""Pipeline schedules: fivefold against torch.distributed.pipelining on the same split model.

Run with one process per pipeline stage, e.g.
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone \
        --nproc-per-node 4 benchmarks/bench_pp.py --micro-batches 8

Both sides run the same modules (the fivefold stage chunks, same weights, same layers per
stage) on the same global batch; one case = forward + backward of every micro-batch. The
cases alternate in one run (fivefold.tools.bench.alternate) and the table reports the median of
per-round time ratios against torch's GPipe. The bubble of each case is measured, not
modelled: every rank records when it computes (fivefold's timeline; autograd markers
around torch's stage modules) and bubble = 1 - sum(busy) / (stages x step time).

torch has no ZB-H1 for one stage per rank, so zb-h1 is timed against fivefold's 1F1B (and
torch's) in the same run.

Evidence that does not depend on the machine's load is printed beside the times: the CPU
seconds each rank's main thread spends in one step (the work a schedule does, whatever the
waits) and those of its other threads (gloo's transfers), and where each rank's idle time of
the traced step went (before its first compute, after its last, waiting on transfers,
between actions).

What the measured bubble is made of: the bytes of one stage-boundary transfer and its
latency and CPU cost (a ping-pong of that tensor, `transfer_cost`), and the bubble of the
executor model (`schedules.executor_model`: every compute starts once its rank is free and
its input has arrived, one latency after it was made) fed with the traced step's own
per-action times: its CPU times (the work, without contention) and its wall times (the
work as stretched by contention). The first is the bubble the schedule allows on this
machine; when the second matches the measured bubble, the excess is the actions' uneven
stretching, not waiting on transfers.

Two verdicts per schedule, from CPU times, which load moves little (`limits`): the bubble's
(formula, then the executor model on equal stages at the measured F / B times, on each stage's
own mean times, on every action's own time, then measured: whether the stages' own times
already leave the formula + 10%, and why), and the
ceiling against torch: per timed round, the executor model on torch's main-thread CPU per rank
over the model on fivefold's compute alone (both stretched to the same round's CPU), against
1.05, with the interval of its median over rounds.

`--malloc retain` runs every case alike, fivefold's and torch's, under glibc's allocator as
`train.malloc=retain` sets it (fivefold/malloc.py: freed memory stays with the process, as
jemalloc or tcmalloc keep it). It removes the page faults glibc's default takes to get freed
memory back, which `benchmarks/bench_malloc.py` measured at under 1% of a pipeline step's CPU.
Peak RSS per case means less then: freed memory stays resident.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fivefold.tools.bench import (
    alternate,
    builds,
    ceiling_verdict,
    compare,
    gather_peak_rss,
    median_interval,
    print_table,
    thread_schedstat,
    write_json,
)
from fivefold.config import load_config
from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
from fivefold.rules.layout import validate
from fivefold.job.malloc import MALLOC_SETTINGS, apply_malloc
from fivefold.parallel.mesh import Mesh
from fivefold.parallel import comm
from fivefold.rules.schedules import build_schedule, executor_model, stage_of
from fivefold.parallelize import cross_entropy_sum
from fivefold.rules.stages import bubble_units
from fivefold.observe.timeline import COMPUTE_KINDS, Timeline, bubble_formula, busy_seconds, gather_rows
from fivefold.train import build, local_micro_batches

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
# Schedules run by fivefold only (zb-h1: compare it with fivefold's 1f1b in the same run).
OURS_ONLY = ("zb-h1",)


class _Busy:
    """Compute time of one rank: forward spans from module hooks, backward from autograd markers."""

    def __init__(self) -> None:
        self.seconds, self.started = 0.0, None

    def begin(self) -> None:
        self.started = time.perf_counter()

    def end(self) -> None:
        if self.started is not None:
            self.seconds += time.perf_counter() - self.started
            self.started = None


class _OnBackward(torch.autograd.Function):
    """Identity whose backward first calls `callback` (marks where a stage's backward starts/ends)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class TorchStageModule(nn.Module):
    """A fivefold chunk as torch.distributed.pipelining wants it: one tensor in, one out."""

    def __init__(self, chunk: nn.Module, positions: torch.Tensor, busy: _Busy) -> None:
        super().__init__()
        self.chunk, self.busy = chunk, busy
        self.register_buffer("positions", positions, persistent=False)
        if chunk.embed is not None:  # the first stage's backward ends at the embedding output
            chunk.embed.register_forward_hook(lambda m, i, out: _OnBackward.apply(out, busy.end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.busy.begin()
        if x.is_floating_point():
            x = _OnBackward.apply(x, self.busy.end)
        out, _ = self.chunk(x, self.positions)
        self.busy.end()
        return _OnBackward.apply(out, self.busy.begin)


def build_cases(config, mesh: Mesh, batch, schedules: list[str], measured: dict, at_place: bool = False) -> dict:
    """Two cases per schedule: fivefold's runner and torch's schedule over the same chunks
    (fivefold's alone for a schedule in OURS_ONLY); with `at_place`, a third: fivefold's
    runner posting each receive at its place in the table, not ahead (an A/B of RECVS_AHEAD)."""
    from torch.distributed import pipelining

    train = config.train
    scale = 1.0 / (train.global_batch * train.seq_len)
    cases = {}
    for name in schedules:
        if not builds(f"fivefold {name}", f"torch {name}"):  # another case measured alone
            continue
        vpp = 2 if name == "interleaved" else 1
        layout = dataclasses.replace(config.layout, pp_schedule=name, vpp=vpp)
        cfg = validate(config.replace(layout=layout), mesh.world_size)
        model = build(cfg, mesh, torch.device("cpu"))
        micro = local_micro_batches(model, batch, 0)
        busy = _Busy()

        def ours(model=model, micro=micro):
            model.runner.run(micro)
            model.optimizer.zero_grad()

        cases[f"fivefold {name}"] = ours
        if at_place:
            cases[f"fivefold {name} recv at place"] = _receiving_at_place(model.runner, ours)
        if name in OURS_ONLY or not builds(f"torch {name}"):
            measured[name] = (model, micro, busy, ours, None)
            continue
        stages = [
            pipelining.PipelineStage(
                TorchStageModule(chunk, micro[0].positions, busy), stage_of(mesh.pp.rank, c, mesh.pp.size),
                mesh.pp.size * vpp, torch.device("cpu"), group=mesh.pp.group,
            )
            for c, chunk in enumerate(model.chunks)
        ]
        schedule_class = getattr(pipelining, TORCH_SCHEDULES[name])
        loss = lambda logits, target: cross_entropy_sum(logits, target) * scale  # noqa: E731
        schedule = schedule_class(stages if vpp > 1 else stages[0], len(micro), loss_fn=loss, scale_grads=False)
        inputs = torch.cat([mb.inputs for mb in micro])
        targets = torch.cat([mb.targets for mb in micro])

        def theirs(model=model, schedule=schedule, inputs=inputs, targets=targets, first=mesh.pp.rank == 0,
                   last=mesh.pp.rank == mesh.pp.size - 1):
            args = (inputs,) if first else ()
            schedule.step(*args, target=targets if last else None, return_outputs=False)
            model.optimizer.zero_grad()

        cases[f"torch {name}"] = theirs
        measured[name] = (model, micro, busy, ours, theirs)
    return cases


class CpuTimeline(Timeline):
    """A timeline that also keeps the main thread's CPU seconds of each compute action."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: dict[tuple[str, int, int], float] = {}

    def start(self) -> None:
        super().start()
        self.cpu.clear()

    @contextlib.contextmanager
    def record(self, kind: str, microbatch: int, chunk: int):
        cpu = time.thread_time()
        with super().record(kind, microbatch, chunk):
            yield
        if kind in COMPUTE_KINDS:
            self.cpu[(kind, microbatch, chunk)] = time.thread_time() - cpu


def transfer_cost(mesh: Mesh, shape: tuple[int, ...], rounds: int = 30) -> dict[str, float]:
    """One stage-boundary transfer between pipeline ranks 0 and 1, alone: its bytes, its
    latency (half a ping-pong's round trip; median and minimum over rounds) and the CPU
    seconds it costs the two processes' other threads (gloo's), per transfer."""
    tensor = torch.randn(shape)
    rank = mesh.pp.rank  # ranks beyond the pair only join the barriers
    trips, other_cpu = [], 0.0
    for _ in range(rounds + 2):
        comm.all_reduce(torch.zeros(1), mesh.pp)
        process, thread, start = time.process_time(), time.thread_time(), time.perf_counter()
        for step in (0, 1):  # rank 0 sends then receives; rank 1 the other way round
            if rank < 2:
                ops = [(tensor, 1 - rank)]
                for work in comm.send_recv(mesh.pp, ops if step == rank else [], [] if step == rank else ops):
                    work.wait()
        trips.append(time.perf_counter() - start)
        other_cpu += (time.process_time() - process) - (time.thread_time() - thread)
    trips = trips[2:]  # the first trips set up the pair's buffers
    total = torch.tensor([other_cpu], dtype=torch.float64)
    comm.all_reduce(total, mesh.pp)
    late, early = _receive_wait(mesh, tensor, rounds, ahead=False), _receive_wait(mesh, tensor, rounds, ahead=True)
    return {"bytes": tensor.numel() * tensor.element_size(), "latency_s": statistics.median(trips) / 2,
            "latency_min_s": min(trips) / 2, "other_threads_cpu_s": float(total[0]) / (2 * (rounds + 2)),
            "wait_posted_late_s": late, "wait_posted_ahead_s": early}


def _receive_wait(mesh: Mesh, tensor: torch.Tensor, rounds: int, ahead: bool, gap: float = 0.01) -> float:
    """Median seconds rank 1 waits for a tensor rank 0 sent `gap` seconds before the wait,
    its receive posted either just before waiting (as at its consumer) or `ahead`, before the
    send. gloo's sender waits for the receive to be posted, so a late one costs a round trip."""
    waits = []
    for _ in range(rounds):
        comm.all_reduce(torch.zeros(1), mesh.pp)
        if mesh.pp.rank == 0:
            for work in comm.send_recv(mesh.pp, [(tensor, 1)]):
                work.wait()
        elif mesh.pp.rank == 1:
            works = comm.send_recv(mesh.pp, [], [(tensor, 0)]) if ahead else []
            time.sleep(gap)
            start = time.perf_counter()
            for work in works or comm.send_recv(mesh.pp, [], [(tensor, 0)]):
                work.wait()
            waits.append(time.perf_counter() - start)
    value = torch.tensor([statistics.median(waits) if waits else 0.0], dtype=torch.float64)
    comm.all_reduce(value, mesh.pp, op="max")
    return float(value[0])


def model_step(name: str, pp: int, m: int, vpp: int, seconds: list[dict], latency: float) -> tuple[float, float]:
    """(bubble, step seconds) of the executor model with each rank's per-action `seconds`
    ((kind, micro-batch, chunk) -> s) and `latency` per transfer; the bubble is measured as
    the step's is: 1 - busy / (pp x span)."""
    table = build_schedule(name, pp, m, vpp)
    times = executor_model(table, pp, lambda r, a: seconds[r][(a.kind.value, a.microbatch, a.chunk)], latency)
    span = max(t[-1][1] for t in times)
    busy = sum(sum(seconds[r].values()) for r in range(pp))
    return 1.0 - busy / (pp * span), span


def balanced_rows(seconds: list[dict]) -> list[dict]:
    """The same actions with every action of a kind lasting that kind's mean over all ranks:
    the stages made equal, the F / B (/ I / W) ratio kept as measured."""
    kinds = {key[0] for row in seconds for key in row}
    mean = {kind: statistics.mean(v for row in seconds for key, v in row.items() if key[0] == kind) for kind in kinds}
    return [{key: mean[key[0]] for key in row} for row in seconds]


class StepUsage(NamedTuple):
    """One call of a case on this rank: its wall time, the main thread's CPU and time waiting
    for a core (schedstat), and the CPU of the process's other threads (gloo's)."""

    wall: float
    main_cpu: float
    main_queued: float
    other_cpu: float


def usage_recorded(step, record: list[StepUsage]):
    """`step`, appending each call's StepUsage to `record`."""

    def run() -> None:
        (cpu, queued), process, start = thread_schedstat(), time.process_time(), time.perf_counter()
        step()
        wall = time.perf_counter() - start
        cpu_after, queued_after = thread_schedstat()
        main = cpu_after - cpu
        record.append(StepUsage(wall, main, queued_after - queued, max(0.0, time.process_time() - process - main)))

    return run


def main_cpu_per_rank(usage: list[StepUsage], mesh: Mesh) -> list[list[float]]:
    """Per call, every pipeline rank's main-thread CPU seconds (a collective: every rank calls it)."""
    local = torch.tensor([u.main_cpu for u in usage], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(mesh.pp.size)]
    dist.all_gather(gathered, local, group=mesh.pp.group)
    return [[float(g[i]) for g in gathered] for i in range(len(usage))]


def scaled_rows(seconds: list[dict], totals: list[float]) -> list[dict]:
    """Each rank's actions stretched alike so that they add up to that rank's `totals[r]`: a
    step whose extra CPU (a peer's bookkeeping around the same compute) is spread over its actions."""
    return [{key: v * total / sum(row.values()) for key, v in row.items()} for row, total in zip(seconds, totals)]


def bubble_verdict(formula: float, balanced: list[float], stages: list[float], actions: list[float],
                   measured: float, within: float = 0.10) -> str:
    """Where the measured bubble's excess over the formula comes from, each step from CPU times
    of the traced steps (per repeat; medians printed): the executor model on equal stages at the
    measured mean F / B times (`balanced`), on each stage's own mean times per kind (`stages`: how
    unequal the stages are), on every action's own time (`actions`: per-action variation on top,
    which a loaded machine adds to), and as measured (wall: contention on top). The verdict
    rests on `stages`: a limit when even the stages' own times leave the formula + `within`."""
    allowed = formula * (1 + within)
    ivl = median_interval(stages)
    text = (f"bubble: formula {formula:.1%}, executor model on equal stages {statistics.median(balanced):.1%}, on "
            f"the stages' own mean times {statistics.median(stages):.1%} ({ivl.low:.1%}-{ivl.high:.1%}), on every "
            f"action's own time {statistics.median(actions):.1%}, measured {measured:.1%}. ")
    if ivl.low > allowed:
        cause = ("the measured F / B times and the transfer latency already do on equal stages"
                 if statistics.median(balanced) > allowed else "the stages' unequal times do")
        return text + (f"verdict: LIMIT. Without contention this model allows no bubble within {within:.0%} of the "
                       f"formula (> {allowed:.1%}): {cause}")
    if ivl.high <= allowed:
        return text + (f"verdict: NOT A LIMIT. The stages' own times allow <= {allowed:.1%}; the rest is per-action "
                       "variation and contention for the cores (wall times stretched unevenly)")
    return text + f"verdict: UNDECIDED. The stages' bubble straddles {allowed:.1%}: rerun with more rounds"


def rank_mean_rows(seconds: list[dict]) -> list[dict]:
    """Each rank's actions of a kind all lasting that rank's mean for the kind: the stages as
    they are, without the per-action variation."""
    out = []
    for row in seconds:
        kinds = {key[0] for key in row}
        mean = {kind: statistics.mean(v for key, v in row.items() if key[0] == kind) for kind in kinds}
        out.append({key: mean[key[0]] for key in row})
    return out


def limits(name: str, bubble: dict, action_cpu: list[dict], main_cpu: dict[str, list[list[float]]],
           shape: tuple[int, int, int], transfer: dict) -> dict:
    """The bubble's verdict and, for a schedule torch runs too, the ceiling of torch / fivefold.

    Everything here is CPU time, which load moves little, fed to the executor model (the same
    timing rule for both sides: an action starts once its rank is free and its input arrived),
    with the per-action CPU times of fivefold's median traced step (the same chunks torch runs).
    Torch's quiet step, per timed round: the model with each rank's actions stretched to that
    rank's main-thread CPU for torch's step in that round (its bookkeeping spread over its
    actions), each transfer costing what a receive posted at its consumer costs (torch posts it
    there). The floor, per round: the model with each rank's actions stretched to fivefold's
    main-thread CPU in the same round times the actions' share of it in the traced step (the
    compute alone, nothing around it, carrying the same round's load), each transfer arriving
    one measured latency after its send. ceiling = torch's step / the floor: the most any
    implementation of the same compute and schedule could gain on torch here. The model with
    fivefold's whole main-thread CPU gives the ratio the CPU times predict."""
    out = {"bubble_verdict": bubble_verdict(bubble["formula"], bubble["model_balanced_per_repeat"],
                                            bubble["model_stages_per_repeat"], bubble["model_cpu_per_repeat"],
                                            bubble["fivefold"])}
    peer, ours = f"torch {name}", f"fivefold {name}"
    if peer not in main_cpu:
        return out
    pp, m, vpp = shape
    late = max(transfer["latency_s"], transfer["wait_posted_late_s"])

    def step(totals: list[float], latency: float) -> float:
        return model_step(name, pp, m, vpp, scaled_rows(action_cpu, totals), latency)[1]

    share = bubble["action_share_of_main_cpu"]
    floors = [step([t * s for t, s in zip(totals, share)], transfer["latency_s"]) for totals in main_cpu[ours]]
    theirs = [step(totals, late) for totals in main_cpu[peer]]
    predicted = [t / step(totals, transfer["latency_s"]) for t, totals in zip(theirs, main_cpu[ours])]
    ceilings = [t / f for t, f in zip(theirs, floors)]
    return out | {"floor_s": statistics.median(floors), "ceiling": ceilings, "verdict": ceiling_verdict(peer, ceilings),
                  "cpu_predicted_ratio": predicted,
                  "fivefold_actions_share": share}


def _receiving_at_place(runner, step):
    """`step` with the runner posting each receive at its place in the table."""

    def run() -> None:
        ahead, runner.recvs_ahead = runner.recvs_ahead, 0
        try:
            step()
        finally:
            runner.recvs_ahead = ahead

    return run


def _bubble(busy: float, span: float, axis) -> float:
    """1 - sum of busy time / (stages x the longest step), over the pipeline ranks."""
    values = torch.tensor([busy, span], dtype=torch.float64)
    spans = values[1:].clone()
    comm.all_reduce(values[:1], axis)
    comm.all_reduce(spans, axis, op="max")
    return 1.0 - float(values[0]) / (axis.size * float(spans[0]))


def measure_bubbles(measured: dict, mesh: Mesh, latency: float, repeats: int = 5) -> dict:
    """Median measured bubble of each case over a few untimed steps, the median CPU seconds of a
    step (main thread: the largest over ranks; other threads: summed over ranks), where
    fivefold's idle time went in its median step, and that step's executor-model bubbles."""
    out = {}
    for name, (model, micro, busy, ours, theirs) in measured.items():
        ff, tt, cpu_ff, cpu_tt, other_ff, other_tt = [], [], [], [], [], []
        for _ in range(repeats):
            comm.all_reduce(torch.zeros(1), mesh.pp)
            thread = time.thread_time()
            with _cpu_seconds(mesh, cpu_ff, other_ff), model.runner.recording(CpuTimeline()) as timeline:
                ours()
            main = time.thread_time() - thread
            cpu_rows = [None] * mesh.pp.size
            dist.all_gather_object(cpu_rows, (timeline.cpu, main), group=mesh.pp.group)
            share = [sum(actions.values()) / spent for actions, spent in cpu_rows]  # the actions' part of the step
            cpu_rows = [actions for actions, _ in cpu_rows]
            ff.append((_bubble(busy_seconds(timeline.events), timeline.span, mesh.pp), gather_rows(timeline, mesh.pp),
                       cpu_rows, share))
            if theirs is None:
                tt.append(float("nan"))
                continue
            comm.all_reduce(torch.zeros(1), mesh.pp)
            busy.seconds, start = 0.0, time.perf_counter()
            with _cpu_seconds(mesh, cpu_tt, other_tt):
                theirs()
            tt.append(_bubble(busy.seconds, time.perf_counter() - start, mesh.pp))
        vpp, m = model.runner.vpp, model.runner.num_microbatches
        pp = mesh.pp.size
        models = [model_step(name, pp, m, vpp, traced[2], latency) for traced in ff]
        balanced = [model_step(name, pp, m, vpp, balanced_rows(traced[2]), latency)[0] for traced in ff]
        stages = [model_step(name, pp, m, vpp, rank_mean_rows(traced[2]), latency)[0] for traced in ff]
        bubble, rows, cpu_rows, share = sorted(ff, key=lambda traced: traced[0])[repeats // 2]
        wall_rows = [{(e.kind, e.microbatch, e.chunk): e.seconds for e in row if e.kind in COMPUTE_KINDS} for row in rows]
        out[name] = {"fivefold": bubble, "torch": sorted(tt)[repeats // 2], "idle": idle_breakdown(rows),
                     "mean_ms": {kind: 1e3 * statistics.mean(e.seconds for row in rows for e in row if e.kind == kind)
                                 for kind in sorted({e.kind for row in rows for e in row} & COMPUTE_KINDS)},
                     "busy_cpu_s": [sum(r.values()) for r in cpu_rows],
                     "model_cpu": model_step(name, pp, m, vpp, cpu_rows, latency)[0],
                     "model_cpu_step_s": model_step(name, pp, m, vpp, cpu_rows, latency)[1],
                     "model_wall": model_step(name, pp, m, vpp, wall_rows, latency)[0],
                     "model_cpu_per_repeat": [b for b, _ in models],
                     "model_cpu_step_s_per_repeat": [t for _, t in models],
                     "model_balanced_per_repeat": balanced, "model_stages_per_repeat": stages,
                     "action_cpu_s": cpu_rows, "action_share_of_main_cpu": share,
                     "cpu_s": {"fivefold": statistics.median(cpu_ff),
                               "torch": statistics.median(cpu_tt) if cpu_tt else float("nan")},
                     "other_threads_cpu_s": {"fivefold": statistics.median(other_ff),
                                             "torch": statistics.median(other_tt) if other_tt else float("nan")}}
    return out


@contextlib.contextmanager
def _cpu_seconds(mesh: Mesh, main: list[float], others: list[float]):
    """Appends the step's main-thread CPU seconds (largest over ranks) to `main` and its other
    threads' (gloo's, summed over ranks) to `others`."""
    process, thread = time.process_time(), time.thread_time()
    yield
    spent = time.thread_time() - thread
    main.append(_largest(spent, mesh.pp))
    other = torch.tensor([time.process_time() - process - spent], dtype=torch.float64)
    comm.all_reduce(other, mesh.pp)
    others.append(float(other[0]))


def formula_at(name: str, pp: int, m: int, vpp: int, measured: dict) -> float:
    """The papers' bubble share with this run's mean F / B / W durations instead of F = B = W
    (only zero-bubble's depends on them: its W fills the drain only as far as W lasts)."""
    t = measured["mean_ms"]
    if name != "zb-h1" or not {"F", "I", "W"} <= set(t):
        return bubble_formula(name, pp, m, vpp)
    units = bubble_units(name, pp, m, vpp, t["F"], t["I"], t["W"])
    return units / (m + units)


def _largest(value: float, axis) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, axis, op="max")
    return float(t[0])


def idle_breakdown(rows: list) -> list[dict[str, float]]:
    """Per rank, seconds computing (busy: equal across ranks when the stages are balanced) and
    not computing: before the first compute, after the last (the pipeline's fill and drain), in
    transfers (waits included) and in between (Python)."""
    span = max(e.end for row in rows for e in row)
    out = []
    for row in rows:
        compute = [e for e in row if e.kind in COMPUTE_KINDS]
        first, last = compute[0].start, compute[-1].end
        transfers = sum(e.seconds for e in row if e.kind not in COMPUTE_KINDS and first <= e.start < last)
        inside = last - first - sum(e.seconds for e in compute)
        out.append({"busy": sum(e.seconds for e in compute), "start": first, "end": span - last,
                    "transfers": transfers, "between": inside - transfers})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-h1")
    parser.add_argument("--malloc", choices=MALLOC_SETTINGS, default="default",
                        help="glibc's allocator for every case alike, as train.malloc (see the module docstring)")
    parser.add_argument("--recv-at-place", action="store_true",
                        help="also time fivefold posting each receive at its place in the table (no receive ahead)")
    parser.add_argument("--json", default="")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.seq_len=64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    malloc = apply_malloc(args.malloc)
    dist.init_process_group("gloo")
    pp = dist.get_world_size()
    config = load_config(args.config, [f"layout.pp={pp}", f"layout.grad_accum={args.micro_batches}", *args.overrides])
    mesh = Mesh.build(validate(config, pp).layout)
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    batch = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    measured: dict = {}
    cases = build_cases(config, mesh, batch, args.schedules.split(","), measured, args.recv_at_place)
    usage: dict[str, list[StepUsage]] = {name: [] for name in cases}
    cases = {name: usage_recorded(case, usage[name]) for name, case in cases.items()}
    results = alternate(cases, warmup=args.warmup, rounds=args.rounds, sync=dist.barrier)
    gather_peak_rss(results)
    main_cpu = {name: main_cpu_per_rank(records[args.warmup:], mesh) for name, records in usage.items()}
    boundary = next(iter(measured.values()))[1][0].inputs.shape + (config.model.hidden,)
    transfer = transfer_cost(mesh, boundary)
    bubbles = measure_bubbles(measured, mesh, transfer["latency_s"])
    action_cpu = {name: bubble.pop("action_cpu_s") for name, bubble in bubbles.items()}
    meta = {"pp": pp, "micro_batches": args.micro_batches, "config": args.config, "overrides": args.overrides,
            "malloc": malloc.to_dict(), "transfer": transfer}
    for name, measured_bubble in bubbles.items():
        vpp = 2 if name == "interleaved" else 1
        meta[f"bubble {name}"] = measured_bubble | {"formula": bubble_formula(name, pp, args.micro_batches, vpp),
                                                    "formula_at_measured_times": formula_at(name, pp, args.micro_batches,
                                                                                            vpp, measured_bubble)}
        meta[f"bubble {name}"] |= limits(name, meta[f"bubble {name}"], action_cpu.pop(name), main_cpu,
                                         (pp, args.micro_batches, vpp), transfer)
    schedules = args.schedules.split(",")
    first = next(name for name in schedules if name not in OURS_ONLY)  # a case torch runs too
    ours_only_peer = "fivefold 1f1b" if "1f1b" in schedules else f"fivefold {first}"
    comparison = compare(f"pipeline schedules, pp={pp}, m={args.micro_batches}", results, f"torch {first}", meta)
    if mesh.rank == 0:
        print(f"allocator for every case, fivefold's and torch's alike: malloc={malloc.setting} ({malloc.detail})")
        print_table(comparison)
        for name in bubbles:
            b = meta[f"bubble {name}"]
            peer = f"torch {name}" if name not in OURS_ONLY else ours_only_peer
            pairs = zip(results[f"fivefold {name}"].seconds, results[peer].seconds)
            ratio = statistics.median(a / b for a, b in pairs)
            meta[f"bubble {name}"][f"time_ratio_over {peer}"] = ratio
            print(f"{name:12s} time fivefold {name} / {peer} {ratio:.3f}   bubble fivefold {b['fivefold']:.1%}  "
                  f"torch {b['torch']:.1%}  formula {b['formula']:.1%}   CPU s/step fivefold "
                  f"{b['cpu_s']['fivefold']:.3f} torch {b['cpu_s']['torch']:.3f}")
            idle = "  ".join(f"rank {r}: " + " ".join(f"{k} {v * 1e3:.0f}" for k, v in parts.items())
                             for r, parts in enumerate(b["idle"]))
            print(f"{'':12s} idle ms  {idle}")
            means = " ".join(f"{k} {v:.0f}" for k, v in b["mean_ms"].items())
            print(f"{'':12s} mean ms  {means}   formula at these times {b['formula_at_measured_times']:.1%}")
            print(f"{'':12s} CPU s/step other threads fivefold {b['other_threads_cpu_s']['fivefold']:.3f} torch "
                  f"{b['other_threads_cpu_s']['torch']:.3f}   busy CPU s per rank "
                  + " ".join(f"{v:.3f}" for v in b["busy_cpu_s"])
                  + f"   executor-model bubble with this step's CPU times {b['model_cpu']:.1%}, "
                  f"wall times {b['model_wall']:.1%}")
            if name in OURS_ONLY and ours_only_peer.split()[-1] in bubbles:
                other = bubbles[ours_only_peer.split()[-1]]["model_cpu_step_s"]
                print(f"{'':12s} step of the CPU-time model {b['model_cpu_step_s']:.3f} s, {ours_only_peer}'s "
                      f"{other:.3f} s: ratio {other / b['model_cpu_step_s']:.3f} "
                      "(CPU times: less load-dependent than wall times, not independent of it)")
            print(f"{'':12s} {b['bubble_verdict']}")
            if "ceiling" in b:
                low, high, _ = median_interval(b["cpu_predicted_ratio"])
                share = " ".join(f"{v:.1%}" for v in b["fivefold_actions_share"])
                print(f"{'':12s} floor (executor model on the actions' CPU times) {b['floor_s']:.3f} s; the actions' share "
                      f"of fivefold's main-thread CPU per rank {share}; torch / fivefold predicted from CPU "
                      f"{statistics.median(b['cpu_predicted_ratio']):.3f} ({low:.3f}-{high:.3f})")
                print(f"{'':12s} {b['verdict']}")
        print(f"transfer per micro-batch and boundary: {transfer['bytes']} bytes, latency median "
              f"{transfer['latency_s'] * 1e3:.3f} ms (min {transfer['latency_min_s'] * 1e3:.3f}), other threads' CPU "
              f"{transfer['other_threads_cpu_s'] * 1e3:.3f} ms per transfer (both ranks); a consumer waits "
              f"{transfer['wait_posted_late_s'] * 1e3:.3f} ms for data already sent if its receive is posted at "
              f"the consumer, {transfer['wait_posted_ahead_s'] * 1e3:.3f} ms if posted ahead")
        path = args.json or os.path.join("runs", f"bench_pp_pp{pp}.json")
        print(f"wrote {write_json([comparison], path)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
