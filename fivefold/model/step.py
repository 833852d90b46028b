"""What one training step is made of, below both the loop and the strategies.

The micro-batch a rank sees, the autocast context of the compute dtype, and the loss
normalisation: `train.py` runs them without a pipeline and `parallel/pipeline.py` inside
its schedule, so they are written once here (strategies may not import the loop).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import Config, TrainConfig
from .attention import positions_in_documents


@dataclass
class MicroBatch:
    """One micro-batch as this rank sees it: its tokens, targets and their absolute positions.

    With document masking, positions restart at each packed document and `documents` holds
    the document index of every token of the whole sequences (attention stays inside them).
    """

    inputs: torch.Tensor  # (b, t) token ids
    targets: torch.Tensor  # (b, t)
    positions: torch.Tensor  # (t,) positions of these tokens in their sequences, (b, t) in their documents
    documents: torch.Tensor | None = None  # (b, T) document index of each token of the whole sequences
    indices: torch.Tensor | None = None  # (t,) with documents: these tokens' positions in their sequences

    @property
    def sequence_positions(self) -> torch.Tensor:
        """(t,) positions of this rank's tokens in their sequences, with or without documents."""
        return self.positions if self.indices is None else self.indices


def whole_sequence(inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None) -> MicroBatch:
    """The micro-batch of a rank that holds whole sequences (no context parallelism)."""
    if documents is None:
        return MicroBatch(inputs, targets, torch.arange(inputs.shape[1], device=inputs.device))
    indices = torch.arange(inputs.shape[1], device=inputs.device)
    return MicroBatch(inputs, targets, positions_in_documents(documents), documents, indices)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses: the caller divides by the tokens of the global batch."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def autocast_for(config: Config, device: torch.device) -> contextlib.AbstractContextManager:
    """The compute dtype's autocast (bf16), or nothing (fp32)."""
    if config.train.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_scale(train: TrainConfig) -> float:
    """Factor of a token-loss sum: the mean over every token of the global batch, in any layout."""
    return 1.0 / (train.global_batch * train.seq_len)


def sequence_scale(train: TrainConfig) -> float:
    """Factor of the per-sequence auxiliary (MoE) loss sum: the mean over the global batch."""
    return 1.0 / train.global_batch
