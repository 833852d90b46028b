"""Every tensor a run hands to a collective lives on the model's device: proven without a GPU.

NCCL takes only GPU tensors: a host tensor handed to one of its collectives fails the job
("No backend type associated with device type cpu"), and a GPU shard added into a host
buffer fails too. gloo takes both, so a CPU test run cannot see either mistake. Here the
whole run (`fivefold.run.run_training`: claiming the run folder, build, training steps
with accumulation, clipping, evaluation, the loss report, per-rank metrics, MoE statistics,
the pipeline timeline, recomputation none/selective/full, the end-of-run save) runs every
layout of the parity matrix on the meta device (its first and last rank), under torch's fake process
group. The meta device is not the CPU, so any tensor created without the model's device
shows up on the CPU: `OffDeviceCollectives` records every collective that receives one,
whoever issued it, and comm.py's own check (`Axis.device_type`) refuses it. A run that
finishes with neither has no host tensor in any collective for any device, CUDA included:
which tensors are created where follows from the code and the model's device alone, never
from values (the meta device has none).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fivefold.config import load_config
from fivefold.parallel import comm
from fivefold.parallel.mesh import Mesh
from fivefold.rules.layout import validate

from test_hybrid_matrix import EIGHT_RANKS, FOUR_RANKS

RECOMPUTE = ("none", "selective", "full")


class OffDeviceCollectives(TorchDispatchMode):
    """Records every c10d operation (a collective or a point-to-point transfer) that is handed
    a tensor off `device_type`, with the devices it saw.

    torch's object collectives (`all_gather_object`, used for start-up records) and its barrier
    are left out: they make their own tensors, on the backend's device (the current GPU under NCCL).
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.seen: list[str] = []
        self.in_object_collective = 0

    def object_collective(self, collective):  # noqa: ANN001, ANN201
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.in_object_collective += 1
            try:
                return collective(*args, **kwargs)
            finally:
                self.in_object_collective -= 1
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        # barrier's tensor is torch's own too, made on the backend's device
        if func.namespace == "c10d" and not self.in_object_collective and func.overloadpacket.__name__ != "barrier":
            devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if devices - {self.device_type}:
                self.seen.append(f"{func} on {sorted(devices)}")
        return func(*args, **(kwargs or {}))


def _run_config(config, index: int):  # noqa: ANN001
    """The parity layout with every step feature a run can switch on: accumulation as the
    layout has it, clipping, evaluation each step, and one of the recomputation modes."""
    train = dataclasses.replace(
        config.train, steps=2, grad_clip=1.0, eval_interval=2, eval_batches=1, trace=config.layout.pp > 1,
    )
    layout = dataclasses.replace(config.layout, recompute=RECOMPUTE[index % len(RECOMPUTE)])
    return validate(config.replace(train=train, layout=layout))


def run_on_meta(config, ranks: list[int], folder: Path, monkeypatch) -> dict[int, list[str]]:  # noqa: ANN001
    """Each rank's whole run on the meta device; the off-device collectives each rank issued."""
    import torch.distributed as dist

    from fivefold import run
    from fivefold.tools.dryrun import DryRunMode, FusedAttentionOnMeta, fake_world, fused_attention_in_every_forward

    def build_for_meta(*args):  # noqa: ANN002, ANN202
        """The run's own build, with the fused attention kernel in recomputed forwards too (see dryrun)."""
        model = build(*args)
        fused_attention_in_every_forward(m for chunk in model.chunks for m in chunk.modules())
        return model

    build, run_training = run.build, run.run_training
    off_device: dict[int, list[str]] = {}
    for rank in ranks:
        with fake_world(config.layout.world_size, rank):
            with DryRunMode(), FusedAttentionOnMeta(), OffDeviceCollectives("meta") as seen:
                monkeypatch.setattr(run, "build", build_for_meta)
                monkeypatch.setattr(dist, "all_gather_object", seen.object_collective(dist.all_gather_object))
                records = run_training(config, folder / f"rank{rank}", show_progress=False, device=torch.device("meta"))
                monkeypatch.undo()
        assert len(records) == config.train.steps and "val_loss" in records[-1]
        off_device[rank] = seen.seen
    return off_device


LAYOUTS = FOUR_RANKS + EIGHT_RANKS + [  # the parity matrix; ZeRO-2/3 alone, in a pipeline, hybrid
    load_config("tiny", ["layout.dp=2", "layout.zero=2"]),
    load_config("tiny", ["layout.dp=2", "layout.zero=3", "layout.grad_accum=2"]),
    load_config("tiny", ["layout.dp=2", "layout.pp=2", "layout.zero=3", "layout.grad_accum=2"]),
    load_config("tiny", ["layout.dp=4", "layout.dp_shard=2", "layout.zero=3"]),
    load_config("tiny-moe", ["layout.dp=4", "layout.dp_shard=2", "layout.ep=2", "layout.zero=2"]),
]


def _layout_id(config) -> str:  # noqa: ANN001
    default = type(config.layout)()
    changed = [f"{f.name}={getattr(config.layout, f.name)}" for f in dataclasses.fields(config.layout)
               if getattr(config.layout, f.name) != getattr(default, f.name)]
    return f"{config.model.name}-" + ",".join(changed)


# The default suite runs these (indices into LAYOUTS): every strategy, every cp algorithm, every
# pipeline schedule, ZeRO-1/2/3 (in a pipeline and hybrid), MoE, and each recomputation mode; the
# other layouts are in the opt-in slow suite (they take minutes together on two cores).
DEFAULT_SUITE = (1, 2, 3, 5, 6, 8, 10, 13, 21, 27, 28)


def _layout_params() -> list:
    return [pytest.param(i, c, id=_layout_id(c), marks=() if i in DEFAULT_SUITE else pytest.mark.slow)
            for i, c in enumerate(LAYOUTS)]


@pytest.mark.parametrize("index, config", _layout_params())
def test_every_parity_layout_runs_on_a_device_that_is_not_the_cpu(index, config, tmp_path, monkeypatch):
    """The first and the last rank: between them every axis's first and last position (the
    first and last pipeline stage, tp rank 0 that reports the loss and one that does not)."""
    config = _run_config(config, index)
    off_device = run_on_meta(config, [0, config.layout.world_size - 1], tmp_path, monkeypatch)
    assert all(not seen for seen in off_device.values()), {r: s[:3] for r, s in off_device.items() if s}


def test_a_host_tensor_handed_to_a_collective_is_refused_with_the_axis_op_and_device():
    from fivefold.tools.dryrun import fake_world

    config = validate(load_config("tiny", ["layout.dp=2", "layout.tp=2"]))
    with fake_world(4, 0):
        mesh = Mesh.build(config.layout, device_type="meta")
        comm.all_reduce(torch.zeros(2, device="meta"), mesh.dp)  # the mesh's device: accepted
        calls = {
            "all_reduce on axis dp": lambda: comm.all_reduce(torch.zeros(2), mesh.dp),
            "all_gather on axis tp": lambda: comm.all_gather(torch.zeros(2), mesh.tp),
            "reduce_scatter on axis world": lambda: comm.reduce_scatter(torch.zeros(4), mesh.world),
            "all_to_all on axis tp": lambda: comm.all_to_all(torch.zeros(2), mesh.tp),
            "broadcast on axis dp": lambda: comm.broadcast(torch.zeros(2), mesh.dp),
            "p2p on axis dp": lambda: comm.send_recv(mesh.dp, sends=[(torch.zeros(2), 1)]),
        }
        for expected, call in calls.items():
            with pytest.raises(comm.CollectiveDeviceError, match=f"^{expected}: a tensor on cpu, but this mesh's collectives run on meta"):
                call()
        assert mesh.stats.wire[("dp", "all_reduce")] == 8  # only the accepted call was counted


def test_the_recorder_sees_a_host_tensor_that_bypasses_comm():
    """The test's own recorder does not rely on comm.py's check: it sees any c10d call."""
    import torch.distributed as dist

    from fivefold.tools.dryrun import fake_world

    with fake_world(2, 0), OffDeviceCollectives("meta") as seen:
        dist.all_reduce(torch.zeros(1))
        dist.all_reduce(torch.zeros(1, device="meta"))
    assert len(seen.seen) == 1 and "cpu" in seen.seen[0]


def test_layouts_cover_the_parity_matrix_and_every_recompute_mode():
    assert len(LAYOUTS) == len(FOUR_RANKS) + len(EIGHT_RANKS) + 5
    modes = {RECOMPUTE[i % len(RECOMPUTE)] for i, _ in enumerate(LAYOUTS)}
    assert modes == set(RECOMPUTE)
    assert any(c.layout.pp > 1 for c in LAYOUTS)  # the timeline's gather is traced there


def test_the_default_suite_keeps_every_strategy_algorithm_schedule_and_recompute_mode():
    chosen = [(i, LAYOUTS[i].layout) for i in DEFAULT_SUITE]
    assert {RECOMPUTE[i % len(RECOMPUTE)] for i, _ in chosen} == set(RECOMPUTE)
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        assert any(getattr(lay, axis) > 1 for _, lay in chosen), axis
    assert {lay.cp_algorithm for _, lay in chosen if lay.cp > 1} >= {"ring", "allgather", "ulysses"}
    assert {lay.pp_schedule for _, lay in chosen if lay.pp > 1} >= {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert {lay.zero for _, lay in chosen} >= {1, 2, 3}
    assert any(lay.zero == 3 and lay.pp > 1 for _, lay in chosen) and any(lay.dp_shard for _, lay in chosen)
    assert any(lay.sequence_parallel for _, lay in chosen)


# ------------------------------------------------------------------------ ranks and GPUs


@pytest.fixture
def one_gpu(monkeypatch):  # noqa: ANN001, ANN201
    """This machine as a host with one visible GPU (nothing runs on it: the checks come first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("fivefold.run.machine_memory_bytes", lambda device: (80 << 30, "GPU memory"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_ranks_than_gpus_on_a_machine_is_refused_with_the_counts_and_the_fix(one_gpu, device):
    from fivefold.run import RunError, check_machine

    config = validate(load_config("tiny", ["layout.dp=2", f"train.device={device}"]))
    with pytest.raises(RunError, match=r"runs 2 ranks on this machine but it has 1 GPU\(s\).*--train.device cpu"):
        check_machine(config)
    check_machine(validate(load_config("tiny", ["layout.dp=2", "train.device=cpu"])))  # gloo: any count
    check_machine(validate(load_config("tiny", [f"train.device={device}"])))  # one rank, one GPU


def test_torchrun_per_machine_rank_count_is_what_must_fit(one_gpu, monkeypatch):
    from fivefold.run import check_machine

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # dp=2 over two machines of one GPU each
    check_machine(validate(load_config("tiny", ["layout.dp=2", "train.device=cuda"])))


@pytest.mark.parametrize("command", [
    ["train", "--config", "tiny", "--layout", "dp=2", "--train.steps", "1"],
    ["parity", "--config", "tiny", "--layout", "dp=2", "--steps", "1"],
])
def test_the_cli_refuses_before_any_process_starts_and_writes_nothing(one_gpu, command, tmp_path, monkeypatch, capsys):
    import subprocess

    from fivefold.cli import main

    def no_process(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    argv = command + (["--run-dir", str(run_dir)] if command[0] == "train" else [])
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "runs 2 ranks on this machine but it has 1 GPU(s)" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_parity_and_diagnose_build_on_the_mesh_device():
    """What `fivefold parity` and `diagnose` build follows the job's device, not the CPU."""
    from fivefold.tools.diagnose import probe
    from fivefold.tools.dryrun import DryRunMode, FusedAttentionOnMeta, fake_world
    from fivefold.tools.parity import train_trace

    config = validate(load_config("tiny", ["layout.dp=2", "train.steps=1"]))
    with fake_world(2, 1):
        mesh = Mesh.build(config.layout, device_type="meta")
        with DryRunMode(), FusedAttentionOnMeta(), OffDeviceCollectives("meta") as seen:
            trace = train_trace(config, mesh, 1, keep_params=False)
            outputs, grads = probe(config, mesh)
    assert len(trace.losses) == 1 and not seen.seen, seen.seen[:3]
    assert {t.device.type for t in [*outputs.values(), *grads.values()]} == {"meta"}


# ------------------------------------------------------------------ the watchdog on a GPU


def test_a_blocking_collective_stays_in_flight_until_the_device_gets_past_it(monkeypatch):
    """On a GPU a blocking call returns when NCCL has queued the collective: the flight record
    must keep it in flight until an event recorded after it completes, so a hang report names
    the collective the GPU is stuck in. The event is a stand-in here (no GPU); on the host
    (CPU, meta) a returned call has completed and no event is made."""
    from fivefold.tools.dryrun import fake_world

    class Event:
        done = False

        def query(self) -> bool:
            return self.done

    event = Event()
    assert comm.device_completion_event("cpu") is None and comm.device_completion_event("meta") is None
    monkeypatch.setattr(comm, "device_completion_event", lambda device_type: event)
    config = validate(load_config("tiny", ["layout.dp=2"]))
    with fake_world(2, 0):
        mesh = Mesh.build(config.layout, device_type="meta")
        comm.all_reduce(torch.zeros(2, device="meta"), mesh.dp)
        flight = mesh.stats.flight
        flight.sweep()
        stuck = flight.oldest_in_flight()
        assert stuck is not None and (stuck.axis, stuck.op) == ("dp", "all_reduce")
        event.done = True
        flight.sweep()
        assert flight.oldest_in_flight() is None


def test_generate_refuses_a_gpu_that_is_not_there_before_reading_anything(monkeypatch, tmp_path, capsys):
    from fivefold.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--run", str(tmp_path / "no-such-run"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fivefold: error: --device cuda but ") and err.endswith("use --device cpu or auto")
    assert len(err.splitlines()) == 1
