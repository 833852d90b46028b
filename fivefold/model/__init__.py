"""The model: plain PyTorch, no distributed code. Parallelism is applied from outside."""

from .attention import Attention, AttentionCore, apply_rope, rope_tables
from .init import canonical_name, initial_value
from .mlp import MLP
from .llama import Block, RMSNorm, Transformer, build_model, count_parameters
from .moe import MoE, Experts, LocalDispatcher, Router, capacity_keep, sort_slots_by_expert

__all__ = [
    "Attention", "AttentionCore", "apply_rope", "rope_tables", "canonical_name", "initial_value",
    "MLP", "Block", "RMSNorm", "Transformer", "build_model", "count_parameters",
    "MoE", "Experts", "LocalDispatcher", "Router", "capacity_keep", "sort_slots_by_expert",
]
