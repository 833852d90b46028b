"""Dry run of one rank of a real-size layout on this CPU, held against the planner.

`fivefold dryrun --config llama3-405b --layout "tp=8,pp=16,dp=128" --world-size 16384`
builds one rank (or a few) of the layout in this process:

- torch's fake process group stands in for the world: every collective returns at once,
  receives leave their buffers uninitialised, and no other process exists;
- every tensor lives on the meta device: it has a shape, a dtype and a storage identity but
  no data, so nothing is computed and a 405B-parameter shard costs nothing;
- the real `Mesh.build`, `parallelize` and `train.train_step` run unchanged: the pipeline
  rank walks its own list of the real schedule, the data-parallel/ZeRO optimizer builds its
  buckets and reduces them, comm.py counts the bytes of every collective from shapes and
  dtypes.

Measured, per rank: parameter, gradient and optimizer bytes by storage (`memory.held_memory`,
right after the optimizer step, when all three are alive, and at the end of the backward,
when ZeRO-2/3 still hold the full gradients that gradient finalizers complete; the larger of
the two), the peak of the bytes saved for backward (saved-tensor hooks, each storage counted
once while any autograd node holds it), and the wire bytes per axis of the step up to and including the optimizer update (what the
loop then sends to report the loss and MoE statistics is left out, as the planner leaves it). They are printed beside `planner.estimate` for the same layout.

Values that only data decide are assumed, as the planner assumes them: every expert receives
the same number of token-slots (balanced routing, nothing dropped) and every scalar read
back from a tensor (the loss, the gradient norm) is 0. `DryRunMode` supplies them, and
`FusedAttentionOnMeta` runs the attention kernel the CPU would run (in recomputed forwards too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import Config
from ..data.sources import Sampler
from ..rules.layout import LayoutError, rank_to_coords, validate
from ..observe.held_memory import HeldMemory, held_memory
from ..planner import HARDWARE, Hardware
from ..planner.bridge import layout_spec
from ..planner.bridge import model_spec
from ..planner.errors import PlanError
from ..planner.estimate import check_kept_gather_fits, estimate_valid
from ..planner.stages import StagePlan, stage_plans
from ..rules.volumes import planner_axis_bytes

# Above these a dry run's own bookkeeping (Python objects per group, per module, per
# schedule action) stops being small; see `check_dry_run_size`.
MAX_WORLD = 1 << 20
MAX_LAYER_PASSES = 200_000


class DryRunError(ValueError):
    """Input a dry run cannot take; the message says what to change."""


# ----------------------------------------------------------------------------- assumed values

_VALUE = "_fivefold_assumed_value"


def _value(t: Any) -> float | None:
    return getattr(t, _VALUE, None) if isinstance(t, torch.Tensor) else None


def _set_value(t: torch.Tensor, value: float | None) -> torch.Tensor:
    setattr(t, _VALUE, value)
    return t


aten = torch.ops.aten
_SAME_VALUE = {
    aten.view, aten._unsafe_view, aten.reshape, aten.clone, aten.contiguous, aten._to_copy, aten.detach,
    aten.alias, aten.select, aten.slice, aten.squeeze, aten.unsqueeze, aten.expand, aten.t, aten.transpose,
    aten.permute, aten.flatten, aten.lift_fresh, aten._reshape_alias,
}
_FILLED = {aten.ones_like: 1, aten.ones: 1, aten.zeros_like: 0, aten.zeros: 0}


class DryRunMode(TorchDispatchMode):
    """Supplies the values that data would decide, on meta tensors, as the planner assumes.

    A tensor may carry one assumed value shared by all its elements (`_VALUE`): set by fills,
    by `bincount` (each of E bins receives n / E of the n entries: balanced routing), kept by
    views, copies, joins of equal values and all-to-alls (every rank routes alike), scaled by sums. Shapes that
    depend on data follow from it: `nonzero` keeps every element (no token dropped),
    `repeat_interleave` repeats by the assumed count, `.item()`/`.tolist()` return it (0 when
    no value is known: a loss or a norm).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        packet = func.overloadpacket
        special = self._special(func, args, kwargs)
        if special is not _NOT_SPECIAL:
            return special
        sent = _value(args[1]) if packet is torch.ops.c10d.alltoall_base_ else None
        out = func(*args, **kwargs)
        for written in _written_tensors(func, args, kwargs):  # an in-place op changed the values we knew
            _set_value(written, None)
        if sent is not None:  # (output, input, ...): balanced routing sends alike, so each rank receives it
            _set_value(args[0], sent)
        return self._propagate(packet, args, kwargs, out)

    def _special(self, func, args, kwargs):  # noqa: ANN001
        packet = func.overloadpacket
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or first.device.type != "meta":
            return _NOT_SPECIAL  # a tensor with values (DeviceMesh's rank grid, say) answers for itself
        if packet is aten._local_scalar_dense:
            value = _value(args[0])
            dtype = args[0].dtype
            if dtype is torch.bool:
                return bool(value)
            if dtype.is_floating_point:
                return float(value or 0.0)
            return int(value or 0)
        if packet is aten.bincount:
            return _balanced_bincount(args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0))
        if packet is aten.nonzero:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.int64, device=x.device)
        if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
            return _repeat_interleave(args, kwargs)
        if packet is aten._to_copy and args[0].device.type == "meta" and kwargs.get("device") not in (None, _META):
            return _arrive(args[0], kwargs)
        return _NOT_SPECIAL

    def _propagate(self, packet, args, kwargs, out):  # noqa: ANN001
        if not isinstance(out, torch.Tensor):
            return out
        if packet in _SAME_VALUE:
            return _set_value(out, _value(args[0]))
        if packet in _FILLED:
            return _set_value(out, _FILLED[packet])
        if packet in (aten.stack, aten.cat):  # joined tensors that all hold one value hold it too
            values = {_value(t) for t in args[0]}
            return _set_value(out, values.pop()) if len(values) == 1 else out
        if packet in (aten.full, aten.full_like):
            return _set_value(out, float(args[1]))
        if packet is aten.sum and _value(args[0]) is not None:
            return _set_value(out, _value(args[0]) * (args[0].numel() // max(out.numel(), 1)))
        return out


def _written_tensors(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:  # noqa: ANN001
    """The tensors an op writes into (`x` of `x.add_(y)`, not `y`), from its schema."""
    if not func._schema.is_mutable:
        return []
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


_NOT_SPECIAL = object()
_META = torch.device("meta")
MAX_ARRIVING = 1 << 20  # elements a meta tensor may bring to a real device (counts, sums, norms)


def _arrive(t: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """A meta tensor copied to a real device (a loss sum to the CPU): its assumed value, or 0."""
    if t.numel() > MAX_ARRIVING:
        raise DryRunError(f"a dry run cannot bring a tensor of {t.numel()} elements off the meta device")
    dtype = kwargs.get("dtype") or t.dtype
    return _set_value(torch.full(t.shape, _value(t) or 0, dtype=dtype, device=kwargs["device"]), _value(t))


class FusedAttentionOnMeta(TorchFunctionMode):
    """Attention on meta tensors runs the kernel the CPU would run.

    For meta tensors torch picks the math kernel, which saves the s x s scores for backward;
    the CPU (like the GPU) runs a fused flash kernel that saves a log-sum-exp per query
    instead. When the CPU would pick flash attention for these dtypes and arguments, call
    that kernel (its meta function gives the shapes, its autograd formula what is saved).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta" and _cpu_picks_flash(args, kwargs):
            q, k, v = args[:3]
            out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"),
            )
            return out
        return func(*args, **kwargs)


def fused_attention_in_every_forward(modules: Iterator[torch.nn.Module]) -> None:
    """Run each module's forward under `FusedAttentionOnMeta`, also when autograd calls it again.

    Activation recomputation runs a checkpointed forward a second time inside the backward,
    where torch-function modes entered around the step are not active: attention there would
    take the math kernel, and the checkpoint would refuse its recomputed tensors (other shapes
    than those the fused kernel saved). Wrapping every forward puts the mode around the
    recomputed attention too, whichever module (the core, a context-parallel core) calls it.
    """
    for module in modules:
        module.forward = _under_fused_attention(module.forward)


def _under_fused_attention(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(mode, FusedAttentionOnMeta) for mode in torch.overrides._get_current_function_mode_stack()):
            return forward(*args, **kwargs)
        with FusedAttentionOnMeta():
            return forward(*args, **kwargs)

    return run


def _cpu_picks_flash(args: tuple, kwargs: dict) -> bool:
    from torch.nn.attention import SDPBackend

    def tiny(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((1,) * t.dim(), dtype=t.dtype)

    q, k, v = (tiny(t) for t in args[:3])
    mask = kwargs.get("attn_mask")
    choice = torch._fused_sdp_choice(q, k, v, None if mask is None else tiny(mask),
                                     is_causal=kwargs.get("is_causal", False))
    return choice == SDPBackend.FLASH_ATTENTION.value


def _balanced_bincount(x: torch.Tensor, minlength: int) -> torch.Tensor:
    if not minlength:
        raise DryRunError("a dry run needs bincount(..., minlength=E) to know the number of bins")
    if x.numel() % minlength:
        raise DryRunError(
            f"balanced routing gives each of {minlength} experts {x.numel()}/{minlength} token-slots, not a whole "
            "number; choose a micro-batch and sequence length whose tokens x top_k divide by the experts per rank"
        )
    return _set_value(torch.empty(minlength, dtype=torch.int64, device=x.device), x.numel() // minlength)


def _repeat_interleave(args: tuple, kwargs: dict) -> torch.Tensor:
    if len(args) == 1 or not isinstance(args[1], torch.Tensor):  # repeat_interleave(repeats): indices
        repeats, source = args[0], None
    else:
        source, repeats = args[0], args[1]
    count = _value(repeats)
    if count is None:
        raise DryRunError("a dry run met repeat_interleave with counts it cannot assume (only balanced routing is)")
    total = int(count) * repeats.numel()
    dtype = repeats.dtype if source is None else source.dtype
    return torch.empty(total, dtype=dtype, device=repeats.device)


# ----------------------------------------------------------------------------- saved activations


class _Saved:
    """What autograd holds instead of a saved tensor; freed with the graph that saved it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (data_ptr is 0 for every meta tensor)."""
    return t.untyped_storage()._cdata


class SavedActivations:
    """Bytes autograd holds for backward, live and at their peak, counted by storage.

    A storage saved by several operators counts once while any of them holds it; parameters
    are not activations. Use `hooks()` around the forward and backward passes.
    """

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.excluded = {storage_key(p) for p in parameters}
        self.holders: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if key in self.excluded or not nbytes:
            return t
        if not self.holders.get(key):
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key, nbytes)
        return saved

    def _release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= nbytes

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


# ----------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class RankResult:
    """What one dry-run rank held, saved and sent during one training step."""

    rank: int
    stage: int  # pipeline rank
    held: dict[str, int]  # params, grads, optimizer (padding to shard boundaries excluded)
    saved_peak: int  # activation bytes saved for backward, at their peak over the step
    comm: dict[str, int]  # planner axis -> wire bytes sent in the step
    build_seconds: float
    step_seconds: float

    @property
    def peak(self) -> int:
        return sum(self.held.values()) + self.saved_peak


class _FakeSampler:
    """The global batch's rows of one data-parallel rank as fake token ids (no data needed)."""

    def __init__(self, config: Config) -> None:
        self.train = config.train

    def local_rows_at(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(inputs, targets, documents) as the training loop asks a sampler: one unbroken text."""
        shape = (self.train.global_batch // dp_size, self.train.seq_len)
        return torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.int64), None


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """torch.distributed as rank `rank` of `world_size` with torch's fake process group."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise DryRunError("a dry run needs a process without torch.distributed initialised")
    # meta tensors too: point-to-point calls pick the backend by the tensors' device
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _measure_after_step(model, held: list[HeldMemory], wire: list[dict]) -> None:  # noqa: ANN001
    """Read held memory at the end of the backward and right after the optimizer step, and
    the bytes sent so far after the step.

    Parameters, reduced gradients and the optimizer state are all alive after the step
    (zero_grad may drop gradients afterwards), and the step's traffic is complete: what
    follows only reports (the loss over the world, MoE load statistics), which the planner
    leaves out. The end of the backward is read too: ZeRO-2/3 hold the full gradients that
    gradient finalizers complete until their reduction at the end of the step (see `held_at_peak`).
    """
    finish, step = model.optimizer.finish_grad_sync, model.optimizer.step

    def measure_then_finish() -> None:
        held.append(held_memory(model.chunks, model.optimizer))
        finish()

    def step_then_measure(lr: float) -> None:
        step(lr)
        held.append(held_memory(model.chunks, model.optimizer))
        wire.append(dict(model.mesh.stats.wire))

    model.optimizer.finish_grad_sync = measure_then_finish
    model.optimizer.step = step_then_measure


def held_at_peak(held: list[HeldMemory]) -> dict[str, int]:
    """Each kind of model state at the largest of the measurements, padding left out."""
    measured = [h.without_padding() for h in held]
    return {kind: max(m[kind] for m in measured) for kind in measured[0]}


def run_rank(config: Config, rank: int) -> RankResult:
    """Build `rank` of `config`'s (validated) layout on the meta device and run one training step."""
    from ..parallel.mesh import Mesh
    from ..train import build, train_step

    with fake_world(config.layout.world_size, rank):
        start = time.perf_counter()
        mesh = Mesh.build(config.layout, device_type="meta")  # outside the modes: DeviceMesh keeps its rank grid in a real tensor
        with DryRunMode(), FusedAttentionOnMeta():
            model = build(config, mesh, torch.device("meta"))
            fused_attention_in_every_forward(m for chunk in model.chunks for m in chunk.modules())
            built = time.perf_counter()
            held: list[HeldMemory] = []
            wire: list[dict] = []
            _measure_after_step(model, held, wire)
            saved = SavedActivations([p for chunk in model.chunks for p in chunk.parameters()])
            mesh.stats.reset()
            with saved.hooks():
                train_step(model, cast(Sampler, _FakeSampler(config)), 0)  # it only asks for batches
        comm = bytes_per_planner_axis(wire[0])
        return RankResult(
            mesh.rank, mesh.pp.rank, held_at_peak(held), saved.peak, comm, built - start,
            time.perf_counter() - built,
        )


def bytes_per_planner_axis(wire: dict[tuple[str, str], int]) -> dict[str, int]:
    """comm.py's wire bytes per (axis, op), summed per planner axis; the world axis left out."""
    per_axis: dict[str, int] = {}
    for (axis, _op), nbytes in wire.items():
        per_axis[axis] = per_axis.get(axis, 0) + nbytes
    return planner_axis_bytes(per_axis)


# ----------------------------------------------------------------------------- the planner's side


def planner_precision(config: Config) -> str:
    """The precision whose bytes the dry-run step keeps: fp32 weights, gradients and Adam
    moments (what bf16 runs keep too: they autocast over fp32 master weights), fp32
    activations (see `without_autocast`)."""
    return "fp32"


def without_autocast(config: Config) -> tuple[Config, str]:
    """The config the dry run steps, and a note when it differs from the one asked for.

    bf16 runs autocast over fp32 weights; autocast does not run on the meta device, so the
    dry run keeps fp32 activations. Weights, gradients and optimizer state are the bytes a
    bf16 run keeps; activations and tensor/pipeline traffic are those of an fp32 run.
    """
    if config.train.dtype != "bf16":
        return config, ""
    note = ("train.dtype=bf16 autocasts over fp32 weights; autocast does not run on the meta device, so the dry "
            "run's activations and tp/pp/cp/ep traffic are fp32 (weights, gradients, optimizer state are as in bf16)")
    return config.replace(train=dataclasses.replace(config.train, dtype="fp32")), note


RECOMPUTE_NOTE = ("layout.recompute=full: the dry run counts what the forward saves (each layer's input), not "
                  "the one layer a recomputation holds during the backward, which the planner adds")


def plan(config: Config, hardware: Hardware) -> list[StagePlan]:
    """The planner's memory and traffic for one device of every pipeline stage of the layout."""
    spec = model_spec(config.model, config.train.seq_len)
    return stage_plans(spec, layout_spec(config.layout, config.train.global_batch), hardware=hardware, precision=planner_precision(config))


# ----------------------------------------------------------------------------- inputs


def resolve_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        names = ", ".join(n for n in HARDWARE if n != "cpu")
        raise DryRunError(f"--hardware {name!r} is unknown; use one of {names}") from None


def prepare(config: Config, world_size: int | None, ranks: list[int] | None) -> tuple[Config, list[int]]:
    """Validate the layout for `world_size` and the ranks to build (default: rank 0)."""
    if world_size is not None and world_size < 1:
        raise DryRunError(f"--world-size {world_size} must be at least 1")
    try:
        config = validate(config, world_size)
    except LayoutError as err:
        raise DryRunError(str(err)) from None
    world = config.layout.world_size
    ranks = list(ranks) if ranks else [0]
    outside = [r for r in ranks if not 0 <= r < world]
    if outside:
        raise DryRunError(f"rank {outside[0]} is outside the world of {world} ranks; use --rank between 0 and {world - 1}")
    check_dry_run_size(config)
    return config, ranks


def refuse_what_cannot_fit(config: Config, hardware: Hardware) -> None:
    """The planner's refusals of layouts that cannot fit (`check_kept_gather_fits`), before any rank is built."""
    spec = model_spec(config.model, config.train.seq_len)
    layout = layout_spec(config.layout, config.train.global_batch)
    try:
        check_kept_gather_fits(estimate_valid(spec, layout, hardware, planner_precision(config), "adam"))
    except PlanError as err:
        raise DryRunError(str(err)) from None


def check_dry_run_size(config: Config) -> None:
    """Refuse layouts whose bookkeeping alone would not fit a dry run on one CPU.

    Fake tensors hold no data, but the world's groups (a list of ranks per group, built for
    every axis), the modules of the rank's stage and the schedule's layer passes are real
    Python objects and real time.
    """
    layout, model = config.layout, config.model
    if layout.world_size > MAX_WORLD:
        raise DryRunError(
            f"a world of {layout.world_size} ranks is more than a dry run lists groups for ({MAX_WORLD}); "
            "dry-run a layout with the same per-rank shape and a smaller dp"
        )
    layers_here = math.ceil(model.layers / layout.pp)
    passes = layers_here * layout.grad_accum
    if passes > MAX_LAYER_PASSES:
        raise DryRunError(
            f"one rank would run {passes} layer forwards ({layers_here} layers x {layout.grad_accum} micro-batches); "
            f"a dry run takes at most {MAX_LAYER_PASSES}: raise layout.micro_batch or pp"
        )


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Row:
    label: str
    measured: int
    planned: int | None
    tolerance: float | None  # allowed relative difference; None: reported only

    @property
    def difference(self) -> float | None:
        if self.planned is None:
            return None
        if self.planned == 0:
            return 0.0 if self.measured == 0 else math.inf
        return (self.measured - self.planned) / self.planned

    @property
    def ok(self) -> bool:
        return self.tolerance is None or self.difference is None or abs(self.difference) <= self.tolerance


def compare(result: RankResult, stage: StagePlan) -> list[Row]:
    """Side-by-side rows of one rank against the planner's numbers for its pipeline stage."""
    rows = [
        Row("parameters", result.held["params"], stage.memory.params, 0.01),
        Row("gradients", result.held["grads"], stage.memory.grads, 0.01),
        Row("optimizer state", result.held["optimizer"], stage.memory.optimizer, 0.01),
        Row("activations saved", result.saved_peak, stage.memory.activations, 0.05),
    ]
    axes = sorted(set(result.comm) | {a for a, v in stage.comm_bytes.items() if v})
    rows += [Row(f"comm {axis}", result.comm.get(axis, 0), int(stage.comm_bytes.get(axis, 0)), 0.0) for axis in axes]
    rows.append(Row("peak held + saved", result.peak, stage.memory.total - stage.memory.buffers, None))
    return rows


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _format_difference(row: Row) -> str:
    if row.difference is None:
        return ""
    if row.tolerance == 0.0 and row.planned is not None and 0 < abs(row.measured - row.planned) < 1 << 20:
        return f"{row.measured - row.planned:+d} B"  # an exact row off by bookkeeping bytes
    return f"{row.difference * 100:+.2f}%"


def render(rows: list[Row], result: RankResult, config: Config, hardware: Hardware) -> str:
    layout = config.layout
    coords = rank_to_coords(result.rank, layout)
    lines = [
        f"rank {result.rank} of {layout.world_size} (pp={coords.pp} dp={coords.dp} cp={coords.cp} tp={coords.tp}); "
        f"built in {result.build_seconds:.1f} s, one step in {result.step_seconds:.1f} s",
        f"{'':<20}{'dry run':>14}{'planner':>14}{'diff':>10}",
    ]
    for row in rows:
        planned = format_bytes(row.planned) if row.planned is not None else "-"
        diff = _format_difference(row)
        flag = "" if row.ok else ("  <- not exact" if row.tolerance == 0 else f"  <- outside {row.tolerance:.0%}")
        lines.append(f"{row.label:<20}{format_bytes(row.measured):>14}{planned:>14}{diff:>10}{flag}")
    capacity = hardware.memory_bytes
    verdict = "fits" if result.peak <= hardware.usable_memory_bytes else "does NOT fit"
    lines.append(
        f"peak {format_bytes(result.peak)} of {format_bytes(capacity)} on {hardware.name} "
        f"({result.peak / capacity:.0%}; {verdict} in the {format_bytes(hardware.usable_memory_bytes)} usable)"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class DryRun:
    config: Config
    hardware: Hardware
    plan: list[StagePlan]
    results: list[RankResult]
    note: str = ""

    def rows(self, result: RankResult) -> list[Row]:
        return compare(result, self.plan[result.stage])

    def render(self) -> str:
        tables = [render(self.rows(r), r, self.config, self.hardware) for r in self.results]
        return "\n\n".join(tables + ([f"note: {self.note}"] if self.note else []))


def dry_run(config: Config, world_size: int | None = None, ranks: list[int] | None = None,
            hardware: str = "H100-80GB") -> DryRun:
    """Validate, build each rank on the meta device, run one step, and estimate the same layout."""
    hw = resolve_hardware(hardware)
    config, note = without_autocast(config)
    config, ranks = prepare(config, world_size, ranks)
    refuse_what_cannot_fit(config, hw)
    results = [run_rank(config, rank) for rank in ranks]
    notes = [note] + [RECOMPUTE_NOTE if config.layout.recompute == "full" else ""]
    return DryRun(config, hw, plan(config, hw), results, "; ".join(n for n in notes if n))


def run_dryrun_cli(config: Config, world_size: int | None, ranks: list[int] | None, hardware: str) -> int:
    report = dry_run(config, world_size, ranks, hardware)
    print(report.render())
    return 0
