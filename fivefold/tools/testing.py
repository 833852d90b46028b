"""Multi-process test harness: a pool of gloo worker processes kept alive across tests.

Starting eight Python processes with torch costs seconds on a small machine, so tests do
not spawn their own: `WorkerPool(n)` starts n ranks once (one gloo process group) and runs
functions on all of them, returning each rank's result. Functions must be importable
(module-level) and take a `WorkerContext` first.

If any rank fails, dies or hangs, the pool is torn down and rebuilt on the next call, so one
broken test cannot hang or poison the rest.

A call hangs when none of its unfinished ranks, nor any process they started (the
compiler's workers), has used CPU for `stall_s` seconds: ranks blocked on a collective that
a peer never joins sit idle, while ranks that are only slow on a loaded machine keep using
CPU, or wait for a core or a disk (a process state /proc shows), however little CPU they
get. Elapsed time alone cannot tell the two apart on a
shared two-core machine. The report names the function, its elapsed time, each rank's CPU
seconds and the Python stack of every unfinished rank. A call that keeps using CPU is
stopped after `timeout_s`, which grows with the ranks each core has to run. Both limits,
and the process group's own collective timeout, are multiplied by
$FIVEFOLD_TEST_TIMEOUT_SCALE (default 1) for slower machines.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A function raised, hung or died on one or more ranks; the message says which and why."""


TIMEOUT_SCALE_ENV = "FIVEFOLD_TEST_TIMEOUT_SCALE"
STALL_S = 60.0  # every unfinished rank idle (no CPU used, none runnable) this long: a hang
CALL_S_PER_RANK_PER_CORE = 180.0  # the cap of a call that keeps using CPU, per rank a core runs
STALL_CPU_S = 0.1  # CPU seconds the unfinished ranks must add to count as progress
POLL_S = 1.0
PEER_GRACE_S = 10.0  # after one rank failed, how long the others may take to finish or fail
STACK_WAIT_S = 2.0  # for the stack dumps of hung ranks to be written


def timeout_scale() -> float:
    """$FIVEFOLD_TEST_TIMEOUT_SCALE: a factor on every limit of the pool (default 1)."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={raw!r} must be a positive number (a factor on the pool's timeouts)")
    return scale


def default_call_cap_s(world_size: int) -> float:
    """The longest a call may keep using CPU: grows with the ranks each core has to run."""
    ranks_per_core = max(1.0, world_size / (os.cpu_count() or 1))
    return CALL_S_PER_RANK_PER_CORE * ranks_per_core * timeout_scale()


@dataclass
class Activity:
    """What a process and all its descendants (the compiler's workers) are doing."""

    cpu_s: float  # CPU seconds used so far, with those of descendants that ended and were waited for
    runnable: bool  # one of them is running, waiting for a core, or in uninterruptible I/O


def tree_activity(pids: list[int]) -> list[Activity] | None:
    """The Activity of each process tree rooted at `pids`, or None where /proc cannot tell (not Linux)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    seen: dict[int, tuple[float, bool]] = {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[int(entry)] = int(fields[1])
        # fields: state, ppid, ..., utime, stime, cutime, cstime at 11-14
        seen[int(entry)] = (sum(int(v) for v in fields[11:15]) / tick, fields[0] in ("R", "D"))
    totals = {pid: Activity(0.0, False) for pid in pids}
    for pid, (cpu_s, runnable) in seen.items():
        node, depth = pid, 0
        while node in parent and node not in totals and depth < 64:  # up to a root, if it has one
            node, depth = parent[node], depth + 1
        if node in totals:
            totals[node].cpu_s += cpu_s
            totals[node].runnable |= runnable
    return [totals[pid] for pid in pids]


@dataclass
class WorkerContext:
    """Handed to every function a pool runs: this rank's identity and its cached meshes."""

    rank: int
    world_size: int
    _meshes: dict = field(default_factory=dict)

    def mesh(self, layout: Any):
        """The Mesh of `layout`, built once per worker (group creation is collective and slow)."""
        from ..parallel.mesh import Mesh

        key = Mesh.groups_key(layout)
        if key not in self._meshes:
            self._meshes[key] = Mesh.build(layout)
        mesh = self._meshes[key]
        mesh.layout = layout  # same groups; other layout fields (zero, schedule, ...) may differ
        mesh.stats.reset()
        return mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(
    rank: int, world_size: int, port: int, paths: list[str], tasks, results, timeout_s: float, stack_file: str
) -> None:
    import torch.distributed as dist

    # The pool asks for the stacks of a hung rank with SIGUSR1 (the file stays open for the process's life).
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)  # noqa: SIM115
    sys.path[:0] = [p for p in paths if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    ctx = WorkerContext(rank, world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:  # report everything, including assertion errors, to the test
            results.put((rank, False, traceback.format_exc()))
    # No destroy_process_group(): it waits for the peers, which are exiting too. The parent has
    # every result by now (it asks a rank to stop only then), so nothing is left to flush:
    # leave at once rather than through the interpreter's and gloo's teardown (seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerPool:
    """n gloo ranks waiting for functions to run.

    stall_s: a call whose unfinished ranks use no CPU for this long is a hang (see the module
    docstring); timeout_s: the longest a call may run while it keeps using CPU; both default
    to values scaled by $FIVEFOLD_TEST_TIMEOUT_SCALE. The process group's collective timeout
    is timeout_s: a rank waiting for a peer that is slow, not hung, keeps waiting, and a
    deadlock is reported by the stall check first, with the ranks' stacks.
    """

    def __init__(self, world_size: int, timeout_s: float | None = None, stall_s: float | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = default_call_cap_s(world_size) if timeout_s is None else timeout_s
        self.stall_s = STALL_S * timeout_scale() if stall_s is None else stall_s
        self._procs: list = []
        self._ctx = mp.get_context("spawn")
        self._stack_dir: tempfile.TemporaryDirectory | None = None

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        paths = [p or os.getcwd() for p in sys.path]  # '' means the current directory
        self._stack_dir = tempfile.TemporaryDirectory(prefix="fivefold-pool-")
        self._procs = [
            self._ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, port, paths, self._tasks[r], self._results, self.timeout_s,
                      self._stack_file(r)),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run fn(ctx, *args, **kwargs) on every rank; return the results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outcomes = _Watch(self, fn.__name__).collect()
        failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
        if failures:
            self.close()  # other ranks may have been left mid-collective
            raise WorkerError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{_format(failures)}")
        return [outcomes[r][1] for r in range(self.world_size)]

    def _stack_file(self, rank: int) -> str:
        assert self._stack_dir is not None
        return str(Path(self._stack_dir.name) / f"rank{rank}.txt")

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """The current Python stack of each of `ranks` (a dump each asks for; empty where none came)."""
        sizes = {}
        for r in ranks:
            path = Path(self._stack_file(r))
            sizes[r] = path.stat().st_size if path.exists() else 0
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_WAIT_S
        written = lambda r: Path(self._stack_file(r)).stat().st_size > sizes[r]  # noqa: E731
        while time.monotonic() < deadline and not all(written(r) for r in ranks):
            time.sleep(0.1)
        time.sleep(0.2)  # a dump is written at once by the signal handler; let the last one end
        return {r: Path(self._stack_file(r)).read_text()[sizes[r]:].strip() for r in ranks if written(r)}

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers: those waiting for a task exit at once; those still busy are killed
        after `grace_s` (0 after a hang: they will not come back)."""
        if not self._procs:
            return
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + grace_s  # one grace period for all ranks, then kill the rest
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        if self._stack_dir is not None:
            self._stack_dir.cleanup()
            self._stack_dir = None


class _Watch:
    """Waits for one call's results, telling a slow call from a hung, dead or failed one."""

    def __init__(self, pool: WorkerPool, name: str) -> None:
        self.pool, self.name = pool, name
        self.start = time.monotonic()
        self.outcomes: dict[int, tuple[bool, Any]] = {}
        self.first_failure: float | None = None
        self.cpu_at_start = self._cpu()
        self.cpu_mark, self.progress_at = self.cpu_at_start, self.start

    def _activity(self) -> list[Activity] | None:
        return tree_activity([p.pid for p in self.pool._procs])

    def _cpu(self) -> list[float] | None:
        activity = self._activity()
        return None if activity is None else [a.cpu_s for a in activity]

    def collect(self) -> dict[int, tuple[bool, Any]]:
        while len(self.outcomes) < self.pool.world_size:
            try:
                rank, ok, value = self.pool._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check(time.monotonic())
                continue
            self.outcomes[rank] = (ok, value)
            if not ok and self.first_failure is None:
                self.first_failure = time.monotonic()
        return self.outcomes

    def pending(self) -> list[int]:
        return [r for r in range(self.pool.world_size) if r not in self.outcomes]

    def _check(self, now: float) -> None:
        pending = self.pending()
        dead = [r for r in pending if not self.pool._procs[r].is_alive()]
        if dead:
            codes = ", ".join(f"rank {r}: exit code {self.pool._procs[r].exitcode}" for r in dead)
            self._fail(now, f"worker process died ({codes})", [])
        if self.first_failure is not None and now - self.first_failure > PEER_GRACE_S:
            self._fail(now, f"a rank failed and ranks {pending} did not finish within {PEER_GRACE_S:g} s after it",
                       pending)
        if self._progressed(pending):
            self.progress_at = now
        if now - self.progress_at > self.pool.stall_s:
            idle = now - self.progress_at
            self._fail(now, f"hung: ranks {pending} idle (no CPU used, none runnable) for {idle:.0f} s "
                            f"(stall limit {self.pool.stall_s:g} s)", pending)
        if now - self.start > self.pool.timeout_s:
            self._fail(now, f"still running after the call's limit of {self.pool.timeout_s:g} s", pending)

    def _progressed(self, pending: list[int]) -> bool:
        """Whether the unfinished ranks used CPU since the last progress, or one is runnable now
        (then it waits for a core or a disk, not for a peer). Unknown (no /proc): progress."""
        activity = self._activity()
        if activity is None or self.cpu_mark is None:
            return True
        cpu = [a.cpu_s for a in activity]
        used = sum(cpu[r] - self.cpu_mark[r] for r in pending)
        if used >= STALL_CPU_S or any(activity[r].runnable for r in pending):
            self.cpu_mark = cpu
            return True
        return False

    def _fail(self, now: float, why: str, stack_ranks: list[int]) -> None:
        stacks = self.pool.stacks(stack_ranks) if stack_ranks else {}
        now_cpu = self._cpu()
        self.pool.close(grace_s=0.0)  # the unfinished ranks are stuck, dead or failing
        cpu = ""
        if self.cpu_at_start is not None and now_cpu is not None:
            used = [f"{b - a:.1f}" for a, b in zip(self.cpu_at_start, now_cpu)]
            cpu = f"; CPU seconds per rank in the call (start-up included): {', '.join(used)}"
        failures = {r: v for r, (ok, v) in self.outcomes.items() if not ok}
        finished = sorted(r for r, (ok, _) in self.outcomes.items() if ok)
        lines = [
            f"{self.name} on {self.pool.world_size} ranks: {why}, after {now - self.start:.0f} s{cpu}; "
            f"finished: ranks {finished}; failures: {_format(failures)}",
            f"(on a slow machine raise {TIMEOUT_SCALE_ENV}, now {timeout_scale():g})",
        ]
        lines += [f"--- rank {r} stack:\n{text}" for r, text in sorted(stacks.items())]
        raise WorkerError("\n".join(lines))


def _format(failures: dict[int, str]) -> str:
    if not failures:
        return "none"
    first = min(failures)
    return f"rank {first}:\n{failures[first]}"


class PoolSet:
    """One pool per world size, created on first use and kept until closed."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        if world_size not in self._pools:
            self._pools[world_size] = WorkerPool(world_size)
        return self._pools[world_size]

    def run(self, world_size: int, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        return self.get(world_size).run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
