"""Configuration: the frozen values a run is described by, and the TOML presets they load from.

`schema.py` holds `Config` and its sections (`ModelConfig`, `Layout`, `TrainConfig`,
`DataConfig`, `CheckpointConfig`), loading with dotted overrides, and every range check;
`presets/` holds the presets (`tiny`, `small`, the MoE variants, and real model shapes for
the planner). Nothing here imports torch.
"""

from .schema import (
    DEVICES,
    MALLOC_SETTINGS,
    PRESET_DIR,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    Layout,
    ModelConfig,
    TrainConfig,
    check_values,
    config_from_dict,
    default_ffn_hidden,
    load_config,
    merge,
    parse_overrides,
    preset_names,
    with_overrides,
)

__all__ = [
    "DEVICES", "MALLOC_SETTINGS", "PRESET_DIR", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
    "Layout", "ModelConfig", "TrainConfig", "check_values", "config_from_dict", "default_ffn_hidden",
    "load_config", "merge", "parse_overrides", "preset_names", "with_overrides",
]
