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
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def alternate(
    cases: dict[str, Callable[[], None]],
    warmup: int = 1,
    rounds: int = 5,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, CaseResult]:
    """Time every case once per round, rotating the order each round."""
    names = list(cases)
    results = {n: CaseResult(n) for n in names}
    for name in names:
        for _ in range(warmup):
            cases[name]()
        sync()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            cases[name]()
            sync()
            results[name].seconds.append(time.perf_counter() - start)
    return results


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


def run_bench_cli(argv: list[str]) -> int:
    """`fivefold bench NAME [args]`: run one of the benchmarks in benchmarks/ by name."""
    import runpy
    import sys

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    available = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py")) if root.is_dir() else []
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fivefold bench NAME [options]\nbenchmarks: " + (", ".join(available) or "none found"))
        return 0
    script = root / f"bench_{argv[0]}.py"
    if not script.exists():
        print(f"fivefold: error: no benchmark '{argv[0]}'; available: {', '.join(available)}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0
