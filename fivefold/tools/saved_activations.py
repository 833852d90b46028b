"""Activation memory: what each layer keeps for backward, measured and derived.

Measured: `measure_saved_bytes` runs a forward pass under saved-tensor hooks and charges
every tensor autograd saves to the layer whose forward saved it. A storage is counted once
(q, k and v save the same input); parameters are not activations; a storage saved by
several layers (the rotary tables) is reported apart as shared.

Derived: `saved_tensors_per_layer` is the planner's list (fivefold.planner.activations, the
one description of what a layer saves, for every precision, MoE, SP, CP and recomputation)
for a runtime model and layout. It follows the method of Korthikanti et al. 2022 (section 4.1), which finds sbh(34 + 5as/h) bytes for
a GPT layer, sbh(10 + 24/t + 5as/(ht)) under tensor parallelism and everything divided by
t under sequence parallelism. For fivefold's layer (RMSNorm, grouped-query attention with
RoPE and PyTorch's fused SDPA, SwiGLU, no dropout), fp32 activations, b sequences of s
tokens, hidden h, a heads, FFN width f, tensor-parallel degree t, and k the key/value
width a rank holds (kv heads / t, at least one, times the head dimension):

    replicated (norm) regions, per norm:   input h, rstd 1, normalised x * rstd h
    region inputs (saved once for q,k,v / gate,up):               h      (each)
    attention, per token: q and output (= the wo input) 2 h/t; k, v 2 k (grouped heads,
        as SDPA takes them with enable_gqa, never repeated); logsumexp a/t
    SwiGLU: gate out, up out, silu out, down input:                   4 f/t

    bytes = 4 b s [ h (6 + (2 + 4 f/h) / t) + 2 k + 2 + a/t ]                (tensor parallel)
    bytes = 4 b s [ h (2 + (6 + 4 f/h) / t) + 2 k + (2 + a) / t ]            (+ sequence parallel)

t = 1 gives the single-device layer, 4 b s [h (8 + 4 f/h) + 2 k + 2 + a]. The fused attention
stores a log-sum-exp per query and head instead of the s x s scores, so there is no
5as/h term. Under sequence parallel the norm regions are split, but the two region inputs
are all-gathered before q, k, v and gate, up and kept whole for their weight gradients
(2 b s h, not divided by t); Megatron instead keeps the shard and all-gathers again in
backward (more communication, less memory) -- the one term where fivefold's formula keeps
a full-size tensor. The key/value terms shrink with the kv heads
(`fivefold.planner.activations.attention_saved_kv_heads`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import Layout, ModelConfig
from ..planner.activations import SavedTensor
from ..planner.activations import saved_tensors_per_layer as planner_saved_tensors  # the one list
from ..planner.bridge import layout_spec, model_spec


def saved_tensors_per_layer(model: ModelConfig, layout: Layout, micro_batch: int, seq_len: int,
                            precision: str = "fp32", moe: bool = False) -> list[SavedTensor]:
    """Every tensor one layer saves for backward on one rank: the planner's list
    (`fivefold.planner.activations`) for this runtime model and layout.

    See the module docstring for the derivation; `measure_saved_bytes` checks it.
    """
    spec = dataclasses.replace(layout_spec(layout, micro_batch * layout.dp), micro_batch=micro_batch)
    return planner_saved_tensors(model_spec(model, seq_len), spec, precision, moe)


def activation_bytes_per_layer(model: ModelConfig, layout: Layout, micro_batch: int, seq_len: int,
                               precision: str = "fp32", moe: bool = False) -> int:
    """Sum of `saved_tensors_per_layer`: the closed forms of the module docstring."""
    return sum(s.bytes for s in saved_tensors_per_layer(model, layout, micro_batch, seq_len, precision, moe))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's data: unwrap tensor subclasses (DTensor's local
    shard, an asynchronous collective's result) until a tensor with storage remains."""
    while hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t


@dataclass
class SavedBytes:
    per_layer: dict[str, int]  # layer name -> bytes saved for backward by that layer only
    shared: int  # storages saved by more than one layer (e.g. the rotary tables)
    outside_layers: int  # saved outside every layer (embedding, head, loss)


def measure_saved_bytes(model: nn.Module, run_forward, layers: dict[str, nn.Module]) -> SavedBytes:
    """Run `run_forward()` under saved-tensor hooks; charge each saved storage to its layer.

    `layers` maps names to the modules whose forward passes are measured separately; the
    parameters of `model` are excluded.
    """
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    owners: dict[int, set[str]] = {}
    sizes: dict[int, int] = {}
    current = ["<outside>"]
    handles = []

    def leave(_module: nn.Module, _args: tuple, _output: object) -> None:
        current.pop()

    for name, layer in layers.items():
        handles.append(layer.register_forward_pre_hook(lambda _m, _a, name=name: current.append(name)))
        handles.append(layer.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key not in params and storage.nbytes():
            owners.setdefault(key, set()).add(current[-1])
            sizes[key] = storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run_forward()
    finally:
        for h in handles:
            h.remove()
    per_layer = {name: 0 for name in layers}
    shared = outside = 0
    for key, who in owners.items():
        if len(who) > 1:
            shared += sizes[key]
        elif "<outside>" in who:
            outside += sizes[key]
        else:
            per_layer[next(iter(who))] += sizes[key]
    return SavedBytes(per_layer, shared, outside)
