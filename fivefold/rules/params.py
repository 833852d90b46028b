"""Parameter counts of fivefold's layer, split the way tensor and expert parallelism shard them.

The one count of the runtime's model: the planner's memory and FLOPs, the FLOPs per token
behind every logged MFU (`flops.py`), the size check of a checkpoint and the parameter count
a run prints all read it. Pure arithmetic on the model's widths: the runtime's `ModelConfig`
and the planner's `ModelSpec` both have them (`ModelShape`).

fivefold's layer (Llama-style): embedding V x h; per layer RMSNorm (h), q: h x (a d), k and
v: h x (kv d) each, o: (a d) x h, RMSNorm (h) and a SwiGLU MLP (gate, up: h x f; down:
f x h) or, in Mixture-of-Experts layers, a router h x E and E routed SwiGLU experts of width
f_e plus `shared_experts` shared ones; the final RMSNorm (h); the head h x V unless tied.
No loop over layers: dense and MoE layers are each counted once and multiplied, so the
count also sizes models far too large to build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .volumes import local_kv_heads


class ModelShape(Protocol):
    """The widths a parameter count reads (`ModelConfig` and the planner's `ModelSpec`)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn(self) -> int: ...
    @property
    def expert_ffn(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def shared_experts(self) -> int: ...
    @property
    def moe_every(self) -> int: ...
    @property
    def first_dense_layers(self) -> int: ...
    @property
    def tied_embeddings(self) -> bool: ...

    def is_moe_layer(self, index: int) -> bool: ...


@dataclass(frozen=True)
class Block:
    """Parameters of one module. ``sharded`` splits over tp; ``replicated`` does not.

    ``matmul`` counts the weights used in matrix multiplications (FLOPs = 2 x matmul per
    token in the forward pass).
    """

    sharded: int = 0
    replicated: int = 0
    matmul: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def __add__(self, other: "Block") -> "Block":
        return Block(self.sharded + other.sharded, self.replicated + other.replicated, self.matmul + other.matmul)

    def times(self, k: int) -> "Block":
        return Block(self.sharded * k, self.replicated * k, self.matmul * k)


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer: non-expert parameters and routed experts (all E of them)."""

    dense: Block  # attention, norms, dense MLP or router + shared experts
    expert: Block  # one routed expert
    num_experts: int  # routed experts in this layer (0 for a dense layer)
    top_k: int

    @property
    def total(self) -> int:
        return self.dense.total + self.num_experts * self.expert.total

    @property
    def active(self) -> int:
        return self.dense.total + self.top_k * self.expert.total

    @property
    def matmul_active(self) -> int:
        return self.dense.matmul + self.top_k * self.expert.matmul


def moe_layer_count(m: ModelShape) -> int:
    """How many layers are MoE layers (the shape's `is_moe_layer`), in closed form."""
    if m.num_experts <= 0:
        return 0
    every, first = max(m.moe_every, 1), min(m.first_dense_layers, m.layers)
    return m.layers // every - first // every


class LayerBlocks:
    """The parameters of each module of fivefold's layer. The planner's GPT layer (Megatron's,
    with biases and LayerNorm) subclasses it; the counts below take either."""

    def attention(self, m: ModelShape) -> Block:
        """wq, wk, wv, wo (grouped-query: k and v have n_kv_heads heads), split over tp."""
        q_width, kv_width = m.heads * m.head_dim, m.n_kv_heads * m.head_dim
        weights = m.hidden * q_width + 2 * m.hidden * kv_width + q_width * m.hidden
        return Block(sharded=weights, matmul=weights)

    def kv_replicas(self, m: ModelShape, tp: int) -> tuple[float, float]:
        """(parameters, matmul weights) a tensor-parallel rank holds beyond an even 1/tp split
        of the key/value projections: with tp > kv heads each head is repeated on tp/kv ranks
        (as the runtime does), so a rank holds one whole head instead of kv/tp of one."""
        weights = 2 * m.hidden * m.head_dim * extra_kv_heads(m, tp)
        return weights, weights

    def mlp(self, m: ModelShape, width: int) -> Block:
        """SwiGLU of `width`: gate, up (h x width) and down (width x h), split over tp."""
        return Block(sharded=3 * m.hidden * width, matmul=3 * m.hidden * width)

    def norms(self, m: ModelShape) -> Block:
        """The layer's two RMSNorm weights, replicated over tp."""
        return Block(replicated=2 * m.hidden)

    def embedding(self, m: ModelShape) -> Block:
        """The input side (first stage): the vocabulary-parallel word embedding."""
        return Block(sharded=m.vocab_size * m.hidden)

    def head(self, m: ModelShape) -> Block:
        """The output side (last stage): final norm and output layer; a tied head adds no
        weights (the matmul still happens)."""
        vh = m.vocab_size * m.hidden
        if m.tied_embeddings:
            return Block(replicated=m.hidden, matmul=vh)
        return Block(sharded=vh, replicated=m.hidden, matmul=vh)


FIVEFOLD_LAYER = LayerBlocks()


def extra_kv_heads(m: ModelShape, tp: int) -> float:
    """Key/value heads a tp rank holds beyond kv/tp (heads repeated when tp > kv heads)."""
    return local_kv_heads(m.n_kv_heads, tp) - m.n_kv_heads / tp


def layer_params(m: ModelShape, index: int, blocks: LayerBlocks = FIVEFOLD_LAYER) -> LayerParams:
    base = blocks.attention(m) + blocks.norms(m)
    if not m.is_moe_layer(index):
        return LayerParams(base + blocks.mlp(m, m.ffn), Block(), 0, 0)
    router = Block(replicated=m.hidden * m.num_experts, matmul=m.hidden * m.num_experts)
    shared = blocks.mlp(m, m.expert_ffn).times(m.shared_experts)
    return LayerParams(base + router + shared, blocks.mlp(m, m.expert_ffn), m.num_experts, m.top_k)


def layer_kinds(m: ModelShape, blocks: LayerBlocks = FIVEFOLD_LAYER) -> list[tuple[LayerParams, int]]:
    """(parameters of one layer, number of such layers) for the dense and the MoE layers."""
    moe = moe_layer_count(m)
    first_moe = next((i for i in range(m.layers) if m.is_moe_layer(i)), 0) if moe else 0
    first_dense = next((i for i in range(m.layers) if not m.is_moe_layer(i)), 0)
    kinds = [(first_dense, m.layers - moe), (first_moe, moe)]
    return [(layer_params(m, index, blocks), count) for index, count in kinds if count]


def total_params(m: ModelShape, blocks: LayerBlocks = FIVEFOLD_LAYER) -> int:
    """Every parameter of the full model, every expert counted."""
    layers = sum(lp.total * n for lp, n in layer_kinds(m, blocks))
    return layers + blocks.embedding(m).total + blocks.head(m).total


def active_params(m: ModelShape, blocks: LayerBlocks = FIVEFOLD_LAYER) -> int:
    """Parameters one token uses: top_k routed experts plus the shared ones, the embedding included."""
    layers = sum(lp.active * n for lp, n in layer_kinds(m, blocks))
    return layers + blocks.embedding(m).total + blocks.head(m).total
