"""Reading text data files, with errors that name the file and line (no torch: preparation workers import this)."""

from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """A data source or tokenizer that cannot be used; the message says what to change."""


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
