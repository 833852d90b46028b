"""The dense feed-forward layer: SwiGLU, down(silu(gate(x)) * up(x)) (Shazeer 2020).

Used by every dense layer (llama.py) and as the shared experts of a Mixture-of-Experts layer
(moe.py). `swiglu` computes silu(gate) * up with a backward that writes into the buffers it
frees instead of allocating three more ffn-wide tensors.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up, with a backward that writes into the buffers it frees.

    Autograd differentiates silu and mul into three new ffn-wide tensors; the same three
    products (silu_backward, and the two halves of the mul's gradient) are written here into
    silu(gate), up and gate, which nothing needs once their gradients are formed: no new
    buffers, and no write into memory that is not already in use. The forward is the usual
    one, op for op, and saves what autograd saved (gate, silu(gate), up).

    The inputs must be the gate and up projections' own outputs, held by nothing else: the
    backward overwrites them (their version counters move, so a second backward through the
    same graph fails loudly instead of reading them).
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        activated = F.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up, activated = ctx.saved_tensors
        grad_up = torch.mul(grad, activated, out=activated)
        grad_activated = torch.mul(grad, up, out=up)
        grad_gate = torch.ops.aten.silu_backward.grad_input(grad_activated, gate, grad_input=gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of two projections' fresh outputs (see _SwiGLUFunction).

    A compiled region takes the plain expression: inductor fuses it, forward and backward,
    into single kernels of its own. So do inputs the in-place backward would corrupt without
    autograd noticing: leaves (the caller's own tensors) and two views of one buffer.
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or gate.shape != up.shape or gate.dtype != up.dtype:
        return F.silu(gate) * up
    if gate.is_leaf or up.is_leaf or _one_buffer(gate, up):
        return F.silu(gate) * up
    return _SwiGLUFunction.apply(gate, up)


def _one_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of one buffer (meta tensors have none: a dry run's never are)."""
    ptr = a.untyped_storage().data_ptr()
    return ptr != 0 and ptr == b.untyped_storage().data_ptr()


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x)))
