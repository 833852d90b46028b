"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU (mlp.py).

Layers live in a ModuleDict keyed by their global index ("0".."L-1") and the embedding and
head may be absent, so one pipeline stage is the same class holding a subset of layers and
parameter names stay those of the full model.

`Transformer.forward` returns (output, aux): output is logits when the module has the head
(hidden states otherwise) and aux the summed auxiliary MoE loss of the micro-batch's
sequences (None for a dense stage).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .attention import Attention, rope_tables
from .init import initial_value
from .mlp import MLP
from .moe import ROUTING_COUNTERS, MoE, routing_uncounted


def _without_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on `device` (nothing to turn off where autocast does not exist, e.g. meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


class _RMSNormFunction(torch.autograd.Function):
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, with a hand-derived backward.

    The forward is the usual one, op for op. Autograd would differentiate it through pow,
    mean, rsqrt and two products (about a dozen passes over the activations); the closed form
    below takes six, and the same maths: with n = x * rstd and g the incoming gradient,
        d weight = sum over tokens of g * n
        d x      = rstd * (g * weight - n * mean(g * weight * n))
    It saves what autograd saved: the fp32 input, rstd, n in the input's dtype, the weight.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision otherwise.
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        normalised = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(xf, rstd, normalised, weight)
        ctx.input_dtype = x.dtype
        return weight * normalised

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xf, rstd, normalised, weight = ctx.saved_tensors
        width = xf.shape[-1]
        grad_times_n = grad * normalised
        grad_weight = grad_times_n.reshape(-1, width).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        with _without_autocast(grad.device):  # in fp32, even if the backward runs under autocast
            projection = (grad_times_n.float() @ weight.float()).unsqueeze(-1) / width  # mean(g weight n)
        n = normalised if normalised.dtype == torch.float32 else xf * rstd  # n unrounded under bf16
        grad_x = (grad * weight).float().mul_(rstd).addcmul_(n, rstd * projection, value=-1)  # in place: no new buffers
        return grad_x.to(ctx.input_dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


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
            return checkpoint(self._forward, x, rope[0], rope[1], documents, use_reentrant=False,
                              context_fn=self._recomputation_contexts)
        return self._forward(x, rope[0], rope[1], documents)

    def _recomputation_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(forward, recomputation): the recomputed forward leaves routing statistics uncounted."""
        return contextlib.nullcontext(), routing_uncounted(self)


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
        assert self.embed is not None  # no head module: tied, so the embedding is here
        return F.linear(x, self.embed.weight)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: a method of its own so that train.compile can compile it."""
        assert self.norm is not None  # only the chunk that holds the head has the final norm
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
        if self.norm is not None:  # has_head
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
