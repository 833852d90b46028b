"""A Hugging Face export carries the run's tokenizer: config.json's BOS/EOS ids are the training
tokenizer's (not transformers' Llama defaults 1 and 2), and the tokenizer files load with
`AutoTokenizer` and give the ids fivefold trained on."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import write_final_weights
from fivefold.config import Config, load_config
from fivefold.data.sources import ByteTokenizer
from fivefold.parallel.mesh import Mesh
from fivefold.train import build


def _run_with_weights(run: Path, tokenizer: str = "bytes") -> Config:
    config = load_config("tiny")
    config = config.replace(model=dataclasses.replace(config.model, layers=1),
                            data=dataclasses.replace(config.data, tokenizer=tokenizer))
    model = build(config, Mesh.single(config.layout), torch.device("cpu"))
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    write_final_weights(model, run, 1)
    return config


def _export(run: Path, out: Path) -> tuple[int, str]:
    from fivefold.cli import main

    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = main(["convert", "export", "--run-dir", str(run), "--out", str(out)])
    return code, log.getvalue()


def test_a_byte_tokenizer_run_exports_its_eos_and_a_tokenizer_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    _run_with_weights(tmp_path / "run")
    code, log = _export(tmp_path / "run", tmp_path / "hf")
    assert code == 0, log
    assert "AutoTokenizer" in log
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == 0 and hf_config["bos_token_id"] is None  # byte 0 ends documents
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return 'héllo ✓'\x00"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 0 and tokenizer.bos_token_id is None and len(tokenizer) == 256


def _hf_tokenizer_folder(folder: Path) -> None:
    """A small word-level tokenizer.json with <s>=1 and </s>=2 moved to ids 5 and 6, and its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "<s>": 5, "</s>": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def test_a_hugging_face_tokenizer_run_exports_that_tokenizer_and_its_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    _hf_tokenizer_folder(tmp_path / "tok")
    _run_with_weights(tmp_path / "run", tokenizer=str(tmp_path / "tok"))
    code, log = _export(tmp_path / "run", tmp_path / "hf")
    assert code == 0, log
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (5, 6)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (5, 6)


def test_a_tokenizer_gone_since_training_still_exports_the_weights_and_says_so(tmp_path):
    _run_with_weights(tmp_path / "run", tokenizer=str(tmp_path / "gone" / "tokenizer.json"))
    code, log = _export(tmp_path / "run", tmp_path / "hf")
    assert code == 0, log
    assert "no tokenizer written" in log and "gone" in log
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["bos_token_id"] is None and hf_config["eos_token_id"] is None
