"""Faults of multi-process jobs under the fivefold launcher: killed ranks, a stopped rank,
SIGTERM to the launcher, clean exits. These tests spawn real processes (that is what they
are about), so they use the tiny preset with 2 layers, 16-token sequences and few steps.

Processes are found from outside, through /proc: a rank is a child of the launcher with
RANK in its environment; every process of a test's job carries FIVEFOLD_TEST_JOB=<tag>.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import checkpoint_root, full_state_of_run, list_checkpoints
from fivefold.job.launch import ranks_not_arrived, waits_for

TINY = ["--config", "tiny", "--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4"]
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers


class TrainJob:
    """`fivefold train` started as a user would, with its output in files and a /proc tag."""

    def __init__(self, tmp: Path, run_dir: Path, layout: str, *flags: str) -> None:
        self.tag = uuid.uuid4().hex
        self.run_dir = run_dir
        self.out, self.err = tmp / f"{run_dir.name}.out", tmp / f"{run_dir.name}.err"
        env = dict(os.environ, FIVEFOLD_TEST_JOB=self.tag, PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "fivefold.cli", "train", *TINY, "--layout", layout, "--run-dir", str(run_dir), *flags]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=tmp)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def stderr(self) -> str:
        return self.err.read_text()


def proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def live_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def processes_of_job(tag: str) -> list[int]:
    """Every process (zombies excluded: their environment is gone) that carries the job's tag."""
    return [pid for pid in live_pids() if proc_environ(pid).get("FIVEFOLD_TEST_JOB") == tag]


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's current rank processes."""
    ranks = {}
    for pid in live_pids():
        if parent_of(pid) == launcher:
            env = proc_environ(pid)
            if "RANK" in env:
                ranks[int(env["RANK"])] = pid
    return ranks


def wait_for(condition, timeout: float, what: str, job: TrainJob | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(f"the job exited ({job.proc.returncode}) while waiting for {what}:\n{job.stderr()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{job.stderr()}" if job else ""))


def newest_step(run_dir: Path) -> int:
    found = list_checkpoints(checkpoint_root(run_dir))
    return int(found[0].name.split("_")[1]) if found else 0


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_weights(run_dir: Path) -> dict:
    from fivefold.checkpoint import final_weights_of

    found = final_weights_of(run_dir)
    assert found is not None, f"{run_dir} has no final weights"
    return found.read_all()


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("key, value", [("max_restarts", "-1"), ("collective_timeout_s", "0"),
                                        ("collective_timeout_s", "nan"), ("stop_grace_s", "-5")])
def test_impossible_fault_settings_are_refused_before_any_process_starts(key, value):
    from fivefold.config import ConfigError, load_config

    # the config's range table refuses them while loading, before the launcher exists
    with pytest.raises(ConfigError, match=rf"train\.{key}={value}(\.0)? is (out of range: it must be|not a finite number)"):
        load_config("tiny", [f"train.{key}={value}"])


# ----------------------------------------------------------------------------- flight recorder


def _flight_log(ctx):
    from fivefold.config import Layout
    from fivefold.parallel import comm

    mesh = ctx.mesh(Layout(dp=2))
    flight = mesh.stats.flight
    before = flight.issued.get("dp", 0)
    x = torch.ones(256)
    comm.all_reduce(x, mesh.dp)
    work = comm.all_reduce(x, mesh.dp, async_op=True)
    while not work.is_completed():  # completion, not wait(), is what finishes a record
        time.sleep(0.001)
    flight.sweep()
    done = [(r.axis, r.op, r.seq - before, r.bytes, r.finished is not None) for r in list(flight.records)[-2:]]
    work.wait()
    return done, flight.oldest_in_flight()


def _waited_reduce_scatter(ctx):
    from fivefold.config import Layout
    from fivefold.parallel import comm

    mesh = ctx.mesh(Layout(dp=2))
    _, work = comm.reduce_scatter(torch.ones(8), mesh.dp, async_op=True)
    work.wait()
    record = mesh.stats.flight.newest()
    return record.op, record.finished is not None


def test_a_waited_async_collective_is_finished_even_when_its_handle_never_says_so(pools):
    """gloo's async reduce-scatter handle never reports is_completed(), not even after wait():
    the record must still finish, or the watchdog would end every long ZeRO run."""
    assert pools.run(2, _waited_reduce_scatter) == [("reduce_scatter", True)] * 2


def test_flight_recorder_numbers_collectives_per_axis_and_sees_async_completion(pools):
    for done, oldest in pools.run(2, _flight_log):
        assert done == [("dp", "all_reduce", 1, 1024, True), ("dp", "all_reduce", 2, 1024, True)]
        assert oldest is None


# ----------------------------------------------------------------------------- (a) killed ranks


def test_random_rank_killed_five_times_restarts_and_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    """4 ranks (dp=2, tp=2), a checkpoint after every step; five times, a random rank is
    SIGKILLed at a random point after a random step. The launcher restarts each time from the
    last checkpoint, and the final weights equal an uninterrupted run's bit for bit."""
    rng = random.Random()
    steps, kills, layout = 12, 5, "dp=2,tp=2"
    flags = ("--train.steps", str(steps), "--checkpoint.interval", "1")
    straight = TrainJob(tmp_path, tmp_path / "straight", layout, *flags)
    assert straight.wait() == 0, straight.stderr()

    job = TrainJob(tmp_path, tmp_path / "faulty", layout, *flags, "--train.max_restarts", str(kills))
    killed: list[tuple[int, int]] = []
    previous: set[int] = set()
    for _ in range(kills):
        ranks = wait_for(lambda: (r := rank_pids(job.proc.pid)) and len(r) == 4 and not set(r.values()) & previous and r,
                         120, "the ranks of the next attempt", job)
        previous = set(ranks.values())
        target = newest_step(job.run_dir) + rng.randint(1, 2)  # a step this attempt has not done yet
        wait_for(lambda: newest_step(job.run_dir) >= target, 120, f"checkpoint of step {target}", job)
        time.sleep(rng.uniform(0, 0.1))  # sometimes right after the checkpoint, sometimes inside the next step
        victim = rng.randrange(4)
        os.kill(ranks[victim], signal.SIGKILL)
        killed.append((victim, target))
    assert job.wait() == 0, job.stderr()
    assert job.stderr().count("was killed by SIGKILL") == kills, job.stderr()
    logged = [json.loads(line)["step"] for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(steps))  # a step trained again after a restart replaces its row
    reference, restarted = final_weights(straight.run_dir), final_weights(job.run_dir)
    assert reference.keys() == restarted.keys()
    for name in reference:
        assert reference[name].equal(restarted[name]), f"{name} differs after kills {killed}"


# ----------------------------------------------------------------------------- (b) stopped rank


def test_stopped_rank_ends_the_job_within_the_timeout_with_a_report_naming_it(tmp_path):
    # Margin after the first rank blocked: watchdog poll, the other ranks' records, SIGKILL.
    # From the SIGSTOP itself, the other ranks may first compute for a while (slowly, on a busy machine).
    timeout_s, margin_s, busy_machine_s = 6.0, 10.0, 30.0
    job = TrainJob(tmp_path, tmp_path / "stuck", "dp=2,tp=2", "--train.steps", "500",
                   "--train.collective_timeout_s", str(timeout_s))
    wait_for(lambda: metrics_lines(job.run_dir) >= 1, 120, "the first step", job)
    ranks = rank_pids(job.proc.pid)
    victim = random.randrange(4)
    os.kill(ranks[victim], signal.SIGSTOP)
    stopped_at = time.monotonic()
    code = job.wait(timeout=timeout_s + 60)
    elapsed = time.monotonic() - stopped_at
    err = job.stderr()
    assert code == 1, err
    records = [json.loads(p.read_text()) for p in (job.run_dir / "flight_records" / "attempt_0").glob("rank_*.json")]
    first_blocked = min(r["stuck"]["started"] for r in records)
    reported = job.err.stat().st_mtime  # the report comes once every rank has been reaped
    assert reported - first_blocked < timeout_s + margin_s, f"the report came {reported - first_blocked:.1f} s after a rank blocked"
    assert elapsed < timeout_s + busy_machine_s, f"the job took {elapsed:.1f} s to end"
    assert f"rank {victim} did not arrive" in err, err
    assert f"rank {victim}: stopped" in err, err
    waiting = [line for line in err.splitlines() if "waited" in line and f"rank {victim} (" in line]
    assert waiting and any(op in waiting[0] for op in ("all_reduce", "all_gather", "reduce_scatter")), err
    assert processes_of_job(job.tag) == []


def record(rank: int, axis: str, group: list[int], seq: int, issued: dict[str, int]) -> dict:
    stuck = {"axis": axis, "group": group, "op": "all_reduce", "seq": seq, "bytes": 4, "started": 0.0}
    return {"rank": rank, "time": 5.0, "stuck": stuck, "issued": issued}


def test_report_names_the_root_of_the_wait_not_the_ranks_blocked_behind_it():
    # dp=2, tp=2; rank 3 is stopped. Rank 2 waits for it in tp, rank 1 in dp; rank 0 waits in
    # dp for rank 2, which never got to that dp collective because it is stuck in tp.
    records = {
        0: record(0, "dp", [0, 2], 8, {"dp": 8, "tp": 20}),
        1: record(1, "dp", [1, 3], 8, {"dp": 8, "tp": 20}),
        2: record(2, "tp", [2, 3], 21, {"dp": 7, "tp": 21}),
    }
    assert waits_for(records)[0] == {2: "its last collective on axis dp is #7"}
    assert ranks_not_arrived(records) == [3]
    # Two ranks that issued different collectives wait for each other: both are named.
    crossed = {0: record(0, "dp", [0, 1], 3, {"dp": 3, "tp": 1}), 1: record(1, "tp", [0, 1], 2, {"dp": 2, "tp": 2})}
    crossed[1]["stuck"]["group"] = [0, 1]
    assert ranks_not_arrived(crossed) == [0, 1]


# ----------------------------------------------------------------------------- (c) signals


def test_sigterm_to_the_launcher_stops_every_process_and_keeps_the_checkpoint(tmp_path):
    job = TrainJob(tmp_path, tmp_path / "term", "dp=2", "--train.steps", "500", "--checkpoint.interval", "2")
    wait_for(lambda: newest_step(job.run_dir) >= 2, 120, "the first checkpoint", job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.stderr()
    assert processes_of_job(job.tag) == []
    step = newest_step(job.run_dir)
    assert step >= 2 and not (job.run_dir / "model.safetensors").exists()
    _, state = full_state_of_run(job.run_dir)  # every shard present, checksums verified on read
    assert state and all(t.isfinite().all() for t in state.values())
    assert json.loads((job.run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step - 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signalled_single_process_run_checkpoints_and_exits_as_the_launcher_does(tmp_path, sig):
    """Ctrl-C or SIGTERM to a one-process `fivefold train`: a checkpoint after the current step, one
    line naming the signal and --resume, no traceback, and 128 + the signal as a dp=2 job exits."""
    job = TrainJob(tmp_path, tmp_path / "single", "dp=1", "--train.steps", "5000")
    wait_for(lambda: metrics_lines(job.run_dir) >= 1, 120, "the first step", job)
    job.proc.send_signal(sig)
    assert job.wait(timeout=60) == 128 + sig, job.stderr()
    assert "Traceback" not in job.stderr() and "--resume" in job.stderr(), job.stderr()
    step = newest_step(job.run_dir)
    assert step >= 1 and not (job.run_dir / "model.safetensors").exists()
    assert json.loads((job.run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step - 1


def test_sigkill_to_the_launcher_leaves_no_orphans(tmp_path):
    job = TrainJob(tmp_path, tmp_path / "orphans", "dp=2", "--train.steps", "500")
    wait_for(lambda: len(rank_pids(job.proc.pid)) == 2, 120, "the ranks", job)
    job.proc.kill()
    job.proc.wait()
    wait_for(lambda: processes_of_job(job.tag) == [], 10, "the ranks to die with the launcher")


# ----------------------------------------------------------------------------- (d) clean exits


def test_finished_jobs_exit_zero_every_time(tmp_path):
    for run in range(3):
        job = TrainJob(tmp_path, tmp_path / f"clean{run}", "dp=2", "--train.steps", "2")
        code = job.wait()
        assert code == 0 and "terminate called" not in job.stderr(), job.stderr()
        assert (job.run_dir / "model.safetensors").exists()


LEAVE_CLEANLY = """
import os, sys, torch
from pathlib import Path
from fivefold.config import load_config
from fivefold.parallel import comm
from fivefold.run import distributed_job

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
with distributed_job(load_config("tiny", ["layout.dp=2"]), Path(sys.argv[1])) as (mesh, _):
    during = threads()
    comm.all_reduce(torch.ones(8), mesh.dp, async_op=True).wait()
Path(sys.argv[1], f"threads_{mesh.rank}").write_text(f"{before} {during} {threads()}")
"""


def test_a_finished_rank_joins_every_backend_thread_before_exit(tmp_path):
    """The cause of the aborts at exit: gloo worker threads still alive when the interpreter
    is torn down. After distributed_job, a rank has no more threads than before it joined."""
    from fivefold.job.launch import Job, run_job

    job = Job(world_size=2, command=("-c", LEAVE_CLEANLY, str(tmp_path)), flight_dir=tmp_path / "flight",
              env={"PYTHONPATH": str(REPO)})
    assert run_job(job) == 0
    for rank in range(2):
        before, during, after = map(int, (tmp_path / f"threads_{rank}").read_text().split())
        assert during > before and after <= before, (before, during, after)


@pytest.mark.skipif(os.environ.get("FIVEFOLD_SLOW_TESTS") != "1", reason="16 processes; set FIVEFOLD_SLOW_TESTS=1")
def test_five_dimensional_parity_exits_zero_in_back_to_back_runs(tmp_path):
    cmd = [sys.executable, "-m", "fivefold.cli", "parity", "--config", "tiny-moe",
           "--layout", "dp=2,cp=2,tp=2,pp=2,ep=2,grad_accum=2", "--steps", "3"]
    for _ in range(3):
        job = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
        assert job.returncode == 0 and "terminate called" not in job.stderr, job.stdout + job.stderr
