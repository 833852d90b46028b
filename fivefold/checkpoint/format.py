"""The files of a checkpoint on disk, the atomic commit that makes them visible, and the
checks a manifest passes before anything it names is opened.

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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..parallel.sharding import ShardSpec
from ..job.rundir import fsync_path, write_json
from .errors import CheckpointError, CorruptCheckpoint, IncompatibleCheckpoint

FORMAT = "fivefold-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


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


def index_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


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
    write_json(directory / index_file(rank), info)


def commit(tmp: Path, final: Path, world_size: int, meta: dict[str, Any]) -> None:
    """Rank 0, once every rank wrote its files: manifest last, then the rename into place."""
    files, entries, rng = {}, [], {}
    for rank in range(world_size):
        index_path = tmp / index_file(rank)
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


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def staging_dir(root: Path, step: int) -> Path:
    """Where the ranks write checkpoint `step` before the commit renames it to `step_dir`."""
    return root / f".tmp_step_{step:06d}"


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
