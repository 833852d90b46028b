"""What one rank saves: its primary shards of parameters, persistent buffers and optimizer
state, and its random generator states.

The optimizer's part
--------------------
Every optimizer satisfies `CheckpointState` (fivefold/parallel/protocols.py): `steps`
(completed updates, for Adam's bias correction), `sharded_state()` ({parameter name: {state
key, e.g. "exp_avg": (this rank's tensor, where it sits)}}) and `load_sharded_state(reader)`
(for each local state tensor: reader.read_into(tensor, spec, state_key)).

A replicated state gives the parameter's Placement (only its primary replica is written);
a ZeRO flat shard gives `ShardSpec.from_placement(param_placement, flat=(start, length),
replicated_over=...)` with the axes that still replicate that shard. An optimizer that holds
the parameters' shards itself (ZeRO-3: the modules keep no usable full parameters) sets
`owns_parameter_shards = True` and returns each parameter's shard under the key "param";
the checkpoint then saves and loads parameters through the optimizer only (buffers still
come from the modules), and `load_sharded_state` fills them with read_into(t, spec, "param").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..model.init import canonical_name
from ..model.moe import ROUTING_COUNTERS
from ..parallel.protocols import CheckpointState
from ..parallel.sharding import Placement, ShardSpec, get_placement
from .regions import clip_to_global

RUNTIME_BUFFERS = ROUTING_COUNTERS  # per-step statistics, not state


def state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers (e.g. the router's balancing bias) of one model chunk."""
    buffers = [(n, b) for n, b in module.named_buffers() if not n.endswith(RUNTIME_BUFFERS)]
    return list(module.named_parameters()) + buffers


def module_state_tensors(module: nn.Module, optimizer: CheckpointState) -> list[tuple[str, torch.Tensor]]:
    """What the modules contribute: everything, or only buffers when the optimizer owns the parameters."""
    if optimizer.owns_parameter_shards:
        return [(n, b) for n, b in module.named_buffers() if not n.endswith(RUNTIME_BUFFERS)]
    return state_tensors(module)


def spec_of(where: Placement | ShardSpec, config: ModelConfig) -> ShardSpec:
    """The ShardSpec of a Placement or spec, under the canonical name (a tied head is the embedding)."""
    spec = where if isinstance(where, ShardSpec) else ShardSpec.from_placement(where)
    name = canonical_name(spec.name, config)
    if name == spec.name:
        return spec
    return ShardSpec(name, spec.global_shape, spec.offsets, spec.shape, spec.flat, spec.replicated_over)


def _is_primary(spec: ShardSpec, mesh) -> bool:
    return all(mesh[axis].rank == 0 for axis in spec.replicated_over)


def shard_entries(model: Any) -> list[tuple[str, ShardSpec, torch.Tensor]]:
    """(state, spec, tensor) of every shard this rank is the primary replica of."""
    config, mesh = model.config.model, model.mesh
    model.optimizer.wait_for_parameters()  # ZeRO-1/2 may still be gathering the last update
    entries = []
    for chunk in model.chunks:
        for name, tensor in module_state_tensors(chunk, model.optimizer):
            entries.append(("param", spec_of(get_placement(tensor, name), config), tensor))
    for states in model.optimizer.sharded_state().values():
        for key, (tensor, where) in states.items():
            entries.append((key if key == "param" else f"optim.{key}", spec_of(where, config), tensor))
    return [(state, *clip_to_global(spec, t)) for state, spec, t in entries if _is_primary(spec, mesh)]


def rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    if "cpu" in states:
        torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
