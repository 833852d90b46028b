"""Activation memory: every tensor a layer saves for its backward pass, listed by name.

Method (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Section 4): walk the forward pass and list each tensor an operator keeps for its
backward; count each distinct tensor once. Sizes are for one micro-batch of ``b`` sequences
on one device, with ``s`` the sequence length, ``h`` the hidden size, ``a`` heads, ``d``
head dimension, ``t`` the tensor-parallel and ``c`` the context-parallel degree.

GPT layer (Korthikanti, Section 4.1), 16-bit activations, 1-byte dropout masks::

    LayerNorm inputs 2 x 2sbh, QKV input 2sbh, Q and K 4sbh, V 2sbh, softmax output 2as^2b,
    softmax dropout mask as^2b, dropout output 2as^2b, projection input 2sbh,
    attention dropout mask sbh, MLP input 2sbh, GeLU input 8sbh, fc2 input 8sbh,
    MLP dropout mask sbh                                    = sbh (34 + 5as/h) bytes

With tensor parallelism the LayerNorm/dropout regions stay whole (10sbh) and the rest is
split: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism everything is split:
sbh(34/t + 5as/(ht)); selective recomputation drops the 5as^2b attention-core terms
(34sbh/t with SP); full recomputation keeps only the layer input, 2sbh (2sbh/t with SP).

Llama layer: exactly what fivefold's runtime layer saves (model/llama.py, attention.py,
moe.py), so that one list serves the planner and the runtime (fivefold.tools.saved_activations
sums it; tests measure it with saved-tensor hooks). Per token, fp32::

    attn_norm: input, rstd (1), x * rstd (h each)     -- RMSNorm's weight gradient needs x * rstd
    qkv.input h                                       -- one storage for wq, wk, wv
    sdpa.q, sdpa.k, sdpa.v, sdpa.out (= o_proj.input) -- K/V at `attention_saved_kv_heads`
    sdpa.logsumexp a/t (fp32)
    mlp_norm: input, rstd, x * rstd; mlp.input h; gate_out, silu_out, up_out, down_input f/t

SDPA (flash and math kernels alike, e.g. fp32 on CPU) saves q, k, v, its output and the
log-sum-exp per query and head; the output projection's input is the same storage. K/V reach
SDPA with their own grouped heads (``enable_gqa``), so they are saved at key/value-head size
(`attention_saved_kv_heads` is the one place that says so). bf16 follows autocast: RMSNorm keeps an fp32 copy of its input; under autocast over
fp32 weights the residual stream and x * rstd stay fp32 and every linear layer saves its own
bf16 cast of its input and of its weight; the rotary tables are cast per layer for q and k.
MoE layers replace the MLP by the router (logits, kept by the z-loss's logsumexp, probs,
top-k ids, weights), the dispatch orders, per routed copy of a token (k per token, balanced
routing) experts.input, four SwiGLU tensors of width f_e, the experts' output rows and their
router weights (combine), four SwiGLU tensors of the shared experts, and
per-sequence auxiliary-loss statistics. Not modelled (below 0.2% in the dry-run cases): a
sigmoid router's two per-token sums, the shared fp32 rotary tables, the loss's per-token
targets and statistics.

Parallel splits: tensor-parallel regions (attention core, MLP) hold a/t heads and f/t
columns; norm regions are whole unless sequence parallel, where they hold s/t tokens; the
runtime all-gathers the QKV/MLP inputs and keeps them whole for the weight gradients
(Megatron instead keeps the shard and gathers again in backward, Korthikanti 4.2.2).
Context parallelism splits s by c; the all-gather variant saves the gathered K/V (full s)
and its causal mask, ring and Ulysses save local-size tensors. Expert inputs are not
sequence-parallel. Selective recomputation checkpoints the attention core, which keeps its
grouped q, k, v inputs (drops sdpa.logsumexp or the GPT softmax terms);
full recomputation keeps the layer input only.
"""

from __future__ import annotations

from typing import NamedTuple

from ..rules.fp8 import FP8_BYTES, base_policy, is_fp8
from ..rules.precision import PrecisionError, parse_policy
from ..rules.precision import ElementBytes
from ..rules.volumes import local_kv_heads, ulysses_kv_heads, vocab_rows_per_rank
from .errors import UnknownNameError
from .spec import LayoutSpec, ModelSpec



class SavedTensor(NamedTuple):
    name: str
    elements: int
    bytes_per_element: int

    @property
    def bytes(self) -> int:
        return self.elements * self.bytes_per_element


def activation_element_bytes(precision: str) -> ElementBytes:
    """Bytes per element of the residual stream and of matmul outputs under a precision policy."""
    try:
        return parse_policy(base_policy(precision)).element_bytes()
    except PrecisionError as err:
        raise UnknownNameError(str(err)) from None


class _Dims(NamedTuple):
    b: int        # sequences per micro-batch
    s: int        # full sequence length
    rows: int     # tokens in tensor-parallel regions: b * s / c
    nrows: int    # tokens in norm regions: rows / t with sequence parallel
    kv_rows: int  # tokens of saved K/V: b * s for all-gather CP
    t: int
    ab: int       # bytes per activation element (the compute dtype)
    rb: int       # bytes of the residual stream: the wider of the parameter and compute dtypes
    casts: bool   # autocast over wider weights: each linear saves its own cast of input and weight


def _dims(m: ModelSpec, lay: LayoutSpec, precision: str) -> _Dims:
    b, s, t, c = lay.micro_batch, m.seq_len, lay.tp, lay.cp
    rows = b * s // c
    nrows = rows // t if lay.sequence_parallel else rows
    kv_rows = b * s if (c > 1 and lay.cp_kind == "allgather") else rows
    rb, ab = activation_element_bytes(precision)
    return _Dims(b, s, rows, nrows, kv_rows, t, ab, rb, rb != ab)


def saved_tensors_per_layer(model: ModelSpec, layout: LayoutSpec, precision: str = "bf16",
                            moe: bool | None = None) -> list[SavedTensor]:
    """Tensors one layer saves for backward, per device and micro-batch (see module doc).

    ``moe`` selects a MoE or dense layer; by default a MoE layer when the model has any.
    """
    moe = model.is_moe if moe is None else (moe and model.num_experts > 0)
    x = _dims(model, layout, precision)
    if layout.recompute == "full":
        return [SavedTensor("layer.input", x.nrows * model.hidden, x.rb)]
    if model.arch == "gpt":
        return _gpt_attention(model, layout, x) + _gpt_mlp(model, x, moe)
    attention = _mla_attention(model, layout, x) if model.is_mla else _llama_attention(model, layout, x)
    saved = attention + _llama_mlp(model, x, moe, layout.ep, _norms_recomputed(model, layout))
    return _in_fp8(saved) if is_fp8(precision) else saved


# Inputs kept only for the weight gradient of a linear layer that FP8 covers (`rules.fp8`):
# FP8 keeps them in FP8 (DeepSeek-V3 Section 3.3.3). Outputs of the attention core, which the
# core's own backward reads in 16 bits, are not among them. SwiGLU keeps its two inputs (gate
# and up projections' outputs) in FP8 and recomputes its output in backward (Section 3.3.3).
_FP8_CACHED = frozenset({"qkv.input", "q_a_kv_a.input", "q_b.input", "kv_b.input", "mlp.input", "experts.input"})
_SWIGLU_INPUTS = (".gate_out", ".up_out")
_SWIGLU_RECOMPUTED = (".silu_out", ".down_input")


def _in_fp8(saved: list[SavedTensor]) -> list[SavedTensor]:
    out = []
    for t in saved:
        if t.name.endswith(_SWIGLU_RECOMPUTED):
            continue
        fp8 = t.name in _FP8_CACHED or t.name.endswith(_SWIGLU_INPUTS)
        out.append(t._replace(bytes_per_element=FP8_BYTES) if fp8 else t)
    return out


def activation_bytes_per_layer(model: ModelSpec, layout: LayoutSpec, precision: str = "bf16",
                               moe: bool | None = None) -> int:
    """Sum of `saved_tensors_per_layer`: bytes one layer keeps per micro-batch and device.

    For ``arch="gpt"`` this is Korthikanti et al.'s sbh(34 + 5as/h) and its TP, SP,
    selective and full-recompute forms (module docstring).
    """
    return sum(t.bytes for t in saved_tensors_per_layer(model, layout, precision, moe))


def _gpt_attention(m: ModelSpec, lay: LayoutSpec, x: _Dims) -> list[SavedTensor]:
    h, ab, t = m.hidden, x.ab, x.t
    qd, kvd = m.heads * m.head_dim // t, local_kv_heads(m.n_kv_heads, t) * m.head_dim
    scores = x.rows * (m.heads // t) * x.s  # local queries x all keys
    out = [
        SavedTensor("ln1.input", x.nrows * h, ab),
        SavedTensor("qkv.input", x.nrows * h, ab),
        SavedTensor("attn.q", x.rows * qd, ab),
        SavedTensor("attn.k", x.kv_rows * kvd, ab),
    ]
    if lay.recompute == "none":
        out += [SavedTensor("attn.softmax_out", scores, ab),
                SavedTensor("attn.softmax_dropout_mask", scores, 1),
                SavedTensor("attn.softmax_dropout_out", scores, ab)]
    return out + [
        SavedTensor("attn.v", x.kv_rows * kvd, ab),
        SavedTensor("proj.input", x.rows * qd, ab),
        SavedTensor("attn.dropout_mask", x.nrows * h, 1),
    ]


def _gpt_mlp(m: ModelSpec, x: _Dims, moe: bool) -> list[SavedTensor]:
    h, ab = m.hidden, x.ab
    out = [SavedTensor("ln2.input", x.nrows * h, ab), SavedTensor("fc1.input", x.nrows * h, ab)]
    if moe:
        k, f = m.top_k, m.expert_ffn // x.t
        out += [SavedTensor("router.probs", x.rows * m.num_experts, 4),
                SavedTensor("experts.input", k * x.rows * h, ab),
                SavedTensor("experts.gelu_input", k * x.rows * f, ab),
                SavedTensor("experts.fc2_input", k * x.rows * f, ab),
                SavedTensor("combine.expert_out", k * x.rows * h, ab),
                SavedTensor("combine.weights", k * x.rows, ab)]
        for j in range(m.shared_experts):
            out += [SavedTensor(f"shared{j}.gelu_input", x.rows * f, ab),
                    SavedTensor(f"shared{j}.fc2_input", x.rows * f, ab)]
    else:
        f = m.ffn // x.t
        out += [SavedTensor("gelu.input", x.rows * f, ab), SavedTensor("fc2.input", x.rows * f, ab)]
    return out + [SavedTensor("mlp.dropout_mask", x.nrows * h, 1)]


def attention_saved_kv_heads(m: ModelSpec, lay: LayoutSpec) -> int:
    """Key/value heads per rank, at the rank's saved K/V length, that fivefold's attention
    saves for backward: the one place that says how grouped-query attention keeps K/V.

    Every attention core hands K/V to SDPA (``enable_gqa``) or to the fused CPU kernel with
    their own, grouped heads, so K and V are saved at the rank's key/value heads, never at
    query-head size. Ulysses sends each rank its heads' K/V for the whole sequence: heads / c
    for s tokens, the same elements as the repeated-up-to-c heads it sends for s / c tokens.
    """
    local = local_kv_heads(m.n_kv_heads, lay.tp)
    if lay.cp > 1 and lay.cp_kind == "ulysses":
        return ulysses_kv_heads(lay.cp, local)
    return local


def _rmsnorm(prefix: str, rows: int, h: int, x: _Dims) -> list[SavedTensor]:
    """RMSNorm (model/llama.py): x.float() (the input itself in fp32, a copy otherwise),
    rsqrt's output, x * rstd for the weight gradient (in the residual dtype)."""
    return [SavedTensor(f"{prefix}.input_fp32", rows * h, 4),
            SavedTensor(f"{prefix}.rstd", rows, 4),
            SavedTensor(f"{prefix}.normalised", rows * h, x.rb)]


def _norms_recomputed(m: ModelSpec, lay: LayoutSpec) -> bool:
    """Selective recomputation of a multi-head latent attention model is DeepSeek-V3's
    (Section 3.2.3): every RMSNorm and the MLA up-projections rerun in backward."""
    return m.is_mla and lay.recompute == "selective"


def _norm(prefix: str, rows: int, h: int, x: _Dims, recomputed: bool) -> list[SavedTensor]:
    """`_rmsnorm`, or only its input (in the residual dtype) when it reruns in backward."""
    return [SavedTensor(f"{prefix}.input", rows * h, x.rb)] if recomputed else _rmsnorm(prefix, rows, h, x)


def _linear_inputs(name: str, rows: int, width: int, consumers: int, x: _Dims) -> list[SavedTensor]:
    """One input read by ``consumers`` linear layers: saved once, or, under autocast over
    wider weights, one compute-dtype cast per layer (autocast caches only weights' casts)."""
    return [SavedTensor(name, (consumers if x.casts else 1) * rows * width, x.ab)]


def _weight_casts(elements: int, x: _Dims) -> list[SavedTensor]:
    """Autocast over wider weights saves each weight's compute-dtype cast for its backward."""
    return [SavedTensor("autocast.weight_casts", elements, x.ab)] if x.casts else []


def _rope_casts(m: ModelSpec, x: _Dims) -> list[SavedTensor]:
    """apply_rope casts the fp32 cos/sin tables (local positions x d) to the compute dtype for
    q and k; in fp32 the shared tables themselves are saved (not counted per layer)."""
    return [SavedTensor("rope.table_casts", 4 * (x.rows // x.b) * m.head_dim, x.ab)] if x.ab != 4 else []


def _llama_attention(m: ModelSpec, lay: LayoutSpec, x: _Dims) -> list[SavedTensor]:
    h, ab, t = m.hidden, x.ab, x.t
    d, qh = m.head_dim, m.heads // t
    gathered = x.rows  # q, k, v's input: whole under tp, all-gathered under sequence parallel
    out = _rmsnorm("attn_norm", x.nrows, h, x) + _linear_inputs("qkv.input", gathered, h, 3, x)
    kv_local = local_kv_heads(m.n_kv_heads, t) * d
    out += _weight_casts(2 * h * qh * d + 2 * h * kv_local, x) + _rope_casts(m, x)
    if lay.recompute == "selective":  # the checkpointed core keeps its inputs, grouped K/V
        kvh = local_kv_heads(m.n_kv_heads, t)
        return out + [SavedTensor("core.q", x.rows * qh * d, ab),
                      SavedTensor("core.k", x.rows * kvh * d, ab),
                      SavedTensor("core.v", x.rows * kvh * d, ab),
                      SavedTensor("o_proj.input", x.rows * qh * d, ab)]
    kvh = attention_saved_kv_heads(m, lay)
    out += [SavedTensor("sdpa.q", x.rows * qh * d, ab),
            SavedTensor("sdpa.k", x.kv_rows * kvh * d, ab),
            SavedTensor("sdpa.v", x.kv_rows * kvh * d, ab),
            SavedTensor("sdpa.out_and_o_proj.input", x.rows * qh * d, ab),  # one storage
            SavedTensor("sdpa.logsumexp", x.rows * qh, 4)]
    if lay.cp > 1 and lay.cp_kind == "allgather":  # the causal mask of local queries x all keys
        out.append(SavedTensor("sdpa.mask", x.rows * x.s, 1))
    if lay.cp > 1 and lay.cp_kind == "ring" and ab != 4:
        # ring attention merges its blocks in fp32 and keeps that output for its backward; the
        # output projection reads a compute-dtype cast of it (counted above)
        out.append(SavedTensor("ring.out_fp32", x.rows * qh * d, 4))
    if lay.cp > 1 and lay.cp_kind == "ulysses":
        # q, k and v are views of the all-to-all's q|k|v buffer (counted above); the output
        # comes back through an all-to-all, so the output projection's input is a storage of its own
        out.append(SavedTensor("o_proj.input", x.rows * qh * d, ab))
    return out


def _mla_attention(m: ModelSpec, lay: LayoutSpec, x: _Dims) -> list[SavedTensor]:
    """Multi-head latent attention (planner only), saved as fivefold's attention would save it:
    each norm as `_rmsnorm`, each linear its input, the attention core q, k, v, out and
    logsumexp at the heads' own widths (q/k: qk_nope + qk_rope, v: v_head_dim). Selective
    recomputation checkpoints from the latents on (DeepSeek-V3 Section 3.2.3 recomputes the
    up-projections): q, k and v are rebuilt in backward, the latents and the output kept."""
    h, ab, qh = m.hidden, x.ab, m.heads // x.t
    qk, again = m.qk_nope_dim + m.qk_rope_dim, _norms_recomputed(m, lay)
    out = _norm("attn_norm", x.nrows, h, x, again) + _linear_inputs("q_a_kv_a.input", x.rows, h, 2, x)
    out += _norm("q_a_norm", x.rows, m.q_lora_rank, x, again) + _norm("kv_a_norm", x.rows, m.kv_lora_rank, x, again)
    out += [SavedTensor("q_b.input", x.rows * m.q_lora_rank, ab),
            SavedTensor("kv_b.input", x.rows * m.kv_lora_rank, ab),
            SavedTensor("k_rope", x.rows * m.qk_rope_dim, ab),
            SavedTensor("core.out_and_o_proj.input", x.rows * qh * m.v_head_dim, ab)]
    if lay.recompute == "none":
        out += [SavedTensor("core.q", x.rows * qh * qk, ab),
                SavedTensor("core.k", x.kv_rows * qh * qk, ab),
                SavedTensor("core.v", x.kv_rows * qh * m.v_head_dim, ab),
                SavedTensor("core.logsumexp", x.rows * qh, 4)]
    return out


def _swiglu(prefix: str, rows: int, width: int, ab: int) -> list[SavedTensor]:
    return [SavedTensor(f"{prefix}.gate_out", rows * width, ab),
            SavedTensor(f"{prefix}.silu_out", rows * width, ab),
            SavedTensor(f"{prefix}.up_out", rows * width, ab),
            SavedTensor(f"{prefix}.down_input", rows * width, ab)]


def _llama_mlp(m: ModelSpec, x: _Dims, moe: bool, ep: int, norm_recomputed: bool = False) -> list[SavedTensor]:
    h, ab = m.hidden, x.ab
    out = _norm("mlp_norm", x.nrows, h, x, norm_recomputed)
    if not moe:
        return (out + _linear_inputs("mlp.input", x.rows, h, 2, x) + _weight_casts(3 * h * (m.ffn // x.t), x)
                + _swiglu("mlp", x.rows, m.ffn // x.t, ab))
    out += [SavedTensor("router_and_shared.input", x.rows * h, ab)]  # the router's weight gradient reads it
    k, f, e = m.top_k, m.expert_ffn // x.t, m.num_experts
    slots = k * x.rows
    out += [SavedTensor("router.logits", x.rows * e, 4),
            SavedTensor("router.probs", x.rows * e, 4),
            SavedTensor("router.logsumexp", x.rows, 4),
            SavedTensor("router.topk_ids", slots, 8),
            SavedTensor("router.weights_and_sum", slots + x.rows, 4),
            SavedTensor("dispatch.order", (2 if ep == 1 else 3) * slots, 8),  # slots, tokens; ep: regrouping
            SavedTensor("experts.input", slots * h, ab)]
    out += [SavedTensor("experts.group_offsets", e // ep, 4)]  # the grouped-matmul kernel's offsets
    out += _swiglu("experts", slots, f, ab)
    out += [SavedTensor("dispatch.expert_rows", slots * h, ab),  # the experts' output, kept by the weighting
            SavedTensor("combine.weights", slots, ab),
            SavedTensor("aux_loss.per_sequence", x.b * (4 * e + 3), 4)]  # statistics, f and p per sequence
    if m.shared_experts:
        out += _swiglu("shared", x.rows, f * m.shared_experts, ab)
    return out


def saved_tensors_embedding(model: ModelSpec, layout: LayoutSpec,
                            precision: str = "bf16") -> list[SavedTensor]:
    """First stage, per micro-batch: GPT's embedding dropout mask; Llama's token ids (int64)."""
    x = _dims(model, layout, precision)
    if model.arch == "gpt":
        return [SavedTensor("embedding.dropout_mask", x.nrows * model.hidden, 1)]
    return [SavedTensor("embedding.indices", x.rows, 8)]


def saved_tensors_output(model: ModelSpec, layout: LayoutSpec,
                         precision: str = "bf16") -> list[SavedTensor]:
    """Last stage, per micro-batch: final norm, head input and the fp32 log-probabilities
    the (vocab-parallel) cross-entropy keeps, b s V / (c t) elements."""
    x = _dims(model, layout, precision)
    h = model.hidden
    if model.arch == "llama":
        out = _rmsnorm("final_norm", x.nrows, h, x)
    else:
        out = [SavedTensor("final_norm.input", x.nrows * h, x.ab)]
    vocab_t = vocab_rows_per_rank(model.vocab, x.t)
    return out + [SavedTensor("head.input", x.rows * h, x.ab),  # all-gathered under sequence parallel
                  SavedTensor("loss.log_probs", x.rows * vocab_t, 4)]
