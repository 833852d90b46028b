"""Parameter counts of the two layers the planner plans, split as tp and ep shard them.

GPT (``arch="gpt"``): Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", eq. (2)::

    P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))

i.e. per layer 12h^2 weights + 13h biases and LayerNorm parameters, plus the V x h word
embedding (shared with the output layer) and s x h position embeddings. The count follows
that formula exactly (it leaves out the final LayerNorm's 2h); with ``ffn_hidden`` or
``kv_heads`` set, the same terms are derived for the given widths.

Llama (``arch="llama"``, fivefold's runtime model) is counted by the runtime's own rule,
`fivefold.rules.params`; GPT overrides the blocks that differ (`GPTBlocks`).
"""

from __future__ import annotations

from typing import Protocol

from ..rules import params as fivefold_params
from ..rules.params import FIVEFOLD_LAYER, Block, LayerBlocks, LayerParams, ModelShape, extra_kv_heads


class PlannedShape(ModelShape, Protocol):
    """A model the planner plans (`ModelSpec`): fivefold's widths, the layer type, the sequence."""

    @property
    def arch(self) -> str: ...
    @property
    def seq_len(self) -> int: ...


class GPTBlocks(LayerBlocks):
    """Megatron's GPT layer: biases on every linear, LayerNorm (weight and bias), a GeLU MLP
    of two matrices, learned position embeddings, the output layer tied to the embedding."""

    def attention(self, m: ModelShape) -> Block:
        """q, k, v, o with their biases: qkv column-parallel, o row-parallel (bias replicated)."""
        h, qd, kvd = m.hidden, m.heads * m.head_dim, m.n_kv_heads * m.head_dim
        weights = h * qd + 2 * h * kvd + qd * h
        return Block(sharded=weights + qd + 2 * kvd, replicated=h, matmul=weights)

    def kv_replicas(self, m: ModelShape, tp: int) -> tuple[float, float]:
        weights, matmul = super().kv_replicas(m, tp)
        return weights + 2 * m.head_dim * extra_kv_heads(m, tp), matmul

    def mlp(self, m: ModelShape, width: int) -> Block:
        """fc1 h x f (+f bias), fc2 f x h (+h bias)."""
        h = m.hidden
        return Block(sharded=2 * h * width + width, replicated=h, matmul=2 * h * width)

    def norms(self, m: ModelShape) -> Block:
        return Block(replicated=2 * 2 * m.hidden)

    def embedding(self, m: PlannedShape) -> Block:  # type: ignore[override]
        return Block(sharded=m.vocab_size * m.hidden, replicated=m.seq_len * m.hidden)

    def head(self, m: ModelShape) -> Block:
        """Always tied (and the formula omits the final LayerNorm); the matmul still happens."""
        return Block(matmul=m.vocab_size * m.hidden)


GPT_LAYER = GPTBlocks()


class MLABlocks(LayerBlocks):
    """fivefold's layer with multi-head latent attention (DeepSeek-V3, arXiv 2412.19437
    Section 2.1.1): queries through a rank-``q_lora_rank`` bottleneck, keys and values through
    a shared rank-``kv_lora_rank`` latent plus one rotary key of ``qk_rope_dim`` shared by the
    heads, each compression followed by an RMSNorm. The down-projections are replicated over
    tp (as Megatron-core's MLA does); the up-projections and the output split by heads."""

    def attention(self, m: ModelShape) -> Block:
        h, heads = m.hidden, m.heads
        qk = m.qk_nope_dim + m.qk_rope_dim  # type: ignore[attr-defined]
        q_down, kv_down = h * m.q_lora_rank, h * (m.kv_lora_rank + m.qk_rope_dim)  # type: ignore[attr-defined]
        q_up = m.q_lora_rank * heads * qk  # type: ignore[attr-defined]
        kv_up = m.kv_lora_rank * heads * (m.qk_nope_dim + m.v_head_dim)  # type: ignore[attr-defined]
        out = heads * m.v_head_dim * h  # type: ignore[attr-defined]
        latent_norms = m.q_lora_rank + m.kv_lora_rank  # type: ignore[attr-defined]
        return Block(sharded=q_up + kv_up + out, replicated=q_down + kv_down + latent_norms,
                     matmul=q_down + kv_down + q_up + kv_up + out)

    def kv_replicas(self, m: ModelShape, tp: int) -> tuple[float, float]:
        """The latent is shared by all heads: no key/value head is repeated over tp."""
        return 0.0, 0.0


MLA_LAYER = MLABlocks()


def selective_recompute_matmul(m: PlannedShape) -> int:
    """Matmul weights per token that selective recomputation re-runs besides the attention
    core: multi-head latent attention's up-projections (`MLABlocks`), none otherwise."""
    if not getattr(m, "is_mla", False):
        return 0
    qk = m.qk_nope_dim + m.qk_rope_dim  # type: ignore[attr-defined]
    return m.heads * (m.q_lora_rank * qk + m.kv_lora_rank * (m.qk_nope_dim + m.v_head_dim))  # type: ignore[attr-defined]


def blocks_of(m: PlannedShape) -> LayerBlocks:
    if m.arch == "gpt":
        return GPT_LAYER
    return MLA_LAYER if getattr(m, "is_mla", False) else FIVEFOLD_LAYER


def layer_params(m: PlannedShape, i: int) -> LayerParams:
    return fivefold_params.layer_params(m, i, blocks_of(m))


def kv_replica_params(m: PlannedShape, tp: int) -> tuple[float, float]:
    return blocks_of(m).kv_replicas(m, tp)


def embedding_block(m: PlannedShape) -> Block:
    return blocks_of(m).embedding(m)


def head_block(m: PlannedShape) -> Block:
    return blocks_of(m).head(m)


def is_tied(m: PlannedShape) -> bool:
    return m.arch == "gpt" or m.tied_embeddings


def total_params(m: PlannedShape) -> int:
    return fivefold_params.total_params(m, blocks_of(m))


def active_params(m: PlannedShape) -> int:
    return fivefold_params.active_params(m, blocks_of(m))


def gpt_formula_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021, eq. (2): 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))
