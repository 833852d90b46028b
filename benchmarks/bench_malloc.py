"""fivefold's training step under glibc's default allocator and under `train.malloc=retain`.

The allocator setting is process-wide and cannot be switched back within a process, so every
(case, setting) runs in a fresh launch of its own, and the two settings of a case run back to
back, in an order that alternates over cases and rounds. Each launch builds one fivefold layout
on the `small` preset (what bench_dp and bench_pp run), takes warm-up steps, then times
`--steps` full training steps (forward, backward, gradient reduction, clip, AdamW), recording
per rank: wall time, CPU time of the process (all threads: compute and gloo's), page faults
(getrusage minflt) and peak resident memory over the process's life (VmHWM: building, warm-up
and the steps). The report is, per case, the median over rounds of retain / default in each
round (CPU: both ranks' sum; wall: rank 0; faults and memory: per rank), and the share of
default's CPU per step that the faults retain avoids cost at this machine's measured price of
one fault: a bound on what retain can save that the machine's load does not move.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 benchmarks/bench_malloc.py --rounds 3

Cases: single (one process), dp, zero2, zero3 (dp=2), 1f1b, zb-h1 (pp=2, 8 micro-batches).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fivefold.job.malloc import MALLOC_SETTINGS, apply_malloc  # noqa: E402

PP = ("layout.pp=2", "layout.grad_accum=8")
CASES: dict[str, tuple[int, tuple[str, ...]]] = {  # name: (processes, overrides of the small preset)
    "single": (1, ()),
    "dp": (2, ("layout.dp=2",)),
    "zero2": (2, ("layout.dp=2", "layout.zero=2")),
    "zero3": (2, ("layout.dp=2", "layout.zero=3")),
    "1f1b": (2, (*PP, "layout.pp_schedule=1f1b")),
    "zb-h1": (2, (*PP, "layout.pp_schedule=zb-h1")),
}


def proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(case: str, setting: str, warmup: int, steps: int, out: str) -> None:
    """One launch: apply `setting`, build the case's layout, measure its steps, rank 0 writes `out`."""
    state = apply_malloc(setting)  # first, as `fivefold train` does
    import torch
    import torch.distributed as dist

    from fivefold.config import load_config
    from fivefold.rules.layout import validate
    from fivefold.data.loader import open_training_data
    from fivefold.parallel.mesh import Mesh
    from fivefold.train import build, train_step

    torch.set_num_threads(1)
    processes, overrides = CASES[case]
    if processes > 1:
        dist.init_process_group("gloo")
    config = validate(load_config("small", list(overrides)), processes)
    mesh = Mesh.build(config.layout) if processes > 1 else Mesh.single(config.layout)
    _, sampler = open_training_data(config)
    model = build(config, mesh, torch.device("cpu"))
    per_step: dict[str, list[float]] = {"wall_s": [], "cpu_s": [], "minflt": []}
    for step in range(warmup + steps):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        train_step(model, sampler, step)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        if step >= warmup:
            per_step["wall_s"].append(wall)
            per_step["cpu_s"].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            per_step["minflt"].append(after.ru_minflt - before.ru_minflt)
    mine = {k: statistics.median(v) for k, v in per_step.items()}
    mine |= {"peak_rss_mb": proc_status_mb("VmHWM"), "rss_after_mb": proc_status_mb("VmRSS"), "malloc": state.to_dict()}
    ranks = [mine]
    if processes > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if mesh.rank == 0:
        Path(out).write_text(json.dumps(ranks))
    if processes > 1:  # as run.py leaves a job: gloo's threads joined while the interpreter lives
        dist.barrier()
        dist.destroy_process_group()
        mesh.release()
        del model
        gc.collect()


def launch(case: str, setting: str, args: argparse.Namespace, out: Path) -> list[dict]:
    processes, _ = CASES[case]
    me = [str(Path(__file__).resolve()), "--worker", case, "--malloc", setting, "--warmup", str(args.warmup),
          "--steps", str(args.steps), "--out", str(out)]
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out.unlink(missing_ok=True)
    job = subprocess.run([sys.executable, *runner, *me], env=env, stdout=subprocess.DEVNULL)
    if job.returncode != 0 or not out.exists():
        raise SystemExit(f"the {case} launch under malloc={setting} failed (exit code {job.returncode}); "
                         "its output is above")
    return json.loads(out.read_text())


def summary(ranks: list[dict]) -> dict[str, float | list[float]]:
    return {"cpu_s": sum(r["cpu_s"] for r in ranks), "wall_s": ranks[0]["wall_s"],
            "minflt": [r["minflt"] for r in ranks], "peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in ranks],
            "rss_after_mb": [round(r["rss_after_mb"], 1) for r in ranks], "malloc": ranks[0]["malloc"]["detail"]}


def measure(args: argparse.Namespace, cases: list[str]) -> dict[str, list[dict[str, dict]]]:
    """case -> per round {setting: summary}; the settings of a case run back to back."""
    rounds: dict[str, list[dict[str, dict]]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for c, case in enumerate(cases):
                order = MALLOC_SETTINGS if (r + c) % 2 == 0 else MALLOC_SETTINGS[::-1]
                rounds[case].append({s: summary(launch(case, s, args, Path(tmp) / "out.json")) for s in order})
                print(f"round {r} {case}: " + "  ".join(
                    f"{s} CPU {v['cpu_s']:.3f} s wall {v['wall_s']:.3f} s faults {v['minflt']} peak MB {v['peak_rss_mb']}"
                    for s, v in rounds[case][-1].items()), flush=True)
    return rounds


def fault_cost_s(rounds: int = 15) -> float:
    """CPU seconds one page fault costs here: a fresh 64 MiB tensor (its own mmap under glibc's
    default: above the largest self-adjusted threshold) filled, against a resident one filled,
    over the faults the first takes; the median of alternated pairs."""
    import torch

    torch.set_num_threads(1)
    numel = (64 << 20) // 4
    resident = torch.zeros(numel)
    costs = []
    for _ in range(rounds):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
        torch.empty(numel).fill_(1.0)
        fresh, faults = time.thread_time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        start = time.thread_time()
        resident.fill_(1.0)
        costs.append((fresh - (time.thread_time() - start)) / max(faults, 1))
    return statistics.median(costs)


def ratio(rounds: list[dict[str, dict]], key: str) -> float:
    return statistics.median(r["retain"][key] / r["default"][key] for r in rounds)


def per_rank_median(rounds: list[dict[str, dict]], setting: str, key: str) -> list[float]:
    return [statistics.median(r[setting][key][i] for r in rounds) for i in range(len(rounds[0][setting][key]))]


def report(rounds: dict[str, list[dict[str, dict]]], per_fault_s: float) -> dict:
    load = os.getloadavg()
    print(f"\nretain / default, median over {len(next(iter(rounds.values())))} rounds "
          f"(load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}); faults per step and peak RSS per rank, medians")
    print(f"{'case':8s} {'CPU':>6s} {'wall':>6s}   {'faults default':>18s} {'faults retain':>18s}   "
          f"{'peak MB default':>18s} {'peak MB retain':>18s}   {'faults saved, % of CPU':>22s}")
    table = {}
    for case, per_round in rounds.items():
        row = {"cpu_ratio": ratio(per_round, "cpu_s"), "wall_ratio": ratio(per_round, "wall_s")}
        for s in MALLOC_SETTINGS:
            row[f"minflt_{s}"] = per_rank_median(per_round, s, "minflt")
            row[f"peak_rss_mb_{s}"] = per_rank_median(per_round, s, "peak_rss_mb")
        # what the faults retain avoids cost at this machine's price per fault, against default's CPU per step
        saved = (sum(row["minflt_default"]) - sum(row["minflt_retain"])) * per_fault_s
        row["fault_share_of_cpu"] = saved / statistics.median(r["default"]["cpu_s"] for r in per_round)
        table[case] = row | {"rounds": per_round}
        cells = [" ".join(f"{v:.0f}" for v in row[k]) for k in
                 ("minflt_default", "minflt_retain", "peak_rss_mb_default", "peak_rss_mb_retain")]
        print(f"{case:8s} {row['cpu_ratio']:6.3f} {row['wall_ratio']:6.3f}   {cells[0]:>18s} {cells[1]:>18s}   "
              f"{cells[2]:>18s} {cells[3]:>18s}   {row['fault_share_of_cpu']:>22.2%}")
    print(f"one page fault costs {per_fault_s * 1e6:.2f} us of CPU here (a fresh 64 MiB tensor filled against a "
          "resident one); the last column is what retain's fewer faults can save, whatever the load")
    return {"load_average": load, "fault_cost_s": per_fault_s, "cases": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default="runs/bench/malloc.json")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--malloc", default="default", choices=MALLOC_SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.malloc, args.warmup, args.steps, args.out)
        return
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    per_fault_s = fault_cost_s()
    result = report(measure(args, cases), per_fault_s)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
