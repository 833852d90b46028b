"""FLOP counts: model FLOPs (for MFU) and hardware FLOPs (including recomputation).

Forward FLOPs of one layer for T tokens with a context of s keys: 2 T x (matmul weights
the token uses) for the linear layers, plus 4 T s (a d) for the attention scores QK^T and
the weighted sum over V (2 T s a d each). Backward costs twice the forward (input and
weight gradients), so a training step costs 3x the forward.

* Model FLOPs (Chowdhery et al. 2022, "PaLM", Appendix B): 6 N + 12 l (a d) s per token,
  recomputation not counted. For fivefold's own layer (``arch="llama"``) this is the
  runtime's count, `fivefold.rules.flops.model_flops_per_token` (N: every parameter but the input
  embedding, norms included), so a predicted MFU and a logged one share their numerator.
  For GPT, N is the matmul weights a token uses (`params.layer_params` and the head), which
  gives Megatron's 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per batch of B sequences.
* Hardware FLOPs add what recomputation re-runs: full recomputation one more forward of
  every layer, selective recomputation the attention scores and weighted sum (Korthikanti
  et al. 2022, Section 5). For GPT with full recomputation this is Narayanan et al. 2021,
  eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).

Both use the full s x s score matrix, as those definitions do, even for causal masks.
"""

from __future__ import annotations

from ..rules.flops import model_flops_per_token
from .bridge import model_config
from .params import head_block, layer_params, selective_recompute_matmul
from .spec import ModelSpec


def attention_width(m: ModelSpec) -> float:
    """a d: the width of queries (and of the attention output). With multi-head latent
    attention the scores use q/k heads of qk_nope + qk_rope and the weighted sum v heads of
    v_head_dim, so the mean of the two stands in the 4 T s (a d) count."""
    if m.is_mla:
        return m.heads * (m.qk_nope_dim + m.qk_rope_dim + m.v_head_dim) / 2
    return m.heads * m.head_dim


def layer_forward_flops(m: ModelSpec, i: int, tokens: float) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs of layer ``i`` for ``tokens`` full-context tokens."""
    lp = layer_params(m, i)
    return 2.0 * tokens * lp.matmul_active, 4.0 * tokens * m.seq_len * attention_width(m)


def _layers_forward(m: ModelSpec, tokens: float) -> tuple[float, float]:
    n_moe = m.num_moe_layers
    mm = at = 0.0
    for moe, n in ((False, m.layers - n_moe), (True, n_moe)):
        if n:
            i = m.moe_layers.index(moe)
            f_mm, f_at = layer_forward_flops(m, i, tokens)
            mm, at = mm + n * f_mm, at + n * f_at
    return mm, at


def model_flops_per_step(m: ModelSpec, global_batch: int) -> float:
    """PaLM model FLOPs of one step over ``global_batch`` sequences of ``m.seq_len``."""
    tokens = float(global_batch) * m.seq_len
    if m.arch == "llama" and not m.is_mla:  # the runtime's layer: the runtime's count
        return tokens * model_flops_per_token(model_config(m), m.seq_len)
    mm, at = _layers_forward(m, tokens)
    head = 2.0 * tokens * head_block(m).matmul
    return 3.0 * (mm + at + head)


def hardware_flops_per_step(m: ModelSpec, global_batch: int, recompute: str = "none") -> float:
    """Model FLOPs plus the forward work recomputation repeats (module docstring)."""
    tokens = float(global_batch) * m.seq_len
    mm, at = _layers_forward(m, tokens)
    selective = at + 2.0 * tokens * m.layers * selective_recompute_matmul(m)
    extra = {"none": 0.0, "selective": selective, "full": mm + at}[recompute]
    return model_flops_per_step(m, global_batch) + extra


def gpt_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """72 B s l h^2 (1 + s/(6h) + V/(12 l h)): GPT model FLOPs without recomputation."""
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def gpt_hardware_flops_full_recompute(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
