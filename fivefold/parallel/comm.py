"""Every collective fivefold runs, each named by the axis it runs on and counted in bytes.

Two layers:
- plain collectives (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `send_recv`)
  that record, per axis, the bytes this rank puts on the wire under the ring algorithm;
- autograd functions in conjugate pairs (Megatron's f/g operators), whose backward is the
  transpose of their forward: identity <-> all-reduce, split <-> all-gather,
  all-gather <-> reduce-scatter, all-to-all <-> reverse all-to-all.

An axis of size 1 short-circuits every operation, so single-process code pays nothing.
Wire bytes per rank (n = group size, B = full buffer bytes):
all-reduce 2(n-1)/n B; all-gather and reduce-scatter (n-1)/n B; all-to-all the bytes
sent to other ranks; point-to-point the bytes sent.

Every tensor handed to a collective must live on the mesh's device type (`Axis.device_type`,
the model's): NCCL refuses host tensors ("No backend type associated with device type cpu"),
gloo takes them. The check runs on every backend, so a host tensor that would stop a GPU job
fails here on a laptop too, naming the axis, the operation and the device.

Every collective is also logged in the mesh's flight recorder (`CommStats.flight`): axis,
op, sequence number on that axis, bytes, start time and whether it completed. A
`CollectiveWatchdog` thread per rank ends the rank with a flight record on disk when one
stays unfinished longer than `train.collective_timeout_s`; `fivefold.job.launch` turns the
records of all ranks into one report that names the rank that did not arrive.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..rules import p2p_order
from .mesh import Axis, CollectiveRecord, FlightRecorder

COLLECTIVE_TIMEOUT_EXIT = 75  # exit status of a rank ended by its watchdog (EX_TEMPFAIL)
PEER_LOST_EXIT = 76  # exit status of a rank whose collective failed because a peer went away
FLIGHT_DIR_ENV = "FIVEFOLD_FLIGHT_DIR"  # set by fivefold.job.launch: where this attempt's ranks write flight records


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective does not live where the mesh's collectives run."""


def _on_mesh_device(axis: Axis, op: str, *tensors: torch.Tensor) -> None:
    """Refuse a tensor off the mesh's device type before it reaches the backend (one string
    comparison per tensor: always on)."""
    for t in tensors:
        if t.device.type != axis.device_type:
            raise CollectiveDeviceError(
                f"{op} on axis {axis.name}: a tensor on {t.device}, but this mesh's collectives run on "
                f"{axis.device_type} (NCCL takes only GPU tensors); create it on the model's device"
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(axis: Axis, op: str, buffer_bytes: int, wire_bytes: int) -> CollectiveRecord:
    """Count the bytes and open the collective's flight record."""
    axis.stats.add(axis.name, op, buffer_bytes, wire_bytes)
    return axis.stats.flight.start(axis.name, axis.ranks, op, buffer_bytes)


class _RecordedWork:
    """An async collective's handle that also tells the flight recorder when a wait returns
    (some gloo handles never report `is_completed()`; the recorder must not see them hang)."""

    def __init__(self, work: Any, record: CollectiveRecord, axis: Axis) -> None:
        self._work, self._record, self._axis = work, record, axis

    def wait(self, *args: Any) -> Any:
        result = self._work.wait(*args)
        self._axis.stats.flight.waited(self._record)
        return result

    def is_completed(self) -> bool:
        return self._record.finished is not None or self._work.is_completed()

    def __getattr__(self, name: str) -> Any:  # everything else is the handle's own
        return getattr(self._work, name)


class _DeviceDone:
    """Completion of a blocking collective as the device sees it.

    On a GPU a blocking call returns once the collective is queued on the stream (NCCL runs
    it later): an event recorded right after it completes only when the collective has. The
    watchdog's sweep asks the event, so a collective stuck on the GPU stays in flight in the
    record and the hang report names it (not whatever the host reached next)."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def is_completed(self) -> bool:
        return bool(self._event.query())


def device_completion_event(device_type: str) -> Any:
    """An event recorded on the current stream of `device_type`, or None where a call that
    returned has completed (CPU, meta)."""
    if device_type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _landed(axis: Axis, record: CollectiveRecord, work: Any) -> Any:
    """Hand the collective's outcome to the flight recorder: done for a blocking call (`work`
    is None) on the host, done when the device gets past it on a GPU, to be swept or waited
    for async work. Returns the handle to wait on."""
    if work is None:
        event = device_completion_event(axis.device_type)
        axis.stats.flight.issued_async(record, [] if event is None else [_DeviceDone(event)])
        return None
    axis.stats.flight.issued_async(record, [work])
    return _RecordedWork(work, record, axis)


def _emulates_sharded_collectives(axis: Axis) -> bool:
    """True where the backend has no reduce-scatter or all-gather worth calling (gloo: its
    reduce-scatter clones the input and all-reduces the clone, its all-gather goes through a
    fresh temporary); NCCL and others keep their native collectives."""
    return dist.get_backend(axis.group) == dist.Backend.GLOO


class _AllOf:
    """One handle for several async collectives that together make one operation."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, *args: Any) -> bool:
        for work in self._works:
            work.wait(*args)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _waited_together(works: list[Any], async_op: bool) -> Any:
    """The works as one handle when async; otherwise wait for them now (returns None)."""
    if async_op:
        return _AllOf(works)
    for work in works:
        work.wait()
    return None


# ----------------------------------------------------------------------------- plain collectives


def all_reduce(tensor: torch.Tensor, axis: Axis, op: str = "sum", async_op: bool = False):
    """In-place all-reduce; op is "sum", "avg" (sum then divide) or "max".

    With `async_op` returns the handle (None on an axis of size 1): `tensor` holds the result
    once it is waited on (for "avg" the division runs in that wait).
    """
    if axis.size == 1:
        return None
    n = axis.size
    _on_mesh_device(axis, "all_reduce", tensor)
    record = _record(axis, "all_reduce", _nbytes(tensor), 2 * (n - 1) * _nbytes(tensor) // n)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    work = _landed(axis, record, dist.all_reduce(tensor, op=reduce_op, group=axis.group, async_op=async_op))
    if op == "avg":
        if async_op:
            return _FinishOnWait(work, lambda: tensor.div_(n))
        tensor.div_(n)
    return work


class _FinishOnWait:
    """An async handle whose result needs one local step after the collective (a division
    for an average): the step runs once, in the first wait, so issuing never blocks.

    Later waits return at once: gloo's reduce-scatter handle copies its result into the
    output again on every wait, which would overwrite the finished (divided) values.
    """

    def __init__(self, work: Any, finish: Callable[[], object]) -> None:
        self._work, self._finish, self._finished = work, finish, False

    def wait(self, *args: Any) -> bool:
        if not self._finished:
            self._work.wait(*args)
            self._finish()
            self._finished = True
        return True

    def is_completed(self) -> bool:
        """True once the result is usable: after a wait (the local step runs there)."""
        return self._finished

    def __getattr__(self, name: str) -> Any:  # everything else is the handle's own
        return getattr(self._work, name)


def all_gather(tensor: torch.Tensor, axis: Axis, dim: int = 0, async_op: bool = False):
    """Concatenate every rank's `tensor` along `dim`. Returns the output, or (output, handle)
    with `async_op`: the output is filled once the handle is waited on (handle None on an
    axis of size 1), for any `dim`.
    """
    if axis.size == 1:
        return (tensor, None) if async_op else tensor
    n = axis.size
    _on_mesh_device(axis, "all_gather", tensor)
    # The collective concatenates along dim 0: gather with `dim` moved to the front, into
    # one buffer whose view with `dim` moved back is the result (no copy after the gather).
    local = tensor.movedim(dim, 0).contiguous()
    gathered = torch.empty((n * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    record = _record(axis, "all_gather", _nbytes(gathered), (n - 1) * _nbytes(local))
    work = _landed(axis, record, dist.all_gather_single(gathered, local, group=axis.group, async_op=async_op))
    out = gathered.movedim(0, dim)
    return (out, work) if async_op else out


def all_gather_into(out: torch.Tensor, local: torch.Tensor, axis: Axis, async_op: bool = False):
    """Concatenate every rank's flat `local` into the caller's flat buffer `out` (n x local.numel()).

    For callers that own the destination (ZeRO gathers parameters into their flat storage).
    Returns the work handle when async, else None.
    """
    n = axis.size
    if out.numel() != n * local.numel():
        raise ValueError(f"all_gather_into on axis {axis.name}: {out.numel()} != {n} x {local.numel()}")
    if n == 1:
        out.copy_(local.reshape(out.shape))
        return None
    _on_mesh_device(axis, "all_gather", out, local)
    record = _record(axis, "all_gather", _nbytes(out), (n - 1) * _nbytes(local))
    if not _emulates_sharded_collectives(axis):
        work = dist.all_gather_single(out, local.contiguous(), group=axis.group, async_op=async_op)
        return _landed(axis, record, work)
    # gloo gathers through a fresh flat temporary and copies it into `out`; one broadcast per
    # rank straight into its slice of `out` moves the same bytes and copies nothing.
    slices = out.view(-1).chunk(n)
    own = slices[axis.rank]
    if own.data_ptr() != local.data_ptr():
        own.copy_(local.reshape(own.shape))
    works = [dist.broadcast(s, src=axis.global_rank(i), group=axis.group, async_op=True) for i, s in enumerate(slices)]
    return _landed(axis, record, _waited_together(works, async_op))


def reduce_scatter(
    tensor: torch.Tensor, axis: Axis, dim: int = 0, op: str = "sum", async_op: bool = False,
    overwrite_input: bool = False,
):
    """Sum (or average) `tensor` over the axis and keep this rank's 1/n shard along `dim`.

    Returns the shard, or (shard, handle) with `async_op`: the shard holds the result once the
    handle is waited on (for "avg" the division runs in that wait; handle None on an axis of
    size 1), for any `dim`. `overwrite_input`: the caller discards `tensor` afterwards, so the
    collective may change it (see `reduce_scatter_into`).
    """
    if axis.size == 1:
        return (tensor, None) if async_op else tensor
    n = axis.size
    full = tensor.movedim(dim, 0).contiguous()
    if full.shape[0] % n:
        raise ValueError(f"reduce_scatter on axis {axis.name}: dim size {full.shape[0]} not divisible by {n}")
    shard = torch.empty((full.shape[0] // n,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
    work = reduce_scatter_into(shard, full, axis, async_op=async_op, overwrite_input=overwrite_input)
    out = shard.movedim(0, dim)  # a view: filled by the collective, whenever it lands
    if op == "avg":
        if async_op:
            return out, _FinishOnWait(work, lambda: shard.div_(n))
        shard.div_(n)
    return (out, work) if async_op else out


def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, axis: Axis, async_op: bool = False, overwrite_input: bool = False,
    scratch: torch.Tensor | None = None,
):
    """Sum the flat `full` over the axis into the caller's flat buffer `out` (full.numel() / n).

    For callers that own the destination (ZeRO lands a gradient shard in its own storage);
    `out` may be this rank's slice of `full` (in place). Returns the work handle when async.
    `overwrite_input`: the caller no longer needs `full`'s other slices, so the collective may
    leave anything there.

    gloo has no reduce-scatter of its own (torch's clones `full`, all-reduces the clone and
    copies the slice out), so on gloo: two ranks swap halves and add (half an all-reduce's
    bytes); more ranks all-reduce `full` in place when it may be overwritten. Either gives the
    all-reduce's sum bit for bit (for two ranks it is one addition, which commutes).
    `scratch`: a flat buffer of out.numel() elements the two-rank exchange may receive into
    (a caller that reduces every step keeps one instead of a fresh allocation per call).
    """
    n = axis.size
    if full.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter_into on axis {axis.name}: {full.numel()} != {n} x {out.numel()}")
    if n == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full.reshape(out.shape))
        return None
    _on_mesh_device(axis, "reduce_scatter", out, full)
    if scratch is not None:
        _on_mesh_device(axis, "reduce_scatter", scratch)
    record = _record(axis, "reduce_scatter", _nbytes(full), (n - 1) * _nbytes(out))
    if _emulates_sharded_collectives(axis) and n == 2:
        return _reduce_scatter_by_exchange(out, full, axis, record, async_op, scratch)
    if overwrite_input and _emulates_sharded_collectives(axis):
        work = _landed(axis, record, dist.all_reduce(full, op=dist.ReduceOp.SUM, group=axis.group, async_op=async_op))
        own = full.view(-1).chunk(n)[axis.rank]
        if own.data_ptr() == out.data_ptr():
            return work
        return _then(work, lambda: out.copy_(own.reshape(out.shape)))
    work = dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=axis.group, async_op=async_op)
    return _landed(axis, record, work)


def _reduce_scatter_by_exchange(
    out: torch.Tensor, full: torch.Tensor, axis: Axis, record: CollectiveRecord, async_op: bool,
    scratch: torch.Tensor | None = None,
) -> Any:
    """Two ranks: send the peer its half of `full`, receive the peer's copy of ours, add.

    Reads `full` only. The tag is the collective's sequence number on the axis (the same on
    both ranks), so two exchanges in flight never take each other's messages."""
    halves = full.view(-1).chunk(2)
    own, theirs = halves[axis.rank], halves[1 - axis.rank]
    received = torch.empty_like(own) if scratch is None else scratch.view(-1)
    peer, tag = axis.global_rank(1 - axis.rank), record.seq % (1 << 31)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, theirs, peer, group=axis.group, tag=tag),
        dist.P2POp(dist.irecv, received, peer, group=axis.group, tag=tag),
    ])
    flat_out = out.view(-1)

    def add() -> None:
        if flat_out.data_ptr() == own.data_ptr():
            own.add_(received)
        else:
            torch.add(own, received, out=flat_out)

    return _then(_landed(axis, record, _waited_together(works, async_op)), add)


def _then(work: Any, step: Callable[[], object]) -> Any:
    """Run `step` after the collective: now when it was blocking (`work` None), else in the
    handle's first wait."""
    if work is None:
        step()
        return None
    return _FinishOnWait(work, step)


def broadcast(tensor: torch.Tensor, axis: Axis, src_group_rank: int = 0) -> torch.Tensor:
    if axis.size == 1:
        return tensor
    n = axis.size
    _on_mesh_device(axis, "broadcast", tensor)
    record = _record(axis, "broadcast", _nbytes(tensor), (n - 1) * _nbytes(tensor) // n)
    _landed(axis, record, dist.broadcast(tensor, src=axis.global_rank(src_group_rank), group=axis.group))
    return tensor


def barrier(axis: Axis) -> None:
    """Wait until every rank of the axis got here (logged in the flight recorder, no bytes counted)."""
    if axis.size == 1:
        return
    _landed(axis, axis.stats.flight.start(axis.name, axis.ranks, "barrier", 0), dist.barrier(group=axis.group))


def all_to_all(
    tensor: torch.Tensor, axis: Axis, send_splits: Sequence[int] | None = None, recv_splits: Sequence[int] | None = None
) -> torch.Tensor:
    """Exchange row blocks along dim 0: block i of `tensor` goes to group rank i.

    With no splits, the rows are split evenly. Returns the received rows, in rank order.
    """
    if axis.size == 1:
        return tensor
    n = axis.size
    _on_mesh_device(axis, "all_to_all", tensor)
    tensor = tensor.contiguous()
    if send_splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"all_to_all on axis {axis.name}: {tensor.shape[0]} rows not divisible by {n}")
        send_splits = [tensor.shape[0] // n] * n
    if recv_splits is None:
        recv_splits = list(send_splits)
    row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
    out = torch.empty((sum(recv_splits),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    sent_to_others = sum(s for i, s in enumerate(send_splits) if i != axis.rank) * row_bytes
    record = _record(axis, "all_to_all", _nbytes(tensor), sent_to_others)
    dist.all_to_all_single(
        out, tensor, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=axis.group
    )
    _landed(axis, record, None)
    return out


def send_recv(
    axis: Axis,
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    op_name: str = "p2p",
) -> list:
    """Post point-to-point sends and receives together (batched); peers are group ranks.

    Returns the work handles; the caller waits on them. Only sent bytes are counted. The
    batch is one flight record, finished when all its handles are complete, and one group
    of `CommStats.recording_p2p` when that is on (peers as global ranks).
    """
    _on_mesh_device(axis, op_name, *(t for t, _ in (*sends, *recvs)))
    if axis.stats.p2p_groups is not None and (sends or recvs):
        axis.stats.p2p_groups.append(tuple(
            [p2p_order.P2POp("send", axis.global_rank(peer), _nbytes(t)) for t, peer in sends]
            + [p2p_order.P2POp("recv", axis.global_rank(peer), _nbytes(t)) for t, peer in recvs]
        ))
    ops = []
    for tensor, peer in sends:
        axis.stats.add(axis.name, op_name, _nbytes(tensor), _nbytes(tensor))
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), axis.global_rank(peer), group=axis.group))
    for tensor, peer in recvs:
        ops.append(dist.P2POp(dist.irecv, tensor, axis.global_rank(peer), group=axis.group))
    if not ops:
        return []
    record = axis.stats.flight.start(axis.name, axis.ranks, op_name, sum(_nbytes(t) for t, _ in (*sends, *recvs)))
    works = dist.batch_isend_irecv(ops)
    axis.stats.flight.issued_async(record, works)
    return works


# ----------------------------------------------------------------------------- autograd pairs


class _CopyToAxis(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (the input feeds every rank's shard)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.axis)
        return grad, None


class _ReduceFromAxis(torch.autograd.Function):
    """Forward: all-reduce (sum partial results). Backward: identity."""

    @staticmethod
    def forward(ctx, x, axis):
        out = x.contiguous().clone()
        all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _own_shard(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """This rank's shard of `x`: part `axis.rank` of `axis.size` equal splits along `dim`."""
    return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()


def _conjugate_pair(name: str, doc: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function over (x, axis, dim) that runs `forward(x, axis, dim)` and whose
    backward runs `backward(grad, axis, dim)`: the four pairs below differ only in these."""

    def run_forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return forward(x, axis, dim)

    def run_backward(ctx, grad):
        return backward(grad, ctx.axis, ctx.dim), None, None

    body = {"__doc__": doc, "forward": staticmethod(run_forward), "backward": staticmethod(run_backward)}
    return type(name, (torch.autograd.Function,), body)


def _gather(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    return all_gather(x, axis, dim=dim)


def _scatter(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    return reduce_scatter(x, axis, dim=dim)


_SplitToAxis = _conjugate_pair(
    "_SplitToAxis", "Forward: keep this rank's shard along dim. Backward: all-gather the gradient.",
    _own_shard, _gather)
_GatherFromAxis = _conjugate_pair(
    "_GatherFromAxis", "Forward: all-gather along dim. Backward: keep this rank's shard of the gradient.",
    _gather, _own_shard)
_AllGatherReduceScatter = _conjugate_pair(
    "_AllGatherReduceScatter", "Forward: all-gather along dim. Backward: reduce-scatter (sequence parallel's entry).",
    _gather, _scatter)
_ReduceScatterAllGather = _conjugate_pair(
    "_ReduceScatterAllGather", "Forward: reduce-scatter along dim. Backward: all-gather (sequence parallel's exit).",
    _scatter, _gather)


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with (uneven) splits. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, axis, send_splits, recv_splits):
        ctx.axis, ctx.send, ctx.recv = axis, send_splits, recv_splits
        return all_to_all(x, axis, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.axis, ctx.recv, ctx.send), None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Forward: all-reduce sum. Backward: all-reduce sum (for a value every rank then uses)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        out = x.contiguous().clone()
        all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.axis)
        return grad, None


def copy_to(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _CopyToAxis.apply(x, axis)


def reduce_from(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _ReduceFromAxis.apply(x, axis)


def split_to(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    return x if axis.size == 1 else _SplitToAxis.apply(x, axis, dim)


def gather_from(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    return x if axis.size == 1 else _GatherFromAxis.apply(x, axis, dim)


def all_gather_to_full(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Sequence-parallel entry: all-gather forward, reduce-scatter backward."""
    return x if axis.size == 1 else _AllGatherReduceScatter.apply(x, axis, dim)


def reduce_scatter_to_shard(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Sequence-parallel exit: reduce-scatter forward, all-gather backward."""
    return x if axis.size == 1 else _ReduceScatterAllGather.apply(x, axis, dim)


def all_to_all_autograd(
    x: torch.Tensor, axis: Axis, send_splits: Sequence[int] | None = None, recv_splits: Sequence[int] | None = None
) -> torch.Tensor:
    if axis.size == 1:
        return x
    send = list(send_splits) if send_splits is not None else None
    recv = list(recv_splits) if recv_splits is not None else send
    return _AllToAll.apply(x, axis, send, recv)


def sum_over(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """All-reduce sum whose gradient is also summed: for statistics every rank uses in its loss."""
    return x if axis.size == 1 else _AllReduceSum.apply(x, axis)


# ----------------------------------------------------------------------------- watchdog


def flight_record_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank_{rank:05d}.json"


def write_flight_record(
    flight: FlightRecorder, rank: int, folder: Path, stuck: CollectiveRecord, timeout_s: float, error: str = ""
) -> Path:
    """Write this rank's flight record as JSON (atomically: a reader never sees half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = flight_record_path(folder, rank)
    body = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "timeout_s": timeout_s, "stuck": asdict(stuck), "error": error, **flight.dump()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)
    return path


class CollectiveWatchdog:
    """Ends this rank when one of its collectives stays unfinished longer than `timeout_s`.

    A peer that died, stopped or took another branch leaves its partners blocked inside a
    collective; gloo would only notice at the process-group timeout, NCCL perhaps never. The
    watchdog writes the flight record (what this rank was waiting for, and its last
    collectives) to `folder` and exits with COLLECTIVE_TIMEOUT_EXIT: the launcher then
    reports, from all ranks' records, which rank did not arrive.
    """

    def __init__(self, flight: FlightRecorder, rank: int, timeout_s: float, folder: Path) -> None:
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"train.collective_timeout_s must be a positive number of seconds, got {timeout_s}")
        self.flight, self.rank, self.timeout_s, self.folder = flight, rank, timeout_s, Path(folder)
        self._stop = threading.Event()
        # A daemon: a rank that fails with an exception must still be able to exit.
        self._thread = threading.Thread(target=self._watch, name="fivefold-collective-watchdog", daemon=True)

    def start(self) -> "CollectiveWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            self.flight.sweep()
            stuck = self.flight.oldest_in_flight()
            if stuck is not None and time.time() - stuck.started > self.timeout_s:
                self._give_up(stuck)

    def end_if_peer_lost(self, err: BaseException) -> None:
        """After `err` ended the rank's work: when it is the backend failing an in-flight
        collective (a peer exited, was killed, or timed out first), write the flight record,
        say so in one line and exit with PEER_LOST_EXIT; otherwise return (a real error keeps
        its traceback)."""
        # The failed collective is still in flight, or (async, already swept as complete) the newest.
        stuck = self.flight.oldest_in_flight() or self.flight.newest()
        if stuck is None or not is_backend_failure(err):
            return
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self._end(stuck, f"failed: {first_line}", PEER_LOST_EXIT, error=first_line)

    def _give_up(self, stuck: CollectiveRecord) -> None:
        waited = f"unfinished after {time.time() - stuck.started:.1f} s (train.collective_timeout_s={self.timeout_s:g})"
        self._end(stuck, waited, COLLECTIVE_TIMEOUT_EXIT)

    def _end(self, stuck: CollectiveRecord, what: str, code: int, error: str = "") -> None:
        try:
            path = write_flight_record(self.flight, self.rank, self.folder, stuck, self.timeout_s, error)
            where = f"flight record {path}"
        except OSError as err:
            where = f"could not write the flight record: {err}"
        sys.stdout.flush()
        print(f"rank {self.rank}: {stuck.op} #{stuck.seq} on axis {stuck.axis} (ranks {list(stuck.group)}) {what}; {where}",
              file=sys.stderr, flush=True)
        os._exit(code)  # the main thread may be blocked in the collective: end the process here


def is_backend_failure(err: BaseException) -> bool:
    """True for the errors gloo and NCCL raise when a collective cannot complete."""
    if type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(key in text for key in ("gloo", "NCCL", "Connection closed", "Timed out"))
