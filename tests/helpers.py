"""Functions the worker pool runs on every rank (they must be importable by module path)."""

from __future__ import annotations

from fivefold.config import Config
from fivefold.parity import train_trace


def trace_on_rank(ctx, config: Config, steps: int):
    """Train `config` on this rank of the pool; rank 0 returns the trace with full parameters."""
    from fivefold.layout import validate

    resolved = validate(config, ctx.world_size)
    mesh = ctx.mesh(resolved.layout)
    trace = train_trace(resolved, mesh, steps)
    return trace if ctx.rank == 0 else trace.comm_bytes


def layout_parity(pools, reference, config: Config, steps: int = 3):
    """Train `config` on its layout in the pool and check it against the single-process run."""
    from fivefold.parity import assert_parity

    world = config.layout.world_size
    results = pools.run(world, trace_on_rank, config, steps)
    return assert_parity(reference(config, steps), results[0])
