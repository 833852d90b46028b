"""The benchmark summary and the memory pass: which pairs the summary states and how it computes
their ratios; that a case measured alone runs in a process where no other case was built."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.tools import bench
from fivefold.tools.bench import (
    ALONE_ENV,
    ALONE_OUT_ENV,
    PRELOAD_ENV,
    SUITE,
    MemoryVariant,
    alone_memory,
    ceiling_verdict,
    headline_rows,
    median_interval,
    memory_pass,
    per_round_ratio,
    suite_markdown,
)

ROOT = Path(__file__).resolve().parents[2]

# A benchmark script in miniature: "big" keeps 64 MB alive, "small" keeps --mb MB (8 by default);
# each call allocates and frees as much again (a transient peak). Construction goes through
# `bench.builds`, as in benchmarks/, so a case run alone has nothing else alive.
FAKE_BENCHMARK = '''
import os, sys
from fivefold.tools import bench

if os.environ.get("EXPECT_PRELOADED") and "colorsys" not in sys.modules:
    raise SystemExit("the launcher did not import the preloaded module first")
if os.environ.get("EXPECT_FIXED_MMAP") and os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
    raise SystemExit("the memory pass did not fix glibc's mmap threshold")
MB = 1 << 20
small_mb = int(sys.argv[sys.argv.index("--mb") + 1]) if "--mb" in sys.argv else 8

def case(mb):
    kept = bytearray(b"\\x01") * (mb * MB)  # written, so every page is resident
    def step():
        temporary = bytearray(b"\\x02") * (mb * MB)
        del temporary
    step.kept = kept
    return step

builders = {"big": lambda: case(64), "small": lambda: case(small_mb)}
cases = {name: build() for name, build in builders.items() if bench.builds(name)}
print("timed", sorted(bench.alternate(cases, warmup=1, rounds=2)))
'''


def _case(seconds: list[float], rss: float, alone: dict | None = None) -> dict:
    case = {"seconds": seconds, "peak_rss_mb": rss, "median_s": sorted(seconds)[len(seconds) // 2]}
    return case | ({"alone": alone} if alone is not None else {})


def test_per_round_ratio_pairs_rounds_before_taking_the_median():
    # Medians of each side alone would give 2.0 / 2.0 = 1; the rounds say the peer is slower.
    assert per_round_ratio([3.0, 2.0, 1.5], [1.0, 2.0, 1.0]) == pytest.approx(1.5)


def test_the_summary_states_peer_over_fivefold_for_pairs_run_side_by_side():
    outcomes = {
        "dp": [
            {"title": "dp vs ddp", "baseline": "fivefold-dp", "ratios": {"fivefold-dp": 1.0, "torch-ddp": 1.1},
             "cases": {"fivefold-dp": _case([1.0, 1.0, 1.0], 100.0), "torch-ddp": _case([1.1, 1.2, 1.0], 150.0)}},
            {"title": "zero2 alone", "baseline": "fivefold-zero2", "ratios": {"fivefold-zero2": 1.0},
             "cases": {"fivefold-zero2": _case([1.0], 90.0)}},
        ],
        "tp": "exit code 1",
    }
    (row,) = headline_rows(outcomes)
    assert (row.label, row.title, row.time_ratio, row.memory_ratio, row.memory_alone) == (
        "dp=2 vs torch DDP", "dp vs ddp", pytest.approx(1.1), pytest.approx(1.5), False)
    markdown = suite_markdown(outcomes, {"cores": "2"})
    # no alone measurement: the shared-process peak, and the row says so
    # 3 rounds: the interval is their whole range, which holds the median 75% of the time
    assert "| dp=2 vs torch DDP | dp vs ddp | 1.100 | 1.000–1.200, 75% | 1.50 (shared) | – |" in markdown
    assert "did not finish: exit code 1" in markdown and "cores: 2" in markdown
    assert "ZeRO-2 vs fivefold dp" not in markdown  # zero2 never ran beside dp: no row, no guess


def test_the_memory_ratio_is_held_memory_measured_alone_when_both_cases_have_it():
    ours = {"peak_rss_mb": 900.0, "held_mb": 200.0, "built_mb": 120.0, "kept_mb": 150.0, "live_tensors_mb": 110.0}
    other = {"peak_rss_mb": 1000.0, "held_mb": 300.0, "built_mb": 180.0, "kept_mb": 240.0}
    outcomes = {"tp": [{"title": "tp=2", "baseline": "fivefold", "ratios": {"fivefold": 1.0, "dtensor": 1.2},
                        "cases": {"fivefold": _case([1.0], 2000.0, ours), "dtensor": _case([1.2], 2000.0, other)}}]}
    (row,) = headline_rows(outcomes)
    assert row.memory_alone and row.memory_ratio == pytest.approx(1.5)
    markdown = suite_markdown(outcomes)
    # one round: its ratio is the whole interval, which holds the median with probability 0
    assert "| tp=2 vs DTensor parallelize_module | tp=2 | 1.200 | 1.200–1.200, 0% | 1.50 | 200 / 300 |" in markdown
    assert "| fivefold | 1.0000 | 1.000 | 2000 | 900 | 200 (120, 150; 110) |" in markdown


def test_alone_memory_subtracts_the_idle_process_on_each_rank_and_reports_the_largest():
    idle = {"rss_before_mb_per_rank": [300.0, 280.0]}
    measured = {"calls": 3, "rss_before_mb_per_rank": [400.0, 400.0], "peak_rss_mb_per_rank": [500.0, 510.0],
                "rss_after_mb_per_rank": [450.0, 430.0], "live_tensors_mb_per_rank": [100.0, 90.0]}
    alone = alone_memory(measured, idle)
    assert alone["held_mb_per_rank"] == [200.0, 230.0] and alone["held_mb"] == 230.0
    assert alone["built_mb"] == 120.0 and alone["kept_mb"] == 150.0 and alone["peak_rss_mb"] == 510.0
    assert alone["live_tensors_mb"] == 100.0
    assert alone_memory("exit code 1, log x", idle) == {"error": "exit code 1, log x"}


def test_live_tensors_count_each_storage_once():
    import torch

    before = bench.live_tensor_mb()
    block = torch.ones(1 << 20)  # 4 MB
    views = [block[1:], block.view(2, -1), block.detach()]  # the same storage
    assert bench.live_tensor_mb() - before == pytest.approx(4.0, abs=0.01)
    del block, views


def _fake_comparison(mode: str) -> dict:
    return {"title": f"fake {mode}", "baseline": "big", "meta": {"mode": mode},
            "cases": {label: {"name": label, "seconds": [1.0], "peak_rss_mb": 0.0} for label in ("big", "small")}}


def test_each_case_is_measured_in_a_process_where_no_other_case_was_built(tmp_path):
    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE_BENCHMARK)
    comparisons = [_fake_comparison("a"), _fake_comparison("b")]
    variants = (MemoryVariant(("--mb", "8"), (("mode", "a"),)), MemoryVariant(("--mb", "24"), (("mode", "b"),)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), EXPECT_PRELOADED="1", **{PRELOAD_ENV: "colorsys,not_installed_x"})
    memory_pass(comparisons, variants, lambda extra: [sys.executable, "-m", "fivefold.tools.bench", str(script), *extra],
                env, tmp_path / "memory")
    a, b = ({name: case["alone"] for name, case in c["cases"].items()} for c in comparisons)
    assert "error" not in a["small"], a["small"]
    # small keeps 8 MB and allocates 8 more per call: held about 16 MB, built and kept about 8;
    # with big's 64 MB alive beside it, every one of these would be above 64
    assert 12 <= a["small"]["held_mb"] < 40 and 6 <= a["small"]["built_mb"] < 30 and a["small"]["kept_mb"] < 30
    assert 110 <= a["big"]["held_mb"] < 170
    assert 40 <= b["small"]["held_mb"] < 70  # the variant's arguments reached its process: 2 x 24 MB
    assert a["small"]["calls"] == 1 + bench.ALONE_CALLS


def test_memory_only_measures_the_cases_an_earlier_run_left_and_writes_them_back(tmp_path, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_fake.py").write_text(FAKE_BENCHMARK)
    out = tmp_path / "results"
    out.mkdir()
    (out / "fake.json").write_text(json.dumps([_fake_comparison("a")]))
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: tmp_path / "benchmarks")
    monkeypatch.setattr(bench, "SUITE", (bench.SuiteEntry("fake", 1, ("--mb", "8"), preload=("colorsys",)),))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("EXPECT_PRELOADED", "1")
    monkeypatch.setenv("EXPECT_FIXED_MMAP", "1")
    outcomes = bench.run_suite(out, [], memory="only")
    written = json.loads((out / "fake.json").read_text())
    assert outcomes["fake"] == written
    assert 12 <= written[0]["cases"]["small"]["alone"]["held_mb"] < 40
    assert (out / "memory" / "fake" / "v0-idle.json").exists()


def test_a_case_name_the_benchmark_does_not_know_is_refused_with_the_names_it_knows(tmp_path):
    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE_BENCHMARK.replace("if bench.builds(name)", "if bench.builds(name) or True"))
    done = subprocess.run([sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=str(ROOT), **{ALONE_ENV: "bigg"}),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "FIVEFOLD_BENCH_ALONE='bigg' names no case of this benchmark; cases: big, small" in done.stderr


def test_every_benchmark_of_the_suite_builds_only_the_case_measured_alone():
    # the guard each script needs, so that `bench all`'s memory pass measures one case at a time
    for entry in SUITE:
        source = (ROOT / "benchmarks" / entry.script_file).read_text()
        assert "builds(" in source, f"{entry.script_file} builds its cases without bench.builds"


def test_a_real_benchmark_run_alone_builds_one_case_and_reports_each_rank(tmp_path):
    out = tmp_path / "alone.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{ALONE_ENV: "fivefold-grouped",
                                                                         ALONE_OUT_ENV: str(out)})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "benchmarks" / "bench_ep.py"), "--no-deepspeed", "--hidden", "64", "--ffn", "256",
               "--batch", "1", "--seq", "8", "--out", str(tmp_path / "unused.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["case"] == "fivefold-grouped" and record["cases"] == ["fivefold-grouped"]  # no other layer built
    assert len(record["peak_rss_mb_per_rank"]) == 2 and record["calls"] == 2 + bench.ALONE_CALLS
    assert all(p >= b for p, b in zip(record["peak_rss_mb_per_rank"], record["rss_before_mb_per_rank"]))
    assert all(t >= 0.7 for t in record["live_tensors_mb_per_rank"])  # 4 experts x 3 x 64 x 256 fp32
    assert not (tmp_path / "unused.json").exists()  # the process ended after measuring, as the pass expects


def test_the_context_parallel_benchmark_builds_its_model_with_the_runtime_it_benchmarks(tmp_path):
    # bench_cp stands in for parallelize.build_optimizer; a change of that function's arguments
    # must not leave the benchmark failing only when `bench all` reaches it
    out = tmp_path / "alone.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{ALONE_ENV: "ring", ALONE_OUT_ENV: str(out)})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "benchmarks" / "bench_cp.py"), "--seq", "64", "--layers", "1",
               "--out", str(tmp_path / "unused.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(out.read_text())["case"] == "ring"


def test_the_median_interval_takes_the_order_statistics_that_cover_the_median_with_the_asked_probability():
    # 3 values: only the whole range, which misses the median when all 3 fall on one side: 2 x 1/8
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, pytest.approx(0.75))
    # 11 values: [x(3), x(9)] covers 1 - 2 P(Binomial(11, 1/2) <= 2) = 1 - 2 x 67/2048; [x(4), x(8)] would be < 0.9
    values = [float(v) for v in (10, 0, 9, 1, 8, 2, 7, 3, 6, 4, 5)]
    assert median_interval(values) == (2.0, 8.0, pytest.approx(1 - 2 * 67 / 2048))
    assert median_interval(values, confidence=0.5) == (3.0, 7.0, pytest.approx(1 - 2 * 232 / 2048))
    with pytest.raises(ValueError, match="at least one"):
        median_interval([])


def test_the_ceiling_verdict_claims_a_limit_only_when_the_whole_interval_is_below_the_target():
    below, above, straddling = [1.01, 1.02, 1.03, 1.0, 1.04], [1.06, 1.2, 1.1, 1.08, 1.07], [1.0, 1.1, 1.02, 1.2, 1.01]
    assert ceiling_verdict("torch-ddp", below).startswith("verdict: LIMIT. ceiling vs torch-ddp 1.020")
    assert ceiling_verdict("torch-ddp", above).startswith("verdict: NO LIMIT.")
    assert ceiling_verdict("torch-ddp", straddling).startswith("verdict: UNDECIDED.")
    assert ceiling_verdict("torch-ddp", below, target=1.02).startswith("verdict: UNDECIDED.")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dp_floor_bound_counts_waits_on_collectives_but_not_one_rank_waiting_for_a_late_other():
    bench_dp = _load_script("bench_dp")
    rounds = 5

    def timed(seconds: float) -> bench.CaseResult:
        return bench.CaseResult("x", [seconds] * rounds)

    def per_rank(*values: float) -> list[list[float]]:
        return [[v] * rounds for v in values]

    # compute 1.0 CPU s per rank and the all-reduce 0.1: floor = 1.1 s on 2 cores. The peer spends
    # the floor's CPU and waits 0.02 s on its last all-reduce on both ranks, rank 0 also 0.3 s for a
    # late rank 1 (load): only the 0.02 enters the bound. fivefold's dp waits 0.2 s on both ranks.
    cpu = {"compute": per_rank(1.0, 1.0), "all_reduce": per_rank(0.1, 0.1), "torch-ddp": per_rank(1.1, 1.1),
           "fivefold-dp": per_rank(1.1, 1.1), "compute-zero1": per_rank(1.0, 1.0),
           "reduce_scatter+all_gather": per_rank(0.1, 0.1), "torch-zero1": per_rank(1.1, 1.1),
           "fivefold-zero1": per_rank(1.1, 1.1)}
    blocked = {name: per_rank(0.0, 0.0) for name in cpu} | {
        "torch-ddp": per_rank(0.32, 0.02), "fivefold-dp": per_rank(0.2, 0.2), "torch-zero1": per_rank(0.2, 0.2)}
    results = {name: timed(2.0) for name in cpu}
    report = bench_dp.floor_report(results, cpu, blocked, cores=2)
    ddp, zero1 = report["torch-ddp"], report["torch-zero1"]
    assert ddp["ceiling"] == [pytest.approx((2.2 + 0.04) / 2 / 1.1, abs=1e-4)] * rounds
    assert ddp["fivefold_bound_over_floor"] == [pytest.approx((2.2 + 0.4) / 2 / 1.1, abs=1e-4)] * rounds
    assert ddp["peer_skew_s"] == pytest.approx(0.3)
    assert ddp["verdict"].startswith("verdict: LIMIT.")
    assert ddp["cpu_ceiling"] == [pytest.approx(1.0)] * rounds and ddp["cpu_verdict"].startswith("verdict: LIMIT.")
    assert zero1["ceiling"] == [pytest.approx((2.2 + 0.4) / 2 / 1.1, abs=1e-4)] * rounds
    assert zero1["verdict"].startswith("verdict: NO LIMIT.")


def test_the_pp_ceiling_is_torch_cpu_over_fivefold_compute_alone_in_the_same_round_through_the_executor_model():
    bench_pp = _load_script("bench_pp")
    pp, m = 2, 4
    actions = [{**{("F", i, 0): 1.0 for i in range(m)}, **{("B", i, 0): 2.0 for i in range(m)}} for _ in range(pp)]
    compute = sum(actions[0].values())
    transfer = {"latency_s": 0.0, "wait_posted_late_s": 0.0}
    bubble = {"formula": 1 / 5, "model_balanced_per_repeat": [0.2] * 3, "model_stages_per_repeat": [0.2] * 3,
              "model_cpu_per_repeat": [0.3] * 3, "fivefold": 0.25, "action_share_of_main_cpu": [0.8, 0.8]}
    # fivefold's main thread spends its actions' CPU / 0.8 in every round, torch 1.2x the compute
    # in three rounds and 1.02x in two: the model is linear in the times, so the ceiling is the ratio
    rounds = {"fivefold 1f1b": [[compute / 0.8] * pp] * 5,
              "torch 1f1b": [[compute * 1.2] * pp] * 3 + [[compute * 1.02] * pp] * 2}
    out = bench_pp.limits("1f1b", bubble, actions, rounds, (pp, m, 1), transfer)
    assert out["ceiling"] == [pytest.approx(1.2)] * 3 + [pytest.approx(1.02)] * 2
    assert out["cpu_predicted_ratio"][0] == pytest.approx(1.2 * 0.8)
    assert out["verdict"].startswith("verdict: UNDECIDED.")
    rounds["torch 1f1b"] = [[compute * 1.02] * pp] * 5
    assert bench_pp.limits("1f1b", bubble, actions, rounds, (pp, m, 1), transfer)["verdict"].startswith(
        "verdict: LIMIT.")
    # the bubble: the stages' own times within the formula + 10% -> no limit, whatever the per-action times add
    assert "verdict: NOT A LIMIT" in out["bubble_verdict"]
    # equal stages already outside it -> a limit, and it says which step does it
    bubble |= {"model_balanced_per_repeat": [0.3] * 3, "model_stages_per_repeat": [0.3] * 3}
    verdict = bench_pp.limits("zb-h1", bubble, actions, rounds, (pp, m, 1), transfer)
    assert set(verdict) == {"bubble_verdict"}  # torch runs no zb-h1: no ceiling
    assert "verdict: LIMIT" in verdict["bubble_verdict"] and "already do on equal stages" in verdict["bubble_verdict"]
    bubble |= {"model_balanced_per_repeat": [0.2] * 3}
    assert "the stages' unequal times do" in bench_pp.limits("zb-h1", bubble, actions, rounds, (pp, m, 1),
                                                             transfer)["bubble_verdict"]
    rows = bench_pp.rank_mean_rows([{("F", 0, 0): 1.0, ("F", 1, 0): 3.0, ("B", 0, 0): 4.0}])
    assert rows == [{("F", 0, 0): 2.0, ("F", 1, 0): 2.0, ("B", 0, 0): 4.0}]


def test_the_suite_table_lists_the_verdicts_the_benchmarks_wrote():
    floor_row = {"cpu_verdict": "verdict: LIMIT. ceiling vs torch-ddp 1.004", "verdict": "verdict: UNDECIDED. x"}
    outcomes = {"dp-floor": [{"title": "floor", "baseline": "compute", "ratios": {}, "cases": {},
                              "meta": {"floor": {"torch-ddp": floor_row}}}],
                "pp": [{"title": "pp", "baseline": "torch gpipe", "ratios": {}, "cases": {},
                        "meta": {"bubble 1f1b": {"bubble_verdict": "bubble: formula 11.1% verdict: LIMIT. y",
                                                 "verdict": "verdict: LIMIT. ceiling vs torch 1f1b 0.992"},
                                 "bubble zb-h1": {"bubble_verdict": "bubble: formula 4.0% verdict: LIMIT. z"},
                                 "transfer": {"bytes": 1}}}]}
    markdown = suite_markdown(outcomes)
    assert "- dp-floor, against torch-ddp, work alone: verdict: LIMIT. ceiling vs torch-ddp 1.004" in markdown
    assert "- dp-floor, against torch-ddp, wall on a quiet machine: verdict: UNDECIDED. x" in markdown
    assert "- pp, 1f1b, against torch: verdict: LIMIT. ceiling vs torch 1f1b 0.992" in markdown
    assert "- pp, zb-h1, bubble: formula 4.0% verdict: LIMIT. z" in markdown
    assert "zb-h1, against torch" not in markdown
    assert "## Limits" not in suite_markdown({"pp": "exit code 1"})
    # the floor's entry runs bench_dp.py with --floor, and measures no memory (dp's cases already are)
    (entry,) = [e for e in SUITE if e.name == "dp-floor"]
    assert entry.script_file == "bench_dp.py" and "--floor" in entry.args and entry.memory == ()
