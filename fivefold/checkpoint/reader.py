"""Reading a committed checkpoint: whether it holds this model, and the region of each tensor a
rank needs, assembled from the stored shards.

Trust
-----
A checkpoint folder may come from elsewhere, so nothing in it is trusted before it is
checked: every file a manifest names must be a plain file name inside the folder (see
`fivefold.checkpoint.format.check_manifest_fields`), every entry's shapes must be those of
the configured model (before anything is allocated), and every stored tensor's shape and
dtype (read from the safetensors header) must match its entry before it is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import Config, ModelConfig, config_from_dict
from ..parallel.sharding import Placement, ShardSpec
from .errors import CheckpointError, CorruptCheckpoint, IncompatibleCheckpoint
from .format import MANIFEST, rank_file, sha256_file
from .regions import assemble, bounds, intersect
from .state import spec_of

_STATE_DTYPES = ("F32", "F64", "BF16", "F16")  # parameters and optimizer state are floating point


def architecture(model: ModelConfig) -> dict[str, Any]:
    """What fixes the names and shapes of a model's tensors."""
    return {
        "vocab_size": model.vocab_size, "hidden": model.hidden, "layers": model.layers, "heads": model.heads,
        "kv_heads": model.n_kv_heads, "ffn": model.ffn, "tied_embeddings": model.tied_embeddings,
        "num_experts": model.num_experts, "expert_ffn": model.expert_ffn if model.is_moe else 0,
        "shared_experts": model.shared_experts if model.is_moe else 0,
        "moe_layers": [i for i in range(model.layers) if model.is_moe_layer(i)],
    }


def check_compatible(manifest: dict[str, Any], config: Config, path: Path) -> list[str]:
    """Raise if the checkpoint holds another model; return notes on other settings that differ."""
    try:
        saved = config_from_dict(manifest["config"])
    except ValueError as err:
        raise IncompatibleCheckpoint(f"{path} holds a config this version cannot use: {err}") from None
    ours, theirs = architecture(config.model), architecture(saved.model)
    diffs = [f"{k}: checkpoint {theirs[k]} vs config {ours[k]}" for k in ours if ours[k] != theirs[k]]
    if diffs:
        raise IncompatibleCheckpoint(f"{path} was saved for a different model ({'; '.join(diffs)})")
    notes = []
    for section in ("model", "train", "checkpoint"):
        old, new = manifest["config"].get(section, {}), config.to_dict()[section]
        notes += [f"{section}.{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items()
                  if old.get(k) != v and k not in NOT_SETTINGS and not isinstance(v, (list, tuple))]
    return notes


# Keys that name the run rather than set how it trains (checkpoint.resume is how it was started).
NOT_SETTINGS = ("name", "run_dir", "resume")


def check_model_fits(model: ModelConfig, source: Path) -> None:
    """Refuse a saved config whose full fp32 weights exceed this machine's memory, before sizing
    any tensor: a forged config must not make the reader build or allocate an impossible model."""
    from ..observe.metrics import machine_memory_bytes
    from ..rules.params import total_params
    from ..rules.precision import PrecisionPolicy

    needed = total_params(model) * PrecisionPolicy().param_bytes  # the reader builds fp32 tensors
    available, what = machine_memory_bytes("cpu")
    if needed > available:
        raise IncompatibleCheckpoint(
            f"{source} describes a model of {total_params(model):,} parameters ({needed / 1e9:,.1f} GB of "
            f"weights), more than this machine's {available / 1e9:,.1f} GB of {what}"
        )


class CheckpointReader:
    """Reads the region of a tensor a rank needs from the shards of a committed checkpoint."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest = Path(path), manifest
        self.by_tensor: dict[tuple[str, str], list[tuple[str, str, ShardSpec]]] = {}
        for e in manifest["entries"]:
            self.by_tensor.setdefault((e["name"], e["state"]), []).append((e["file"], e["key"], ShardSpec.from_json(e)))
        self._handles: dict[str, Any] = {}
        try:
            self.model_config = config_from_dict(manifest["config"]).model
        except ValueError as err:
            raise IncompatibleCheckpoint(f"{self.path} holds a config this version cannot use: {err}") from None
        self.skip_optimizer_state = False  # set for weights-only checkpoints: optimizer state stays fresh
        check_model_fits(self.model_config, self.path)
        self._check_shapes()

    def _check_shapes(self) -> None:
        """Every stored tensor must be one of the model's, with its shape: bounds what loading allocates."""
        from ..parallel.sharding import full_shapes

        expected = full_shapes(self.model_config)
        for (name, state), stored in self.by_tensor.items():
            if name not in expected:
                raise IncompatibleCheckpoint(f"{self.path} holds {state} of {name!r}, which the model does not have")
            for _, _, spec in stored:
                if tuple(spec.global_shape) != expected[name]:
                    raise IncompatibleCheckpoint(
                        f"{self.path} gives {name} shape {list(spec.global_shape)}, but its config's model "
                        f"has {list(expected[name])}"
                    )

    @property
    def has_optimizer(self) -> bool:
        return bool(self.manifest.get("has_optimizer"))

    def _open(self, file: str):
        from safetensors import safe_open

        if file in self._handles:
            return self._handles[file]
        path = self.path / file
        if sha256_file(path) != self.manifest["files"][file]["sha256"]:
            raise CorruptCheckpoint(f"{path} does not match its sha256 in the manifest: the file was altered")
        try:
            self._handles[file] = safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types for malformed headers
            raise CorruptCheckpoint(f"{path} cannot be read: {err}") from None
        return self._handles[file]

    def _load(self, file: str, key: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = _STATE_DTYPES) -> torch.Tensor:
        """Tensor `key` of `file`, after its header's shape and dtype were checked (nothing is read before)."""
        handle = self._open(file)
        if key not in handle.keys():
            raise CorruptCheckpoint(f"{self.path / file} lacks tensor {key!r} listed in the manifest")
        header = handle.get_slice(key)
        stored_shape, dtype = tuple(header.get_shape()), header.get_dtype()
        if stored_shape != tuple(shape) or dtype not in dtypes:
            raise CorruptCheckpoint(
                f"{self.path / file}: tensor {key!r} is {dtype} {list(stored_shape)}, the manifest says "
                f"{'/'.join(dtypes)} {list(shape)}"
            )
        return handle.get_tensor(key)

    def pieces(self, target: ShardSpec, state: str) -> Iterator[tuple[ShardSpec, torch.Tensor]]:
        """The stored shards of (target.name, state) that overlap the target region."""
        stored = self.by_tensor.get((target.name, state))
        if not stored:
            raise IncompatibleCheckpoint(f"{self.path} has no {state} of {target.name}")
        t_off, t_shape, _, _ = bounds(target)
        for file, key, spec in stored:
            if tuple(spec.global_shape) != tuple(target.global_shape):
                raise IncompatibleCheckpoint(
                    f"{target.name} has shape {list(spec.global_shape)} in {self.path}, the model needs {list(target.global_shape)}"
                )
            s_off, s_shape, _, _ = bounds(spec)
            if intersect(t_off, t_shape, s_off, s_shape) is not None:
                yield spec, self._load(file, key, spec.local_shape)

    def read_into(self, tensor: torch.Tensor, target: ShardSpec | Placement, state: str = "param") -> None:
        """Fill a local tensor (parameter, or optimizer state under `state`, e.g. "exp_avg")."""
        spec = spec_of(target, self.model_config)
        key = state if state == "param" or state.startswith("optim.") else f"optim.{state}"
        if key != "param" and self.skip_optimizer_state:
            return
        if tuple(tensor.shape) != tuple(spec.local_shape):
            raise CheckpointError(f"{spec.name}: local tensor {tuple(tensor.shape)} does not match its spec {spec.local_shape}")
        assemble(spec, list(self.pieces(spec, key)), tensor)

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        stored = self.by_tensor.get((name, state))
        if not stored:
            raise IncompatibleCheckpoint(f"{self.path} has no {state} of {name}")
        spec = ShardSpec.whole(name, stored[0][2].global_shape)
        out = torch.empty(spec.global_shape)
        assemble(spec, list(self.pieces(spec, state)), out)
        return out

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        """The generator states rank `rank` saved; set_rng_states checks their length."""
        kinds = self.manifest["rng"].get(str(rank), [])
        file = rank_file(rank)
        if kinds and file not in self.manifest["files"]:
            raise CorruptCheckpoint(f"{self.path / MANIFEST} lists rng states of rank {rank} but not its file")
        states = {}
        for kind in kinds:
            key = f"rng/{kind}"
            handle = self._open(file)
            shape = tuple(handle.get_slice(key).get_shape()) if key in handle.keys() else ()
            states[kind] = self._load(file, key, shape if len(shape) == 1 else (-1,), ("U8",))
        return states
