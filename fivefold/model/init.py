"""Deterministic initialisation: a parameter's initial value depends on the seed and its name only.

Not on construction order, device or layout. Values are drawn per tile of a fixed grid over
the full tensor (`TILE`: 256 x 256 over the last two dims, one row of the leading dims, 64k
elements of a vector), each tile from its own generator seeded by (seed, name, tile). A rank
that holds a shard draws only the tiles its box overlaps (`initial_box`), so initialising a
shard costs time and memory in proportion to the shard, and it still equals the same slice
of the single-process model, whatever the layout.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Iterator

import torch

from ..config import ModelConfig
from .moe import EXPERT_BIAS

# Output projections feed the residual stream; scaling them by 1/sqrt(2 * layers) keeps the
# residual's variance from growing with depth (GPT-2, Megatron).
_RESIDUAL_OUTPUTS = ("attn.wo.weight", "mlp.down.weight", "mlp.shared.down.weight", "mlp.experts.down")

TILE_2D = (256, 256)  # over the last two dims of a matrix (or a stack of them)
TILE_1D = 1 << 16


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_name(name: str, config: ModelConfig) -> str:
    """A tied head held apart from the embedding (a last pipeline stage) is the embedding."""
    return "embed.weight" if config.tied_embeddings and name == "head.weight" else name


def tile_shape(ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        return ()
    if ndim == 1:
        return (TILE_1D,)
    return (1,) * (ndim - 2) + TILE_2D


def tiles(
    shape: tuple[int, ...], offsets: tuple[int, ...], box: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(tile index, start, extent) of every tile of a `shape` tensor that the box overlaps.

    Tiles at the tensor's far edges are clipped to it, so a tile's values never depend on
    which box asks for them.
    """
    size = tile_shape(len(shape))
    ranges = [range(o // t, -(-(o + n) // t)) for o, n, t in zip(offsets, box, size)]
    for index in itertools.product(*ranges):
        start = tuple(i * t for i, t in zip(index, size))
        extent = tuple(min(t, n - s) for t, n, s in zip(size, shape, start))
        yield index, start, extent


def _std(name: str, config: ModelConfig) -> float:
    std = config.init_std
    return std / math.sqrt(2 * config.layers) if name.endswith(_RESIDUAL_OUTPUTS) else std


def initial_box(
    name: str, shape: tuple[int, ...], offsets: tuple[int, ...], box: tuple[int, ...], seed: int, config: ModelConfig
) -> torch.Tensor:
    """Elements [offsets, offsets + box) of the fp32 initial value of the `shape` tensor `name`."""
    name = canonical_name(name, config)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(box)
    if leaf == EXPERT_BIAS:
        return torch.zeros(box)
    out = torch.empty(box)
    for index, start, extent in tiles(shape, offsets, box):
        generator = torch.Generator().manual_seed(name_seed(seed, f"{name}@{index}"))
        values = torch.randn(extent, generator=generator)
        lo = [max(s, o) for s, o in zip(start, offsets)]
        hi = [min(s + e, o + n) for s, e, o, n in zip(start, extent, offsets, box)]
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = values[
            tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
        ]
    return out.mul_(_std(name, config))


def initial_value(name: str, shape: tuple[int, ...], seed: int, config: ModelConfig) -> torch.Tensor:
    """The full fp32 initial value of the parameter or buffer called `name`."""
    return initial_box(name, shape, (0,) * len(shape), shape, seed, config)
