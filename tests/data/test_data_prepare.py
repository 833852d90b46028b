"""`fivefold data prepare`, prepared datasets, blends and data-file errors (no hub: tests make their data)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.data.blend import BlendIndex, parse_blend
from fivefold.cli import main
from fivefold.config import load_config
from fivefold.data.indexed import IndexedDataset
from fivefold.data.loader import check_data_source, open_training_data
from fivefold.data.packing import permute
from fivefold.data.prepare import prepare
from fivefold.data.textfiles import DataError

TEXTS = ["the first document", "", "a second, longer document: déjà vu", "third\nwith two lines", "4"]


def _bytes_of(texts: list[str]) -> list[int]:
    """The expected stream with the byte tokenizer: every non-empty document, then EOS (0)."""
    return [t for text in texts if text for t in list(text.encode()) + [0]]


def _write_inputs(root):
    """The same documents as .txt files, .jsonl, .parquet, .csv and a saved Hugging Face dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    kept = [t for t in TEXTS if t]
    (root / "txt").mkdir()
    for i, text in enumerate(kept):
        (root / "txt" / f"{i:02d}.txt").write_text(text)
    (root / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    pq.write_table(pa.table({"body": TEXTS}), root / "docs.parquet", row_group_size=2)
    Dataset.from_dict({"body": TEXTS}).to_csv(str(root / "docs.csv"), index=False)
    Dataset.from_dict({"body": TEXTS}).save_to_disk(str(root / "saved"))
    return {"txt": (root / "txt", "text"), "jsonl": (root / "docs.jsonl", "body"), "parquet": (root / "docs.parquet", "body"),
            "csv": (root / "docs.csv", "body"), "saved": (root / "saved", "body")}


def _stream(path) -> list[int]:
    dataset = IndexedDataset(path)
    return dataset.read(0, dataset.num_tokens).tolist()


def test_every_input_kind_gives_the_same_stream(tmp_path):
    for kind, (path, field) in _write_inputs(tmp_path).items():
        out = tmp_path / f"prepared-{kind}"
        result = prepare([str(path)], out, field=field, workers=1)
        expected = _bytes_of(TEXTS) if kind != "csv" else _bytes_of([t for t in TEXTS])  # csv reads "" as empty too
        assert _stream(out) == expected, kind
        assert result.documents == 4 and result.tokens == len(expected)
        dataset = IndexedDataset(out)
        assert dataset.manifest["dtype"] == "uint16" and dataset.manifest["tokenizer"]["kind"] == "bytes"
        ends = [dataset.document_end(d) for d in range(dataset.num_documents)]
        assert ends == np.cumsum([len(t.encode()) + 1 for t in TEXTS if t]).tolist()


def _tokenizer_folder(root, words: list[str]):
    """A word-level tokenizer.json and a model folder's tokenizer_config.json, made here."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return root


def test_hugging_face_tokenizer_and_model_folder_with_bos_and_eos(tmp_path):
    folder = _tokenizer_folder(tmp_path / "model", ["hello", "world", "again"])
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n{"text": "again"}\n')
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "with-folder", tokenizer=str(folder), workers=1)
    assert _stream(tmp_path / "with-folder") == [1, 3, 4, 2, 1, 5, 2]  # <s> hello world </s> <s> again </s>
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "no-bos", tokenizer=str(folder / "tokenizer.json"), use_bos=False, workers=1)
    assert _stream(tmp_path / "no-bos") == [3, 4, 2, 5, 2]
    identity = IndexedDataset(tmp_path / "no-bos").tokenizer
    assert identity["kind"] == "huggingface" and identity["vocab_size"] == 6 and identity["eos_id"] == 2


def test_parallel_preparation_is_deterministic_and_resumable(tmp_path):
    for i in range(4):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i}.jsonl").write_text("".join(json.dumps({"text": f"doc {i}-{j} " * j}) + "\n" for j in range(1, 30)))
    serial = prepare([str(tmp_path / "in")], tmp_path / "serial", workers=1)
    parallel = prepare([str(tmp_path / "in")], tmp_path / "parallel", workers=2)
    manifest = lambda p: {k: v for k, v in json.loads((p / "manifest.json").read_text()).items() if k != "inputs"}
    assert serial.shards == 4 and manifest(tmp_path / "serial") == manifest(tmp_path / "parallel")
    # An interruption: one shard never finished (its record is written last).
    (tmp_path / "serial" / "shard_00002.json").unlink()
    (tmp_path / "serial" / "shard_00002.bin").write_bytes(b"partial")
    resumed = prepare([str(tmp_path / "in")], tmp_path / "serial", workers=1)
    assert resumed.reused == 3 and resumed.new_tokens == json.loads((tmp_path / "serial" / "manifest.json").read_text())["shards"][2]["tokens"]
    assert manifest(tmp_path / "serial") == manifest(tmp_path / "parallel")
    with pytest.raises(DataError, match="holds another preparation"):
        prepare([str(tmp_path / "in" / "0.jsonl")], tmp_path / "serial", workers=1)


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"document number {i} " * (1 + i % 5)}) + "\n" for i in range(200)))
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "p", workers=1)
    return tmp_path / "p"


def _tiny(source, *extra):
    return load_config("tiny", [f"data.source={source}", *extra])


def test_truncated_changed_and_foreign_datasets_are_detected_before_training(prepared, tmp_path):
    check_data_source(_tiny(prepared))
    shard = prepared / "shard_00000.bin"
    original = shard.read_bytes()
    data = bytearray(original)
    data[100] ^= 1
    shard.write_bytes(bytes(data))  # same size, new modification time
    with pytest.raises(DataError, match="shard_00000.bin was changed after preparation"):
        check_data_source(_tiny(prepared))
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="truncated or altered"):
        check_data_source(_tiny(prepared))
    shard.write_bytes(original)
    check_data_source(_tiny(prepared))  # restored: accepted again
    folder = _tokenizer_folder(tmp_path / "tok", ["document", "number"])
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        check_data_source(_tiny(prepared, f"data.tokenizer={folder / 'tokenizer.json'}"))


def test_sampler_reads_windows_of_the_stream_and_splits_by_documents(prepared):
    config = _tiny(prepared, "data.document_mask=true", "data.val_fraction=0.1")
    data, sampler = open_training_data(config)
    dataset = data.datasets[0]
    stream = torch.from_numpy(dataset.read(0, dataset.num_tokens))
    inputs, targets, documents = sampler.local_rows_at(3, 0, 1)
    assert inputs.shape == (8, 32) and torch.equal(inputs[:, 1:], targets[:, :-1])
    boundary = dataset.document_end(dataset.num_documents - 21)  # the last 10% of 200 documents are held out
    ends = np.array([dataset.document_end(d) for d in range(dataset.num_documents)])
    starts = sampler.window_of(np.arange(24, 32)) * 32  # step 3's samples
    assert starts.max() + 33 <= boundary
    for row, docs, start in zip(inputs, documents, starts):
        assert torch.equal(row, stream[start : start + 32])
        assert docs.tolist() == np.searchsorted(ends, np.arange(start, start + 32), side="right").tolist()
    val = data.validation_sampler(32, 8, 1)
    assert val.start == boundary  # validation windows start after the last training document
    parts = [sampler.local_rows_at(5, r, 4)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), sampler.global_batch_at(5)[0])  # ranks read only their rows


def test_permutation_is_a_bijection_and_the_batch_a_function_of_the_step(prepared):
    for n in (1, 2, 7, 100, 1000):
        assert sorted(permute(np.arange(n), n, seed=3, epoch=1).tolist()) == list(range(n))
    assert permute(np.arange(100), 100, 3, 0).tolist() != permute(np.arange(100), 100, 3, 1).tolist()
    a = open_training_data(_tiny(prepared))[1].global_batch_at(9)[0]
    b = open_training_data(_tiny(prepared))[1].global_batch_at(9)[0]
    assert torch.equal(a, b)


def test_blend_fractions_follow_the_weights(prepared, tmp_path):
    index = BlendIndex([0.7, 0.2, 0.1])
    index.extend_to(1000)
    for n in (10, 100, 1000):
        counts = np.bincount(index.dataset[:n], minlength=3)
        assert np.all(np.abs(counts - np.array([0.7, 0.2, 0.1]) * n) <= 1)
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"text": "zzzz " * 20}) + "\n" for _ in range(50)))
    prepare([str(tmp_path / "other.jsonl")], tmp_path / "other", workers=1)
    _, sampler = open_training_data(_tiny(f"3 {prepared} 1 {tmp_path / 'other'}"))
    rows = torch.cat([sampler.global_batch_at(k)[0] for k in range(8)])
    from_other = int((rows == ord("z")).any(dim=1).sum())
    assert from_other == 16  # a quarter of 64 rows
    with pytest.raises(DataError, match="must be a positive number"):
        parse_blend(f"0.5 {prepared} 0 {tmp_path / 'other'}")


def test_checkpoint_records_the_data_position(prepared, tmp_path):
    from fivefold.data.packing import data_position

    _, sampler = open_training_data(_tiny(prepared))
    position = data_position(sampler, 7)
    assert position["sample"] == 56 and position["dataset"] == IndexedDataset(prepared).fingerprint
    assert position["epoch"] == 56 // sampler.windows


def _bad_inputs(tmp_path):
    """(file content as bytes, file name, the words the message must hold)."""
    return [
        (b"", "empty.txt", "empty.txt is empty"),
        (b"text\n\x00\x01binary", "bin.txt", "bin.txt:2 holds a NUL byte"),
        (b"ok line\nbad \xff\xfe here", "latin.txt", "latin.txt:2 is not UTF-8"),
        (b'{"text": "a"}\n[1, 2]\n', "array.jsonl", "array.jsonl:2 is a JSON list, not an object"),
        (b'{"text": "a"}\n{"body": "b"}\n', "nofield.jsonl", "nofield.jsonl:2 has no field 'text'"),
        (b'{"text": "a"}\n{"text": oops}\n', "broken.jsonl", "broken.jsonl:2 is not valid JSON"),
        (b'{"text": 5}\n', "number.jsonl", "number.jsonl:1: field 'text' is a int, not text"),
        (b"not parquet", "junk.parquet", "junk.parquet is not a readable Parquet file"),
    ]


def test_bad_data_files_name_file_and_line(tmp_path, capsys):
    for content, name, message in _bad_inputs(tmp_path):
        path = tmp_path / name
        path.write_bytes(content)
        for argv in (["data", "prepare", str(path), "--out", str(tmp_path / "out"), "--workers", "1", "--overwrite"],
                     ["train", "--config", "tiny", "--train.steps", "1", f"--data.source={path}"]):
            if name.endswith(".parquet") and argv[0] == "train":
                continue  # raw training sources are .txt/.jsonl; Parquet is prepared first
            assert main(argv) == 2, (name, argv[0])
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err, (name, argv[0], err)


def test_garbage_tokenizer_unreadable_file_and_missing_source(tmp_path, capsys, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{ not a tokenizer")
    (tmp_path / "d.txt").write_text("text")
    cases = [
        (["data", "prepare", str(tmp_path / "d.txt"), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "tokenizer.json")],
         "tokenizer.json is not a Hugging Face tokenizer.json"),
        (["data", "prepare", str(tmp_path / "nothing.jsonl"), "--out", str(tmp_path / "o")], "nothing.jsonl does not exist"),
    ]
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    cases.append((["data", "prepare", str(locked), "--out", str(tmp_path / "o2")], "locked.txt cannot be read (Permission denied)"))
    real_read_bytes = Path.read_bytes

    def read_bytes(self):  # a file this user may not read (chmod 0 would not stop root)
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    # Under a multi-process layout, a missing data file is reported before any process starts.
    monkeypatch.setattr("fivefold.job.launch.run_job", lambda *a: pytest.fail("processes were started"))
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--config", "tiny", "--layout", "dp=2", "--data.source", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert main(["train", "--config", "tiny", "--layout", "dp=2", "--data.document_mask", "true"]) == 2
    assert "document_mask needs a prepared dataset" in capsys.readouterr().err
    small_vocab = ["train", "--config", "tiny", "--layout", "dp=2", "--model.vocab_size", "100"]
    assert main(small_vocab) == 2 and "256 tokens but model.vocab_size=100" in capsys.readouterr().err


def test_resume_on_prepared_data_continues_exactly(prepared, tmp_path):
    """3 steps straight vs 1, checkpoint, resume for 2, with document masking: bitwise equal."""
    import shutil

    from fivefold.checkpoint import checkpoint_root, final_weights_of
    from fivefold.run import run_training

    config = _tiny(prepared, "data.document_mask=true", "model.layers=1", "train.steps=3", "checkpoint.interval=1")
    straight = run_training(config, tmp_path / "straight", show_progress=False)
    step1 = checkpoint_root(tmp_path / "straight") / "step_000001"
    saved = json.loads(next(step1.glob("manifest*.json")).read_text())["data"]
    assert saved["sample"] == 8 and saved["dataset"] == IndexedDataset(prepared).fingerprint
    shutil.copytree(step1, checkpoint_root(tmp_path / "resumed") / "step_000001")
    resumed_config = config.replace(checkpoint=config.checkpoint.__class__(interval=1, resume=True))
    later = run_training(resumed_config, tmp_path / "resumed", show_progress=False)
    assert [r["loss"] for r in later] == [r["loss"] for r in straight[1:]]
    a, b = (final_weights_of(tmp_path / name).read_all() for name in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sequence_longer_than_every_document_gets_a_note(prepared):
    longest = json.loads((prepared / "manifest.json").read_text())["longest_document"]
    assert longest == len("document number 199 " * 5) + 1  # the text and its EOS
    data, _ = open_training_data(_tiny(prepared, "data.document_mask=true", f"train.seq_len={2 * longest}"))
    assert f"longer than every document (the longest has {longest} tokens)" in data.notes[0]
    assert not open_training_data(_tiny(prepared, "data.document_mask=true", "train.seq_len=32"))[0].notes
