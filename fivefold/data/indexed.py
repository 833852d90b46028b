"""Prepared token datasets: memory-mapped shards, a document index, a manifest with checksums.

A prepared dataset is a folder written by `fivefold data prepare` (prepare.py):

    manifest.json          format, tokenizer identity, dtype, counts, one entry per shard
    shard_00000.bin        token ids, uint16 when the vocabulary fits, else uint32
    shard_00000.idx        int64 end offset (in tokens, within the shard) of every document

Every document ends with the tokenizer's EOS token, so concatenated shards are the packed
token stream. Nothing is read into memory at start: shards and indexes are opened with
numpy.memmap and a sampler reads only the windows of its own rows, so a rank's memory and
start-up time do not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .textfiles import DataError

FORMAT = "fivefold-tokens-1"
MANIFEST = "manifest.json"
PLAN = "plan.json"  # written first by `data prepare`; the manifest, written last, marks it finished
VERIFIED = ".verified.json"  # cache of checked shard checksums, keyed by size and mtime


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def sha256_of(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(block):
            digest.update(data)
    return digest.hexdigest()


def is_prepared(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def check_not_unfinished(path: Path, what: str = "data.source") -> None:
    """Refuse a folder where `data prepare` started but did not finish (a plan, no manifest),
    naming the fix, instead of reading it as a folder of text files."""
    if (path / PLAN).is_file() and not is_prepared(path):
        raise DataError(f"{what}={path} is a preparation that did not finish (no {MANIFEST}; interrupted or out of "
                        f"disk space): run the same `fivefold data prepare ... --out {path}` again to finish it")


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path} cannot be read as JSON ({err}); prepare the dataset again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not a fivefold prepared dataset (format {manifest.get('format')!r}, expected {FORMAT!r})")
    return manifest


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _load_verified(root: Path) -> dict[str, dict[str, str]]:
    try:
        cache = json.loads((root / VERIFIED).read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_verified(root: Path, cache: dict[str, dict[str, str]]) -> None:
    """Best effort: a read-only dataset is simply checked in full each time."""
    tmp = root / f"{VERIFIED}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, root / VERIFIED)
    except OSError:
        tmp.unlink(missing_ok=True)


def verify(root: Path, manifest: dict[str, Any]) -> None:
    """Every shard and index present, of the right size, with the manifest's sha256.

    Sizes are checked every time. A file's checksum is computed once and remembered with its
    size and modification time, so a changed file is hashed again while an unchanged corpus
    starts in constant time.
    """
    itemsize = np.dtype(manifest["dtype"]).itemsize
    cache, changed = _load_verified(root), False
    for shard in manifest["shards"]:
        expected = {".bin": shard["tokens"] * itemsize, ".idx": shard["documents"] * 8}
        for suffix, size in expected.items():
            name = shard["name"] + suffix
            path = root / name
            if not path.is_file():
                raise DataError(f"{root} is missing {name}; prepare the dataset again (finished shards are kept)")
            if path.stat().st_size != size:
                raise DataError(f"{path} is truncated or altered: {path.stat().st_size} bytes, the manifest says {size}")
            key = _stat_key(path)
            if cache.get(name, {}).get("stat") == key and cache[name].get("sha256") == shard["sha256" + suffix.replace(".", "_")]:
                continue
            digest = sha256_of(path)
            if digest != shard["sha256" + suffix.replace(".", "_")]:
                raise DataError(f"{path} was changed after preparation: its sha256 does not match the manifest")
            cache[name], changed = {"stat": key, "sha256": digest}, True
    if changed:
        _save_verified(root, cache)


@dataclass
class Shard:
    tokens: np.ndarray  # (n,) token ids, memory-mapped
    ends: np.ndarray  # (documents,) end offset of each document within the shard, memory-mapped


class IndexedDataset:
    """A prepared dataset as one token stream with document boundaries, memory-mapped."""

    def __init__(self, root: str | Path, check: bool = True) -> None:
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        if check:
            verify(self.root, self.manifest)
        dtype = np.dtype(self.manifest["dtype"])
        self.shards = [
            Shard(
                _memmap(self.root / (s["name"] + ".bin"), dtype, s["tokens"]),
                _memmap(self.root / (s["name"] + ".idx"), np.dtype(np.int64), s["documents"]),
            )
            for s in self.manifest["shards"]
        ]
        counts = [s["tokens"] for s in self.manifest["shards"]]
        docs = [s["documents"] for s in self.manifest["shards"]]
        self.token_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # per shard: O(shards)
        self.doc_starts = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)
        self.num_tokens = int(self.token_starts[-1])
        self.num_documents = int(self.doc_starts[-1])

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    @property
    def fingerprint(self) -> str:
        """Identifies the data: the checksums of every shard, in order."""
        text = "".join(s["sha256_bin"] for s in self.manifest["shards"])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def document_end(self, doc: int) -> int:
        """Global token offset where document `doc` ends (exclusive)."""
        shard = bisect_right(self.doc_starts, doc) - 1
        return int(self.token_starts[shard] + self.shards[shard].ends[doc - self.doc_starts[shard]])

    def _pieces(self, start: int, count: int) -> Iterator[tuple[int, int, int, int]]:
        """(position in the window, shard, offset in the shard, length) of each shard's part of
        tokens [start, start+count), in order: a window may span shards."""
        done = 0
        while done < count:
            pos = start + done
            shard = bisect_right(self.token_starts, pos) - 1
            take = min(count - done, int(self.token_starts[shard + 1] - pos))
            yield done, shard, int(pos - self.token_starts[shard]), take
            done += take

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start+count) of the stream as int64 (they may span shards)."""
        out = np.empty(count, dtype=np.int64)
        for done, shard, offset, take in self._pieces(start, count):
            out[done : done + take] = self.shards[shard].tokens[offset : offset + take]
        return out

    def documents(self, start: int, count: int) -> np.ndarray:
        """Global document index of tokens [start, start+count): a few binary searches per window."""
        out = np.empty(count, dtype=np.int64)
        for done, shard, offset, take in self._pieces(start, count):
            ends = self.shards[shard].ends
            first = int(np.searchsorted(ends, offset, side="right"))
            last = int(np.searchsorted(ends, offset + take - 1, side="right"))
            local = np.arange(offset, offset + take)
            doc = first + np.searchsorted(ends[first : last + 1], local, side="right")
            out[done : done + take] = doc + self.doc_starts[shard]
        return out


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
