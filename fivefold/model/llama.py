"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Layers live in a ModuleDict keyed by their global index ("0".."L-1") and the embedding and
head may be absent, so one pipeline stage is the same class holding a subset of layers and
parameter names stay those of the full model.

`Transformer.forward` returns (output, aux): output is logits when the module has the head
(hidden states otherwise) and aux the summed auxiliary MoE loss of the micro-batch's
sequences (None for a dense stage).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .attention import Attention, rope_tables
from .init import initial_value
from .moe import ROUTING_COUNTERS, MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision otherwise.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def build_mlp(config: ModelConfig, index: int) -> nn.Module:
    if not config.is_moe_layer(index):
        return MLP(config.hidden, config.ffn)
    return MoE(
        config.hidden,
        config.num_experts,
        config.top_k,
        config.expert_ffn,
        shared_experts=config.shared_experts,
        router=config.router,
        renormalize=config.renormalize,
        dropless=config.dropless,
        capacity_factor=config.capacity_factor,
        aux_loss_coef=config.aux_loss_coef,
        z_loss_coef=config.z_loss_coef,
    )


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config.hidden, config.heads, config.n_kv_heads)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = build_mlp(config, index)
        self.recompute_full = False  # full recomputation: keep only the block's input

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.attn_norm(x), (cos, sin), documents)
        out = self.mlp(self.mlp_norm(x))
        if isinstance(out, tuple):  # MoE: (output, auxiliary loss)
            return x + out[0], out[1]
        return x + out, None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.recompute_full and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope[0], rope[1], documents, use_reentrant=False)
        return self._forward(x, rope[0], rope[1], documents)


class Transformer(nn.Module):
    """The decoder, or the part of it one pipeline stage holds."""

    def __init__(
        self,
        config: ModelConfig,
        layer_ids: Iterable[int] | None = None,
        with_embedding: bool = True,
        with_head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        ids = list(range(config.layers)) if layer_ids is None else list(layer_ids)
        # An explicit (uninitialised) weight skips nn.Embedding's normal_() init: the values are
        # set by init_weights anyway, and normal_() on the meta device imports torch._dynamo,
        # which costs seconds in every process.
        self.embed = (
            nn.Embedding(config.vocab_size, config.hidden, _weight=torch.empty(config.vocab_size, config.hidden))
            if with_embedding
            else None
        )
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in ids})
        self.norm = RMSNorm(config.hidden, config.norm_eps) if with_head else None
        # A tied head reuses the embedding matrix when both are here; a pipeline stage holding
        # the head alone keeps its own copy (named head.weight) that the pipeline keeps in sync.
        tie_here = config.tied_embeddings and with_embedding
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False) if with_head and not tie_here else None
        self.has_head = with_head

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(x)
        return F.linear(x, self.embed.weight)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: a method of its own so that train.compile can compile it."""
        return self.output_logits(self.norm(x))

    def forward(
        self, inputs: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """inputs: token ids (B, T) with an embedding, hidden states (B, T, C) without.

        positions: absolute positions (T,) of this rank's tokens; 0..T-1 by default; or (B, T)
        positions inside each packed document. documents: (B, T_full) document index of every
        token of the whole sequences (attention stays inside documents), or None.
        """
        x = self.embed(inputs) if self.embed is not None else inputs
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        rope = self.rope(positions)
        aux = None
        for block in self.layers.values():
            x, layer_aux = block(x, rope, documents)
            if layer_aux is not None:
                aux = layer_aux if aux is None else aux + layer_aux
        if self.has_head:
            x = self.final(x)
        return x, aux

    @torch.no_grad()
    def init_weights(self, seed: int) -> "Transformer":
        """Set every parameter and buffer to its deterministic initial value (seed, name)."""
        for name, tensor in list(self.named_parameters()) + list(self.named_buffers()):
            if name.endswith(ROUTING_COUNTERS):
                tensor.zero_()
                continue
            tensor.copy_(initial_value(name, tuple(tensor.shape), seed, self.config))
        return self

    def moe_layers(self) -> dict[str, MoE]:
        return {name: block.mlp for name, block in self.layers.items() if isinstance(block.mlp, MoE)}


def build_model(config: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """The full single-device model, initialised deterministically."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    return model.init_weights(seed)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
