"""Hugging Face export and import (`fivefold convert`), and the full weights of a run.

Export assembles the full tensors of a run's newest checkpoint (any layout) or of its final
`model.safetensors` and writes a folder `transformers` loads; import turns a Hugging Face
Llama/Mixtral folder into a new run directory whose step 0 holds the weights only, so that
fine-tuning starts with a fresh optimizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import Config, ModelConfig, check_values, config_from_dict
from ..parallel.sharding import ShardSpec
from .errors import CheckpointError, CorruptCheckpoint
from .format import (
    MANIFEST,
    checkpoint_root,
    commit,
    list_checkpoints,
    read_manifest,
    staging_dir,
    step_dir,
    write_rank_files,
)
from .reader import CheckpointReader, check_model_fits
from .state import RUNTIME_BUFFERS


def find_checkpoint(path: Path, step: int | None = None) -> Path | None:
    """A checkpoint directory itself, or the newest (or given-step) complete one of a run directory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    for candidate in list_checkpoints(checkpoint_root(path)):
        if step is not None and candidate != step_dir(checkpoint_root(path), step):
            continue
        try:
            read_manifest(candidate)
            return candidate
        except CorruptCheckpoint as err:
            print(f"warning: skipping {candidate}: {err}")
    if step is not None:
        raise CheckpointError(f"{path} has no usable checkpoint of step {step}")
    return None


def _read_run_config(path: Path) -> Config:
    try:
        return config_from_dict(json.loads(path.read_text()))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not the config.json of a run: {err}") from None


def _read_weights(path: Path, config: Config) -> dict[str, torch.Tensor]:
    """The saved tensors, after their shapes (from the file header) were checked against the config."""
    from safetensors import safe_open

    from ..parallel.sharding import full_shapes

    expected = {n: s for n, s in full_shapes(config.model).items() if not n.endswith(RUNTIME_BUFFERS)}
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            problems = [f"{n}: file {list(shapes[n])}, config {list(s)}" for n, s in expected.items()
                        if n in shapes and shapes[n] != s]
            missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
            if problems or missing or unexpected:
                raise CheckpointError(f"{path} does not match the model in config.json: " + "; ".join(
                    problems[:3] + ([f"missing {missing[:5]}"] if missing else [])
                    + ([f"unexpected {unexpected[:5]}"] if unexpected else [])))
            return {key: handle.get_tensor(key) for key in shapes}
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own error types for a malformed file
        raise CheckpointError(f"{path} cannot be read as safetensors weights: {err}") from None


def read_final_weights(run_dir: Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The final weights a run saved (model.safetensors + config.json), checked against that config."""
    config = _read_run_config(Path(run_dir) / "config.json")
    check_model_fits(config.model, Path(run_dir) / "config.json")
    return config, _read_weights(Path(run_dir) / "model.safetensors", config)


def full_state_of_run(path: Path, step: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Full tensors of a run's newest checkpoint, or of its final model.safetensors."""
    from ..parallel.sharding import full_shapes

    found = find_checkpoint(path, step)
    if found is not None:
        manifest = read_manifest(found)
        reader = CheckpointReader(found, manifest)
        model_config = reader.model_config
        return model_config, {name: reader.read_full(name) for name in full_shapes(model_config)}
    if not ((Path(path) / "model.safetensors").is_file() and (Path(path) / "config.json").is_file()):
        raise CheckpointError(f"{path} has neither a checkpoint nor model.safetensors + config.json")
    config, state = read_final_weights(Path(path))
    return config.model, state


def check_export_target(out: Path) -> None:
    """Export writes only into a new or empty folder: never over a run or other files."""
    from ..job.rundir import existing_entries, looks_like_run

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; give a new or empty folder")
    if looks_like_run(out) or (out / MANIFEST).exists():
        raise CheckpointError(f"--out {out} holds a training run or checkpoint; export into a new or empty folder")
    if existing_entries(out):
        raise CheckpointError(f"--out {out} is not empty; export into a new or empty folder")


def export_hf(path: Path, out: Path, step: int | None = None) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors) from a run or checkpoint."""
    from .hf import write_hf_folder

    check_export_target(out)
    model_config, state = full_state_of_run(path, step)
    return write_hf_folder(state, model_config, out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def config_toml(config: Config) -> str:
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def import_hf(hf_dir: Path, run_dir: Path, base: str = "tiny") -> Path:
    """Start a run directory from Hugging Face weights: config.toml + a weights-only step 0.

    `fivefold train --config RUN/config.toml --run-dir RUN --resume` then fine-tunes them
    with a fresh optimizer. The training settings come from the preset `base`.
    """
    from ..config import load_config
    from .hf import read_hf_folder

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    root = checkpoint_root(run_dir)
    if list_checkpoints(root):
        raise CheckpointError(f"{run_dir} already has checkpoints; import into a new run directory")
    model_config, state = read_hf_folder(hf_dir)
    check_import_shapes(state, model_config, hf_dir)
    config = load_config(base)
    config = check_values(config.replace(model=model_config, train=_with(config.train, run_dir=str(run_dir))))
    run_dir.mkdir(parents=True, exist_ok=True)
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copy(hf_dir / "tokenizer.json", run_dir / "tokenizer.json")
        config = config.replace(data=_with(config.data, tokenizer=str(run_dir / "tokenizer.json")))
    (run_dir / "config.toml").write_text(config_toml(config))
    tmp = staging_dir(root, 0)
    tmp.mkdir(parents=True, exist_ok=True)
    write_rank_files(tmp, 0, [("param", ShardSpec.whole(n, tuple(t.shape)), t) for n, t in state.items()], {})
    meta = {"step": 0, "optimizer_steps": 0, "has_optimizer": False, "config": config.to_dict()}
    commit(tmp, step_dir(root, 0), 1, meta)
    return run_dir


def check_import_shapes(state: dict[str, torch.Tensor], model_config: ModelConfig, hf_dir: Path) -> None:
    """Every imported tensor must have the shape the config's model gives it, before a run starts from it."""
    from ..parallel.sharding import full_shapes

    expected = full_shapes(model_config)
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{hf_dir}: weight {name} has shape {list(tensor.shape)} but its config.json describes "
                f"{list(expected[name])}; the weights and config.json are from different models"
            )
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise CheckpointError(f"{hf_dir}: weights {unknown[:5]} are not part of the model its config.json describes")


def _with(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


def run_convert_cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="fivefold convert", description="Hugging Face export and import")
    sub = parser.add_subparsers(dest="direction", required=True)
    export = sub.add_parser("export", help="a run's newest checkpoint (or final weights) -> Hugging Face folder")
    export.add_argument("--run-dir", required=True, help="run directory or one checkpoint directory")
    export.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the newest)")
    export.add_argument("--out", required=True, help="folder to write config.json + model.safetensors to")
    imp = sub.add_parser("import", help="Hugging Face Llama/Mixtral folder -> starting weights of a new run")
    imp.add_argument("--hf", required=True, help="folder with config.json and *.safetensors")
    imp.add_argument("--run-dir", required=True, help="new run directory to create")
    imp.add_argument("--config", default="tiny", help="preset giving the training settings (default: tiny)")
    args = parser.parse_args(argv)
    if args.direction == "export":
        out = export_hf(Path(args.run_dir), Path(args.out), args.step)
        print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained)")
        return 0
    run_dir = import_hf(Path(args.hf), Path(args.run_dir), args.config)
    print(f"imported {args.hf} into {run_dir}; fine-tune with: "
          f"fivefold train --config {run_dir / 'config.toml'} --run-dir {run_dir} --resume")
    return 0
