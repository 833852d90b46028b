"""Deterministic initialisation: a parameter's initial value depends on the seed and its name only.

Not on construction order, device or layout: a rank that holds a shard computes the full
tensor from (seed, name) and keeps its slice, so every layout starts from the same weights
as the single-process model.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..config import ModelConfig

# Output projections feed the residual stream; scaling them by 1/sqrt(2 * layers) keeps the
# residual's variance from growing with depth (GPT-2, Megatron).
_RESIDUAL_OUTPUTS = ("attn.wo.weight", "mlp.down.weight", "mlp.shared.down.weight", "mlp.experts.down")


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_name(name: str, config: ModelConfig) -> str:
    """A tied head held apart from the embedding (a last pipeline stage) is the embedding."""
    return "embed.weight" if config.tied_embeddings and name == "head.weight" else name


def initial_value(name: str, shape: tuple[int, ...], seed: int, config: ModelConfig) -> torch.Tensor:
    """The full fp32 initial value of the parameter or buffer called `name`."""
    name = canonical_name(name, config)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if leaf == "expert_bias":
        return torch.zeros(shape)
    std = config.init_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2 * config.layers)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=generator) * std
