"""Sharded, atomic, layout-independent checkpoints; Hugging Face export and import.

Format
------
A run directory holds `checkpoints/step_000123/` (the state after 123 optimizer steps):

- `rank_00000.safetensors` … one file per rank with only the shards this rank is the
  primary replica of (parameters, persistent buffers, optimizer state) plus its RNG states;
  every rank writes a file, possibly empty, so a missing file is always noticed;
- `rank_00000.json` … the index of that file: for every tensor, the canonical full-model
  name, the state it belongs to (`param`, `optim.exp_avg`, …), the global shape and the
  region of the global tensor it holds (see `ShardSpec`), and the file's sha256;
- `manifest.json`, written last by rank 0 after every rank finished: format version, step,
  config, world size, optimizer step count, sha256 and size of every file, all index entries
  merged, and a checksum of the manifest itself.

Files are safetensors only: loading never unpickles anything.

Atomic commit: ranks write into `checkpoints/.tmp_step_000123/`; after all ranks report
success (one all-reduce) rank 0 writes the manifest and renames the directory into place,
then prunes all but the newest `checkpoint.keep`. A crash at any point before the rename
leaves only a `.tmp_` directory, which is ignored and later removed; the previous checkpoint
stays complete. All ranks must see the same file system (a shared one across nodes).

Layout independence
-------------------
A shard is described by `ShardSpec`: a box (offsets, shape) of the global tensor — the
`Placement` of a tensor-, expert- or pipeline-parallel shard — optionally narrowed to a flat
range (start, length) of that box's row-major flattening, which is how ZeRO shards a
flattened parameter (over a whole tensor, the box is the whole tensor; under ZeRO + TP, it is
the TP shard). Loading is box intersection: each rank asks, for each tensor it holds, for its
own spec, and `assemble` copies in the overlap of every stored shard of that tensor; every
element inside the global shape must be covered, padding (e.g. a vocabulary padded to a
multiple of tp) keeps its current value. So any layout and world size can load any other's
checkpoint. `torch.distributed.checkpoint` reshards only boxes (no flat ranges within a box)
and has no atomic commit or checksums, so it is not used.

The data sampler is a pure function of the step (fivefold/data.py) and the learning rate a
pure function of the step and the train config, so saving the step restores both. RNG
states (CPU, and CUDA when present) are restored per rank when the world size is unchanged.

Optimizer protocol
------------------
An optimizer the checkpoint can save implements:

    steps: int   # completed updates (Adam's bias correction); saved and restored here
    def sharded_state(self) -> dict[str, dict[str, tuple[Tensor, Placement | ShardSpec]]]:
        # {parameter name: {state key, e.g. "exp_avg": (this rank's tensor, where it sits)}}
    def load_sharded_state(self, reader: CheckpointReader) -> None:
        # for each local state tensor: reader.read_into(tensor, spec, state_key)

A replicated state gives the parameter's Placement (only its primary replica is written);
a ZeRO flat shard gives `ShardSpec.from_placement(param_placement, flat=(start, length),
replicated_over=...)` with the axes that still replicate that shard. An optimizer that holds
the parameters' shards itself (ZeRO-3: the modules keep no usable full parameters) sets
`owns_parameter_shards = True` and returns each parameter's shard under the key "param";
the checkpoint then saves and loads parameters through the optimizer only (buffers still
come from the modules), and `load_sharded_state` fills them with read_into(t, spec, "param").

Trust
-----
A checkpoint folder may come from elsewhere, so nothing in it is trusted before it is
checked: every file a manifest names must be a plain file name inside the folder, every
entry's shapes must be those of the configured model (before anything is allocated), and
every stored tensor's shape and dtype (read from the safetensors header) must match its
entry before it is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn

from .config import Config, ModelConfig, check_values, config_from_dict
from .model.init import canonical_name
from .parallel import comm
from .parallel.sharding import Placement, ShardSpec, get_placement
from .rundir import describe_write_error, fsync_path, write_errors, write_json

FORMAT = "fivefold-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
RUNTIME_BUFFERS = ("tokens_per_expert", "dropped_slots")  # per-step statistics, not state
_STATE_DTYPES = ("F32", "F64", "BF16", "F16")  # parameters and optimizer state are floating point


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which and why."""


class CorruptCheckpoint(CheckpointError):
    """Missing, truncated or altered files: an older checkpoint may still be usable."""


class IncompatibleCheckpoint(CheckpointError):
    """A checkpoint of another model: no checkpoint of this run directory will load."""


# ------------------------------------------------------------------------------ shard regions


def _bounds(spec: ShardSpec) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """The smallest box holding the region, and the region's flat range inside that box.

    A flat range of a box spans whole rows of its first dim except at the two ends, so the
    bounding box is those rows. A 0-d tensor is treated as shape (1,).
    """
    offsets, shape = (spec.offsets, spec.shape) if spec.shape else ((0,), (1,))
    if spec.flat is None:
        return offsets, shape, 0, math.prod(shape)
    start, length = spec.flat
    row = math.prod(shape[1:])
    first, last = start // row, -(-(start + length) // row)
    box_offsets = (offsets[0] + first,) + tuple(offsets[1:])
    box_shape = (last - first,) + tuple(shape[1:])
    return box_offsets, box_shape, start - first * row, start - first * row + length


def _intersect(a_off, a_shape, b_off, b_shape) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _index(offsets: tuple[int, ...], origin: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - g, o - g + n) for o, g, n in zip(offsets, origin, shape))


def _inside(offsets: tuple[int, ...], shape: tuple[int, ...], global_shape: tuple[int, ...]) -> torch.Tensor:
    """Bool mask over a box: True where the element lies inside the (unpadded) global tensor."""
    global_shape = global_shape or (1,)
    mask = torch.ones(shape, dtype=torch.bool)
    for dim, (o, n, g) in enumerate(zip(offsets, shape, global_shape)):
        view = [1] * len(shape)
        view[dim] = n
        mask &= (torch.arange(o, o + n) < g).view(view)
    return mask


def assemble(target: ShardSpec, pieces: Iterable[tuple[ShardSpec, torch.Tensor]], out: torch.Tensor) -> None:
    """Fill `out` (the local tensor of `target`) from stored shards of the same global tensor.

    Every element of `target` inside the global shape must be covered by some piece;
    elements outside (padding) keep their value. Overlapping pieces hold equal values
    (replicas), so the order does not matter.
    """
    t_off, t_shape, t_start, t_end = _bounds(target)
    buffer = torch.zeros(t_shape, dtype=out.dtype)
    buffer.view(-1)[t_start:t_end] = out.detach().reshape(-1).cpu()
    covered = ~_inside(t_off, t_shape, target.global_shape)
    for spec, data in pieces:
        s_off, s_shape, s_start, s_end = _bounds(spec)
        overlap = _intersect(t_off, t_shape, s_off, s_shape)
        if overlap is None:
            continue
        source = torch.zeros(s_shape, dtype=out.dtype)
        present = torch.zeros(s_shape, dtype=torch.bool)
        source.view(-1)[s_start:s_end] = data.reshape(-1).to(out.dtype)
        present.view(-1)[s_start:s_end] = True
        src_index, dst_index = _index(overlap[0], s_off, overlap[1]), _index(overlap[0], t_off, overlap[1])
        mask = present[src_index]
        buffer[dst_index] = torch.where(mask, source[src_index], buffer[dst_index])
        covered[dst_index] |= mask
    missing = (~covered.view(-1)[t_start:t_end]).sum().item()
    if missing:
        raise CorruptCheckpoint(f"the checkpoint lacks {missing} elements of {target.name} needed by this rank's shard")
    with torch.no_grad():
        out.copy_(buffer.view(-1)[t_start:t_end].view(out.shape).to(out.device))


def clip_to_global(spec: ShardSpec, tensor: torch.Tensor) -> tuple[ShardSpec, torch.Tensor]:
    """Drop the padding of a box shard before saving: padding never exists in the full model."""
    if spec.flat is not None or not spec.shape:
        return spec, tensor
    shape = tuple(max(0, min(n, g - o)) for o, n, g in zip(spec.offsets, spec.shape, spec.global_shape))
    if shape == spec.shape:
        return spec, tensor
    clipped = tensor[tuple(slice(0, n) for n in shape)]
    return ShardSpec(spec.name, spec.global_shape, spec.offsets, shape, None, spec.replicated_over), clipped


# ----------------------------------------------------------------------------- what is saved


def state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers (e.g. the router's balancing bias) of one model chunk."""
    buffers = [(n, b) for n, b in module.named_buffers() if not n.endswith(RUNTIME_BUFFERS)]
    return list(module.named_parameters()) + buffers


def module_state_tensors(module: nn.Module, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """What the modules contribute: everything, or only buffers when the optimizer owns the parameters."""
    if getattr(optimizer, "owns_parameter_shards", False):
        return [(n, b) for n, b in module.named_buffers() if not n.endswith(RUNTIME_BUFFERS)]
    return state_tensors(module)


def spec_of(where: Placement | ShardSpec, config: ModelConfig) -> ShardSpec:
    """The ShardSpec of a Placement or spec, under the canonical name (a tied head is the embedding)."""
    spec = where if isinstance(where, ShardSpec) else ShardSpec.from_placement(where)
    name = canonical_name(spec.name, config)
    if name == spec.name:
        return spec
    return ShardSpec(name, spec.global_shape, spec.offsets, spec.shape, spec.flat, spec.replicated_over)


def _is_primary(spec: ShardSpec, mesh) -> bool:
    return all(mesh[axis].rank == 0 for axis in spec.replicated_over)


def optimizer_state(optimizer: Any) -> dict[str, dict[str, tuple[torch.Tensor, Placement | ShardSpec]]]:
    if not hasattr(optimizer, "sharded_state") or not hasattr(optimizer, "load_sharded_state"):
        raise CheckpointError(
            f"{type(optimizer).__name__} does not implement sharded_state()/load_sharded_state(); "
            "see the optimizer protocol in fivefold/checkpoint.py"
        )
    return optimizer.sharded_state()


def shard_entries(model: Any) -> list[tuple[str, ShardSpec, torch.Tensor]]:
    """(state, spec, tensor) of every shard this rank is the primary replica of."""
    config, mesh = model.config.model, model.mesh
    entries = []
    for chunk in model.chunks:
        for name, tensor in module_state_tensors(chunk, model.optimizer):
            entries.append(("param", spec_of(get_placement(tensor, name), config), tensor))
    for states in optimizer_state(model.optimizer).values():
        for key, (tensor, where) in states.items():
            entries.append((key if key == "param" else f"optim.{key}", spec_of(where, config), tensor))
    return [(state, *clip_to_global(spec, t)) for state, spec, t in entries if _is_primary(spec, mesh)]


def rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    if "cpu" in states:
        torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


# ------------------------------------------------------------------------------------- files


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()




def _manifest_checksum(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def write_rank_files(
    directory: Path, rank: int, entries: list[tuple[str, ShardSpec, torch.Tensor]], rng: dict[str, torch.Tensor]
) -> None:
    """This rank's safetensors file of shards and its JSON index (with the file's sha256)."""
    from safetensors.torch import save_file

    tensors, index = {}, []
    for i, (state, spec, tensor) in enumerate(entries):
        key = f"{i:05d}/{state}/{spec.name}"
        tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
        index.append({"key": key, "state": state, **spec.to_json()})
    for kind, value in rng.items():
        tensors[f"rng/{kind}"] = value.detach().cpu().contiguous()
    path = directory / rank_file(rank)
    save_file(tensors, str(path))
    fsync_path(path)
    info = {"rank": rank, "file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
            "entries": index, "rng": sorted(rng)}
    write_json(directory / f"rank_{rank:05d}.json", info)


def commit(tmp: Path, final: Path, world_size: int, meta: dict[str, Any]) -> None:
    """Rank 0, once every rank wrote its files: manifest last, then the rename into place."""
    files, entries, rng = {}, [], {}
    for rank in range(world_size):
        index_path = tmp / f"rank_{rank:05d}.json"
        if not index_path.is_file():
            raise CheckpointError(f"rank {rank} did not write {index_path}")
        info = json.loads(index_path.read_text())
        files[info["file"]] = {"sha256": info["sha256"], "bytes": info["bytes"]}
        files[index_path.name] = {"sha256": sha256_file(index_path), "bytes": index_path.stat().st_size}
        entries += [dict(e, file=info["file"]) for e in info["entries"]]
        rng[str(rank)] = info["rng"]
    manifest = {"format": FORMAT, **meta, "world_size": world_size, "files": files, "entries": entries, "rng": rng}
    manifest["checksum"] = _manifest_checksum(manifest)
    write_json(tmp / MANIFEST, manifest)
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():  # an unusable checkpoint of the same step, from before a fallback
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories (committed, i.e. renamed into place), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove leftovers of interrupted writes."""
    for path in list_checkpoints(root)[max(keep, 1):]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp_step_*"):
        shutil.rmtree(path, ignore_errors=True)


# -------------------------------------------------------------------------------- save / load


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def agree_max(value: int, model: Any) -> int:
    """The largest of every rank's `value` (a status code), so all ranks take the same branch."""
    device = model.extras.get("device", torch.device("cpu"))
    flag = torch.tensor([float(value)], device=device)
    comm.all_reduce(flag, model.mesh.world, op="max")
    return int(flag.item())


def save_checkpoint(model: Any, step: int, root: Path, keep: int = 3) -> Path:
    """Every rank writes its shards in parallel; rank 0 commits once all succeeded.

    `step` is the number of optimizer steps done: a run resumed from it continues at step
    index `step`. Returns the committed directory.
    """
    mesh, root = model.mesh, Path(root)
    tmp, final = root / f".tmp_step_{step:06d}", step_dir(root, step)
    if mesh.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted attempt at the same step
    agree_max(0, model)  # nobody writes before the stale directory is gone
    failure = ""
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write_rank_files(tmp, mesh.rank, shard_entries(model), rng_states())
    except write_errors() as err:  # a full disk surfaces from safetensors as its own error type
        failure = f"rank {mesh.rank} could not write its shards of checkpoint {final}: {describe_write_error(err)}"
    if agree_max(1 if failure else 0, model):
        _discard(tmp, mesh.rank)
        raise CheckpointError(failure or f"another rank failed to write checkpoint {final}; nothing was committed")
    if mesh.rank == 0:
        try:
            commit(tmp, final, mesh.world_size, checkpoint_meta(model, step))
            prune(root, keep)
        except write_errors() as err:
            failure = f"could not commit checkpoint {final}: {describe_write_error(err)}"
    if agree_max(1 if failure else 0, model):
        _discard(tmp, mesh.rank)
        raise CheckpointError(failure or f"rank 0 could not commit checkpoint {final}")
    return final


def _discard(tmp: Path, rank: int) -> None:
    """Rank 0 removes an uncommitted write (frees a full disk); it was never visible to a reader."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_meta(model: Any, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "optimizer_steps": int(getattr(model.optimizer, "steps", step)),
        "has_optimizer": True,
        "config": model.config.to_dict(),
        # Where the data stands (the batch of a step is a function of the step and these).
        "data": model.extras["data_position"](step) if "data_position" in model.extras else {},
    }


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint, after cheap checks of every file it lists.

    Presence and size of every rank's file are checked here (a missing rank or a truncated
    shard); contents are checked against their sha256 when a reader opens them.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CorruptCheckpoint(f"{path} has no {MANIFEST}: it was never completed")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(f"{manifest_path} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("checksum") != _manifest_checksum(manifest):
        raise CorruptCheckpoint(f"{manifest_path} was altered: its checksum does not match its contents")
    if manifest.get("format") != FORMAT:
        raise IncompatibleCheckpoint(f"{path} has format {manifest.get('format')!r}; this version reads {FORMAT!r}")
    check_manifest_fields(manifest, manifest_path)
    for name, info in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{path} is missing {name}" + _whose(name))
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CorruptCheckpoint(f"{file} is truncated or altered: {size} bytes, the manifest says {info['bytes']}")
    return manifest


def _is_count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(_is_count(v) for v in value)


def is_plain_file_name(name: Any) -> bool:
    """A name that stays inside its folder: no separator, not '.' or '..', not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and Path(name).name == name)


def _entry_problem(entry: Any, files: dict[str, Any]) -> str:
    """What is wrong with one manifest entry, or "" (types and the region's consistency)."""
    if not isinstance(entry, dict):
        return "is not an object"
    if not all(isinstance(entry.get(k), str) for k in ("key", "state", "name", "file")):
        return "lacks its key, state, name or file"
    if entry["file"] not in files:
        return f"names file {entry['file']!r}, which the manifest does not list"
    shapes: list[list[int]] = [entry.get(k) for k in ("global_shape", "offsets", "shape")]  # type: ignore[misc]
    if not all(_counts(v) for v in shapes) or len({len(v) for v in shapes}) != 1:
        return "has malformed global_shape/offsets/shape"
    global_shape, offsets, shape = shapes
    if any(o > g or n > g for g, o, n in zip(global_shape, offsets, shape)):
        return f"holds a region (offsets {offsets}, shape {shape}) outside its tensor of shape {global_shape}"
    flat = entry.get("flat")
    if flat is not None and not (_counts(flat) and len(flat) == 2 and flat[0] + flat[1] <= math.prod(shape)):
        return f"has a flat range {flat} outside its region of shape {shape}"
    return ""


def check_manifest_fields(manifest: dict[str, Any], manifest_path: Path) -> None:
    """Types and bounds of everything a loader uses, before anything is opened or allocated."""
    def bad(why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{manifest_path} {why}")

    if not (_is_count(manifest.get("step")) and _is_count(manifest.get("optimizer_steps"))
            and _is_count(manifest.get("world_size"), 1)):
        raise bad("has a malformed step, optimizer_steps or world_size")
    if not isinstance(manifest.get("config"), dict):
        raise bad("has no config")
    files, entries, rng = manifest.get("files"), manifest.get("entries"), manifest.get("rng")
    if not isinstance(files, dict) or not isinstance(entries, list) or not isinstance(rng, dict):
        raise bad("lacks its files, entries or rng tables")
    for name, info in files.items():
        if not is_plain_file_name(name):
            raise bad(f"names file {name!r} outside its checkpoint folder; refusing to open it")
        if not (isinstance(info, dict) and _is_count(info.get("bytes")) and isinstance(info.get("sha256"), str)):
            raise bad(f"has a malformed size or sha256 for {name}")
    for i, entry in enumerate(entries):
        problem = _entry_problem(entry, files)
        if problem:
            raise bad(f"entry {i} {problem}")
    if not all(isinstance(kinds, list) and set(kinds) <= {"cpu", "cuda"} for kinds in rng.values()):
        raise bad("has a malformed rng table")


def _whose(file_name: str) -> str:
    match = re.match(r"rank_(\d+)\.", file_name)
    return f" (the shards of rank {int(match.group(1))})" if match else ""


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
    for section in ("model", "train"):
        old, new = manifest["config"].get(section, {}), config.to_dict()[section]
        notes += [f"{section}.{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items()
                  if old.get(k) != v and k not in ("name", "run_dir") and not isinstance(v, (list, tuple))]
    return notes


def check_model_fits(model: ModelConfig, source: Path) -> None:
    """Refuse a saved config whose full fp32 weights exceed this machine's memory, before sizing
    any tensor: a forged config must not make the reader build or allocate an impossible model."""
    from .metrics import machine_memory_bytes, parameter_count
    from .precision import PrecisionPolicy

    needed = parameter_count(model) * PrecisionPolicy().param_bytes  # the reader builds fp32 tensors
    available, what = machine_memory_bytes("cpu")
    if needed > available:
        raise IncompatibleCheckpoint(
            f"{source} describes a model of {parameter_count(model):,} parameters ({needed / 1e9:,.1f} GB of "
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
        from .parallel.sharding import full_shapes

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
        t_off, t_shape, _, _ = _bounds(target)
        for file, key, spec in stored:
            if tuple(spec.global_shape) != tuple(target.global_shape):
                raise IncompatibleCheckpoint(
                    f"{target.name} has shape {list(spec.global_shape)} in {self.path}, the model needs {list(target.global_shape)}"
                )
            s_off, s_shape, _, _ = _bounds(spec)
            if _intersect(t_off, t_shape, s_off, s_shape) is not None:
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


def load_into(model: Any, path: Path, manifest: dict[str, Any]) -> int:
    """Overwrite this rank's parameters, optimizer state and RNG from a checkpoint; return its step."""
    reader = CheckpointReader(path, manifest)
    config = model.config.model
    optimizer = model.optimizer
    for chunk in model.chunks:
        for name, tensor in module_state_tensors(chunk, optimizer):
            reader.read_into(tensor, spec_of(get_placement(tensor, name), config), "param")
    optimizer_state(optimizer)  # raises if the optimizer lacks the protocol
    reader.skip_optimizer_state = not reader.has_optimizer  # imported weights: fresh moments
    optimizer.load_sharded_state(reader)
    optimizer.steps = int(manifest["optimizer_steps"])
    if manifest["world_size"] == model.mesh.world_size:
        try:
            set_rng_states(reader.rng_states(model.mesh.rank))
        except RuntimeError as err:  # a generator state of the wrong length
            raise CorruptCheckpoint(f"{path}: the random generator state of rank {model.mesh.rank} is unusable ({err})") from None
    return int(manifest["step"])


# Status codes ranks agree on (the largest wins): ok, try an older checkpoint, stop.
_OK, _CORRUPT, _INCOMPATIBLE = 0, 1, 2


def _attempt(model: Any, path: Path) -> tuple[int, str, int]:
    try:
        manifest = read_manifest(path)
        notes = check_compatible(manifest, model.config, path)
        step = load_into(model, path, manifest)
        notes += _data_notes(manifest, model, step)
    except CorruptCheckpoint as err:
        return _CORRUPT, str(err), -1
    except CheckpointError as err:  # another model, or an optimizer that cannot load state
        return _INCOMPATIBLE, str(err), -1
    if notes and model.mesh.rank == 0:
        print(f"note: resuming {path} with settings changed since it was saved: {', '.join(notes)}")
    return _OK, "", step


def _data_notes(manifest: dict[str, Any], model: Any, step: int) -> list[str]:
    """The data a checkpoint was trained on, where it differs from the data the run resumes on."""
    if "data_position" not in model.extras or not manifest.get("data"):
        return []
    now, saved = model.extras["data_position"](step), manifest["data"]
    return [f"data {key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in now if saved.get(key) != now[key]]


def resume_latest(model: Any, root: Path) -> int:
    """Load the newest usable checkpoint under `root`; return its step (0 if there is none).

    A corrupt checkpoint (on any rank) is reported and the previous one tried; a checkpoint
    of another model, or none usable among existing ones, stops the run before it writes.
    """
    failures = []
    candidates = list_checkpoints(Path(root))
    for path in candidates:
        status, reason, step = _attempt(model, path)
        worst = agree_max(status, model)
        if worst == _OK:
            return step
        reason = reason or "unusable on another rank (see its log)"
        if worst == _INCOMPATIBLE:
            raise IncompatibleCheckpoint(reason)
        failures.append(reason)
        if model.mesh.rank == 0:
            print(f"warning: skipping checkpoint {path.name}: {reason}")
    if candidates:
        raise CheckpointError(f"no usable checkpoint in {root}: " + "; ".join(failures))
    return 0



# ------------------------------------------------------------------------ during a training run


class StopRequest:
    """Turns SIGTERM into a request to checkpoint and stop after the current step.

    Ranks may receive the signal at different steps, so `agreed` takes the maximum over the
    world: all ranks stop after the same step, and all take part in the final checkpoint.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # not the main thread (e.g. inside a test harness): no handler
            self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, model: Any) -> bool:
        return bool(agree_max(int(self.requested), model))

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# ------------------------------------------------------------------------- Hugging Face convert


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

    from .parallel.sharding import full_shapes

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
    from .parallel.sharding import full_shapes

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
    from .rundir import existing_entries, looks_like_run

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
    from .config import load_config
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
    tmp = root / ".tmp_step_000000"
    tmp.mkdir(parents=True, exist_ok=True)
    write_rank_files(tmp, 0, [("param", ShardSpec.whole(n, tuple(t.shape)), t) for n, t in state.items()], {})
    meta = {"step": 0, "optimizer_steps": 0, "has_optimizer": False, "config": config.to_dict()}
    commit(tmp, step_dir(root, 0), 1, meta)
    return run_dir


def check_import_shapes(state: dict[str, torch.Tensor], model_config: ModelConfig, hf_dir: Path) -> None:
    """Every imported tensor must have the shape the config's model gives it, before a run starts from it."""
    from .parallel.sharding import full_shapes

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
