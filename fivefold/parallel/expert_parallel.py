"""Expert parallelism: the experts of every MoE layer are sharded over the `ep` group.

The rest of the model stays replicated. Each rank routes its own tokens (different dp rows
or cp segments) exactly as the single-process model does and orders the kept token-slots by
global expert (model/moe.py; experts of ep rank r are the contiguous block
[r * E/ep, (r+1) * E/ep), so this also groups them by destination rank). The MoE's
`dispatcher` is swapped for `ExpertParallelDispatcher`, which

1. exchanges the per-expert counts with an all-to-all, so every rank knows its receive splits;
2. sends the token rows with an all-to-all of uneven splits;
3. regroups the received rows by local expert and runs the experts (`Experts.kernel`);
4. restores the (source, expert) order and sends the results back with the reverse all-to-all.

It returns the kept slots' outputs in dispatch order, as the single-device dispatcher does; the
MoE weights them by their router probabilities and adds them to their tokens
(`combine_slots`). Backward runs through the same pairs (`comm.all_to_all_autograd`, index
ops). Routing, capacity and dropped tokens are decided before dispatch from this rank's tokens
only, so they are identical to the single-process model's (per-sequence capacity, see
model/moe.py).

Gradients: expert weights are `replicated_over` ("edp",) (and "tp" when not tp-split), so the
data-parallel optimizer sums their gradients over expert-data-parallel ranks (and ZeRO shards
their state there); every other parameter keeps its dp x cp placement.

Tensor parallel (runs first in parallelize.py) splits each expert's ffn dimension (a Split on
dim 1 of gate/up, dim 2 of down) and wraps the whole MoE block as one tp region: inside it
every tp rank holds the same whole tokens (gathered first under sequence parallel) and the
block's output, partial over the ffn shards, is reduced on exit. The EP split on dim 0 is
added after the tp split (`Placement.splits` = (tp split, ep split)), and the dispatcher needs
no tp communication of its own: each tp rank exchanges its tokens with the ranks of its own ep
group, which share its tp coordinate.
The dispatcher also works with ep = 1, so the same code path serves TP-only MoE layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from ..config import Config
from .mesh import Axis, Mesh
from ..model.llama import Transformer
from ..model.moe import scatter_rows, sort_slots_by_expert
from . import comm
from .protocols import ParamFinalizer
from .sharding import Placement, Split, get_placement, set_placement

# ----------------------------------------------------------------------------- pure index functions


def rank_splits(counts: list[int], ep: int) -> list[int]:
    """Rows sent to each ep rank, from the slots per global expert counts (E,), read to the host."""
    local = len(counts) // ep
    return [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]


@dataclass(frozen=True)
class DispatchSizes:
    """The data-dependent sizes of one dispatch on the host, from a single read of the device.

    The all-to-all splits and the experts' group sizes depend on the routing, so the host
    must know them; reading them together costs one sync per MoE layer per forward instead
    of one per size.
    """

    send: list[int]  # rows to each ep rank
    recv: list[int]  # rows from each ep rank
    received: list[list[int]]  # (ep, E_local) rows from each source for each local expert

    @classmethod
    def read(cls, counts: torch.Tensor, recv_counts: torch.Tensor) -> "DispatchSizes":
        """counts (E,) this rank sends per global expert, recv_counts (ep, E_local) it receives."""
        sent, received = torch.stack([counts.view_as(recv_counts), recv_counts]).tolist()  # the one read
        ep = len(sent)
        return cls(rank_splits(sum(sent, []), ep), rank_splits(sum(received, []), ep), received)


def dispatch_order(
    expert_ids: torch.Tensor, keep: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept slots ordered by global expert, stable (ties keep slot order), and counts (E,).

    expert_ids, keep: (S,) flattened slots. Because each rank holds a contiguous block of
    experts, this order also groups the slots by destination rank.
    """
    return sort_slots_by_expert(expert_ids, keep, num_experts)


def regroup_by_local_expert(recv_counts: torch.Tensor, received: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Permutation that turns received rows from (source rank, local expert) order into
    (local expert, source rank) order, and the rows per local expert.

    recv_counts (ep, E_local): rows from each source for each local expert, on the device;
    `received`: the same counts on the host (the sizes need no second read). Stable, so the
    rows of one (expert, source) pair keep the order their source sent them in.
    """
    ep, local = recv_counts.shape
    total = sum(map(sum, received))
    expert_of_row = torch.arange(local, device=recv_counts.device).repeat(ep)  # (ep * E_local,)
    # output_size: the length is known on the host, so CUDA need not read it back
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts.reshape(-1), output_size=total)  # (R,)
    order = torch.argsort(expert_of_row, stable=True)
    return order, [sum(column) for column in zip(*received)]


def unpermute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo a gather by `order` (a permutation): out[order[i]] = rows[i], so that
    unpermute(values.index_select(0, order), order) == values. One scatter, no inverse index."""
    return scatter_rows(rows, order, rows.shape[0])


# ----------------------------------------------------------------------------- the dispatcher


class ExpertParallelDispatcher(nn.Module):
    """All-to-all dispatch/combine around this rank's experts (see the module docstring).

    `sent_counts` (E,) accumulates the slots this rank sent to each global expert and `calls`
    the dispatches since the last `reset_counters()`: the routing behind the all-to-all bytes.
    A recomputed forward (full recomputation) dispatches again without counting: its bytes
    are `volumes.all_to_all_wire_bytes` with two forward passes.
    """

    def __init__(self, ep: Axis, num_experts: int) -> None:
        super().__init__()
        self.ep, self.num_experts = ep, num_experts
        self.sent_counts = torch.zeros(num_experts, dtype=torch.int64)
        self.calls = 0
        self.counting = True  # False while a recomputed forward dispatches again (model.moe.routing_uncounted)

    def reset_counters(self) -> None:
        self.sent_counts = torch.zeros_like(self.sent_counts)
        self.calls = 0

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """rows (S_kept, h) of the kept slots, grouped by global expert, counts (E,) rows each.
        Returns the experts' outputs for those rows, in the same order."""
        if self.counting:
            with torch.no_grad():  # summed on the device: read when the statistics are
                self.sent_counts = self.sent_counts.to(counts.device)
                self.sent_counts += counts
                self.calls += 1
        return self._exchange_and_compute(rows, counts, experts)

    def _exchange_and_compute(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Rows (S_kept, h) ordered by global expert -> expert outputs, in the same order."""
        ep = self.ep.size
        local = self.num_experts // ep
        recv_counts = comm.all_to_all(counts.contiguous(), self.ep).view(ep, local)  # (source, local expert)
        sizes = DispatchSizes.read(counts, recv_counts)
        received = comm.all_to_all_autograd(rows, self.ep, sizes.send, sizes.recv)  # (R, h)
        order, expert_counts = regroup_by_local_expert(recv_counts, sizes.received)
        grouped = received.index_select(0, order)
        out = experts(grouped, expert_counts)  # (R, h), partial over the ffn shards when tp-split
        out = unpermute(out, order)  # back to (source, expert) order
        return comm.all_to_all_autograd(out, self.ep, sizes.recv, sizes.send)


# ----------------------------------------------------------------------------- applying it


def _shard_expert_weight(owner: nn.Module, attr: str, name: str, mesh: Mesh) -> Placement:
    """Keep this ep rank's block of experts (dim 0) of an (already tp-sliced) meta parameter."""
    param = getattr(owner, attr)
    old = get_placement(param, name)
    ep = mesh.ep
    over = tuple(a for a in old.replicated_over if a != "dp_cp")
    placement = dataclasses.replace(
        old.with_split(Split(dim=0, index=ep.rank, count=ep.size)), replicated_over=("edp",) + over
    )
    local_shape = (param.shape[0] // ep.size,) + tuple(param.shape[1:])
    new = nn.Parameter(torch.empty(local_shape, device=param.device, dtype=param.dtype), param.requires_grad)
    set_placement(new, placement)
    setattr(owner, attr, new)
    return placement


def apply_expert_parallel(chunk: Transformer, mesh: Mesh, config: Config) -> list[ParamFinalizer]:
    """Shard every MoE layer's experts over mesh.ep and swap in the all-to-all dispatcher.

    Runs on the meta-device model, after tensor parallel and before materialisation. Expert
    gradients need no finalizer: the data-parallel optimizer sums them over "edp".
    """
    if config.model.num_experts % mesh.ep.size:
        raise ValueError(f"{config.model.num_experts} experts do not split over ep={mesh.ep.size}")
    for layer, moe in chunk.moe_layers().items():
        prefix = f"layers.{layer}.mlp.experts."
        for attr in ("gate", "up", "down"):
            _shard_expert_weight(moe.experts, attr, prefix + attr, mesh)
        moe.dispatcher = ExpertParallelDispatcher(mesh.ep, moe.num_experts)
    return []


def moe_dispatchers(chunks: Sequence[Transformer]) -> dict[str, ExpertParallelDispatcher]:
    """The expert-parallel dispatchers of the MoE layers in `chunks`, by layer name."""
    out = {}
    for chunk in chunks:
        for name, moe in chunk.moe_layers().items():
            if isinstance(moe.dispatcher, ExpertParallelDispatcher):
                out[name] = moe.dispatcher
    return out


__all__ = [
    "DispatchSizes", "ExpertParallelDispatcher", "apply_expert_parallel",
    "dispatch_order", "moe_dispatchers", "rank_splits",
    "regroup_by_local_expert", "unpermute",
]
