"""The `fivefold` launcher: starts the local ranks of a job and supervises them.

`fivefold train` and `fivefold parity` use it for layouts of more than one process (plain
`torchrun ... -m fivefold.cli train` keeps working for those who launch themselves, and for
several nodes). For every attempt it

- hosts a fresh rendezvous store on a loopback socket (127.0.0.1, a free port chosen by the
  kernel and held from bind to exit, so no other job can take it) and starts each rank with
  torch.distributed's environment variables, gloo bound to the loopback interface too;
  no key of an earlier attempt can reach a later one (torchrun's own restarts of these
  jobs failed in gloo's connectFullMesh or hung);
- watches the ranks: when one exits with an error or is killed, it SIGKILLs the others
  (checkpoints are committed atomically, so nothing saved is lost) and, while restarts are
  left (`train.max_restarts`), starts the next attempt with `--resume`;
- when a rank's collective watchdog ends it (`train.collective_timeout_s`), it waits a few
  seconds for the other ranks' flight records, SIGKILLs what is left (stopped processes
  included) and prints one report naming the rank that did not arrive;
- turns Ctrl-C and SIGTERM into SIGTERM for every rank (ranks checkpoint after the current
  step and exit); after `train.stop_grace_s`, or at a second signal, it SIGKILLs them.

Ranks run in their own session (a terminal's Ctrl-C reaches only the launcher, which stops
them in order) and die with the launcher even if it is SIGKILLed (Linux parent-death
signal): no orphans. The launcher exits 0 only when every rank of an attempt exited 0 and
no stop was requested.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from ..parallel.comm import COLLECTIVE_TIMEOUT_EXIT, FLIGHT_DIR_ENV, PEER_LOST_EXIT, flight_record_path

POLL_S = 0.05
FLIGHT_RECORD_WAIT_S = 5.0  # after the first watchdog exit: time for the other ranks' records


@dataclass(frozen=True)
class Job:
    """What to start on every attempt and how to supervise it."""

    world_size: int
    command: tuple[str, ...]  # each rank runs `python <command>`
    resume_args: tuple[str, ...] = ()  # appended to the command from the second attempt on
    max_restarts: int = 0
    collective_timeout_s: float = 300.0
    stop_grace_s: float = 30.0
    flight_dir: Path = Path("flight_records")  # attempt k writes its ranks' records to flight_dir/attempt_k
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the ranks


@dataclass
class Outcome:
    """How an attempt ended: exit statuses per rank (None: was still running when stopped)."""

    codes: list[int | None]
    stopped_ranks: list[int] = field(default_factory=list)  # SIGSTOPped when the attempt ended
    signal_received: int = 0

    @property
    def finished(self) -> bool:
        return not self.signal_received and all(code == 0 for code in self.codes)

    @property
    def timed_out(self) -> bool:
        return COLLECTIVE_TIMEOUT_EXIT in self.codes


class SignalLatch:
    """Records SIGINT/SIGTERM (and SIGHUP) for the supervision loop, instead of dying at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalLatch":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)


# ------------------------------------------------------------------------------ one attempt


def loopback_store(timeout_s: float) -> tuple[Any, int]:
    """A fresh rendezvous store listening on 127.0.0.1, on a port the kernel chose; ranks
    join it as clients. Returns (store, port); the store owns and closes the socket."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )
    return store, port


def loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def rank_env(job: Job, rank: int, attempt: int, port: int) -> dict[str, str]:
    """torch.distributed's environment for `rank`, as torchrun would set it on one node."""
    env = dict(os.environ, **job.env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
        WORLD_SIZE=str(job.world_size), LOCAL_WORLD_SIZE=str(job.world_size), ROLE_WORLD_SIZE=str(job.world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        # The store is the launcher's: ranks connect as clients under the attempt's prefix.
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt),
        TORCHELASTIC_MAX_RESTARTS=str(job.max_restarts),
        FIVEFOLD_LAUNCHED="1", **{FLIGHT_DIR_ENV: str(attempt_flight_dir(job, attempt))},
    )
    interface = loopback_interface()
    if interface:  # single node: gloo's and NCCL's own sockets on loopback too
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return env


def attempt_flight_dir(job: Job, attempt: int) -> Path:
    return job.flight_dir / f"attempt_{attempt}"


def die_with_parent() -> Callable[[], None] | None:
    """A preexec function: the rank gets SIGKILL when the launcher dies, however it dies
    (Linux's parent-death signal). prctl is looked up here, before fork, so the child only
    calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    launcher = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before the signal was armed
            os._exit(1)

    return arm


def start_ranks(job: Job, attempt: int, port: int) -> list[subprocess.Popen]:
    command = [sys.executable, *job.command, *(job.resume_args if attempt else ())]
    preexec = die_with_parent()
    return [
        subprocess.Popen(command, env=rank_env(job, rank, attempt, port), start_new_session=True, preexec_fn=preexec)
        for rank in range(job.world_size)
    ]


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP) or traced, from /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass


def kill_and_reap(procs: list[subprocess.Popen]) -> None:
    signal_all(procs, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    for proc in procs:
        proc.wait()


def wait_until(procs: list[subprocess.Popen], deadline: float, done: Callable[[list[subprocess.Popen]], bool]) -> None:
    while time.monotonic() < deadline and not done(procs):
        time.sleep(POLL_S)


def all_exited(procs: list[subprocess.Popen]) -> bool:
    return all(p.poll() is not None for p in procs)


def all_exited_or_stopped(procs: list[subprocess.Popen]) -> bool:
    return all(p.poll() is not None or is_stopped(p.pid) for p in procs)


def any_failed(procs: list[subprocess.Popen]) -> bool:
    return any(p.poll() not in (None, 0) for p in procs)


def supervise(procs: list[subprocess.Popen], job: Job, latch: SignalLatch) -> Outcome:
    """Wait for the attempt to finish, fail, or be stopped by a signal; return how it ended."""
    while True:
        if latch.received:
            return stop_on_signal(procs, job, latch)
        codes = [p.poll() for p in procs]
        if all(code == 0 for code in codes):
            return Outcome(codes)
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            if COLLECTIVE_TIMEOUT_EXIT in failed:  # the others are timing out too: collect their records
                wait_until(procs, time.monotonic() + FLIGHT_RECORD_WAIT_S, all_exited_or_stopped)
            stopped = [rank for rank, p in enumerate(procs) if p.poll() is None and is_stopped(p.pid)]
            return Outcome([p.poll() for p in procs], stopped)
        time.sleep(POLL_S)


def stop_on_signal(procs: list[subprocess.Popen], job: Job, latch: SignalLatch) -> Outcome:
    """Forward SIGTERM to every rank; wait for them to checkpoint and exit, within the grace time."""
    first = latch.received[0]
    print(
        f"fivefold: {signal.Signals(first).name}: stopping all ranks (training ranks checkpoint after the "
        f"current step; SIGKILL after {job.stop_grace_s:g} s or at a second signal)",
        file=sys.stderr, flush=True,
    )
    signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + job.stop_grace_s
    # A rank that died (e.g. signalled before it could checkpoint) leaves the others unable to agree.
    wait_until(procs, deadline, lambda ps: all_exited(ps) or any_failed(ps) or len(latch.received) > 1)
    return Outcome([p.poll() for p in procs], signal_received=first)


def run_attempt(job: Job, attempt: int, latch: SignalLatch) -> Outcome:
    flight = attempt_flight_dir(job, attempt)
    shutil.rmtree(flight, ignore_errors=True)  # records of an earlier job with this attempt number
    store, port = loopback_store(job.collective_timeout_s)
    procs = start_ranks(job, attempt, port)
    try:
        return supervise(procs, job, latch)
    finally:
        kill_and_reap(procs)
        del store  # the next attempt gets a fresh store: no keys of this one can confuse it


# ------------------------------------------------------------------------------ reports


def read_flight_records(folder: Path, world_size: int) -> dict[int, dict[str, Any]]:
    records = {}
    for rank in range(world_size):
        try:
            records[rank] = json.loads(flight_record_path(folder, rank).read_text())
        except (OSError, ValueError):
            continue
    return records


def waits_for(records: dict[int, dict[str, Any]]) -> dict[int, dict[int, str]]:
    """The wait-for graph: for each rank with a record, the partners of its unfinished
    collective that never issued it (their sequence number on that axis lags, or they wrote
    no record at all), each with the evidence."""
    graph: dict[int, dict[int, str]] = {}
    for rank, record in sorted(records.items()):
        stuck = record["stuck"]
        graph[rank] = {}
        for peer in stuck["group"]:
            if peer == rank:
                continue
            if peer not in records:
                graph[rank][peer] = "wrote no flight record"
                continue
            issued = records[peer]["issued"].get(stuck["axis"], 0)
            if issued < stuck["seq"]:
                graph[rank][peer] = f"its last collective on axis {stuck['axis']} is #{issued}"
    return graph


def ranks_not_arrived(records: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks at the root of the wait: waited for, and not themselves waiting for anyone
    (stopped, dead, or busy outside any collective). Ranks blocked only because their own
    partners are late are not named. A cycle (ranks issuing different collectives) names
    every rank in it."""
    graph = waits_for(records)
    waited_for = {peer for peers in graph.values() for peer in peers}
    roots = sorted(peer for peer in waited_for if not graph.get(peer))
    return roots or sorted(waited_for)


def describe_wait(record: dict[str, Any]) -> str:
    stuck = record["stuck"]
    waited = record["time"] - stuck["started"]
    text = (
        f"waited {waited:.1f} s in {stuck['op']} #{stuck['seq']} on axis {stuck['axis']} "
        f"(ranks {', '.join(map(str, stuck['group']))}; {stuck['bytes']} bytes)"
    )
    return text + (f", then it failed: {record['error']}" if record.get("error") else "")


def timeout_report(job: Job, attempt: int, outcome: Outcome) -> str:
    """One report for a collective timeout: who did not arrive, then what every rank was doing."""
    records = read_flight_records(attempt_flight_dir(job, attempt), job.world_size)
    graph, late = waits_for(records), ranks_not_arrived(records)
    head = f"fivefold: collective timeout (train.collective_timeout_s={job.collective_timeout_s:g})"
    if late:
        head += f": rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not arrive"
    lines = [head]
    for rank in range(job.world_size):
        if rank in records:
            what = describe_wait(records[rank])
            if graph[rank]:
                what += "; waiting for " + "; ".join(f"rank {p} ({why})" for p, why in sorted(graph[rank].items()))
        elif rank in outcome.stopped_ranks:
            what = "stopped (SIGSTOP or a debugger), wrote no flight record"
        else:
            what = f"wrote no flight record (exit status {outcome.codes[rank]})"
        lines.append(f"  rank {rank}: {what}")
    lines.append(f"  flight records: {attempt_flight_dir(job, attempt)}")
    return "\n".join(lines)


def failure_report(job: Job, attempt: int, outcome: Outcome) -> str:
    if outcome.timed_out:
        return timeout_report(job, attempt, outcome)
    parts, lost = [], []
    for rank, code in enumerate(outcome.codes):
        if code == PEER_LOST_EXIT:
            lost.append(rank)
        elif code is not None and code < 0:
            parts.append(f"rank {rank} was killed by {signal.Signals(-code).name}")
        elif code:
            parts.append(f"rank {rank} exited with status {code}")
    if lost:
        parts.append(f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost a peer inside a collective")
    return "fivefold: " + "; ".join(parts or ["a rank failed"])


# ------------------------------------------------------------------------------ the job


def run_job(job: Job) -> int:
    """Run `job` to the end, restarting it after failures; the launcher's exit status."""
    with SignalLatch() as latch:
        for attempt in range(job.max_restarts + 1):
            if latch.received:  # between two attempts
                return 128 + latch.received[0]
            outcome = run_attempt(job, attempt, latch)
            if outcome.finished:
                return 0
            if outcome.signal_received:
                print(f"fivefold: stopped by {signal.Signals(outcome.signal_received).name}", file=sys.stderr, flush=True)
                return 128 + outcome.signal_received
            print(failure_report(job, attempt, outcome), file=sys.stderr, flush=True)
            if attempt < job.max_restarts:
                print(f"fivefold: restart {attempt + 1} of {job.max_restarts} (train.max_restarts), "
                      "from the last checkpoint", file=sys.stderr, flush=True)
            elif job.max_restarts:
                print(f"fivefold: giving up after {job.max_restarts} restarts", file=sys.stderr, flush=True)
    return 1
