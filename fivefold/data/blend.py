"""Blends of prepared datasets with Megatron's blended-dataset semantics.

`data.source = "0.7 data/web 0.3 data/code"` (weight, path pairs, as Megatron's --data-path).
Sample i of the blend goes to the dataset whose realised count lags its weight most:
argmax_d (w_d * (i + 1) - count_d), ties to the first. After any n samples every dataset's
count is within one of w_d * n, so the realised fraction follows the weights at every
scale, and sample i is a pure function of i (the same in every layout). The j-th sample a
dataset contributes is its own sampler's sample j (its own epochs and shuffle).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .sources import DataError
from .packing import StepSampler


def parse_blend(source: str) -> list[tuple[float, str]] | None:
    """[(weight, path), ...] for "w1 path1 w2 path2 ..."; None for a single path."""
    parts = source.split()
    if len(parts) < 2:
        return None
    try:
        float(parts[0])
    except ValueError:
        return None
    if len(parts) % 2:
        raise DataError(f"data.source={source!r}: a blend is 'weight path weight path ...'; an odd number of items was given")
    pairs = []
    for weight_text, path in zip(parts[0::2], parts[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise DataError(f"data.source: blend weight {weight_text!r} (before {path}) is not a number") from None
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise DataError(f"data.source: blend weight {weight_text} for {path} must be a positive number")
        pairs.append((weight, path))
    return pairs


class BlendIndex:
    """Which dataset sample i comes from, and its index there; extended on demand and kept."""

    def __init__(self, weights: list[float]) -> None:
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self.dataset = np.empty(0, dtype=np.int32)
        self.within = np.empty(0, dtype=np.int64)
        self._counts = [0] * len(weights)

    def extend_to(self, n: int) -> None:
        start = len(self.dataset)
        if n <= start:
            return
        chosen = np.empty(n - start, dtype=np.int32)
        within = np.empty(n - start, dtype=np.int64)
        counts, weights = self._counts, self.weights
        for i in range(start, n):
            lag = [w * (i + 1) - c for w, c in zip(weights, counts)]
            d = lag.index(max(lag))
            chosen[i - start], within[i - start] = d, counts[d]
            counts[d] += 1
        self.dataset = np.concatenate([self.dataset, chosen])
        self.within = np.concatenate([self.within, within])

    def lookup(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.extend_to(int(samples.max()) + 1 if len(samples) else 0)
        return self.dataset[samples], self.within[samples]


class BlendedSampler(StepSampler):
    """Rows of several samplers, interleaved by `BlendIndex`."""

    def __init__(self, samplers: Sequence[StepSampler], weights: list[float], global_batch: int, seed: int) -> None:
        self.samplers, self.index = samplers, BlendIndex(weights)
        self.global_batch, self.seed = global_batch, seed

    def rows(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        which, within = self.index.lookup(samples)
        per_dataset = {d: (np.nonzero(which == d)[0], sampler.rows(within[which == d]))
                       for d, sampler in enumerate(self.samplers) if (which == d).any()}
        first = next(iter(per_dataset.values()))[1]
        out = [None if t is None else t.new_empty((len(samples), *t.shape[1:])) for t in first]
        for places, rows in per_dataset.values():
            for target, part in zip(out, rows):
                if target is not None and part is not None:
                    target[torch.from_numpy(places)] = part
        return out[0], out[1], out[2]  # type: ignore[return-value]

    def describe_position(self, sample: int) -> dict:
        """Samples taken from each dataset before `sample`."""
        self.index.extend_to(sample)
        return {"blend_samples": np.bincount(self.index.dataset[:sample], minlength=len(self.samplers)).tolist()}
