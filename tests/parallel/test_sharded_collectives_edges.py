"""comm's gloo reduce-scatter and all-gather (an exchange of halves for two ranks, an in-place
all-reduce for more, one broadcast per rank for gathers) at their edges, against torch's own
collectives bit for bit: every dtype the wire carries, empty shards, and several async
exchanges in flight at once, on different groups and two on one group, waited in the reverse
order of issue."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from fivefold.config import Layout

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.flatten().view(torch.uint8),
                                                                     b.flatten().view(torch.uint8))


def _torch_reduce_scatter(full: torch.Tensor, axis) -> torch.Tensor:
    import torch.distributed as dist

    out = full.new_empty(full.numel() // axis.size)
    dist.reduce_scatter_tensor(out, full.clone(), group=axis.group)
    return out


def _values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=generator) * 100).to(dtype)


def _dtypes_and_empty(ctx) -> dict[str, bool]:
    import torch.distributed as dist

    from fivefold.parallel import comm

    dp = ctx.mesh(Layout(dp=ctx.world_size)).dp
    n, checks = dp.size, {}
    with mock.patch.object(comm, "_emulates_sharded_collectives", lambda axis: True):
        for dtype in DTYPES:
            for numel in (8 * n, 0):
                full = _values(ctx.rank, numel, dtype)
                expected = _torch_reduce_scatter(full, dp)
                out = full.new_empty(numel // n)
                comm.reduce_scatter_into(out, full.clone(), dp, overwrite_input=True)
                kept = full.new_empty(numel // n)
                comm.reduce_scatter_into(kept, full.clone(), dp, async_op=True).wait()
                local = full[: numel // n].clone()
                gathered_expected = full.new_empty(numel)
                dist.all_gather_into_tensor(gathered_expected, local.clone(), group=dp.group)
                gathered = full.new_empty(numel)
                comm.all_gather_into(gathered, local, dp)
                checks[f"{dtype} x{numel}"] = (_same(out, expected) and _same(kept, expected)
                                               and _same(gathered, gathered_expected))
    return checks


@pytest.mark.parametrize("world", [2, 4])
def test_emulated_sharded_collectives_give_torchs_bits_for_every_dtype_and_empty_shards(pools, world):
    for rank, checks in enumerate(pools.run(world, _dtypes_and_empty)):
        assert all(checks.values()), (world, rank, {k: v for k, v in checks.items() if not v})


def _concurrent_exchanges(ctx) -> dict[str, bool]:
    """Async reduce-scatters in flight together on three groups (dp and cp exchange halves,
    dp_cp all-reduces in place), two of them on dp, waited in reverse order of issue."""
    from fivefold.parallel import comm

    mesh = ctx.mesh(Layout(dp=2, cp=2))
    axes = [mesh.dp, mesh.cp, mesh["dp_cp"], mesh.dp]
    inputs = [_values(10 * i + ctx.rank, 96, torch.float32) for i in range(len(axes))]
    expected = [_torch_reduce_scatter(full, axis) for full, axis in zip(inputs, axes)]
    outs = [full.new_empty(full.numel() // axis.size) for full, axis in zip(inputs, axes)]
    with mock.patch.object(comm, "_emulates_sharded_collectives", lambda axis: True):
        works = [comm.reduce_scatter_into(out, full.clone(), axis, async_op=True, overwrite_input=True)
                 for out, full, axis in zip(outs, inputs, axes)]
        for work in reversed(works):
            work.wait()
    return {f"{i}: {axis.name}": _same(out, exp) for i, (out, exp, axis) in enumerate(zip(outs, expected, axes))}


def test_async_exchanges_in_flight_on_several_groups_keep_their_messages_apart(pools):
    for rank, checks in enumerate(pools.run(4, _concurrent_exchanges)):
        assert all(checks.values()), (rank, checks)
