"""A linear layer whose weight gradient is computed later, outside its own backward.

Two strategies need one: the zero-bubble pipeline (B computes input gradients, W the weight
gradients, at another time of the schedule) and tensor parallelism's overlap (a region's
weight gradients are computed while its input gradient's collective travels). The layer's
backward returns dx only and leaves a `PendingWeightGrad` (weight, x, dy) in a list its
owner keeps; `weight_grad` turns one into dW = dy^T x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PendingWeightGrad:
    """What a deferred linear left behind: dW = dy^T x."""

    weight: torch.Tensor
    input: torch.Tensor  # x (cast to dy's dtype for dW, as autocast did for the matmul)
    output_grad: torch.Tensor  # dy


def weight_grad(item: PendingWeightGrad) -> torch.Tensor:
    """dW = dy^T x of one pending use of a weight, in dy's dtype, shaped like the weight."""
    dy, x = item.output_grad, item.input.to(item.output_grad.dtype)
    return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T whose backward returns dx and appends (W, x, dy) to `pending`.

    The weight enters detached (its value) and by reference: the input-gradient backward
    never reaches the weight's gradient accumulator; whoever owns `pending` does, later.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_value: torch.Tensor, weight: torch.Tensor,
                pending: list[PendingWeightGrad]):
        ctx.save_for_backward(x, weight_value)
        ctx.weight, ctx.pending = weight, pending
        return F.linear(x, weight_value)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight_value = ctx.saved_tensors
        ctx.pending.append(PendingWeightGrad(ctx.weight, x, dy))
        return dy.matmul(weight_value.to(dy.dtype)), None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, pending: list[PendingWeightGrad]) -> torch.Tensor:
    """F.linear(x, weight) (no bias) whose weight gradient is left in `pending`; a plain
    F.linear when no gradient is wanted."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast would, then multiply without it
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return _DeferredLinear.apply(x.to(dtype), weight.detach().to(dtype), weight, pending)
    return _DeferredLinear.apply(x, weight.detach(), weight, pending)
