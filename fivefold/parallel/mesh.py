"""The process groups of a layout, held in one explicit object.

`Mesh` wraps torch's `DeviceMesh` (dims pp, dp, cp, tp) and adds the derived groups:
`dp_cp` (gradients of non-expert parameters are averaged over it), `ep` (experts are
sharded over it), `edp` (expert data parallel: replicas of the same experts) and `pp_ends`
(the first and last pipeline ranks, which both hold a tied embedding). Under hybrid sharding
(`layout.dp_shard`) each data axis also has a shard axis (ZeRO shards over it) and a
replicate axis (the shards' copies, whose gradients are all-reduced): `zero_axes`. Nothing
here is global: whoever needs a group is handed the mesh or one of its axes.

A single-process mesh (`Mesh.single()`) has every axis of size 1 and needs no
`torch.distributed` at all, so the same training code runs with or without processes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..config import Layout
from ..rules.layout import (
    HYBRID_AXES,
    Coords,
    coords_to_rank,
    edp_index,
    ep_index,
    group_ranks,
    is_hybrid,
    rank_to_coords,
)
from ..rules.p2p_order import P2PGroup

AXES = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp", "pp_ends", "world", *(a for pair in HYBRID_AXES.values() for a in pair))


@dataclass
class CollectiveRecord:
    """One collective as this rank issued it: enough to tell which peer never arrived."""

    axis: str
    group: tuple[int, ...]  # global ranks of the axis group this rank belongs to
    op: str
    seq: int  # 1 for the first collective this rank issued on `axis`, then 2, 3, ...
    bytes: int
    started: float  # time.time() when issued
    finished: float | None = None  # time.time() when complete; None while in flight


class FlightRecorder:
    """A short, bounded log of this rank's last collectives (NCCL's flight recorder, for gloo too).

    `fivefold.parallel.comm` starts a record before every collective and hands back the
    work handles of async ones; a record is finished when its call returned (blocking) or
    when `sweep` sees all its handles complete, whether or not anyone waited on them yet.
    Sweeps run at every new collective and from the watchdog thread, so every access holds
    the lock; handles are dropped as soon as they complete.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.records: deque[CollectiveRecord] = deque(maxlen=capacity)
        self.issued: dict[str, int] = {}  # per axis: sequence number of the last collective issued
        self.pending: list[tuple[CollectiveRecord, list[Any]]] = []  # async records and their handles
        self.lock = threading.Lock()

    def start(self, axis: str, group: list[int], op: str, nbytes: int) -> CollectiveRecord:
        self.sweep()
        with self.lock:
            seq = self.issued.get(axis, 0) + 1
            self.issued[axis] = seq
            record = CollectiveRecord(axis, tuple(group), op, seq, nbytes, time.time())
            self.records.append(record)
            return record

    def issued_async(self, record: CollectiveRecord, works: list[Any]) -> None:
        """`record` completes with `works` (an empty list: it already completed)."""
        with self.lock:
            if works:
                self.pending.append((record, list(works)))
            else:
                record.finished = time.time()

    def waited(self, record: CollectiveRecord) -> None:
        """Someone waited on `record`'s handle and it returned: the collective is complete.

        Needed beside `sweep`: gloo's async reduce-scatter handle never reports
        `is_completed()`, not even after `wait()` returned (torch 2.13)."""
        with self.lock:
            if record.finished is None:
                record.finished = time.time()
            self.pending = [(r, works) for r, works in self.pending if r is not record]

    def sweep(self) -> None:
        with self.lock:
            still = []
            for record, works in self.pending:
                if record.finished is not None:
                    continue
                if all(work.is_completed() for work in works):
                    record.finished = time.time()
                else:
                    still.append((record, works))
            self.pending = still

    def oldest_in_flight(self) -> CollectiveRecord | None:
        with self.lock:
            return next((r for r in self.records if r.finished is None), None)

    def newest(self) -> CollectiveRecord | None:
        with self.lock:
            return self.records[-1] if self.records else None

    def dump(self) -> dict[str, Any]:
        """A JSON-ready copy: the records, oldest first, and the last sequence number per axis."""
        with self.lock:
            return {"issued": dict(self.issued), "records": [asdict(r) for r in self.records]}


@dataclass
class CommStats:
    """Bytes each rank moves, per axis and per collective, counted by `fivefold.parallel.comm`.

    `wire` is what the ring algorithm sends from this rank (e.g. 2(n-1)/n of the buffer for
    an all-reduce) so it compares directly with the planner's analytic volumes; `buffer`
    is the size of the tensors handed to the collective.
    """

    wire: dict[tuple[str, str], int] = field(default_factory=dict)
    buffer: dict[tuple[str, str], int] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    flight: FlightRecorder = field(default_factory=FlightRecorder)  # not cleared by reset()
    p2p_groups: list[P2PGroup] | None = None  # filled by comm.send_recv inside `recording_p2p`

    def add(self, axis: str, op: str, buffer_bytes: int, wire_bytes: int) -> None:
        key = (axis, op)
        self.wire[key] = self.wire.get(key, 0) + wire_bytes
        self.buffer[key] = self.buffer.get(key, 0) + buffer_bytes
        self.calls[key] = self.calls.get(key, 0) + 1

    def axis_bytes(self, axis: str) -> int:
        return sum(v for (a, _), v in self.wire.items() if a == axis)

    def by_axis(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (axis, _), v in self.wire.items():
            out[axis] = out.get(axis, 0) + v
        return out

    def reset(self) -> None:
        self.wire.clear()
        self.buffer.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, Any]:
        return {f"{a}/{op}": {"wire": self.wire[(a, op)], "calls": self.calls[(a, op)]} for (a, op) in self.wire}

    @contextlib.contextmanager
    def recording_p2p(self) -> Iterator[list[P2PGroup]]:
        """Inside, every batch of point-to-point operations this rank issues is appended to
        the yielded list, in issue order (for `rules.p2p_order.check_p2p_order`)."""
        self.p2p_groups = []
        try:
            yield self.p2p_groups
        finally:
            self.p2p_groups = None


@dataclass
class Axis:
    """One communication axis as seen by this rank: its group, size, position and byte counter."""

    name: str
    group: Any  # a ProcessGroup, or None when the axis has size 1 and needs no communication
    size: int
    rank: int
    ranks: list[int]  # global ranks of the group, in group order
    stats: CommStats
    device_type: str = "cpu"  # where the tensors of its collectives live: "cuda" under NCCL, "meta" in a dry run

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


class Mesh:
    """Every process group of a layout, for this rank."""

    def __init__(self, layout: Layout, axes: dict[str, Axis], device_mesh: Any, stats: CommStats) -> None:
        self.layout = layout
        self.axes = axes
        self.device_mesh = device_mesh
        self.stats = stats
        self.rank = axes["world"].rank
        self.coords: Coords = rank_to_coords(self.rank, layout)

    def __getitem__(self, name: str) -> Axis:
        return self.axes[name]

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # Convenience accessors for the axes used most.
    @property
    def tp(self) -> Axis:
        return self.axes["tp"]

    @property
    def pp(self) -> Axis:
        return self.axes["pp"]

    @property
    def dp(self) -> Axis:
        return self.axes["dp"]

    @property
    def cp(self) -> Axis:
        return self.axes["cp"]

    @property
    def dp_cp(self) -> Axis:
        return self.axes["dp_cp"]

    @property
    def ep(self) -> Axis:
        return self.axes["ep"]

    @property
    def edp(self) -> Axis:
        return self.axes["edp"]

    @property
    def world(self) -> Axis:
        return self.axes["world"]

    def zero_axes(self, data_axis: str) -> tuple[Axis, Axis]:
        """(shard, replicate) axes of ZeRO state whose copies lie along `data_axis` ("dp_cp",
        "edp"): without hybrid sharding the data axis itself and a size-1 axis."""
        shard, replicate = HYBRID_AXES[data_axis]
        return self.axes[shard], self.axes[replicate]

    def release(self) -> None:
        """Drop this mesh's references to its process groups, after destroy_process_group.

        destroy_process_group only forgets torch's own references: a group that is still
        referenced keeps its backend and the backend's worker threads alive until
        interpreter exit, where gloo's threads may need the GIL while Python is being torn
        down, and the process aborts ("terminate called without an active exception").
        The caller collects garbage next, so the groups and their threads go away now.
        """
        for axis in self.axes.values():
            axis.group = None
        self.device_mesh = None

    def rank_of(self, coords: Coords) -> int:
        return coords_to_rank(coords, self.layout)

    @property
    def device(self) -> torch.device:
        """The device this rank's model lives on (for CUDA: the current GPU, which the job set)."""
        return torch.device(self.world.device_type)

    @classmethod
    def single(cls, layout: Layout | None = None, device_type: str = "cpu") -> "Mesh":
        """A mesh for one process: every axis has size 1 and no group."""
        layout = layout or Layout()
        if layout.world_size != 1:
            raise ValueError(f"Mesh.single() needs a layout of world size 1, got {layout.world_size}")
        stats = CommStats()
        axes = {name: Axis(name, None, 1, 0, [0], stats, device_type) for name in AXES}
        return cls(layout, axes, None, stats)

    @staticmethod
    def groups_key(layout: Layout) -> tuple:
        """What the groups `build` creates depend on: two layouts with the same key get the same
        groups (so a mesh may be reused across them), whatever else (schedule, recompute...) differs."""
        hybrid_shard = layout.shard_degree if is_hybrid(layout) else None
        return (layout.pp, layout.dp, layout.cp, layout.tp, layout.ep, hybrid_shard)

    @classmethod
    def build(cls, layout: Layout, device_type: str = "cpu") -> "Mesh":
        """Create every group of `layout`; must be called by all ranks of the default group.

        `device_type` is where the model and every tensor handed to a collective live (the
        model's device type); comm.py refuses a tensor anywhere else.
        """
        if layout.world_size == 1:
            return cls.single(layout)
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build needs torch.distributed initialised (use torchrun or the test pool)")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"layout needs {layout.world_size} processes, the job has {world}")
        from torch.distributed.device_mesh import init_device_mesh

        # A meta model's mesh keeps its rank grid on the host: torch's DeviceMesh needs real values.
        device_mesh = init_device_mesh(
            "cpu" if device_type == "meta" else device_type, (layout.pp, layout.dp, layout.cp, layout.tp),
            mesh_dim_names=("pp", "dp", "cp", "tp"),
        )
        stats = CommStats()
        rank = dist.get_rank()
        axes = {name: _axis_from_mesh(device_mesh, name, stats) for name in ("pp", "dp", "cp", "tp")}
        for name in ("dp_cp", "ep", "edp", "pp_ends"):
            axes[name] = _derived_axis(layout, name, rank, stats)
        axes.update(_hybrid_axes(layout, axes, rank, stats))
        axes["world"] = Axis("world", dist.group.WORLD, world, rank, list(range(world)), stats)
        for axis in axes.values():
            axis.device_type = device_type
        return cls(layout, axes, device_mesh, stats)


def _axis_from_mesh(device_mesh: Any, name: str, stats: CommStats) -> Axis:
    sub = device_mesh[name]
    size = sub.size()
    ranks = sub.mesh.flatten().tolist()
    group = sub.get_group() if size > 1 else None
    return Axis(name, group, size, sub.get_local_rank(), ranks, stats)


def _hybrid_axes(layout: Layout, axes: dict[str, Axis], rank: int, stats: CommStats) -> dict[str, Axis]:
    """The shard and replicate axes of each data axis. Without hybrid sharding no group is made:
    the shard axis is the data axis itself (its bytes are counted under its own name, as before)
    and the replicate axis has size 1."""
    out: dict[str, Axis] = {}
    for data_axis, (shard, replicate) in HYBRID_AXES.items():
        if is_hybrid(layout):
            out[shard] = _derived_axis(layout, shard, rank, stats)
            out[replicate] = _derived_axis(layout, replicate, rank, stats)
        else:
            out[shard] = axes[data_axis]
            out[replicate] = Axis(replicate, None, 1, 0, [rank], stats)
    return out


def _derived_axis(layout: Layout, name: str, rank: int, stats: CommStats) -> Axis:
    """Create the groups of a derived axis; every rank creates every group, in the same order."""
    mine = None
    group = None
    for ranks in group_ranks(layout, name):
        # new_group is collective over the default group: all ranks must call it for every group.
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine, group = ranks, g
    assert mine is not None
    return Axis(name, group, len(mine), mine.index(rank), mine, stats)


def unavailable_device(preference: str) -> str | None:
    """Why the device `preference` names cannot be used here, or None when it can."""
    if preference == "cuda" and not torch.cuda.is_available():
        build = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        return f"{build} (torch {torch.__version__})"
    return None


def device_for(preference: str = "auto") -> torch.device:
    """The device a rank computes on: CUDA (its local GPU) when available and wanted, else CPU."""
    import os

    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local)


__all__ = ["Axis", "CollectiveRecord", "CommStats", "FlightRecorder", "Mesh", "device_for", "ep_index", "edp_index",
           "unavailable_device"]
