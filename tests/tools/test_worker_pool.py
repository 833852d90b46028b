"""The worker pool tells a slow call from a hung or dead one, and says which it was."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fivefold.tools.testing import (
    TIMEOUT_SCALE_ENV,
    WorkerError,
    WorkerPool,
    default_call_cap_s,
    tree_activity,
)

STALL_S = 2.0  # short, so that a hang is reported quickly; real pools use 60 s


@pytest.fixture
def pool(pools):
    """The session's started two-rank pool, with a short stall limit while the test runs."""
    p = pools.get(2)
    p.run(_rank_1_computes_while_rank_0_waits, 0.0)  # (re)started under the default limits
    default, p.stall_s = p.stall_s, STALL_S
    yield p
    p.stall_s = default


def _busy(seconds: float) -> None:
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def _rank_1_computes_while_rank_0_waits(ctx, seconds: float) -> int:
    import torch.distributed as dist

    if ctx.rank == 1:
        _busy(seconds)
    dist.barrier()  # rank 0 waits here, idle, for as long as rank 1 computes
    return ctx.rank


def _hang_on_rank_0(ctx) -> None:
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.barrier()  # rank 1 never joins


def _rank_1_exits(ctx) -> None:
    if ctx.rank == 1:
        os._exit(3)


def test_a_slow_call_passes_and_a_hang_names_the_call_its_time_and_the_stuck_rank_stack(pool):
    # Rank 0 waits idle in a collective for longer than the stall limit while rank 1 uses CPU
    # all that time (a slow machine looks like this): the call completes.
    assert pool.run(_rank_1_computes_while_rank_0_waits, 2 * STALL_S) == [0, 1]
    with pytest.raises(WorkerError) as err:
        pool.run(_hang_on_rank_0)
    message = str(err.value)
    assert "_hang_on_rank_0 on 2 ranks: hung: ranks [0] idle (no CPU used, none runnable) for" in message, message
    assert "finished: ranks [1]" in message and TIMEOUT_SCALE_ENV in message, message
    stack = message.split("--- rank 0 stack:", 1)[1]
    assert "in _hang_on_rank_0" in stack and "barrier" in stack, message


def test_a_dead_rank_is_reported_at_once_with_its_exit_code(pool):
    with pytest.raises(WorkerError, match=r"_rank_1_exits on 2 ranks: worker process died \(rank 1: exit code 3\)"):
        pool.run(_rank_1_exits)


def test_cpu_of_a_worker_includes_the_processes_it_started():
    """A rank waiting on its own subprocesses (the compiler's workers) is making progress."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 1: pass\n"
                               "print('done', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        if tree_activity([os.getpid()]) is None:
            pytest.skip("no /proc on this system: the pool falls back to its call limit")
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        own = time.process_time()
        tree = tree_activity([os.getpid()])
        assert tree is not None and tree[0].cpu_s >= own + 0.9, (tree, own)
    finally:
        child.kill()
        child.wait()


def test_limits_scale_with_ranks_per_core_and_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    cores = os.cpu_count() or 1
    assert default_call_cap_s(cores) == 180.0
    assert default_call_cap_s(4 * cores) == 4 * 180.0
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "2.5")
    pool = WorkerPool(cores)
    assert (pool.timeout_s, pool.stall_s) == (2.5 * 180.0, 2.5 * 60.0)
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "fast")
    with pytest.raises(ValueError, match=f"{TIMEOUT_SCALE_ENV}='fast' must be a positive number"):
        WorkerPool(2)
