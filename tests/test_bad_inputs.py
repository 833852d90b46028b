"""Careless input, table-driven: every bad argument, config value, layout, run folder, checkpoint,
generate, convert, plan and parity input gets a clear error: the expected exit code, no
traceback, the words that say what to change, and whatever was saved before is unchanged.

The CLI runs in this process (`fivefold.cli.main(argv)` with stdout/stderr captured), so the
whole table takes seconds; one case runs the real entry point in a subprocess. Data-file
errors are covered by the data tests.

`python tests/test_bad_inputs.py` runs the table as a survey instead of a test and prints how
many cases got a clear error, a traceback, a hang, lost data or were accepted; with
PYTHONPATH pointing at another checkout it surveys that code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", "tiny", "--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4",
         "--train.steps", "2", "--train.eval_interval", "0"]
TRAIN = ["train", *SMALL, "--run-dir", "{d}/new"]
# The reference run finished its 2 steps: resuming it asks for one more (a finished run is refused).
RESUME = ["train", *SMALL, "--run-dir", "{d}/run", "--resume", "--train.steps", "3"]
PARITY = ["parity", "--config", "tiny", "--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4"]


@dataclass
class Case:
    """argv may name {d} (the case's folder) and {d}/run (a copy of a finished run when `run`)."""

    name: str
    argv: list[str]
    code: int
    words: tuple[str, ...]
    run: bool = False
    prepare: Callable[[Path], None] | None = None
    keep: str | None = None  # a path under {d} that must be unchanged afterwards
    limit_file_bytes: int = 0  # simulate a full disk: writes beyond this many bytes fail


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    crashed: str = ""  # the traceback of an exception that escaped main()
    hung: bool = False
    lost: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------- preparations


def _write(relative: str, content: str | bytes) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        path = d / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return prepare


def _mkdir(relative: str) -> Callable[[Path], None]:
    return lambda d: (d / relative).mkdir(parents=True, exist_ok=True)


def _hold_lock(d: Path) -> None:
    """Another live run holds the run folder's lock (an open file description we never close)."""
    fd = os.open(d / "run" / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 4242 on host elsewhere\n")
    HELD_LOCKS.append(fd)


HELD_LOCKS: list[int] = []


def _manifest_checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _only_newest_checkpoint(d: Path) -> Path:
    root = d / "run" / "checkpoints"
    steps = sorted(root.iterdir())
    for old in steps[:-1]:
        shutil.rmtree(old)
    return steps[-1]


def _forge(edit: Callable[[dict, Path], None]) -> Callable[[Path], None]:
    """Edit the manifest of the run's only checkpoint and re-sign it, as a forger would."""
    def prepare(d: Path) -> None:
        path = _only_newest_checkpoint(d)
        manifest = json.loads((path / "manifest.json").read_text())
        edit(manifest, path)
        manifest["checksum"] = _manifest_checksum(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
    return prepare


def _embed_entry(manifest: dict) -> dict:
    return next(e for e in manifest["entries"] if e["name"] == "embed.weight" and e["state"] == "param")


def _file_outside(manifest: dict, path: Path) -> None:
    """The rank file moved outside the checkpoint folder, the manifest pointing there."""
    outside = path.parents[2] / "outside.safetensors"
    shutil.move(path / "rank_00000.safetensors", outside)
    name = "../../../outside.safetensors"
    manifest["files"][name] = manifest["files"].pop("rank_00000.safetensors")
    for entry in manifest["entries"]:
        entry["file"] = name


def _absolute_file(manifest: dict, path: Path) -> None:
    name = str(path / "rank_00000.safetensors")
    manifest["files"][name] = manifest["files"].pop("rank_00000.safetensors")
    for entry in manifest["entries"]:
        entry["file"] = name


def _set(key: str, value: object) -> Callable[[dict, Path], None]:
    return lambda manifest, path: manifest.__setitem__(key, value)


def _entry(key: str, value: object) -> Callable[[dict, Path], None]:
    return lambda manifest, path: _embed_entry(manifest).__setitem__(key, value)


def _drop_entry_key(key: str) -> Callable[[dict, Path], None]:
    return lambda manifest, path: _embed_entry(manifest).pop(key)


def _swap_tensor(manifest: dict, path: Path) -> None:
    """The rank file re-written with the embedding transposed; sizes and sums updated to match."""
    from safetensors.torch import load_file, save_file

    file = path / "rank_00000.safetensors"
    tensors = load_file(str(file))
    key = _embed_entry(manifest)["key"]
    tensors[key] = tensors[key].t().contiguous()
    save_file(tensors, str(file))
    manifest["files"]["rank_00000.safetensors"] = {"sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
                                                   "bytes": file.stat().st_size}


def _config_value(section: str, key: str, value: object) -> Callable[[dict, Path], None]:
    return lambda manifest, path: manifest["config"][section].__setitem__(key, value)


def _edit_run_config(key: str, value: object) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        path = d / "run" / "config.json"
        config = json.loads(path.read_text())
        config["model"][key] = value
        path.write_text(json.dumps(config))
    return prepare


def _nan_in_final_weights(d: Path) -> None:
    """The run's final weights with one NaN, as a diverged run leaves them."""
    from safetensors.torch import load_file, save_file

    file = d / "run" / "model.safetensors"
    tensors = load_file(str(file))
    name = next(k for k in sorted(tensors) if tensors[k].is_floating_point())
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(file))


def _export_hf(d: Path) -> None:
    """A Hugging Face Llama folder holding the run's weights (written directly: no transformers import)."""
    from safetensors.torch import load_file, save_file

    from fivefold.config import config_from_dict
    from fivefold.checkpoint.hf import state_dict_to_hf

    m = config_from_dict(json.loads((d / "run" / "config.json").read_text())).model
    hf = d / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": m.vocab_size, "hidden_size": m.hidden, "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads, "num_key_value_heads": m.n_kv_heads, "intermediate_size": m.ffn,
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": m.tied_embeddings, "rope_theta": m.rope_theta,
    }))
    save_file(state_dict_to_hf(load_file(str(d / "run" / "model.safetensors")), m), str(hf / "model.safetensors"))


def _hf_with(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        _export_hf(d)
        edit(d / "hf")
    return prepare


def _hf_config(key: str, value: object) -> Callable[[Path], None]:
    def edit(hf: Path) -> None:
        config = json.loads((hf / "config.json").read_text())
        if value is None:
            config.pop(key)
        else:
            config[key] = value
        (hf / "config.json").write_text(json.dumps(config))
    return _hf_with(edit)


TOML_SMALL = ("[model]\nlayers = 2\nhidden = 64\nheads = 4\n"
              "[train]\nsteps = 2\nseq_len = 16\nglobal_batch = 4\neval_interval = 0\n")


def _toml(text: str) -> Callable[[Path], None]:
    """A config file: small settings (so that accepting it would not train for long), then `text`."""
    return _write("c.toml", TOML_SMALL + text)


# ------------------------------------------------------------------------------------- the table

CASES: list[Case] = [
    # ---- config values: range checks name the key and what is allowed
    *[Case(f"train.{k}={v}", [*TRAIN, f"--train.{k}", v], 2, (f"train.{k}", why)) for k, v, why in [
        ("lr", "nan", "finite"), ("lr", "inf", "finite"), ("lr", "-inf", "finite"), ("lr", "0", "greater than 0"),
        ("lr", "-0.1", "greater than 0"), ("seq_len", "0", "at least 1"), ("seq_len", "-5", "at least 1"),
        ("global_batch", "0", "at least 1"), ("global_batch", "-4", "at least 1"), ("steps", "0", "at least 1"),
        ("steps", "-3", "at least 1"), ("warmup_steps", "-1", "at least 0"), ("grad_clip", "-1", "at least 0"),
        ("grad_clip", "nan", "finite"), ("min_lr", "-1e-4", "at least 0"), ("weight_decay", "-0.1", "at least 0"),
        ("beta1", "1.0", "[0, 1)"), ("beta2", "-0.5", "[0, 1)"), ("eps", "0", "greater than 0"),
        ("seed", "-1", "[0, 2147483648)"), ("seed", "99999999999999999999", "[0, 2147483648)"),
        ("eval_interval", "-1", "at least 0"), ("eval_batches", "0", "at least 1"), ("log_interval", "0", "at least 1"),
        ("device", "tpu", "auto, cpu, cuda"), ("steps", "many", "expected an integer"), ("lr", "fast", "expected a number"),
        ("dtype", "fp8", "fp32, bf16"), ("seq_len", "4096", "max_seq_len"),
    ]],
    *[Case(f"model.{k}={v}", [*TRAIN, f"--model.{k}", v], 2, (f"model.{k}", why)) for k, v, why in [
        ("hidden", "-64", "at least 1"), ("hidden", "0", "at least 1"), ("layers", "0", "at least 1"),
        ("heads", "0", "at least 1"), ("vocab_size", "0", "at least 1"), ("kv_heads", "-1", "at least 0"),
        ("ffn_hidden", "-1", "at least 0"), ("max_seq_len", "0", "at least 1"), ("norm_eps", "0", "greater than 0"),
        ("rope_theta", "-1", "greater than 0"), ("init_std", "-0.1", "at least 0"), ("num_experts", "-1", "at least 0"),
        ("capacity_factor", "nan", "finite"), ("aux_loss_coef", "-1", "at least 0"), ("name", "../../escape", "plain name"),
        ("name", "a/b", "plain name"), ("name", ".hidden", "plain name"), ("tied_embeddings", "maybe", "true or false"),
    ]],
    *[Case(f"{k}={v}", [*TRAIN, f"--{k}", v], 2, (why,) if k.startswith("bogus") else (k, why)) for k, v, why in [
        ("checkpoint.interval", "-1", "at least 0"), ("checkpoint.keep", "0", "at least 1"),
        ("data.val_fraction", "0", "(0, 0.5)"), ("data.val_fraction", "0.9", "(0, 0.5)"),
        ("layout.bucket_mb", "inf", "finite"), ("train.stepz", "3", "unknown key"), ("bogus.key", "1", "unknown section 'bogus'"),
    ]],
    Case("huge model", [*TRAIN, "--model.hidden", "1048576", "--model.heads", "8192", "--model.layers", "64"], 1,
         ("parameters", "GB", "smaller model")),
    Case("world size 0", [*TRAIN, "--layout", "auto", "--world-size", "0"], 2, ("--world-size", "at least 1")),
    Case("config is a directory", ["train", "--config", "{d}"], 2, ("is a directory",)),
    Case("config file missing", ["train", "--config", "{d}/none.toml"], 2, ("does not exist",)),
    Case("unknown preset", ["train", "--config", "tinyy"], 2, ("no preset", "tiny")),
    Case("config not TOML", ["train", "--config", "{d}/c.toml"], 2, ("not valid TOML",), prepare=_toml("[data\nsource=")),
    Case("config binary", ["train", "--config", "{d}/c.toml"], 2, ("not valid TOML",),
         prepare=_write("c.toml", b"\xff\xfe\x00binary")),
    Case("config unknown section", ["train", "--config", "{d}/c.toml"], 2, ("unknown section",),
         prepare=_toml("[modle]\nhidden = 64\n")),
    Case("config section not a table", ["train", "--config", "{d}/c.toml"], 2, ("must be a table",),
         prepare=_write("c.toml", "model = 3\n")),
    Case("config value out of range", ["train", "--config", "{d}/c.toml"], 2, ("checkpoint.keep", "at least 1"),
         prepare=_toml("[checkpoint]\nkeep = -1\n")),
    Case("dotted flag without value", ["train", "--train.steps"], 2, ("needs a value",)),
    # ---- layouts
    *[Case(f"layout {text!r}", [*TRAIN, "--layout", text], 2, words) for text, words in [
        ("dp=2,dp=4", ("dp twice", "keep one")), ("dp", ("name=value",)), ("dp=", ("name=value",)),
        ("=2", ("name=value",)), (",", ("names no axis",)), ("dq=2", ("unknown key 'layout.dq'",)),
        ("dp=two", ("layout.dp", "expected an integer")), ("tp=3", ("tp=3 does not divide",)),
        ("dp=0", ("at least 1",)), ("pp=-1", ("at least 1",)), ("zero=5", ("ZeRO stage",)),
        ("dp=3", ("does not split over dp=3",)), ("ep=2,dp=2", ("Mixture-of-Experts",)),
        ("cp=3", ("not divisible",)), ("pp_schedule=magic", ("unknown",)),
    ]],
    # checked before any process is spawned
    Case("shard degree does not divide dp", [*TRAIN, "--layout", "dp=4,dp_shard=3,zero=2"], 2,
         ("layout.dp_shard=3 does not divide dp=4", "use one of 1, 2, 4")),
    Case("shard degree without ZeRO", [*TRAIN, "--layout", "dp=4,dp_shard=2"], 2,
         ("layout.dp_shard=2", "set layout.zero to 1, 2 or 3")),
    Case("dualpipev, too few micro-batches", [*TRAIN, "--model.layers", "4", "--layout", "pp=2,vpp=2,grad_accum=2,"
         "pp_schedule=dualpipev"], 2, ("needs at least 2 x pp - 1 = 3 micro-batches", "use grad_accum >= 3")),
    Case("dualpipev, one chunk per rank", [*TRAIN, "--layout", "pp=2,pp_schedule=dualpipev"], 2, ("set vpp=2",)),
    Case("2-process layout, bad lr", [*TRAIN, "--layout", "dp=2", "--train.lr", "nan"], 2, ("train.lr", "finite")),
    Case("2-process layout, busy folder", [*TRAIN[:-1], "{d}/run", "--layout", "dp=2"], 2, ("not empty", "--resume"),
         run=True, keep="run"),
    # ---- run folders
    Case("non-empty run folder", [*TRAIN[:-1], "{d}/run"], 2, ("not empty", "--resume", "--overwrite"), run=True, keep="run"),
    Case("run folder is a file", [*TRAIN[:-1], "{d}/f"], 2, ("is a file",), prepare=_write("f", "x")),
    Case("resume and overwrite", [*RESUME, "--overwrite"], 2, ("give only one",), run=True, keep="run"),
    Case("resume a finished run", ["train", "--run-dir", "{d}/run", "--resume"], 2,
         ("has finished 2 steps", "--train.steps N with N larger than 2"), run=True, keep="run"),
    Case("overwrite a folder that is no run", [*TRAIN[:-1], "{d}/mine", "--overwrite"], 2, ("does not hold one",),
         prepare=_write("mine/notes.txt", "keep me"), keep="mine"),
    Case("run folder in use", [*RESUME], 2, ("in use by another run", "pid 4242"), run=True, prepare=_hold_lock,
         keep="run/checkpoints"),
    Case("run folder cannot be created", [*TRAIN[:-1], "/proc/fivefold/run"], 2, ("cannot create run folder",)),
    Case("disk full at a checkpoint", [*RESUME, "--train.steps", "3", "--checkpoint.interval", "1"], 1,
         ("could not write", "step_000003", "step_000002", "is kept"), run=True, keep="run/checkpoints/step_000002",
         limit_file_bytes=200_000),
    Case("loss becomes NaN", [*RESUME, "--train.steps", "5", "--train.lr", "1e30", "--checkpoint.interval", "100"], 1,
         ("diverged at step", "train.lr", "step_000002", "is kept"), run=True, keep="run/checkpoints"),
    # ---- checkpoints from elsewhere: nothing is trusted before it is checked
    Case("manifest names a file outside", RESUME, 2, ("outside its checkpoint folder",), run=True,
         prepare=_forge(_file_outside), keep="run"),
    Case("manifest names an absolute path", RESUME, 2, ("outside its checkpoint folder",), run=True,
         prepare=_forge(_absolute_file), keep="run"),
    Case("manifest forged huge shape", RESUME, 2, ("embed.weight", "[100000000, 100000000]"), run=True,
         prepare=_forge(_entry("global_shape", [100000000, 100000000])), keep="run"),
    Case("manifest forged offsets", RESUME, 2, ("outside its tensor",), run=True,
         prepare=_forge(_entry("offsets", [5000, 0])), keep="run"),
    Case("manifest forged flat range", RESUME, 2, ("flat range",), run=True,
         prepare=_forge(_entry("flat", [0, 10**12])), keep="run"),
    Case("manifest negative offsets", RESUME, 2, ("malformed global_shape",), run=True,
         prepare=_forge(_entry("offsets", [-1, 0])), keep="run"),
    Case("manifest step not a number", RESUME, 2, ("malformed step",), run=True,
         prepare=_forge(_set("step", "x")), keep="run"),
    Case("manifest files not a table", RESUME, 2, ("lacks its files",), run=True,
         prepare=_forge(_set("files", [])), keep="run"),
    Case("manifest entry without file", RESUME, 2, ("lacks its key, state, name or file",), run=True,
         prepare=_forge(_drop_entry_key("file")), keep="run"),
    Case("manifest unknown rng kind", RESUME, 2, ("malformed rng",), run=True,
         prepare=_forge(_set("rng", {"0": ["gpu"]})), keep="run"),
    Case("stored tensor shape differs", RESUME, 2, ("the manifest says",), run=True,
         prepare=_forge(_swap_tensor), keep="run"),
    Case("manifest config out of range", RESUME, 2, ("model.hidden", "at least 1"), run=True,
         prepare=_forge(_config_value("model", "hidden", -1)), keep="run"),
    Case("manifest not JSON", RESUME, 2, ("not valid JSON",), run=True,
         prepare=lambda d: (_only_newest_checkpoint(d) / "manifest.json").write_text("{oops"), keep="run"),
    Case("checkpoint of another model", [*RESUME, "--model.hidden", "32", "--model.ffn_hidden", "64"], 2,
         ("different model", "hidden"), run=True, keep="run"),
    # ---- generate
    Case("generate negative tokens", ["generate", "--run", "{d}/run", "--max-new-tokens", "-1"], 2, ("--max-new-tokens",),
         run=True),
    Case("generate negative temperature", ["generate", "--run", "{d}/run", "--temperature", "-0.5"], 2,
         ("--temperature",), run=True),
    Case("generate nan temperature", ["generate", "--run", "{d}/run", "--temperature", "nan"], 2, ("--temperature",),
         run=True),
    Case("generate huge seed", ["generate", "--run", "{d}/run", "--seed", str(2**70)], 2, ("--seed", "64 bits"), run=True),
    Case("generate tokens not a number", ["generate", "--run", "{d}/run", "--max-new-tokens", "many"], 2,
         ("invalid int value",)),
    Case("generate missing run", ["generate", "--run", "{d}/none"], 2, ("not a folder",)),
    Case("generate run is a file", ["generate", "--run", "{d}/f"], 2, ("not a folder",), prepare=_write("f", "x")),
    Case("generate run without weights", ["generate", "--run", "{d}/empty"], 2, ("model.safetensors is missing",),
         prepare=_mkdir("empty")),
    Case("generate corrupt weights", ["generate", "--run", "{d}/run"], 2, ("cannot be read",), run=True,
         prepare=_write("run/model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")),
    Case("generate weights hold NaN", ["generate", "--run", "{d}/run", "--max-new-tokens", "2"], 2,
         ("hold NaN or inf", "/run", "convert export"), run=True, prepare=_nan_in_final_weights, keep="run"),
    Case("generate config not JSON", ["generate", "--run", "{d}/run"], 2, ("not the config.json",), run=True,
         prepare=_write("run/config.json", "{nope")),
    Case("generate weights of another shape", ["generate", "--run", "{d}/run"], 2, ("does not match",), run=True, prepare=_edit_run_config("hidden", 32)),
    Case("generate huge config", ["generate", "--run", "{d}/run"], 2, ("parameters", "more than this machine"),
         run=True, prepare=_edit_run_config("layers", 10**9)),
    Case("generate config out of range", ["generate", "--run", "{d}/run"], 2, ("model.layers", "at least 1"), run=True,
         prepare=_edit_run_config("layers", -2)),
    # ---- convert
    Case("export over a run", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/run"], 2,
         ("holds a training run",), run=True, keep="run"),
    Case("export over another run", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/other"], 2,
         ("holds a training run",), run=True, prepare=lambda d: shutil.copytree(d / "run", d / "other"), keep="other"),
    Case("export into a non-empty folder", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/docs"], 2,
         ("not empty",), run=True, prepare=_write("docs/readme.txt", "mine"), keep="docs"),
    Case("export onto a file", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/f"], 2, ("is a file",),
         run=True, prepare=_write("f", "mine"), keep="f"),
    Case("export from nothing", ["convert", "export", "--run-dir", "{d}/none", "--out", "{d}/hf"], 2,
         ("neither a checkpoint",)),
    Case("export a missing step", ["convert", "export", "--run-dir", "{d}/run", "--step", "99", "--out", "{d}/hf"], 2,
         ("step 99",), run=True),
    Case("export forged huge shape", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/hf"], 2,
         ("embed.weight", "[100000000, 100000000]"), run=True,
         prepare=_forge(_entry("global_shape", [100000000, 100000000])), keep="run"),
    Case("export forged huge config", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/hf"], 2,
         ("parameters", "more than this machine"), run=True, prepare=_forge(_config_value("model", "layers", 10**9)),
         keep="run"),
    Case("export forged file outside", ["convert", "export", "--run-dir", "{d}/run", "--out", "{d}/hf"], 2,
         ("skipping", "outside its checkpoint folder", "neither a checkpoint"), run=True,
         prepare=lambda d: (_forge(_file_outside)(d), (d / "run" / "model.safetensors").unlink()), keep="run"),
    Case("import from nothing", ["convert", "import", "--hf", "{d}/none", "--run-dir", "{d}/new"], 2,
         ("not a Hugging Face model folder",)),
    Case("import into an existing run", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/run"], 2,
         ("is not empty", "checkpoints", "new or empty --run-dir"), run=True, prepare=_export_hf, keep="run"),
    Case("import shapes differ from config", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/new"], 2,
         ("embed.weight", "[256, 64]", "[300, 64]"), run=True, prepare=_hf_config("vocab_size", 300)),
    Case("import config not JSON", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/new"], 2,
         ("not valid JSON",), run=True, prepare=_hf_with(lambda hf: (hf / "config.json").write_text("{x"))),
    Case("import garbage weights", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/new"], 2,
         ("cannot be read as safetensors",), run=True,
         prepare=_hf_with(lambda hf: (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad"))),
    Case("import unknown model type", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/new"], 2,
         ("model_type='gpt2'",), run=True, prepare=_hf_config("model_type", "gpt2")),
    Case("import config lacks a size", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/new"], 2,
         ("hidden_size=None", "positive integer"), run=True, prepare=_hf_config("hidden_size", None)),
    Case("import negative size", ["convert", "import", "--hf", "{d}/hf", "--run-dir", "{d}/new"], 2,
         ("num_hidden_layers=-1", "positive integer"), run=True, prepare=_hf_config("num_hidden_layers", -1)),
    Case("convert without direction", ["convert"], 2, ("export", "import")),
    # ---- plan
    *[Case(f"plan {' '.join(extra)}", ["plan", "--model", "llama3-8b", *extra], 2, words) for extra, words in [
        (["--gpus", "0"], ("--gpus", "at least 1")), (["--gpus", "-8"], ("--gpus", "at least 1")),
        (["--seq-len", "0"], ("--seq-len", "at least 1")), (["--global-batch", "0"], ("--global-batch", "at least 1")),
        (["--top", "0"], ("--top", "at least 1")), (["--gpus", "eight"], ("invalid int value",)),
        (["--precision", "fp64"], ("invalid choice",)),
    ]],
    Case("plan unknown model", ["plan", "--model", "gpt5"], 2, ("gpt5",)),
    # ---- parity
    *[Case(f"parity {' '.join(extra)}", [*PARITY, *extra], 2, words) for extra, words in [
        (["--layout", "tp=1", "--steps", "0"], ("--steps", "at least 1")),
        (["--layout", "tp=1", "--steps", "-2"], ("--steps", "at least 1")),
        (["--layout", "dp=2,dp=4"], ("dp twice",)), (["--layout", "tp=3"], ("does not divide",)),
        (["--layout", "dp=2", "--train.lr", "nan"], ("train.lr", "finite")),
        (["--layout", "dp=2", "--config", "tinyy"], ("no preset",)),
        (["--layout", "dp=2", "--steps", "x"], ("invalid int value",)), ([], ("--layout",)),
    ]],
]

if not torch.cuda.is_available():
    CASES.append(Case("cuda on a CPU build", [*TRAIN, "--train.device", "cuda"], 1, ("train.device=cuda", "train.device=cpu")))


# ------------------------------------------------------------------------------------ running


def snapshot(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes beyond `limit` bytes fail with EFBIG, as on a full disk (the signal is ignored)."""
    if not limit:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def run_case(case: Case, d: Path, trained: Path, seconds: int = 120) -> Outcome:
    """Run one case in this process; never raises (what escaped main() is recorded)."""
    from fivefold.cli import main

    if case.run:
        shutil.copytree(trained, d / "run")
    if case.prepare:
        case.prepare(d)
    before = snapshot(d / case.keep) if case.keep else {}
    argv = [a.replace("{d}", str(d)) for a in case.argv]
    out, err = io.StringIO(), io.StringIO()
    outcome = Outcome(None, "", "")
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    cwd = os.getcwd()
    try:
        os.chdir(d)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), file_size_limit(case.limit_file_bytes):
            outcome.code = main(argv)
    except SystemExit as exit:  # argparse
        outcome.code = exit.code if isinstance(exit.code, int) else 1
    except Hang:
        outcome.hung = True
    except BaseException:  # noqa: BLE001 - recording it is the point
        outcome.crashed = traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(cwd)
        while HELD_LOCKS:
            os.close(HELD_LOCKS.pop())
    outcome.out, outcome.err = out.getvalue(), err.getvalue()
    if case.keep:
        after = snapshot(d / case.keep) if (d / case.keep).exists() else {}
        outcome.lost = sorted(k for k in before if before[k] != after.get(k))
    return outcome


def classify(case: Case, outcome: Outcome) -> str:
    text = outcome.out + outcome.err
    if outcome.hung:
        return "hang"
    if outcome.crashed or "Traceback" in text:
        return "traceback"
    if outcome.lost:
        return "data lost"
    if outcome.code == case.code and all(w in text for w in case.words):
        return "clear error"
    return "accepted" if outcome.code == 0 else "unclear error"


def train_reference_run(d: Path) -> Path:
    """A finished tiny run: checkpoints of steps 1 and 2, final weights, metrics, config.json."""
    from fivefold.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["train", *SMALL, "--checkpoint.interval", "1", "--run-dir", str(d / "run")])
    assert code == 0
    return d / "run"


# ----------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train_reference_run(tmp_path_factory.mktemp("trained"))


def test_the_table_is_large_and_names_are_unique():
    assert len(CASES) >= 100
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_error_and_loses_nothing(case, trained, tmp_path):
    outcome = run_case(case, tmp_path, trained)
    verdict = classify(case, outcome)
    assert verdict == "clear error", (
        f"{verdict}: exit {outcome.code} (expected {case.code}), lost {outcome.lost}\n"
        f"{outcome.crashed}\nstdout: {outcome.out[-1500:]}\nstderr: {outcome.err[-1500:]}"
    )
    if case.name == "loss becomes NaN":
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]  # valid JSON: no bare NaN
        assert any(r["loss"] is None or r["grad_norm"] is None for r in records)
        assert not (tmp_path / "run" / "model.safetensors.part").exists()


def test_the_installed_entry_point_prints_no_traceback(tmp_path):
    """The same refusal through `python -m fivefold.cli`, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    job = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--train.lr", "nan", "--run-dir", "r"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 2 and "Traceback" not in job.stderr
    assert "train.lr=nan is not a finite number" in job.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was created


# ---------------------------------------------------------------------------------------- survey


def survey() -> dict[str, int]:
    """Run the whole table and count the verdicts (for comparing two versions of the code)."""
    import tempfile

    counts = {"tried": 0, "clear error": 0, "traceback": 0, "hang": 0, "data lost": 0, "accepted": 0,
              "unclear error": 0}
    with tempfile.TemporaryDirectory() as tmp:
        trained_run = train_reference_run(Path(tmp) / "trained")
        for i, case in enumerate(CASES):
            d = Path(tmp) / f"case{i}"
            d.mkdir()
            verdict = classify(case, run_case(case, d, trained_run, seconds=60))
            counts["tried"] += 1
            counts[verdict] += 1
            print(f"{verdict:13} {case.name}", flush=True)
    return counts


if __name__ == "__main__":
    print(json.dumps(survey(), indent=1))
