"""A preparation cut short: Ctrl-C or a full disk during `fivefold data prepare` gives one line,
no traceback and no partial file, and training on the folder names the unfinished preparation
instead of looking for text files in it. Run as a user would: real processes, a real signal to
the whole process group (as a terminal's Ctrl-C), and a file size limit for the full disk."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["train", "--config", "tiny", "--model.layers", "1", "--train.seq_len", "16", "--train.global_batch", "4",
         "--train.steps", "1"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def _cli(argv: list[str], cwd: Path, file_limit: int = 0) -> subprocess.CompletedProcess:
    """`python -m fivefold.cli ARGV`; with `file_limit`, writes beyond it fail as on a full disk."""
    limit = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_limit}, resource.RLIM_INFINITY)); ") if file_limit else ""
    code = f"import sys; {limit}from fivefold.cli import main; sys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], env=_env(), cwd=cwd, capture_output=True, text=True, timeout=300)


def _jsonl_inputs(folder: Path, files: int, docs: int) -> Path:
    folder.mkdir()
    for i in range(files):
        rows = [json.dumps({"text": f"document {i}.{j} " + "lorem ipsum dolor sit amet " * 40}) for j in range(docs)]
        (folder / f"part_{i:04d}.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.tmp"))


def _assert_train_names_the_unfinished_preparation(out: Path, cwd: Path) -> None:
    from fivefold.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([*TRAIN, "--data.source", str(out), "--run-dir", str(cwd / "run")])
    assert code == 2, err.getvalue()
    assert "did not finish" in err.getvalue() and "holds no .txt" not in err.getvalue(), err.getvalue()


def test_a_full_disk_gives_one_line_leaves_no_partial_file_and_train_names_the_unfinished_preparation(tmp_path):
    inputs = _jsonl_inputs(tmp_path / "in", files=1, docs=200)  # one ~220 kB shard
    out = tmp_path / "prepared"
    result = _cli(["data", "prepare", str(inputs), "--out", str(out), "--workers", "1"], tmp_path, file_limit=50_000)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "disk is full" in lines[0] and "again" in lines[0], result.stderr
    assert _leftovers(out) == [] and not (out / "shard_00000.bin").exists() and not (out / "manifest.json").exists()
    _assert_train_names_the_unfinished_preparation(out, tmp_path)


def test_ctrl_c_gives_one_line_leaves_no_partial_file_and_the_next_run_continues(tmp_path):
    inputs = _jsonl_inputs(tmp_path / "in", files=300, docs=60)
    out = tmp_path / "prepared"
    cmd = [sys.executable, "-m", "fivefold.cli", "data", "prepare", str(inputs), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("shard_*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the preparation ended before it could be interrupted: {proc.communicate()}"
    os.killpg(proc.pid, signal.SIGINT)  # a terminal sends Ctrl-C to every process of the group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err and "again" in err, err
    assert _leftovers(out) == [] and not (out / "manifest.json").exists()
    _assert_train_names_the_unfinished_preparation(out, tmp_path)
    again = _cli(["data", "prepare", str(inputs), "--out", str(out), "--workers", "2"], tmp_path)
    assert again.returncode == 0 and "finished shards kept" in again.stdout, again.stdout + again.stderr
