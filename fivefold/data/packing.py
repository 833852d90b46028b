"""Packed sequences from a prepared dataset; step k's global batch is a pure function of (seed, k).

The token stream (documents joined by their EOS) is cut into non-overlapping windows of
seq_len + 1 tokens. Sample i of the endless sample sequence is window perm_e(i mod W) of
epoch e = i div W, where perm_e is a keyed pseudo-random permutation of [0, W) computed
per index (a Feistel network with cycle walking): no permutation table is stored, so memory
and start-up time do not grow with the corpus, and any rank can find any sample directly.
Global batch k is samples k*G .. k*G+G-1; data-parallel rank r reads only its contiguous
G/dp of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .sources import DataError
from .indexed import IndexedDataset

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 finaliser of x + key (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(key & _MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[int]:
    base = _mix(np.array([seed * 1_000_003 + epoch], dtype=np.uint64), 0x9E3779B97F4A7C15)
    return [int(_mix(base, r + 1)[0]) for r in range(_ROUNDS)]


def permute(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """perm(index) for a keyed bijection of [0, n): a balanced Feistel network, cycle-walked into range."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    low = np.uint64((1 << (bits // 2)) - 1)
    keys = _round_keys(seed, epoch)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & low
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & low)
        return (left << half) | right

    y = np.asarray(index, dtype=np.uint64).copy()
    outside = np.ones(y.shape, dtype=bool)
    while outside.any():  # the domain is < 4n, so a few rounds at most on average
        y[outside] = feistel(y[outside])
        outside = y >= np.uint64(n)
    return y.astype(np.int64)


class StepSampler:
    """Step k -> sample ids k*G .. k*G+G-1; subclasses turn sample ids into rows."""

    global_batch: int

    def rows(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def local_rows_at(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This data-parallel rank's rows of step `step`: only these windows are read."""
        per = self.global_batch // dp_size
        first = step * self.global_batch + dp_rank * per
        return self.rows(np.arange(first, first + per, dtype=np.int64))

    def local_batch_at(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets, _ = self.local_rows_at(step, dp_rank, dp_size)
        return inputs, targets

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local_batch_at(step, 0, 1)


class PackedSampler(StepSampler):
    """Windows of tokens [start, end) of a prepared dataset's stream."""

    def __init__(
        self, dataset: IndexedDataset, start: int, end: int, seq_len: int, global_batch: int, seed: int,
        document_mask: bool = False, what: str = "",
    ) -> None:
        self.dataset, self.start, self.seq_len = dataset, start, seq_len
        self.global_batch, self.seed, self.document_mask = global_batch, seed, document_mask
        self.windows = (end - start - 1) // seq_len
        if self.windows < 1:
            raise DataError(
                f"{what or dataset.root} holds {end - start} tokens, fewer than one sequence of "
                f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len or add data"
            )

    def window_of(self, samples: np.ndarray) -> np.ndarray:
        epochs, pos = np.divmod(samples, self.windows)
        out = np.empty_like(samples)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = permute(pos[chosen], self.windows, self.seed, int(epoch))
        return out

    def rows(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        starts = self.start + self.window_of(samples) * self.seq_len
        width = self.seq_len + 1
        tokens = np.stack([self.dataset.read(int(s), width) for s in starts]) if len(starts) else np.empty((0, width), np.int64)
        rows = torch.from_numpy(tokens)
        documents = None
        if self.document_mask:
            docs = np.stack([self.dataset.documents(int(s), self.seq_len) for s in starts])
            documents = torch.from_numpy(docs)
        return rows[:, :-1], rows[:, 1:], documents

    def describe_position(self, sample: int) -> dict[str, Any]:
        return {"dataset": self.dataset.fingerprint, "epoch": sample // self.windows, "windows": self.windows}


def split_by_documents(dataset: IndexedDataset, val_fraction: float) -> tuple[int, int, int]:
    """(0, boundary, end) token offsets: the last val_fraction of the documents are held out.

    A contiguous range of whole documents, as Megatron splits: no validation document is
    ever seen in training, and the split does not depend on the layout or the seed.
    """
    docs = dataset.num_documents
    held_out = max(1, round(val_fraction * docs))
    if docs - held_out < 1:
        raise DataError(
            f"{dataset.root} holds {docs} document(s): too few to hold out a validation split by documents "
            f"(data.val_fraction={val_fraction}); add documents"
        )
    boundary = dataset.document_end(docs - held_out - 1)
    return 0, boundary, dataset.num_tokens


def data_position(sampler: Any, step: int) -> dict[str, Any]:
    """What locates step `step` in the data: recorded in checkpoints (the batch is a function of it)."""
    sample = step * sampler.global_batch
    position: dict[str, Any] = {"sample": sample, "seed": sampler.seed, "global_batch": sampler.global_batch}
    if hasattr(sampler, "describe_position"):
        position.update(sampler.describe_position(sample))
    return position
