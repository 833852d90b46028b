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


# fp32 elements of logits a loss chunk widens at once (16 MiB): the full (tokens, vocab) fp32
# copy is 4 GiB at 8k tokens and a 128k vocabulary.
LOSS_CHUNK_ELEMENTS = 1 << 22


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, chunk_elements: int = LOSS_CHUNK_ELEMENTS
) -> torch.Tensor:
    """Sum (not mean) of token losses: the caller divides by the tokens of the global batch.

    Computed over chunks of tokens, so the fp32 logits, their log-probabilities and their
    gradient exist for one chunk at a time, never for the whole (tokens, vocab) tensor.
    """
    vocab = logits.shape[-1]
    rows = max(1, chunk_elements // vocab)
    return _ChunkedCrossEntropySum.apply(logits.reshape(-1, vocab), targets.reshape(-1), rows)


def whole_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`cross_entropy_sum` as one expression, for torch.compile: inductor fuses the widening
    into the loss's own kernels, so no fp32 copy is stored, and a python loop over chunks
    would only be unrolled into one graph per token count."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """F.cross_entropy(logits.float(), targets, reduction="sum"), chunk by chunk of rows.

    Bit for bit the same loss and gradient as the unchunked expression: every row's
    log-softmax and gradient are computed by the same ops, and the token losses are summed by
    the same kernel (nll_loss's sum) in the same order. Saves the logits in their own dtype
    (bf16 under autocast) and recomputes each chunk's softmax in the backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        losses = torch.cat([
            F.cross_entropy(chunk.float(), t, reduction="none")  # (rows,) fp32
            for chunk, t in zip(logits.split(rows), targets.split(rows))
        ])
        ctx.save_for_backward(logits, targets)
        ctx.rows = rows
        # nll_loss sums -input[i, target[i]]: with input = -losses and target 0 that is the
        # cross-entropy's own sum, in its order
        return F.nll_loss(-losses[:, None], torch.zeros_like(targets), reduction="sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets = ctx.saved_tensors
        out = torch.empty_like(logits)  # (N, V) in the logits' dtype, as autograd's would be
        for chunk, t, dest in zip(logits.split(ctx.rows), targets.split(ctx.rows), out.split(ctx.rows)):
            dest.copy_(_cross_entropy_sum_grad(chunk, t, grad))
        return out, None, None


def _cross_entropy_sum_grad(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d/dlogits of grad * F.cross_entropy(logits.float(), targets, reduction="sum"), fp32.

    The kernels autograd runs for that expression (nll_loss's backward puts -grad at each
    target; log_softmax's backward), called directly: no graph is built inside the backward,
    so nothing of this chunk is saved or outlives it.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    grad_log_probs = torch.zeros_like(log_probs).scatter_(1, targets[:, None], -grad.expand(targets.shape[0], 1))
    return torch._log_softmax_backward_data(grad_log_probs, log_probs, 1, log_probs.dtype)


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
