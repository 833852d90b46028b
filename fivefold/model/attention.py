"""Rotary position embedding and grouped-query causal attention (plain PyTorch)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (T, head_dim) for the given absolute positions.

    Positions are passed in, not assumed to be 0..T-1, so a rank holding a chunk of a longer
    sequence (context parallel) rotates its tokens by their global positions.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, d/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, d): the "rotate half" layout
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, d) by the tables (T, d)."""
    return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)).to(x.dtype)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask, for q (B, Hq, T, d) and k, v (B, Hkv, T, d).

    A module of its own so that context parallelism can swap in a distributed version and
    selective recomputation can recompute exactly this part.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:  # grouped-query attention: each key/value head serves `repeat` query heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads; no biases, as in Llama."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_theta: float) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.rope_theta = rope_theta
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.core = AttentionCore()
        self.recompute_core = False  # selective recomputation: keep no attention internals

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        d = self.head_dim
        q = self.wq(x)  # (B, T, Hq*d) -- T may grow here under sequence parallel
        k = self.wk(x)
        v = self.wv(x)
        B, T = q.shape[0], q.shape[1]
        q = q.view(B, T, -1, d).transpose(1, 2)  # (B, Hq, T, d)
        k = k.view(B, T, -1, d).transpose(1, 2)  # (B, Hkv, T, d)
        v = v.view(B, T, -1, d).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)  # (B, Hq, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.wo(y)
