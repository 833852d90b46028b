"""The tokenizer half of a Hugging Face export: the ids config.json names and the files
`transformers.AutoTokenizer.from_pretrained` loads.

The ids come from the tokenizer the run trained with (`data.tokenizer`), so an exported model
stops on the token it learned to end documents with:

- `bytes`: 256 ids, one per UTF-8 byte; no BOS, EOS is byte 0. It is written as a byte-level
  BPE tokenizer.json with no merges, whose id i is byte i (GPT-2's byte-to-character map),
  so it encodes and decodes exactly as fivefold's byte tokenizer does.
- a tokenizer.json or a model folder: that tokenizer.json is copied, with the folder's
  tokenizer_config.json and special_tokens_map.json where it has them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..data.prepare import resolve_tokenizer
from ..data.textfiles import DataError

COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ExportedTokenizer:
    """What the export knows of the run's tokenizer; `note` says what could not be written."""

    bos_id: int | None
    eos_id: int | None
    files: tuple[str, ...]
    note: str = ""


def byte_to_char() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> dict:
    """A tokenizer.json whose id i is UTF-8 byte i: byte-level BPE without merges or added tokens."""
    chars = byte_to_char()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }


def _write_byte_tokenizer(out: Path, max_seq_len: int) -> tuple[str, ...]:
    (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False), encoding="utf-8")
    eos = byte_to_char()[0]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None,
              "model_max_length": max_seq_len, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    return "tokenizer.json", "tokenizer_config.json"


def _copy_hf_tokenizer(tokenizer_json: Path, out: Path) -> tuple[str, ...]:
    written = ["tokenizer.json"]
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    for name in COMPANION_FILES:
        if (tokenizer_json.parent / name).is_file():
            shutil.copyfile(tokenizer_json.parent / name, out / name)
            written.append(name)
    return tuple(written)


def export_tokenizer(spec: str, out: Path, max_seq_len: int) -> ExportedTokenizer:
    """Write the run's tokenizer into `out` and return its BOS/EOS ids; a tokenizer no longer
    readable is reported in `note` (the weights are still worth exporting)."""
    try:
        resolved = resolve_tokenizer(spec)
    except DataError as err:
        return ExportedTokenizer(None, None, (), f"no tokenizer written and no BOS/EOS ids set: {err}")
    if resolved.kind == "bytes":
        files = _write_byte_tokenizer(out, max_seq_len)
    else:
        files = _copy_hf_tokenizer(Path(resolved.path), out)
    return ExportedTokenizer(resolved.bos_id, resolved.eos_id, files)
