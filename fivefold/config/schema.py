"""Configuration: plain dataclasses loaded from TOML presets and overridden by dotted flags.

A run is described by one `Config` holding four sections: `model`, `layout`, `train`, `data`
(plus `checkpoint`). Every key is checked: an unknown key or a value of the wrong type is
rejected with its full dotted path and what is allowed, so a typo never silently falls back
to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message says what to change."""


FFN_MULTIPLE = 64  # the default SwiGLU width is rounded up to a multiple of this


def default_ffn_hidden(hidden: int) -> int:
    """The SwiGLU width of a layer whose `ffn_hidden` is unset: 2/3 of 4 * hidden (the
    parameters of a 4h GeLU MLP), rounded up to a multiple of `FFN_MULTIPLE`. Llama's
    reference code rounds to 256; the presets of real models set their width explicitly,
    so the rounding only shapes small models, and the planner plans with this rule too."""
    raw = int(8 * hidden / 3)
    return FFN_MULTIPLE * -(-raw // FFN_MULTIPLE)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder, optionally with Mixture-of-Experts layers."""

    name: str = "custom"
    vocab_size: int = 256
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 0  # 0: same as heads (multi-head attention)
    ffn_hidden: int = 0  # 0: `default_ffn_hidden(hidden)`
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    init_std: float = 0.02
    # Mixture of Experts; num_experts == 0 means a dense model.
    num_experts: int = 0
    top_k: int = 2
    moe_every: int = 1  # layer i is MoE when i % moe_every == moe_every - 1
    first_dense_layers: int = 0  # layers below this index stay dense (DeepSeek-V3 style)
    expert_ffn_hidden: int = 0  # 0: same as ffn_hidden
    shared_experts: int = 0
    router: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3 scores with a balancing bias)
    renormalize: bool = True  # renormalise the top-k weights to sum to one
    dropless: bool = True  # no token is dropped; otherwise each expert takes at most its capacity
    capacity_factor: float = 1.25  # capacity per sequence = ceil(factor * seq_len * top_k / num_experts)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.0  # auxiliary-loss-free balancing step (sigmoid router only)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or default_ffn_hidden(self.hidden)

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden or self.ffn

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        if not self.is_moe or index < self.first_dense_layers:
            return False
        return index % self.moe_every == self.moe_every - 1


@dataclass(frozen=True)
class Layout:
    """How a run is split over devices. Validated against the model by `fivefold.rules.layout`."""

    dp: int = 1
    # Hybrid sharding (HSDP): ZeRO shards over groups of dp_shard data-parallel ranks (times cp)
    # and the dp / dp_shard groups are replicas of each other; 0 shards over all of dp.
    dp_shard: int = 0
    zero: int = 0
    # ZeRO-3: gather each unit's parameters around every micro-batch's forward and backward
    # ("micro_batch"), or once per step, kept gathered across its micro-batches ("step": fewer
    # all-gathers, the full parameters held through the step).
    zero3_gather: str = "micro_batch"
    tp: int = 1
    sequence_parallel: bool = False
    tp_overlap: bool = False  # backward: tp input-gradient collectives overlap the weight-gradient matmuls
    pp: int = 1
    vpp: int = 1
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved, zb-h1
    pp_layers: tuple[int, ...] = ()  # explicit layers per stage (overrides balancing)
    ep: int = 1
    cp: int = 1
    cp_algorithm: str = "ring"  # allgather, ring, ulysses
    micro_batch: int = 0  # samples per micro-batch per data-parallel rank; 0: derived
    grad_accum: int = 0  # micro-batches per step; 0: derived from global batch and micro_batch
    recompute: str = "none"  # none, selective (attention core), full (whole layer)
    bucket_mb: float = 25.0  # gradient bucket size for data parallel

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shard_degree(self) -> int:
        """Data-parallel ranks that one ZeRO shard group spans (cp aside): dp_shard, or all of dp."""
        return self.dp_shard or self.dp

    @property
    def replicate_degree(self) -> int:
        """How many replicas of each ZeRO shard group there are (1: flat ZeRO)."""
        return self.dp // self.shard_degree if self.dp % self.shard_degree == 0 else 1


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step, the same in every layout
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    dtype: str = "fp32"  # compute: fp32, or bf16 (autocast; fp32 weights unless param_dtype says otherwise)
    param_dtype: str = "fp32"  # parameters and gradients: fp32, or bf16 (fp32 master weights in the optimizer)
    reduce_dtype: str = ""  # data-parallel gradient sums: fp32 or bf16; empty: param_dtype
    seed: int = 1234
    eval_interval: int = 50  # 0 disables validation
    eval_batches: int = 4
    log_interval: int = 1
    device: str = "auto"  # auto, cpu, cuda
    run_dir: str = ""  # empty: a new folder under runs/
    trace: bool = False  # record a per-rank timeline of one step (Gantt PNG + Chrome trace)
    compile: bool = False  # torch.compile each transformer block's computation (regional compilation)
    profile: tuple[int, ...] = ()  # steps to record with torch.profiler (RUN_DIR/profile/)
    drift_margin: float = 0.25  # warn when a measurement is off the planner's prediction by more (ratio)
    # Fault handling of multi-process jobs (fivefold/job/launch.py, the watchdog in parallel/comm.py).
    max_restarts: int = 0  # restarts from the last checkpoint after a rank fails
    collective_timeout_s: float = 300.0  # a collective unfinished this long ends the job with a report
    stop_grace_s: float = 30.0  # after Ctrl-C/SIGTERM: time to checkpoint and exit before SIGKILL
    # glibc's allocator in every rank (fivefold/job/malloc.py): "default" (glibc's own thresholds) or
    # "retain" (freed memory stays with the process, no page faults to get it back); no effect elsewhere
    malloc: str = "default"
    # torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 in every rank
    # (fivefold/job/determinism.py): run-to-run identical bits on one machine, at some speed
    deterministic: bool = False


@dataclass(frozen=True)
class DataConfig:
    # "embedded", a .txt/.jsonl file or a folder of them, a prepared dataset (`fivefold data
    # prepare`), or a blend of prepared datasets as "weight path weight path ..." (Megatron's form)
    source: str = "embedded"
    tokenizer: str = "bytes"  # "bytes", or a path to a Hugging Face tokenizer.json
    val_fraction: float = 0.05
    jsonl_field: str = "text"
    document_mask: bool = False  # prepared data: attention stays inside each packed document


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 0  # steps between checkpoints; 0: only the final weights
    keep: int = 3
    resume: bool = False


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: Layout = field(default_factory=Layout)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check and convert one value against its field's annotation."""
    hint = annotation if not isinstance(annotation, str) else eval(annotation, vars(typing), {})
    origin = typing.get_origin(hint)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list of integers, got {value!r}")
        return tuple(_coerce(f"{path}[{i}]", v, int) for i, v in enumerate(value))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value))
        except ValueError:
            raise ConfigError(f"{path}: expected an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
    if hint is str:
        return str(value)
    raise ConfigError(f"{path}: unsupported field type {hint!r}")


def _merge_section(section: str, current: Any, values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(current)}
    updates = {}
    for key, value in values.items():
        path = f"{section}.{key}"
        if key not in fields:
            raise ConfigError(f"unknown key '{path}'{did_you_mean(key, fields, section + '.')}; "
                              f"{section} accepts: {', '.join(sorted(fields))}")
        updates[key] = _coerce(path, value, fields[key].type)
    return dataclasses.replace(current, **updates)


def did_you_mean(name: str, known: typing.Iterable[str], prefix: str = "") -> str:
    """" (did you mean 'PREFIX+closest'?)" for a misspelled name, or "" when nothing is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def merge(config: Config, values: dict[str, Any]) -> Config:
    """Merge a nested dict ({"model": {...}, ...}) into `config`, checking every key."""
    sections = {}
    for section, body in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section '{section}'{did_you_mean(section, SECTIONS)}; "
                              f"use one of: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"'{section}' must be a table of keys, got {body!r}")
        sections[section] = _merge_section(section, getattr(config, section), body)
    return config.replace(**sections)


def resolve_preset(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if not path.is_file():
            raise ConfigError(f"config {path} is a directory, not a file; give a .toml file or a preset name")
        return path
    preset = PRESET_DIR / f"{name_or_path}.toml"
    if not preset.exists():
        raise ConfigError(
            f"no preset named '{name_or_path}'; presets: {', '.join(preset_names())}, or give a .toml path"
        )
    return preset


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror}") from None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ["train.steps=50", "layout.tp=2"] into a nested dict of strings."""
    nested: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override '{pair}' must look like section.key=value")
        dotted, value = pair.split("=", 1)
        parts = dotted.strip().lstrip("-").split(".")
        if len(parts) != 2:
            raise ConfigError(f"override '{dotted}' must be section.key, e.g. train.steps")
        nested.setdefault(parts[0], {})[parts[1]] = value
    return nested


def load_config(name_or_path: str | None = "small", overrides: list[str] | None = None) -> Config:
    """Load a preset (or TOML file), then apply dotted `section.key=value` overrides."""
    config = Config()
    if name_or_path:
        config = merge(config, load_toml(resolve_preset(name_or_path)))
    return with_overrides(config, overrides or [])


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """`config` with dotted `section.key=value` overrides applied; every key and value checked."""
    if overrides:
        config = merge(config, parse_overrides(overrides))
    return check_values(config)


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config saved with `Config.to_dict` (e.g. next to saved weights)."""
    if not isinstance(values, dict):
        raise ConfigError(f"a saved config must be a table of sections, got {type(values).__name__}")
    return check_values(merge(Config(), values))


# ------------------------------------------------------------------------------- value ranges
# Ranges of single keys. Checks that relate keys to each other or to the layout (heads and
# kv_heads, top_k and num_experts, capacity_factor when tokens are dropped, ...) live in
# fivefold.rules.layout.validate, which runs before any process starts.

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")  # becomes a folder name under runs/
DEVICES = ("auto", "cpu", "cuda")
MALLOC_SETTINGS = ("default", "retain")  # train.malloc, applied by fivefold/job/malloc.py
SEED_LIMIT = 2**31  # seeds are combined with step and epoch numbers into 64-bit generator seeds


def _at_least(low: int) -> tuple[typing.Callable[[Any], bool], str]:
    return (lambda v: v >= low), f"at least {low}"


def _positive() -> tuple[typing.Callable[[Any], bool], str]:
    return (lambda v: v > 0), "greater than 0"


def _below_one() -> tuple[typing.Callable[[Any], bool], str]:
    return (lambda v: 0 <= v < 1), "in [0, 1)"


RANGES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "model.vocab_size": _at_least(1),
    "model.hidden": _at_least(1),
    "model.layers": _at_least(1),
    "model.heads": _at_least(1),
    "model.kv_heads": _at_least(0),
    "model.ffn_hidden": _at_least(0),
    "model.max_seq_len": _at_least(1),
    "model.rope_theta": _positive(),
    "model.norm_eps": _positive(),
    "model.init_std": _at_least(0),
    "model.num_experts": _at_least(0),
    "model.first_dense_layers": _at_least(0),
    "model.expert_ffn_hidden": _at_least(0),
    "model.shared_experts": _at_least(0),
    "model.aux_loss_coef": _at_least(0),
    "model.z_loss_coef": _at_least(0),
    "model.bias_update_rate": _at_least(0),
    "train.steps": _at_least(1),
    "train.global_batch": _at_least(1),
    "train.seq_len": _at_least(1),
    "train.lr": _positive(),
    "train.min_lr": _at_least(0),
    "train.warmup_steps": _at_least(0),
    "train.weight_decay": _at_least(0),
    "train.beta1": _below_one(),
    "train.beta2": _below_one(),
    "train.eps": _positive(),
    "train.grad_clip": _at_least(0),
    "train.seed": ((lambda v: 0 <= v < SEED_LIMIT), f"in [0, {SEED_LIMIT})"),
    "train.eval_interval": _at_least(0),
    "train.eval_batches": _at_least(1),
    "train.log_interval": _at_least(1),
    "train.device": ((lambda v: v in DEVICES), f"one of {', '.join(DEVICES)}"),
    "train.malloc": ((lambda v: v in MALLOC_SETTINGS), f"one of {', '.join(MALLOC_SETTINGS)}"),
    "train.drift_margin": _at_least(0),
    "train.max_restarts": _at_least(0),  # restarts after a failed rank
    "train.collective_timeout_s": _positive(),  # seconds a collective may wait before the watchdog stops the job
    "train.stop_grace_s": _at_least(0),  # seconds ranks get to checkpoint after SIGINT/SIGTERM  # a ratio: how far measurement may drift from the prediction
    "data.val_fraction": ((lambda v: 0 < v < 0.5), "in (0, 0.5)"),
    "checkpoint.interval": _at_least(0),
    "checkpoint.keep": _at_least(1),
    "model.name": (
        (lambda v: bool(SAFE_NAME.match(v)) and ".." not in v),
        "a plain name of letters, digits, '.', '_' and '-' (it names the run folder under runs/; "
        "no path separators or '..')",
    ),
}


def _flat_values(config: Config) -> Iterator[tuple[str, Any]]:
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, section.name)):
            yield f"{section.name}.{f.name}", getattr(getattr(config, section.name), f.name)


def check_values(config: Config) -> Config:
    """Reject a value outside its key's range (and any NaN or infinite number); return `config`."""
    for key, value in _flat_values(config):
        if value is None:
            raise ConfigError(f"{key} has no value")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number")
        if key not in RANGES:
            continue
        allowed, text = RANGES[key]
        try:
            ok = allowed(value)
        except TypeError:  # a value built in code, not through merge(): e.g. a string for a number
            raise ConfigError(f"{key}={value!r} has the wrong type") from None
        if not ok:
            raise ConfigError(f"{key}={value!r} is out of range: it must be {text}")
    return config
