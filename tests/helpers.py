"""Functions the worker pool runs on every rank (they must be importable by module path)."""

from __future__ import annotations

from fivefold.config import Config
from fivefold.tools.parity import train_trace


def trace_on_rank(ctx, config: Config, steps: int):
    """Train `config` on this rank of the pool; rank 0 returns the trace with full parameters."""
    from fivefold.rules.layout import validate

    resolved = validate(config, ctx.world_size)
    mesh = ctx.mesh(resolved.layout)
    trace = train_trace(resolved, mesh, steps)
    return trace if ctx.rank == 0 else trace.comm_bytes


def layout_parity(pools, reference, config: Config, steps: int = 3):
    """Train `config` on its layout in the pool and check it against the single-process run."""
    from fivefold.tools.parity import assert_parity

    world = config.layout.world_size
    results = pools.run(world, trace_on_rank, config, steps)
    return assert_parity(reference(config, steps), results[0])


def traces_on_rank(ctx, configs: list[Config], steps: int):
    """Train several configs one after another on the same ranks (one pool call, many layouts)."""
    return [trace_on_rank(ctx, config, steps) for config in configs]


def many_layout_parity(pools, reference, configs: list[Config], steps: int = 2):
    """Check every config (all of one world size) against its single-process reference."""
    from fivefold.tools.parity import compare

    world = configs[0].layout.world_size
    assert all(c.layout.world_size == world for c in configs)
    results = pools.run(world, traces_on_rank, configs, steps)[0]
    failures = []
    for config, trace in zip(configs, results):
        report = compare(reference(config, steps), trace)
        if not report.ok:
            failures.append(f"{describe(config)}: {report.summary()}\n  " + "\n  ".join(report.failures[:5]))
    assert not failures, "\n".join(failures)


def describe(config: Config) -> str:
    l = config.layout
    parts = [f"{k}{getattr(l, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(l, k) > 1]
    if l.zero:
        parts.append(f"zero{l.zero}")
    if l.dp_shard:
        parts.append(f"dp_shard{l.dp_shard}")
    if l.sequence_parallel:
        parts.append("sp")
    if l.pp > 1:
        parts.append(l.pp_schedule + (f"-vpp{l.vpp}" if l.vpp > 1 else ""))
    if l.cp > 1:
        parts.append(l.cp_algorithm)
    return f"{config.model.name}:" + "·".join(parts)
