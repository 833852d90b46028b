"""Communication per device and step: every collective a layout issues, timed.

Which collectives each axis issues and their buffers are defined once in `fivefold.rules.volumes`
(the strategy tests hold the runtime's counted bytes to the same functions); this module
places them on the hardware. Per-device bytes sent per call are the ring volumes of
`fivefold.rules.volumes.ring_factor`. Time of one call: latency x ring steps + volume /
bandwidth, with the intra-node bandwidth when the whole group sits on one node under
fivefold's rank order (tp fastest, then cp, dp, pp: a group of size n and stride r spans
n r consecutive ranks) and the inter-node bandwidth otherwise.

Sizes: b sequences per micro-batch, s/c tokens per context rank, h hidden, X = b s h / c
activation elements, each of the residual stream's dtype or of the compute dtype depending on
what the collective carries (`fivefold.rules.volumes.ElementBytes`: under bf16 autocast over fp32
weights the residual stream, and so the pipeline's sends, stays fp32); key/value heads per
tensor-parallel rank are kv/t, or one head repeated when t > kv
(`fivefold.rules.volumes.local_kv_heads`). Per axis:

* tp, per layer and micro-batch: `volumes.tp_layer_calls`; embedding, head and loss:
  `volumes.tp_end_calls`; once per step, gradients partial over tp: `volumes.tp_step_calls`.
* cp, per layer and micro-batch: `volumes.cp_layer_calls` (all-gather, ring or Ulysses);
  per MoE layer and micro-batch, the routing statistics: `volumes.cp_moe_layer_calls`.
* ep, per MoE layer and micro-batch: `volumes.ep_layer_calls` for the b (s/c) k routed
  token copies of h elements each, balanced routing assumed, and the slots per expert.
* pp, per micro-batch and model chunk: a send of the chunk's output activation (X, divided
  by t with SP) forward and of its input gradient backward; with tied embeddings and pp > 1
  one all-reduce of the word-embedding gradient between the first and last stage.
* dp, over dp x cp ranks for non-expert and dp x cp / ep for expert parameters:
  `volumes.dp_step_calls` for the bytes of the rank's gradients (in the precision
  policy's reduction dtype) and parameters (in their own dtype; `fivefold.rules.precision`).

Full recomputation repeats each forward collective inside the recomputed layers (tp, cp,
ep); selective recomputation repeats those of the attention core (cp). It adds no ZeRO-3
parameter gather: a block recomputes inside its own backward, after the gather that backward
already made. ZeRO-2/3 reduce the gradients that gradient finalizers complete once per step,
the others per micro-batch (`volumes.zero_reduction`).
"""

from __future__ import annotations

from typing import NamedTuple

from ..rules import volumes
from ..rules.layout import sequence_segments
from ..rules.precision import ElementBytes
from ..rules.fp8 import FP8_BYTES, is_fp8
from ..rules.node_routing import LinkShares, link_shares
from ..rules.volumes import Call, local_kv_heads, ring_factor, ring_steps
from .hardware import Hardware
from .spec import LayoutSpec, ModelSpec

AXES = ("dp", "tp", "pp", "cp", "ep")
KINDS = volumes.OPS


class Collective(NamedTuple):
    """``calls`` calls per step, each on a buffer of ``nbytes`` (see module docstring)."""

    axis: str
    kind: str
    nbytes: float
    group: int
    calls: float
    span: int
    phase: str  # "fwd", "bwd" or "step"
    what: str
    shares: LinkShares | None = None  # node-aware all-to-all: NVLink and network bytes per byte


    @property
    def factor(self) -> float:
        return ring_factor(self.kind, self.group)

    @property
    def volume(self) -> float:
        """Bytes this device sends per step."""
        if self.shares is not None:
            return self.calls * (self.shares.intra + self.shares.inter) * self.nbytes
        return self.calls * self.factor * self.nbytes

    def time(self, hw: Hardware) -> float:
        if self.calls == 0 or (self.group <= 1 and self.kind != "send"):
            return 0.0
        if self.shares is not None:  # both links at once (`rules.node_routing`)
            intra = self.shares.intra * self.nbytes / (hw.intra_node_bw * hw.link_efficiency)
            inter = self.shares.inter * self.nbytes / (hw.inter_node_bw * hw.link_efficiency)
            lat = hw.inter_latency_s if self.shares.inter else hw.intra_latency_s
            return self.calls * (lat * ring_steps(self.kind, self.group) + max(intra, inter))
        intra = self.span <= hw.gpus_per_node
        bw = (hw.intra_node_bw if intra else hw.inter_node_bw) * hw.link_efficiency
        lat = hw.intra_latency_s if intra else hw.inter_latency_s
        return self.calls * (lat * ring_steps(self.kind, self.group) + self.factor * self.nbytes / bw)


def _act_elems(m: ModelSpec, lay: LayoutSpec) -> int:
    """X: elements of one full-width activation of a micro-batch on a context rank."""
    return lay.micro_batch * m.seq_len // lay.cp * m.hidden


def _collectives(axis: str, calls: list[Call], group: int, span: int, times: float = 1) -> list[Collective]:
    return [Collective(axis, c.op, c.nbytes, group, c.calls * times, span, c.phase, c.what) for c in calls if c.calls]


def _forward_passes(lay: LayoutSpec) -> int:
    return volumes.forward_passes(lay.recompute)


def tp_layers(m: ModelSpec, lay: LayoutSpec, eb: ElementBytes, layer_mbs: float) -> list[Collective]:
    """Tensor-parallel collectives of ``layer_mbs`` (layers x micro-batches) layer passes."""
    if lay.tp == 1 or layer_mbs == 0:
        return []
    calls = volumes.tp_layer_calls(_act_elems(m, lay), eb, lay.sequence_parallel, _forward_passes(lay))
    return _collectives("tp", calls, lay.tp, lay.tp, layer_mbs)


def tp_ends(m: ModelSpec, lay: LayoutSpec, eb: ElementBytes, first: bool, last: bool, mbs: float) -> list[Collective]:
    """Vocab-parallel embedding (first stage), head and cross-entropy (last stage)."""
    if lay.tp == 1:
        return []
    rows = lay.micro_batch * m.seq_len // lay.cp
    calls = volumes.tp_end_calls(_act_elems(m, lay), eb, rows, lay.sequence_parallel, first, last)
    return _collectives("tp", calls, lay.tp, lay.tp, mbs)


def tp_grad_sums(m: ModelSpec, lay: LayoutSpec, grad_b: int, n_layers: int, n_moe: int, last: bool) -> list[Collective]:
    """Per-step all-reduces over tp of gradients that are partial on each tp rank."""
    calls = volumes.tp_step_calls(m.hidden, m.head_dim, m.n_kv_heads, lay.tp, m.num_experts, n_layers, n_moe,
                                  lay.sequence_parallel, last, grad_b)
    return _collectives("tp", calls, lay.tp, lay.tp)


def cp_layers(m: ModelSpec, lay: LayoutSpec, eb: ElementBytes, layer_mbs: float) -> list[Collective]:
    """Context-parallel collectives of ``layer_mbs`` layer passes."""
    cp = lay.cp
    if cp == 1 or layer_mbs == 0:
        return []
    calls = volumes.cp_layer_calls(lay.cp_kind, cp, lay.micro_batch, m.seq_len // cp, m.heads // lay.tp,
                                   local_kv_heads(m.n_kv_heads, lay.tp), m.head_dim, eb.compute, lay.recompute)
    return _collectives("cp", calls, cp, lay.tp * cp, layer_mbs)


def cp_moe_layers(m: ModelSpec, lay: LayoutSpec, moe_layer_mbs: float) -> list[Collective]:
    """Context-parallel sums of ``moe_layer_mbs`` MoE layer passes' routing statistics."""
    cp = lay.cp
    if cp == 1 or moe_layer_mbs == 0:
        return []
    calls = volumes.cp_moe_layer_calls(cp, sequence_segments(lay.cp_kind, cp), lay.micro_batch, m.num_experts,
                                       m.top_k, m.dropless, lay.recompute)
    return _collectives("cp", calls, cp, lay.tp * cp, moe_layer_mbs)


def ep_layers(m: ModelSpec, lay: LayoutSpec, eb: ElementBytes, moe_layer_mbs: float, gpus_per_node: int,
              precision: str = "bf16") -> list[Collective]:
    """Expert-parallel dispatch/combine all-to-alls of ``moe_layer_mbs`` MoE layer passes; the
    token copies split over NVLink and the network by `rules.node_routing.link_shares` (the
    model's node-limited routing), the expert-count exchanges as plain all-to-alls."""
    if lay.ep == 1 or moe_layer_mbs == 0:
        return []
    calls = volumes.ep_layer_calls(_act_elems(m, lay) * m.top_k, eb, m.num_experts, _forward_passes(lay),
                                   fp8_bytes=FP8_BYTES if is_fp8(precision) else 0)
    shares = link_shares(m.top_k, lay.ep, lay.tp, gpus_per_node, m.route_nodes)
    out = _collectives("ep", calls, lay.ep, lay.tp * lay.ep, moe_layer_mbs)
    return [c if c.what == "slots per expert" else c._replace(shares=shares) for c in out]


def pp_sends(m: ModelSpec, lay: LayoutSpec, eb: ElementBytes, stage: int, tied_vocab_bytes: float) -> list[Collective]:
    """Point-to-point activation/gradient sends of one pipeline device per step (the residual stream)."""
    p, v, mbs = lay.pp, lay.vpp, lay.num_micro_batches
    if p == 1:
        return []
    chunks = [stage + k * p for k in range(v)]
    last = p * v - 1
    fwd = sum(j < last for j in chunks)
    bwd = sum(j > 0 for j in chunks)
    nb = _act_elems(m, lay) * eb.residual // (lay.tp if lay.sequence_parallel else 1)
    out = _collectives("pp", volumes.pp_calls(nb, fwd, bwd), 2, 2 * lay.tp * lay.cp * lay.dp, mbs)
    if tied_vocab_bytes and stage in (0, p - 1):
        out.append(Collective("pp", "all_reduce", tied_vocab_bytes, 2, 1, lay.world, "step", "tied embedding grad"))
    return out


def dp_grads(lay: LayoutSpec, param_b: int, grad_b: int, dense: float, expert: float,
             kept: tuple[float, float] = (0.0, 0.0), finalized: float = 0.0) -> list[Collective]:
    """Data-parallel (ZeRO) collectives for ``dense`` and ``expert`` parameters held here.

    Under hybrid sharding ZeRO's collectives run inside the shard groups (neighbouring ranks)
    and each shard's gradient sum is all-reduced over its replicas once per step
    (`fivefold.rules.volumes.replica_calls`).

    ``param_b``: bytes per parameter gathered (ZeRO-1/2/3); ``grad_b``: per gradient element
    reduced (the precision policy's reduction dtype); ``kept``: the (non-expert, expert)
    parameters ZeRO-3 keeps gathered from the forward to the backward; ``finalized``: the
    non-expert parameters whose gradients finalizers complete (`fivefold.rules.volumes.zero_reduction`;
    no expert parameter has one).
    """
    out: list[Collective] = []
    groups = lay.zero_groups
    span = lay.tp * lay.cp * lay.dp
    shard_span = span // groups.dense_replicas  # a shard group's ranks lie next to each other
    gathers = 2  # forward and backward; full recomputation runs inside the backward's gather
    for what, psi, psi_kept, n, copies in (("non-expert", dense, kept[0], groups.dense_shard, groups.dense_replicas),
                                           ("expert", expert, kept[1], groups.expert_shard, groups.expert_replicas)):
        if n * copies <= 1 or psi == 0:
            continue
        finalized_bytes = finalized * grad_b if what == "non-expert" else 0.0
        if n > 1:
            calls = volumes.dp_step_calls(lay.zero, psi * grad_b, psi * param_b, lay.num_micro_batches, gathers,
                                          psi_kept * param_b, finalized_bytes, lay.pp, lay.zero3_gather)
            out += [c._replace(what=f"{what} {c.what}") for c in _collectives("dp", calls, n, shard_span)]
        if copies > 1 and lay.zero:
            calls = volumes.replica_calls(psi * grad_b / n)
            out += [c._replace(what=f"{what} {c.what}") for c in _collectives("dp", calls, copies, span)]
    return out


def volumes_by_axis(colls: list[Collective]) -> dict[str, float]:
    out = {a: 0.0 for a in AXES}
    for c in colls:
        out[c.axis] += c.volume
    return out


def volumes_by_kind(colls: list[Collective]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {a: {} for a in AXES}
    for c in colls:
        out[c.axis][c.kind] = out[c.axis].get(c.kind, 0.0) + c.volume
    return out
