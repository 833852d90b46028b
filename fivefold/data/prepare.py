"""`fivefold data prepare`: tokenize text once into memory-mapped shards (indexed.py).

Inputs: .txt files (one document each), .jsonl (one document per line, `--field`), .parquet
(one document per row, `--field`), .csv/.json through `datasets`, folders of these, and a
folder written by a Hugging Face `datasets` save_to_disk. Nothing is downloaded.

Tokenizers and special tokens:
- `bytes`: UTF-8 bytes, ids 0..255; no BOS; EOS is byte 0 (NUL, which text files never
  hold: such files are refused as binary).
- a `tokenizer.json`, or a Hugging Face model folder holding one: text is encoded without
  the tokenizer's own post-processing; BOS (the folder's tokenizer_config.json `bos_token`)
  is put before every document unless --no-bos; EOS (its `eos_token`, else a well-known end
  token of the vocabulary, else --eos-token) after every document. Packing needs the EOS.

The work is cut into units (a group of .txt files, a .jsonl or .csv file, a Parquet row
group, a range of rows of a saved dataset), one shard per unit, in a fixed order: the
output does not depend on the number of workers. Units run in parallel over processes;
a finished shard is kept, so an interrupted preparation continues where it stopped.
"""

from __future__ import annotations

import argparse
import functools
import json
import errno
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .textfiles import DataError, jsonl_documents, read_text_file
from .indexed import FORMAT, MANIFEST, PLAN, sha256_of, shard_name, token_dtype

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".csv", ".json")
TXT_FILES_PER_UNIT = 256
ROWS_PER_UNIT = 20_000
WELL_KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


# ----------------------------------------------------------------------------- tokenizers


@dataclass(frozen=True)
class TokenizerSpec:
    """What fixes the ids: recorded in the manifest and compared before training."""

    kind: str  # "bytes" or "huggingface"
    path: str  # the tokenizer.json (absolute), "" for bytes
    sha256: str  # of the tokenizer.json, "" for bytes
    vocab_size: int
    bos_id: int | None
    eos_id: int

    def identity(self) -> dict[str, Any]:
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id}


def _special(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def resolve_tokenizer(spec: str, use_bos: bool = True, eos_token: str | None = None) -> TokenizerSpec:
    """`bytes`, a tokenizer.json, or a model folder holding tokenizer.json (+ tokenizer_config.json)."""
    if spec == "bytes":
        return TokenizerSpec("bytes", "", "", 256, None, 0)
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(f"{path} holds no tokenizer.json; give a Hugging Face model folder with a fast tokenizer, a tokenizer.json or 'bytes'")
        path = path / "tokenizer.json"
    from .sources import HFTokenizer

    tokenizer = HFTokenizer(str(path))
    config = _tokenizer_config(path.parent / "tokenizer_config.json")
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    bos = _special(config, "bos_token") if use_bos else None
    eos = eos_token or _special(config, "eos_token") or next((t for t in WELL_KNOWN_EOS if t in vocab), None)
    if eos is None or eos not in vocab:
        raise DataError(f"{path}: no end-of-document token found (tokenizer_config.json eos_token or one of {', '.join(WELL_KNOWN_EOS)}); pass --eos-token")
    if bos is not None and bos not in vocab:
        raise DataError(f"{path}: bos_token {bos!r} of tokenizer_config.json is not in the vocabulary; pass --no-bos")
    return TokenizerSpec("huggingface", str(path.resolve()), sha256_of(path), tokenizer.vocab_size,
                         vocab[bos] if bos is not None else None, vocab[eos])


def _tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON ({err})") from None
    return config if isinstance(config, dict) else {}


@functools.lru_cache(maxsize=2)
def _encoder(path: str):
    """The tokenizer of a worker process, loaded once per process (checked by resolve_tokenizer)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def encode_documents(docs: list[str], tok: TokenizerSpec) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document end offsets) of documents with BOS/EOS; empty documents are dropped."""
    docs = [d for d in docs if d]
    if tok.kind == "bytes":
        pieces = [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in docs]
    else:
        pieces = [np.asarray(e.ids, dtype=np.int64) for e in _encoder(tok.path).encode_batch(docs, add_special_tokens=False)]
    head = [tok.bos_id] if tok.bos_id is not None else []
    dtype = token_dtype(tok.vocab_size)
    lengths = np.array([len(head) + len(p) + 1 for p in pieces], dtype=np.int64)
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for p, end, length in zip(pieces, ends, lengths):
        start = end - length
        if head:
            out[start] = head[0]
        out[start + len(head) : end - 1] = p
        out[end - 1] = tok.eos_id
    return out, ends


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputUnit:
    """One shard's worth of input: files of one kind, or a row range of one file or dataset."""

    kind: str  # "txt", "jsonl", "parquet", "datasets_file", "saved_dataset"
    paths: tuple[str, ...]
    start: int = 0  # row group (parquet) or first row (saved dataset)
    stop: int = 0


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def _load_saved(path: str, split: str):
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(path)
    except Exception as err:  # datasets raises several types for a damaged folder
        raise DataError(f"{path} is not a readable Hugging Face datasets folder ({err})") from None
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise DataError(f"{path} has splits {', '.join(dataset)}; choose one with --split")
        dataset = dataset[split]
    return dataset


def plan_units(inputs: list[str], split: str, out: Path | None = None) -> list[InputUnit]:
    """The units of every input, in a fixed order (inputs as given, files sorted in folders).

    Hidden files and folders, and the output folder when it lies inside an input, are skipped.
    """
    units: list[InputUnit] = []
    for text in inputs:
        path = Path(text)
        if not path.exists():
            raise DataError(f"{path} does not exist; give .txt/.jsonl/.parquet/.csv/.json files, folders of them or a saved dataset")
        if is_saved_dataset(path):
            rows = len(_load_saved(str(path), split))
            units += [InputUnit("saved_dataset", (str(path),), a, min(a + ROWS_PER_UNIT, rows)) for a in range(0, rows, ROWS_PER_UNIT)]
            continue
        files = sorted(p for p in path.rglob("*") if _is_input(p, path, out)) if path.is_dir() else [path]
        if not files:
            raise DataError(f"{path} holds no {'/'.join(TEXT_SUFFIXES)} files")
        units += _file_units(files)
    return units


def _is_input(file: Path, folder: Path, out: Path | None) -> bool:
    hidden = any(part.startswith(".") for part in file.relative_to(folder).parts)
    inside_out = out is not None and out.resolve() in file.resolve().parents
    return file.is_file() and file.suffix in TEXT_SUFFIXES and not hidden and not inside_out


def _file_units(files: list[Path]) -> list[InputUnit]:
    units: list[InputUnit] = []
    txt: list[str] = []
    for f in files:
        if f.suffix not in TEXT_SUFFIXES:
            raise DataError(f"{f}: unknown kind of file; use {', '.join(TEXT_SUFFIXES)}")
        if f.suffix == ".txt":
            txt.append(str(f))
            continue
        if f.suffix == ".parquet":
            units += [InputUnit("parquet", (str(f),), g, g + 1) for g in range(_row_groups(f))]
        else:
            units.append(InputUnit("jsonl" if f.suffix == ".jsonl" else "datasets_file", (str(f),)))
    units += [InputUnit("txt", tuple(txt[i : i + TXT_FILES_PER_UNIT])) for i in range(0, len(txt), TXT_FILES_PER_UNIT)]
    return units


def _row_groups(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).num_row_groups
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{path} is not a readable Parquet file ({err})") from None


def _column(table_columns: list[str], field: str, where: str) -> None:
    if field not in table_columns:
        raise DataError(f"{where} has no column '{field}' (columns: {', '.join(table_columns)}); choose one with --field")


def read_unit(unit: InputUnit, field: str, split: str, cache: Path) -> list[str]:
    """The documents of a unit, in order."""
    if unit.kind == "txt":
        return [read_text_file(Path(p)) for p in unit.paths]
    path = unit.paths[0]
    if unit.kind == "jsonl":
        return jsonl_documents(Path(path), field)
    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path).read_row_group(unit.start)
        _column(table.column_names, field, path)
        return _texts(table.column(field).to_pylist(), path, first_row=_rows_before(path, unit.start))
    dataset = _load_saved(path, split) if unit.kind == "saved_dataset" else _load_data_file(path, cache)
    _column(dataset.column_names, field, path)
    stop = unit.stop if unit.kind == "saved_dataset" else len(dataset)
    return _texts(dataset[unit.start : stop][field], path, first_row=unit.start)


def _rows_before(path: str, group: int) -> int:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return sum(meta.row_group(g).num_rows for g in range(group))


def _load_data_file(path: str, cache: Path):
    from datasets import load_dataset

    builder = {".csv": "csv", ".json": "json"}[Path(path).suffix]
    try:
        return load_dataset(builder, data_files=[path], split="train", cache_dir=str(cache))
    except Exception as err:
        raise DataError(f"{path} cannot be read as {builder} by `datasets` ({str(err).splitlines()[0]})") from None


def _texts(values: list[Any], path: str, first_row: int) -> list[str]:
    for i, value in enumerate(values):
        if value is not None and not isinstance(value, str):
            raise DataError(f"{path}: row {first_row + i + 1} holds a {type(value).__name__}, not text")
    return [v or "" for v in values]


# ----------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class Job:
    index: int
    unit: InputUnit
    tokenizer: TokenizerSpec
    field: str
    split: str
    out: str


def _record_path(out: Path, index: int) -> Path:
    return out / f"{shard_name(index)}.json"


class PrepareWriteError(OSError):
    """A shard or the manifest could not be written (a full disk, most often); the message says what to do."""


def _write_failure(path: Path, err: OSError) -> PrepareWriteError:
    # numpy's tofile reports a short write as "N requested and M written", without an errno
    full = err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or "requested and" in str(err)
    reason = "the disk is full" if full else (err.strerror or str(err))
    return PrepareWriteError(f"could not write {path} ({reason}); nothing partial was kept: free space and run the "
                             "same `fivefold data prepare` again, which keeps the shards already finished")


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` into a temporary file renamed over `path`: a reader never sees half a file, and a
    failed or interrupted write leaves nothing behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and not isinstance(err, PrepareWriteError):
            raise _write_failure(path, err) from None
        raise


def write_shard(job: Job) -> dict[str, Any]:
    """Tokenize one unit into shard `job.index`: files first, the record last (the commit)."""
    out = Path(job.out)
    docs = read_unit(job.unit, job.field, job.split, out / ".datasets-cache")
    tokens, ends = encode_documents(docs, job.tokenizer)
    name = shard_name(job.index)
    record = {"name": name, "tokens": int(len(tokens)), "documents": int(len(ends)), "empty_documents": len(docs) - len(ends),
              "longest_document": int(np.diff(ends, prepend=0).max()) if len(ends) else 0}
    for suffix, array in ((".bin", tokens), (".idx", ends.astype(np.int64))):
        write_atomically(out / f"{name}{suffix}", array.tofile)
        record["sha256_" + suffix[1:]] = sha256_of(out / f"{name}{suffix}")
    text = json.dumps(record)
    write_atomically(_record_path(out, job.index), lambda tmp: tmp.write_text(text))
    return record


def remove_leftovers(out: Path) -> None:
    """Temporary files of writes cut short (a killed worker cannot clean up after itself)."""
    for tmp in out.glob("*.tmp"):
        tmp.unlink(missing_ok=True)


def finished_record(out: Path, index: int, itemsize: int) -> dict[str, Any] | None:
    """The record of a shard finished by an earlier run, if its files are whole."""
    try:
        record = json.loads(_record_path(out, index).read_text())
        whole = (out / f"{record['name']}.bin").stat().st_size == record["tokens"] * itemsize
        return record if whole and (out / f"{record['name']}.idx").stat().st_size == record["documents"] * 8 else None
    except (OSError, ValueError, KeyError):
        return None


def _check_plan(out: Path, plan: dict[str, Any], overwrite: bool) -> None:
    """An output folder continues only the preparation it was started for."""
    path = out / PLAN
    if path.is_file() and not overwrite:
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            previous = None
        if previous != json.loads(json.dumps(plan)):  # as stored: tuples become lists
            raise DataError(f"{out} holds another preparation (other inputs, tokenizer or field); use another --out or --overwrite")
    if overwrite:
        for stale in list(out.glob("shard_*")) + [out / MANIFEST]:
            stale.unlink(missing_ok=True)
    text = json.dumps(plan, indent=1)
    write_atomically(path, lambda tmp: tmp.write_text(text))


def _progress(total: int, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                    TimeRemainingColumn(), disable=not enabled)


def _run_jobs(jobs: list[Job], workers: int) -> Iterator[dict[str, Any]]:
    if workers <= 1 or len(jobs) <= 1:
        yield from map(write_shard, jobs)
        return
    # spawn: no forked copy of torch's threads. Workers ignore Ctrl-C, which the terminal sends to
    # them too: the main process alone stops (terminating them) and reports it, in one line.
    with get_context("spawn").Pool(workers, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
        yield from pool.imap_unordered(write_shard, jobs)


class PrepareInterrupted(Exception):
    """Ctrl-C during the preparation: the shards finished so far are kept for the next run."""

    def __init__(self, out: Path, finished: int, total: int) -> None:
        super().__init__(f"interrupted: {finished} of {total} shards are finished and kept in {out}; run the same "
                         "`fivefold data prepare` again to continue (training refuses the folder until then)")


@dataclass
class PrepareResult:
    out: Path
    tokens: int
    documents: int
    shards: int
    reused: int  # shards kept from an interrupted earlier run
    new_tokens: int  # tokens prepared by this run
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def prepare(
    inputs: list[str], out: str | Path, tokenizer: str = "bytes", field: str = "text", workers: int = 0,
    split: str = "train", use_bos: bool = True, eos_token: str | None = None, overwrite: bool = False,
    show_progress: bool = False,
) -> PrepareResult:
    """Prepare `inputs` into the folder `out`; returns counts and tokens/s of the new work."""
    start = time.perf_counter()
    tok = resolve_tokenizer(tokenizer, use_bos, eos_token)
    out = Path(out)
    units = plan_units(inputs, split, out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    plan = {"format": FORMAT, "tokenizer": tok.identity(), "field": field, "split": split, "units": [asdict(u) for u in units]}
    remove_leftovers(out)
    _check_plan(out, plan, overwrite)
    itemsize = token_dtype(tok.vocab_size).itemsize
    records = {i: r for i in range(len(units)) if (r := finished_record(out, i, itemsize)) is not None}
    jobs = [Job(i, u, tok, field, split, str(out)) for i, u in enumerate(units) if i not in records]
    workers = min(workers or os.cpu_count() or 1, max(1, len(jobs)))
    new_tokens = 0
    try:
        with _progress(len(units), show_progress) as progress:
            task = progress.add_task("prepare", total=len(units), completed=len(records), tps=0.0)
            for record in _run_jobs(jobs, workers):
                records[int(record["name"].split("_")[1])] = record
                new_tokens += record["tokens"]
                progress.update(task, advance=1, tps=new_tokens / (time.perf_counter() - start))
    except KeyboardInterrupt:
        remove_leftovers(out)  # the pool's workers are terminated by now
        raise PrepareInterrupted(out, len(records), len(units)) from None
    except OSError:
        remove_leftovers(out)  # of the other workers, terminated while writing
        raise
    ordered = [records[i] for i in range(len(units))]
    write_manifest(out, tok, ordered, inputs)
    return PrepareResult(out, sum(r["tokens"] for r in ordered), sum(r["documents"] for r in ordered), len(ordered),
                         len(units) - len(jobs), new_tokens, time.perf_counter() - start)


def write_manifest(out: Path, tok: TokenizerSpec, records: list[dict[str, Any]], inputs: list[str]) -> None:
    documents = sum(r["documents"] for r in records)
    if documents == 0:
        raise DataError(f"{', '.join(inputs)}: no document holds any text")
    manifest = {
        "format": FORMAT,
        "tokenizer": {**tok.identity(), "path": tok.path},
        "dtype": token_dtype(tok.vocab_size).name,
        "tokens": sum(r["tokens"] for r in records),
        "documents": documents,
        "empty_documents_skipped": sum(r["empty_documents"] for r in records),
        "longest_document": max(r.get("longest_document", 0) for r in records),  # tokens, with BOS/EOS
        "inputs": [str(Path(i).resolve()) for i in inputs],
        "shards": [{k: r[k] for k in ("name", "tokens", "documents", "sha256_bin", "sha256_idx")} for r in records],
    }
    text = json.dumps(manifest, indent=1)
    write_atomically(out / MANIFEST, lambda tmp: tmp.write_text(text))


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold data", description="Prepare training data once, train from it many times.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="tokenize files, folders or a saved Hugging Face dataset into memory-mapped shards")
    p.add_argument("inputs", nargs="+", help=".txt/.jsonl/.parquet/.csv/.json files, folders of them, or a save_to_disk folder")
    p.add_argument("--out", required=True, help="the prepared dataset's folder (then: --data.source OUT)")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json, or a Hugging Face model folder")
    p.add_argument("--field", default="text", help="the text field of .jsonl/.parquet/.csv/.json rows and datasets")
    p.add_argument("--split", default="train", help="the split of a saved DatasetDict")
    p.add_argument("--workers", type=int, default=0, help="processes (default: every CPU core)")
    p.add_argument("--no-bos", action="store_true", help="do not put the tokenizer's BOS before each document")
    p.add_argument("--eos-token", default=None, help="the end-of-document token when the tokenizer does not name one")
    p.add_argument("--overwrite", action="store_true", help="start over in an --out folder that holds another preparation")
    return parser


def run_data_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 0:
        raise DataError(f"--workers {args.workers} must be 0 (every core) or more")
    try:
        result = prepare(args.inputs, args.out, args.tokenizer, args.field, args.workers, args.split,
                         use_bos=not args.no_bos, eos_token=args.eos_token, overwrite=args.overwrite,
                         show_progress=sys.stderr.isatty())
    except (PrepareInterrupted, KeyboardInterrupt) as err:  # KeyboardInterrupt: before the shards started
        print(f"fivefold: {str(err) or 'interrupted before any shard was written'}", file=sys.stderr)
        return 128 + signal.SIGINT
    reused = f" ({result.reused} finished shards kept)" if result.reused else ""
    print(f"{result.out}: {result.tokens:,} tokens in {result.documents:,} documents, {result.shards} shards{reused}; "
          f"{result.tokens_per_s:,.0f} tokens/s")
    print(f"train with: fivefold train --data.source {result.out}")
    return 0
