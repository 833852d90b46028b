"""Hugging Face export and import (`fivefold convert`), and the full weights of a run.

Export takes a run's newest weights (by the step each holds: its newest checkpoint, assembled
from the shards of any layout, or its final weights) and writes a folder `transformers` loads;
import turns a Hugging Face Llama/Mixtral folder into a new run directory whose step 0 holds
the weights only, so that fine-tuning starts with a fresh optimizer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Config, ModelConfig, check_values, config_from_dict
from ..job.rundir import existing_entries
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
from .hf_tokenizer import ExportedTokenizer, export_tokenizer
from .reader import CheckpointReader, check_model_fits
from .sets import INDEX_FILE, SINGLE_FILE, TensorSet, describe
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


def _read_weights(found: TensorSet, config: Config) -> dict[str, torch.Tensor]:
    """The saved tensors, after their shapes (from the file headers) were checked against the config."""
    from ..parallel.sharding import full_shapes

    expected = {n: s for n, s in full_shapes(config.model).items() if not n.endswith(RUNTIME_BUFFERS)}
    where = describe(found)
    try:
        shapes = found.shapes()
        problems = [f"{n}: file {list(shapes[n])}, config {list(s)}" for n, s in expected.items()
                    if n in shapes and shapes[n] != s]
        missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
        if problems or missing or unexpected:
            raise CheckpointError(f"{where} does not match the model in config.json: " + "; ".join(
                problems[:3] + ([f"missing {missing[:5]}"] if missing else [])
                + ([f"unexpected {unexpected[:5]}"] if unexpected else [])))
        return found.read_all()
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own error types for a malformed file
        raise CheckpointError(f"{where} cannot be read as safetensors weights: {err}") from None


def final_weights_of(run_dir: Path) -> TensorSet | None:
    """The final weights a run saved (model.safetensors, or a sharded set with its index), if any."""
    return TensorSet.locate(Path(run_dir))


def read_final_weights(run_dir: Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The final weights a run saved and its config.json, checked against each other."""
    run_dir = Path(run_dir)
    config = _read_run_config(run_dir / "config.json")
    check_model_fits(config.model, run_dir / "config.json")
    found = final_weights_of(run_dir)
    if found is None:
        raise CheckpointError(f"{run_dir} has no final weights ({SINGLE_FILE} and {INDEX_FILE} are missing)")
    return config, _read_weights(found, config)


@dataclass(frozen=True)
class RunWeights:
    """Where a run's weights come from: a checkpoint directory or the final weights, and their step."""

    checkpoint: Path | None
    final: TensorSet | None
    step: int | None

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        return f"final weights {describe(self.final)}"


def newest_weights(path: Path, step: int | None = None) -> RunWeights:
    """The newest weights of a run: its newest checkpoint or its final weights, by the step each holds.

    A tie goes to the checkpoint, whose files carry checksums. Final weights written before
    they recorded their step are placed by their modification time against the checkpoint's.
    With `step`, the checkpoint of that step, else final weights holding it.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return RunWeights(path, None, None)
    final = _usable_final_weights(path)
    if step is not None:
        found = find_checkpoint(path, step) if _has_checkpoint_of(path, step) else None
        if found is not None:
            return RunWeights(found, None, step)
        if final is not None and final.step == step:
            return RunWeights(None, final, step)
        raise CheckpointError(f"{path} has no usable checkpoint of step {step}"
                              + (f" and its final weights hold step {final.step}" if final is not None else ""))
    checkpoint = find_checkpoint(path)
    if checkpoint is None and final is None:
        raise CheckpointError(f"{path} has neither a checkpoint nor final weights ({SINGLE_FILE} or {INDEX_FILE} "
                              f"with config.json); train it first (fivefold train --run-dir {path}) or give "
                              "--run-dir a checkpoint folder")
    if checkpoint is None:
        return RunWeights(None, final, final.step if final else None)
    checkpoint_step = int(read_manifest(checkpoint)["step"])
    if final is None or not _final_is_newer(final, checkpoint_step, checkpoint):
        return RunWeights(checkpoint, None, checkpoint_step)
    return RunWeights(None, final, final.step)


def _has_checkpoint_of(path: Path, step: int) -> bool:
    return step_dir(checkpoint_root(path), step).is_dir()


def steps_trained(path: Path) -> int:
    """The steps the newest weights of a run hold (checkpoint or final weights); 0 for a run with neither."""
    try:
        return newest_weights(path).step or 0
    except CheckpointError:
        return 0


def _usable_final_weights(path: Path) -> TensorSet | None:
    """The run's final weights if they and its config.json are there; unusable ones are skipped, said so."""
    try:
        found = final_weights_of(path)
    except CheckpointError as err:
        print(f"warning: skipping the final weights: {err}")
        return None
    if found is not None and not (path / "config.json").is_file():
        print(f"warning: skipping the final weights: {path / 'config.json'}, which describes their model, is missing")
        return None
    return found


def _final_is_newer(final: TensorSet, checkpoint_step: int, checkpoint: Path) -> bool:
    if final.step is not None:
        return final.step > checkpoint_step
    newest_file = max(p.stat().st_mtime for p in final.paths)
    return newest_file > (checkpoint / MANIFEST).stat().st_mtime


def full_state_of_run(path: Path, step: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Full tensors of a run's newest weights: its newest checkpoint or its final weights, whichever is newer."""
    return _full_state(newest_weights(path, step))


def _full_state(source: RunWeights) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from ..parallel.sharding import full_shapes

    if source.checkpoint is not None:
        reader = CheckpointReader(source.checkpoint, read_manifest(source.checkpoint))
        model_config = reader.model_config
        return model_config, {name: reader.read_full(name) for name in full_shapes(model_config)}
    assert source.final is not None
    config = _read_run_config(source.final.folder / "config.json")
    check_model_fits(config.model, source.final.folder / "config.json")
    return config.model, _read_weights(source.final, config)


def _tokenizer_of(source: RunWeights) -> str:
    """The `data.tokenizer` the weights were trained with (checked by _full_state already)."""
    if source.checkpoint is not None:
        return str(read_manifest(source.checkpoint)["config"].get("data", {}).get("tokenizer", "bytes"))
    assert source.final is not None
    return _read_run_config(source.final.folder / "config.json").data.tokenizer


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


def export_hf(path: Path, out: Path, step: int | None = None) -> tuple[Path, RunWeights]:
    """Write a Hugging Face folder from a run's newest weights (or a checkpoint); returns it and the source."""
    return export_hf_with_tokenizer(path, out, step)[:2]


def export_hf_with_tokenizer(path: Path, out: Path, step: int | None = None) -> tuple[Path, RunWeights, ExportedTokenizer]:
    """export_hf, also writing the run's tokenizer; config.json's BOS/EOS ids are that tokenizer's."""
    from .hf import write_hf_folder

    check_export_target(out)
    source = newest_weights(path, step)
    model_config, state = _full_state(source)
    Path(out).mkdir(parents=True, exist_ok=True)
    tokenizer = export_tokenizer(_tokenizer_of(source), Path(out), model_config.max_seq_len)
    folder = write_hf_folder(state, model_config, out, step=source.step,
                             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    return folder, source, tokenizer


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

    `fivefold train --run-dir RUN --resume` (which reads RUN/config.toml) then fine-tunes them
    with a fresh optimizer. The training settings come from the preset `base`.
    """
    from ..config import load_config
    from .hf import read_hf_folder

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    check_import_target(run_dir)
    root = checkpoint_root(run_dir)
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


def check_import_target(run_dir: Path) -> None:
    """An import starts a run: only in a new or empty folder, so it never writes over a run (its
    weights, metrics and checkpoints) or a user's files."""
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(f"--run-dir {run_dir} is a file; give a new or empty folder")
    entries = existing_entries(run_dir)
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointError(f"{run_dir} is not empty ({shown}); import into a new or empty --run-dir "
                              "(an import never writes over a run or other files)")


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
    export = sub.add_parser("export", help="a run's newest weights (checkpoint or final weights) -> Hugging Face folder")
    export.add_argument("--run-dir", required=True, help="run directory or one checkpoint directory")
    export.add_argument("--step", type=int, default=None,
                        help="the weights of this step: a checkpoint, or the final weights (default: the newest)")
    export.add_argument("--out", required=True, help="folder to write config.json and the safetensors files to")
    imp = sub.add_parser("import", help="Hugging Face Llama/Mixtral folder -> starting weights of a new run")
    imp.add_argument("--hf", required=True, help="folder with config.json and *.safetensors")
    imp.add_argument("--run-dir", required=True, help="new run directory to create")
    imp.add_argument("--config", default="tiny", help="preset giving the training settings (default: tiny)")
    args = parser.parse_args(argv)
    if args.direction == "export":
        out, source, tokenizer = export_hf_with_tokenizer(Path(args.run_dir), Path(args.out), args.step)
        print(f"wrote {out} from the {source.describe()} (load with transformers.AutoModelForCausalLM.from_pretrained)")
        if tokenizer.files:
            print(f"tokenizer: {', '.join(tokenizer.files)} (load with transformers.AutoTokenizer.from_pretrained); "
                  f"bos_token_id={tokenizer.bos_id}, eos_token_id={tokenizer.eos_id}")
        else:
            print(f"note: {tokenizer.note}")
        return 0
    run_dir = import_hf(Path(args.hf), Path(args.run_dir), args.config)
    print(f"imported {args.hf} into {run_dir}; fine-tune with: fivefold train --run-dir {run_dir} --resume")
    return 0
