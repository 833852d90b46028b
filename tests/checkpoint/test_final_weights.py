"""The end-of-run weights: a Hugging Face-style safetensors set, written without any rank holding
the whole model, read by export and generate; export takes the newest weights of a run.

Pure tests check the files (huggingface_hub's split, safetensors' format, the index, replacing
a set with a crash at every rename) and the plan. Pool tests save under dp, ZeRO-3, tp + SP,
ZeRO-3 + tp, pp with a tied embedding, and ep, and check the files against the single process
and the allocations of every rank. A dry run on the meta device under torch's fake process
group checks that no CPU tensor meets a device tensor anywhere in the save. CLI tests run the
import -> fine-tune -> export round trip, an export with nothing to export, and a full disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fivefold.checkpoint import (
    CheckpointError,
    TensorSet,
    newest_weights,
    read_final_weights,
    save_checkpoint,
    write_final_weights,
)
from fivefold.checkpoint.final import plan_final_weights, saved_tensors
from fivefold.checkpoint.sets import (
    INDEX_FILE,
    REPLACED_DIR,
    SINGLE_FILE,
    TensorFileWriter,
    TensorInfo,
    file_names,
    replace_set,
    restore_interrupted_replace,
    set_files_in,
    set_metadata,
    split_into_files,
    write_set,
)
from fivefold.config import load_config
from fivefold.parallel.mesh import Mesh
from fivefold.rules.layout import rank_to_coords, validate
from fivefold.tools.parity import PARAM_ATOL, PARAM_RTOL
from fivefold.train import build

import final_weights_workers as workers


def _tiny(**model):
    config = load_config("tiny")
    return config.replace(model=dataclasses.replace(config.model, **model)) if model else config


def _with_layout(config, **layout):
    return config.replace(layout=dataclasses.replace(config.layout, **layout))


@contextlib.contextmanager
def _umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


# --------------------------------------------------------------------------------- the files


def test_files_are_split_as_huggingface_hub_splits_a_state_dict():
    from huggingface_hub import split_torch_state_dict_into_shards

    rng = random.Random(0)
    for trial in range(40):
        sizes = [rng.choice([1, 3, 8, 20, 64]) for _ in range(rng.randint(1, 12))]
        state = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
        limit = rng.choice([16, 40, 100, 1000]) * 4
        theirs = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                                    max_shard_size=limit)
        ours = split_into_files([TensorInfo(n, tuple(t.shape)) for n, t in state.items()], limit)
        names = file_names(len(ours))
        assert {n: [t.name for t in f] for n, f in zip(names, ours)} == theirs.filename_to_tensors, (sizes, limit)


def test_a_streamed_file_is_a_safetensors_file_readable_by_the_team(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(2.5),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "c": torch.randn(2, 2, 2)}
    infos = [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    with _umask(0o022):
        writer = TensorFileWriter(tmp_path / "x.safetensors", infos, set_metadata(7))
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.close()
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert safe_open(str(tmp_path / "x.safetensors"), "pt").metadata() == {"format": "pt", "step": "7"}
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_file_writer_takes_the_header_order_only(tmp_path):
    writer = TensorFileWriter(tmp_path / "x.safetensors", [TensorInfo("a", (2,)), TensorInfo("b", (3,))], {})
    with pytest.raises(ValueError, match="expected a"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="1 of 2|0 of 2"):
        writer.close()
    writer.discard()
    assert not (tmp_path / "x.safetensors").exists()


def _state(seed: int, count: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(4, 4 + i, generator=g) for i in range(count)}


def test_a_sharded_set_reads_back_and_forged_ones_are_refused(tmp_path):
    state = _state(1)
    paths = write_set(tmp_path, state, step=4, max_file_bytes=200)
    assert len(paths) > 2 and (tmp_path / INDEX_FILE).is_file() and not (tmp_path / SINGLE_FILE).exists()
    found = TensorSet.locate(tmp_path)
    assert found is not None and found.step == 4
    assert all(torch.equal(found.get(n), t) for n, t in state.items())
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": sum(t.numel() * 4 for t in state.values()), "step": 4}

    def forged(edit) -> str:
        good = (tmp_path / INDEX_FILE).read_text()
        edit()
        try:
            with pytest.raises(CheckpointError) as err:
                TensorSet.locate(tmp_path)
            return str(err.value)
        finally:
            (tmp_path / INDEX_FILE).write_text(good)

    outside = dict(index, weight_map=dict(index["weight_map"], w0="../../etc/passwd"))
    assert "refusing to open it" in forged(lambda: (tmp_path / INDEX_FILE).write_text(json.dumps(outside)))
    other_step = dict(index, metadata={"total_size": 0, "step": 5})
    assert "different saves" in forged(lambda: (tmp_path / INDEX_FILE).write_text(json.dumps(other_step)))
    paths[1].rename(tmp_path / "aside")
    assert "missing" in forged(lambda: None)


def test_replacing_a_set_leaves_the_old_or_the_new_one_whole_whatever_rename_a_crash_stops_at(tmp_path, monkeypatch):
    old, new = _state(2, 3), _state(3, 5)
    for old_bytes, new_bytes in [(10**6, 200), (200, 10**6), (200, 300)]:  # single -> sharded, back, sharded -> sharded
        renames = 0
        while True:
            folder = tmp_path / f"run{old_bytes}-{new_bytes}-{renames}"
            folder.mkdir()
            write_set(folder, old, step=1, max_file_bytes=old_bytes)
            (folder / "notes.txt").write_text("mine")
            staging = folder / ".staging"
            staging.mkdir()
            write_set(staging, new, step=2, max_file_bytes=new_bytes)
            calls, real = [0], os.replace

            def crashing(src, dst, calls=calls, limit=renames, real=real):
                if calls[0] == limit:
                    raise KeyboardInterrupt("power cut")
                calls[0] += 1
                real(src, dst)

            monkeypatch.setattr(os, "replace", crashing)
            try:
                replace_set(staging, folder)
                finished = True
            except KeyboardInterrupt:
                finished = False
            finally:
                monkeypatch.setattr(os, "replace", real)
            restore_interrupted_replace(folder)
            found = TensorSet.locate(folder)
            assert found is not None
            expected = new if found.step == 2 else old
            assert found.read_all().keys() == expected.keys()
            assert all(torch.equal(found.get(n), t) for n, t in expected.items())
            assert {p.name for p in set_files_in(folder)} == {p.name for p in found.paths}  # nothing stale
            assert (folder / "notes.txt").read_text() == "mine" and not (folder / REPLACED_DIR).exists()
            if finished:
                assert found.step == 2
                break
            renames += 1


# ---------------------------------------------------------------------------------- the plan


def test_the_plan_spreads_files_over_the_stage_holding_them_and_gives_a_tied_embedding_to_the_first_stage():
    config = validate(_with_layout(_tiny(tied_embeddings=True), pp=2, dp=2, tp=2), 8)
    plan = plan_final_weights(config, max_file_bytes=40_000)
    names = [t.name for t in plan.tensors]
    assert names == [t.name for t in saved_tensors(config.model)] and "head.weight" not in names
    assert sorted(plan.file_of) == sorted(names) and [t for f in plan.files for t in f] == plan.tensors
    assert plan.owners["embed.weight"] == 0 and plan.owners["norm.weight"] == 1
    assert plan.owners["layers.0.attn.wq.weight"] == 0 and plan.owners["layers.3.attn.wq.weight"] == 1
    for members, writer in zip(plan.files, plan.writers):
        on_writer = sum(t.nbytes for t in members if plan.owners[t.name] == rank_to_coords(writer, config.layout).pp)
        assert 2 * on_writer >= sum(t.nbytes for t in members)  # the writer's stage holds most of the file
    assert len(set(plan.writers)) == min(len(plan.files), 8)  # files go round the stage's ranks
    interleaved = validate(_with_layout(_tiny(), pp=2, vpp=2, pp_schedule="interleaved", grad_accum=2), 2)
    owners = plan_final_weights(interleaved).owners  # virtual stage s on pipeline rank s % pp
    assert [owners[f"layers.{i}.attn.wq.weight"] for i in range(4)] == [0, 1, 0, 1]
    assert owners["embed.weight"] == 0 and owners["head.weight"] == 1
    v_shape = validate(_with_layout(_tiny(), pp=2, vpp=2, pp_schedule="dualpipev", grad_accum=4), 2)
    owners = plan_final_weights(v_shape).owners  # stages 0 and 3 on rank 0, 1 and 2 on rank 1
    assert [owners[f"layers.{i}.attn.wq.weight"] for i in range(4)] == [0, 1, 1, 0]
    assert owners["embed.weight"] == 0 and owners["head.weight"] == 0


# ------------------------------------------------------------------- saving under layouts (pool)

LAYOUTS = [
    pytest.param("tiny", dict(dp=2), {}, 2, id="dp"),
    # 4 ranks over 2 kv heads: each kv head repeated on 2 ranks; 258 rows padded to 260
    pytest.param("tiny", dict(tp=4, sequence_parallel=True), {"vocab_size": 258}, 4, id="tp4-sp-repeated-kv-padded-vocab"),
    # flat ranges of column-parallel (contiguous) and row-parallel (strided) boxes
    pytest.param("tiny", dict(dp=2, tp=2, zero=3), {}, 4, id="zero3-tp2"),
    pytest.param("tiny", dict(pp=2, dp=2), {"tied_embeddings": True}, 4, id="pp2-tied"),
    pytest.param("tiny-moe", dict(dp=4, ep=2), {}, 4, id="ep2-dp4"),
    # hybrid sharding: each shard is held by both replicas and written by one
    pytest.param("tiny", dict(dp=4, dp_shard=2, zero=3), {}, 4, id="hsdp-zero3"),
]


@pytest.mark.parametrize("preset, layout, model, ranks", LAYOUTS)
def test_the_final_save_equals_the_single_process_and_no_rank_allocates_more_than_a_file(
        preset, layout, model, ranks, pools, reference, tmp_path):
    base = load_config(preset)
    base = base.replace(model=dataclasses.replace(base.model, **model), train=dataclasses.replace(base.train, steps=2))
    config = validate(_with_layout(base, **layout), ranks)
    tensors = saved_tensors(config.model)
    largest = max(t.nbytes for t in tensors)
    max_file = 3 * largest  # several files, several writers
    results = pools.run(ranks, workers.save_before_and_after_training, config, str(tmp_path), 2, max_file)

    # Untrained, every layout holds the single process's initial weights, bit for bit.
    single_layout = validate(base).layout
    initial_single = build(base.replace(layout=single_layout), Mesh.single(single_layout), torch.device("cpu")).full_parameters()
    _, initial = read_final_weights(_as_run(tmp_path / "initial", config))
    assert initial.keys() == initial_single.keys()
    assert all(torch.equal(initial[n], initial_single[n]) for n in initial), "initial weights differ"
    # Trained, the files hold exactly what the layout trained (its own in-memory gather), ...
    _, trained = read_final_weights(_as_run(tmp_path / "trained", config))
    _, replaced = read_final_weights(_as_run(tmp_path / "replaced", config))
    assert TensorSet.locate(tmp_path / "replaced").step == 2 and len(TensorSet.locate(tmp_path / "trained").files) > 1
    own = results[0]["full"]
    assert trained.keys() == own.keys()
    for name in own:
        assert torch.equal(trained[name], own[name]), name
        assert torch.equal(replaced[name], own[name]), name
    # ... which is the single process's within the parity bound.
    ref = reference(config, 2).params
    for name, tensor in trained.items():
        assert ((tensor - ref[name]).abs() - PARAM_RTOL * ref[name].abs()).max().item() <= PARAM_ATOL, name
    # Memory: a rank's save allocates at most a file's worth waiting to be written and the tensor it
    # assembles, where the in-memory gather allocates the whole model on every rank.
    model_bytes = sum(t.nbytes for t in tensors)
    file_bytes = max(sum(t.nbytes for t in f) for f in split_into_files(tensors, max_file))
    for rank, r in enumerate(results):
        print(f"rank {rank}: save peak {r['save_peak']:,} B (largest tensor {largest:,}, largest file {file_bytes:,}, "
              f"model {model_bytes:,}); in-memory gather peak {r['gather_peak']:,} B")
        assert r["save_peak"] <= file_bytes + largest, (rank, r["save_peak"], file_bytes, largest)
        assert r["gather_peak"] >= model_bytes, (rank, r["gather_peak"], model_bytes)


def _as_run(folder: Path, config) -> Path:  # noqa: ANN001
    """A folder holding a set and the config.json a run writes beside it."""
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return folder


# ------------------------------------------------------------- on a device that is not the CPU


class CpuTensorSeen(TorchDispatchMode):
    """Records every op that touches a CPU tensor: on the meta device, each is a CPU/device mix.

    NCCL refuses host tensors in collectives and a CUDA shard added into a CPU buffer fails
    (or, with `+=`, silently runs on the host); a save that runs on the meta device under
    torch's fake process group without any op touching a CPU tensor has neither, for any
    device: only shapes decide what it does, and the device is the model's own.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" for t in tensors):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


META_LAYOUTS = [  # and the axes the save must communicate over
    pytest.param("tiny", dict(pp=2, tp=2, sequence_parallel=True), {"tied_embeddings": True, "vocab_size": 258},
                 {"tp", "pp"}, id="pp2-tp2-sp-tied"),
    pytest.param("tiny", dict(dp=2, tp=2, zero=3), {}, {"dp_cp", "tp"}, id="zero3-tp2"),
    pytest.param("tiny-moe", dict(dp=4, ep=2), {}, {"dp_cp"}, id="ep2-dp4"),
    pytest.param("tiny", dict(dp=4, dp_shard=2, zero=3), {}, {"dp_cp"}, id="hsdp-zero3"),
    pytest.param("tiny-moe", dict(dp=2, ep=2, tp=2), {}, {"dp_cp", "tp"}, id="ep2-tp2"),
    pytest.param("tiny", dict(pp=2, vpp=2, dp=2, zero=1, pp_schedule="interleaved", grad_accum=2), {}, {"pp"}, id="pp2-vpp2-zero1"),
]


@pytest.mark.parametrize("preset, layout, model, axes", META_LAYOUTS)
def test_the_save_runs_on_a_device_that_is_not_the_cpu_without_touching_a_cpu_tensor(preset, layout, model, axes, tmp_path):
    from fivefold.tools.dryrun import DryRunMode, fake_world

    base = load_config(preset)
    config = validate(_with_layout(base.replace(model=dataclasses.replace(base.model, **model)), **layout))
    plan = plan_final_weights(config, 3 * max(t.nbytes for t in saved_tensors(config.model)))
    sent: set[str] = set()
    for rank in range(config.layout.world_size):
        with fake_world(config.layout.world_size, rank):
            mesh = Mesh.build(config.layout, device_type="meta")
            with DryRunMode():
                model = build(config, mesh, torch.device("meta"))
                mesh.stats.reset()
                with CpuTensorSeen() as seen:
                    assert write_final_weights(model, tmp_path, 3, plan_max_bytes(plan)) is None
                assert seen.ops == [], (rank, seen.ops[:5])
                sent |= {axis for axis, n in mesh.stats.by_axis().items() if n}
    assert axes <= sent, sent  # the parts met over these axes, on meta tensors, counted by comm.py
    assert list(tmp_path.iterdir()) == []  # no values on the meta device: nothing is written


def plan_max_bytes(plan) -> int:  # noqa: ANN001
    return max(sum(t.nbytes for t in f) for f in plan.files)


def test_the_check_above_sees_the_cpu_buffers_of_the_old_in_memory_gather():
    from fivefold.parallel.sharding import full_shapes, gather_full_state
    from fivefold.tools.dryrun import DryRunMode, fake_world

    config = validate(_with_layout(_tiny(), tp=2))
    with fake_world(2, 0):
        mesh = Mesh.build(config.layout, device_type="meta")
        with DryRunMode():
            model = build(config, mesh, torch.device("meta"))
            with CpuTensorSeen() as seen, contextlib.suppress(Exception):
                gather_full_state(list(model.chunks), mesh, full_shapes(config.model), device=torch.device("cpu"))
    assert seen.ops


# ------------------------------------------------------------------ which weights a run exports


def test_export_takes_the_newest_of_the_checkpoint_and_the_final_weights(tmp_path):
    from safetensors.torch import save_file

    config = _tiny(layers=2)
    model = build(config, Mesh.single(config.layout), torch.device("cpu"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    checkpoint = save_checkpoint(model, 3, run / "checkpoints")
    for final_step, newest in [(2, "checkpoint"), (3, "checkpoint"), (5, "final")]:  # a tie: the checksummed one
        write_final_weights(model, run, final_step)
        found = newest_weights(run)
        assert (found.checkpoint is not None, found.step) == (newest == "checkpoint", max(final_step, 3)), final_step
    assert newest_weights(run, step=5).final is not None and newest_weights(run, step=3).checkpoint == checkpoint
    with pytest.raises(CheckpointError, match="step 4.*final weights hold step 5"):
        newest_weights(run, step=4)
    # Final weights from before they recorded a step: placed by modification time.
    for path in TensorSet.locate(run).paths:
        path.unlink()
    save_file({k: v.contiguous() for k, v in model.full_parameters().items()}, str(run / SINGLE_FILE))
    manifest_time = (checkpoint / "manifest.json").stat().st_mtime
    os.utime(run / SINGLE_FILE, (manifest_time - 10, manifest_time - 10))
    assert newest_weights(run).checkpoint == checkpoint
    os.utime(run / SINGLE_FILE, (manifest_time + 10, manifest_time + 10))
    assert newest_weights(run).final is not None


def _cli(argv: list[str]) -> tuple[int, str]:
    from fivefold.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


FAST = ["--train.seq_len", "16", "--train.global_batch", "4", "--train.eval_interval", "0"]


def test_import_fine_tune_export_exports_the_fine_tuned_weights(tmp_path):
    """Issue: export gave the imported weights (the step-0 checkpoint) after a fine-tune whose last
    step was no checkpoint step, and the resume said "no checkpoint" right after loading one."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from fivefold.checkpoint.hf import state_dict_to_hf

    hf_config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    imported = load_file(str(tmp_path / "hf" / SINGLE_FILE))
    run, out = tmp_path / "run", tmp_path / "out"
    assert _cli(["convert", "import", "--hf", tmp_path / "hf", "--run-dir", run])[0] == 0
    code, log = _cli(["train", "--config", run / "config.toml", "--run-dir", run, "--resume", "--train.steps", "3", *FAST])
    assert code == 0, log[-2000:]
    assert "resuming at step 0 from" in log and "no checkpoint in" not in log, log[-2000:]
    code, log = _cli(["convert", "export", "--run-dir", run, "--out", out])
    assert code == 0 and "from the final weights" in log, log
    config, final = read_final_weights(run)
    assert TensorSet.locate(run).step == 3
    expected = state_dict_to_hf(final, config.model)
    exported = load_file(str(out / SINGLE_FILE))
    assert exported.keys() == expected.keys() == imported.keys()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)
    assert not all(torch.equal(exported[n], imported[n].float()) for n in imported)  # the fine-tune is in it


def test_export_of_a_run_with_nothing_to_export_says_so_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(_tiny().to_dict()))
    (run / "metrics.jsonl").write_text("")
    code, log = _cli(["convert", "export", "--run-dir", run, "--out", tmp_path / "out"])
    assert code == 2 and "neither a checkpoint nor final weights" in log and "Traceback" not in log, log
    assert not (tmp_path / "out").exists()


def test_a_disk_that_fills_during_the_final_save_keeps_the_previous_weights_and_names_the_checkpoint(tmp_path):
    import hashlib

    from test_bad_inputs import file_size_limit

    run = tmp_path / "run"
    small = ["--config", "tiny", "--model.layers", "2", *FAST, "--run-dir", run]
    assert _cli(["train", *small, "--train.steps", "2", "--checkpoint.interval", "1"])[0] == 0
    before = hashlib.sha256((run / SINGLE_FILE).read_bytes()).hexdigest()
    with file_size_limit(200_000):  # the weights file is larger: writing it fails as on a full disk
        code, log = _cli(["train", *small, "--train.steps", "3", "--resume"])
    assert code == 1 and "Traceback" not in log, log[-3000:]
    line = next(line for line in log.splitlines() if "final weights" in line)
    for words in (SINGLE_FILE, "the previous final weights", "(step 2)", "are kept", "step_000002"):
        assert words in line, line
    assert hashlib.sha256((run / SINGLE_FILE).read_bytes()).hexdigest() == before
    assert TensorSet.locate(run).step == 2 and not (run / ".tmp_final_weights").exists()


def test_a_sharded_set_is_read_by_generate_and_export_and_the_export_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")

    config = _tiny(layers=2)
    model = build(config, Mesh.single(config.layout), torch.device("cpu"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    write_final_weights(model, run, 1, max_file_bytes=50_000)
    assert len(TensorSet.locate(run).files) > 2
    code, log = _cli(["generate", "--run", run, "--prompt", "def ", "--max-new-tokens", "4"])
    assert code == 0, log
    from fivefold.checkpoint import export_hf

    out, _ = export_hf(run, tmp_path / "hf")
    from fivefold.checkpoint.hf import write_hf_folder

    sharded = write_hf_folder(model.full_parameters(), config.model, tmp_path / "hf-sharded", step=1, max_file_bytes=50_000)
    assert (sharded / INDEX_FILE).is_file() and not (sharded / SINGLE_FILE).exists()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = model.chunks[0](ids)
        for folder in (out, sharded):
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            assert (reloaded(input_ids=ids).logits - expected).abs().max().item() < 1e-5, folder


def test_a_rank_whose_disk_fills_fails_the_save_on_every_rank_and_the_previous_set_stays(pools, tmp_path):
    config = validate(_with_layout(_tiny(layers=2), dp=2), 2)
    max_file = 2 * max(t.nbytes for t in saved_tensors(config.model))
    assert set(plan_final_weights(config, max_file).writers) == {0, 1}
    errors = pools.run(2, workers.save_with_a_full_disk_on_the_last_rank, config, str(tmp_path), max_file)
    assert "rank 1 could not write model-" in errors[1] and "File too large" in errors[1], errors
    assert "rank 1 could not write its files" in errors[0], errors
    found = TensorSet.locate(tmp_path)
    assert found is not None and found.step == 0 and len(found.read_all()) == len(saved_tensors(config.model))
    assert not (tmp_path / ".tmp_final_weights").exists()


def test_a_run_with_bf16_parameters_saves_the_fp32_masters_of_its_replicated_optimizer(tmp_path):
    """Without ZeRO, the optimizer of bf16 parameters keeps whole fp32 masters (in the parameters'
    placements, not ZeRO's flat ranges): the final weights are those masters, as under ZeRO."""
    from fivefold.run import run_training

    config = load_config("tiny", ["model.layers=1", "train.seq_len=16", "train.global_batch=2", "train.steps=2",
                                  "train.dtype=bf16", "train.param_dtype=bf16"])
    run_training(config, tmp_path / "run", show_progress=False)
    _, saved = read_final_weights(tmp_path / "run")
    assert saved["layers.0.attn.wq.weight"].dtype == torch.float32
    rounded = {name: t.to(torch.bfloat16).float() for name, t in saved.items()}
    assert any(not torch.equal(saved[n], rounded[n]) for n in saved)  # more than bf16's bits: the masters
