"""`estimate`: memory, FLOPs, communication, bubble and time of one layout.

Time model, per pipeline stage and micro-batch:

* compute = matmul and attention FLOPs / (peak x ``matmul_efficiency``) + memory-bound
  time. Attention is timed by the FLOPs the model-FLOPs count gives it (the full s x s
  score matrix, flops.py), so no layout can show an MFU above ``matmul_efficiency``; a
  causal kernel that skips the masked half runs faster than this predicts for long
  sequences, and its MFU by the PaLM definition would exceed the matmul rate. The memory-bound part (norms,
  activation functions, softmax, residuals, casts) is estimated as each saved activation
  being written once and read once per pass, i.e. 2 x saved bytes per forward, over
  ``hbm_bw``, for three passes (forward, and a backward of twice the traffic), four with
  full recomputation.
* F, B, W: forward, input-gradient and weight-gradient times (B includes recomputation);
  they set the zero-bubble schedule's bubble (pipeline.py).
* exposed communication: tensor-, expert- and Ulysses/all-gather context-parallel
  collectives sit on the critical path (they produce inputs of the next operator); ring
  attention overlaps its block transfers with the attention computation; pipeline sends
  are blocking between compute steps (Megatron-LM's 1F1B). Data-parallel collectives
  overlap with compute except the last bucket: gradient reduction with the backward of
  the last micro-batch, the parameter all-gather of ZeRO-1/2 with the next forward, and
  ZeRO-2/3's per-micro-batch collectives with that micro-batch's compute.

step = (m + bubble) x slowest stage's micro-batch time + exposed data-parallel time +
optimizer update (memory-bound: the optimizer shard read and written, gradients read,
weights written, over ``hbm_bw``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..rules import volumes
from ..config import Config
from ..rules.layout import validate, zero_groups
from ..rules.precision import ElementBytes
from .activations import (
    activation_bytes_per_layer,
    activation_element_bytes,
    saved_tensors_embedding,
    saved_tensors_output,
)
from .bridge import layout_spec, model_spec
from .comm import (
    AXES,
    Collective,
    cp_layers,
    cp_moe_layers,
    dp_grads,
    ep_layers,
    pp_sends,
    tp_ends,
    tp_grad_sums,
    tp_layers,
    volumes_by_axis,
    volumes_by_kind,
)
from .flops import attention_width, hardware_flops_per_step, model_flops_per_step
from .errors import PlanError
from .hardware import GiB, Hardware, get_hardware
from .model_states import StateBytes, state_bytes, zero_model_states
from .params import embedding_block, head_block, is_tied, kv_replica_params, layer_params, selective_recompute_matmul
from .pipeline import (
    bubble_units,
    dualpipev_compute_share,
    dualpipev_exposed,
    in_flight,
    in_flight_embedding,
    in_flight_output,
    stage_layers,
)
from .spec import LayoutSpec, ModelSpec
from .validate import check_layout, check_routing


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device on the pipeline stage that needs the most memory."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int       # ZeRO-3 gathered layers (current and prefetched)
    stage: int
    capacity: int      # usable device memory (hardware memory minus reserve)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one training step. Times in seconds, bytes per device."""

    model: ModelSpec
    layout: LayoutSpec
    hardware: Hardware
    precision: str
    optimizer: str
    memory: MemoryBreakdown
    flops_per_step: float           # model FLOPs, all devices (PaLM definition)
    hardware_flops_per_step: float  # including recomputation, all devices
    bubble_fraction: float          # bubble time / ideal pipeline time
    comm_bytes: dict                # axis -> bytes sent per device per step
    comm_bytes_by_kind: dict        # axis -> {collective kind -> bytes}
    comm_time_s: dict               # axis -> seconds of communication per step
    comm_exposed_s: dict            # axis -> seconds not hidden behind compute
    compute_time_s: float           # m micro-batches on the slowest stage, no bubble
    bubble_time_s: float
    optimizer_time_s: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float        # model FLOP/s per device, in TFLOP/s
    hardware_tflops_per_device: float
    mfu: float
    hfu: float
    fits: bool
    stage_memory: tuple = field(default=())  # total bytes of every stage
    collectives: tuple = field(default=(), repr=False)  # Collective records, busiest stage per axis

    @property
    def num_micro_batches(self) -> int:
        return self.layout.num_micro_batches


@dataclass(frozen=True)
class _LayerCost:
    dense_params: float   # per device
    expert_params: float  # per device
    act: int              # saved bytes per micro-batch, with the layout's recomputation
    act_full: int         # saved bytes per micro-batch without recomputation
    mm: float             # matmul FLOPs per micro-batch and device (forward)
    attn: float           # attention FLOPs per micro-batch and device (forward, executed)
    router_mm: float      # the part of ``mm`` in the MoE router, which FP8 leaves in 16 bits
    selective_mm: float   # matmul FLOPs selective recomputation re-runs besides the attention core
    expert_mm: float      # the part of ``mm`` in the routed experts (balanced routing)

    def gemm_equivalent(self, fp8_speedup: float) -> float:
        """``mm`` in FLOPs at the 16-bit rate: the linear layers FP8 covers (all but the
        router, `rules.fp8`) run ``fp8_speedup`` times faster."""
        return self.router_mm + (self.mm - self.router_mm) / fp8_speedup


class CostCache:
    """Per-layer costs shared between estimates of one model (e.g. during a search).

    Layer costs depend on tp, cp, ep, micro-batch, sequence parallelism, recomputation and
    the context-parallel kind only, so many layouts share them. Not thread-safe; create
    one per search.
    """

    def __init__(self, model: ModelSpec, precision: str) -> None:
        self.model, self.precision = model, precision
        self._layers: dict = {}
        self._ends: dict = {}
        self._flops: dict = {}
        self._comm: dict = {}
        self._groups: dict = {}
        self._memo: dict = {}

    def flops(self, global_batch: int, recompute: str) -> tuple[float, float]:
        """(model, hardware) FLOPs per step."""
        key = (global_batch, recompute)
        if key not in self._flops:
            self._flops[key] = (model_flops_per_step(self.model, global_batch),
                                hardware_flops_per_step(self.model, global_batch, recompute))
        return self._flops[key]

    def layer(self, lay: LayoutSpec, moe: bool) -> _LayerCost:
        key = (moe, lay.tp, lay.cp, lay.ep, lay.micro_batch, lay.sequence_parallel, lay.recompute, lay.cp_kind)
        if key not in self._layers:
            self._layers[key] = _layer_cost(self.model, lay, self.precision, self.model.moe_layers.index(moe))
        return self._layers[key]

    def pass_comm_s(self, lay: LayoutSpec, hw: Hardware, moe: bool) -> float:
        """Seconds of the always-exposed collectives of one layer pass (one micro-batch):
        tensor-, expert- and (all-gather/Ulysses) context-parallel. Collective time is linear
        in the number of calls, so a stage's time is this times its layer passes."""
        key = (hw, moe, lay.tp, lay.cp, lay.ep, lay.micro_batch, lay.sequence_parallel, lay.recompute, lay.cp_kind)
        if key not in self._comm:
            m, eb = self.model, activation_element_bytes(self.precision)
            colls = tp_layers(m, lay, eb, 1) + (ep_layers(m, lay, eb, 1, hw.gpus_per_node, self.precision)
                                             + cp_moe_layers(m, lay, 1) if moe else [])
            if lay.cp_kind != "ring":
                colls += cp_layers(m, lay, eb, 1)
            self._comm[key] = sum(c.time(hw) for c in colls)
        return self._comm[key]

    def memo(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per key."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def stage_groups(self, lay: LayoutSpec) -> list[tuple[int, int, int]]:
        """(stage, dense layers, MoE layers) of every pipeline stage of ``lay``."""
        key = (lay.pp, lay.vpp, lay.pp_layers)
        if key not in self._groups:
            self._groups[key] = _stage_groups(self.model, lay)
        return self._groups[key]

    def ends(self, lay: LayoutSpec) -> tuple[int, int]:
        """Saved bytes per micro-batch of the embedding (first stage) and output (last)."""
        key = (lay.tp, lay.cp, lay.micro_batch, lay.sequence_parallel)
        if key not in self._ends:
            m, p = self.model, self.precision
            self._ends[key] = (sum(x.bytes for x in saved_tensors_embedding(m, lay, p)),
                               sum(x.bytes for x in saved_tensors_output(m, lay, p)))
        return self._ends[key]


def _cache_for(cache: CostCache | None, model: ModelSpec, precision: str) -> CostCache:
    """``cache`` when it holds costs of this model and precision, else a new one."""
    if cache is None or cache.model is not model or cache.precision != precision:
        return CostCache(model, precision)
    return cache


def _layer_cost(m: ModelSpec, lay: LayoutSpec, precision: str, i: int) -> _LayerCost:
    lp = layer_params(m, i)
    t = lay.tp
    moe = lp.num_experts > 0
    kv_params, kv_matmul = kv_replica_params(m, t)
    dense = lp.dense.sharded / t + lp.dense.replicated + kv_params
    expert = lp.num_experts / lay.ep * (lp.expert.sharded / t + lp.expert.replicated)
    act = activation_bytes_per_layer(m, lay, precision, moe)
    if lay.recompute == "none":
        act_full = act
    else:
        act_full = activation_bytes_per_layer(m, lay.with_states(lay.zero, "none"), precision, moe)
    tokens = lay.micro_batch * m.seq_len / lay.cp
    attn = 4.0 * tokens * m.seq_len * attention_width(m) / t  # the same count as the model FLOPs
    router = 2.0 * tokens * m.hidden * m.num_experts if moe else 0.0  # replicated over tp
    selective = 2.0 * tokens * selective_recompute_matmul(m) / t
    routed = 2.0 * tokens * lp.top_k * lp.expert.matmul / t
    return _LayerCost(dense, expert, act, act_full, 2.0 * tokens * (lp.matmul_active / t + kv_matmul), attn, router,
                      selective, routed)


@dataclass(frozen=True)
class _StageTime:
    t_f: float
    t_b: float
    t_w: float
    inner_exposed: dict   # axis -> exposed seconds per step (tp, cp, ep, pp)
    dp_exposed: float
    optimizer_s: float
    colls: list
    comm_time: dict
    volumes: dict


@dataclass(frozen=True)
class _Ctx:
    m: ModelSpec
    lay: LayoutSpec
    hw: Hardware
    precision: str
    eb: ElementBytes
    sb: StateBytes
    costs: dict
    ends: tuple[int, int]


def _context(model: ModelSpec, layout: LayoutSpec, hw: Hardware, precision: str, optimizer: str,
             cache: CostCache | None) -> _Ctx:
    eb = activation_element_bytes(precision)
    sb = state_bytes(precision, optimizer)
    cache = _cache_for(cache, model, precision)
    costs = {moe: cache.layer(layout, moe) for moe in set(model.moe_layers)}
    return _Ctx(model, layout, hw, precision, eb, sb, costs, cache.ends(layout))


def _stage_groups(model: ModelSpec, layout: LayoutSpec) -> list[tuple[int, int, int]]:
    """(stage, dense layers, MoE layers) of every pipeline stage."""
    out = []
    for s, layers in enumerate(stage_layers(model, layout)):
        n_moe = sum(model.moe_layers[i] for i in layers)
        out.append((s, len(layers) - n_moe, n_moe))
    return out


def estimate(model: ModelSpec, layout: LayoutSpec, hardware: str | Hardware = "A100-80GB",
             precision: str = "bf16", optimizer: str = "adam", gpus: int | None = None,
             cache: CostCache | None = None) -> Estimate:
    """Predict memory, FLOPs, communication and time of ``layout`` for ``model``.

    Raises `PlanError` for unknown names and for layouts that ``fivefold train`` refuses
    (the runtime's own validation, with its message); a layout that does not fit in memory
    is returned with ``fits=False``.
    """
    hw = get_hardware(hardware)
    check_layout(model, layout, gpus, precision)
    check_routing(model, layout, hw)
    hw.fp8_speedup(precision)  # refuses FP8 on a device without it, before any costing
    ctx = _context(model, layout, hw, precision, optimizer, cache)
    return estimate_valid(model, layout, hw, precision, optimizer, cache, ctx)


def estimate_run(config: Config, hardware: str | Hardware = "H100-80GB", optimizer: str = "adam") -> Estimate:
    """`estimate` of a runtime `Config` (its model, layout, sequence length, batch and dtype)."""
    config = validate(config)
    spec = model_spec(config.model, config.train.seq_len)
    layout = layout_spec(config.layout, config.train.global_batch)
    hw = get_hardware(hardware)
    return estimate_valid(spec, layout, hw, "bf16" if config.train.dtype == "bf16" else "fp32", optimizer)


def check_kept_gather_fits(e: Estimate) -> None:
    """Refuse a layout that keeps ZeRO-3's parameters gathered through the step
    (``zero3_gather="step"``) where that alone keeps it from fitting (gathering per micro-batch
    would fit), with what it needs and what gathering per micro-batch would need: the fix is a
    policy change, not a bigger machine.

    Other layouts that do not fit, this one included when gathering per micro-batch would not
    fit either, are reported (``fits=False``), not refused: the planner shows their breakdown,
    and the search looks for another layout."""
    lay = e.layout
    if e.fits or lay.zero != 3 or not volumes.zero3_gathers_once_per_step(lay.zero3_gather):
        return
    per_micro_batch = estimate_valid(e.model, lay.with_states(3, lay.recompute, "micro_batch"), e.hardware,
                                     e.precision, e.optimizer)
    if not per_micro_batch.fits:
        return
    raise PlanError(
        f"zero3_gather=step keeps every parameter of a stage gathered through the step and needs "
        f"{e.memory.total / GiB:.1f} GiB per device, but {e.hardware.name} has {e.hardware.usable_memory_bytes / GiB:.1f} "
        f"GiB usable; use zero3_gather=micro_batch (needs {per_micro_batch.memory.total / GiB:.1f} GiB) or more pp or tp")


def estimate_valid(model: ModelSpec, layout: LayoutSpec, hw: Hardware, precision: str, optimizer: str,
                   cache: CostCache | None = None, ctx: _Ctx | None = None) -> Estimate:
    """`estimate` of a layout already validated (by `check_layout` or the search)."""
    cache = _cache_for(cache, model, precision)
    ctx = ctx or _context(model, layout, hw, precision, optimizer, cache)
    groups = cache.stage_groups(layout)
    states = cache.memo(_states_key(layout, layout.zero, optimizer), lambda: _states_per_stage(ctx, groups, layout.zero))
    totals = [a + st for a, st in zip(_stage_activations(ctx, groups), states)]
    times, seen = [], {}
    for s, n_dense, n_moe in groups:  # stages with the same layers and ends take the same time
        key = (n_dense, n_moe, s == 0, s == layout.pp - 1)
        if key not in seen:
            seen[key] = _stage_time(ctx, s, n_dense, n_moe, _stage_memory(ctx, s, n_dense, n_moe))
        times.append(seen[key])
    worst = _stage_memory(ctx, *groups[max(range(len(totals)), key=totals.__getitem__)])
    flops = cache.flops(layout.global_batch, layout.recompute)
    return _combine(model, layout, hw, precision, optimizer, worst, totals, times, flops)


def _params_here(ctx: _Ctx, first: bool, last: bool, n_dense: int, n_moe: int) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one device of a stage."""
    m, t = ctx.m, ctx.lay.tp
    per = [(ctx.costs[k], n) for k, n in ((False, n_dense), (True, n_moe)) if n]
    dense = sum(c.dense_params * n for c, n in per)
    expert = sum(c.expert_params * n for c, n in per)
    if first:
        emb = embedding_block(m)
        dense += emb.sharded / t + emb.replicated
    if last:
        hb = head_block(m)
        dense += hb.sharded / t + hb.replicated
        if is_tied(m) and ctx.lay.pp > 1:
            dense += m.vocab * m.hidden / t  # the output layer's copy of the word embedding
    return dense, expert


def _tied_copy_elements(m: ModelSpec, lay: LayoutSpec, s: int) -> float:
    """Elements of the copy of a word embedding tied across the pipeline's first and last stage
    that a rank of stage ``s`` holds (summed over them by a gradient finalizer); 0 elsewhere."""
    return m.vocab * m.hidden / lay.tp if is_tied(m) and lay.pp > 1 and s in (0, lay.pp - 1) else 0.0


def _finalized_params(ctx: _Ctx, s: int, n_dense: int, n_moe: int) -> float:
    """Parameters of a rank of stage ``s`` whose gradients finalizers complete before the
    data-parallel reduction: sums over tp (`volumes.tp_finalized_elements`) and the tied
    embedding over the pipeline ends. ZeRO-2/3 hold those gradients full and reduce them once
    per step (`volumes.zero_reduction`)."""
    m, lay = ctx.m, ctx.lay
    partial, shared_kv = volumes.tp_finalized_elements(m.hidden, m.head_dim, m.n_kv_heads, lay.tp, m.num_experts,
                                                       n_dense + n_moe, n_moe, lay.sequence_parallel,
                                                       s == lay.pp - 1)
    return partial + shared_kv + _tied_copy_elements(m, lay, s)


def _kept_for_backward(ctx: _Ctx, first: bool, last: bool) -> tuple[float, float]:
    """(non-expert, expert) parameters ZeRO-3 keeps gathered from the forward to the backward:
    the root (embedding, final norm, head) and the last layer (parallel/zero.py). ZeRO-3 runs
    without pipeline stages, so the stage's last layer is the model's."""
    root, _ = _params_here(ctx, first, last, 0, 0)
    last_layer = ctx.costs[ctx.m.is_moe_layer(ctx.m.layers - 1)]
    return root + last_layer.dense_params, last_layer.expert_params


def _stage_activations(ctx: _Ctx, groups: list[tuple[int, int, int]]) -> list[int]:
    """Saved-activation bytes at the peak of each (stage, dense layers, MoE layers) in ``groups``."""
    lay = ctx.lay
    embedding = in_flight_embedding(lay) * ctx.ends[0]
    output = in_flight_output(lay) * ctx.ends[1]
    per_layers: dict = {}  # (dense, MoE layers) -> (bytes per micro-batch, rematerialised layer)
    out = []
    for s, n_dense, n_moe in groups:
        if (n_dense, n_moe) not in per_layers:
            per = [(ctx.costs[k], n) for k, n in ((False, n_dense), (True, n_moe)) if n]
            remat = max(c.act_full for c, _ in per) if lay.recompute == "full" and per else 0
            per_layers[n_dense, n_moe] = (sum(c.act * n for c, n in per), remat)
        layers, remat = per_layers[n_dense, n_moe]
        act = in_flight(lay, s) * layers
        if s == 0:
            act += embedding
        if s == lay.pp - 1:
            act += output
        out.append(int(act + remat))  # one layer rematerialised during backward with full recomputation
    return out


def _stage_states(ctx: _Ctx, s: int, n_dense: int, n_moe: int, zero: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, buffers) bytes of one device of stage ``s``."""
    lay, sb = ctx.lay, ctx.sb
    dense, expert = _params_here(ctx, s == 0, s == lay.pp - 1, n_dense, n_moe)
    groups = zero_groups(lay.dp, lay.cp, lay.ep, zero, lay.dp_shard)  # `zero` may differ from lay.zero
    ms_d = zero_model_states(dense, groups.dense_shard, zero, sb, _finalized_params(ctx, s, n_dense, n_moe), lay.pp,
                             lay.zero3_gather)
    ms_e = zero_model_states(expert, groups.expert_shard, zero, sb, pp=lay.pp,
                             gather=lay.zero3_gather)  # no expert gradient has a finalizer
    buffers = 0
    # Gathering per micro-batch holds the unit in use and the one prefetched besides the shards;
    # gathering once per step holds every unit full, which zero_model_states already counts.
    if zero == 3 and n_dense + n_moe and not volumes.zero3_gathers_once_per_step(lay.zero3_gather):
        per = [ctx.costs[k] for k, n in ((False, n_dense), (True, n_moe)) if n]
        buffers = int(2 * sb.param * max(c.dense_params + c.expert_params for c in per))
    return (ms_d.params + ms_e.params, ms_d.grads + ms_e.grads, ms_d.optimizer + ms_e.optimizer, buffers)


def _stage_memory(ctx: _Ctx, s: int, n_dense: int, n_moe: int) -> MemoryBreakdown:
    p, g, o, buf = _stage_states(ctx, s, n_dense, n_moe, ctx.lay.zero)
    act = _stage_activations(ctx, [(s, n_dense, n_moe)])[0]
    return MemoryBreakdown(p, g, o, act, buf, s, ctx.hw.usable_memory_bytes)


def memory_grid(model: ModelSpec, layout: LayoutSpec, hardware: str | Hardware = "A100-80GB",
                precision: str = "bf16", optimizer: str = "adam",
                zeros: tuple[int, ...] = (0, 1, 2, 3),
                recomputes: tuple[str, ...] = ("none", "selective", "full"),
                cache: CostCache | None = None) -> dict[tuple[int, str], int]:
    """Worst-stage total bytes for every (ZeRO stage, recomputation) of ``layout``.

    The same numbers as ``estimate(...).memory.total``, computed together so that a search
    can discard layouts that do not fit before timing them.
    """
    hw = get_hardware(hardware)
    check_layout(model, layout, precision=precision)
    return memory_grid_valid(model, layout, hw, precision, optimizer, zeros, recomputes, cache)


def memory_grid_valid(model: ModelSpec, layout: LayoutSpec, hw: Hardware, precision: str, optimizer: str,
                      zeros: tuple[int, ...], recomputes: tuple[str, ...] = ("none", "selective", "full"),
                      cache: CostCache | None = None) -> dict[tuple[int, str], int]:
    """`memory_grid` of a layout already validated."""
    cache = _cache_for(cache, model, precision)
    all_groups = cache.stage_groups(layout)
    peaks = _peak_candidates(all_groups)
    groups = [all_groups[i] for i in peaks]
    acts, states = {}, {}
    for r in recomputes:
        ctx = _context(model, layout.with_states(layout.zero, r), hw, precision, optimizer, cache)
        acts[r] = _stage_activations(ctx, groups)
    for z in zeros:  # model states do not depend on micro-batching, schedule or recomputation
        row = cache.memo(_states_key(layout, z, optimizer), lambda: _states_per_stage(ctx, all_groups, z))
        states[z] = [row[i] for i in peaks]
    return {(z, r): max(a + st for a, st in zip(acts[r], states[z])) for z in zeros for r in recomputes}


def _peak_candidates(groups: list[tuple[int, int, int]]) -> list[int]:
    """Indices of the stages among which the most loaded one is: the first of each kind.

    Stages with the same layers and ends hold the same model states, and activations for
    more micro-batches the earlier they sit (micro-batches in flight never grow with the
    stage index under any schedule), so the first of them needs the most memory.
    """
    first: dict = {}
    last = groups[-1][0]
    for i, (s, nd, nm) in enumerate(groups):
        first.setdefault((nd, nm, s == 0, s == last), i)
    return list(first.values())


def _states_key(lay: LayoutSpec, zero: int, optimizer: str) -> tuple:
    """What the model states of every stage depend on (not micro-batching, schedule or recomputation)."""
    return ("states", lay.tp, lay.pp, lay.vpp, lay.pp_layers, lay.ep, lay.dp * lay.cp, lay.dp_shard, zero, optimizer,
            lay.sequence_parallel, lay.zero3_gather)  # sequence parallelism adds gradient finalizers


def _states_per_stage(ctx: _Ctx, groups: list[tuple[int, int, int]], zero: int) -> list[int]:
    per_key: dict = {}
    row = []
    for s, nd, nm in groups:
        key = (s == 0, s == ctx.lay.pp - 1, nd, nm)
        if key not in per_key:
            per_key[key] = sum(_stage_states(ctx, s, nd, nm, zero))
        row.append(per_key[key])
    return row


def _stage_time(ctx: _Ctx, s: int, n_dense: int, n_moe: int, mem: MemoryBreakdown) -> _StageTime:
    m, lay, hw, sb, eb = ctx.m, ctx.lay, ctx.hw, ctx.sb, ctx.eb
    first, last = s == 0, s == lay.pp - 1
    per = [(ctx.costs[k], n) for k, n in ((False, n_dense), (True, n_moe)) if n]
    t, mbs, n_layers = lay.tp, lay.num_micro_batches, n_dense + n_moe

    # ---- compute per micro-batch ----
    dualpipev = lay.schedule == "dualpipev" and lay.pp > 1
    share = dualpipev_compute_share(hw.sm_count, lay.ep) if dualpipev else 1.0
    rate = hw.peak(ctx.precision) * hw.matmul_efficiency * share
    speedup = hw.fp8_speedup(ctx.precision)
    # the busiest expert-parallel rank runs expert_imbalance times the mean routed tokens
    mm = sum((c.gemm_equivalent(speedup) + (lay.expert_imbalance - 1) * c.expert_mm / speedup) * n for c, n in per)
    at = sum(c.attn * n for c, n in per)
    selective = at + sum(c.selective_mm * n for c, n in per) / speedup
    tokens = lay.micro_batch * m.seq_len / lay.cp
    head = 2.0 * tokens * head_block(m).matmul / t if last else 0.0
    recompute = {"none": 0.0, "selective": selective, "full": mm + at}[lay.recompute]
    passes = 4 if lay.recompute == "full" else 3
    ends = (ctx.ends[0] if first else 0) + (ctx.ends[1] if last else 0)
    elem = 2.0 * (sum(c.act_full * n for c, n in per) * passes + 3 * ends) / hw.hbm_bw
    t_f = (mm + at + head) / rate + elem / 3
    t_b = (mm + 2 * at + head + recompute) / rate + 2 * elem / 3
    t_w = (mm + head) / rate

    # ---- communication ----
    dense, expert = _params_here(ctx, first, last, n_dense, n_moe)
    tied = _tied_copy_elements(m, lay, s) * sb.grad
    inner = (tp_layers(m, lay, eb, n_layers * mbs) + tp_ends(m, lay, eb, first, last, mbs)
             + tp_grad_sums(m, lay, sb.grad, n_layers, n_moe, last)
             + cp_layers(m, lay, eb, n_layers * mbs) + cp_moe_layers(m, lay, n_moe * mbs)
             + ep_layers(m, lay, eb, n_moe * mbs, hw.gpus_per_node, ctx.precision) + pp_sends(m, lay, eb, s, tied))
    keeps = lay.zero == 3 and n_layers and volumes.zero3_keeps_ends_gathered(lay.pp)
    kept = _kept_for_backward(ctx, first, last) if keeps else (0.0, 0.0)
    dp = dp_grads(lay, sb.param, sb.reduce, dense, expert, kept, _finalized_params(ctx, s, n_dense, n_moe))
    comm_time = {a: 0.0 for a in AXES}
    for c in inner + dp:
        comm_time[c.axis] += c.time(hw)
    comm_time["ep"] *= lay.expert_imbalance  # the busiest rank receives and returns that many more copies
    exposed = {a: comm_time[a] for a in ("tp", "cp", "ep", "pp")}
    if lay.cp > 1 and lay.cp_kind == "ring":  # transfers hide behind attention, launches do not
        launches = sum(c.calls for c in inner if c.axis == "cp") * hw.intra_latency_s
        exposed["cp"] = max(launches, comm_time["cp"] - mbs * 3 * at / rate)
    if dualpipev:  # expert and pipeline transfers hide behind the paired micro-batch's compute
        hidden_axes = ("ep", "pp")
        comm = sum(comm_time[a] for a in hidden_axes)
        left = dualpipev_exposed(comm, mbs * (t_f + t_b + t_w), lay.pp, mbs)
        for a in hidden_axes:
            exposed[a] = comm_time[a] * left / comm if comm else 0.0
    dp_exp = _dp_exposed(dp, hw, mbs, max(n_layers, 1), t_f, t_b + t_w)
    optimizer_s = mem.optimizer / sb.optimizer * (2 * sb.optimizer + sb.param + sb.grad) / hw.hbm_bw
    colls = inner + dp
    return _StageTime(t_f, t_b, t_w, exposed, dp_exp, optimizer_s, colls, comm_time,
                      volumes_by_axis(colls))


def time_lower_bound(model: ModelSpec, layout: LayoutSpec, hw: Hardware, precision: str,
                     cache: CostCache) -> float:
    """A step time that no ZeRO variant of ``layout`` (with its recomputation) can beat;
    with ``recompute="none"`` one that no recomputation can beat either.

    The least-loaded stage's compute with the layout's recomputation (including
    memory-bound time), the smallest bubble the schedule can have, and the collectives the
    time model always exposes (tensor-parallel, expert-parallel, all-gather/Ulysses
    context-parallel). The bubble of ZB-H1 is at least a third of 1F1B's: F + B >= 2 W.
    """
    lay = layout
    rate = hw.peak(precision) * hw.matmul_efficiency
    p, v, mbs = lay.pp, lay.vpp, lay.num_micro_batches
    n_dense, n_moe = cache.memo(("least loaded", lay.pp, lay.vpp, lay.pp_layers), lambda: _least_loaded(cache, lay))
    per = [(False, n_dense)] if n_dense else []
    if n_moe:
        per.append((True, n_moe))
    passes = 4 if lay.recompute == "full" else 3
    t_mb = 0.0
    for moe, n in per:
        c = cache.layer(lay, moe)
        mm = c.gemm_equivalent(hw.fp8_speedup(precision))
        recompute = {"none": 0.0, "selective": c.attn, "full": mm + c.attn}[lay.recompute]
        flops = 3 * mm + 3 * c.attn + recompute
        hides_comm = lay.schedule == "dualpipev"  # may hide all of its expert all-to-alls
        comm = 0.0 if hides_comm else cache.pass_comm_s(lay, hw, moe)
        t_mb += n * (flops / rate + 2.0 * passes * c.act_full / hw.hbm_bw + comm)
    bubble = 0.0 if p == 1 or lay.schedule == "dualpipev" else (p - 1) / (v if lay.schedule == "interleaved" else 1)
    if lay.schedule == "zb-h1":
        bubble /= 3
    return mbs * t_mb * (1 + bubble / mbs)


def _least_loaded(cache: CostCache, lay: LayoutSpec) -> tuple[int, int]:
    """(dense, MoE) layers that every pipeline stage of ``lay`` holds at least."""
    groups = cache.stage_groups(lay)
    return min(nd for _, nd, _ in groups), min(nm for _, _, nm in groups)


def _dp_exposed(colls: list[Collective], hw: Hardware, mbs: int, buckets: int,
                fwd_window: float, bwd_window: float) -> float:
    """Data-parallel time not hidden behind compute; the last bucket never overlaps."""
    per_mb = sum(c.time(hw) for c in colls if c.calls >= mbs > 1) / mbs
    reduce = sum(c.time(hw) for c in colls if not (c.calls >= mbs > 1) and c.phase != "step")
    gather = sum(c.time(hw) for c in colls if not (c.calls >= mbs > 1) and c.phase == "step")
    hide = lambda t, w: max(t / buckets, t - w)  # noqa: E731
    return mbs * hide(per_mb, fwd_window + bwd_window) + hide(reduce, bwd_window) + hide(gather, fwd_window)


def _combine(m: ModelSpec, lay: LayoutSpec, hw: Hardware, precision: str, optimizer: str,
             worst: MemoryBreakdown, stage_totals: list[int], times: list[_StageTime],
             flops: tuple[float, float]) -> Estimate:
    mbs = lay.num_micro_batches
    per_mb = [st.t_f + st.t_b + st.t_w + sum(st.inner_exposed.values()) / mbs for st in times]
    slow = max(range(len(times)), key=per_mb.__getitem__)
    st = times[slow]
    units = bubble_units(lay, st.t_f, st.t_b, st.t_w)
    tail = max(t.dp_exposed + t.optimizer_s for t in times)
    step = (mbs + units) * per_mb[slow] + tail

    colls: list[Collective] = []
    comm_bytes, by_kind, comm_time, exposed = {}, {}, {}, {}
    for axis in AXES:
        busiest = max(times, key=lambda t: t.volumes[axis])
        mine = [c for c in busiest.colls if c.axis == axis]
        colls += mine
        comm_bytes[axis] = busiest.volumes[axis]
        by_kind[axis] = volumes_by_kind(mine)[axis]
        comm_time[axis] = busiest.comm_time[axis]
        exposed[axis] = st.dp_exposed if axis == "dp" else st.inner_exposed[axis]
    mflops, hflops = flops
    peak = hw.peak(precision) * lay.world
    return Estimate(
        model=m, layout=lay, hardware=hw, precision=precision, optimizer=optimizer,
        memory=worst, flops_per_step=mflops, hardware_flops_per_step=hflops,
        bubble_fraction=units / mbs, comm_bytes=comm_bytes, comm_bytes_by_kind=by_kind,
        comm_time_s=comm_time, comm_exposed_s=exposed,
        compute_time_s=mbs * (st.t_f + st.t_b + st.t_w), bubble_time_s=units * per_mb[slow],
        optimizer_time_s=st.optimizer_s, step_time_s=step,
        tokens_per_s=lay.global_batch * m.seq_len / step,
        tflops_per_device=mflops / step / lay.world / 1e12,
        hardware_tflops_per_device=hflops / step / lay.world / 1e12,
        mfu=mflops / step / peak, hfu=hflops / step / peak,
        fits=worst.total <= hw.usable_memory_bytes,
        stage_memory=tuple(stage_totals), collectives=tuple(colls))
