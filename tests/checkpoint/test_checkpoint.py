"""Checkpoints: resharding by box intersection, atomic commit, corruption, resume, crash, export.

Pure unit tests check the reassembly of any region from any other partition (boxes, ZeRO
flat ranges, flat ranges inside tensor-parallel boxes, padding). Single-process runs check
bitwise resume, corruption handling and Hugging Face export; a 2-rank pool checks parallel
writes and cross-rank resharding; a torchrun job killed with SIGKILL checks automatic
restart. Cross-layout resume tests run when the strategy modules they need exist.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ShardSpec,
    assemble,
    checkpoint_root,
    clip_to_global,
    import_hf,
    list_checkpoints,
    read_manifest,
    resume_latest,
)
from fivefold.config import load_config
from fivefold.rules.layout import validate
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.sharding import Placement, Split
from fivefold.train import build

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ pure resharding (no processes)


def _region(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Ground truth: the elements of `spec` taken from the full tensor (zero padding allowed)."""
    padded = torch.zeros([max(g, o + n) for g, o, n in zip(full.shape, spec.offsets, spec.shape)] or [1])
    padded[tuple(slice(0, g) for g in full.shape)] = full
    box = padded[tuple(slice(o, o + n) for o, n in zip(spec.offsets, spec.shape))]
    if spec.flat is None:
        return box.clone()
    start, length = spec.flat
    return box.reshape(-1)[start : start + length].clone()


def _random_partition(shape: tuple[int, ...], rng: random.Random) -> list[ShardSpec]:
    """A random layout: a box grid (like tp x ep splits), each box maybe ZeRO-split into flat ranges."""
    dims = [rng.choice([1, 2, 3]) if n >= 3 else 1 for n in shape]
    specs = []
    for cell in _grid(shape, dims):
        offsets, box_shape = cell
        numel = math.prod(box_shape)
        pieces = rng.choice([1, 1, 2, 3])
        if pieces == 1:
            specs.append(ShardSpec("w", shape, offsets, box_shape))
            continue
        cuts = sorted(rng.sample(range(1, numel), min(pieces - 1, numel - 1)))
        bounds = [0, *cuts, numel]
        specs += [ShardSpec("w", shape, offsets, box_shape, (a, b - a)) for a, b in zip(bounds, bounds[1:])]
    return specs


def _grid(shape: tuple[int, ...], counts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Uneven boxes: every dim cut into `counts[d]` contiguous pieces."""
    per_dim = []
    for n, c in zip(shape, counts):
        edges = [round(i * n / c) for i in range(c + 1)]
        per_dim.append([(a, b - a) for a, b in zip(edges, edges[1:]) if b > a])
    cells = [((), ())]
    for options in per_dim:
        cells = [(o + (a,), s + (n,)) for o, s in cells for a, n in options]
    return cells


def test_any_partition_reassembles_any_other():
    """Boxes, flat ranges of whole tensors and flat ranges inside boxes, resharded both ways."""
    rng = random.Random(0)
    for case in range(40):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.choice([1, 2, 3])))
        full = torch.randn(shape, generator=torch.Generator().manual_seed(case))
        stored = [(s, _region(full, s)) for s in _random_partition(shape, rng)]
        rng.shuffle(stored)
        for target in _random_partition(shape, rng):
            out = torch.full(target.local_shape, float("nan"))
            assemble(target, stored, out)
            assert torch.equal(out, _region(full, target)), (case, target)


def test_padding_is_dropped_on_save_and_kept_on_load():
    """A vocabulary of 5 rows padded to 6 for tp=2 (rows 3..5 hold one padding row), loaded as tp=3 of 6."""
    full = torch.arange(10.0).view(5, 2)
    saved = []
    for index in range(2):
        placement = Placement("embed.weight", (5, 2), (Split(0, index, 2),), padded_shape=(6, 2))
        local = placement.take(full)
        saved.append(clip_to_global(ShardSpec.from_placement(placement), local))
    assert saved[1][0].shape == (2, 2) and saved[1][1].shape == (2, 2)  # padding row not stored
    placement = Placement("embed.weight", (5, 2), (Split(0, 2, 3),), padded_shape=(6, 2))
    out = torch.full((2, 2), -1.0)
    assemble(ShardSpec.from_placement(placement), saved, out)
    assert torch.equal(out[0], full[4]) and torch.equal(out[1], torch.tensor([-1.0, -1.0]))


def test_uncovered_elements_and_scalars():
    spec = ShardSpec("w", (4,), (0,), (4,))
    with pytest.raises(CorruptCheckpoint, match="lacks 2 elements of w"):
        assemble(spec, [(ShardSpec("w", (4,), (0,), (2,)), torch.ones(2))], torch.zeros(4))
    scalar = ShardSpec("s", (), (), ())
    out = torch.zeros(())
    assemble(scalar, [(ShardSpec("s", (), (), (), (0, 1)), torch.tensor([3.0]))], out)
    assert out.item() == 3.0


# --------------------------------------------------------------------- single-process training

SMALL = ["model.layers=2", "train.seq_len=16", "train.global_batch=4", "train.eval_interval=0"]


def small_config(preset: str, *overrides: str):
    return load_config(preset, SMALL + list(overrides))


def train_run(config, run_dir: Path, resume: bool = False) -> list[dict]:
    from fivefold.run import run_training

    config = config.replace(checkpoint=dataclasses.replace(config.checkpoint, resume=resume))
    return run_training(config, run_dir, show_progress=False)


def copy_checkpoints(run_dir: Path, dest: Path, steps: list[int]) -> Path:
    for step in steps:
        name = f"step_{step:06d}"
        shutil.copytree(checkpoint_root(run_dir) / name, checkpoint_root(dest) / name)
    return dest


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from fivefold.checkpoint import final_weights_of

    found = final_weights_of(run_dir)
    assert found is not None, f"{run_dir} has no final weights"
    return found.read_all()


def optimizer_states(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    reader = CheckpointReader(path, read_manifest(path))
    return {key: reader.read_full(*key) for key in reader.by_tensor}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """tiny with 2 layers trained 3 steps straight, a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("dense") / "run"
    config = small_config("tiny", "train.steps=3", "checkpoint.interval=1")
    records = train_run(config, run_dir)
    return config, run_dir, records


def test_resume_same_layout_is_bitwise(dense_run, tmp_path):
    """Train 3 straight vs 1, checkpoint, resume for 2: same losses, weights and optimizer state, bit for bit."""
    config, run_dir, records = dense_run
    resumed = copy_checkpoints(run_dir, tmp_path / "resumed", [1])
    later = train_run(config, resumed, resume=True)
    assert [r["step"] for r in later] == [1, 2]
    assert [r["loss"] for r in later] == [r["loss"] for r in records[1:]]
    straight, again = weights(run_dir), weights(resumed)
    assert sorted(straight) == sorted(again)
    assert all(torch.equal(straight[k], again[k]) for k in straight)
    final_a, final_b = (optimizer_states(checkpoint_root(d) / "step_000003") for d in (run_dir, resumed))
    assert any(state.startswith("optim.") for _, state in final_a)
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_resume_moe_with_tied_embeddings_is_bitwise(tmp_path):
    config = small_config("tiny-moe", "train.steps=3", "checkpoint.interval=1", "model.tied_embeddings=true",
                          "model.num_experts=4", "model.layers=1",
                          "model.router=sigmoid", "model.bias_update_rate=0.01")
    straight = tmp_path / "straight"
    train_run(config, straight)
    resumed = copy_checkpoints(straight, tmp_path / "resumed", [1])
    train_run(config, resumed, resume=True)
    a, b = weights(straight), weights(resumed)
    assert any(k.endswith("router.expert_bias") and a[k].abs().sum() > 0 for k in a)  # the buffer is state too
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_commit_is_atomic_and_keeps_the_last_k(dense_run, tmp_path):
    config, run_dir, _ = dense_run
    root = checkpoint_root(run_dir)
    assert [p.name for p in list_checkpoints(root)] == ["step_000003", "step_000002", "step_000001"]
    assert not list(root.glob(".tmp_*"))
    from fivefold.checkpoint import prune

    copy = copy_checkpoints(run_dir, tmp_path / "r", [1, 2, 3])
    (checkpoint_root(copy) / ".tmp_step_000004").mkdir()  # a write that crashed before its commit
    (checkpoint_root(copy) / ".tmp_step_000004" / "rank_00000.safetensors").write_bytes(b"partial")
    model = fresh_model(config)
    assert resume_latest(model, checkpoint_root(copy)) == 3  # the crashed write is invisible
    prune(checkpoint_root(copy), keep=2)
    assert [p.name for p in list_checkpoints(checkpoint_root(copy))] == ["step_000003", "step_000002"]
    assert not list(checkpoint_root(copy).glob(".tmp_*"))


def test_sigterm_checkpoints_and_stops_after_the_current_step(tmp_path, monkeypatch):
    import fivefold.run as run

    def step_then_terminate(model, sampler, step, **options):
        result = train_step(model, sampler, step, **options)
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    train_step = run.train_step
    monkeypatch.setattr(run, "train_step", step_then_terminate)
    handler_before = signal.getsignal(signal.SIGTERM)
    records = train_run(small_config("tiny", "train.steps=3"), tmp_path / "run")  # no interval: SIGTERM only
    assert len(records) == 1
    assert [p.name for p in list_checkpoints(checkpoint_root(tmp_path / "run"))] == ["step_000001"]
    assert not (tmp_path / "run" / "model.safetensors").exists()  # the run is not finished
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the run restores the previous handler


# ------------------------------------------------------------------------------------ corruption


def fresh_model(config):
    config = validate(config)
    return build(config, Mesh.single(config.layout), torch.device("cpu"))


def _truncate(path: Path) -> None:
    data = (path / "rank_00000.safetensors").read_bytes()
    (path / "rank_00000.safetensors").write_bytes(data[:-100])


def _flip_byte(path: Path) -> None:
    file = path / "rank_00000.safetensors"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _remove_rank_file(path: Path) -> None:
    (path / "rank_00000.safetensors").unlink()


def _edit_manifest(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["step"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))


def _remove_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()


@pytest.mark.parametrize(
    "damage, message",
    [
        (_truncate, "truncated or altered"),
        (_flip_byte, "does not match its sha256"),
        (_remove_rank_file, r"missing rank_00000.safetensors \(the shards of rank 0\)"),
        (_edit_manifest, "manifest.json was altered"),
        (_remove_manifest, "never completed"),
    ],
    ids=["truncated", "flipped-byte", "missing-rank-file", "edited-manifest", "no-manifest"],
)
def test_corrupt_newest_falls_back_to_previous(dense_run, tmp_path, capsys, damage, message):
    config, run_dir, _ = dense_run
    copy = copy_checkpoints(run_dir, tmp_path / "r", [2, 3])
    damage(checkpoint_root(copy) / "step_000003")
    model = fresh_model(config)
    assert resume_latest(model, checkpoint_root(copy)) == 2
    out = capsys.readouterr().out
    assert "skipping checkpoint step_000003" in out and re.search(message, out), out
    expected = optimizer_states(checkpoint_root(run_dir) / "step_000002")
    params = dict(model.chunks[0].named_parameters())
    assert all(torch.equal(params[name], t) for (name, state), t in expected.items() if state == "param")


def test_no_usable_checkpoint_stops_without_writing(dense_run, tmp_path):
    config, run_dir, _ = dense_run
    copy = copy_checkpoints(run_dir, tmp_path / "r", [3])
    _flip_byte(checkpoint_root(copy) / "step_000003")
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="no usable checkpoint.*does not match its sha256"):
        train_run(config, copy, resume=True)
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_checkpoint_of_another_model_is_refused(dense_run, tmp_path):
    config, run_dir, _ = dense_run
    copy = copy_checkpoints(run_dir, tmp_path / "r", [2, 3])
    other = small_config("tiny", "model.hidden=32", "model.ffn_hidden=64")
    with pytest.raises(IncompatibleCheckpoint, match="different model .*hidden: checkpoint 64 vs config 32"):
        resume_latest(fresh_model(other), checkpoint_root(copy))


# ---------------------------------------------------------------------------- Hugging Face export


def test_export_loads_in_transformers_with_same_logits_and_import_starts_a_run(dense_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from fivefold.tools.generate import load_trained

    from fivefold.cli import main

    config, run_dir, _ = dense_run
    assert main(["convert", "export", "--run-dir", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _ = load_trained(run_dir)  # the final weights, equal to the newest checkpoint's
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_model(input_ids=ids).logits - model(ids)[0]).abs().max() < 1e-5
    # Import the exported folder as the starting weights of a new run (fresh optimizer).
    new_run = tmp_path / "finetune"
    assert main(["convert", "import", "--hf", str(tmp_path / "hf"), "--run-dir", str(new_run)]) == 0
    with pytest.raises(CheckpointError, match="is not empty"):  # never overwrites a run
        import_hf(tmp_path / "hf", new_run)
    imported = load_config(str(new_run / "config.toml"))
    fresh = fresh_model(imported)
    assert resume_latest(fresh, checkpoint_root(new_run)) == 0
    assert fresh.optimizer.steps == 0
    trained = dict(model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in fresh.chunks[0].named_parameters())


# ------------------------------------------------------------------------------- multi-process


def test_two_ranks_write_in_parallel_and_any_world_reshards(pools, tmp_path):
    """2 ranks save column halves; 2 ranks resume as row halves; 1 process resumes whole; a lost rank file is named."""
    from checkpoint_workers import load_row_sharded, save_column_sharded

    config = small_config("tiny")
    root = tmp_path / "checkpoints"
    path = Path(pools.run(2, save_column_sharded, config, str(root))[0])
    manifest = read_manifest(path)
    assert manifest["world_size"] == 2 and {"rank_00000.safetensors", "rank_00001.safetensors"} <= set(manifest["files"])
    wq = [e for e in manifest["entries"] if e["name"] == "layers.0.attn.wq.weight" and e["state"] == "param"]
    assert sorted((e["file"], tuple(e["offsets"]), tuple(e["shape"])) for e in wq) == [
        ("rank_00000.safetensors", (0, 0), (64, 32)), ("rank_00001.safetensors", (0, 32), (64, 32))]
    norms = [e for e in manifest["entries"] if e["name"] == "norm.weight"]
    assert [e["file"] for e in norms] == ["rank_00000.safetensors"] * 3  # a replica is written once
    for report in pools.run(2, load_row_sharded, config, str(root)):
        assert report == {"step": 5, "optimizer_steps": 7, "mismatches": [], "sharded": True}
    # One process, whole tensors: the parameters are the deterministic initial weights.
    model = fresh_model(config)
    assert resume_latest(model, root) == 5
    for name, p in model.optimizer.named:
        m, v = model.optimizer.state[id(p)]
        assert torch.equal(m, 2 * p) and torch.equal(v, p * p), name
    (path / "rank_00001.safetensors").unlink()
    with pytest.raises(CorruptCheckpoint, match=r"missing rank_00001.safetensors \(the shards of rank 1\)"):
        read_manifest(path)


def _read_fifo_lines(fifo: Path, lines: list[str], done: threading.Event) -> None:
    """Read every line written to a FIFO by writers that each open, write one line and close."""
    while not done.is_set():
        with open(fifo) as f:  # blocks until the next writer opens it
            lines += [line for line in f.read().splitlines() if line]


def _wait_for(condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_killed_rank_restarts_under_torchrun_and_ends_like_an_uninterrupted_run(dense_run, tmp_path):
    """SIGKILL from outside after the checkpoint of step 1 of 3: torchrun restarts the job, it
    resumes at step 1 and ends with the weights of the uninterrupted run, bit for bit.

    metrics.jsonl is a FIFO this test reads, so the worker cannot finish a step's metrics line
    (and so cannot write the next checkpoint) until the test lets it: the kill always lands
    between the checkpoints of steps 1 and 2, without a hook in the training loop.
    """
    _, straight, _ = dense_run
    overrides = ["--model.layers", "2", "--train.seq_len", "16", "--train.global_batch", "4",
                 "--train.steps", "3", "--checkpoint.interval", "1", "--train.eval_interval", "0"]
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    os.mkfifo(run_dir / "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
           "-m", "fivefold.cli", "train", "--config", "tiny", "--run-dir", str(run_dir), "--resume", *overrides]
    # The same thread count as this process, which trained the uninterrupted run: same summation order.
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    job = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    done = threading.Event()
    try:
        with open(run_dir / "metrics.jsonl") as fifo:
            lines.append(fifo.readline())  # step 0; the worker then commits step 1 and trains step 1
        _wait_for(lambda: (checkpoint_root(run_dir) / "step_000001" / "manifest.json").exists())
        worker = int((run_dir / ".lock").read_text().split()[1])  # "pid N on host H", written by rank 0
        os.kill(worker, signal.SIGKILL)
        reader = threading.Thread(target=_read_fifo_lines, args=(run_dir / "metrics.jsonl", lines, done), daemon=True)
        reader.start()
        output, _ = job.communicate(timeout=300)
    finally:
        done.set()
        job.kill()
        _release_fifo_reader(run_dir / "metrics.jsonl")
    assert job.returncode == 0, output[-3000:]
    assert "resuming at step 1" in output, output[-3000:]
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]  # step 1 was cut short by the kill
    a, b = weights(straight), weights(run_dir)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _release_fifo_reader(fifo: Path) -> None:
    """Open the FIFO for writing once, so a reader blocked in open() returns and sees `done`."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader is waiting
        pass



# ------------------------------------------------------------------------ cross-layout resume

STRATEGY_MODULES = {"dp": "data_parallel", "zero": "zero", "tp": "tensor_parallel", "pp": "pipeline",
                    "ep": "expert_parallel", "cp": "context_parallel"}
LAYOUT_STEPS = ["model.layers=2", "train.seq_len=16", "train.global_batch=8", "train.eval_interval=0"]


def layout_config(preset: str, layout: str):
    from fivefold.rules.layout import parse_layout_string

    return load_config(preset, LAYOUT_STEPS + [f"layout.{k}={v}" for k, v in parse_layout_string(layout).items()])


def skip_unless_strategies_exist(config) -> None:
    """Skip (only) when a strategy module the layout needs is not importable yet."""
    layout = config.layout
    needed = []
    if layout.dp * layout.cp > 1:
        needed.append("zero" if layout.zero else "dp")
    needed += [axis for axis in ("tp", "pp", "ep", "cp") if getattr(layout, axis) > 1]
    for axis in needed:
        module = f"fivefold.parallel.{STRATEGY_MODULES[axis]}"
        try:
            importlib.import_module(module)
        except ImportError as err:
            pytest.skip(f"layout needs {module}, which is not importable in this tree yet ({err})")


def run_on(pools, world: int, fn, *args):
    """Run a worker function on `world` ranks: in this process when world is 1."""
    if world == 1:
        from fivefold.tools.testing import WorkerContext

        return [fn(WorkerContext(0, 1), *args)]
    return pools.run(world, fn, *args)


def save_then_resume(pools, saved, resumed, saved_steps: int, total_steps: int, root: Path):
    from checkpoint_workers import resume_and_train, train_and_save

    run_on(pools, saved.layout.world_size, train_and_save, saved, saved_steps, str(root))
    start, trace = run_on(pools, resumed.layout.world_size, resume_and_train, resumed, total_steps, str(root))[0]
    assert start == saved_steps
    return trace


@pytest.mark.parametrize(
    "preset, saved_layout, resumed_layout",
    [
        ("tiny", "micro_batch=4", "micro_batch=2"),  # single process: runs in every tree
        ("tiny", "dp=2,tp=2,pp=2,zero=1", "dp=4,zero=3"),
        ("tiny", "dp=2,tp=2,pp=2,zero=1", "tp=4"),
        ("tiny", "tp=2,sequence_parallel=true", "pp=2"),
        ("tiny", "cp=2", "dp=2,zero=2"),
        ("tiny-moe", "dp=2,ep=2", "tp=2,pp=2"),
        ("tiny-moe", "dp=4,ep=2,zero=1", "cp=2,ep=2"),
        # hybrid sharding: shards replicated over two shard groups, saved once, read by any layout
        ("tiny", "dp=4,dp_shard=2,zero=3", "dp=4,zero=3"),
        ("tiny", "dp=4,zero=2", "dp=4,dp_shard=2,zero=2"),
        ("tiny-moe", "dp=4,dp_shard=2,ep=2,zero=3", "dp=2,ep=2,zero=1"),
        # ZeRO-3 inside pipeline stages: each stage's shards are written by its own dp ranks
        ("tiny", "dp=2,pp=2,zero=3,grad_accum=2", "dp=4,zero=1"),
        ("tiny", "dp=4,zero=1", "dp=2,pp=2,zero=3,grad_accum=2"),
        ("tiny-moe", "dp=2,pp=2,ep=2,zero=3,grad_accum=2", "dp=4,ep=2,zero=2"),
        # parameters kept gathered through the step: the saved shards are the sharded masters
        ("tiny", "dp=2,pp=2,zero=3,zero3_gather=step,grad_accum=2", "dp=2,tp=2,zero=1"),
        ("tiny", "dp=2,tp=2,zero=1", "dp=2,pp=2,zero=3,zero3_gather=step,grad_accum=2"),
    ],
)
def test_resume_under_another_layout_matches_the_reference(pools, reference, tmp_path, preset, saved_layout, resumed_layout):
    """Saved after 1 step under one layout, resumed for 1 more under another: parity with the straight run."""
    from fivefold.tools.parity import TrainTrace, assert_parity

    saved, resumed = layout_config(preset, saved_layout), layout_config(preset, resumed_layout)
    skip_unless_strategies_exist(saved)
    skip_unless_strategies_exist(resumed)
    trace = save_then_resume(pools, saved, resumed, 1, 2, tmp_path / "checkpoints")
    straight = reference(saved, 2)
    assert_parity(TrainTrace(straight.losses[1:], [], [], params=straight.params), trace)


@pytest.mark.parametrize("preset, layout", [("tiny", "dp=2,tp=2,pp=2,zero=1"), ("tiny-moe", "dp=2,ep=2,zero=2"),
                                            ("tiny", "dp=2,pp=2,zero=3,grad_accum=2")])
def test_resume_under_the_same_parallel_layout_is_bitwise(pools, tmp_path, preset, layout):
    from helpers import trace_on_rank

    config = layout_config(preset, layout)
    skip_unless_strategies_exist(config)
    straight = pools.run(config.layout.world_size, trace_on_rank, config, 2)[0]
    trace = save_then_resume(pools, config, config, 1, 2, tmp_path / "checkpoints")
    assert all(torch.equal(straight.params[k], trace.params[k]) for k in straight.params)
