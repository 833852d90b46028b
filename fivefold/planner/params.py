"""Exact parameter counts, split the way tensor and expert parallelism shard them.

GPT (``arch="gpt"``): Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", eq. (2)::

    P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))

i.e. per layer 12h^2 weights + 13h biases and LayerNorm parameters, plus the V x h word
embedding (shared with the output layer) and s x h position embeddings. The count follows
that formula exactly (it leaves out the final LayerNorm's 2h); with ``ffn_hidden`` or
``kv_heads`` set, the same terms are derived for the given widths.

Llama (``arch="llama"``, fivefold's runtime model): embedding V x h; per layer RMSNorm (h),
q: h x (a d), k and v: h x (kv d) each, o: (a d) x h, RMSNorm (h) and a SwiGLU MLP
(gate, up: h x f; down: f x h) or, in MoE layers, a router h x E and E routed SwiGLU
experts of width f_e plus ``shared_experts`` shared ones; final RMSNorm (h); head h x V
unless tied.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..volumes import local_kv_heads
from .spec import ModelSpec


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
        return Block(self.sharded + other.sharded, self.replicated + other.replicated,
                     self.matmul + other.matmul)

    def times(self, k: int) -> "Block":
        return Block(self.sharded * k, self.replicated * k, self.matmul * k)


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer: non-expert parameters and routed experts (all E of them)."""

    dense: Block       # attention, norms, dense MLP or router + shared experts
    expert: Block      # one routed expert
    num_experts: int   # routed experts in this layer (0 for a dense layer)
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


def attention_block(m: ModelSpec) -> Block:
    """q, k, v, o projections (+ GPT biases: qkv column-parallel, o row-parallel)."""
    h, qd, kvd = m.hidden, m.heads * m.head_dim, m.n_kv_heads * m.head_dim
    weights = h * qd + 2 * h * kvd + qd * h
    if m.arch == "gpt":
        return Block(sharded=weights + qd + 2 * kvd, replicated=h, matmul=weights)
    return Block(sharded=weights, matmul=weights)


def kv_replica_params(m: ModelSpec, tp: int) -> tuple[float, float]:
    """(parameters, matmul weights) a tensor-parallel rank holds beyond an even 1/tp split
    of the key/value projections: with tp > kv heads each head is repeated on tp/kv ranks
    (as the runtime does), so a rank holds one whole head instead of kv/tp of one."""
    extra_heads = local_kv_heads(m.n_kv_heads, tp) - m.n_kv_heads / tp
    weights = 2 * m.hidden * m.head_dim * extra_heads
    biases = 2 * m.head_dim * extra_heads if m.arch == "gpt" else 0.0
    return weights + biases, weights


def mlp_block(m: ModelSpec, width: int) -> Block:
    """GPT: fc1 h x f (+f bias), fc2 f x h (+h bias). Llama SwiGLU: gate, up, down."""
    h = m.hidden
    if m.arch == "gpt":
        return Block(sharded=2 * h * width + width, replicated=h, matmul=2 * h * width)
    return Block(sharded=3 * h * width, matmul=3 * h * width)


def norms_block(m: ModelSpec) -> Block:
    """Two norms per layer: LayerNorm has weight and bias (2h), RMSNorm a weight (h)."""
    per = 2 * m.hidden if m.arch == "gpt" else m.hidden
    return Block(replicated=2 * per)


def layer_params(m: ModelSpec, i: int) -> LayerParams:
    base = attention_block(m) + norms_block(m)
    if not m.is_moe_layer(i):
        return LayerParams(base + mlp_block(m, m.ffn), Block(), 0, 0)
    router = Block(replicated=m.hidden * m.num_experts, matmul=m.hidden * m.num_experts)
    shared = mlp_block(m, m.expert_ffn).times(m.shared_experts)
    return LayerParams(base + router + shared, mlp_block(m, m.expert_ffn), m.num_experts, m.top_k)


def embedding_block(m: ModelSpec) -> Block:
    """Input side (first stage): vocab-parallel word embedding (+ GPT position embedding)."""
    pos = m.seq_len * m.hidden if m.arch == "gpt" else 0
    return Block(sharded=m.vocab * m.hidden, replicated=pos)


def head_block(m: ModelSpec) -> Block:
    """Output side (last stage): final norm and output layer; a tied head adds no weights.

    GPT always ties (and the formula omits the final LayerNorm); the matmul still happens.
    """
    vh = m.vocab * m.hidden
    if m.arch == "gpt":
        return Block(matmul=vh)
    if m.tied_embeddings:
        return Block(replicated=m.hidden, matmul=vh)
    return Block(sharded=vh, replicated=m.hidden, matmul=vh)


def is_tied(m: ModelSpec) -> bool:
    return m.arch == "gpt" or m.tied_embeddings


def layer_kinds(m: ModelSpec) -> list[tuple[LayerParams, int]]:
    """(parameters of one layer, number of such layers) for dense and MoE layers."""
    n_moe = m.num_moe_layers
    return [(layer_params(m, m.moe_layers.index(moe)), n)
            for moe, n in ((False, m.layers - n_moe), (True, n_moe)) if n]


def total_params(m: ModelSpec) -> int:
    layers = sum(lp.total * n for lp, n in layer_kinds(m))
    return layers + embedding_block(m).total + head_block(m).total


def active_params(m: ModelSpec) -> int:
    layers = sum(lp.active * n for lp, n in layer_kinds(m))
    return layers + embedding_block(m).total + head_block(m).total


def matmul_params_active(m: ModelSpec) -> int:
    """Weights a token multiplies with: every linear layer it uses, including the head.

    This is the N of PaLM's model-FLOPs definition (Chowdhery et al. 2022, App. B, 6N per
    token): the embedding lookup does no multiplication, the output layer does, tied or not.
    """
    layers = sum(lp.matmul_active * n for lp, n in layer_kinds(m))
    return layers + head_block(m).matmul


def gpt_formula_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021, eq. (2): 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))
