"""Shard geometry: which region of a full tensor a stored shard holds, and how to fill a rank's
own region from the stored shards that overlap it.

A shard is described by `ShardSpec`: a box (offsets, shape) of the global tensor — the
`Placement` of a tensor-, expert- or pipeline-parallel shard — optionally narrowed to a flat
range (start, length) of that box's row-major flattening, which is how ZeRO shards a
flattened parameter (over a whole tensor, the box is the whole tensor; under ZeRO + TP, it is
the TP shard). Loading is box intersection: each rank asks, for each tensor it holds, for its
own spec, and `assemble` copies in the overlap of every stored shard of that tensor; every
element inside the global shape must be covered, padding (e.g. a vocabulary padded to a
multiple of tp) keeps its current value. So any layout and world size can load any other's
checkpoint. `torch.distributed.checkpoint` reshards only boxes (no flat ranges within a box)
and has no atomic commit or checksums, so it is not used.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..parallel.sharding import ShardSpec
from .errors import CorruptCheckpoint


def bounds(spec: ShardSpec) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """The smallest box holding the region, and the region's flat range inside that box.

    A flat range of a box spans whole rows of its first dim except at the two ends, so the
    bounding box is those rows. A 0-d tensor is treated as shape (1,).
    """
    offsets, shape = (spec.offsets, spec.shape) if spec.shape else ((0,), (1,))
    if spec.flat is None:
        return offsets, shape, 0, math.prod(shape)
    start, length = spec.flat
    row = math.prod(shape[1:])
    first, last = start // row, -(-(start + length) // row)
    box_offsets = (offsets[0] + first,) + tuple(offsets[1:])
    box_shape = (last - first,) + tuple(shape[1:])
    return box_offsets, box_shape, start - first * row, start - first * row + length


def intersect(a_off, a_shape, b_off, b_shape) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _index(offsets: tuple[int, ...], origin: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - g, o - g + n) for o, g, n in zip(offsets, origin, shape))


def _inside(offsets: tuple[int, ...], shape: tuple[int, ...], global_shape: tuple[int, ...]) -> torch.Tensor:
    """Bool mask over a box: True where the element lies inside the (unpadded) global tensor."""
    global_shape = global_shape or (1,)
    mask = torch.ones(shape, dtype=torch.bool)
    for dim, (o, n, g) in enumerate(zip(offsets, shape, global_shape)):
        view = [1] * len(shape)
        view[dim] = n
        mask &= (torch.arange(o, o + n) < g).view(view)
    return mask


def assemble(target: ShardSpec, pieces: Iterable[tuple[ShardSpec, torch.Tensor]], out: torch.Tensor) -> None:
    """Fill `out` (the local tensor of `target`) from stored shards of the same global tensor.

    Every element of `target` inside the global shape must be covered by some piece;
    elements outside (padding) keep their value. Overlapping pieces hold equal values
    (replicas), so the order does not matter.
    """
    t_off, t_shape, t_start, t_end = bounds(target)
    buffer = torch.zeros(t_shape, dtype=out.dtype)
    buffer.view(-1)[t_start:t_end] = out.detach().reshape(-1).cpu()
    covered = ~_inside(t_off, t_shape, target.global_shape)
    for spec, data in pieces:
        s_off, s_shape, s_start, s_end = bounds(spec)
        overlap = intersect(t_off, t_shape, s_off, s_shape)
        if overlap is None:
            continue
        source = torch.zeros(s_shape, dtype=out.dtype)
        present = torch.zeros(s_shape, dtype=torch.bool)
        source.view(-1)[s_start:s_end] = data.reshape(-1).to(out.dtype)
        present.view(-1)[s_start:s_end] = True
        src_index, dst_index = _index(overlap[0], s_off, overlap[1]), _index(overlap[0], t_off, overlap[1])
        mask = present[src_index]
        buffer[dst_index] = torch.where(mask, source[src_index], buffer[dst_index])
        covered[dst_index] |= mask
    missing = (~covered.view(-1)[t_start:t_end]).sum().item()
    if missing:
        raise CorruptCheckpoint(f"the checkpoint lacks {missing} elements of {target.name} needed by this rank's shard")
    with torch.no_grad():
        out.copy_(buffer.view(-1)[t_start:t_end].view(out.shape).to(out.device))


def clip_to_global(spec: ShardSpec, tensor: torch.Tensor) -> tuple[ShardSpec, torch.Tensor]:
    """Drop the padding of a box shard before saving: padding never exists in the full model."""
    if spec.flat is not None or not spec.shape:
        return spec, tensor
    shape = tuple(max(0, min(n, g - o)) for o, n, g in zip(spec.offsets, spec.shape, spec.global_shape))
    if shape == spec.shape:
        return spec, tensor
    clipped = tensor[tuple(slice(0, n) for n in shape)]
    return ShardSpec(spec.name, spec.global_shape, spec.offsets, shape, None, spec.replicated_over), clipped
