"""Weight names and configs shared with Hugging Face `LlamaForCausalLM` / `MixtralForCausalLM`.

fivefold's `Transformer` computes the same function as those models (RMSNorm, rotate-half RoPE
with the angle table [θ, θ], grouped-query attention, SwiGLU; Mixtral's router is a softmax
over all experts, top-k, renormalised, dropless), so conversion is renaming and, for Mixtral
experts, stacking:

| fivefold                         | Hugging Face (`model.` prefix inside layers)               |
|----------------------------------|------------------------------------------------------------|
| embed.weight                     | model.embed_tokens.weight                                  |
| layers.i.attn_norm.weight        | model.layers.i.input_layernorm.weight                      |
| layers.i.attn.{wq,wk,wv,wo}      | model.layers.i.self_attn.{q,k,v,o}_proj                    |
| layers.i.mlp_norm.weight         | model.layers.i.post_attention_layernorm.weight             |
| layers.i.mlp.{gate,up,down}      | model.layers.i.mlp.{gate,up,down}_proj                     |
| layers.i.mlp.router.gate.weight  | model.layers.i.mlp.gate.weight (module) /                  |
|                                  | model.layers.i.block_sparse_moe.gate.weight (files)        |
| layers.i.mlp.experts.gate/up     | mlp.experts.gate_up_proj (E, 2f, h) = [gate; up] (module) /|
|   (E, f, h) stacked              | block_sparse_moe.experts.e.w1 / w3 (f, h) (files)          |
| layers.i.mlp.experts.down        | mlp.experts.down_proj (E, h, f) (module) /                 |
|   (E, h, f)                      | block_sparse_moe.experts.e.w2 (h, f) (files)               |
| norm.weight                      | model.norm.weight                                          |
| head.weight (absent when tied)   | lm_head.weight                                             |

Two Mixtral namings exist: the modules of transformers >= 5 fuse the experts into 3-D
tensors ("module" names), while checkpoint files on disk — and every transformers version's
loader — use one matrix per expert ("files" names). Import accepts either; export writes
the files naming by default, which every version loads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import ModelConfig
from ..model.moe import EXPERT_BIAS

SUPPORTED_TYPES = ("llama", "mixtral")


class HFConversionError(ValueError):
    """A Hugging Face config or state dict fivefold cannot represent; the message says why."""


# ----------------------------------------------------------------------------------- configs


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _rope_theta(hf_config: Any) -> float:
    """rope_theta from transformers 5 `rope_parameters`, or the older top-level key."""
    params = _get(hf_config, "rope_parameters") or _get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    if rope_type != "default":
        raise HFConversionError(f"rope_type={rope_type!r} (scaled RoPE) is not supported; fivefold uses plain RoPE")
    theta = params.get("rope_theta") if params else None
    return float(theta if theta is not None else _get(hf_config, "rope_theta", 10000.0))


_REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _check_supported_features(hf_config: Any, model_type: str) -> None:
    for key in _REQUIRED_SIZES:
        value = _get(hf_config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HFConversionError(f"config.json: {key}={value!r}; it must be a positive integer")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={_get(hf_config, 'hidden_act')!r}; fivefold's MLP is SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if _get(hf_config, flag, False):
            raise HFConversionError(f"{flag}=true; fivefold's linear layers have no bias")
    if model_type == "mixtral" and _get(hf_config, "sliding_window") not in (None, 0):
        raise HFConversionError("sliding_window attention is not supported; fivefold attends to the whole context")
    hidden, heads = _get(hf_config, "hidden_size"), _get(hf_config, "num_attention_heads")
    head_dim = _get(hf_config, "head_dim")
    if head_dim not in (None, hidden // heads):
        raise HFConversionError(f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {hidden // heads}")


def config_from_hf(hf_config: Any, name: str | None = None) -> ModelConfig:
    """fivefold's ModelConfig for a transformers LlamaConfig / MixtralConfig (object or dict)."""
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_TYPES:
        raise HFConversionError(f"model_type={model_type!r}; fivefold converts {', '.join(SUPPORTED_TYPES)}")
    _check_supported_features(hf_config, model_type)
    heads = _get(hf_config, "num_attention_heads")
    name = name or str(_get(hf_config, "_name_or_path") or model_type).rstrip("/").split("/")[-1]
    common = dict(
        name=re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or model_type,  # it names run folders
        vocab_size=_get(hf_config, "vocab_size"),
        hidden=_get(hf_config, "hidden_size"),
        layers=_get(hf_config, "num_hidden_layers"),
        heads=heads,
        kv_heads=_get(hf_config, "num_key_value_heads") or heads,
        ffn_hidden=_get(hf_config, "intermediate_size"),
        max_seq_len=_get(hf_config, "max_position_embeddings", 2048),
        rope_theta=_rope_theta(hf_config),
        norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        tied_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        init_std=float(_get(hf_config, "initializer_range", 0.02)),
    )
    if model_type == "llama":
        return ModelConfig(**common)
    return ModelConfig(
        **common,
        num_experts=_get(hf_config, "num_local_experts"),
        top_k=_get(hf_config, "num_experts_per_tok"),
        expert_ffn_hidden=_get(hf_config, "intermediate_size"),
        router="softmax",
        renormalize=True,
        dropless=True,
        aux_loss_coef=float(_get(hf_config, "router_aux_loss_coef", 0.0)),
        z_loss_coef=0.0,
    )


def _check_exportable(config: ModelConfig) -> None:
    """Mixtral is the only MoE shape transformers knows: every layer MoE, softmax, dropless."""
    if not config.is_moe:
        return
    reasons = []
    if config.shared_experts:
        reasons.append("shared experts (model.shared_experts > 0)")
    if config.moe_every != 1 or config.first_dense_layers:
        reasons.append("dense layers between MoE layers (moe_every / first_dense_layers)")
    if config.router != "softmax" or not config.renormalize:
        reasons.append("a router other than softmax with renormalised top-k")
    if not config.dropless:
        reasons.append("token dropping (model.dropless = false)")
    if reasons:
        raise HFConversionError("Mixtral cannot express " + "; ".join(reasons))


def hf_config_from(config: ModelConfig) -> Any:
    """A transformers LlamaConfig (dense) or MixtralConfig (MoE) for fivefold's ModelConfig."""
    _check_exportable(config)
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tied_embeddings,
        initializer_range=config.init_std,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )
    if not config.is_moe:
        from transformers import LlamaConfig

        return LlamaConfig(**common, intermediate_size=config.ffn, attention_bias=False, mlp_bias=False)
    from transformers import MixtralConfig

    return MixtralConfig(
        **common,
        intermediate_size=config.expert_ffn,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.top_k,
        router_aux_loss_coef=config.aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


# ------------------------------------------------------------------------------ state dicts

# fivefold name suffix inside a layer -> Hugging Face suffix inside `model.layers.i.`
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
# Per-expert matrices in Mixtral checkpoint files: w1 = gate, w3 = up, w2 = down.
_FILE_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def _layer_state_from_hf(hf: Mapping[str, torch.Tensor], i: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    prefix, out = f"model.layers.{i}.", {}
    for ours, theirs in _LAYER_NAMES.items():
        if ours.startswith("mlp.") and config.is_moe_layer(i):
            continue
        out[f"layers.{i}.{ours}"] = _need(hf, prefix + theirs)
    if config.is_moe_layer(i):
        out.update(_experts_from_hf(hf, i, config))
    return out


def _experts_from_hf(hf: Mapping[str, torch.Tensor], i: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Router and stacked experts of layer i, from either Mixtral naming."""
    ours, p = f"layers.{i}.mlp.", f"model.layers.{i}."
    E, f = config.num_experts, config.expert_ffn
    out = {ours + f"router.{EXPERT_BIAS}": torch.zeros(E)}
    if p + "mlp.experts.gate_up_proj" in hf:  # transformers >= 5 module names
        out[ours + "router.gate.weight"] = _need(hf, p + "mlp.gate.weight")
        gate_up = hf[p + "mlp.experts.gate_up_proj"]  # (E, 2f, h)
        out[ours + "experts.gate"] = gate_up[:, :f].contiguous()
        out[ours + "experts.up"] = gate_up[:, f:].contiguous()
        out[ours + "experts.down"] = _need(hf, p + "mlp.experts.down_proj")
        return out
    moe = p + "block_sparse_moe."
    out[ours + "router.gate.weight"] = _need(hf, moe + "gate.weight")
    for kind, w in _FILE_EXPERT.items():
        out[ours + "experts." + kind] = torch.stack([_need(hf, f"{moe}experts.{e}.{w}.weight") for e in range(E)])
    return out


def _need(hf: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in hf:
        raise HFConversionError(f"the Hugging Face weights have no {key!r}; is this the right model folder?")
    return hf[key]


def state_dict_from_hf(hf_state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """fivefold's full state dict (names of `Transformer(config)`) from Hugging Face weights."""
    state = {"embed.weight": _need(hf_state, "model.embed_tokens.weight"), "norm.weight": _need(hf_state, "model.norm.weight")}
    if not config.tied_embeddings:
        state["head.weight"] = _need(hf_state, "lm_head.weight")
    for i in range(config.layers):
        state.update(_layer_state_from_hf(hf_state, i, config))
    return state


def _experts_to_hf(state: Mapping[str, torch.Tensor], i: int, config: ModelConfig, fused: bool) -> dict[str, torch.Tensor]:
    ours, p = f"layers.{i}.mlp.", f"model.layers.{i}."
    gate, up, down = state[ours + "experts.gate"], state[ours + "experts.up"], state[ours + "experts.down"]
    if fused:
        return {
            p + "mlp.gate.weight": state[ours + "router.gate.weight"],
            p + "mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1),  # (E, 2f, h)
            p + "mlp.experts.down_proj": down,
        }
    moe = p + "block_sparse_moe."
    out = {moe + "gate.weight": state[ours + "router.gate.weight"]}
    for kind, stacked in (("gate", gate), ("up", up), ("down", down)):
        for e in range(config.num_experts):
            out[f"{moe}experts.{e}.{_FILE_EXPERT[kind]}.weight"] = stacked[e].contiguous()
    return out


def state_dict_to_hf(
    state: Mapping[str, torch.Tensor], config: ModelConfig, naming: str = "files"
) -> dict[str, torch.Tensor]:
    """Hugging Face weights from fivefold's full state dict.

    naming="files": the checkpoint-file names every transformers version loads (per-expert
    Mixtral matrices; no lm_head.weight when tied). naming="module": the parameter names of
    the installed transformers >= 5 modules (fused experts), for `model.load_state_dict`.
    """
    if naming not in ("files", "module"):
        raise ValueError(f"naming must be 'files' or 'module', got {naming!r}")
    _check_exportable(config)
    out = {theirs: state[ours] for ours, theirs in _TOP_NAMES.items() if ours in state}
    if config.tied_embeddings and naming == "module":
        out["lm_head.weight"] = state["embed.weight"]
    for i in range(config.layers):
        for ours, theirs in _LAYER_NAMES.items():
            if ours.startswith("mlp.") and config.is_moe_layer(i):
                continue
            out[f"model.layers.{i}.{theirs}"] = state[f"layers.{i}.{ours}"]
        if config.is_moe_layer(i):
            out.update(_experts_to_hf(state, i, config, fused=naming == "module"))
    return out


# ---------------------------------------------------------------------------------- folders


def read_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, fivefold full state) from a Hugging Face model folder (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not config_path.is_file() or not files:
        raise HFConversionError(f"{folder} is not a Hugging Face model folder: it needs config.json and *.safetensors")
    try:
        hf_config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise HFConversionError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(hf_config, dict):
        raise HFConversionError(f"{config_path} must hold a JSON object")
    config = config_from_hf(hf_config, name=folder.name)
    hf_state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            hf_state.update(load_file(str(path)))
        except Exception as err:  # safetensors raises its own error types for a malformed file
            raise HFConversionError(f"{path} cannot be read as safetensors: {err}") from None
    state = state_dict_from_hf(hf_state, config)
    return config, {k: v.float().contiguous() for k, v in state.items()}


def write_hf_folder(state: Mapping[str, torch.Tensor], config: ModelConfig, folder: str | Path,
                    step: int | None = None, max_file_bytes: int | None = None,
                    bos_id: int | None = None, eos_id: int | None = None) -> Path:
    """Write config.json and the weights (one model.safetensors, or a sharded set with its index, as
    `save_pretrained` writes them) that `AutoModelForCausalLM.from_pretrained` loads.

    `bos_id` / `eos_id` are the training tokenizer's; None writes null rather than transformers'
    Llama defaults (1, 2), which would name ordinary tokens of another tokenizer."""
    from .sets import DEFAULT_MAX_FILE_BYTES, write_set

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = hf_config_from(config)
    hf_config.architectures = ["MixtralForCausalLM" if config.is_moe else "LlamaForCausalLM"]
    hf_config.dtype = "float32"
    hf_config.bos_token_id, hf_config.eos_token_id = bos_id, eos_id
    hf_config.save_pretrained(str(folder))
    tensors = {k: v.detach().float().contiguous() for k, v in state_dict_to_hf(state, config).items()}
    write_set(folder, tensors, step=step, max_file_bytes=max_file_bytes or DEFAULT_MAX_FILE_BYTES)
    return folder
