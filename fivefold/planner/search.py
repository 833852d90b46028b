"""Layout search: enumerate valid layouts, drop those that do not fit, rank by step time.

Pruning (exact under the cost model, so no faster layout is lost): for a fixed structure
(degrees, schedule, micro-batch, sequence parallelism, context-parallel kind), more
recomputation only adds FLOPs and communication and a higher ZeRO stage from 1 upwards
only adds communication; so among the (ZeRO, recomputation) pairs that fit, only those
not dominated in both are timed. ZeRO-0 and ZeRO-1 are both kept (their overlap differs).
ZeRO-3 is tried with both gather policies (per micro-batch, once per step) and the two are
pruned apart (`_frontier`).
GPipe is not enumerated by default: it has 1F1B's bubble and more activation memory.

With ``top`` set, structures are visited in order of a lower bound on their step time
(`estimate.time_lower_bound`); the visit stops once that bound exceeds the
``top``-th best time found, which again loses no layout that would rank in the top.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Iterator

from ..config import Config, Layout
from ..rules.layout import LayoutError, _check_zero, validate
from .bridge import runtime_config
from .errors import PlanError
from .estimate import CostCache, Estimate, estimate_valid, memory_grid_valid, time_lower_bound
from .hardware import GiB, Hardware, get_hardware
from .models import load_model
from .spec import CP_KINDS, LayoutSpec, ModelSpec, divisors
from .validate import routes

DEFAULT_SCHEDULES = ("1f1b", "interleaved", "zb-h1")
DEFAULT_MICRO_BATCHES = (1, 2, 4)
_RECOMPUTE_ORDER = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


State = tuple[int, str, str]  # (ZeRO stage, ZeRO-3 gather policy, recomputation)


def _frontier(fits: list[State]) -> list[State]:
    """States not dominated by one with the same gather policy, zero' <= zero and less recompute.

    ZeRO-3 gathering once per step is compared only with itself: it moves fewer bytes than
    gathering per micro-batch but holds more, and its gathers overlap the forward where
    ZeRO-1/2's follow the update, so neither it nor a lower stage is faster in every case."""
    rank = lambda r: _RECOMPUTE_ORDER.index(r)  # noqa: E731
    keep = []
    for z, g, r in fits:
        dominated = any((z2, g2, r2) != (z, g, r) and g2 == g and rank(r2) <= rank(r)
                        and (z2 <= z and not (z2 == 0 and z == 1))
                        for z2, g2, r2 in fits)
        if not dominated:
            keep.append((z, g, r))
    return keep


def _state_memory(m: ModelSpec, lay: LayoutSpec, hw: Hardware, precision: str, optimizer: str,
                  stages: tuple[int, ...], cache: CostCache) -> dict[State, int]:
    """Worst-stage bytes of ``lay`` in every state: each accepted ZeRO stage gathering per
    micro-batch, and ZeRO-3 also gathering once per step (`layout.zero3_gather`)."""
    grid = memory_grid_valid(m, lay, hw, precision, optimizer, stages, cache=cache)
    out = {(z, "micro_batch", r): v for (z, r), v in grid.items()}
    if 3 in stages:
        step = lay.with_states(lay.zero, lay.recompute, "step")
        out.update({(z, "step", r): v for (z, r), v in memory_grid_valid(m, step, hw, precision, optimizer, (3,),
                                                                         cache=cache).items()})
    return out


def _accepted(config: Config) -> Config | None:
    """The runtime's `validate` of ``config``, or None when ``fivefold train`` refuses it."""
    try:
        return validate(config)
    except LayoutError:
        return None


def _zero_stages(layout: Layout) -> tuple[int, ...]:
    """ZeRO stages the runtime accepts for a layout it accepts (its zero rule; hybrid sharding
    needs a ZeRO stage)."""
    stages = []
    for z in ZERO_STAGES:
        try:
            _check_zero(dataclasses.replace(layout, zero=z))
        except LayoutError:
            continue
        stages.append(z)
    return tuple(stages)


def _accepted_tp(model: ModelSpec, precision: str, limit: int, gpus: int) -> list[int]:
    """Tensor-parallel degrees the runtime accepts for the model (checked on tp alone)."""
    out = []
    for tp in divisors(gpus):
        if tp <= limit and _accepted(runtime_config(model, LayoutSpec(tp=tp, global_batch=1), precision)):
            out.append(tp)
    return out


def structures(model: ModelSpec, gpus: int, hw: Hardware, global_batch: int,
               schedules=DEFAULT_SCHEDULES, micro_batches=DEFAULT_MICRO_BATCHES,
               max_tp: int | None = None, max_vpp: int = 4, precision: str = "bf16") -> Iterator[LayoutSpec]:
    """Every `LayoutSpec` shape (ZeRO 0, no recomputation) of ``gpus`` devices whose degrees
    multiply to ``gpus`` and split the batch; the runtime's validation is left to the caller."""
    tp_limit = min(max_tp or hw.gpus_per_node, hw.gpus_per_node)
    for tp in _accepted_tp(model, precision, tp_limit, gpus):
        for pp in divisors(gpus // tp):
            if pp > model.layers:
                continue
            for cp in divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                for dp_shard in _shard_degrees(tp, cp, dp, hw.gpus_per_node):
                    for lay in _variants(model, global_batch, tp, pp, cp, dp, schedules, micro_batches, max_vpp,
                                         dp_shard):
                        if routes(model, lay, hw):  # node-limited routing needs its nodes in the ep group
                            yield lay


def _shard_degrees(tp: int, cp: int, dp: int, gpus_per_node: int) -> list[int]:
    """0 (ZeRO over all of dp), and the hybrid sharding whose shard groups (dp_shard x cp x tp
    neighbouring ranks) fill one node, when that leaves several replicas."""
    per_node = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
    hybrid = per_node > 1 or (per_node == 1 and cp > 1)
    return [0, per_node] if hybrid and dp % per_node == 0 and dp // per_node > 1 else [0]


def _variants(model, gb, tp, pp, cp, dp, schedules, micro_batches, max_vpp, dp_shard=0):
    eps = [e for e in divisors(dp * cp) if model.num_experts % e == 0] if model.is_moe else [1]
    scheds = [("1f1b", 1)] if pp == 1 else [
        (s, v) for s in schedules
        for v in ((range(2, max_vpp + 1)) if s == "interleaved" else (1,))
        if pp * v <= model.layers]
    for mb in micro_batches:
        if (gb // dp) % mb:
            continue
        for ep in eps:
            for sched, vpp in scheds:
                for sp in ((False, True) if tp > 1 else (False,)):
                    for kind in (CP_KINDS if cp > 1 else ("allgather",)):
                        yield LayoutSpec(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp, micro_batch=mb,
                                         global_batch=gb, schedule=sched, sequence_parallel=sp,
                                         cp_kind=kind, dp_shard=dp_shard)


def _check_request(gpus: int, global_batch: int) -> None:
    for name, v in (("gpus", gpus), ("global_batch", global_batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")


def search(model: ModelSpec | str, gpus: int = 64, hardware: str | Hardware = "H100-80GB",
           global_batch: int = 512, seq_len: int | None = None, precision: str = "bf16",
           optimizer: str = "adam", top: int | None = 50,
           schedules=DEFAULT_SCHEDULES, micro_batches=DEFAULT_MICRO_BATCHES,
           max_tp: int | None = None) -> list[tuple[LayoutSpec, Estimate]]:
    """Layouts of ``gpus`` devices that fit, best (shortest step) first: the ``top`` best,
    or all of them with ``top=None``. Every layout returned is one ``fivefold train``
    accepts (each candidate passes the runtime's `fivefold.rules.layout.validate`).

    ``seq_len`` overrides the model's. Raises `PlanError` when no layout divides the
    model and batch, or none fits in memory (the message says what to change).
    """
    m = load_model(model) if isinstance(model, str) else model
    if seq_len is not None:
        m = m.replace(seq_len=seq_len)
    hw = get_hardware(hardware)
    _check_request(gpus, global_batch)
    out: list[tuple[LayoutSpec, Estimate]] = []
    smallest: tuple[int, LayoutSpec] | None = None
    n_valid = 0
    cache = CostCache(m, precision)
    shapes = list(structures(m, gpus, hw, global_batch, schedules, micro_batches, max_tp, precision=precision))
    bounds = [time_lower_bound(m, lay, hw, precision, cache) for lay in shapes]
    best: list[float] = []  # max-heap (negated) of the `top` shortest step times so far
    for bound, lay in sorted(zip(bounds, shapes), key=lambda x: x[0]):
        if top and len(best) >= top and bound > -best[0]:
            break
        # hybrid sharding is checked with a ZeRO stage (it shards nothing without one)
        config = _accepted(runtime_config(m, lay.with_states(1, "none") if lay.dp_shard else lay, precision))
        if config is None:
            continue
        n_valid += 1
        grid = _state_memory(m, lay, hw, precision, optimizer, _zero_stages(config.layout), cache)
        fits = [k for k, v in grid.items() if v <= hw.usable_memory_bytes]
        if not fits:
            z, g, r = min(grid, key=grid.__getitem__)
            if smallest is None or grid[z, g, r] < smallest[0]:
                smallest = (grid[z, g, r], lay.with_states(z, r, g))
            continue
        for z, g, r in _frontier(fits):
            cand = lay.with_states(z, r, g)
            if r != "none" and top and len(best) >= top and time_lower_bound(m, cand, hw, precision, cache) > -best[0]:
                continue  # its recomputation alone makes it slower than the top ones
            est = estimate_valid(m, cand, hw, precision, optimizer, cache=cache)
            out.append((cand, est))
            if top:
                heapq.heappush(best, -est.step_time_s)
                if len(best) > top:
                    heapq.heappop(best)
    if not out:
        raise _nothing_fits(m, gpus, hw, global_batch, n_valid, smallest)
    out.sort(key=lambda c: (c[1].step_time_s, c[1].memory.total))
    return out[:top] if top else out


def _nothing_fits(m: ModelSpec, gpus: int, hw: Hardware, gb: int, n_valid: int, smallest) -> PlanError:
    if n_valid == 0:
        return PlanError(
            f"no layout of {gpus} devices divides {m.name} (layers={m.layers}, heads={m.heads}, "
            f"kv_heads={m.n_kv_heads}, seq_len={m.seq_len}) with global_batch={gb}: choose a device "
            f"count and global batch with common factors (e.g. powers of two), global_batch "
            f"divisible by the data-parallel degree")
    need, lay = smallest
    return PlanError(
        f"no layout of {gpus} x {hw.name} fits {m.name} with global_batch={gb}, seq_len={m.seq_len}: "
        f"the smallest ({lay.short()}) needs {need / GiB:.1f} GiB per device but "
        f"{hw.usable_memory_bytes / GiB:.1f} GiB are usable; use more devices, hardware with more "
        f"memory, or a shorter sequence")
