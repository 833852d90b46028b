"""Flat gradient buckets: what data parallel and ZeRO share.

- parameters are grouped by the axis that replicates them (read from their Placement:
  "dp_cp" for ordinary weights, "edp" for experts under expert parallelism) and packed, in
  reverse registration order (roughly the order backward produces them), into buckets of
  about `bucket_mb`; each bucket owns one flat buffer that its parameters and gradients view
  (`FlatBucket`, `plan_buckets`);
- a `BucketReducer` counts, from post-accumulate-grad hooks, when a bucket's gradients are
  complete and launches its collective asynchronously, buckets of one axis strictly in order
  so every rank issues the same collectives in the same order (DDP does the same);
- `check_replicas_identical` proves, before training, that every replica starts from the
  same weights.

What a bucket's collective is (an all-reduce, a reduce-scatter) is the strategy's:
`data_parallel.py` and `zero.py` hand the reducer their `launch`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn as nn

from . import comm
from .mesh import Axis, Mesh
from .sharding import Placement, get_placement
from .optim import decays


MB = 1 << 20


DATA_AXES = ("dp_cp", "edp")  # axes over which gradients are summed, in order of preference


@dataclass
class Segment:
    """One parameter's place inside a bucket's flat buffer: elements [start, start + numel)."""

    name: str
    param: nn.Parameter
    start: int
    numel: int
    placement: Placement
    decays: bool

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class FlatBucket:
    """Parameters reduced (and, with ZeRO, sharded) together over one axis.

    `numel` includes the padding that makes it divisible by the axis size; padding lies at
    the end, after the last segment, and never belongs to a parameter.
    """

    axis: Axis
    segments: list[Segment]
    numel: int
    dtype: torch.dtype
    device: torch.device
    params: torch.Tensor | None = None  # (numel,) flat parameter storage the parameters view
    grads: torch.Tensor | None = None  # (numel,) flat gradient storage the .grad view (stages 0-1)
    index: int = 0  # position in the reducer's launch order
    extra: dict = field(default_factory=dict)

    @property
    def used(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def padding(self) -> int:
        return self.numel - self.used

    def shard_range(self) -> tuple[int, int]:
        """This rank's contiguous 1/n of the bucket (ZeRO ownership)."""
        size = self.numel // self.axis.size
        return self.axis.rank * size, (self.axis.rank + 1) * size

    def runs(self, lo: int, hi: int) -> Iterator[tuple[Segment, int, int]]:
        """(segment, start, end) of each parameter's overlap with [lo, hi), in flat coordinates."""
        for seg in self.segments:
            start, end = max(seg.start, lo), min(seg.end, hi)
            if start < end:
                yield seg, start, end

    def flatten_params_(self) -> None:
        """Move the parameters into one flat buffer and make each parameter a view of it."""
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for seg in self.segments:
            flat[seg.start : seg.end].copy_(seg.param.data.reshape(-1))
            seg.param.data = flat[seg.start : seg.end].view_as(seg.param)
        self.params = flat

    def cast_params_(self, dtype: torch.dtype) -> None:
        """Store the flat parameters in `dtype`; the parameters stay views of the new buffer."""
        if dtype == self.dtype:
            return
        assert self.params is not None, "flatten_params_ first"
        flat = self.params.to(dtype)
        for seg in self.segments:
            seg.param.data = flat[seg.start : seg.end].view_as(seg.param)
        self.params, self.dtype = flat, dtype

    def attach_grad_views_(self) -> None:
        """Give every parameter a .grad that views this bucket's flat gradient buffer."""
        self.grads = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for seg in self.segments:
            seg.param.grad = self.grads[seg.start : seg.end].view_as(seg.param)

    def grad_view(self, seg: Segment) -> torch.Tensor:
        assert self.grads is not None
        return self.grads[seg.start : seg.end].view_as(seg.param)

    def release_grads_(self) -> None:
        """Set every .grad to None and leave the flat buffer's values stale (nothing zeroed).

        A step's first gradient of each parameter is then the tensor backward produced, copied
        into the buffer by the reducer's hook (one copy, as DDP does), instead of being added
        to a buffer zeroed in advance (a memset and an add that reads twice). Parameters that
        get no gradient are zero-filled by `fill_missing_grads_` before anything reads them.
        """
        for seg in self.segments:
            seg.param.grad = None

    def fill_missing_grads_(self) -> None:
        """Give every parameter without a gradient this step a zeroed view of the flat buffer."""
        for seg in self.segments:
            if seg.param.grad is None:
                view = self.grad_view(seg)
                view.zero_()
                seg.param.grad = view

    def gather_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """A flat (numel,) tensor of the parameters' current .grad (zeros where None): `out`, or a new one."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device) if out is None else out
        flat[self.used :].zero_()
        for seg in self.segments:
            if seg.param.grad is not None:
                flat[seg.start : seg.end].copy_(seg.param.grad.reshape(-1))
            else:
                flat[seg.start : seg.end].zero_()
        return flat


def reduction_axis(placement: Placement) -> str | None:
    """The data axis whose ranks hold copies of this parameter (None: no data-parallel copy)."""
    return next((a for a in DATA_AXES if a in placement.replicated_over), None)


def local_axis(mesh: Mesh) -> Axis:
    """A size-1 stand-in for parameters no data axis replicates: nothing to reduce."""
    return Axis("local", None, 1, 0, [mesh.rank], mesh.stats)


def trainable(modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable parameter of every chunk, each parameter once."""
    seen: set[int] = set()
    named = []
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    return named


def group_by_axis(named: list[tuple[str, nn.Parameter]], mesh: Mesh) -> dict[tuple, list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by (reduction axis, dtype, device), in their original order."""
    groups: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        axis = reduction_axis(get_placement(p, name)) or "local"
        groups.setdefault((axis, p.dtype, p.device), []).append((name, p))
    return groups


def make_bucket(named: list[tuple[str, nn.Parameter]], axis: Axis, pad_to: int) -> FlatBucket:
    segments, offset = [], 0
    for name, p in named:
        placement = get_placement(p, name)
        segments.append(Segment(name, p, offset, p.numel(), placement, decays(p.dim())))
        offset += p.numel()
    numel = -(-offset // pad_to) * pad_to
    first = named[0][1]
    return FlatBucket(axis, segments, numel, first.dtype, first.device)


def plan_buckets(
    named: list[tuple[str, nn.Parameter]], mesh: Mesh, bucket_bytes: int, pad_to_axis: bool
) -> list[FlatBucket]:
    """Buckets of at most ~bucket_bytes per axis group, filled in reverse registration order.

    Reverse order approximates the order in which backward completes gradients, so early
    buckets are ready early. The bucket completed last is cut to at most a quarter of
    bucket_bytes (`split_tail`): with no backward left to hide it, its reduction is the wait
    between the backward and the optimizer. With `pad_to_axis`, each bucket's length is a
    multiple of its axis size (ZeRO shards buckets evenly).
    """
    buckets: list[FlatBucket] = []
    for (axis_name, _, _), members in group_by_axis(named, mesh).items():
        axis = mesh[axis_name] if axis_name != "local" else local_axis(mesh)
        pad_to = axis.size if pad_to_axis else 1
        groups: list[list[tuple[str, nn.Parameter]]] = [[]]
        size = 0
        for name, p in reversed(members):
            nbytes = p.numel() * p.element_size()
            if groups[-1] and size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, p))
            size += nbytes
        groups[-1:] = split_tail(groups[-1], bucket_bytes // TAIL_FRACTION)
        buckets.extend(make_bucket(group, axis, pad_to) for group in groups if group)
    for i, bucket in enumerate(buckets):
        bucket.index = i
    return buckets


TAIL_FRACTION = 4  # the last bucket holds at most bucket_bytes / TAIL_FRACTION (one or more parameters)


def split_tail(group: list[tuple[str, nn.Parameter]], tail_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    """[rest, tail]: the last parameters of `group` (those backward completes last) up to
    `tail_bytes` (at least one) as their own bucket; [group] when it all fits in the tail."""
    size, cut = 0, len(group)
    while cut > 0:
        nbytes = group[cut - 1][1].numel() * group[cut - 1][1].element_size()
        if cut < len(group) and size + nbytes > tail_bytes:
            break
        size += nbytes
        cut -= 1
    return [group[:cut], group[cut:]] if cut > 0 else [group]


@torch.no_grad()
def check_replicas_identical(buckets: list[FlatBucket]) -> None:
    """Raise unless every replica of every parameter holds the same values (checked, not assumed).

    Each parameter contributes two float64 fingerprints (its sum and a position-weighted sum);
    the max and the min over the replicas' group must agree for every one of them.
    """
    by_axis: dict[str, tuple[Axis, list[Segment]]] = {}
    for bucket in buckets:
        by_axis.setdefault(bucket.axis.name, (bucket.axis, []))[1].extend(bucket.segments)
    for axis, segments in by_axis.values():
        if axis.size == 1:
            continue
        prints = torch.stack([_fingerprint(seg.param.data) for seg in segments]).reshape(-1)
        both = torch.cat([prints, -prints])  # on the parameters' device: where the axis's collectives run
        comm.all_reduce(both, axis, op="max")
        high, low = both[: prints.numel()], -both[prints.numel() :]
        differs = (high != low).reshape(len(segments), 2).any(dim=1)
        if differs.any():
            bad = [segments[i].name for i in differs.nonzero().flatten().tolist()]
            raise RuntimeError(
                f"data-parallel replicas over axis {axis.name} (ranks {axis.ranks}) start from different "
                f"weights for {len(bad)} parameter(s), e.g. {', '.join(bad[:3])}; every replica must be "
                "initialised identically (same seed, same materialisation)"
            )


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(1021).add_(1)
    return torch.stack([flat.sum(), (flat * weights).sum()])


class Pending:
    """An in-flight collective and what to do once it has landed."""

    def __init__(self, work, then: Callable[[], None] | None = None, keep: tuple = ()) -> None:
        self.work, self.then, self.keep = work, then, keep  # keep: buffers the collective uses

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.then is not None:
            self.then()


class BucketReducer:
    """Launches each bucket's reduction as soon as backward has completed all its gradients.

    `launch(bucket) -> Pending` starts the collective; `on_complete(bucket)` (optional) runs
    on every completion, also inside no_sync (ZeRO-3 frees gathered parameters there);
    a bucket for which `defer(bucket)` is true is launched by `finish()` only.
    Launches follow bucket order per axis and group, so all ranks issue collectives identically.

    `per_backward` (ZeRO-2/3): every backward is reduced, inside no_sync too. At the end of a
    backward (an autograd engine callback, as DDP uses) the buckets of every group it touched
    (a group is a model chunk, `bucket.extra["group"]`) that have not launched are launched,
    all its collectives are waited for, and a new round starts. Without it, only backward
    passes outside no_sync reduce, and `finish()` launches what is left.
    """

    def __init__(
        self,
        buckets: list[FlatBucket],
        launch: Callable[[FlatBucket], Pending],
        on_complete: Callable[[FlatBucket], None] | None = None,
        defer: Callable[[FlatBucket], bool] = lambda _bucket: False,
        per_backward: bool = False,
    ) -> None:
        self.buckets, self.launch, self.on_complete = buckets, launch, on_complete
        self.syncing = True
        self.defer = defer  # True: reduce the bucket only in finish() (ZeRO, when grad finalizers must run first)
        self.per_backward = per_backward
        self.pending: list[Pending] = []
        self.touched: set[int] = set()  # groups whose gradients this backward produced (per_backward)
        self._reset()
        for bucket in buckets:
            for seg in bucket.segments:
                seg.param.register_post_accumulate_grad_hook(self._hook(bucket, seg))

    def _reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.launched = [False] * len(self.buckets)
        self.next_by_axis: dict[tuple[str, int, bool], list[int]] = {}
        for bucket in self.buckets:
            self.next_by_axis.setdefault(_queue_key(bucket), []).append(bucket.index)

    def _hook(self, bucket: FlatBucket, seg: Segment) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.launched[bucket.index]:
                raise RuntimeError(
                    f"the gradient of {seg.name} arrived after its bucket was reduced: run every backward "
                    "of a step but the last inside optimizer.no_sync()"
                )
            if bucket.grads is not None and param.grad is not None:
                view = bucket.grad_view(seg)
                if param.grad.data_ptr() != view.data_ptr():  # the step's first gradient, or a replaced .grad
                    view.copy_(param.grad)
                    param.grad = view
            reducing = not self.defer(bucket) and (self.syncing or self.per_backward)
            if reducing and self.per_backward:
                self._join_round(bucket)
            self.ready[bucket.index] += 1
            if self.ready[bucket.index] == len(bucket.segments):
                self.ready[bucket.index] = 0
                if self.on_complete is not None:
                    self.on_complete(bucket)
                if reducing:
                    self._mark_complete(bucket)

        return hook

    def _join_round(self, bucket: FlatBucket) -> None:
        if not self.touched:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.touched.add(bucket.extra.get("group", 0))

    def _end_of_backward(self) -> None:
        """Launch the touched groups' remaining buckets (in order; not the deferred), wait, start a new round."""
        for bucket in self.buckets:
            if bucket.extra.get("group", 0) in self.touched and not self.launched[bucket.index]:
                if not self.defer(bucket):
                    self._mark_complete(bucket)
        self._wait_all()
        self.touched.clear()

    def _mark_complete(self, bucket: FlatBucket) -> None:
        bucket.extra["complete"] = True
        order = self.next_by_axis[_queue_key(bucket)]
        while order and self.buckets[order[0]].extra.get("complete"):
            self._launch(self.buckets[order.pop(0)])

    def _launch(self, bucket: FlatBucket) -> None:
        self.launched[bucket.index] = True
        self.pending.append(self.launch(bucket))

    def finish(self) -> None:
        """Launch what backward did not complete (unused parameters, deferral), wait for all.

        In per_backward mode every backward has already been reduced, but the deferred buckets.
        """
        for bucket in self.buckets:
            if not self.launched[bucket.index] and (not self.per_backward or self.defer(bucket)):
                self._launch(bucket)
        self._wait_all()

    def _wait_all(self) -> None:
        for pending in self.pending:
            pending.wait()
        self.pending = []
        for bucket in self.buckets:
            bucket.extra.pop("complete", None)
        self._reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous


def _queue_key(bucket: FlatBucket) -> tuple[str, int, bool]:
    # Deferred buckets (zero.py) queue apart: they launch in finish(), never ahead of the others.
    return bucket.axis.name, bucket.extra.get("group", 0), bucket.extra.get("deferred", False)


def flat_params(bucket: FlatBucket) -> torch.Tensor:
    assert bucket.params is not None, "the bucket's parameters are not flattened yet"
    return bucket.params


def flat_grads(bucket: FlatBucket) -> torch.Tensor:
    assert bucket.grads is not None, "the bucket has no flat gradient buffer"
    return bucket.grads
