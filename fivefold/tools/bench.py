"""Side-by-side benchmarks: alternate implementations in one run, report median ratios.

Shared machines are noisy, so absolute times from different runs are not comparable.
`alternate` runs each case's warm-up, then repeats rounds in which every case runs once,
in a rotating order; `ratios` reports, for each case, the median over rounds of
time(case) / time(baseline) measured in the same round. Multi-process benchmarks call it
on every rank with a `sync` function (a barrier) so all ranks time the same thing.

Memory is measured apart: with FIVEFOLD_BENCH_ALONE=<case> a benchmark script builds only that
case (every case's construction is guarded by `builds`), and `alternate` runs its warm-up and
a few calls, writes the case's peak RSS per rank and exits, so no other case of the benchmark
is alive. FIVEFOLD_BENCH_ALONE=- builds no case: the benchmark's idle process, whose resident
size (imports, process group, data) is the baseline subtracted from every case's peak.
`fivefold bench all` runs one such process per case after the timed run (`memory_pass`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, NoReturn


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


def thread_schedstat() -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a core) of the calling thread, from
    Linux's schedstat; without it, the thread's CPU time and no waiting. The waiting part is
    what other threads (gloo's, other processes') took from this one."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
    except (OSError, ValueError):
        return time.thread_time(), 0.0
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


ALONE_ENV = "FIVEFOLD_BENCH_ALONE"  # the one case this process builds and measures
ALONE_OUT_ENV = "FIVEFOLD_BENCH_ALONE_OUT"  # where rank 0 writes that measurement (JSON)
IDLE_CASE = "-"  # build no case: the idle process whose resident size is the baseline
ALONE_CALLS = 2  # calls of a case run alone, after its warm-up


def alone_case() -> str | None:
    """The case named by FIVEFOLD_BENCH_ALONE, or None when every case runs (timed)."""
    return os.environ.get(ALONE_ENV) or None


def builds(*cases: str) -> bool:
    """Whether to build what any of `cases` needs: always, unless one case runs alone
    (FIVEFOLD_BENCH_ALONE) and it is none of them. Benchmark scripts guard each case's
    construction with it, so that a case measured alone has no other case's model,
    optimizer or buffers alive beside it."""
    alone = alone_case()
    return alone is None or alone in cases


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
    With FIVEFOLD_BENCH_ALONE set, it measures that case's memory alone and ends the process
    (`measure_alone`): the rest of a benchmark script needs the cases that were not built.
    """
    alone = alone_case()
    if alone is not None:
        measure_alone(cases, alone, warmup, sync)
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


def measure_alone(cases: dict[str, Callable[[], None]], alone: str, warmup: int,
                  sync: Callable[[], None]) -> NoReturn:
    """Run the one case built in this process (its warm-up, then ALONE_CALLS calls) and write,
    per rank, the resident size before the calls, the peak during them and the size after;
    for IDLE_CASE run nothing and write the resident size of the idle process. Then exit."""
    if alone != IDLE_CASE and alone not in cases:
        raise SystemExit(f"{ALONE_ENV}={alone!r} names no case of this benchmark; "
                         f"cases: {', '.join(cases)} (or {IDLE_CASE} for none)")
    sync()
    before = current_rss_mb()
    reset_peak_rss()
    calls = 0 if alone == IDLE_CASE else warmup + ALONE_CALLS
    for _ in range(calls):
        cases[alone]()
        sync()
    measured = {"rss_before_mb": before, "peak_rss_mb": max(peak_rss_mb(), before), "rss_after_mb": current_rss_mb(),
                "live_tensors_mb": live_tensor_mb()}
    per_rank = _gather_per_rank(list(measured.values()))
    record = {"case": alone, "calls": calls, "cases": list(cases)}
    record |= {f"{key}_per_rank": [round(r[i], 1) for r in per_rank] for i, key in enumerate(measured)}
    if _rank() == 0:
        path = os.environ.get(ALONE_OUT_ENV)
        if path:
            Path(path).write_text(json.dumps(record, indent=2))
        else:
            print(json.dumps(record))
    _end_process_group()
    raise SystemExit(0)


def live_tensor_mb() -> float:
    """MB of the CPU tensor storages that Python objects reference now (each storage once): the
    model, gradients, optimizer state, buffers. Storages only C++ holds (DDP's buckets, autograd's
    saved tensors, a collective's temporaries) are not found, and neither is what the allocator
    keeps after tensors are freed; 0 where torch was never imported."""
    import gc
    import sys
    import warnings

    torch = sys.modules.get("torch")
    if torch is None:
        return 0.0
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":  # type(): no __class__ hooks
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a fake tensor (compile's) warns instead of failing
                try:
                    storage = obj.untyped_storage()
                    pointer, size = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError, TypeError, UserWarning):  # wrapper or fake: no data
                    continue
            if pointer:
                storages[pointer] = max(storages.get(pointer, 0), size)
    return sum(storages.values()) / 2**20


def _distributed():
    """torch.distributed when this process has a process group (without importing torch)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist is not None else 0


def _gather_per_rank(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (one list per rank), or just this process's without a group."""
    dist = _distributed()
    if dist is None:
        return [values]
    import torch

    local = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [g.tolist() for g in gathered]


def _end_process_group() -> None:
    dist = _distributed()
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()


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


class MedianInterval(NamedTuple):
    """Where the median of the distribution a benchmark's per-round values come from lies."""

    low: float
    high: float
    coverage: float  # the probability that [low, high] holds that median


def median_interval(values: list[float], confidence: float = 0.9) -> MedianInterval:
    """A distribution-free interval for the median: the order statistics x(k) and x(n+1-k),
    with the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is at least `confidence`.
    It assumes only that rounds are independent draws, not that round times are normal (a loaded
    machine's are not). With too few values for `confidence`, the whole range and its coverage,
    1 - 2^(1-n): 3 rounds cover the median only 75% of the time, 11 rounds [x(3), x(9)] 93%."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    ordered, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        below = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(Binomial(n, 1/2) < k)
        return 1.0 - 2.0 * below

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return MedianInterval(ordered[k - 1], ordered[n - k], coverage(k))


TARGET_RATIO = 1.05  # the time ratio (peer / fivefold) every comparison is held to


def ceiling_verdict(peer: str, ceilings: list[float], target: float = TARGET_RATIO) -> str:
    """One line that says whether `target` is out of reach against `peer`, from per-round
    ceilings (the most any implementation of the same work could gain on the peer, estimated in
    each round): a limit when the interval of their median lies below `target`; no limit when
    it lies at or above it (the peer leaves room, or the estimate does on this run); undecided
    (more rounds needed) when it straddles it."""
    median, (low, high, cover) = statistics.median(ceilings), median_interval(ceilings)
    measured = f"ceiling vs {peer} {median:.3f} ({cover:.0%} interval {low:.3f}-{high:.3f}, {len(ceilings)} rounds)"
    if high < target:
        return (f"verdict: LIMIT. {measured} < {target}: no implementation of the same work on this machine "
                f"can be {target}x faster than {peer}")
    if low >= target:
        return (f"verdict: NO LIMIT. {measured} >= {target}: {target}x over {peer} is not ruled out; what keeps "
                "fivefold below it is its own overhead, or this run's load (see the waits above)")
    return f"verdict: UNDECIDED. {measured} straddles {target}: rerun with more rounds"


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
class MemoryVariant:
    """One setting under which `bench all` measures a benchmark's cases alone: arguments added to
    the benchmark's own, and the comparison meta values that pick the comparisons whose cases it
    measures (none: every comparison of the benchmark)."""

    args: tuple[str, ...] = ()
    meta: tuple[tuple[str, object], ...] = ()

    def covers(self, comparison: dict) -> bool:
        return all(comparison.get("meta", {}).get(key) == value for key, value in self.meta)


@dataclass(frozen=True)
class SuiteEntry:
    """How `fivefold bench all` runs one benchmark script: processes, arguments, output flag,
    and for the memory pass: its variants, and the libraries its cases import themselves
    (imported before any case is built, in the idle process too, so that no case is charged
    for library code)."""

    name: str
    processes: int
    args: tuple[str, ...]
    out_flag: str = "--out"
    without_deepspeed: tuple[str, ...] = ()  # arguments that leave DeepSpeed's cases out
    memory: tuple[MemoryVariant, ...] = (MemoryVariant(),)
    preload: tuple[str, ...] = ()
    script: str = ""  # the benchmark script's name when it is not bench_<name>.py

    @property
    def script_file(self) -> str:
        return f"bench_{self.script or self.name}.py"


DEEPSPEED_DP_CASES = "deepspeed-zero1,deepspeed-zero2,deepspeed-zero3"
# Rounds per benchmark. On a shared 2-core machine one round's ratio of the same pair ranged
# from 0.57 to 1.72 (dp, 3 rounds), so a median of 3 is one draw from a wide spread: 3 rounds
# hold the true median between their extremes only 75% of the time (`median_interval`), 9-11
# rounds between their 2nd/3rd-lowest and -highest 93-96% of the time. The rounds are spent
# where a round is cheap or the rows are close to 1.05 (single, dp, pp); tp and ep, far from
# it, keep fewer. With the dp floor's verdicts they add about 6 minutes to a quiet run of
# `bench all` (13 -> ~19 min, memory pass included).
SUITE = (
    SuiteEntry("single", 1, ("--rounds", "9", "--steps", "1", "--threads", "1", "--compile"),
               preload=("transformers.models.llama.modeling_llama", "torch._inductor.compile_fx")),
    SuiteEntry("dp", 2, ("--rounds", "11"), "--json", ("--skip", DEEPSPEED_DP_CASES),
               preload=("deepspeed", "torch.distributed.fsdp", "torch.distributed.optim")),
    # the verdicts of the limit against DDP and ZeroRedundancyOptimizer (CPU-based: see bench_dp.py);
    # its cases are timed and measured alone in "dp" already, so no memory pass
    SuiteEntry("dp-floor", 2, ("--floor", "--rounds", "9"), "--json", script="dp", memory=()),
    SuiteEntry("tp", 2, ("--rounds", "5"),
               memory=(MemoryVariant(("--modes", "sp"), (("sequence_parallel", True),)),
                       MemoryVariant(("--modes", "nosp"), (("sequence_parallel", False),))),
               preload=("torch.distributed.tensor.parallel",)),
    SuiteEntry("pp", 2, ("--rounds", "11", "--micro-batches", "8"), "--json",
               preload=("torch.distributed.pipelining",)),
    SuiteEntry("ep", 2, ("--rounds", "7"), without_deepspeed=("--no-deepspeed",), preload=("deepspeed.moe.layer",)),
    SuiteEntry("cp", 2, ("--seq", "2048", "--rounds", "11"), preload=("torch.distributed.tensor.experimental",)),
)
PRELOAD_ENV = "FIVEFOLD_BENCH_PRELOAD"  # comma list of modules the launcher imports first
# The memory pass runs glibc with a fixed mmap threshold: every block of 64 KiB or more is its own
# mapping, returned to the system when freed. With glibc's default (a threshold that grows after
# frees) freed tensors stay resident in the heap depending on the order of allocations, and the
# peak measured the allocator's history: in one run fivefold's ZeRO-1 held 579 MB against torch's
# 503 and its 1F1B 271 against 217 by default, 411 against 435 and 180 against 177 with the fixed
# threshold, the same tensors alive in both.
MEMORY_PASS_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def suite_command(entry: SuiteEntry, out: Path, with_deepspeed: bool, extra: tuple[str, ...] = (),
                  preloaded: bool = False) -> list[str]:
    """The command that runs `entry` (plus `extra` arguments); `preloaded`: through this
    module's launcher, which imports the modules named in FIVEFOLD_BENCH_PRELOAD first."""
    import sys

    script = str(benchmarks_dir() / entry.script_file)
    args = [*entry.args, *(() if with_deepspeed else entry.without_deepspeed), *extra, entry.out_flag, str(out)]
    launch = ["-m", __name__, script] if preloaded else [script]
    if entry.processes == 1:
        return [sys.executable, *launch, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={entry.processes}",
            *launch, *args]


def run_preloaded(argv: list[str]) -> int:
    """`python -m fivefold.tools.bench SCRIPT [ARGS]`: import the modules named in
    FIVEFOLD_BENCH_PRELOAD (those not installed are left out), then run SCRIPT as __main__."""
    import importlib
    import importlib.util
    import runpy
    import sys

    if not argv:
        print("usage: python -m fivefold.tools.bench SCRIPT [ARGS]", file=sys.stderr)
        return 2
    for module in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            importlib.import_module(module)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def suite_env() -> dict[str, str]:
    root = benchmarks_dir().parent
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])))


def run_suite(out_dir: Path, only: list[str], memory: str = "alone") -> dict[str, list[dict] | str]:
    """Run every benchmark of SUITE (or `only`) one after another; name → comparisons or error.
    memory "alone": each benchmark's timed run is followed by its memory pass; "shared": no
    memory pass; "only": the memory pass alone, over the JSON an earlier run left in `out_dir`."""
    import importlib.util
    import subprocess

    with_deepspeed = importlib.util.find_spec("deepspeed") is not None
    env = suite_env()
    outcomes: dict[str, list[dict] | str] = {}
    for entry in SUITE:
        if only and entry.name not in only:
            continue
        out = out_dir / f"{entry.name}.json"
        if memory == "only":
            outcomes[entry.name] = json.loads(out.read_text()) if out.exists() else f"no {out} from an earlier run"
        else:
            out.unlink(missing_ok=True)
            print(f"== bench {entry.name}", flush=True)
            code = subprocess.call(suite_command(entry, out, with_deepspeed), env=env, cwd=benchmarks_dir().parent)
            outcomes[entry.name] = json.loads(out.read_text()) if code == 0 and out.exists() else f"exit code {code}"
        result = outcomes[entry.name]
        if memory != "shared" and isinstance(result, list):
            memory_pass(result, entry.memory,
                        lambda extra: suite_command(entry, out_dir / "memory" / "unused.json", with_deepspeed,
                                                    extra, preloaded=True),
                        env | MEMORY_PASS_ALLOCATOR | {PRELOAD_ENV: ",".join(entry.preload)},
                        out_dir / "memory" / entry.name)
            out.write_text(json.dumps(result, indent=2))
    return outcomes


def memory_pass(comparisons: list[dict], variants: tuple[MemoryVariant, ...],
                command: Callable[[tuple[str, ...]], list[str]], env: dict[str, str], work: Path) -> None:
    """Measure every case of `comparisons` alone, each in a process of its own, and record the
    result on the case as `alone` (`alone_memory`). Per variant, one idle process (no case
    built) gives the baseline. Logs and raw measurements go to `work`."""
    work.mkdir(parents=True, exist_ok=True)
    for v, variant in enumerate(variants):
        covered = [c for c in comparisons if variant.covers(c)]
        keys = list(dict.fromkeys(case.get("name", label) for c in covered for label, case in c["cases"].items()))
        if not keys:
            continue
        idle = measure_in_process(command(variant.args), IDLE_CASE, env, work / f"v{v}-idle")
        for i, key in enumerate(keys):
            print(f"== memory, alone: {key} {' '.join(variant.args)}".rstrip(), flush=True)
            measured = measure_in_process(command(variant.args), key, env, work / f"v{v}-case{i}")
            for comparison in covered:
                for label, case in comparison["cases"].items():
                    if case.get("name", label) == key:
                        case["alone"] = alone_memory(measured, idle)


def measure_in_process(command: list[str], case: str, env: dict[str, str], stem: Path) -> dict | str:
    """Run `command` with only `case` built (FIVEFOLD_BENCH_ALONE); its measurement, or why not."""
    import subprocess

    out, log = stem.with_suffix(".json"), stem.with_suffix(".log")
    out.unlink(missing_ok=True)
    with open(log, "w") as f:
        code = subprocess.call(command, env=env | {ALONE_ENV: case, ALONE_OUT_ENV: str(out)}, cwd=benchmarks_dir().parent,
                               stdout=f, stderr=subprocess.STDOUT)
    if code == 0 and out.exists():
        return json.loads(out.read_text())
    print(f"   failed (exit code {code}), log: {log}", flush=True)
    return f"exit code {code}, log {log}"


def alone_memory(measured: dict | str, idle: dict | str) -> dict:
    """A case's memory measured alone: per rank, its peak RSS during warm-up + ALONE_CALLS calls,
    and `held` = that peak minus the idle process's RSS on the same rank (imports, process
    group, data: what every case shares), `built` = its RSS before the first call minus the
    same (model, optimizer and buffers as built), `kept` = its RSS after the last call minus the
    same (what stays between steps), `live_tensors` = the tensor storages Python references after
    the last call (`live_tensor_mb`: kept minus it is mostly what the allocator keeps); `*_mb` are
    the largest over ranks."""
    if isinstance(measured, str) or isinstance(idle, str):
        return {"error": measured if isinstance(measured, str) else f"idle process: {idle}"}
    base = idle["rss_before_mb_per_rank"]
    held = [round(p - b, 1) for p, b in zip(measured["peak_rss_mb_per_rank"], base)]
    built = [round(r - b, 1) for r, b in zip(measured["rss_before_mb_per_rank"], base)]
    kept = [round(r - b, 1) for r, b in zip(measured["rss_after_mb_per_rank"], base)]
    tensors = measured.get("live_tensors_mb_per_rank", [0.0])
    return {"peak_rss_mb": max(measured["peak_rss_mb_per_rank"]), "held_mb": max(held), "built_mb": max(built),
            "kept_mb": max(kept), "live_tensors_mb": max(tensors), "peak_rss_mb_per_rank": measured["peak_rss_mb_per_rank"],
            "idle_rss_mb_per_rank": base, "held_mb_per_rank": held, "built_mb_per_rank": built,
            "kept_mb_per_rank": kept, "live_tensors_mb_per_rank": tensors, "calls": measured["calls"]}


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
    ("dp", "fivefold-zero2", "fivefold-dp", "ZeRO-2 vs fivefold dp (dp's step / ZeRO-2's; below 1: sharding costs time)"),
    ("dp", "fivefold-zero3", "fivefold-dp", "ZeRO-3 vs fivefold dp (dp's step / ZeRO-3's; below 1: sharding costs time)"),
    ("tp", "fivefold", "dtensor", "tp=2 vs DTensor parallelize_module"),
    ("pp", "fivefold gpipe", "torch gpipe", "pp=2 GPipe vs torch.distributed.pipelining"),
    ("pp", "fivefold 1f1b", "torch 1f1b", "pp=2 1F1B vs torch.distributed.pipelining"),
    ("pp", "fivefold interleaved", "torch interleaved", "pp=2 interleaved vs torch.distributed.pipelining"),
    ("pp", "fivefold zb-h1", "fivefold 1f1b", "pp=2 zero-bubble (zb-h1) vs fivefold 1F1B"),
    ("ep", "fivefold-grouped", "deepspeed", "MoE layer, ep=2, vs DeepSpeed MoE"),
)


def per_round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """numerator / denominator of each round, both timed in the same round."""
    return [a / b for a, b in zip(numerator, denominator)]


def per_round_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator / denominator, both timed in the same round."""
    return statistics.median(per_round_ratios(numerator, denominator))


class HeadlineRow(NamedTuple):
    label: str
    title: str  # the comparison that measured the pair
    time_ratio: float  # other's step time / fivefold's, median over rounds
    interval: MedianInterval  # where that median lies (`median_interval` of the per-round ratios)
    memory_ratio: float  # other's memory / fivefold's
    memory_alone: bool  # True: held MB of each case measured alone; False: peak RSS in the shared process
    ours_mb: float
    other_mb: float


def pair_memory(ours: dict, other: dict) -> tuple[float, float, bool]:
    """The two cases' memory: held MB measured alone when both have it, else their peak RSS in
    the process they shared; and which of the two it is."""
    alone = [case.get("alone", {}) for case in (ours, other)]
    if all("held_mb" in a for a in alone):
        return alone[0]["held_mb"], alone[1]["held_mb"], True
    return ours["peak_rss_mb"], other["peak_rss_mb"], False


def headline_rows(outcomes: dict[str, list[dict] | str]) -> list[HeadlineRow]:
    """Every HEADLINE pair that some comparison measured side by side, with its time ratio
    (other / fivefold) and memory ratio (other / fivefold)."""
    rows = []
    for bench_name, ours, other, label in HEADLINE:
        result = outcomes.get(bench_name)
        for comparison in result if isinstance(result, list) else []:
            cases = comparison["cases"]
            if ours in cases and other in cases:
                per_round = per_round_ratios(cases[other]["seconds"], cases[ours]["seconds"])
                ours_mb, other_mb, alone = pair_memory(cases[ours], cases[other])
                rows.append(HeadlineRow(label, comparison["title"], statistics.median(per_round),
                                        median_interval(per_round), other_mb / max(ours_mb, 1e-9), alone,
                                        ours_mb, other_mb))
    return rows


MEMORY_METHOD = (
    "Memory ratio = other's held MB / fivefold's: above 1 means fivefold holds less. Each case's memory is "
    f"measured alone, in a process where no other case of its benchmark is built: its warm-up and {ALONE_CALLS} "
    "more calls, with glibc's mmap threshold fixed at 64 KiB (a freed tensor leaves the process, so the peak is "
    "that of what the case allocates, not of what the allocator kept), the kernel's peak RSS during them, minus "
    "the resident size of the same benchmark's idle process "
    "(same imports, the peers' libraries included, process group and data, no case built), per rank; the largest "
    "over ranks. A ratio marked (shared) is the older measure, used where a case has no alone measurement: the "
    "peak RSS of cases that ran in one process, where what the other cases keep alive counts in every case."
)


def summary_lines(outcomes: dict[str, list[dict] | str]) -> list[str]:
    lines = ["## Summary", "",
             "Time ratio = median over rounds of (other case's step time / fivefold's), both timed in the same "
             "round: above 1 means fivefold is faster. Interval: where the median of such per-round ratios lies, "
             "with the probability given (distribution-free, from the rounds' order statistics; more rounds "
             "narrow it). " + MEMORY_METHOD, "",
             "| comparison | measured in | time ratio | interval (rounds) | memory ratio | held MB, fivefold / other |",
             "|---|---|---|---|---|---|"]
    for row in headline_rows(outcomes):
        memory = f"{row.memory_ratio:.2f}" if row.memory_alone else f"{row.memory_ratio:.2f} (shared)"
        held = f"{row.ours_mb:.0f} / {row.other_mb:.0f}" if row.memory_alone else "–"
        low, high, cover = row.interval
        lines.append(f"| {row.label} | {row.title} | {row.time_ratio:.3f} | {low:.3f}–{high:.3f}, {cover:.0%} "
                     f"| {memory} | {held} |")
    return lines


def limit_lines(outcomes: dict[str, list[dict] | str]) -> list[str]:
    """The verdicts of the limit that the benchmarks wrote into their comparisons' meta: per peer
    of `bench_dp.py --floor` (work alone, and wall on a quiet machine), per schedule of
    bench_pp (the bubble, and the ceiling against torch)."""
    lines = []
    for name, result in outcomes.items():
        for comparison in result if isinstance(result, list) else []:
            meta = comparison.get("meta", {})
            for peer, row in meta.get("floor", {}).items():
                lines.append(f"- {name}, against {peer}, work alone: {row['cpu_verdict']}")
                lines.append(f"- {name}, against {peer}, wall on a quiet machine: {row['verdict']}")
            for key, row in meta.items():
                if not (key.startswith("bubble ") and isinstance(row, dict)):
                    continue
                schedule = key.removeprefix("bubble ")
                if "bubble_verdict" in row:
                    lines.append(f"- {name}, {schedule}, {row['bubble_verdict']}")
                if "verdict" in row:
                    lines.append(f"- {name}, {schedule}, against torch: {row['verdict']}")
    if not lines:
        return []
    return ["## Limits", "",
            "Verdicts of the benchmarks against the 1.05 target and the bubble formula + 10%, from CPU times and "
            "waits (how: benchmarks/README.md, `dp` and `pp`). LIMIT: no implementation of the same work can reach it "
            "on this machine; NO LIMIT: the peer leaves room; UNDECIDED: the interval over rounds straddles it.", "",
            *lines, ""]


def alone_cells(case: dict) -> str:
    """`peak | held (built, kept; live tensors)` of a case measured alone, or why it has none."""
    alone = case.get("alone")
    if alone is None:
        return "– | –"
    if "error" in alone:
        return f"failed: {alone['error']} | –"
    return (f"{alone['peak_rss_mb']:.0f} | {alone['held_mb']:.0f} ({alone['built_mb']:.0f}, {alone['kept_mb']:.0f}; "
            f"{alone.get('live_tensors_mb', 0.0):.0f})")


def comparison_lines(name: str, comparison: dict) -> list[str]:
    lines = [f"### {name}: {comparison['title']}", "",
             f"| case | median s | ratio vs {comparison['baseline']} | peak RSS MB, shared process "
             "| alone: peak RSS MB | alone: held MB (built, kept; live tensors) |", "|---|---|---|---|---|---|"]
    for case, values in comparison["cases"].items():
        lines.append(f"| {case} | {values['median_s']:.4f} | {comparison['ratios'][case]:.3f} "
                     f"| {values['peak_rss_mb']:.0f} | {alone_cells(values)} |")
    return lines + [""]


def suite_markdown(outcomes: dict[str, list[dict] | str], meta: dict | None = None) -> str:
    """The summary (peer / fivefold per pair), then one table per comparison."""
    lines = ["# fivefold benchmarks", ""]
    if meta:
        lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    lines += summary_lines(outcomes)
    lines += ["", *limit_lines(outcomes)]
    lines += ["## Every comparison", "",
              "Ratios below are medians of per-round time(case) / time(baseline); below 1 means faster than "
              "the baseline. Peak RSS, shared process: the case's own peak while every case of the comparison "
              "lived in one process (largest over ranks). Alone: the case in a process of its own (see the summary); "
              "held = peak minus the idle process's RSS, built = resident before the first call (model, optimizer, "
              "buffers), kept = resident after the last call, both minus the same; live tensors = the tensor storages "
              "Python references after the last call (kept minus it: mostly what the allocator keeps); largest over "
              "ranks.", ""]
    for name, result in outcomes.items():
        if isinstance(result, str):
            lines += [f"### {name}", "", f"did not finish: {result}", ""]
            continue
        for comparison in result:
            lines += comparison_lines(name, comparison)
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
    """`fivefold bench all [--only a,b] [--out DIR] [--memory alone|shared|only]`: every comparison,
    one table (markdown + JSON)."""
    import argparse

    parser = argparse.ArgumentParser(prog="fivefold bench all")
    parser.add_argument("--only", default="", help=f"comma list of: {', '.join(e.name for e in SUITE)}")
    parser.add_argument("--out", default="bench_results", help="folder for every JSON and all.md")
    parser.add_argument("--memory", choices=("alone", "shared", "only"), default="alone",
                        help="alone (default): after each benchmark's timed run, measure every case's memory in a "
                             "process of its own (one short process per case, a few minutes in all); shared: skip "
                             "that, the memory column is then the peak RSS of cases that shared a process; only: "
                             "measure memory alone for the benchmarks whose JSON an earlier run left in --out, "
                             "without timing them again")
    args = parser.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - {e.name for e in SUITE})
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(e.name for e in SUITE)}")
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = run_suite(out_dir, only, memory=args.memory)
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


if __name__ == "__main__":  # the memory pass's launcher: python -m fivefold.tools.bench SCRIPT [ARGS]
    import sys

    sys.exit(run_preloaded(sys.argv[1:]))
