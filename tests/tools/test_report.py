"""Run reports: what training logs, the HTML report in a real headless browser, bad run folders,
and `fivefold plan --compare`.

Three small runs train on the 2-rank worker pool (dense pp=2 with a traced step and a profiled
step, MoE with ep=2, dense cp=2); their logs are checked against the planner's prediction
(model states within 1%, bytes per axis exactly where the planner's volume is exact), their
reports are rendered and loaded in headless Chromium, which must run the page without script
errors and decode every figure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fivefold.config import load_config
from fivefold.observe.metrics import flatten_scalars
from fivefold.tools.report import load_run, write_report

RUNS = {
    "pp2": ("tiny", ["layout.pp=2", "layout.grad_accum=2", "train.trace=true", "train.profile=1",
                     "train.eval_interval=2"]),
    "moe_ep2": ("tiny-moe", ["layout.dp=2", "layout.ep=2"]),
    "cp2": ("tiny", ["layout.cp=2", "layout.cp_algorithm=ring"]),
}
STEPS = 3
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _train_runs(ctx, root: str) -> None:
    from fivefold.run import run_training

    for name, (preset, overrides) in RUNS.items():
        config = load_config(preset, overrides + [f"train.steps={STEPS}"])
        run_training(config, Path(root) / name, show_progress=False)


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    pools.run(2, _train_runs, str(root))
    return root


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _prediction(run_dir: Path) -> dict:
    return json.loads((run_dir / "prediction.json").read_text())


# ---------------------------------------------------------------------- what training logs


def test_runs_log_memory_and_bytes_that_match_the_prediction(runs):
    for name in RUNS:
        records, predicted = _records(runs / name), _prediction(runs / name)
        assert len(records) == STEPS and "step_time_s" in predicted, name
        assert all(len(r["peak_memory_bytes"]) == 2 and min(r["peak_memory_bytes"]) > 0 for r in records), name
        phases = {"forward_backward", "grad_sync", "statistics", "grad_norm", "optimizer"}
        assert all(set(r["phase_seconds"]) == phases for r in records), name
        assert all(sum(r["phase_seconds"].values()) <= r["step_seconds"] for r in records), name  # laps of one step
        held = max(sum(rank.values()) for rank in records[0]["held_bytes"])
        assert held == pytest.approx(predicted["memory_bytes"]["model_states"], rel=0.01), name
    # Bytes per axis equal the analytic volume, except the traced step's clock alignment (4 bytes
    # on pp) and the ep all-to-all, which follows the actual routing.
    pp = _records(runs / "pp2")
    assert [r["comm_bytes"]["pp"] for r in pp] == [_prediction(runs / "pp2")["comm_bytes"]["pp"] + (4 if r["step"] == 2 else 0) for r in pp]
    assert all(r["comm_bytes"] == _prediction(runs / "cp2")["comm_bytes"] for r in _records(runs / "cp2"))
    assert all(r["comm_bytes"]["dp"] == _prediction(runs / "moe_ep2")["comm_bytes"]["dp"] for r in _records(runs / "moe_ep2"))


def test_moe_run_logs_the_all_to_all_matrix_of_its_routing(runs):
    for record in _records(runs / "moe_ep2"):
        for layer in record["moe"].values():
            matrix = layer["all_to_all_tokens"]
            assert len(matrix) == 2 and all(len(row) == 2 for row in matrix)
            # every routed token-slot leaves some ep rank for the rank holding its expert
            assert sum(map(sum, matrix)) == sum(layer["tokens_per_expert"])
            # column j: the slots of the experts ep rank j holds (the second half of them for j = 1)
            assert sum(row[1] for row in matrix) == sum(layer["tokens_per_expert"][4:])


def test_trace_and_profile_files(runs):
    assert (runs / "pp2" / "trace.json").exists() and (runs / "pp2" / "timeline.png").exists()
    traces = sorted(p.name for p in (runs / "pp2" / "profile").iterdir())
    assert traces == ["step1-rank0.json", "step1-rank1.json"]
    assert json.loads((runs / "pp2" / "profile" / traces[0]).read_text())["traceEvents"]


def test_drift_warnings_name_what_is_off_by_more_than_the_margin():
    from fivefold.observe.prediction import drift_warnings

    prediction = {"hardware": "H100-80GB", "step_time_s": 1.0, "memory_bytes": {"model_states": 1000},
                  "comm_bytes": {"dp": 800, "tp": 100}}
    records = [
        {"step": 0, "step_seconds": 9.0, "held_bytes": [{"params": 250, "grads": 250, "optimizer": 500}],
         "comm_bytes": {"dp": 800, "tp": 100}},  # first step: warm-up, left out of the time
        {"step": 1, "step_seconds": 1.2, "comm_bytes": {"dp": 800, "tp": 140}},
        {"step": 2, "step_seconds": 1.1, "comm_bytes": {"dp": 800, "tp": 140}},
    ]
    warnings = drift_warnings(prediction, records, margin=0.25)
    assert len(warnings) == 1 and "tp bytes per step 140 measured vs 100 predicted" in warnings[0]
    assert "more than 25%" in warnings[0]
    assert len(drift_warnings(prediction, records, margin=0.1)) == 2  # 1.15 s median is now off too
    assert drift_warnings({"error": "no layout"}, records, 0.25) == []
    uncalibrated = {**prediction, "step_time_s": 0.1, "step_time_calibrated": False}  # 11x off: not held against it
    assert len(drift_warnings(uncalibrated, records, margin=0.1)) == 1  # the tp bytes still are


def test_an_uncalibrated_cpu_is_planned_with_rates_measured_at_start(tmp_path, monkeypatch):
    import dataclasses

    import torch

    from fivefold.planner.hardware import CPU_DEFAULT, save_calibration
    from fivefold.observe.prediction import planner_hardware

    monkeypatch.setenv("FIVEFOLD_CACHE_DIR", str(tmp_path))
    measured = planner_hardware(torch.device("cpu"), "fp32")
    assert measured.name.startswith("cpu (") and measured.peak_flops_fp32 == measured.peak_flops > 0
    assert measured.peak_flops != CPU_DEFAULT.peak_flops and measured.hbm_bw != CPU_DEFAULT.hbm_bw
    assert measured.intra_node_bw == CPU_DEFAULT.intra_node_bw  # not measured at start: the calibration's job
    calibrated = dataclasses.replace(CPU_DEFAULT, peak_flops=1.5e11, peak_flops_fp32=1.0e11)
    save_calibration(calibrated)
    assert planner_hardware(torch.device("cpu"), "fp32") == calibrated  # a saved calibration wins


def test_tensorboard_tags_flatten_nested_metrics():
    record = {"step": 4, "loss": 2.0, "peak_memory_bytes": [10, 20], "comm_bytes": {"ep": 8},
              "moe": {"layer1": {"imbalance": 1.5, "tokens_per_expert": [3, 5]}}, "trace": True}
    assert flatten_scalars(record) == {
        "loss": 2.0, "peak_memory_bytes/rank0": 10.0, "peak_memory_bytes/rank1": 20.0, "comm_bytes/ep": 8.0,
        "moe/layer1/imbalance": 1.5, "moe/layer1/tokens_per_expert/0": 3.0, "moe/layer1/tokens_per_expert/1": 5.0,
    }


# ---------------------------------------------------------------------------------- reports

EVERY_RUN = {"loss", "throughput", "step_time", "comm", "memory"}
FIGURES = {
    "pp2": EVERY_RUN | {"pipeline"},
    "moe_ep2": EVERY_RUN | {"moe_tokens", "moe_balance", "moe_all_to_all"},
    "cp2": EVERY_RUN,
}


def _figures(page: Path) -> set[str]:
    return {p.stem for p in page.parent.glob("*.png")}


def _damaged_runs(runs: Path, root: Path) -> dict[str, Path]:
    """An empty folder, a crashed run (last line cut short), an old run (no newer fields)."""
    empty = root / "empty"
    empty.mkdir()
    crashed = root / "crashed"
    shutil.copytree(runs / "moe_ep2", crashed)
    text = (crashed / "metrics.jsonl").read_text()
    (crashed / "metrics.jsonl").write_text(text[: len(text) - 40])
    old = root / "old"
    shutil.copytree(runs / "pp2", old)
    (old / "prediction.json").unlink()
    (old / "trace.json").unlink()
    new_fields = ("peak_memory_bytes", "comm_bytes", "held_bytes", "mfu")
    lines = [json.dumps({k: v for k, v in r.items() if k not in new_fields}) for r in _records(old)]
    (old / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return {"empty": empty, "crashed": crashed, "old": old}


@pytest.fixture(scope="module")
def pages(runs, tmp_path_factory) -> dict[str, Path]:
    """report.html of every run and every damaged folder, rendered once for the module."""
    root = tmp_path_factory.mktemp("reports")
    folders = {name: runs / name for name in RUNS} | _damaged_runs(runs, root)
    return {name: write_report(folder, root / f"{name}-report") for name, folder in folders.items()}


def test_reports_draw_every_section_that_applies(runs, pages):
    pages = {name: pages[name] for name in RUNS}
    for name, page in pages.items():
        assert _figures(page) == FIGURES[name], name
        assert load_run(runs / name).missing == [], name
    cp_page = pages["cp2"].read_text()
    assert "pp=1: no pipeline" in cp_page and "dense model" in cp_page
    assert "ep=2: every rank holds" not in pages["moe_ep2"].read_text()


def test_damaged_run_folders_report_what_is_missing(pages):
    assert _figures(pages["empty"]) == set()
    assert "metrics.jsonl is absent" in pages["empty"].read_text()
    assert "lines [3] are not step records" in pages["crashed"].read_text()
    assert {"loss", "moe_tokens"} <= _figures(pages["crashed"])
    old = pages["old"].read_text()
    assert "prediction.json is absent" in old and "no bytes per axis logged" in old
    assert "run with --train.trace true" in old and "pipeline" in _figures(pages["old"])  # the ideal chart


def test_report_cli_refuses_a_missing_folder(tmp_path, capsys):
    from fivefold.cli import main

    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def _load_in_browsers(browser: str, pages: list[Path]) -> list[tuple[str, str]]:
    """(DOM, console log) of each page, all browsers started at once."""
    flags = ["--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=2000", "--dump-dom"]
    procs = [subprocess.Popen([browser, *flags, page.resolve().as_uri()], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=page.parent) for page in pages]
    return [p.communicate(timeout=120) for p in procs]


def _console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if ":CONSOLE" in line]


def test_reports_load_in_a_headless_browser(runs, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip(f"no headless browser ({', '.join(BROWSERS)}) on PATH; .ci/run installs chromium")
    pages = [write_report(runs / name, tmp_path / name) for name in RUNS]
    pages += list(write_report(folder, tmp_path / f"{name}-report") for name, folder in _damaged_runs(runs, tmp_path).items())
    broken = tmp_path / "broken.html"  # proves the console check sees script errors
    broken.write_text("<html><body><script>notDefinedAnywhere();</script></body></html>")
    results = _load_in_browsers(browser, pages + [broken])
    for page, (dom, log) in zip(pages, results[:-1]):
        count = len(_figures(page))
        assert f'data-figures-loaded="{count}" data-figures="{count}"' in dom, (page, dom[:300])
        assert _console_errors(log) == [], page
    assert any("notDefinedAnywhere" in line for line in _console_errors(results[-1][1]))


# ------------------------------------------------------------------------- plan --compare


def test_plan_compare_zero_prints_the_papers_bytes_per_stage(capsys):
    from fivefold.planner import load_model
    from fivefold.tools.plan_cli import run_plan_cli

    assert run_plan_cli(["--compare", "zero", "--model", "llama3-70b", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    psi, n, k = load_model("llama3-70b").num_params(), 64, 12  # fp16/bf16 Adam: 2 + 2 + K
    expected = {
        "0 baseline": (2 + 2 + k) * psi,
        "1 Pos ": 2 * psi + 2 * psi + k * psi // n,
        "2 Pos+g ": 2 * psi + (2 + k) * psi // n,
        "3 Pos+g+p": (2 + 2 + k) * psi // n,
    }
    assert psi % n == 0  # the paper's formula is exact here, no rounding
    for stage, nbytes in expected.items():
        line = next(line for line in out.splitlines() if stage in line)
        assert f"{nbytes:,}" in line, (stage, line)


def test_plan_compare_schedule_tables_and_gantt(tmp_path, capsys):
    from fivefold.tools.plan_cli import run_plan_cli

    png = tmp_path / "schedules.png"
    assert run_plan_cli(["--compare", "schedule", "--model", "llama3-8b", "--gpus", "8", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0
    rows = {line.split("│")[1].strip(): line.split("│")[2:] for line in out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert set(rows) == {"gpipe", "1f1b", "interleaved (vpp=2)", "zb-h1"}
    gib = {name: float(cells[2]) for name, cells in rows.items()}
    assert gib["gpipe"] > gib["1f1b"]  # GPipe keeps every micro-batch's activations, 1F1B at most pp


def test_rules_of_thumb_name_the_rule_and_the_override():
    from fivefold.planner import estimate, load_model, parse_layout
    from fivefold.tools.plan_compare import rules_of_thumb

    dense = load_model("llama3-70b")
    chosen = estimate(dense, parse_layout("dp=1,tp=8,pp=8,zero=0,mb=1", global_batch=64), "H100-80GB")
    text = "\n".join(rules_of_thumb(dense, chosen))
    assert "TP inside a node: followed" in text and "PP across nodes: followed" in text
    assert "DP first: does not apply" in text
    moe = load_model("mixtral-8x7b")
    chosen = estimate(moe, parse_layout("dp=8,tp=8,pp=1,zero=1,mb=1", global_batch=64), "H100-80GB")
    lines = rules_of_thumb(moe, chosen)
    ep_line = next(line for line in lines if line.startswith("- EP for MoE"))
    assert "overridden" in ep_line and "ep=2" in ep_line


def test_plan_search_ends_with_the_rules_of_thumb(tmp_path, capsys):
    from fivefold.tools.plan_cli import run_plan_cli

    spec = tmp_path / "small.json"
    spec.write_text(json.dumps({"arch": "llama", "layers": 4, "hidden": 256, "heads": 4, "ffn_hidden": 512,
                                "vocab": 1024, "seq_len": 256}))
    assert run_plan_cli(["--model", str(spec), "--gpus", "4", "--hardware", "A100-40GB", "--global-batch", "8",
                         "--json", "--top", "1"]) == 0
    explanation = json.loads(capsys.readouterr().out)["explanation"]
    # a small model fits one device: the first rule applies, and the winner either follows it or says why not
    assert "- DP first: followed" in explanation or "- DP first: the model fits one device, yet" in explanation


def _uncalibrated_run(calibrated: bool):
    from fivefold.tools.report import RunData

    records = [{"step": s, "step_seconds": 1.0 + 0.1 * s, "tokens_per_s": 1000.0 - 10 * s} for s in range(4)]
    prediction = {"hardware": "cpu (rates measured at start)", "step_time_calibrated": calibrated,
                  "step_time_s": 0.01, "tokens_per_s": 100_000.0,
                  "breakdown_s": {"compute": 0.008, "optimizer": 0.002}}
    return RunData(Path("run"), {}, records, prediction, None)


@pytest.mark.parametrize("calibrated", [False, True])
def test_an_uncalibrated_step_time_is_marked_and_the_charts_scale_to_the_measurement(calibrated, monkeypatch):
    """A CPU prediction 100x off: uncalibrated, it is named so and the charts keep the measured scale;
    calibrated, the same value is a real drift and is drawn."""
    from fivefold.observe.prediction import summary
    from fivefold.tools import report

    limits = []
    monkeypatch.setattr(report, "_png", lambda fig: limits.append(fig.axes[0].get_ylim()) or b"")
    run = _uncalibrated_run(calibrated)
    notes = report.step_time_section(run).notes + report.throughput_section(run).notes
    (time_low, time_high), (tokens_low, tokens_high) = limits
    if calibrated:  # the prediction's lines are on the charts
        assert time_low <= 0.01 and tokens_high >= 100_000
        assert not any("uncalibrated" in n for n in notes)
    else:  # each chart spans the measured values only
        assert 0.9 < time_low and time_high < 1.5 and 900 < tokens_high < 1100
        assert sum("uncalibrated" in n for n in notes) == 2
    line = summary({**run.prediction, "memory_bytes": {"total": 0, "model_states": 0, "activations": 0},
                    "comm_bytes": {}})
    assert ("uncalibrated" in line) != calibrated and "0.01 s/step" in line
