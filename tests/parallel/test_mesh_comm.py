"""The mesh's groups follow DESIGN.md's rank order, and comm.py's collectives count bytes exactly."""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from fivefold.config import Layout
from fivefold.parallel.mesh import Mesh
from fivefold.rules.layout import group_ranks


def _mesh_groups(ctx, layout: Layout):
    mesh = ctx.mesh(layout)
    return {name: mesh[name].ranks for name in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")}


def test_mesh_groups_match_rank_order(pools):
    layout = Layout(pp=2, dp=2, cp=1, tp=2, ep=2)
    results = pools.run(8, _mesh_groups, layout)
    for rank, groups in enumerate(results):
        for axis, ranks in groups.items():
            expected = next(g for g in group_ranks(layout, axis) if rank in g)
            assert ranks == expected, (rank, axis)
    assert results[0]["tp"] == [0, 1]  # tensor-parallel ranks are neighbours
    assert results[0]["pp"] == [0, 4]


def _shard_groups(ctx, layout: Layout):
    mesh = ctx.mesh(layout)
    return mesh["dp_cp_shard"].ranks, mesh["dp_cp_rep"].ranks


def test_a_worker_mesh_is_rebuilt_when_the_hybrid_groups_change(pools):
    """The pool keeps one mesh per worker and layout shape; flat ZeRO-3 and hybrid sharding over
    the same degrees have different groups, so the second must not reuse the first's."""
    flat = Layout(dp=4, zero=3)
    hybrid = Layout(dp=4, dp_shard=2, zero=3)
    assert pools.run(4, _shard_groups, flat)[1] == ([0, 1, 2, 3], [1])
    for rank, (shard, replicas) in enumerate(pools.run(4, _shard_groups, hybrid)):
        assert shard == next(g for g in group_ranks(hybrid, "dp_cp_shard") if rank in g), rank
        assert replicas == next(g for g in group_ranks(hybrid, "dp_cp_rep") if rank in g), rank
    # without ZeRO there is nothing to shard: the groups are the flat ones
    assert Mesh.groups_key(Layout(dp=4, dp_shard=2, zero=0)) == Mesh.groups_key(flat)


def _collectives(ctx):
    from fivefold.parallel import comm

    mesh = ctx.mesh(Layout(dp=2, tp=2))
    tp = mesh.tp
    x = torch.full((4, 6), float(ctx.rank + 1))
    reduced = x.clone()
    comm.all_reduce(reduced, tp)
    gathered = comm.all_gather(x[:, :3].contiguous(), tp, dim=1)
    scattered = comm.reduce_scatter(x, tp, dim=0)
    sent = torch.arange(8.0).reshape(4, 2) + 10 * ctx.rank
    received = comm.all_to_all(sent, tp, send_splits=[1, 3], recv_splits=[1, 1] if tp.rank == 0 else [3, 3])
    return reduced, gathered.shape, scattered, received, dict(mesh.stats.wire)


def test_collectives_values_and_bytes(pools):
    results = pools.run(4, _collectives)
    reduced, gathered_shape, scattered, _, wire = results[0]
    assert torch.equal(reduced, torch.full((4, 6), 3.0))  # ranks 0 and 1 form tp group: 1 + 2
    assert gathered_shape == (4, 6)
    assert torch.equal(scattered, torch.full((2, 6), 3.0))
    f = 4  # bytes per float32
    assert wire[("tp", "all_reduce")] == 2 * 1 * 24 * f // 2
    assert wire[("tp", "all_gather")] == 12 * f
    assert wire[("tp", "reduce_scatter")] == 12 * f
    assert wire[("tp", "all_to_all")] == 3 * 2 * f  # rank 0 sends 3 rows of 2 to rank 1
    assert torch.equal(results[0][3], torch.tensor([[0.0, 1.0], [10.0, 11.0]]))
    assert results[1][3].shape == (6, 2)


def _allocations_of_all_gather(ctx) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Per dim: how many buffers all_gather allocates (torch.empty calls), and the output shape."""
    from fivefold.parallel import comm

    tp = ctx.mesh(Layout(tp=2)).tp
    x = torch.ones(2, 3)
    counts = {}
    for dim in (0, 1):
        with mock.patch.object(torch, "empty", wraps=torch.empty) as empty:
            out = comm.all_gather(x, tp, dim=dim)
        counts[dim] = (empty.call_count, tuple(out.shape))
    return counts


def test_all_gather_allocates_its_output_once(pools):
    counts = pools.run(2, _allocations_of_all_gather)[0]
    assert counts == {0: (1, (4, 3)), 1: (1, (2, 6))}


def _wait_for_file(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"rank 0 did not return from the async call {path.name} within {seconds} s"
        time.sleep(0.01)


def _async_collectives(ctx, signal_dir: str) -> dict[str, list[torch.Tensor]]:
    """Each async call along dim 1 and each async average, issued by rank 0 before rank 1 joins.

    Rank 1 enters each collective only after rank 0 returned from issuing it, so a call that
    waited inside for the collective could never return. Returns the results after one wait
    and after a second (which must change nothing: an average is divided once).
    """
    from fivefold.parallel import comm

    tp = ctx.mesh(Layout(tp=2)).tp
    x = torch.arange(12.0).reshape(2, 6) * (ctx.rank + 1)
    reduced = x.clone()
    calls = {  # name: issue the call, returning (the result tensor, the handle)
        "all_gather": lambda: comm.all_gather(x, tp, dim=1, async_op=True),
        "reduce_scatter_avg": lambda: comm.reduce_scatter(x, tp, dim=1, op="avg", async_op=True),
        "all_reduce_avg": lambda: (reduced, comm.all_reduce(reduced, tp, op="avg", async_op=True)),
        "reduce_scatter_overwrite_avg": lambda: comm.reduce_scatter(
            x.t().contiguous(), tp, op="avg", async_op=True, overwrite_input=True),
        "all_gather_into": lambda: _gather_into(comm, x.flatten(), tp),
    }
    results = {}
    for name, issue in calls.items():
        returned = Path(signal_dir) / name
        if ctx.rank == 1:
            _wait_for_file(returned, 30.0)
        out, work = issue()
        if ctx.rank == 0:
            returned.touch()
        work.wait()
        once = out.clone()
        work.wait()
        results[name] = [once, out.clone()]
    return results


def _gather_into(comm, local: torch.Tensor, axis) -> tuple[torch.Tensor, object]:
    out = torch.empty(axis.size * local.numel())
    return out, comm.all_gather_into(out, local, axis, async_op=True)


def test_async_collectives_return_before_the_collective_completes(pools, tmp_path):
    """async_op=True never waits inside, also along dim 1 and for averages; one wait finishes."""
    base = torch.arange(12.0).reshape(2, 6)
    for rank, results in enumerate(pools.run(2, _async_collectives, str(tmp_path))):
        expected = {
            "all_gather": torch.cat([base, 2 * base], dim=1),
            "reduce_scatter_avg": (1.5 * base)[:, 3 * rank : 3 * rank + 3],
            "all_reduce_avg": 1.5 * base,
            "reduce_scatter_overwrite_avg": (1.5 * base).t()[3 * rank : 3 * rank + 3],
            "all_gather_into": torch.cat([base.flatten(), 2 * base.flatten()]),
        }
        for name, (once, twice) in results.items():
            assert torch.equal(once, expected[name]), (rank, name, once)
            assert torch.equal(twice, expected[name]), (rank, name, "a second wait changed the result")


def _autograd_pairs(ctx):
    """Each conjugate pair's backward is the transpose of its forward: <w, f(x)> == <f^T(w), x>.

    Inner products run over the whole group; a tensor that is replicated on every rank (the
    input of copy_to/split_to, the output of reduce_from/gather_from) is counted once.
    """
    from fivefold.parallel import comm

    mesh = ctx.mesh(Layout(tp=2))
    tp = mesh.tp
    ops = {  # name: (function, input replicated, output replicated)
        "copy_to": (lambda t: comm.copy_to(t, tp), True, False),
        "reduce_from": (lambda t: comm.reduce_from(t, tp), False, True),
        "split_to": (lambda t: comm.split_to(t, tp, 1), True, False),
        "gather_from": (lambda t: comm.gather_from(t, tp, 1), False, True),
        "all_gather_to_full": (lambda t: comm.all_gather_to_full(t, tp, 1), False, False),
        "reduce_scatter_to_shard": (lambda t: comm.reduce_scatter_to_shard(t, tp, 1), False, False),
        "all_to_all": (lambda t: comm.all_to_all_autograd(t, tp), False, False),
    }
    out = {}
    for name, (fn, input_replicated, output_replicated) in ops.items():
        torch.manual_seed(0 if input_replicated else 1 + ctx.rank)
        x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        y = fn(x)
        torch.manual_seed(100 if output_replicated else 101 + ctx.rank)
        w = torch.randn_like(y)
        (g,) = torch.autograd.grad(y, x, w)
        forward_dot = (w * y).sum().item()
        backward_dot = (g * x).sum().item()
        dots = torch.tensor([
            forward_dot if (not output_replicated or tp.rank == 0) else 0.0,
            backward_dot if (not input_replicated or tp.rank == 0) else 0.0,
        ], dtype=torch.float64)
        comm.all_reduce(dots, tp)
        out[name] = (dots[0].item(), dots[1].item())
    return out


def test_autograd_pairs_are_adjoint(pools):
    for name, (forward_dot, backward_dot) in pools.run(2, _autograd_pairs)[0].items():
        assert abs(forward_dot - backward_dot) < 1e-9, name


def _sharded_collectives(ctx, emulate: bool) -> dict[str, bool]:
    """comm's reduce-scatter and all-gather into caller-owned buffers against torch's own, on
    values with signed zeros, NaN and infinities: True where the bits agree. With `emulate`
    false the backend's native collectives run (as NCCL's would); with it true, gloo's
    emulation (two ranks: an exchange of halves; more: an in-place all-reduce; all-gathers
    by one broadcast per rank)."""
    import torch.distributed as dist

    from fivefold.parallel import comm

    n = ctx.world_size
    dp = ctx.mesh(Layout(dp=n)).dp
    m = 1000 // n
    torch.manual_seed(ctx.rank)
    full = torch.randn(1000)
    full[:4] = torch.tensor([-0.0, 0.0, float("nan"), float("inf")])
    expected = torch.empty(m)
    dist.reduce_scatter_tensor(expected, full.clone(), group=dp.group)
    gathered_expected = torch.empty(1000)
    dist.all_gather_into_tensor(gathered_expected, full[:m].clone(), group=dp.group)
    lo, hi = m * dp.rank, m * (dp.rank + 1)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))

    with mock.patch.object(comm, "_emulates_sharded_collectives", lambda axis: emulate):
        out, scratch = torch.empty(m), full.clone()
        comm.reduce_scatter_into(out, scratch, dp, overwrite_input=True)
        in_place = full.clone()
        comm.reduce_scatter_into(in_place[lo:hi], in_place, dp, async_op=True, overwrite_input=True).wait()
        kept, kept_out = full.clone(), torch.empty(m)
        comm.reduce_scatter_into(kept_out, kept, dp, async_op=True).wait()
        gathered = torch.empty(1000)
        comm.all_gather_into(gathered, full[:m].clone(), dp)
        own = torch.empty(1000)
        own[lo:hi] = full[:m]
        comm.all_gather_into(own, own[lo:hi], dp, async_op=True).wait()
    return {
        "reduce_scatter_into": same(out, expected),
        "in place": same(in_place[lo:hi], expected),
        "without overwrite_input": same(kept_out, expected) and same(kept, full),
        "all_gather_into": same(gathered, gathered_expected),
        "all_gather_into in place": same(own, gathered_expected),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_collectives_match_torch_bit_for_bit_on_either_path(pools, world):
    """The gloo emulation and the native path give torch's reduce-scatter and all-gather bits."""
    for emulate in (False, True):
        for rank, checks in enumerate(pools.run(world, _sharded_collectives, emulate)):
            assert all(checks.values()), (world, emulate, rank, checks)
