"""Planner search speed: how long `fivefold plan` takes to rank the layouts of a cluster.

    PYTHONPATH=$PWD python benchmarks/bench_planner.py [--repeat 3] [--json out.json]

Cases: a 64-GPU MoE search (Mixtral 8x7B, H100, global batch 512) and a 16,384-GPU search of
Llama 3 405B (H100, global batch 2048), both for the top 10 layouts as `fivefold plan` asks.
Reports, per case, the wall-clock and the process CPU time of the fastest of ``--repeat``
runs (the CPU time is what to compare on a shared machine), the number of candidate
structures, and the best layout found.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fivefold.planner import load_model, search
from fivefold.planner.hardware import get_hardware
from fivefold.planner.search import structures

CASES = {
    "mixtral-8x7b, 64 x H100": dict(model="mixtral-8x7b", gpus=64, hardware="H100-80GB", global_batch=512),
    "llama3-405b, 16384 x H100": dict(model="llama3-405b", gpus=16384, hardware="H100-80GB", global_batch=2048),
}


def time_case(case: dict, repeat: int, top: int) -> dict:
    model = load_model(case["model"])
    n_structures = sum(1 for _ in structures(model, case["gpus"], get_hardware(case["hardware"]),
                                             case["global_batch"]))
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        ranked = search(model, gpus=case["gpus"], hardware=case["hardware"], global_batch=case["global_batch"],
                        top=top)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    lay, est = ranked[0]
    return {"wall_s": min(walls), "cpu_s": min(cpus), "structures": n_structures, "best": lay.short(),
            "best_step_s": est.step_time_s, "best_mfu": est.mfu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    results = {name: time_case(case, args.repeat, args.top) for name, case in CASES.items()}
    print(f"{'case':28} {'wall s':>7} {'cpu s':>7} {'shapes':>7}  best layout (step s, MFU)")
    for name, r in results.items():
        print(f"{name:28} {r['wall_s']:7.2f} {r['cpu_s']:7.2f} {r['structures']:7d}  "
              f"{r['best']} ({r['best_step_s']:.2f} s, {r['best_mfu']:.1%})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
