"""Preset model shapes and loading a `ModelSpec` from a JSON or TOML file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from .errors import PlanError, UnknownNameError, choices
from .spec import ModelSpec

_PRESETS: dict[str, ModelSpec] = {
    # Llama 3 8B/70B/405B: Llama Team 2024, "The Llama 3 Herd of Models", Table 3
    # (layers, model dimension, FFN dimension, heads, key/value heads, vocabulary 128,256),
    # pre-training sequence length 8,192 (Section 3.4.1). Untied input/output embeddings.
    "llama3-8b": ModelSpec(name="llama3-8b", arch="llama", layers=32, hidden=4096, heads=32,
                           kv_heads=8, ffn_hidden=14336, vocab=128256, seq_len=8192),
    "llama3-70b": ModelSpec(name="llama3-70b", arch="llama", layers=80, hidden=8192, heads=64,
                            kv_heads=8, ffn_hidden=28672, vocab=128256, seq_len=8192),
    "llama3-405b": ModelSpec(name="llama3-405b", arch="llama", layers=126, hidden=16384,
                             heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256, seq_len=8192),
    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts", Table 1 (dim 4096, 32 layers,
    # head_dim 128, 32 heads, 8 KV heads, hidden_dim 14336, vocab 32000, context 32768,
    # 8 experts, top-2 routing in every layer).
    "mixtral-8x7b": ModelSpec(name="mixtral-8x7b", arch="llama", layers=32, hidden=4096,
                              heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                              seq_len=32768, num_experts=8, top_k=2, expert_ffn_hidden=14336),
    # DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Section 4.2: 61 layers,
    # hidden 7168, 128 attention heads, the first 3 layers dense (FFN 18432, from the
    # released config), then MoE layers with 1 shared + 256 routed experts of width 2048,
    # 8 active; vocabulary 129K (129280 in the released config); pre-training sequence
    # length 4K. Multi-head latent attention is approximated here as standard multi-head
    # attention with 128 heads of dimension 7168/128 = 56 (4h^2 weights per layer instead
    # of MLA's low-rank projections), so counts differ from the published 671B/37B by a few %.
    "deepseek-v3": ModelSpec(name="deepseek-v3", arch="llama", layers=61, hidden=7168,
                             heads=128, ffn_hidden=18432, vocab=129280, seq_len=4096,
                             num_experts=256, top_k=8, expert_ffn_hidden=2048,
                             shared_experts=1, first_dense_layers=3),
    # GPT-3 175B: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
    # (96 layers, d_model 12288, 96 heads, context 2048); vocabulary 51200 as padded by
    # Megatron-LM (Narayanan et al. 2021, Table 1 uses V = 51,200).
    "gpt3-175b": ModelSpec(name="gpt3-175b", arch="gpt", layers=96, hidden=12288, heads=96,
                           vocab=51200, seq_len=2048),
}

MODELS: Mapping[str, ModelSpec] = MappingProxyType(_PRESETS)
_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec))


def model_from_dict(data: Mapping, name: str = "custom") -> ModelSpec:
    """Build a `ModelSpec` from a mapping of its field names; reject unknown fields."""
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise UnknownNameError(f"unknown ModelSpec field(s) {choices(unknown)}; valid fields: {choices(_FIELDS)}")
    missing = [f for f in ("layers", "hidden", "heads", "vocab") if f not in data]
    if missing:
        raise PlanError(f"model description lacks required field(s) {choices(missing)}")
    kwargs = dict(data)
    kwargs.setdefault("name", name)
    try:
        return ModelSpec(**kwargs)
    except TypeError as exc:
        raise PlanError(f"bad model description: {exc}") from None


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name (see `MODELS`) or a path to a ``.json`` / ``.toml`` file of fields.

    A TOML file may put the fields at top level or under a ``[model]`` table.
    """
    key = str(name_or_path)
    if key.lower() in _PRESETS:
        return _PRESETS[key.lower()]
    path = Path(key)
    if not path.suffix or not path.exists():
        raise UnknownNameError(f"unknown model {key!r}: use a preset ({choices(_PRESETS)}) "
                               "or the path of a .json/.toml file with ModelSpec fields")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".toml":
            data = _load_toml(text)
            data = data.get("model", data)
        elif path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise PlanError(f"model file {path} must end in .json or .toml")
    except (ValueError, TypeError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"cannot parse model file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"model file {path} must hold a table/object of ModelSpec fields")
    return model_from_dict(data, name=path.stem)


def _load_toml(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise PlanError("reading TOML needs Python 3.11+ (tomllib) or the tomli package") from None
    return tomllib.loads(text)
