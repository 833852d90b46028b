"""Side-by-side benchmarks: alternate implementations in one run, report median ratios.

Shared machines are noisy, so absolute times from different runs are not comparable.
`alternate` runs each case's warm-up, then repeats rounds in which every case runs once,
in a rotating order; `ratios` reports, for each case, the median over rounds of
time(case) / time(baseline) measured in the same round. Multi-process benchmarks call it
on every rank with a `sync` function (a barrier) so all ranks time the same thing.
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class CaseResult:
    name: str
    seconds: list[float] = field(default_factory=list)  # one per round
    peak_rss_mb: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class Comparison:
    title: str
    baseline: str
    cases: dict[str, CaseResult]
    ratios: dict[str, float]  # median per-round time(case) / time(baseline)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "baseline": self.baseline,
            "ratios": self.ratios,
            "cases": {k: asdict(v) | {"median_s": v.median} for k, v in self.cases.items()},
            "meta": self.meta,
        }


def peak_rss_mb() -> float:
    """Peak resident memory of this process since start or the last `reset_peak_rss` (MB)."""
    hwm = _proc_status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    rss = _proc_status_mb("VmRSS")
    return rss if rss is not None else peak_rss_mb()


def reset_peak_rss() -> None:
    """Start a new high-water mark at the current resident size (Linux; elsewhere a no-op, so
    peaks then accumulate over the process's life)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _proc_status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # the kernel reports KiB
    except OSError:
        pass
    return None


def _run_measured(case: Callable[[], None], result: CaseResult) -> None:
    """Run one call of a case, keeping the case's highest peak RSS and its rise above the
    resident size at the start of the call (what the call itself allocates)."""
    reset_peak_rss()
    before = current_rss_mb()
    case()
    peak = peak_rss_mb()
    result.peak_rss_mb = max(result.peak_rss_mb, peak)
    result.extra["step_rise_mb"] = max(result.extra.get("step_rise_mb", 0.0), peak - before)


def alternate(
    cases: dict[str, Callable[[], None]],
    warmup: int = 1,
    rounds: int = 5,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, CaseResult]:
    """Time every case once per round, rotating the order each round.

    Each case's peak RSS is measured around its own calls (warm-up included), so cases that
    alternate in one process are not charged for each other's transient peaks; memory that
    another case keeps alive between calls still counts, as it would in a real process.
    """
    names = list(cases)
    results = {n: CaseResult(n) for n in names}
    for name in names:
        for _ in range(warmup):
            _run_measured(cases[name], results[name])
        sync()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            _run_measured(cases[name], results[name])
            sync()
            results[name].seconds.append(time.perf_counter() - start)
    return results


def gather_peak_rss(results: dict[str, CaseResult]) -> None:
    """Collective over the default group: every case's peak RSS per rank into
    `extra["peak_rss_mb_per_rank"]`, and `peak_rss_mb` becomes the largest of them."""
    import torch
    import torch.distributed as dist

    local = torch.tensor([results[n].peak_rss_mb for n in results], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    for i, name in enumerate(results):
        per_rank = [round(float(g[i]), 1) for g in gathered]
        results[name].extra["peak_rss_mb_per_rank"] = per_rank
        results[name].peak_rss_mb = max(per_rank)


def compare(title: str, results: dict[str, CaseResult], baseline: str, meta: dict | None = None) -> Comparison:
    base = results[baseline].seconds
    ratios = {
        name: statistics.median(t / b for t, b in zip(res.seconds, base)) for name, res in results.items()
    }
    info = {"python": platform.python_version(), "machine": platform.machine()} | (meta or {})
    return Comparison(title, baseline, results, ratios, info)


def print_table(comparison: Comparison) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=comparison.title)
    table.add_column("case")
    table.add_column("median s", justify="right")
    table.add_column(f"ratio vs {comparison.baseline}", justify="right")
    table.add_column("peak RSS MB", justify="right")
    for name, res in comparison.cases.items():
        table.add_row(name, f"{res.median:.4f}", f"{comparison.ratios[name]:.3f}", f"{res.peak_rss_mb:.0f}")
    Console().print(table)


def write_json(comparisons: list[Comparison], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([c.to_json() for c in comparisons], indent=2))
    return path


@dataclass(frozen=True)
class SuiteEntry:
    """How `fivefold bench all` runs one benchmark script: processes, arguments, output flag."""

    name: str
    processes: int
    args: tuple[str, ...]
    out_flag: str = "--out"
    without_deepspeed: tuple[str, ...] = ()  # arguments that leave DeepSpeed's cases out


DEEPSPEED_DP_CASES = "deepspeed-zero1,deepspeed-zero2,deepspeed-zero3"
SUITE = (
    SuiteEntry("single", 1, ("--rounds", "5", "--steps", "1", "--threads", "1", "--compile")),
    SuiteEntry("dp", 2, ("--rounds", "3"), "--json", ("--skip", DEEPSPEED_DP_CASES)),
    SuiteEntry("tp", 2, ("--rounds", "3")),
    SuiteEntry("pp", 2, ("--rounds", "3", "--micro-batches", "8"), "--json"),
    SuiteEntry("ep", 2, ("--rounds", "5"), without_deepspeed=("--no-deepspeed",)),
    SuiteEntry("cp", 2, ("--seq", "2048", "--rounds", "3")),
)


def benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def suite_command(entry: SuiteEntry, out: Path, with_deepspeed: bool) -> list[str]:
    import sys

    script = str(benchmarks_dir() / f"bench_{entry.name}.py")
    args = [*entry.args, *(() if with_deepspeed else entry.without_deepspeed), entry.out_flag, str(out)]
    if entry.processes == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={entry.processes}",
            script, *args]


def run_suite(out_dir: Path, only: list[str]) -> dict[str, list[dict] | str]:
    """Run every benchmark of SUITE (or `only`) one after another; name → comparisons or error."""
    import importlib.util
    import os
    import subprocess

    with_deepspeed = importlib.util.find_spec("deepspeed") is not None
    root = benchmarks_dir().parent
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])))
    outcomes: dict[str, list[dict] | str] = {}
    for entry in SUITE:
        if only and entry.name not in only:
            continue
        out = out_dir / f"{entry.name}.json"
        out.unlink(missing_ok=True)
        print(f"== bench {entry.name}", flush=True)
        code = subprocess.call(suite_command(entry, out, with_deepspeed), env=env, cwd=root)
        outcomes[entry.name] = json.loads(out.read_text()) if code == 0 and out.exists() else f"exit code {code}"
    return outcomes


# The comparisons the summary states as "peer time / fivefold time": (benchmark, fivefold
# case, other case, what the row means). A row appears when one comparison of that benchmark
# ran both cases side by side; the other case is a peer, or a fivefold case the first is
# held against (ZeRO against plain data parallel, zero-bubble against 1F1B).
HEADLINE = (
    ("single", "fivefold", "transformers", "single process vs transformers LlamaForCausalLM"),
    ("single", "fivefold+compile", "transformers", "single process, train.compile=true, vs transformers eager"),
    ("dp", "fivefold-dp", "torch-ddp", "dp=2 vs torch DDP"),
    ("dp", "fivefold-zero1", "torch-zero1", "ZeRO-1 vs torch ZeroRedundancyOptimizer + DDP"),
    ("dp", "fivefold-zero1", "deepspeed-zero1", "ZeRO-1 vs DeepSpeed ZeRO-1"),
    ("dp", "fivefold-zero2", "deepspeed-zero2", "ZeRO-2 vs DeepSpeed ZeRO-2"),
    ("dp", "fivefold-zero3", "torch-fsdp2", "ZeRO-3 vs torch FSDP2 fully_shard"),
    ("dp", "fivefold-zero3", "deepspeed-zero3", "ZeRO-3 vs DeepSpeed ZeRO-3"),
    ("dp", "fivefold-zero2", "fivefold-dp", "ZeRO-2 vs fivefold dp (1.00 = no cost for sharding)"),
    ("dp", "fivefold-zero3", "fivefold-dp", "ZeRO-3 vs fivefold dp (1.00 = no cost for sharding)"),
    ("tp", "fivefold", "dtensor", "tp=2 vs DTensor parallelize_module"),
    ("pp", "fivefold gpipe", "torch gpipe", "pp=2 GPipe vs torch.distributed.pipelining"),
    ("pp", "fivefold 1f1b", "torch 1f1b", "pp=2 1F1B vs torch.distributed.pipelining"),
    ("pp", "fivefold interleaved", "torch interleaved", "pp=2 interleaved vs torch.distributed.pipelining"),
    ("pp", "fivefold zb-h1", "fivefold 1f1b", "pp=2 zero-bubble (zb-h1) vs fivefold 1F1B"),
    ("ep", "fivefold-grouped", "deepspeed", "MoE layer, ep=2, vs DeepSpeed MoE"),
)


def per_round_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator / denominator, both timed in the same round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def headline_rows(outcomes: dict[str, list[dict] | str]) -> list[tuple[str, str, float, float]]:
    """(row, comparison title, time ratio other/fivefold, peak RSS ratio other/fivefold) for
    every HEADLINE pair that some comparison measured side by side."""
    rows = []
    for bench_name, ours, other, label in HEADLINE:
        result = outcomes.get(bench_name)
        for comparison in result if isinstance(result, list) else []:
            cases = comparison["cases"]
            if ours in cases and other in cases:
                ratio = per_round_ratio(cases[other]["seconds"], cases[ours]["seconds"])
                memory = cases[other]["peak_rss_mb"] / max(cases[ours]["peak_rss_mb"], 1e-9)
                rows.append((label, comparison["title"], ratio, memory))
    return rows


def suite_markdown(outcomes: dict[str, list[dict] | str], meta: dict | None = None) -> str:
    """The summary (peer / fivefold per pair), then one table per comparison."""
    lines = ["# fivefold benchmarks", ""]
    if meta:
        lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    lines += ["## Summary", "",
              "Time ratio = median over rounds of (other case's step time / fivefold's), both timed in the same "
              "round: above 1 means fivefold is faster. Memory ratio = other's peak RSS / fivefold's (largest "
              "over ranks): above 1 means fivefold holds less.", "",
              "| comparison | measured in | time ratio | memory ratio |", "|---|---|---|---|"]
    lines += [f"| {label} | {title} | {ratio:.3f} | {memory:.2f} |"
              for label, title, ratio, memory in headline_rows(outcomes)]
    lines += ["", "## Every comparison", "",
              "Ratios below are medians of per-round time(case) / time(baseline); below 1 means faster than "
              "the baseline.", ""]
    for name, result in outcomes.items():
        if isinstance(result, str):
            lines += [f"### {name}", "", f"did not finish: {result}", ""]
            continue
        for comparison in result:
            lines += [f"### {name}: {comparison['title']}", "",
                      f"| case | median s | ratio vs {comparison['baseline']} | peak RSS MB |", "|---|---|---|---|"]
            for case, values in comparison["cases"].items():
                lines.append(f"| {case} | {values['median_s']:.4f} | {comparison['ratios'][case]:.3f} "
                             f"| {values['peak_rss_mb']:.0f} |")
            lines.append("")
    return "\n".join(lines)


def machine_note() -> dict[str, str]:
    """What the numbers were measured on: CPU, cores, load average at the end, torch."""
    import os

    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"machine": platform.processor() or platform.machine(), "cores": str(os.cpu_count()),
            "load average (1/5/15 min) at the end": "/".join(f"{x:.1f}" for x in load),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_bench_all(argv: list[str]) -> int:
    """`fivefold bench all [--only a,b] [--out DIR]`: every comparison, one table (markdown + JSON)."""
    import argparse

    parser = argparse.ArgumentParser(prog="fivefold bench all")
    parser.add_argument("--only", default="", help=f"comma list of: {', '.join(e.name for e in SUITE)}")
    parser.add_argument("--out", default="bench_results", help="folder for every JSON and all.md")
    args = parser.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - {e.name for e in SUITE})
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(e.name for e in SUITE)}")
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = run_suite(out_dir, only)
    (out_dir / "all.json").write_text(json.dumps(outcomes, indent=2))
    (out_dir / "all.md").write_text(suite_markdown(outcomes, machine_note()))
    print(f"wrote {out_dir / 'all.md'} and {out_dir / 'all.json'}")
    return 0 if all(not isinstance(r, str) for r in outcomes.values()) else 1


def run_bench_cli(argv: list[str]) -> int:
    """`fivefold bench NAME [args]`: run one of the benchmarks in benchmarks/ by name."""
    import runpy
    import sys

    root = benchmarks_dir()
    available = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py")) if root.is_dir() else []
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fivefold bench NAME [options] | fivefold bench all\nbenchmarks: "
              + (", ".join(available) or "none found"))
        return 0
    if argv[0] == "all":
        return run_bench_all(argv[1:])
    script = root / f"bench_{argv[0]}.py"
    if not script.exists():
        print(f"fivefold: error: no benchmark '{argv[0]}'; available: {', '.join(available)}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0
