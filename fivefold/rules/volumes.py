"""Analytic communication volumes: which collectives a layout issues and the bytes they move.

Defined once, here, and used by both sides: the planner turns these calls into timed
collectives (`fivefold.planner.comm`), and the strategy tests check that the bytes
`parallel/comm.py` counts on each axis equal them exactly. Pure arithmetic; imports only
`config`.

Bytes one rank puts on the wire for one call on a group of n ranks, under the ring
(bandwidth-optimal) algorithms (Thakur, Rabenseifner and Gropp 2005; the bus-bandwidth
factors of nccl-tests), for a buffer of B bytes: all-reduce 2(n - 1)/n B; all-gather
(n - 1)/n B with B the gathered output; reduce-scatter (n - 1)/n B with B the input;
all-to-all (n - 1)/n B of the local buffer, evenly split; a point-to-point send B.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

from ..config import Config
from .precision import ElementBytes, PrecisionPolicy

if TYPE_CHECKING:
    import torch


OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


class Call(NamedTuple):
    """``calls`` calls of ``op`` on a buffer of ``nbytes`` (see `wire_bytes` for which buffer)."""

    op: str
    nbytes: float  # whole bytes for the runtime; a planner's per-device share may be fractional
    calls: float
    phase: str  # "fwd", "bwd" or "step"
    what: str


FP32 = ElementBytes(4, 4)  # bytes per element of both activation kinds in fp32

# comm.py's axes -> the planner's five: data-parallel reductions run on dp x cp (dense
# parameters) or on the expert-data-parallel group (experts); the tied embedding's gradient
# sum between the first and last pipeline stages runs on pp_ends. "world" (the loss and the
# global gradient norm) is not a parallel axis and maps to none.
PLANNER_AXIS = {"dp_cp": "dp", "edp": "dp", "dp": "dp", "tp": "tp", "pp": "pp", "pp_ends": "pp", "cp": "cp", "ep": "ep",
                # hybrid sharding: ZeRO inside the shard groups and the sums over their replicas
                "dp_cp_shard": "dp", "dp_cp_rep": "dp", "edp_shard": "dp", "edp_rep": "dp"}


def planner_axis_bytes(wire: dict[str, int]) -> dict[str, int]:
    """Bytes per comm.py axis summed per planner axis (dp, tp, pp, cp, ep); "world" left out."""
    out: dict[str, int] = {}
    for axis, nbytes in wire.items():
        name = PLANNER_AXIS.get(axis)
        if name is not None:
            out[name] = out.get(name, 0) + nbytes
    return out


def wire_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends in one call, exactly as `parallel/comm.py` counts them."""
    if op == "send":
        return nbytes
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    return (n - 1) * (nbytes // n)  # all-gather, reduce-scatter, even all-to-all: n - 1 shards


def ring_factor(op: str, n: int) -> float:
    """`wire_bytes` / nbytes without rounding (for time estimates)."""
    if op == "send":
        return 1.0
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def ring_steps(op: str, n: int) -> int:
    """Sequential latency-bound steps of one ring call."""
    if op == "send":
        return 1
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def total_wire_bytes(calls: Sequence[Call], n: int) -> dict[str, int]:
    """Wire bytes per op of ``calls`` on a group of ``n`` ranks."""
    out: dict[str, int] = {}
    for c in calls:
        if c.calls:
            out[c.op] = out.get(c.op, 0) + int(c.calls) * wire_bytes(c.op, int(c.nbytes), n)
    return out


# ----------------------------------------------------------------------------- shapes per rank


def vocab_rows_per_rank(vocab_size: int, tp: int) -> int:
    """Rows of a vocab-parallel embedding or head on each tensor-parallel rank: the vocabulary
    is padded to a multiple of tp (`padded_vocab`) and split evenly."""
    return -(-vocab_size // tp)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp; the extra rows are never predicted."""
    return vocab_rows_per_rank(vocab_size, tp) * tp


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """Key/value heads a tensor-parallel rank holds: kv/tp, or one head repeated when tp > kv."""
    return max(kv_heads // tp, 1)


def ulysses_kv_heads(cp: int, kv_heads: int) -> int:
    """K/V heads a Ulysses rank sends: its own, or repeated up to cp when they do not split."""
    return cp if kv_heads % cp else kv_heads


# ----------------------------------------------------------------------------- recomputation


def forward_passes(recompute: str) -> int:
    """Forward passes of a layer per micro-batch: full recomputation runs it again in backward."""
    return 2 if recompute == "full" else 1


def core_forward_passes(recompute: str) -> int:
    """Forward passes of the attention core per micro-batch: selective recomputation runs the
    core alone again in backward, full recomputation the whole layer."""
    return 1 if recompute == "none" else 2


# ----------------------------------------------------------------------------- tensor parallel


def tp_layer_calls(x_elems: int, eb: ElementBytes, sequence_parallel: bool, forward_passes: int = 1) -> list[Call]:
    """One transformer layer, one micro-batch: x_elems is one b x s/c x h activation.

    Without sequence parallelism two all-reduces forward (attention and MLP exits) and two
    backward (their entries); with it each becomes an all-gather + reduce-scatter pair
    (Korthikanti et al. 2022, Section 4.2.2). ``forward_passes`` = 2 under full recomputation.
    The recomputed pass repeats every forward collective but the layer's last (the MLP exit):
    torch's non-reentrant checkpoint stops recomputing once the tensors saved for backward
    are rebuilt, and no saved tensor needs the MLP's output.
    The exits carry a projection's output, and its gradient comes back through the gather of
    the output grad: `eb.compute`; the entries carry a norm's output and its gradient: `eb.residual`.
    """
    f = forward_passes
    exits = 2 * f - (f - 1)  # the MLP exit runs once
    into, out = x_elems * eb.residual, x_elems * eb.compute
    if not sequence_parallel:
        return [Call("all_reduce", out, exits, "fwd", "attention/MLP output"),
                Call("all_reduce", into, 2, "bwd", "attention/MLP input grad")]
    return [Call("all_gather", into, 2 * f, "fwd", "norm output to attention/MLP"),
            Call("reduce_scatter", out, exits, "fwd", "attention/MLP output"),
            Call("reduce_scatter", into, 2, "bwd", "attention/MLP input grad"),
            Call("all_gather", out, 2, "bwd", "output grad")]


def tp_end_calls(x_elems: int, eb: ElementBytes, rows: int, sequence_parallel: bool, first: bool,
                 last: bool) -> list[Call]:
    """Vocab-parallel embedding (first stage), head and cross-entropy (last), one micro-batch.

    The embedding's output and the head's input (the final norm's output) are the residual
    stream's (`eb.residual`). The loss all-reduces the row maxima (rows fp32 values) and
    [sum of exp, target logit].
    """
    out: list[Call] = []
    sp = sequence_parallel
    x_bytes = x_elems * eb.residual
    if first:
        out += ([Call("reduce_scatter", x_bytes, 1, "fwd", "embedding"),
                 Call("all_gather", x_bytes, 1, "bwd", "embedding grad")]
                if sp else [Call("all_reduce", x_bytes, 1, "fwd", "embedding")])
    if last:
        out += ([Call("all_gather", x_bytes, 1, "fwd", "head input"),
                 Call("reduce_scatter", x_bytes, 1, "bwd", "head input grad")]
                if sp else [Call("all_reduce", x_bytes, 1, "bwd", "head input grad")])
        out += [Call("all_reduce", rows * 4, 1, "fwd", "cross-entropy row max"),
                Call("all_reduce", 2 * rows * 4, 1, "fwd", "cross-entropy sum and target")]
    return out


def tp_finalized_elements(hidden: int, head_dim: int, kv_heads: int, tp: int, num_experts: int, layers: int,
                          moe_layers: int, sequence_parallel: bool, last: bool) -> tuple[int, int]:
    """(partial, shared kv) local gradient elements that tp's gradient finalizers complete, for
    ``layers`` layers (``moe_layers`` of them MoE) held by the rank (``last``: the final norm too).

    Partial over tp: norm weights under sequence parallelism (each rank saw its tokens), MoE
    routers (each rank saw its expert slice). Shared: the rank's key/value head (wk and wv)
    when tp exceeds the kv heads, held by tp/kv ranks that each saw their own query heads.
    """
    if tp == 1 or layers == 0:
        return 0, 0
    partial = hidden * (2 * layers + (1 if last else 0)) if sequence_parallel else 0
    partial += moe_layers * num_experts * hidden
    shared_kv = 2 * layers * head_dim * hidden if kv_heads % tp else 0
    return partial, shared_kv


def tp_step_calls(hidden: int, head_dim: int, kv_heads: int, tp: int, num_experts: int, layers: int,
                  moe_layers: int, sequence_parallel: bool, last: bool, grad_bytes: int) -> list[Call]:
    """Once per step: the gradient finalizers' sums of `tp_finalized_elements` (same arguments).

    The partial gradients are summed in one all-reduce, the shared kv heads in one (kv, n)
    buffer (each group of tp/kv ranks fills its row). What they read, ZeRO reduces only after
    them (`zero_reduction`).
    """
    partial, shared_kv = tp_finalized_elements(hidden, head_dim, kv_heads, tp, num_experts, layers, moe_layers,
                                               sequence_parallel, last)
    out = [Call("all_reduce", partial * grad_bytes, 1, "step", "partial gradients")] if partial else []
    if shared_kv:
        out.append(Call("all_reduce", kv_heads * shared_kv * grad_bytes, 1, "step", "shared kv heads"))
    return out


def moe_statistics_calls(num_experts: int, moe_layers: int) -> list[Call]:
    """Reporting after the optimizer update, not part of the training step: the training loop
    all-reduces each MoE layer's load statistics (E + 1 float64 values) over tp (and dp x cp)."""
    return [Call("all_reduce", (num_experts + 1) * 8, moe_layers, "step", "MoE statistics")] if moe_layers else []


def tp_wire_bytes_per_step(config: Config) -> dict[str, int]:
    """Bytes one rank sends on the tp axis in one iteration of the training loop, by collective
    (fp32, pp = cp = 1): the step and the MoE statistics reported after it."""
    model, layout, train = config.model, config.layout, config.train
    n, fp32 = layout.tp, 4
    if n == 1:
        return {}
    rows = layout.micro_batch * train.seq_len
    x = rows * model.hidden
    sp = layout.sequence_parallel
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.layers))
    per_mb = tp_layer_calls(x, FP32, sp) * model.layers + tp_end_calls(x, FP32, rows, sp, True, True)
    calls = [c._replace(calls=c.calls * layout.grad_accum) for c in per_mb]
    calls += tp_step_calls(model.hidden, model.head_dim, model.n_kv_heads, n, model.num_experts, model.layers,
                           moe_layers, sp, True, fp32)
    calls += moe_statistics_calls(model.num_experts, moe_layers)
    return total_wire_bytes(calls, n)


# ----------------------------------------------------------------------------- context parallel


def cp_layer_calls(algorithm: str, cp: int, batch: int, local_len: int, heads: int, kv_heads: int,
                   head_dim: int, elem_bytes: int, recompute: str = "none") -> list[Call]:
    """One attention layer, one micro-batch, on a cp rank holding ``heads``/``kv_heads`` heads
    (after tensor parallelism) of ``local_len`` tokens of ``batch`` sequences, whose projected
    q, k, v have ``elem_bytes`` per element (the compute dtype's).

    allgather: all-gather K and V forward, reduce-scatter dK and dV backward;
    ring: cp - 1 hops of the K and of the V block forward, cp - 1 again backward (circulated
    rather than stored) and cp hops of the dK, dV accumulators (they end at their owner);
    ulysses: one all-to-all of q, k and v together and one of the output forward, of their
    gradients backward.
    Everything the forward sends happens inside the attention core, so it repeats in each of
    its `core_forward_passes`, except Ulysses' output all-to-all, which repeats only with the
    whole layer (`forward_passes`): torch's checkpoint stops recomputing the core before it,
    since no tensor the core saves for backward needs its output.
    """
    if cp == 1:
        return []
    token = batch * local_len * head_dim * elem_bytes  # one head of this rank's tokens
    kv_elems = kv_heads * batch * local_len * head_dim  # K (or V) of this rank's tokens
    kv = kv_elems * elem_bytes
    core, layer = core_forward_passes(recompute), forward_passes(recompute)
    if algorithm == "allgather":
        return [Call("all_gather", kv * cp, 2 * core, "fwd", "K, V"),
                Call("reduce_scatter", kv * cp, 2, "bwd", "dK, dV")]
    if algorithm == "ring":
        acc = kv_elems * ring_accumulator_bytes(elem_bytes)
        return [Call("send", kv, 2 * (cp - 1) * core, "fwd", "K, V blocks"),
                Call("send", kv, 2 * (cp - 1), "bwd", "K, V blocks again"),
                Call("send", acc, 2 * cp, "bwd", "dK, dV accumulators, home after cp hops")]
    if algorithm == "ulysses":
        q, kv_sent = heads * token, ulysses_kv_heads(cp, kv_heads) * token
        qkv = q + 2 * kv_sent
        return [Call("all_to_all", qkv, core, "fwd", "q, k, v"), Call("all_to_all", q, layer, "fwd", "out"),
                Call("all_to_all", q, 1, "bwd", "d_out"), Call("all_to_all", qkv, 1, "bwd", "dq, dk, dv")]
    raise ValueError(f"unknown cp algorithm {algorithm!r}")


def ring_accumulator_bytes(elem_bytes: int) -> int:
    """Bytes per element of ring attention's dK/dV accumulators for q, k, v of ``elem_bytes``:
    it computes and sums its blocks in fp32 (16-bit inputs are cast up where a block is used,
    `context_parallel._RingAttention`), while K and V circulate in their own dtype."""
    return max(elem_bytes, 4)


def cp_moe_layer_calls(cp: int, segments: int, batch: int, num_experts: int, top_k: int, dropless: bool,
                       recompute: str = "none") -> list[Call]:
    """One MoE layer, one micro-batch, on a cp rank of ``batch`` sequences cut into
    ``segments`` segments over the cp ranks (`fivefold.rules.layout.sequence_segments`).

    The auxiliary loss's per-sequence statistics, (batch, 2E + 2) fp32 values, are summed
    over the ranks holding the sequence; without dropless routing each rank also sums the
    tokens per sequence (one fp32 value, the capacity's base) and gathers every segment's
    slot counts per sequence, choice rank and expert (int64) to give the slots their
    capacity priority.
    Each forward pass of the layer does all of it (the loss after the combine saves tensors,
    so recomputation runs through it); the backward sends nothing (the statistics' gradient
    is the identity, the counts have none).
    """
    if cp == 1:
        return []
    f = forward_passes(recompute)
    out = [Call("all_reduce", batch * (2 * num_experts + 2) * 4, f, "fwd", "MoE per-sequence statistics")]
    if not dropless:
        out.append(Call("all_reduce", 4, f, "fwd", "MoE tokens per sequence"))
        out.append(Call("all_gather", segments * batch * top_k * num_experts * 8, f, "fwd", "MoE slot counts"))
    return out


def analytic_cp_bytes(algorithm: str, cp: int, batch: int, local_len: int, heads: int, kv_heads: int,
                      head_dim: int, elem_bytes: int = 4) -> int:
    """Bytes one rank puts on the cp axis for one attention layer, forward plus backward."""
    calls = cp_layer_calls(algorithm, cp, batch, local_len, heads, kv_heads, head_dim, elem_bytes)
    return sum(total_wire_bytes(calls, cp).values())


# ----------------------------------------------------------------------------- expert parallel


def ep_layer_calls(routed_elems: int, eb: ElementBytes, num_experts: int, forward_passes: int = 1,
                   count_bytes: int = 8, fp8_bytes: int = 0) -> list[Call]:
    """One MoE layer, one micro-batch, balanced routing: dispatch and combine all-to-alls of
    the rank's routed token copies (``routed_elems`` elements) in each forward pass and once
    backward; each dispatch first exchanges the slots per expert (``num_experts`` int64 counts).
    The dispatch carries the norm's output (`eb.residual`), the combine the experts' (`eb.compute`);
    their gradients travel back in the same dtypes.

    A recomputed forward (`forward_passes`) exchanges all three again: the combine's output
    is saved by the weighting of the expert outputs that follows it, so torch's checkpoint
    does not stop before it.

    With FP8 GEMMs (``fp8_bytes``, `fivefold.rules.fp8`) the dispatch and the combine's gradient
    carry the experts' FP8 inputs instead; the combine and the dispatch's gradient do not."""
    dispatch, combine = routed_elems * eb.residual, routed_elems * eb.compute
    to_experts = routed_elems * fp8_bytes if fp8_bytes else None
    return [Call("all_to_all", num_experts * count_bytes, forward_passes, "fwd", "slots per expert"),
            Call("all_to_all", to_experts or dispatch, forward_passes, "fwd", "dispatch"),
            Call("all_to_all", combine, forward_passes, "fwd", "combine"),
            Call("all_to_all", to_experts or combine, 1, "bwd", "combine grad"),
            Call("all_to_all", dispatch, 1, "bwd", "dispatch grad")]


def all_to_all_wire_bytes(sent: torch.Tensor, rank: int, hidden: int, eb: ElementBytes, calls: int,
                          count_bytes: int = 8, forward_passes: int = 1) -> int:
    """All-to-all bytes one ep rank puts on the wire, forward and backward, for actual routing:
    `ep_layer_calls` with the routed rows counted rather than assumed balanced.

    sent (ep, E) tensor: slots each ep rank sent to each global expert (summed over calls).
    Forward dispatch sends this rank's rows for other ranks' experts and combine returns the
    rows it received from others, in each of the ``forward_passes``; backward sends both
    again in reverse (the combine's gradient back to the experts' ranks, the dispatch's to
    the tokens' ranks). Each of the ``calls`` dispatches also exchanges its E/ep counts with
    the ep - 1 other ranks in every forward pass.
    """
    ep, E = sent.shape
    local = E // ep
    mine = slice(rank * local, (rank + 1) * local)
    sent_to_others = int(sent[rank].sum() - sent[rank, mine].sum())
    received_from_others = int(sent[:, mine].sum() - sent[rank, mine].sum())
    dispatched = forward_passes * sent_to_others + received_from_others  # rows of the norm's output, out and back
    combined = forward_passes * received_from_others + sent_to_others  # rows of the experts' output
    tokens = (dispatched * eb.residual + combined * eb.compute) * hidden
    return tokens + forward_passes * calls * (ep - 1) * local * count_bytes


# ----------------------------------------------------------------------------- pipeline


def pp_calls(act_bytes: int, forward_sends: int, backward_sends: int) -> list[Call]:
    """Point-to-point sends of a pipeline rank: each activation forward, each gradient back."""
    return [Call("send", act_bytes, forward_sends, "fwd", "activations"),
            Call("send", act_bytes, backward_sends, "bwd", "activation grads")]


# ----------------------------------------------------------------------------- data parallel


def reduces_once_per_step(zero: int, pp: int) -> bool:
    """Whether ZeRO keeps a step's full local gradients and reduce-scatters them once, after the
    last micro-batch: stage 1 always, and stage 3 inside a pipeline, whose micro-batches'
    backwards interleave with other micro-batches' forwards (as torch's pipeline schedules run
    FSDP: gradient sync only for the last micro-batch); stages 2 and 3 otherwise reduce every
    backward."""
    return zero == 1 or (zero == 3 and pp > 1)


ZERO3_GATHERS = ("micro_batch", "step")  # layout.zero3_gather: when ZeRO-3 gathers a unit's parameters


def zero3_gathers_once_per_step(gather: str) -> bool:
    """Whether ZeRO-3 gathers each unit once per step and keeps it gathered across the step's
    micro-batches ("step": one all-gather per unit, the whole chunk's parameters held through
    the step) rather than around each micro-batch's forward and backward ("micro_batch")."""
    if gather not in ZERO3_GATHERS:
        raise ValueError(f"zero3_gather='{gather}' is unknown; use one of {', '.join(ZERO3_GATHERS)}")
    return gather == "step"


def zero3_keeps_ends_gathered(pp: int) -> bool:
    """Whether ZeRO-3 keeps a chunk's root and last block gathered from their forward to their
    backward: only without a pipeline, where that backward follows at once. In a pipeline other
    micro-batches' forwards run in between, so every forward and backward gathers its units."""
    return pp == 1


def zero_reduction(zero: int, grad_bytes: float, micro_batches: int, finalized_bytes: float = 0.0,
                   pp: int = 1) -> list[Call]:
    """ZeRO's gradient reduce-scatters of one step (stages 1-3), and what ZeRO-2/3 hold full.

    Stage 1 (and stage 3 in a pipeline, `reduces_once_per_step`) reduces once per step. Stages 2-3 reduce-scatter each backward's gradients as they
    complete and keep only their shard, but for the ``finalized_bytes`` of gradients that
    gradient finalizers complete (sums over tp, `tp_finalized_elements`; the tied embedding's
    sum over the pipeline ends): those parameters sit in buckets of their own that keep their
    full local gradients until the finalizers have run at the end of the step, then are
    reduced once (parallel/zero.py). `held_full_grad_bytes` says what a rank holds full.
    """
    if zero == 1:
        return [Call("reduce_scatter", grad_bytes, 1, "bwd", "grads")]
    if reduces_once_per_step(zero, pp):
        micro_batches = 1
    out = [Call("reduce_scatter", grad_bytes - finalized_bytes, micro_batches, "bwd", "grads")]
    if finalized_bytes:
        out.append(Call("reduce_scatter", finalized_bytes, 1, "bwd", "grads after their finalizers"))
    return [c for c in out if c.nbytes]


def held_full_grad_bytes(zero: int, grad_bytes: float, finalized_bytes: float, pp: int = 1) -> float:
    """Gradient bytes a ZeRO rank holds unsharded at the end of the backward (`zero_reduction`):
    all of them at stages 0-1 and at stage 3 in a pipeline, the finalized ones at stages 2-3."""
    return grad_bytes if zero == 0 or reduces_once_per_step(zero, pp) else finalized_bytes


def dp_step_calls(zero: int, grad_bytes: float, param_bytes: float, micro_batches: int,
                  gathers_per_micro_batch: int = 2, kept_bytes: float = 0.0,
                  finalized_bytes: float = 0.0, pp: int = 1, gather: str = "micro_batch") -> list[Call]:
    """Data-parallel (ZeRO) collectives of one step for a rank's gradients / parameters.

    ZeRO-0: one all-reduce of the gradients per step. ZeRO-1: reduce-scatter of the gradients
    and all-gather of the updated parameters, once per step. ZeRO-2: the gradient
    reduce-scatter runs after every micro-batch (gradients stay sharded), the all-gather once.
    ZeRO-3: all-gather of the parameters for each micro-batch's forward and backward (and
    recomputation), a gradient reduce-scatter per micro-batch. `kept_bytes` of the parameters
    stay gathered from the forward to the backward (zero.py keeps the chunk's root, i.e.
    embedding, final norm and head, and its last block): the later gathers leave them out.
    ``finalized_bytes`` of the gradients are reduced once per step (`zero_reduction`).
    With ``gather="step"`` (`zero3_gathers_once_per_step`) every parameter is gathered once.
    """
    if zero == 0:
        return [Call("all_reduce", grad_bytes, 1, "bwd", "grads")]
    reduce = zero_reduction(zero, grad_bytes, micro_batches, finalized_bytes, pp)
    if zero in (1, 2):
        return [*reduce, Call("all_gather", param_bytes, 1, "step", "updated params")]
    if zero3_gathers_once_per_step(gather):
        return [Call("all_gather", param_bytes, 1, "fwd", "params, kept through the step"), *reduce]
    if not kept_bytes:
        return [Call("all_gather", param_bytes, gathers_per_micro_batch * micro_batches, "fwd", "params"), *reduce]
    return [Call("all_gather", param_bytes, micro_batches, "fwd", "params"),
            Call("all_gather", param_bytes - kept_bytes, (gathers_per_micro_batch - 1) * micro_batches, "bwd",
                 "params not kept from the forward"),
            *reduce]


def replica_calls(shard_grad_bytes: float) -> list[Call]:
    """Hybrid sharding: the all-reduce of each gradient shard over the replicas of its shard
    group, once per step after the last micro-batch (zero.py `_sum_over_replicas`)."""
    return [Call("all_reduce", shard_grad_bytes, 1, "step", "grad shards over replicas")]


def dp_comm_bytes_per_step(elements: int, n: int, stage: int, micro_batches: int = 1,
                           policy: PrecisionPolicy | None = None, kept_elements: int = 0) -> int:
    """Ring bytes one rank sends on the data-parallel axis in one optimizer step for `elements`
    gradient/parameter elements (padding to a multiple of n included): gradients travel in the
    policy's reduction dtype, parameters in their own (fp32 for both without a policy).
    `kept_elements`: ZeRO-3 parameters kept gathered from the forward to the backward."""
    grad_bytes = elements * (policy.reduce_bytes if policy else 4)
    param_bytes = elements * (policy.param_bytes if policy else 4)
    kept_bytes = kept_elements * (policy.param_bytes if policy else 4)
    calls = dp_step_calls(stage, grad_bytes, param_bytes, micro_batches, kept_bytes=kept_bytes)
    return int(sum(total_wire_bytes(calls, n).values()))