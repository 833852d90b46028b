"""The token loss never widens the whole (tokens, vocab) logits to fp32 at once, and stays
bit for bit the loss and gradient of the unchunked F.cross_entropy(logits.float())."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.model.step import cross_entropy_sum


class LargestFp32Tensor(TorchDispatchMode):
    """Records the most elements of any fp32 tensor an operator returns inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def _logits(dtype: torch.dtype, tokens: int = 96, vocab: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, tokens // 2, vocab, generator=gen)).to(dtype)
    return logits, torch.randint(0, vocab, (2, tokens // 2), generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 7, 96, 500])
def test_chunked_loss_and_gradient_equal_the_unchunked_ones_bit_for_bit(dtype, chunk_rows):
    logits, targets = _logits(dtype)
    grad_out = torch.tensor(0.37)
    x = logits.clone().requires_grad_()
    expected = F.cross_entropy(x.float().reshape(-1, 200), targets.reshape(-1), reduction="sum")
    expected.backward(grad_out)
    y = logits.clone().requires_grad_()
    got = cross_entropy_sum(y, targets, chunk_elements=chunk_rows * 200)
    got.backward(grad_out)
    assert got.item() == expected.item()
    assert y.grad.dtype == dtype and torch.equal(y.grad, x.grad)


def test_bf16_logits_are_widened_one_chunk_at_a_time():
    """The largest fp32 tensor of the loss's forward and backward is one chunk of rows, not
    the whole (tokens, vocab) copy the unchunked loss and its gradient make."""
    logits, targets = _logits(torch.bfloat16)
    logits.requires_grad_()
    tokens, vocab, chunk_rows = 96, 200, 16
    with LargestFp32Tensor() as largest:
        cross_entropy_sum(logits, targets, chunk_elements=chunk_rows * vocab).backward()
    assert largest.numel == chunk_rows * vocab < tokens * vocab


def _vocab_parallel(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int, vocab: int) -> torch.Tensor:
    from fivefold.parallel.mesh import Mesh
    from fivefold.parallel.tensor_parallel import vocab_parallel_cross_entropy

    width = logits.shape[-1]
    return vocab_parallel_cross_entropy(logits, targets, Mesh.single().tp, vocab, chunk_elements=chunk_rows * width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_loss_is_the_same_in_any_chunking(dtype):
    """The vocabulary-parallel head's loss (one rank; tp parity tests hold it against the
    single-process run): every chunking gives the one-chunk loss and gradient bit for bit,
    padding columns (here 200 real of 208) included."""
    logits, targets = _logits(dtype, vocab=208)
    targets = targets.clamp(max=199)
    results = []
    for chunk_rows in (96, 1, 7, 16):
        x = logits.clone().requires_grad_()
        loss = _vocab_parallel(x, targets, chunk_rows, vocab=200)
        loss.backward(torch.tensor(0.37))
        results.append((loss.item(), x.grad))
    assert all(r[0] == results[0][0] and torch.equal(r[1], results[0][1]) for r in results)
    assert results[0][1].dtype == dtype and not results[0][1][..., 200:].any()


def test_vocab_parallel_bf16_logits_are_widened_one_chunk_at_a_time():
    logits, targets = _logits(torch.bfloat16)
    logits.requires_grad_()
    tokens, vocab, chunk_rows = 96, 200, 16
    with LargestFp32Tensor() as largest:
        _vocab_parallel(logits, targets, chunk_rows, vocab).backward()
    assert largest.numel == chunk_rows * vocab < tokens * vocab
