"""train.malloc: glibc's allocator as a run setting (fivefold/malloc.py), applied in every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.job import malloc
from fivefold.config import ConfigError, load_config
from fivefold.job.malloc import MallocError, apply_malloc

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config", "tiny", "--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4"]
ON_GLIBC = malloc.glibc_mallopt() is not None

# Run in a process of its own (the setting is process-wide): allocate a block above glibc's
# largest self-adjusted mmap threshold (32 MiB), touch it, free it, and print how much of it
# stayed resident (MiB).
KEPT_AFTER_FREE = """
import ctypes, sys
from fivefold.job.malloc import apply_malloc
apply_malloc(sys.argv[1])
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
before = rss_mib()
block = libc.malloc(64 << 20)
ctypes.memset(block, 1, 64 << 20)
libc.free(block)
print(rss_mib() - before)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def test_an_unknown_setting_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"train.malloc='jemalloc' .* one of default, retain"):
        load_config("tiny", ["train.malloc=jemalloc"])
    with pytest.raises(MallocError, match="use one of: default, retain"):
        apply_malloc("jemalloc")


def test_an_unknown_setting_stops_a_multi_process_run_before_any_process_starts(tmp_path, monkeypatch, capsys):
    import fivefold.job.launch
    from fivefold.cli import main

    def no_launch(job):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(fivefold.job.launch, "run_job", no_launch)
    code = main(["train", *TINY, "--layout", "dp=2", "--train.malloc", "tcmalloc", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "train.malloc='tcmalloc' is out of range: it must be one of default, retain" in err
    assert not (tmp_path / "r").exists()


def test_without_glibc_the_setting_changes_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr(malloc, "glibc_mallopt", lambda: None)
    retain = apply_malloc("retain")
    assert not retain.in_effect and "not glibc" in retain.detail and "changes nothing" in retain.detail
    assert apply_malloc("default").in_effect  # the system's own allocator is the default


def test_thresholds_glibc_refuses_are_reported_not_claimed(monkeypatch):
    monkeypatch.setattr(malloc, "glibc_mallopt", lambda: lambda param, value: int(param == malloc.M_TRIM_THRESHOLD))
    monkeypatch.setattr(malloc, "glibc_version", lambda: "2.17")
    state = apply_malloc("retain")
    assert not state.in_effect and state.detail == "glibc 2.17 refused the mmap threshold: its own in their place"


@pytest.mark.skipif(not ON_GLIBC, reason="glibc's allocator only")
def test_retain_keeps_freed_memory_with_the_process():
    kept = {}
    for setting in ("default", "retain"):
        job = subprocess.run([sys.executable, "-c", KEPT_AFTER_FREE, setting], env=_env(), capture_output=True,
                             text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        kept[setting] = float(job.stdout)
    assert kept["default"] < 16 and kept["retain"] > 48, kept  # MiB of the freed 64


def test_a_launched_run_applies_the_setting_in_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    job = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", *TINY, "--train.steps", "1", "--layout", "dp=2",
                          "--train.malloc", "retain", "--run-dir", str(run_dir)],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stdout + job.stderr
    ranks = json.loads((run_dir / "malloc.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["setting"] == "retain" and r["in_effect"] == ON_GLIBC for r in ranks), ranks
    assert f"malloc=retain: {ranks[0]['detail']}" in job.stdout
