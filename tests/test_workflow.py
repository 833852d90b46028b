"""The user's workflow through the CLI, with nothing redone or lost: train, resume with the run's
own config, refuse to retrain a finished run, and keep metrics.jsonl free of repeated steps.

The CLI runs in this process (`fivefold.cli.main(argv)` with stdout/stderr captured).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

SMALL = ["--config", "tiny", "--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4",
         "--train.eval_interval", "0"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli(*argv: str, cwd: Path) -> tuple[int, str, str]:
    """Run `fivefold ARGV` in this process from `cwd`; (exit code, stdout, stderr)."""
    from fivefold.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(before)
    return code, out.getvalue(), err.getvalue()


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(tmp_path: Path, name: str, *extra: str) -> Path:
    code, out, err = cli("train", *SMALL, "--run-dir", name, *extra, cwd=tmp_path)
    assert code == 0, out + err
    return tmp_path / name


def test_resume_without_config_takes_the_runs_own_config(tmp_path):
    run = train(tmp_path, "run", "--train.steps", "2", "--checkpoint.interval", "1")
    code, out, err = cli("train", "--run-dir", "run", "--resume", "--train.steps", "3", "--checkpoint.interval", "3",
                         cwd=tmp_path)
    assert code == 0, out + err  # the small preset's model would not fit the tiny checkpoint
    assert "settings changed since it was saved: train.steps: 2 -> 3, checkpoint.interval: 1 -> 3" in out
    assert "resuming at step 2 from run/checkpoints/step_000002" in out and "no checkpoint" not in out
    assert logged_steps(run) == [0, 1, 2]
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["layers"] == 2 and saved["checkpoint"]["interval"] == 3


def test_resume_after_import_reads_the_imported_config(tmp_path):
    train(tmp_path, "run", "--train.steps", "1")
    assert cli("convert", "export", "--run-dir", "run", "--out", "hf", cwd=tmp_path)[0] == 0
    code, out, err = cli("convert", "import", "--hf", "hf", "--run-dir", "imported", cwd=tmp_path)
    assert code == 0 and "fivefold train --run-dir imported --resume" in out, out + err
    code, out, err = cli("train", "--run-dir", "imported", "--resume", "--train.steps", "1", "--train.seq_len", "16",
                         "--train.global_batch", "4", cwd=tmp_path)
    assert code == 0, out + err
    assert "resuming at step 0 from imported/checkpoints/step_000000" in out and "no checkpoint" not in out
    assert logged_steps(tmp_path / "imported") == [0]


@pytest.mark.parametrize("interval", ["0", "1"])  # final weights alone, or a checkpoint of the last step too
def test_resuming_a_finished_run_is_refused_and_changes_nothing(tmp_path, interval):
    run = train(tmp_path, "run", "--train.steps", "2", "--checkpoint.interval", interval)
    metrics = (run / "metrics.jsonl").read_bytes()
    code, out, err = cli("train", *SMALL, "--train.steps", "2", "--run-dir", "run", "--resume", cwd=tmp_path)
    assert code == 2 and "Traceback" not in err
    assert "has finished 2 steps" in err and "--train.steps N with N larger than 2" in err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_resume_from_an_older_checkpoint_supersedes_later_metrics_rows(tmp_path):
    """A run that logged step 2 but whose newest checkpoint is step 2's start (as after a crash)."""
    run = train(tmp_path, "run", "--train.steps", "3", "--checkpoint.interval", "2")
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "model.safetensors").unlink()
    assert logged_steps(run) == [0, 1, 2]
    code, out, err = cli("train", "--run-dir", "run", "--resume", cwd=tmp_path)
    assert code == 0, out + err
    assert "1 metrics.jsonl rows of steps from 2 on are superseded" in out
    assert logged_steps(run) == [0, 1, 2]
    code, out, err = cli("report", "run", cwd=tmp_path)
    assert code == 0, out + err
    assert "3 steps in metrics.jsonl" in (run / "report" / "report.html").read_text()


def test_report_counts_each_step_once_in_a_file_that_repeats_steps(tmp_path):
    from fivefold.tools.report import read_metrics

    rows = [{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 1, "loss": 3.5}, {"step": 2, "loss": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = read_metrics(tmp_path / "metrics.jsonl", [])
    assert [(r["step"], r["loss"]) for r in records] == [(0, 5.0), (1, 3.5), (2, 3.0)]


def test_the_progress_bar_shows_no_loss_before_the_first_step():
    from rich.console import Console

    from fivefold.run import _progress, add_train_task

    progress = _progress(True, 4)
    add_train_task(progress, 4, 0)
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    console.print(progress.get_renderable())
    text = console.file.getvalue()
    assert "loss -" in text and "nan" not in text


def test_a_refused_run_removes_the_folder_it_created_and_keeps_one_that_was_there(tmp_path):
    (tmp_path / "was_there").mkdir()
    for folder in ("new", "was_there"):
        for layout in ("dp=1", "dp=2"):  # in this process, and refused by the launcher before it starts ranks
            code, out, err = cli("train", *SMALL, "--layout", layout, "--run-dir", folder,
                                 "--data.source", "missing.bin", cwd=tmp_path)
            assert code == 2 and "data.source=missing.bin does not exist" in err
    assert not (tmp_path / "new").exists() and (tmp_path / "was_there").is_dir()


def test_report_of_a_folder_of_runs_names_the_runs_inside(tmp_path):
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    code, out, err = cli("report", "runs", cwd=tmp_path)
    assert code == 2 and "runs holds 2 run folder(s) (a, b), not a run" in err
    assert "fivefold report runs/b" in err and not (tmp_path / "runs" / "report").exists()


@pytest.mark.parametrize("argv, words", [
    (["--train.step", "3"], "unknown key 'train.step' (did you mean 'train.steps'?)"),
    (["--trian.steps", "3"], "unknown section 'trian' (did you mean 'train'?)"),
    (["--layout", "dp=2,tpp=2"], "unknown key 'layout.tpp' (did you mean 'layout.tp'?)"),
    (["--layout", "pp=2,pp_layers=3,3"], "give it on its own as --layout.pp_layers 3,3"),
])
def test_a_misspelled_setting_names_the_fix(argv, words, tmp_path):
    code, out, err = cli("train", "--config", "tiny", *argv, "--run-dir", "run", cwd=tmp_path)
    assert code == 2 and words in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_overwrite_deletes_what_a_run_wrote_and_keeps_the_users_files(tmp_path):
    from fivefold.job.rundir import is_run_output

    run = train(tmp_path, "run", "--train.steps", "2", "--checkpoint.interval", "1")
    written = sorted(p.name for p in run.iterdir() if p.name != ".lock")
    assert written and all(is_run_output(name) for name in written), written  # the list knows every output
    (run / "notes.txt").write_text("mine")
    (run / "analysis").mkdir()
    (run / "analysis" / "plot.py").write_text("mine too")
    code, out, err = cli("train", *SMALL, "--run-dir", "run", "--overwrite", "--train.steps", "1", cwd=tmp_path)
    assert code == 0, out + err
    assert "--overwrite: kept analysis, notes.txt in run (not written by a run)" in out
    assert (run / "notes.txt").read_text() == "mine" and (run / "analysis" / "plot.py").read_text() == "mine too"
    assert logged_steps(run) == [0] and not (run / "checkpoints").exists()


def test_import_into_a_folder_holding_a_run_is_refused_and_changes_nothing(tmp_path):
    run = train(tmp_path, "run", "--train.steps", "1")  # final weights, no checkpoint
    assert cli("convert", "export", "--run-dir", "run", "--out", "hf", cwd=tmp_path)[0] == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, out, err = cli("convert", "import", "--hf", "hf", "--run-dir", "run", cwd=tmp_path)
    assert code != 0 and "Traceback" not in err
    assert "run is not empty" in err and "import into a new or empty --run-dir" in err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
