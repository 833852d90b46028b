"""Explain a search winner by re-estimating its neighbours with the cost model.

Each line compares the winner with the layout one step away along one axis (a factor of
two moved between that axis and data parallelism, one ZeRO stage, one recomputation
level) and reports whether the neighbour fits and how much slower it is. The rules of
thumb (data parallel while the model fits; tensor parallel inside a node for wide layers;
pipeline across nodes for deep models; context parallel for long sequences; expert
parallel for MoE; ZeRO when optimizer state dominates) appear as the outcome of those
comparisons, not as fixed text.
"""

from __future__ import annotations

from .errors import PlanError
from .estimate import Estimate, estimate, memory_grid
from .hardware import GiB
from .model_states import state_bytes
from .spec import LayoutSpec, ModelSpec

_RECOMPUTE = ("none", "selective", "full")


def _try(m: ModelSpec, lay: LayoutSpec, ref: Estimate) -> Estimate | None:
    try:
        return estimate(m, lay, ref.hardware, ref.precision, ref.optimizer)
    except PlanError:
        if lay.pp > 1 and lay.schedule == "interleaved":  # chunks may no longer divide
            return _try(m, lay.replace(schedule="1f1b", vpp=1), ref)
        return None


def _best_fitting(m: ModelSpec, lay: LayoutSpec, ref: Estimate) -> Estimate | None:
    """The neighbour as given if it fits, else its cheapest (ZeRO, recompute) that fits."""
    e = _try(m, lay, ref)
    if e is None or e.fits:
        return e
    lay = e.layout
    try:
        grid = memory_grid(m, lay, ref.hardware, ref.precision, ref.optimizer)
    except PlanError:
        return e
    fits = [k for k, v in grid.items() if v <= ref.hardware.usable_memory_bytes]
    options = [x for x in (_try(m, lay.replace(zero=z, recompute=r), ref) for z, r in fits) if x]
    return min(options, key=lambda x: x.step_time_s) if options else e


def _compare(win: Estimate, other: Estimate | None, change: str, same_states: bool = True) -> str:
    if other is None:
        return f"{change} is not a valid layout here"
    if not other.fits:
        return (f"{change} does not fit ({other.memory.total / GiB:.1f} GiB needed, "
                f"{other.hardware.usable_memory_bytes / GiB:.1f} GiB usable)")
    delta = other.step_time_s / win.step_time_s - 1
    extra = ""
    if same_states and (other.layout.zero, other.layout.recompute) != (win.layout.zero, win.layout.recompute):
        extra = f" (it needs zero={other.layout.zero}, recompute={other.layout.recompute} to fit)"
    if delta >= 0:
        return f"{change} would be {delta:.1%} slower{extra}"
    return f"{change} would be {-delta:.1%} faster but ranks lower{extra}"


def _move(lay: LayoutSpec, axis: str, up: bool) -> LayoutSpec | None:
    """Move a factor of two between ``axis`` and dp (ep moves inside dp x cp)."""
    if axis == "ep":
        ep = lay.ep * 2 if up else lay.ep // 2
        return lay.replace(ep=ep) if ep >= 1 and (up or lay.ep % 2 == 0) else None
    cur = getattr(lay, axis)
    if up:
        if lay.dp % 2:
            return None
        return lay.replace(**{axis: cur * 2, "dp": lay.dp // 2})
    if cur % 2:
        return None
    return lay.replace(**{axis: cur // 2, "dp": lay.dp * 2})


def _spans(lay: LayoutSpec, axis: str, gpn: int) -> str:
    stride = {"tp": 1, "cp": lay.tp, "dp": lay.tp * lay.cp, "pp": lay.tp * lay.cp * lay.dp,
              "ep": lay.tp}[axis]
    size = getattr(lay, axis)
    return "inside a node" if stride * size <= gpn else "across nodes"


def _axis_line(m: ModelSpec, win: Estimate, axis: str, title: str, why: str) -> str:
    lay, gpn = win.layout, win.hardware.gpus_per_node
    deg = getattr(lay, axis)
    parts = []
    for up in (False, True):
        nb = _move(lay, axis, up)
        if nb is None:
            continue
        name = f"{axis}={getattr(nb, axis)}" + ("" if axis == "ep" else f", dp={nb.dp}")
        parts.append(_compare(win, _best_fitting(m, nb, win), name))
    used = f"{title} ({axis}={deg}, {_spans(lay, axis, gpn)})" if deg > 1 else f"no {title} ({axis}=1)"
    detail = "; ".join(parts) if parts else "no neighbouring degree divides the model and batch"
    return f"- {used}: {why}{detail}."


def explain(model: ModelSpec, candidates: list[tuple[LayoutSpec, Estimate]]) -> str:
    """Why the first candidate wins, in words, from comparisons with its neighbours."""
    if not candidates:
        raise PlanError("explain() needs at least one candidate; run search() first")
    lay, win = candidates[0]
    m, hw = model, win.hardware
    lines = [f"Best layout for {m.name} on {lay.world} x {hw.name}: {lay.short()}. "
             f"Predicted {win.step_time_s:.3g} s/step, {win.tokens_per_s:,.0f} tokens/s, "
             f"{win.tflops_per_device:.0f} TFLOP/s per device, MFU {win.mfu:.1%}; "
             f"{win.memory.total / GiB:.1f} of {hw.usable_memory_bytes / GiB:.1f} GiB per device."]
    dense_bytes = win.memory.model_states
    lines.append(_axis_line(m, win, "tp", "tensor parallel",
                            f"layers of width h={m.hidden} split over NVLink-connected devices "
                            f"({hw.gpus_per_node} per node); " if lay.tp > 1 else
                            "per-layer all-reduces would cost more than the split saves; "))
    lines.append(_axis_line(m, win, "pp", "pipeline parallel",
                            f"{m.layers} layers in {lay.pp} stages, bubble {win.bubble_fraction:.1%} "
                            f"of compute; " if lay.pp > 1 else ""))
    lines.append(_axis_line(m, win, "cp", "context parallel",
                            f"sequence of {m.seq_len} tokens split, activations per device "
                            f"{win.memory.activations / GiB:.1f} GiB; " if lay.cp > 1 else
                            f"sequence of {m.seq_len} tokens kept whole; "))
    if m.is_moe:
        lines.append(_axis_line(m, win, "ep", "expert parallel",
                                f"{m.num_experts} experts per MoE layer, all-to-all dispatch "
                                f"{win.comm_exposed_s['ep']:.3g} s/step exposed; "))
    lines.append(_dp_line(m, win))
    lines.append(_zero_line(m, win, dense_bytes))
    if lay.recompute != "none":
        less = _RECOMPUTE[_RECOMPUTE.index(lay.recompute) - 1]
        lines.append(f"- recomputation ({lay.recompute}): "
                     + _compare(win, _try(m, lay.replace(recompute=less), win), f"recompute={less}", False) + ".")
    return "\n".join(lines)


def _dp_line(m: ModelSpec, win: Estimate) -> str:
    lay = win.layout
    alts = []
    for axis in ("tp", "pp", "cp"):
        nb = _move(lay, axis, True)
        if nb is not None:
            alts.append(_compare(win, _best_fitting(m, nb, win), f"{axis}={getattr(nb, axis)}, dp={nb.dp}"))
    head = (f"- data parallel (dp={lay.dp}): the model fits with {lay.dp} replicas, whose only cost is "
            f"the gradient reduction ({win.comm_exposed_s['dp']:.3g} s/step exposed); "
            if lay.dp > 1 else "- no data parallel (dp=1): every device is needed to hold the model; ")
    return head + ("; ".join(alts) if alts else "no model-parallel degree can grow") + "."


def _zero_line(m: ModelSpec, win: Estimate, model_states: int) -> str:
    lay = win.layout
    sb = state_bytes(win.precision, win.optimizer)
    share = sb.optimizer / (sb.param + sb.grad + sb.optimizer)
    head = (f"- ZeRO stage {lay.zero}: optimizer state is {share:.0%} of unsharded model-state memory "
            f"({model_states / GiB:.1f} GiB of model states per device now); ")
    other = []
    for z in (lay.zero - 1, lay.zero + 1):
        if 0 <= z <= 3 and lay.dp * lay.cp > 1:
            other.append(_compare(win, _try(m, lay.replace(zero=z), win), f"zero={z}", False))
    return head + ("; ".join(other) if other else "there is nothing to shard it over (dp x cp = 1)") + "."
