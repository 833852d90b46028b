"""The pipeline executor's point-to-point order holds under NCCL's rules, for every schedule.

Each pipeline rank of a small model runs the real `PipelineRunner` (a training step and an
evaluation) in this process under torch's fake process group: every transfer returns at
once, so a rank runs alone, and comm.py records the groups of point-to-point operations it
issues. `check_p2p_order` then plays those groups out with each rank's groups in issue
order and every send waiting for its receive, as NCCL runs them once boundary tensors
exceed its buffering. The fake group is not gloo, so the runner takes the order it takes
on NCCL.

The same order is then run by real processes of the gloo pool (the runner told that its
backend is not gloo): it trains as one process does, and the groups it issued hold too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import pytest
import torch

from fivefold.config import Config, load_config
from fivefold.model.step import cross_entropy_sum, whole_sequence
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline import PipelineRunner, build_stage_chunks
from fivefold.rules.layout import SCHEDULES, validate
from fivefold.rules.p2p_order import P2PGroup, check_p2p_order
from fivefold.tools.dryrun import fake_world
from fivefold.tools.parity import assert_parity, train_trace


class _NoReduction:
    """The one thing the runner asks of an optimizer: a context that holds reductions back."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@contextlib.contextmanager
def _cheap_cpu_math() -> Iterator[None]:
    """One thread and denormals flushed inside (torch has no getter for the flush: back to
    its default, off, after); garbage received buffers are full of denormals."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _chunks_per_rank(schedule: str) -> int:
    return 2 if schedule in ("interleaved", "dualpipev") else 1


def _config(schedule: str, pp: int, microbatches: int) -> Config:
    vpp = _chunks_per_rank(schedule)
    return validate(load_config("tiny", [
        f"layout.pp={pp}", f"layout.vpp={vpp}", f"layout.pp_schedule={schedule}",
        f"layout.grad_accum={microbatches}", f"train.global_batch={microbatches}", "train.seq_len=8",
        f"model.layers={pp * vpp}",
    ]))


def _issued_groups(config: Config, rank: int) -> list[P2PGroup]:
    """The point-to-point groups pipeline rank `rank` issues in one training step and one
    evaluation. Only the order of transfers matters, so the weights are zeros and received
    buffers hold whatever memory they got."""
    with fake_world(config.layout.world_size, rank), _cheap_cpu_math():
        mesh = Mesh.build(config.layout)
        chunks = [chunk.to_empty(device="cpu") for chunk in build_stage_chunks(config, mesh)]
        with torch.no_grad():
            for param in (p for chunk in chunks for p in chunk.parameters()):
                param.zero_()
        runner = PipelineRunner(config, mesh, chunks, _NoReduction(), cross_entropy_sum, torch.device("cpu"))  # type: ignore[arg-type]
        tokens = torch.zeros((1, config.train.seq_len), dtype=torch.long)
        micro_batches = [whole_sequence(tokens, tokens) for _ in range(config.layout.grad_accum)]
        with mesh.stats.recording_p2p() as groups:
            runner.run(micro_batches)
            with torch.no_grad():
                runner.evaluate(micro_batches)
    return groups


def _cases() -> list[tuple[str, int, int]]:
    """Every schedule at pp 2, 3 and 4; micro-batch counts below, at, off and at twice pp
    (the interleaved schedule takes multiples of pp only, DualPipeV at least 2 pp - 1)."""
    cases = []
    for schedule in SCHEDULES:
        for pp in (2, 3, 4):
            counts = (pp, 2 * pp) if schedule == "interleaved" else (1, pp, pp + 1, 2 * pp)
            if schedule == "dualpipev":
                counts = (2 * pp - 1, 2 * pp, 3 * pp)
            cases += [(schedule, pp, m) for m in counts]
    return cases


@pytest.mark.parametrize("schedule, pp, microbatches", _cases())
def test_executor_order_cannot_deadlock_when_sends_wait_for_receives(schedule, pp, microbatches):
    config = _config(schedule, pp, microbatches)
    groups = {rank: _issued_groups(config, rank) for rank in range(pp)}
    assert all(groups.values()), "every pipeline rank transfers something"
    check_p2p_order(groups)  # every send a rendezvous: safe for any boundary size


def _train_in_nccl_order(ctx, config: Config, steps: int):
    """Train `config` on this rank of the (gloo) pool with the runner taking the order it
    takes under NCCL; returns (trace on rank 0, this rank's point-to-point groups)."""
    resolved = validate(config, ctx.world_size)
    mesh = ctx.mesh(resolved.layout)
    with mock.patch("fivefold.parallel.pipeline._operations_run_independently", return_value=False), \
            mesh.stats.recording_p2p() as groups:
        trace = train_trace(resolved, mesh, steps)
    return (trace if ctx.rank == 0 else None), mesh.rank, groups


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_nccl_order_trains_as_one_process_does(pools, reference, schedule):
    """The NCCL order run by real processes (gloo): the single-process result, and the
    groups it issued, over two steps, hold under NCCL's rules."""
    microbatches, vpp = (4, 2) if schedule == "interleaved" else (3, _chunks_per_rank(schedule))
    config = load_config("tiny", ["train.seq_len=16", "layout.pp=2", f"layout.vpp={vpp}",
                                  f"layout.pp_schedule={schedule}", f"layout.grad_accum={microbatches}",
                                  f"train.global_batch={2 * microbatches}"])
    results = pools.run(2, _train_in_nccl_order, config, 2)
    assert_parity(reference(config, 2), results[0][0])
    check_p2p_order({rank: groups for _, rank, groups in results})
