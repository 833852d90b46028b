"""A set of safetensors files with an index, as Hugging Face writes them: written one tensor at a
time, read one tensor at a time, and replaced in its folder as a whole.

Layout (what `transformers` writes with `save_pretrained`):

- a set that fits in one file is `model.safetensors`;
- a larger one is `model-00001-of-0000N.safetensors` ... plus `model.safetensors.index.json`
  (`{"metadata": {"total_size": ...}, "weight_map": {tensor: file}}`). Tensors go into files in
  order, a new file starting when the next tensor would push the current one past the size
  bound; a tensor larger than the bound gets a file of its own (huggingface_hub's rule).

Every file names the step its weights hold in its header metadata (`{"format": "pt", "step":
"12"}`), and so does the index (`metadata.step`): readers pick the newest weights of a run by it,
and a set whose files disagree is refused.

A file is written by `TensorFileWriter`: the header is computed from the names, shapes and
dtypes alone, then each tensor's bytes are appended as it arrives, so a writer holds one tensor,
never a file's worth. Files are created with the ordinary mode (0666 less the umask: 0644 under
the usual 022), so the people who share a run folder can read them.

Replacing a set (`replace_set`): the new files are complete and flushed in a staging folder
first. Then the old set's files are moved aside (its index or single file first, so no reader
ever sees an index whose files are half new), the new files moved in (the index or single file
last), and the old ones removed. A full disk or a crash while the staging folder is written leaves
the old set untouched; a crash during the few renames leaves the old set whole in the folder
`.replaced_weights/`, which the next `replace_set` in that folder puts back first.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..job.rundir import fsync_path, write_json
from .errors import CheckpointError, CorruptCheckpoint

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
REPLACED_DIR = ".replaced_weights"
_OLD_FILES = "old_files.json"  # in REPLACED_DIR: the names of the set being replaced
# huggingface_hub's default shard size (transformers 5 raised its own default to 50 GB): files a
# network file system, an object store or a browser upload handles without trouble.
DEFAULT_MAX_FILE_BYTES = 5 * 10**9
_HEADER_ALIGN = 8  # safetensors pads its header so that the data of every dtype is aligned

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says of one tensor: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# ------------------------------------------------------------------------------------ the plan


def split_into_files(tensors: Sequence[TensorInfo], max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[list[TensorInfo]]:
    """Consecutive tensors per file, none over `max_file_bytes` unless one tensor alone is larger."""
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be at least 1, got {max_file_bytes}")
    files: list[list[TensorInfo]] = []
    current: list[TensorInfo] = []
    size = 0
    for info in tensors:
        if info.nbytes > max_file_bytes:  # alone, where it stands in the order
            files.append([info])
            continue
        if current and size + info.nbytes > max_file_bytes:
            files.append(current)
            current, size = [], 0
        current.append(info)
        size += info.nbytes
    if current:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    """`model.safetensors` for one file, else model-00001-of-0000N.safetensors ..."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def header_bytes(tensors: Sequence[TensorInfo], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `tensors` in this order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for info in tensors:
        if info.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{info.name}: dtype {info.dtype} has no safetensors name")
        header[info.name] = {"dtype": _DTYPE_NAMES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def set_metadata(step: int | None) -> dict[str, str]:
    """The header metadata of every file of a set: transformers wants format=pt."""
    return {"format": "pt"} if step is None else {"format": "pt", "step": str(step)}


# ------------------------------------------------------------------------------------ writing


class TensorFileWriter:
    """Streams one safetensors file: the header first, then each tensor's bytes in header order."""

    def __init__(self, path: Path, tensors: Sequence[TensorInfo], metadata: dict[str, str]) -> None:
        self.path, self.tensors, self.written = Path(path), list(tensors), 0
        self._file = open(self.path, "wb")  # mode 0666 less the umask, as any file the user creates
        try:
            self._file.write(header_bytes(self.tensors, metadata))
        except BaseException:
            self.discard()
            raise

    @property
    def done(self) -> bool:
        return self.written == len(self.tensors)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor (a host tensor of the header's shape and dtype)."""
        info = self.tensors[self.written]
        if name != info.name or tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
            raise ValueError(f"{self.path.name}: expected {info.name} {list(info.shape)} {info.dtype} next, "
                             f"got {name} {list(tensor.shape)} {tensor.dtype}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: a file writer takes host tensors, got one on {tensor.device}")
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(raw.numpy().data)  # no copy: the buffer is the tensor's own memory
        self.written += 1

    def close(self) -> None:
        """Flush the complete file to disk."""
        if not self.done:
            raise ValueError(f"{self.path.name}: {self.written} of {len(self.tensors)} tensors written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        """Close and delete an unfinished file (a failed write; frees a full disk)."""
        try:
            self._file.close()
        except OSError:
            pass
        self.path.unlink(missing_ok=True)


def write_index(folder: Path, files: Sequence[Sequence[TensorInfo]], step: int | None) -> Path:
    """model.safetensors.index.json of a set of more than one file (atomically, like every index)."""
    names = file_names(len(files))
    metadata: dict[str, Any] = {"total_size": sum(t.nbytes for f in files for t in f)}
    if step is not None:
        metadata["step"] = step
    weight_map = {t.name: name for name, f in zip(names, files) for t in f}
    return write_json(Path(folder) / INDEX_FILE, {"metadata": metadata, "weight_map": weight_map})


def write_set(folder: Path, tensors: dict[str, torch.Tensor], step: int | None = None,
              max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[Path]:
    """Write host tensors held in memory as a set in `folder` (files, then the index); returns the files."""
    infos = [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    files = split_into_files(infos, max_file_bytes)
    paths = []
    for name, members in zip(file_names(len(files)), files):
        writer = TensorFileWriter(Path(folder) / name, members, set_metadata(step))
        try:
            for info in members:
                writer.write(info.name, tensors[info.name])
            writer.close()
        except BaseException:
            writer.discard()
            raise
        paths.append(writer.path)
    if len(files) > 1:
        write_index(folder, files, step)
    return paths


# ------------------------------------------------------------------------------------ reading


class TensorSet:
    """The set in a folder: which tensors it holds, the step it records, each tensor on demand.

    A folder may come from elsewhere: the index may name only files of the set's own pattern
    inside the folder, every file must exist and list exactly the tensors the index gives it,
    and all must record the same step. Nothing is read but headers until a tensor is asked for.
    """

    def __init__(self, folder: Path, files: list[str], weight_map: dict[str, str], step: int | None) -> None:
        self.folder, self.files, self.weight_map, self.step = Path(folder), files, weight_map, step
        self._handles: dict[str, Any] = {}

    @classmethod
    def locate(cls, folder: Path) -> "TensorSet | None":
        """The set in `folder` (the index if there is one, else model.safetensors), or None."""
        folder = Path(folder)
        if (folder / INDEX_FILE).is_file():
            return cls._from_index(folder)
        if (folder / SINGLE_FILE).is_file():
            handle = cls._open_file(folder / SINGLE_FILE)
            step = _step_of(handle.metadata(), folder / SINGLE_FILE)
            found = cls(folder, [SINGLE_FILE], {k: SINGLE_FILE for k in handle.keys()}, step)
            found._handles[SINGLE_FILE] = handle
            return found
        return None

    @classmethod
    def _from_index(cls, folder: Path) -> "TensorSet":
        path = folder / INDEX_FILE
        try:
            index = json.loads(path.read_text())
            weight_map, metadata = index["weight_map"], index.get("metadata") or {}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise CorruptCheckpoint(f"{path} is not a safetensors index ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptCheckpoint(f"{path} has a malformed weight_map")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if not SHARD_FILE.match(f)]
        if outside:
            raise CorruptCheckpoint(f"{path} names {outside[0]!r}, not a file of this set; refusing to open it")
        step = metadata.get("step") if isinstance(metadata, dict) else None
        if step is not None and not (isinstance(step, int) and step >= 0):
            raise CorruptCheckpoint(f"{path} has a malformed step {step!r}")
        found = cls(folder, files, dict(weight_map), step)
        found._check_files()
        return found

    @staticmethod
    def _open_file(path: Path) -> Any:
        from safetensors import safe_open

        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types for a malformed file
            raise CorruptCheckpoint(f"{path} cannot be read as safetensors weights: {err}") from None

    def _check_files(self) -> None:
        for name in self.files:
            path = self.folder / name
            if not path.is_file():
                raise CorruptCheckpoint(f"{self.folder / INDEX_FILE} names {name}, which is missing")
            handle = self._handle(name)
            listed = {k for k, v in self.weight_map.items() if v == name}
            if set(handle.keys()) != listed:
                raise CorruptCheckpoint(f"{path} does not hold the tensors the index gives it")
            if _step_of(handle.metadata(), path) != self.step:
                raise CorruptCheckpoint(
                    f"{path} records step {_step_of(handle.metadata(), path)}, the index step {self.step}: "
                    "the files are from different saves"
                )

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._open_file(self.folder / file)
        return self._handles[file]

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self.weight_map}

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.weight_map[name]).get_tensor(name)

    def read_all(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.weight_map}

    @property
    def paths(self) -> list[Path]:
        return [self.folder / f for f in self.files] + ([self.folder / INDEX_FILE] if len(self.files) > 1 else [])


def _step_of(metadata: dict[str, str] | None, path: Path) -> int | None:
    step = (metadata or {}).get("step")
    if step is None:
        return None
    if not step.isdigit():
        raise CorruptCheckpoint(f"{path} records a malformed step {step!r}")
    return int(step)


# ------------------------------------------------------------------------------------ replacing


def set_files_in(folder: Path) -> list[Path]:
    """Every file of a set in `folder`: the index or single file first, then the shards."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    heads = [folder / n for n in (INDEX_FILE, SINGLE_FILE) if (folder / n).is_file()]
    shards = sorted(p for p in folder.iterdir() if SHARD_FILE.match(p.name) and p.is_file())
    return heads + shards


def restore_interrupted_replace(folder: Path) -> None:
    """Put back a set a crash left in `.replaced_weights/` while it was being replaced.

    The old set's head (its index or single file) moves aside first and the new one arrives
    last, so a folder without a head was caught in between: the old files come back (their
    list was written before anything moved) and new shards that arrived without their index go.
    """
    folder = Path(folder)
    aside = folder / REPLACED_DIR
    if not aside.is_dir():
        return
    head_present = any((folder / n).is_file() for n in (INDEX_FILE, SINGLE_FILE))
    if not head_present and (aside / _OLD_FILES).is_file():  # between the old head leaving and the new arriving
        old = set(json.loads((aside / _OLD_FILES).read_text()))
        for path in [p for p in aside.iterdir() if p.name in old]:
            os.replace(path, folder / path.name)
        for path in set_files_in(folder):
            if path.name not in old:
                path.unlink()
    shutil.rmtree(aside, ignore_errors=True)
    fsync_path(folder)


def replace_set(staging: Path, folder: Path) -> None:
    """Make the set in `staging` the set of `folder`; the old one stays whole until the last rename."""
    staging, folder = Path(staging), Path(folder)
    restore_interrupted_replace(folder)
    aside = folder / REPLACED_DIR
    aside.mkdir()
    old = set_files_in(folder)
    write_json(aside / _OLD_FILES, [p.name for p in old])
    for path in old:  # index (or single file) first: no reader sees a half-new set
        os.replace(path, aside / path.name)
    for path in reversed(set_files_in(staging)):  # shards first, index (or single file) last
        os.replace(path, folder / path.name)
    fsync_path(folder)
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


def total_bytes(files: Iterable[Iterable[TensorInfo]]) -> int:
    return sum(t.nbytes for f in files for t in f)


def describe(found: TensorSet | None) -> str:
    """How a message names a set: its first file and the step it holds."""
    if found is None:
        return "no final weights"
    head = found.folder / (INDEX_FILE if len(found.files) > 1 else SINGLE_FILE)
    return f"{head} (step {found.step})" if found.step is not None else str(head)


__all__ = [
    "DEFAULT_MAX_FILE_BYTES", "INDEX_FILE", "SINGLE_FILE", "CheckpointError", "TensorFileWriter", "TensorInfo",
    "TensorSet", "describe", "file_names", "header_bytes", "replace_set", "restore_interrupted_replace",
    "set_files_in", "set_metadata", "split_into_files", "total_bytes", "write_index", "write_set",
]
