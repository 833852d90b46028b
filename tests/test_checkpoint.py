"""Checkpoints: resharding by box intersection, atomic commit, corruption, resume, crash, export.

Pure unit tests check the reassembly of any region from any other partition (boxes, ZeRO
flat ranges, flat ranges inside tensor-parallel boxes, padding). Single-process runs check
bitwise resume, corruption handling and Hugging Face export; a 2-rank pool checks parallel
writes and cross-rank resharding; a torchrun job killed with SIGKILL checks automatic
restart. Cross-layout resume tests run when the strategy modules they need exist.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ShardSpec,
    assemble,
    checkpoint_root,
    clip_to_global,
    export_hf,
    import_hf,
    list_checkpoints,
    read_manifest,
    resume_latest,
)
from fivefold.config import load_config
from fivefold.layout import validate
from fivefold.mesh import Mesh
from fivefold.parallel.sharding import Placement, Split, full_shapes, gather_full_state
from fivefold.train import build

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ pure resharding (no processes)


def _region(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Ground truth: the elements of `spec` taken from the full tensor (zero padding allowed)."""
    padded = torch.zeros([max(g, o + n) for g, o, n in zip(full.shape, spec.offsets, spec.shape)] or [1])
    padded[tuple(slice(0, g) for g in full.shape)] = full
    box = padded[tuple(slice(o, o + n) for o, n in zip(spec.offsets, spec.shape))]
    if spec.flat is None:
        return box.clone()
    start, length = spec.flat
    return box.reshape(-1)[start : start + length].clone()


def _random_partition(shape: tuple[int, ...], rng: random.Random) -> list[ShardSpec]:
    """A random layout: a box grid (like tp x ep splits), each box maybe ZeRO-split into flat ranges."""
    dims = [rng.choice([1, 2, 3]) if n >= 3 else 1 for n in shape]
    specs = []
    for cell in _grid(shape, dims):
        offsets, box_shape = cell
        numel = math.prod(box_shape)
        pieces = rng.choice([1, 1, 2, 3])
        if pieces == 1:
            specs.append(ShardSpec("w", shape, offsets, box_shape))
            continue
        cuts = sorted(rng.sample(range(1, numel), min(pieces - 1, numel - 1)))
        bounds = [0, *cuts, numel]
        specs += [ShardSpec("w", shape, offsets, box_shape, (a, b - a)) for a, b in zip(bounds, bounds[1:])]
    return specs


def _grid(shape: tuple[int, ...], counts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Uneven chunks: every dim cut into `counts[d]` contiguous pieces."""
    per_dim = []
    for n, c in zip(shape, counts):
        edges = [round(i * n / c) for i in range(c + 1)]
        per_dim.append([(a, b - a) for a, b in zip(edges, edges[1:]) if b > a])
    cells = [((), ())]
    for options in per_dim:
        cells = [(o + (a,), s + (n,)) for o, s in cells for a, n in options]
    return cells


def test_any_partition_reassembles_any_other():
    """Boxes, flat ranges of whole tensors and flat ranges inside boxes, resharded both ways."""
    rng = random.Random(0)
    for case in range(40):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.choice([1, 2, 3])))
        full = torch.randn(shape, generator=torch.Generator().manual_seed(case))
        stored = [(s, _region(full, s)) for s in _random_partition(shape, rng)]
        rng.shuffle(stored)
        for target in _random_partition(shape, rng):
            out = torch.full(target.local_shape, float("nan"))
            assemble(target, stored, out)
            assert torch.equal(out, _region(full, target)), (case, target)


def test_padding_is_dropped_on_save_and_kept_on_load():
    """A vocabulary of 5 rows padded to 6 for tp=2 (rows 3..5 hold one padding row), loaded as tp=3 of 6."""
    full = torch.arange(10.0).view(5, 2)
    saved = []
    for index in range(2):
        placement = Placement("embed.weight", (5, 2), (Split(0, index, 2),), padded_shape=(6, 2))
        local = placement.take(full)
        saved.append(clip_to_global(ShardSpec.from_placement(placement), local))
    assert saved[1][0].shape == (2, 2) and saved[1][1].shape == (2, 2)  # padding row not stored
    placement = Placement("embed.weight", (5, 2), (Split(0, 2, 3),), padded_shape=(6, 2))
    out = torch.full((2, 2), -1.0)
    assemble(ShardSpec.from_placement(placement), saved, out)
    assert torch.equal(out[0], full[4]) and torch.equal(out[1], torch.tensor([-1.0, -1.0]))


def test_uncovered_elements_and_scalars():
    spec = ShardSpec("w", (4,), (0,), (4,))
    with pytest.raises(CorruptCheckpoint, match="lacks 2 elements of w"):
        assemble(spec, [(ShardSpec("w", (4,), (0,), (2,)), torch.ones(2))], torch.zeros(4))
    scalar = ShardSpec("s", (), (), ())
    out = torch.zeros(())
    assemble(scalar, [(ShardSpec("s", (), (), (), (0, 1)), torch.tensor([3.0]))], out)
    assert out.item() == 3.0
