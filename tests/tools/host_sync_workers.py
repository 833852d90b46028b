"""What the worker pool runs for tests/tools/test_host_syncs.py (importable by module path)."""

from __future__ import annotations

from fivefold.config import Config
from fivefold.data.loader import open_training_data
from fivefold.parallel.mesh import Mesh
from fivefold.rules.layout import validate
from fivefold.tools.host_syncs import HostSyncs
from fivefold.train import build, train_step


def syncs_of_second_step(config: Config, mesh: Mesh) -> HostSyncs:
    """The host syncs of one training step, after a first one has built every lazy state."""
    _, sampler = open_training_data(config)
    model = build(config, mesh, mesh.device)
    train_step(model, sampler, 0)
    with HostSyncs() as syncs:
        train_step(model, sampler, 1)
    return syncs


def syncs_on_rank(ctx, config: Config) -> dict[str, int]:
    """This rank's host syncs in one step of `config`, by call site."""
    resolved = validate(config, ctx.world_size)
    return dict(syncs_of_second_step(resolved, ctx.mesh(resolved.layout)).sites)
