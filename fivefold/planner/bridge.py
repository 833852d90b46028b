"""The planner's `ModelSpec`/`LayoutSpec` as the runtime's `ModelConfig`/`Layout`, and back.

The planner keeps its own frozen specs (their fields are public API), but every rule about
which layouts can run is the runtime's: `validate.check_layout` converts a candidate with
`runtime_config` and runs `fivefold.rules.layout.validate` on it. The GPT layer (``arch="gpt"``)
is not trained by fivefold; it is checked as the Llama layer of the same widths, since the
split rules (heads, widths, vocabulary, sequence, experts, pipeline) do not depend on the
layer's norms or activation.
"""

from __future__ import annotations

import dataclasses

from ..config import Config, Layout, ModelConfig, TrainConfig
from .params import is_tied
from .spec import LayoutSpec, ModelSpec


def model_config(m: ModelSpec) -> ModelConfig:
    """The runtime's description of the model shape ``m``."""
    moe = m.num_experts > 0
    return ModelConfig(
        name=m.name, vocab_size=m.vocab, hidden=m.hidden, layers=m.layers, heads=m.heads,
        kv_heads=m.n_kv_heads, ffn_hidden=m.ffn, max_seq_len=m.seq_len, tied_embeddings=is_tied(m),
        num_experts=m.num_experts, top_k=m.top_k if moe else ModelConfig.top_k, moe_every=m.moe_every,
        first_dense_layers=m.first_dense_layers, expert_ffn_hidden=m.expert_ffn if moe else 0,
        shared_experts=m.shared_experts if moe else 0, dropless=m.dropless,
    )


def model_spec(model: ModelConfig, seq_len: int) -> ModelSpec:
    """The planner's view of a fivefold model (arch "llama": RMSNorm, SwiGLU, GQA, MoE)."""
    return ModelSpec(
        layers=model.layers, hidden=model.hidden, heads=model.heads, vocab=model.vocab_size, seq_len=seq_len,
        ffn_hidden=model.ffn, kv_heads=model.n_kv_heads, arch="llama", num_experts=model.num_experts,
        top_k=model.top_k if model.is_moe else 1, expert_ffn_hidden=model.expert_ffn if model.is_moe else None,
        moe_every=model.moe_every, shared_experts=model.shared_experts, tied_embeddings=model.tied_embeddings,
        first_dense_layers=model.first_dense_layers, dropless=model.dropless, name=model.name,
    )


def runtime_layout(spec: LayoutSpec, base: Layout | None = None) -> Layout:
    """The runtime `Layout` of ``spec`` (other fields from ``base``); batching derived."""
    return dataclasses.replace(
        base or Layout(), dp=spec.dp, tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep, zero=spec.zero, vpp=spec.vpp,
        pp_schedule=spec.runtime_schedule, sequence_parallel=spec.sequence_parallel, recompute=spec.recompute,
        cp_algorithm=spec.cp_kind, micro_batch=spec.micro_batch, grad_accum=0, pp_layers=spec.pp_layers,
        dp_shard=spec.dp_shard, zero3_gather=spec.zero3_gather if spec.zero == 3 else "micro_batch",
    )


def layout_spec(layout: Layout, global_batch: int) -> LayoutSpec:
    """The planner's `LayoutSpec` of a runtime `Layout` (micro_batch resolved by validate)."""
    return LayoutSpec(
        dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, zero=layout.zero, vpp=layout.vpp,
        micro_batch=layout.micro_batch or global_batch // layout.dp, global_batch=global_batch,
        schedule=layout.pp_schedule, sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
        cp_kind=layout.cp_algorithm, pp_layers=tuple(layout.pp_layers), dp_shard=layout.dp_shard,
        zero3_gather=layout.zero3_gather,
    )


def train_dtype(precision: str) -> str:
    """The runtime's ``train.dtype`` for a planner precision (fp16 plans like bf16)."""
    return "fp32" if precision == "fp32" else "bf16"


def runtime_config(m: ModelSpec | ModelConfig, lay: LayoutSpec, precision: str = "bf16") -> Config:
    """A runtime `Config` that trains ``m`` with layout ``lay`` (seq_len from the spec)."""
    model = m if isinstance(m, ModelConfig) else model_config(m)
    train = TrainConfig(seq_len=model.max_seq_len, global_batch=lay.global_batch, dtype=train_dtype(precision))
    return Config(model=model, layout=runtime_layout(lay), train=train)
