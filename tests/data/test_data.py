"""Corpus, tokenizers and the layout-independent sampler."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from fivefold.config import DataConfig
from fivefold.data.sources import (
    ByteTokenizer,
    DataError,
    Sampler,
    embedded_text,
    load_text,
    load_tokenizer,
    load_tokens,
    micro_batches,
)


def test_embedded_corpus_is_shipped_with_its_licence():
    from fivefold.data.sources import CORPUS_DIR

    text = embedded_text()
    assert 1_000_000 < len(text) < 5_000_000
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (CORPUS_DIR / "CORPUS_LICENSE.txt").read_text()
    # identical on every installation: the shipped bytes have one fixed digest
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert digest == hashlib.sha256(embedded_text().encode()).hexdigest()


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "déjà vu — 中文"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256


def test_fast_byte_path_equals_encode():
    config = DataConfig(val_fraction=0.05)
    data = load_tokens(config, ByteTokenizer())
    text = embedded_text()
    head = torch.tensor(ByteTokenizer().encode(text[:1000]), dtype=torch.long)
    assert torch.equal(data.train[: len(head)], head)
    assert len(data.train) + len(data.val) == len(text.encode())


def test_global_batch_is_a_pure_function_of_step():
    tokens = torch.arange(10_000)
    a = Sampler(tokens, seq_len=16, global_batch=8, seed=3)
    b = Sampler(tokens, seq_len=16, global_batch=8, seed=3)
    for step in (0, 1, 7, 500):  # 500 wraps into later epochs
        xa, ya = a.global_batch_at(step)
        xb, yb = b.global_batch_at(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(a.global_batch_at(0)[0], a.global_batch_at(1)[0])


def test_data_parallel_ranks_split_the_global_batch():
    sampler = Sampler(torch.arange(10_000), seq_len=16, global_batch=8, seed=0)
    full, _ = sampler.global_batch_at(4)
    for dp in (1, 2, 4, 8):
        parts = [sampler.local_batch_at(4, r, dp)[0] for r in range(dp)]
        assert torch.equal(torch.cat(parts), full)


def test_micro_batches_keep_order():
    x = torch.arange(32).reshape(8, 4)
    mbs = micro_batches(x, x + 1, 4)
    assert len(mbs) == 4 and torch.equal(torch.cat([m[0] for m in mbs]), x)


def test_text_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from json"}) + "\n")
    text = load_text(DataConfig(source=str(tmp_path)))
    assert "hello world" in text and "from json" in text


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: DataConfig(source=str(p / "missing.txt")), "does not exist"),
        (lambda p: DataConfig(source=str(p)), "holds no .txt or .jsonl files"),
        (lambda p: (p / "x.jsonl").write_text("{oops\n") and DataConfig(source=str(p / "x.jsonl")), "not valid JSON"),
        (lambda p: (p / "y.jsonl").write_text('{"body": 1}\n') and DataConfig(source=str(p / "y.jsonl")),
         "has no field 'text'"),
    ],
)
def test_bad_sources_are_explained(tmp_path, setup, message):
    with pytest.raises(DataError, match=message):
        load_text(setup(tmp_path))


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_hf_tokenizer_from_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(str(path))
    assert loaded.vocab_size == 3 and loaded.encode("hello world") == [1, 2]


def test_too_little_data():
    with pytest.raises(DataError, match="fewer than one sequence"):
        Sampler(torch.arange(5), seq_len=16, global_batch=2, seed=0)
