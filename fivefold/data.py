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
        self._tok = _Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def embedded_text() -> str:
    with gzip.open(CORPUS_DIR / "corpus.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def _read_documents(path: Path, jsonl_field: str) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no} is not valid JSON: {err}") from None
            if jsonl_field not in record:
                raise DataError(f"{path}:{line_no} has no field '{jsonl_field}' (set data.jsonl_field)")
            docs.append(str(record[jsonl_field]))
        return docs
    return [path.read_text(encoding="utf-8", errors="replace")]


def load_text(config: DataConfig) -> str:
    """The training text: the embedded corpus, a .txt/.jsonl file, or a folder of them."""
    if config.source == "embedded":
        return embedded_text()
    path = Path(config.source)
    if not path.exists():
        raise DataError(f"data.source={config.source} does not exist; use 'embedded' or a .txt/.jsonl file or folder")
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
            raise DataError(f"the data holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")

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


def micro_batches(inputs: torch.Tensor, targets: torch.Tensor, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a rank's batch into `count` equal micro-batches, in order."""
    return list(zip(inputs.chunk(count), targets.chunk(count)))
