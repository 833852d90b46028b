"""The training data of a config: the embedded corpus or raw text files (read whole, data.py),
a prepared dataset, or a blend of prepared datasets (memory-mapped, packing.py).

`open_training_data` is what a run and a parity check call; `check_data_source` runs the same
checks in the launching process, before any worker process is started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .blend import BlendedSampler, parse_blend
from ..config import Config
from .sources import DataError, Sampler, TokenData, load_text, load_tokenizer, load_tokens
from .indexed import IndexedDataset, check_not_unfinished, is_prepared
from .packing import PackedSampler, StepSampler, split_by_documents


@dataclass
class PreparedData:
    """Prepared datasets (one, or a blend) split into training and held-out documents."""

    datasets: list[IndexedDataset]
    weights: list[float]
    vocab_size: int
    document_mask: bool
    val_fraction: float = 0.05
    notes: list[str] = field(default_factory=list)  # worth telling the user, not errors

    def _sampler(self, part: int, seq_len: int, global_batch: int, seed: int, val_fraction: float) -> StepSampler:
        samplers: list[StepSampler] = []
        for dataset in self.datasets:
            bounds = split_by_documents(dataset, val_fraction)
            what = f"the {'training' if part == 0 else 'validation'} split of {dataset.root}"
            samplers.append(PackedSampler(dataset, bounds[part], bounds[part + 1], seq_len, global_batch, seed,
                                          self.document_mask, what))
        if len(samplers) == 1:
            return samplers[0]
        return BlendedSampler(samplers, self.weights, global_batch, seed)

    def training_sampler(self, seq_len: int, global_batch: int, seed: int) -> StepSampler:
        return self._sampler(0, seq_len, global_batch, seed, self.val_fraction)

    def validation_sampler(self, seq_len: int, global_batch: int, seed: int) -> StepSampler:
        return self._sampler(1, seq_len, global_batch, seed, self.val_fraction)


def prepared_sources(config: Config) -> list[tuple[float, Path]] | None:
    """[(weight, folder)] when data.source names prepared data (one folder or a blend), else None."""
    blend = parse_blend(config.data.source)
    if blend is not None:
        for _, path in blend:
            check_not_unfinished(Path(path), "data.source: blend member")
            if not is_prepared(Path(path)):
                raise DataError(f"data.source: blend member {path} is not a prepared dataset (no manifest.json); "
                                f"run `fivefold data prepare ... --out {path}` first")
        return [(w, Path(p)) for w, p in blend]
    folder = Path(config.data.source)
    check_not_unfinished(folder)
    return [(1.0, folder)] if config.data.source != "embedded" and is_prepared(folder) else None


def _check_tokenizer(datasets: list[IndexedDataset], config: Config) -> int:
    """All datasets tokenized alike, and as data.tokenizer says when it names one; their vocabulary size."""
    first = datasets[0].tokenizer
    for other in datasets[1:]:
        if _identity(other.tokenizer) != _identity(first):
            raise DataError(f"{other.root} was prepared with another tokenizer than {datasets[0].root}; "
                            "a blend needs one tokenizer: prepare both with the same --tokenizer")
    if config.data.tokenizer != "bytes":  # it names a tokenizer: the data must have been prepared with it
        from .prepare import resolve_tokenizer

        wanted = resolve_tokenizer(config.data.tokenizer, use_bos=first.get("bos_id") is not None)
        if first["kind"] != wanted.kind or first["sha256"] != wanted.sha256:
            raise DataError(f"{datasets[0].root} was prepared with another tokenizer ({first.get('path') or 'bytes'}) "
                            f"than data.tokenizer={config.data.tokenizer}; set data.tokenizer to the one it was "
                            "prepared with, or prepare the data again")
    return int(first["vocab_size"])


def _identity(tokenizer: dict[str, Any]) -> tuple:
    return tokenizer["kind"], tokenizer["sha256"], tokenizer["vocab_size"], tokenizer["eos_id"], tokenizer.get("bos_id")


def _check_vocab(vocab_size: int, config: Config) -> None:
    if vocab_size > config.model.vocab_size:
        raise DataError(
            f"the tokenizer has {vocab_size} tokens but model.vocab_size={config.model.vocab_size}; "
            f"set model.vocab_size >= {vocab_size}"
        )


def open_training_data(config: Config) -> tuple[Any, Any]:
    """(data with .validation_sampler and .vocab_size, the training sampler) of `config`."""
    train = config.train
    sources = prepared_sources(config)
    if sources is None:
        tokenizer = load_tokenizer(config.data.tokenizer)
        _check_vocab(tokenizer.vocab_size, config)
        data: Any = load_tokens(config.data, tokenizer)
        return data, Sampler(data.train, train.seq_len, train.global_batch, train.seed)
    if not 0 < config.data.val_fraction < 0.5:
        raise DataError(f"data.val_fraction={config.data.val_fraction} must be in (0, 0.5)")
    datasets = [IndexedDataset(path) for _, path in sources]
    vocab_size = _check_tokenizer(datasets, config)
    _check_vocab(vocab_size, config)
    data = PreparedData(datasets, [w for w, _ in sources], vocab_size, config.data.document_mask, config.data.val_fraction)
    longest = max(int(d.manifest.get("longest_document", 0)) for d in datasets)
    if config.data.document_mask and 0 < longest < train.seq_len:
        data.notes.append(
            f"train.seq_len={train.seq_len} is longer than every document (the longest has {longest} tokens): "
            "each sequence packs several documents and, with data.document_mask, attends within each; "
            f"a seq_len of {longest} would cost less attention for the same context"
        )
    return data, data.training_sampler(train.seq_len, train.global_batch, train.seed)


def check_data_source(config: Config) -> None:
    """What can fail about the data, checked before worker processes are started.

    Prepared data is opened and verified in full (sizes, checksums); text files are read and
    checked, but not tokenized (every rank does that).
    """
    if prepared_sources(config) is not None:
        open_training_data(config)
        return
    _check_vocab(load_tokenizer(config.data.tokenizer).vocab_size, config)
    if config.data.source != "embedded" or config.data.document_mask:
        load_text(config.data)


__all__ = ["PreparedData", "TokenData", "check_data_source", "open_training_data", "prepared_sources"]
