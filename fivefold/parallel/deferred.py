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

    Only the weight's value (detached) is an input; the parameter itself travels in a
    one-element tuple, which autograd does not see. Were it an input, backward would return
    None for it and autograd would still run its gradient accumulator, whose
    post-accumulate-grad hooks fire with no gradient: data parallel and ZeRO count such a
    call as the gradient's arrival, so every deferred weight was counted twice, once before
    its gradient existed, and its bucket was reduced (ZeRO-3: its parameters freed, while the
    region's other column layers still needed them) too early. Whoever owns `pending` hands
    the parameter its gradient later.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_value: torch.Tensor, weight: tuple[torch.Tensor],
                pending: list[PendingWeightGrad]):
        ctx.save_for_backward(x, weight_value)
        ctx.weight, ctx.pending = weight[0], pending
        return F.linear(x, weight_value)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight_value = ctx.saved_tensors
        ctx.pending.append(PendingWeightGrad(ctx.weight, x, dy))
        return dy.matmul(weight_value.to(dy.dtype)), None, None, None


def _value_of(weight: torch.Tensor, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight's value as an autograd leaf of its own. It requires grad only when x does
    not, so that the output still does and backward reaches the deferred node; its own
    (None) gradient goes nowhere."""
    value = weight.detach() if dtype is None else weight.detach().to(dtype)
    if not x.requires_grad:
        value = value.detach().requires_grad_()
    return value


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, pending: list[PendingWeightGrad]) -> torch.Tensor:
    """F.linear(x, weight) (no bias) whose weight gradient is left in `pending`; a plain
    F.linear when no gradient is wanted."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight)
    device = x.device.type
    # Devices without autocast (meta, in a dry run) cannot ask whether it is on
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):  # cast as autocast would, then multiply without it
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return _DeferredLinear.apply(x.to(dtype), _value_of(weight, x, dtype), (weight,), pending)
    return _DeferredLinear.apply(x, _value_of(weight, x), (weight,), pending)
