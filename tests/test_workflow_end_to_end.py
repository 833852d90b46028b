"""A user's whole workflow, through the command line only, each command a process of its own:
prepare a corpus, train it under a two-rank layout, stop the job with Ctrl-C, resume it with
the run's own settings, finish, report, export, and load the export in transformers, whose
logits must be the run's own final weights'.

The import -> fine-tune -> export round trip is `test_import_fine_tune_export_exports_the_fine_tuned_weights`
(tests/checkpoint/test_final_weights.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--config", "tiny", "--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4",
         "--train.eval_interval", "0"]


def fivefold(*argv: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`fivefold ARGV` as a user runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "fivefold.cli", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


def _write_corpus(folder: Path) -> None:
    folder.mkdir()
    lines = [f"Document {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 11}." for i in range(400)]
    (folder / "a.txt").write_text("\n\n".join(lines[:200]))
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[200:]))


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _stop_with_ctrl_c_after(job: subprocess.Popen, run: Path, steps: int, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while not ((run / "metrics.jsonl").exists() and len(_steps(run)) >= steps):
        assert job.poll() is None, f"the job exited ({job.returncode}) before step {steps}"
        assert time.monotonic() < deadline, f"no step {steps} within {timeout} s"
        time.sleep(0.1)
    job.send_signal(signal.SIGINT)
    return job.wait(timeout=120)


def test_prepare_train_interrupt_resume_report_export_and_load_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fivefold.checkpoint import checkpoint_root, list_checkpoints
    from fivefold.tools.generate import load_trained

    _write_corpus(tmp_path / "corpus")
    done = fivefold("data", "prepare", "corpus", "--out", "prepared", "--workers", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr

    run = tmp_path / "run"
    with open(tmp_path / "train.err", "w") as err:
        job = subprocess.Popen(
            [sys.executable, "-m", "fivefold.cli", "train", *TRAIN, "--layout", "dp=2", "--data.source", "prepared",
             "--run-dir", "run", "--train.steps", "100000"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            code = _stop_with_ctrl_c_after(job, run, steps=2)
        finally:
            if job.poll() is None:
                job.kill()
    stderr = (tmp_path / "train.err").read_text()
    assert code == 130 and "--resume" in stderr and "Traceback" not in stderr, stderr[-3000:]
    saved = int(list_checkpoints(checkpoint_root(run))[0].name.split("_")[1])  # the checkpoint Ctrl-C wrote
    assert saved >= 2 and not (run / "model.safetensors").exists()

    # The run's own config (its layout and data included); only the new length is given.
    done = fivefold("train", "--run-dir", "run", "--resume", "--train.steps", saved + 3, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(run) == list(range(saved + 3))  # every step once: none redone, none lost
    assert (run / "model.safetensors").exists()

    done = fivefold("report", "run", cwd=tmp_path)
    assert done.returncode == 0 and (run / "report" / "report.html").exists(), done.stderr
    done = fivefold("convert", "export", "--run-dir", "run", "--out", "hf", cwd=tmp_path)
    assert done.returncode == 0 and "from the final weights" in done.stdout + done.stderr, done.stderr

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _ = load_trained(str(run), torch.device("cpu"))
    ids = torch.tensor([list(b"the quick brown fox")])
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = exported(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
