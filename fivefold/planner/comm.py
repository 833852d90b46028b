"""Communication per device and step: every collective a layout issues, with ring volumes.

Per-device bytes sent by the ring (bandwidth-optimal) algorithms on n ranks, for a buffer
of S bytes (Thakur, Rabenseifner and Gropp 2005; the bus-bandwidth factors of nccl-tests):
all-reduce 2(n - 1)/n S; all-gather and reduce-scatter (n - 1)/n S with S the full
(gathered or reduced) buffer; all-to-all (n - 1)/n S of the local buffer; a point-to-point
send S. Time of one call: latency x ring steps + volume / bandwidth, with the intra-node
bandwidth when the whole group sits on one node under fivefold's rank order (tp fastest,
then cp, dp, pp: a group of size n and stride r spans n r consecutive ranks) and the
inter-node bandwidth otherwise.

What each axis issues (b sequences per micro-batch, s/c tokens per context rank, h
hidden, X = b s h / c activation elements of the dtype, m micro-batches):

* tp, per layer and micro-batch: 2 all-reduces of X forward and 2 backward (attention
  output and MLP output, and their conjugates; Shoeybi et al. 2019). With sequence
  parallelism 2 all-gathers + 2 reduce-scatters of X forward, 2 reduce-scatters + 2
  all-gathers backward (the same volume, Korthikanti et al. 2022, Section 4.2.2); fivefold
  keeps the gathered inputs for the weight gradients instead of re-gathering them. Per
  step, gradients that are partial over tp are summed with one all-reduce: norm weights
  under SP, MoE routers, and key/value projections shared by tp/kv ranks when tp > kv
  heads. Vocab-parallel embedding: one all-reduce forward (SP: reduce-scatter forward,
  all-gather backward); head: all-reduce of its input gradient (SP: all-gather forward,
  reduce-scatter backward);
  vocab-parallel cross-entropy: 3 all-reduces of b s/c fp32 values (max, sum, target).
* cp, per layer and micro-batch, K and V of b (s/c) (kv/t) d elements each:
  all-gather variant: all-gather K and V forward, reduce-scatter dK and dV backward;
  ring: (c - 1) sends of the K and of the V block forward, and backward (c - 1) sends each
  of K, V (circulated again rather than stored) and c of the dK, dV accumulators (which
  end at their owner);
  Ulysses: all-to-alls of q, k, v, out forward and of d_out, dq, dk, dv backward.
* ep, per MoE layer and micro-batch: dispatch and combine all-to-alls of the b (s/c) k
  routed token copies (k h elements each) forward and again backward.
* pp, per micro-batch and model chunk: a send of the chunk's output activation
  (b s h / c, divided by t with SP) forward, and of its input gradient backward; with
  tied embeddings and pp > 1 one all-reduce of the word-embedding gradient between the
  first and last stage.
* dp, over dp x cp ranks for non-expert and dp x cp / ep for expert parameters, Psi the
  bytes of the rank's gradients (in the policy's reduction dtype) or parameters (in the
  parameters' dtype; fivefold.precision): ZeRO-0 one all-reduce per step
  (2(N - 1)/N Psi); ZeRO-1 reduce-scatter of gradients + all-gather of updated
  parameters per step (same total); ZeRO-2 as ZeRO-1 but the gradient reduce-scatter
  runs every micro-batch (gradients are kept sharded); ZeRO-3 all-gathers parameters
  for each micro-batch's forward and backward (and recomputation) and reduce-scatters
  its gradients: 3(N - 1)/N Psi per micro-batch.

Full recomputation repeats each forward collective inside the recomputed layers.
"""

from __future__ import annotations

from typing import NamedTuple

from .hardware import Hardware
from .spec import LayoutSpec, ModelSpec

AXES = ("dp", "tp", "pp", "cp", "ep")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


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

    @property
    def factor(self) -> float:
        return ring_factor(self.kind, self.group)

    @property
    def volume(self) -> float:
        """Bytes this device sends per step."""
        return self.calls * self.factor * self.nbytes

    def time(self, hw: Hardware) -> float:
        if self.calls == 0 or (self.group <= 1 and self.kind != "send"):
            return 0.0
        intra = self.span <= hw.gpus_per_node
        bw = (hw.intra_node_bw if intra else hw.inter_node_bw) * hw.link_efficiency
        lat = hw.intra_latency_s if intra else hw.inter_latency_s
        return self.calls * (lat * ring_steps(self.kind, self.group) + self.factor * self.nbytes / bw)


def ring_factor(kind: str, n: int) -> float:
    if kind == "send":
        return 1.0
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def ring_steps(kind: str, n: int) -> int:
    if kind == "send":
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def _act_elems(m: ModelSpec, lay: LayoutSpec) -> int:
    """X: elements of one full-width activation of a micro-batch on a context rank."""
    return lay.micro_batch * m.seq_len // lay.cp * m.hidden


def tp_layers(m: ModelSpec, lay: LayoutSpec, ab: int, layer_mbs: float) -> list[Collective]:
    """Tensor-parallel collectives of ``layer_mbs`` (layers x micro-batches) layer passes."""
    t = lay.tp
    if t == 1 or layer_mbs == 0:
        return []
    x = _act_elems(m, lay) * ab
    rec = 2 if lay.recompute == "full" else 1
    c = lambda kind, n, phase, what: Collective("tp", kind, x, t, n * layer_mbs, t, phase, what)  # noqa: E731
    if not lay.sequence_parallel:
        return [c("all_reduce", 2 * rec, "fwd", "attention/MLP output"),
                c("all_reduce", 2, "bwd", "attention/MLP input grad")]
    return [c("all_gather", 2 * rec, "fwd", "norm output to attention/MLP"),
            c("reduce_scatter", 2 * rec, "fwd", "attention/MLP output"),
            c("reduce_scatter", 2, "bwd", "attention/MLP input grad"),
            c("all_gather", 2, "bwd", "output grad")]


def tp_ends(m: ModelSpec, lay: LayoutSpec, ab: int, first: bool, last: bool, mbs: float) -> list[Collective]:
    """Vocab-parallel embedding (first stage), head and cross-entropy (last stage)."""
    t = lay.tp
    if t == 1:
        return []
    x = _act_elems(m, lay) * ab
    c = lambda kind, nb, n, phase, what: Collective("tp", kind, nb, t, n * mbs, t, phase, what)  # noqa: E731
    out: list[Collective] = []
    sp = lay.sequence_parallel
    if first:
        out += ([c("reduce_scatter", x, 1, "fwd", "embedding"), c("all_gather", x, 1, "bwd", "embedding grad")]
                if sp else [c("all_reduce", x, 1, "fwd", "embedding")])
    if last:
        out += ([c("all_gather", x, 1, "fwd", "head input"), c("reduce_scatter", x, 1, "bwd", "head input grad")]
                if sp else [c("all_reduce", x, 1, "bwd", "head input grad")])
        rows = lay.micro_batch * m.seq_len // lay.cp
        out.append(c("all_reduce", rows * 4, 3, "fwd", "cross-entropy max/sum/target"))
    return out


def tp_grad_sums(m: ModelSpec, lay: LayoutSpec, grad_b: int, n_layers: int, n_moe: int, last: bool) -> list[Collective]:
    """Per-step all-reduces over tp of gradients that are partial on each tp rank."""
    t = lay.tp
    if t == 1 or n_layers == 0:
        return []
    elems = m.num_experts * m.hidden * n_moe  # routers: each rank saw its slice of the experts
    if lay.sequence_parallel:  # norms: each rank saw its slice of the tokens
        elems += m.hidden * (2 * n_layers + (1 if last else 0))
    out = [Collective("tp", "all_reduce", elems * grad_b, t, 1, t, "step", "partial gradients")] if elems else []
    kv = m.n_kv_heads
    if t > kv:  # each kv head is held by t/kv ranks: one (kv, n) buffer summed over tp
        per_rank = 2 * m.head_dim * m.hidden * n_layers
        out.append(Collective("tp", "all_reduce", kv * per_rank * grad_b, t, 1, t, "step", "shared kv heads"))
    return out


def cp_layers(m: ModelSpec, lay: LayoutSpec, ab: int, layer_mbs: float) -> list[Collective]:
    """Context-parallel collectives of ``layer_mbs`` layer passes."""
    cp = lay.cp
    if cp == 1 or layer_mbs == 0:
        return []
    rows = lay.micro_batch * m.seq_len // cp
    kv = rows * (m.n_kv_heads // lay.tp) * m.head_dim * ab
    q = rows * (m.heads // lay.tp) * m.head_dim * ab
    rec = 2 if lay.recompute == "full" else 1
    span = lay.tp * cp
    c = lambda kind, nb, n, phase, what: Collective("cp", kind, nb, cp, n * layer_mbs, span, phase, what)  # noqa: E731
    if lay.cp_kind == "allgather":
        return [c("all_gather", kv * cp, 2 * rec, "fwd", "K, V"),
                c("reduce_scatter", kv * cp, 2, "bwd", "dK, dV")]
    if lay.cp_kind == "ring":
        return [c("send", kv, 2 * (cp - 1) * rec, "fwd", "K, V blocks"),
                c("send", kv, 2 * (cp - 1), "bwd", "K, V blocks again"),
                c("send", kv, 2 * cp, "bwd", "dK, dV accumulators, home after cp hops")]
    return [c("all_to_all", q, 2 * rec, "fwd", "q, out"), c("all_to_all", kv, 2 * rec, "fwd", "k, v"),
            c("all_to_all", q, 2, "bwd", "d_out, dq"), c("all_to_all", kv, 2, "bwd", "dk, dv")]


def ep_layers(m: ModelSpec, lay: LayoutSpec, ab: int, moe_layer_mbs: float) -> list[Collective]:
    """Expert-parallel dispatch/combine all-to-alls of ``moe_layer_mbs`` MoE layer passes."""
    ep = lay.ep
    if ep == 1 or moe_layer_mbs == 0:
        return []
    nb = _act_elems(m, lay) * m.top_k * ab
    rec = 2 if lay.recompute == "full" else 1
    c = lambda n, phase, what: Collective("ep", "all_to_all", nb, ep, n * moe_layer_mbs, lay.tp * ep, phase, what)  # noqa: E731
    return [c(2 * rec, "fwd", "dispatch + combine"), c(2, "bwd", "dispatch + combine grads")]


def pp_sends(m: ModelSpec, lay: LayoutSpec, ab: int, stage: int, tied_vocab_bytes: float) -> list[Collective]:
    """Point-to-point activation/gradient sends of one pipeline device per step."""
    p, v, mbs = lay.pp, lay.vpp, lay.num_micro_batches
    if p == 1:
        return []
    chunks = [stage + k * p for k in range(v)]
    last = p * v - 1
    fwd = sum(j < last for j in chunks)
    bwd = sum(j > 0 for j in chunks)
    nb = _act_elems(m, lay) * ab / (lay.tp if lay.sequence_parallel else 1)
    span = 2 * lay.tp * lay.cp * lay.dp
    out = [Collective("pp", "send", nb, 2, fwd * mbs, span, "fwd", "activations"),
           Collective("pp", "send", nb, 2, bwd * mbs, span, "bwd", "activation grads")]
    if tied_vocab_bytes and stage in (0, p - 1):
        out.append(Collective("pp", "all_reduce", tied_vocab_bytes, 2, 1, lay.world, "step", "tied embedding grad"))
    return out


def dp_grads(lay: LayoutSpec, param_b: int, grad_b: int, dense: float, expert: float,
             ranks_dense: int, ranks_expert: int) -> list[Collective]:
    """Data-parallel (ZeRO) collectives for ``dense`` and ``expert`` parameters held here.

    ``param_b``: bytes per parameter gathered (ZeRO-1/2/3); ``grad_b``: per gradient element
    reduced (the precision policy's reduction dtype).
    """
    mbs = lay.num_micro_batches
    out: list[Collective] = []
    for what, psi, n, span in (("non-expert", dense, ranks_dense, lay.tp * lay.cp * lay.dp),
                               ("expert", expert, ranks_expert, lay.tp * lay.cp * lay.dp)):
        if n <= 1 or psi == 0:
            continue
        g, p = psi * grad_b, psi * param_b
        c = lambda kind, nb, calls, phase, w: Collective("dp", kind, nb, n, calls, span, phase, f"{what} {w}")  # noqa: E731
        if lay.zero == 0:
            out.append(c("all_reduce", g, 1, "bwd", "grads"))
        elif lay.zero in (1, 2):
            out += [c("reduce_scatter", g, 1 if lay.zero == 1 else mbs, "bwd", "grads"),
                    c("all_gather", p, 1, "step", "updated params")]
        else:
            gathers = 3 if lay.recompute == "full" else 2
            out += [c("all_gather", p, gathers * mbs, "fwd", "params"),
                    c("reduce_scatter", g, mbs, "bwd", "grads")]
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
