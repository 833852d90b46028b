"""Corpus, tokenizers and a layout-independent sampler.

The global batch of step k is a pure function of (seed, k): the same sequences in the same
order whatever the layout, so any layout can be compared with the single-process run and a
run can resume at any step without replaying the data.

The embedded corpus is a snapshot of 53 modules of the CPython 3.11.7 standard library
(listed in corpus/corpus_files.txt), shipped under the PSF licence (corpus/CORPUS_LICENSE.txt).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .config import DataConfig

CORPUS_DIR = Path(__file__).parent / "corpus"


class DataError(ValueError):
    """A data source or tokenizer that cannot be used; the message says what to change."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, nothing to download or train."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json from a local path."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError("data.tokenizer is a tokenizer.json but `tokenizers` is not installed; "
                            "pip install 'fivefold[tokenizers]'") from None
        if not Path(path).is_file():
            raise DataError(f"data.tokenizer={path} does not exist; give a tokenizer.json path or 'bytes'")
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises a bare Exception for any unreadable file
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"{path} is not a Hugging Face tokenizer.json ({reason})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def embedded_text() -> str:
    with gzip.open(CORPUS_DIR / "corpus.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def read_text_file(path: Path) -> str:
    """The UTF-8 text of a data file; empty, binary, non-UTF-8 and unreadable files name file and line."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path} cannot be read ({err.strerror or err}); check the path and its permissions") from None
    if not raw.strip():
        raise DataError(f"{path} is empty; remove it or give it some text")
    if b"\0" in raw:  # UTF-8 text never holds NUL bytes: this is a binary file
        line = raw.count(b"\n", 0, raw.index(b"\0")) + 1
        raise DataError(f"{path}:{line} holds a NUL byte: a binary file, not text; remove it from data.source")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}:{line} is not UTF-8 text (byte {raw[err.start]:#04x}); convert the file to UTF-8") from None


def jsonl_documents(path: Path, field: str) -> list[str]:
    """The `field` of every JSON object in a .jsonl file, one document per non-blank line."""
    docs = []
    for line_no, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{line_no} is not valid JSON: {err}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{line_no} is a JSON {type(record).__name__}, not an object with a '{field}' field")
        if field not in record:
            raise DataError(f"{path}:{line_no} has no field '{field}' (set data.jsonl_field)")
        if not isinstance(record[field], str):
            raise DataError(f"{path}:{line_no}: field '{field}' is a {type(record[field]).__name__}, not text")
        docs.append(record[field])
    return docs


def _read_documents(path: Path, jsonl_field: str) -> list[str]:
    if path.suffix == ".jsonl":
        return jsonl_documents(path, jsonl_field)
    return [read_text_file(path)]


def load_text(config: DataConfig) -> str:
    """The training text: the embedded corpus, a .txt/.jsonl file, or a folder of them."""
    if config.source == "embedded":
        if config.document_mask:
            raise DataError("data.document_mask needs a prepared dataset (`fivefold data prepare`); "
                            "the embedded corpus has no document boundaries")
        return embedded_text()
    path = Path(config.source)
    if not path.exists():
        raise DataError(f"data.source={config.source} does not exist; use 'embedded' or a .txt/.jsonl file or folder")
    if config.document_mask:
        raise DataError(
            "data.document_mask needs document boundaries: prepare the data with "
            f"`fivefold data prepare {config.source} --out DIR` and set data.source=DIR"
        )
    files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")) if path.is_dir() else [path]
    if not files:
        raise DataError(f"data.source={config.source} holds no .txt or .jsonl files")
    docs = [doc for f in files for doc in _read_documents(f, config.jsonl_field)]
    return "\n\n".join(docs)


@dataclass
class TokenData:
    train: torch.Tensor  # (N,) int64 token ids
    val: torch.Tensor
    vocab_size: int

    def validation_sampler(self, seq_len: int, global_batch: int, seed: int) -> "Sampler":
        return Sampler(self.val, seq_len, global_batch, seed)


def load_tokens(config: DataConfig, tokenizer: Tokenizer) -> TokenData:
    if not 0 < config.val_fraction < 0.5:
        raise DataError(f"data.val_fraction={config.val_fraction} must be in (0, 0.5)")
    text = load_text(config)
    if isinstance(tokenizer, ByteTokenizer):  # the same ids as encode(), without a Python list
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    else:
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    split = int(len(ids) * (1 - config.val_fraction))
    return TokenData(train=ids[:split], val=ids[split:], vocab_size=tokenizer.vocab_size)


class Sampler:
    """Windows of seq_len + 1 tokens; step k's global batch is a pure function of (seed, k).

    Non-overlapping windows are shuffled once per epoch with a generator seeded by
    (seed, epoch); batch k takes windows k*G .. k*G+G-1 of that endless sequence.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int) -> None:
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise DataError(
                f"the data holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
                "lower train.seq_len or add data"
            )

    def _window_ids(self, first: int, count: int) -> list[int]:
        ids, cache = [], {}
        for i in range(first, first + count):
            epoch, pos = divmod(i, self.windows)
            if epoch not in cache:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                cache[epoch] = torch.randperm(self.windows, generator=g)
            ids.append(int(cache[epoch][pos]))
        return ids

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (global_batch, seq_len), for optimizer step `step`."""
        starts = [w * self.seq_len for w in self._window_ids(step * self.global_batch, self.global_batch)]
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        return rows[:, :-1], rows[:, 1:]

    def local_batch_at(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's contiguous share of step k's global batch."""
        inputs, targets = self.global_batch_at(step)
        per = self.global_batch // dp_size
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        return inputs[rows], targets[rows]

    def local_rows_at(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, targets, documents) of this rank's share; one unbroken text: no document ids."""
        inputs, targets = self.local_batch_at(step, dp_rank, dp_size)
        return inputs, targets, None


def micro_batches(
    inputs: torch.Tensor, targets: torch.Tensor, count: int, documents: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, ...]]:
    """Split a rank's batch into `count` equal micro-batches, in order (with their document ids)."""
    if documents is None:
        return list(zip(inputs.chunk(count), targets.chunk(count)))
    return list(zip(inputs.chunk(count), targets.chunk(count), documents.chunk(count)))
