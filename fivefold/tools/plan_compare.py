"""`fivefold plan --compare zero|schedule|axes|hsdp|zero3-pp`: the background articles' comparisons for your model.

- zero: model-state bytes per device for each ZeRO stage, the ZeRO paper's Figure 1
  (Rajbhandari et al. 2020) for any model: 2 + 2 + K bytes per parameter (K = 12 for
  mixed-precision Adam), sharded over the N data-parallel devices by stage.
- schedule: bubble and activation memory of each pipeline schedule on the same layout, and the
  ideal Gantt chart of every schedule (the runtime's own schedule tables run by its simulator)
  as one PNG.
- hsdp: ZeRO-3 over all the devices against hybrid sharding (shard groups of 2, 4, ... devices,
  replicated over the rest): model states per device against data-parallel bytes and time.
- zero3-pp: ZeRO-3 over all the devices against ZeRO-3 inside each stage of a pipeline (pp = 2,
  4, 8): fewer devices share each stage's states, but each holds only its stage's layers, and
  its full gradients through the step; model states, data-parallel bytes, bubble and time.
- axes: the five strategies side by side on the same cluster: what each splits, its
  collective, memory per device, bytes per step on its axis, step time, when to use it.

`rules_of_thumb` names, for a chosen layout, which of the articles' rules it follows and, where
it departs from one, what the cost model predicted for the layout the rule asks for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.table import Table

from ..planner.errors import PlanError
from ..planner.estimate import Estimate, estimate
from ..planner.hardware import GiB, Hardware, get_hardware
from ..planner.model_states import state_bytes, zero_model_states
from ..planner.spec import LayoutSpec, ModelSpec, divisors
from .plan_render import wrappable

GB = 1e9  # the ZeRO paper states memory in decimal gigabytes
LONG_SEQUENCE = 8192  # "序列长度超8k时：引入序列并行" (background article 2, section 6)

ZERO_STAGES = (  # stage, the paper's name, its per-device formula
    (0, "baseline", "(2 + 2 + K) Ψ"),
    (1, "Pos", "2Ψ + 2Ψ + KΨ / N"),
    (2, "Pos+g", "2Ψ + (2 + K) Ψ / N"),
    (3, "Pos+g+p", "(2 + 2 + K) Ψ / N"),
)


# -------------------------------------------------------------------------------------- zero


def zero_rows(model: ModelSpec, gpus: int, precision: str = "bf16", optimizer: str = "adam") -> list[dict[str, Any]]:
    """Per-device model-state bytes of each ZeRO stage for `model` on `gpus` data-parallel devices."""
    psi = model.num_params()
    sb = state_bytes(precision, optimizer)
    rows = []
    for stage, name, formula in ZERO_STAGES:
        states = zero_model_states(psi, gpus, stage, sb)
        rows.append({"stage": stage, "name": name, "formula": formula, "params": states.params,
                     "grads": states.grads, "optimizer": states.optimizer, "total": sum(states)})
    return rows


def zero_table(model: ModelSpec, gpus: int, precision: str = "bf16", optimizer: str = "adam") -> Table:
    sb = state_bytes(precision, optimizer)
    psi = model.num_params()
    table = Table(title=f"ZeRO model states per device: {model.name}, Ψ = {psi:,} parameters, N = {gpus} "
                        f"data-parallel devices, {sb.param} + {sb.grad} + K bytes per parameter, K = {sb.optimizer}")
    for col in ("stage", "formula", "bytes per device", "GB", "params GB", "grads GB", "optimizer GB"):
        table.add_column(col, justify="left" if col in ("stage", "formula") else "right", no_wrap=True)
    for row in zero_rows(model, gpus, precision, optimizer):
        table.add_row(f"{row['stage']} {row['name']}", row["formula"], f"{row['total']:,}",
                      f"{row['total'] / GB:.1f}", f"{row['params'] / GB:.1f}", f"{row['grads'] / GB:.1f}",
                      f"{row['optimizer'] / GB:.1f}")
    return table


# ---------------------------------------------------------------------------------- schedule

SCHEDULE_VARIANTS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
GANTT_MAX_MICROBATCHES_PER_STAGE = 3  # the drawn chart keeps m <= 3 pp so the bars stay readable


def default_pipeline_layout(model: ModelSpec, gpus: int, hw: Hardware, global_batch: int | None) -> LayoutSpec:
    """pp = 4 (or fewer devices), tp with sequence parallel inside a node over the rest where it
    divides, dp the remainder with ZeRO-1 and selective recomputation (the usual 3D setup).
    Without a global batch, 2 pp micro-batches per step: enough to show each schedule's bubble.
    """
    pp = max(d for d in divisors(gpus) if d <= 4 and model.layers % d == 0)
    rest = gpus // pp
    tp = max(d for d in divisors(rest) if d <= hw.gpus_per_node and model.heads % d == 0)
    dp = rest // tp
    return LayoutSpec(dp=dp, tp=tp, pp=pp, zero=1 if dp > 1 else 0, sequence_parallel=tp > 1,
                      recompute="selective", micro_batch=1, global_batch=global_batch or 2 * pp * dp)


def schedule_rows(model: ModelSpec, base: LayoutSpec, hw: Hardware, precision: str) -> list[dict[str, Any]]:
    """Bubble, activation and total memory, step time of each schedule on `base`'s degrees."""
    from ..observe.timeline import bubble_fraction, ideal_rows

    rows = []
    for schedule, vpp in SCHEDULE_VARIANTS:
        row: dict[str, Any] = {"schedule": schedule, "vpp": vpp}
        try:
            lay = base.replace(schedule=schedule, vpp=vpp)
            e = estimate(model, lay, hw, precision)
            ideal = ideal_rows(schedule, lay.pp, lay.num_micro_batches, vpp)
        except (PlanError, ValueError) as err:
            row["error"] = str(err)
            rows.append(row)
            continue
        row.update(bubble=e.bubble_fraction, idle=bubble_fraction(ideal), activations=e.memory.activations,
                   total=e.memory.total, fits=e.fits, step=e.step_time_s)
        rows.append(row)
    return rows


def schedule_table(model: ModelSpec, base: LayoutSpec, hw: Hardware, precision: str) -> Table:
    m = base.num_micro_batches
    table = Table(title=f"Pipeline schedules: {model.name}, {base.short()}, m = {m} micro-batches per step, {hw.name}")
    for col in ("schedule", "bubble / compute", "idle share (simulated)", "activations GiB", "total GiB", "fits",
                "step s"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for row in schedule_rows(model, base, hw, precision):
        name = row["schedule"] + (f" (vpp={row['vpp']})" if row["vpp"] > 1 else "")
        if "error" in row:
            table.add_row(name, f"not possible here: {row['error']}", "", "", "", "", "")
            continue
        table.add_row(name, f"{row['bubble']:.1%}", f"{row['idle']:.1%}", f"{row['activations'] / GiB:.1f}",
                      f"{row['total'] / GiB:.1f}", "yes" if row["fits"] else "no", f"{row['step']:.3g}")
    return table


def draw_schedules(pp: int, num_microbatches: int, path: str | Path) -> tuple[Path, int]:
    """Ideal Gantt charts of every schedule, one panel each; returns (path, micro-batches drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..observe.timeline import bubble_fraction, draw_rows, ideal_rows

    m = min(num_microbatches, GANTT_MAX_MICROBATCHES_PER_STAGE * pp)
    panels = []
    for schedule, vpp in SCHEDULE_VARIANTS:
        try:
            panels.append((schedule, vpp, ideal_rows(schedule, pp, m, vpp)))
        except ValueError:
            continue  # e.g. interleaved with m not a multiple of pp: the table says why
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, (0.5 * pp + 1.1) * len(panels)), squeeze=False)
    for ax, (schedule, vpp, rows) in zip(axes[:, 0], panels):
        draw_rows(ax, rows, scale=1.0, xlabel="time (forward = 1, backward = 2)")
        ax.set_title(f"{schedule}" + (f", vpp={vpp}" if vpp > 1 else "") +
                     f": pp={pp}, m={m}, idle {bubble_fraction(rows):.1%}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path, m


# -------------------------------------------------------------------------------------- axes

# What each strategy splits, its collective and when the articles use it (background article 2,
# "五种并行策略的对比"), one row per strategy.
STRATEGIES = (
    ("data parallel", "dp", "the batch (model replicated)", "gradient all-reduce",
     "the model fits one device: first choice, simplest and cheapest"),
    ("ZeRO-3 (sharded DP)", "zero", "batch; optimizer state, gradients, parameters", "reduce-scatter + all-gather",
     "model states do not fit, but layers do: shard instead of split"),
    ("tensor parallel", "tp", "weight matrices inside each layer", "activation all-reduce per layer",
     "single layers too large; keep it inside a node (NVLink)"),
    ("pipeline parallel", "pp", "consecutive layers into stages", "point-to-point activations",
     "many layers; across nodes, with enough micro-batches for a small bubble"),
    ("expert parallel", "ep", "the experts of each MoE layer", "token all-to-all",
     "MoE models: always, combined with DP/TP"),
    ("context parallel", "cp", "the sequence inside attention", "K/V all-gather or ring",
     f"sequences above {LONG_SEQUENCE // 1024}k tokens, where activations dominate"),
)


def _axis_layout(model: ModelSpec, key: str, gpus: int, degree: int, global_batch: int) -> LayoutSpec:
    """The layout that uses `key` at `degree` and data parallelism for the rest."""
    if key == "dp":
        return LayoutSpec(dp=gpus, global_batch=global_batch)
    if key == "zero":
        return LayoutSpec(dp=gpus, zero=3, global_batch=global_batch)
    if key == "ep":
        return LayoutSpec(dp=gpus, ep=degree, global_batch=global_batch)
    fields: dict[str, Any] = {key: degree, "dp": gpus // degree, "global_batch": global_batch}
    if key == "cp":
        fields["cp_kind"] = "ring"
    return LayoutSpec(**fields)


def _degree(model: ModelSpec, key: str, gpus: int, hw: Hardware) -> int:
    """The largest degree of `key` up to a node's devices that divides the model and the cluster."""
    limit = {"tp": model.heads, "pp": model.layers, "ep": model.num_experts or 1,
             "cp": model.seq_len}.get(key, gpus)
    fits = [d for d in divisors(gpus) if d <= hw.gpus_per_node and d <= limit]
    if key == "pp":
        fits = [d for d in fits if model.layers % d == 0]
    if key == "ep":
        fits = [d for d in fits if model.num_experts % d == 0]
    return max(fits, default=1)


def axes_rows(model: ModelSpec, gpus: int, hw: Hardware, precision: str, global_batch: int) -> list[dict[str, Any]]:
    rows = []
    for name, key, splits, collective, when in STRATEGIES:
        row: dict[str, Any] = {"strategy": name, "splits": splits, "collective": collective, "when": when,
                               "axis": "dp" if key in ("dp", "zero") else key}
        degree = _degree(model, key, gpus, hw)
        if key == "ep" and not model.is_moe:
            row["error"] = "dense model: no experts to split"
        elif key not in ("dp", "zero") and degree == 1:
            row["error"] = f"no degree above 1 divides the model and {gpus} devices"
        else:
            try:
                lay = _axis_layout(model, key, gpus, degree, global_batch)
                row.update(layout=lay.short(), estimate=estimate(model, lay, hw, precision))
            except PlanError as err:
                row["error"] = str(err)
        rows.append(row)
    return rows


def axes_table(model: ModelSpec, gpus: int, hw: Hardware, precision: str, global_batch: int) -> Table:
    table = Table(title=f"The five strategies on {gpus} x {hw.name}: {model.name}, sequence {model.seq_len}, "
                        f"global batch {global_batch} (the rest of the devices data parallel)")
    table.add_column("strategy", overflow="fold")
    table.add_column("layout", overflow="fold", ratio=1)
    for col in ("GiB/device", "fits", "GB/step on its axis", "step s"):
        table.add_column(col, justify="right")
    for row in axes_rows(model, gpus, hw, precision, global_batch):
        if "error" in row:
            table.add_row(row["strategy"], row["error"], "", "", "", "")
            continue
        e: Estimate = row["estimate"]
        table.add_row(row["strategy"], wrappable(row["layout"]), f"{e.memory.total / GiB:.1f}",
                      "yes" if e.fits else "no", f"{e.comm_bytes.get(row['axis'], 0) / GB:.2f}", f"{e.step_time_s:.3g}")
    return table


def axes_legend() -> list[str]:
    """What each strategy splits, its collective and when to use it: the lines under the axes table
    (as text, so that the table stays narrow enough for a terminal)."""
    return [f"- {name}: splits {splits}; {collective}; use when {when}"
            for name, _key, splits, collective, when in STRATEGIES]


# -------------------------------------------------------------------------------------- hsdp


def _estimated(model: ModelSpec, lay: LayoutSpec, hw: Hardware, precision: str, **fields: Any) -> dict[str, Any]:
    """A comparison row: `fields`, the layout and its estimate (or why the planner refused it)."""
    row: dict[str, Any] = {"layout": lay.short(), **fields}
    try:
        row["estimate"] = estimate(model, lay, hw, precision)
    except PlanError as err:
        row["error"] = str(err)
    return row


def _zero3_layout(gpus: int, global_batch: int, **fields: Any) -> LayoutSpec:
    """ZeRO-3 with one micro-batch per device and full recomputation (so activations leave room
    for the states): the setting of both ZeRO-3 comparisons."""
    fields.setdefault("dp", gpus)
    return LayoutSpec(zero=3, micro_batch=1, global_batch=global_batch, recompute="full", **fields)


def _states(e: Estimate) -> float:
    return e.memory.params + e.memory.grads + e.memory.optimizer


def _zero3_table(title: str, head_columns: tuple[str, ...], tail_columns: tuple[str, ...], rows: list[dict[str, Any]],
                 tail) -> Table:
    """The common shape of the ZeRO-3 comparisons: the row's own columns, then memory and dp
    traffic, then `tail(estimate)` cells under `tail_columns`, then the step time."""
    # Short headers (units in the caption) keep the numbers on one line each in a narrow terminal.
    table = Table(title=title, caption="per device: model states and total in GiB; per step: dp and pp traffic "
                  "in GB, dp time and step time in s")
    columns = (*head_columns, "states", "total", "fits", "dp GB", "dp s", *tail_columns, "step s")
    for col in columns:
        if col == "layout":
            table.add_column(col, overflow="fold", ratio=1, min_width=16)
        else:
            table.add_column(col, justify="right", no_wrap=True)
    for row in rows:
        head = (wrappable(row["layout"]), *(str(row[c]) for c in head_columns[1:]))
        if "error" in row:
            table.add_row(*head, row["error"], *[""] * (len(columns) - len(head) - 1))
            continue
        e: Estimate = row["estimate"]
        table.add_row(*head, f"{_states(e) / GiB:.1f}", f"{e.memory.total / GiB:.1f}", "yes" if e.fits else "no",
                      f"{e.comm_bytes.get('dp', 0) / GB:.1f}", f"{e.comm_time_s.get('dp', 0):.3g}", *tail(e),
                      f"{e.step_time_s:.3g}")
    return table


def hsdp_rows(model: ModelSpec, gpus: int, hw: Hardware, precision: str, global_batch: int) -> list[dict[str, Any]]:
    """ZeRO-3 over all `gpus` data-parallel devices, then each hybrid sharding of them (shard
    groups of every divisor of `gpus`, largest first)."""
    return [_estimated(model, _zero3_layout(gpus, global_batch, dp_shard=0 if shard == gpus else shard), hw,
                       precision, shard=shard, replicas=gpus // shard)
            for shard in sorted((d for d in divisors(gpus) if d > 1), reverse=True)]


def hsdp_table(model: ModelSpec, gpus: int, hw: Hardware, precision: str, global_batch: int) -> Table:
    title = (f"ZeRO-3 against hybrid sharding on {gpus} x {hw.name} ({hw.gpus_per_node} per node): "
             f"{model.name}, sequence {model.seq_len}, global batch {global_batch}")
    rows = hsdp_rows(model, gpus, hw, precision, global_batch)
    return _zero3_table(title, ("layout", "shard", "replicas"), (), rows, lambda e: ())


ZERO3_PP_DEGREES = (1, 2, 4, 8)  # up to a node's worth of stages; more only lengthens the bubble


def zero3_pp_rows(model: ModelSpec, gpus: int, hw: Hardware, precision: str, global_batch: int,
                  schedule: str = "1f1b") -> list[dict[str, Any]]:
    """ZeRO-3 over all `gpus` devices, then ZeRO-3 inside each stage of pp = 2, 4, 8 stages (those
    that divide the devices and the layers), the rest data parallel."""
    degrees = [pp for pp in ZERO3_PP_DEGREES if gpus % pp == 0 and model.layers % pp == 0 and gpus // pp > 1]
    return [_estimated(model, _zero3_layout(gpus, global_batch, dp=gpus // pp, pp=pp, schedule=schedule), hw,
                       precision, pp=pp)
            for pp in degrees]


def zero3_pp_table(model: ModelSpec, gpus: int, hw: Hardware, precision: str, global_batch: int) -> Table:
    title = (f"ZeRO-3 with and without pipeline parallelism on {gpus} x {hw.name}: {model.name}, "
             f"sequence {model.seq_len}, global batch {global_batch}, 1F1B")
    rows = zero3_pp_rows(model, gpus, hw, precision, global_batch)
    return _zero3_table(title, ("layout",), ("pp GB", "bubble"), rows,
                        lambda e: (f"{e.comm_bytes.get('pp', 0) / GB:.2f}", f"{e.bubble_fraction:.1%}"))


# ----------------------------------------------------------------------------- rules of thumb


def _try(model: ModelSpec, lay: LayoutSpec, ref: Estimate) -> Estimate | None:
    try:
        return estimate(model, lay, ref.hardware, ref.precision, ref.optimizer)
    except PlanError:
        return None


def _why_not(model: ModelSpec, alt: LayoutSpec | None, ref: Estimate) -> str:
    """What the cost model predicts for the layout a rule asks for, against the chosen one."""
    if alt is None:
        return "no valid layout of this cluster follows it"
    e = _try(model, alt, ref)
    if e is None:
        return "no valid layout of this cluster follows it"
    if not e.fits:
        return f"{alt.short()} would need {e.memory.total / GiB:.1f} GiB per device, more than fits"
    delta = e.step_time_s / ref.step_time_s - 1
    return f"{alt.short()} is predicted {delta:.0%} slower" if delta >= 0 else \
        f"{alt.short()} is predicted {-delta:.0%} faster but was not chosen"


def _half_dp(lay: LayoutSpec, **changes: Any) -> LayoutSpec | None:
    """`lay` with a factor of two moved from dp to the changed axis (None if dp is odd)."""
    if lay.dp % 2:
        return None
    return lay.replace(dp=lay.dp // 2, **changes)


def rules_of_thumb(model: ModelSpec, chosen: Estimate) -> list[str]:
    """Each of the articles' rules: followed, not applicable, or overridden and why."""
    lay, hw = chosen.layout, chosen.hardware
    gpn = hw.gpus_per_node
    one = _try(model, LayoutSpec(micro_batch=lay.micro_batch, global_batch=lay.micro_batch), chosen)
    fits_one = one is not None and one.fits
    lines = ["Rules of thumb (background articles: DP first; TP inside a node; PP across nodes; "
             "CP/SP above 8k tokens; EP for MoE; ZeRO for the remaining memory):"]
    split = lay.tp * lay.pp * lay.cp > 1
    if fits_one:
        if split:
            alt = LayoutSpec(dp=lay.world, ep=lay.ep, zero=lay.zero, micro_batch=lay.micro_batch,
                             global_batch=lay.global_batch)
            lines.append(f"- DP first: the model fits one device, yet the cost model split it; {_why_not(model, alt, chosen)}.")
        else:
            lines.append("- DP first: followed; the model fits one device, so only the batch is split.")
    else:
        need = f"{one.memory.total / GiB:.1f} GiB" if one is not None else "more than one device holds"
        lines.append(f"- DP first: does not apply; one device would need {need} "
                     f"(usable {hw.usable_memory_bytes / GiB:.1f} GiB), so the model must be split.")
    if lay.tp > 1:
        where = "followed: tp" if lay.tp <= gpn else "overridden: tp"
        place = "stays inside a node" if lay.tp <= gpn else "spans nodes (slow links), chosen for memory"
        lines.append(f"- TP inside a node: {where}={lay.tp} {place} of {gpn}.")
    if lay.pp > 1:
        stage_group = lay.tp * lay.cp * lay.dp
        if lay.world <= gpn:
            lines.append(f"- PP across nodes: the whole job is one node; pp={lay.pp} splits its layers there.")
        elif stage_group % gpn == 0:
            lines.append(f"- PP across nodes: followed; each of the {lay.pp} stages fills whole nodes.")
        else:
            lines.append(f"- PP across nodes: partly; stages of {stage_group} devices share nodes of {gpn}.")
    if model.seq_len > LONG_SEQUENCE:
        if lay.cp > 1 or lay.sequence_parallel:
            lines.append(f"- CP/SP for sequences above {LONG_SEQUENCE}: followed (sequence {model.seq_len}, "
                         f"cp={lay.cp}, sp={int(lay.sequence_parallel)}).")
        else:
            lines.append(f"- CP/SP for sequences above {LONG_SEQUENCE}: overridden (sequence {model.seq_len}); "
                         f"{_why_not(model, _half_dp(lay, cp=2, cp_kind='ring'), chosen)}.")
    elif lay.cp > 1:
        lines.append(f"- CP for long sequences: sequence {model.seq_len} is short, yet cp={lay.cp} was chosen; "
                     f"{_why_not(model, lay.replace(cp=1, dp=lay.dp * lay.cp), chosen)}.")
    if model.is_moe:
        if lay.ep > 1:
            lines.append(f"- EP for MoE: followed; ep={lay.ep} splits the {model.num_experts} experts.")
        else:
            ep2 = lay.replace(ep=2) if (lay.dp * lay.cp) % 2 == 0 and model.num_experts % 2 == 0 else None
            lines.append(f"- EP for MoE: overridden; {_why_not(model, ep2, chosen)}.")
    if lay.zero:
        lines.append(f"- ZeRO for the remaining memory: stage {lay.zero} shards over dp x cp = {lay.dp * lay.cp}.")
    elif lay.dp * lay.cp > 1:
        lines.append(f"- ZeRO: not needed; {_why_not(model, lay.replace(zero=1), chosen)}.")
    return lines


# ------------------------------------------------------------------------------------- CLI


def run_compare(args, model: ModelSpec, hardware: str, out) -> int:
    """`fivefold plan --compare ...` (args from plan_cli.py); prints a table, exit code 0."""
    from ..planner.spec import parse_layout

    if args.json:
        raise PlanError("--compare prints tables only; drop --json (the numbers come from fivefold.tools.plan_compare's "
                        "zero_rows, schedule_rows and axes_rows in Python)")
    hw = get_hardware(hardware)
    if not out.is_terminal and "COLUMNS" not in os.environ:  # piped to a file: a width that folds nothing
        out.width = max(out.width, 160)
    gpus = args.gpus or 8
    global_batch = args.global_batch or 8 * gpus
    if args.compare == "zero":
        out.print(zero_table(model, gpus, args.precision, args.optimizer))
        out.print("Stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters "
                  "(Rajbhandari et al. 2020, Figure 1); activations and buffers come on top.", highlight=False)
        return 0
    if args.compare == "axes":
        out.print(axes_table(model, gpus, hw, args.precision, global_batch))
        out.print("\n".join(axes_legend()), highlight=False)
        return 0
    if args.compare == "hsdp":
        out.print(hsdp_table(model, gpus, hw, args.precision, global_batch))
        out.print("A shard group's all-gathers and reduce-scatters stay among neighbouring devices (inside a node "
                  "when it fits); each step adds one all-reduce of the gradient shards over the replicas.",
                  highlight=False)
        return 0
    if args.compare == "zero3-pp":
        out.print(zero3_pp_table(model, gpus, hw, args.precision, global_batch))
        out.print("With pp, each stage's parameters are gathered per block around every micro-batch's forward and "
                  "backward (dp bytes grow with the micro-batches), and its gradients stay whole through the step.",
                  highlight=False)
        return 0
    base = parse_layout(args.layout, global_batch=global_batch) if args.layout else \
        default_pipeline_layout(model, gpus, hw, args.global_batch)
    if base.pp == 1:
        raise PlanError(f"--compare schedule needs a pipeline; give --layout with pp > 1 (got {base.short()})")
    out.print(schedule_table(model, base, hw, args.precision))
    path, drawn = draw_schedules(base.pp, base.num_micro_batches, args.out)
    note = "" if drawn == base.num_micro_batches else f" (drawn with m={drawn} micro-batches to stay readable)"
    out.print(f"ideal Gantt charts of every schedule: {path}{note}", highlight=False)
    return 0
