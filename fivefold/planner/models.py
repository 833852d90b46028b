"""Preset model shapes (the runtime's presets, and planner-only layers) and loading a `ModelSpec`
from a JSON or TOML file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from ..config import load_config, preset_names
from .bridge import model_spec
from .errors import PlanError, UnknownNameError, choices
from .spec import ModelSpec

# Planner-only shapes: layers the runtime does not train. Every other preset is the runtime's
# own (fivefold/config/presets/*.toml, with their sources), planned at its context length.
_PLANNER_ONLY: dict[str, ModelSpec] = {
    # GPT-3 175B: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
    # (96 layers, d_model 12288, 96 heads, context 2048); vocabulary 51200 as padded by
    # Megatron-LM (Narayanan et al. 2021, Table 1 uses V = 51,200).
    "gpt3-175b": ModelSpec(name="gpt3-175b", arch="gpt", layers=96, hidden=12288, heads=96,
                           vocab=51200, seq_len=2048),
    # DeepSeek-V3: arXiv 2412.19437, Section 4.2 (61 layers, the first 3 dense, hidden 7168,
    # 128 heads, MLA with q_lora 1536, kv_lora 512, per-head 128 + 64 rotary for q/k and 128
    # for v, 1 shared + 256 routed experts of width 2048, top-8, at most 4 nodes per token,
    # vocabulary 129K) and its Hugging Face config (vocab 129280, dense width 18432). The
    # multi-token-prediction module is not counted (the 671B/37B the paper gives exclude it).
    "deepseek-v3": ModelSpec(name="deepseek-v3", arch="llama", layers=61, hidden=7168, heads=128,
                             vocab=129280, seq_len=4096, ffn_hidden=18432, num_experts=256, top_k=8,
                             expert_ffn_hidden=2048, shared_experts=1, first_dense_layers=3,
                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                             v_head_dim=128, route_nodes=4),
}


def _runtime_presets() -> dict[str, ModelSpec]:
    """The runtime's presets as the planner sees them (`bridge.model_spec`), at `max_seq_len`."""
    presets = {}
    for name in preset_names():
        model = load_config(name).model
        presets[name] = model_spec(model, model.max_seq_len)
    return presets


_PRESETS: dict[str, ModelSpec] = {**_runtime_presets(), **_PLANNER_ONLY}
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
