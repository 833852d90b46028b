"""SwiGLU's in-place backward never changes a gradient or a tensor its caller holds.

The backward writes its gradients into the gate, up and silu(gate) buffers, which is safe
only when gate and up are two distinct fresh intermediates. Autograd's version counters
catch every other saved use of them, but not inputs that share memory with each other
(both were saved before either was written) or leaves the caller owns (nothing checks
them): those take the plain expression.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.model.mlp import swiglu


def _grads(fn, x: torch.Tensor, grad: torch.Tensor, split) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(*split(x * 1))
    y.backward(grad)
    assert x.grad is not None
    return y.detach(), x.grad


def test_gate_and_up_sharing_memory_give_autograds_gradient():
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    plain = lambda g, u: F.silu(g) * u  # noqa: E731
    for split in (lambda t: (t, t), lambda t: (t, t.view_as(t))):  # one tensor, or two views of one buffer
        ours, theirs = _grads(swiglu, x, grad, split), _grads(plain, x, grad, split)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_leaf_inputs_keep_their_values():
    gen = torch.Generator().manual_seed(1)
    gate0, up0, grad = (torch.randn(3, 8, generator=gen) for _ in range(3))
    gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    swiglu(gate, up).backward(grad)
    assert torch.equal(gate.detach(), gate0) and torch.equal(up.detach(), up0)
    ref_gate, ref_up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    (F.silu(ref_gate) * ref_up).backward(grad)
    assert torch.equal(gate.grad, ref_gate.grad) and torch.equal(up.grad, ref_up.grad)
