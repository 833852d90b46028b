"""Model FLOPs per token: the one count behind every MFU fivefold reports.

Pure arithmetic on a `ModelConfig` (no torch): training logs and benchmarks
(`fivefold.observe.metrics`) and the planner (`planner.flops`) use it, so a measured and a
predicted MFU divide the same numerator.

Definition used throughout fivefold (PaLM's, as torchtitan computes it):

    model FLOPs per token = 6 * N + 12 * L * H * Q * T

- N: parameters one token passes through in matrix multiplications, i.e. every parameter of
  the model except the input embedding table (a lookup, no FLOPs). The output head counts
  (with tied embeddings the shared matrix is counted once, as the head). Norm weights are
  included, as torchtitan does; they are about 1e-4 of N. For Mixture-of-Experts layers N
  counts the *active* parameters: router, top_k routed experts and the shared experts.
- 6 = 2 FLOPs per multiply-add x (1 forward + 2 backward matmuls: input and weight grads).
- 12 * L * H * Q * T: attention scores q k^T and the weighted sum of v, each 2 * Q * T
  FLOPs per token and head in the forward pass, times 3 for forward + backward; L layers,
  H query heads, Q head dimension, T sequence length. Like PaLM we do not halve it for the
  causal mask (a causal kernel does about half of this work), and recomputation
  (activation checkpointing, flash attention's backward) is not counted: MFU measures
  useful model work, not what the hardware executed.

Sources: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1 (C = 6N
per token); Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B (6N + 12LHQT and the definition of MFU); torchtitan `get_num_flop_per_token`
(N = all parameters minus the input embedding).
"""

from __future__ import annotations

from ..config import ModelConfig
from .params import FIVEFOLD_LAYER, layer_kinds


def active_params_per_token(m: ModelConfig) -> int:
    """N of the PaLM formula: every parameter except the input embedding, MoE counted as active
    (the counts are `params.py`'s: norms and the router included, the head once, tied or not)."""
    layers = sum(layer.active * count for layer, count in layer_kinds(m))
    head = FIVEFOLD_LAYER.head(m)
    return layers + head.replicated + head.matmul


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """12 * L * H * Q * T: scores and weighted values, forward + backward, no causal discount."""
    return 12 * m.layers * m.heads * m.head_dim * seq_len


def model_flops_per_token(model_config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 * N + 12 * L * H * Q * T (PaLM)."""
    return 6 * active_params_per_token(model_config) + attention_flops_per_token(model_config, seq_len)
