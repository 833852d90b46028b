"""Where each local tensor sits inside the full model: placements, materialisation, gathering.

Every parameter a rank holds is a shard, a box (one part of each split) of one tensor of the full
single-device model, replicated over some mesh axes. Strategies that split a parameter
record that on it (`set_placement`); everything layout-independent builds on it:
deterministic initialisation of shards, gathering full tensors for parity checks and
checkpoints, and counting each gradient once in the global norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from ..config import ModelConfig
from .mesh import Mesh
from ..model.init import canonical_name, initial_box
from ..model.moe import ROUTING_COUNTERS
from . import comm

_ATTR = "_fivefold_placement"


@dataclass(frozen=True)
class Split:
    """Part `index` of `count` equal parts along `dim` (of the tensor after earlier splits)."""

    dim: int
    index: int
    count: int


@dataclass(frozen=True)
class Placement:
    """How a local tensor relates to the full tensor called `name`.

    `padded_shape` is the full shape after padding (e.g. a vocabulary padded to a multiple of
    tp); the padding rows never exist in the full model. `replicated_over` names the mesh axes
    whose ranks hold identical copies of this local tensor. `extra["repeat"]` maps an axis to
    k when runs of k consecutive ranks of that axis hold the same shard (a key/value head
    shared by k tensor-parallel ranks): those k copies are replicas too.
    """

    name: str
    global_shape: tuple[int, ...]
    splits: tuple[Split, ...] = ()
    padded_shape: tuple[int, ...] | None = None
    replicated_over: tuple[str, ...] = ("dp_cp", "tp")
    # Shards that repeat: a kv head shared by several tp ranks is part index // repeat.
    extra: dict = field(default_factory=dict, compare=False)

    def with_split(self, split: Split, drop_axis: str | None = None) -> "Placement":
        over = tuple(a for a in self.replicated_over if a != drop_axis)
        return replace(self, splits=self.splits + (split,), replicated_over=over)

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, local shape) of this shard inside the padded full tensor."""
        shape = list(self.padded_shape or self.global_shape)
        offsets = [0] * len(shape)
        for s in self.splits:
            size = shape[s.dim] // s.count
            offsets[s.dim] += s.index * size
            shape[s.dim] = size
        return tuple(offsets), tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's slice of the full tensor (padding with zeros where needed)."""
        if self.padded_shape and tuple(self.padded_shape) != tuple(full.shape):
            padded = full.new_zeros(self.padded_shape)
            padded[tuple(slice(0, n) for n in full.shape)] = full
            full = padded
        offsets, shape = self.box()
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        return full[index]


def default_placement(name: str, shape: tuple[int, ...]) -> Placement:
    return Placement(name=name, global_shape=tuple(shape))


def get_placement(param: torch.Tensor, name: str) -> Placement:
    return getattr(param, _ATTR, None) or default_placement(name, tuple(param.shape))


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    setattr(param, _ATTR, placement)


def repeats(placement: Placement) -> dict[str, int]:
    """Axis -> k where runs of k consecutive ranks of the axis hold the same shard."""
    return placement.extra.get("repeat", {})


def replica_count(placement: Placement, mesh: Mesh) -> int:
    whole_axes = math.prod(mesh[a].size for a in placement.replicated_over)
    return whole_axes * math.prod(repeats(placement).values())


def is_primary(placement: Placement, mesh: Mesh) -> bool:
    """The one replica (lowest rank on every replicated axis or run) that speaks for all copies."""
    whole_axes = all(mesh[a].rank == 0 for a in placement.replicated_over)
    return whole_axes and all(mesh[a].rank % k == 0 for a, k in repeats(placement).items())


def _local_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if not n.endswith(ROUTING_COUNTERS)
    ]
    return named


@torch.no_grad()
def materialize(model: nn.Module, config: ModelConfig, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Allocate a (meta-built, possibly sharded) model on `device` with its deterministic values.

    Each local tensor receives its slice of the full initial value, computed alone (its cost
    is the shard's, not the full tensor's), so every layout starts from the weights of the
    single-process model.
    """
    # to_empty replaces every parameter object (meta -> device), dropping attributes set on it.
    placements = {name: get_placement(tensor, name) for name, tensor in _local_tensors(model)}
    model.to_empty(device=device)
    values = torch.device(device).type != "meta"  # a dry run keeps shapes only: no values to compute
    for name, tensor in _local_tensors(model):
        placement = placements[name]
        set_placement(tensor, placement)
        if values:
            tensor.copy_(initial_shard(placement, config, seed))
    for name, buf in model.named_buffers():
        if values and name.endswith(ROUTING_COUNTERS):
            buf.zero_()
    return model


def initial_shard(placement: Placement, config: ModelConfig, seed: int) -> torch.Tensor:
    """This shard of the full initial value, computed alone (zeros where the box pads the tensor)."""
    offsets, shape = placement.box()
    inside = tuple(max(0, min(n, g - o)) for o, n, g in zip(offsets, shape, placement.global_shape))
    if inside == tuple(shape):
        return initial_box(canonical_name(placement.name, config), placement.global_shape, offsets, shape, seed, config)
    out = torch.zeros(shape)
    if all(inside):
        out[tuple(slice(0, n) for n in inside)] = initial_box(
            canonical_name(placement.name, config), placement.global_shape, offsets, inside, seed, config
        )
    return out


@torch.no_grad()
def gather_full_state(
    modules: list[nn.Module], mesh: Mesh, shapes: dict[str, tuple[int, ...]], values: str = "data",
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Full tensors of the whole model (every rank gets them), from this rank's shards.

    `shapes` are the full model's tensor shapes by name (from a meta-built reference).
    values="grad" gathers gradients instead. The primary replica of each shard writes it into
    a zero tensor and one sum over the world assembles everything exactly (adding zeros
    changes no bit). The tensors live on `device`, by default the shards' own (a CUDA shard is
    never added into a host buffer). Every rank holds the whole model: for tests, parity checks
    and small models only; a run's final weights are written by `fivefold.checkpoint.final`.
    """
    device = device or _device_of(modules)
    full = {name: torch.zeros(shape, device=device) for name, shape in shapes.items()}
    for module in modules:
        for name, tensor in _local_tensors(module):
            placement = get_placement(tensor, name)
            if not is_primary(placement, mesh):
                continue
            source = tensor.grad if values == "grad" else tensor
            if source is None:
                continue
            target = full[placement.name]
            if placement.padded_shape and tuple(placement.padded_shape) != tuple(target.shape):
                padded = target.new_zeros(placement.padded_shape)
                _write_box(padded, placement, source)
                target += padded[tuple(slice(0, n) for n in target.shape)]
            else:
                _write_box(target, placement, source)
    if mesh.world.size > 1:
        names = sorted(full)
        flat = torch.cat([full[n].reshape(-1) for n in names])
        comm.all_reduce(flat, mesh.world)
        offset = 0
        for n in names:
            numel = full[n].numel()
            full[n] = flat[offset : offset + numel].view_as(full[n])
            offset += numel
    return full


def _device_of(modules: list[nn.Module]) -> torch.device:
    for module in modules:
        for _, tensor in _local_tensors(module):
            return tensor.device
    return torch.device("cpu")


def _write_box(target: torch.Tensor, placement: Placement, source: torch.Tensor) -> None:
    offsets, shape = placement.box()
    index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
    target[index] += source.detach().to(target.dtype).reshape(shape)


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every parameter (and persistent buffer) of the full model."""
    from ..model import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    return {n: tuple(t.shape) for n, t in _local_tensors(model)}


# ------------------------------------------------------------------------------ shard regions


@dataclass(frozen=True)
class ShardSpec:
    """Which elements of the global tensor `name` a local tensor holds.

    The box (offsets, shape) is in the coordinates of the (possibly padded) global tensor;
    `flat`, when set, narrows it to elements [start, start + length) of the box's row-major
    flattening, and the local tensor is then 1-D of that length.
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None = None
    replicated_over: tuple[str, ...] = ()

    @classmethod
    def from_placement(
        cls, placement: Placement, flat: tuple[int, int] | None = None, replicated_over: tuple[str, ...] | None = None
    ) -> "ShardSpec":
        offsets, shape = placement.box()
        over = placement.replicated_over if replicated_over is None else replicated_over
        return cls(placement.name, tuple(placement.global_shape), tuple(offsets), tuple(shape), flat, tuple(over))

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> "ShardSpec":
        return cls(name, tuple(shape), (0,) * len(shape), tuple(shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.flat[1],) if self.flat is not None else self.shape

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "global_shape": list(self.global_shape), "offsets": list(self.offsets),
                "shape": list(self.shape), "flat": list(self.flat) if self.flat is not None else None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardSpec":
        flat = tuple(d["flat"]) if d.get("flat") is not None else None
        return cls(d["name"], tuple(d["global_shape"]), tuple(d["offsets"]), tuple(d["shape"]), flat)
