"""Multi-process test harness: a pool of gloo worker processes kept alive across tests.

Starting eight Python processes with torch costs seconds on a small machine, so tests do
not spawn their own: `WorkerPool(n)` starts n ranks once (one gloo process group) and runs
functions on all of them, returning each rank's result. Functions must be importable
(module-level) and take a `WorkerContext` first.

If any rank fails or a call exceeds its timeout the pool is torn down and rebuilt on the
next call, so one broken test cannot hang or poison the rest.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A function raised on one or more ranks; the message holds their tracebacks."""


@dataclass
class WorkerContext:
    """Handed to every function a pool runs: this rank's identity and its cached meshes."""

    rank: int
    world_size: int
    _meshes: dict = field(default_factory=dict)

    def mesh(self, layout: Any):
        """The Mesh of `layout`, built once per worker (group creation is collective and slow)."""
        from ..mesh import Mesh

        key = (layout.pp, layout.dp, layout.cp, layout.tp, layout.ep)
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


def _worker_main(rank: int, world_size: int, port: int, paths: list[str], tasks, results, timeout_s: float) -> None:
    import torch.distributed as dist

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
    # No destroy_process_group(): it waits for the peers, which are exiting too; the
    # process's exit closes the connections.


class WorkerPool:
    """n gloo ranks waiting for functions to run."""

    def __init__(self, world_size: int, timeout_s: float = 180.0, collective_timeout_s: float = 60.0) -> None:
        self.world_size, self.timeout_s, self.collective_timeout_s = world_size, timeout_s, collective_timeout_s
        self._procs: list = []
        self._ctx = mp.get_context("spawn")

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        paths = [p or os.getcwd() for p in sys.path]  # '' means the current directory
        self._procs = [
            self._ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, port, paths, self._tasks[r], self._results, self.collective_timeout_s),
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
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            while len(outcomes) < self.world_size:
                wait = self.timeout_s if not any(not ok for ok, _ in outcomes.values()) else 10.0
                rank, ok, value = self._results.get(timeout=wait)
                outcomes[rank] = (ok, value)
        except queue.Empty:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
            raise WorkerError(f"ranks {missing} did not finish {fn.__name__}; failures: {_format(failures)}") from None
        failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
        if failures:
            self.close()  # other ranks may have been left mid-collective
            raise WorkerError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{_format(failures)}")
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        if not self._procs:
            return
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 5.0  # one grace period for all ranks, then kill the rest
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []


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
