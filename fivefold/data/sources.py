"""Corpus, tokenizers and a layout-independent sampler.

The global batch of step k is a pure function of (seed, k): the same sequences in the same
order whatever the layout, so any layout can be compared with the single-process run and a
run can resume at any step without replaying the data.

The embedded corpus is a snapshot of 53 modules of the CPython 3.11.7 standard library
(listed in corpus/corpus_files.txt), shipped under the PSF licence (corpus/CORPUS_LICENSE.txt).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..config import DataConfig
from .textfiles import DataError, jsonl_documents, read_text_file

__all__ = ["DataError", "jsonl_documents", "read_text_file"]  # re-exported: the data module's errors

CORPUS_DIR = Path(__file__).parent / "corpus"


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
        ids: list[int] = []
        i, end = first, first + count
        while i < end:  # one read per epoch the rows span, not one per row
            epoch, pos = divmod(i, self.windows)
            take = min(self.windows - pos, end - i)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            ids += torch.randperm(self.windows, generator=g)[pos : pos + take].tolist()
            i += take
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
