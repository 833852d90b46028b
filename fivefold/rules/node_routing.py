"""Node-limited expert routing and what an expert all-to-all sends inside and between nodes.

An expert-parallel group of ``ep`` ranks, tp apart (fivefold's rank order), covers
``nodes = ceil(ep * tp / gpus_per_node)`` nodes with ``g = ep / nodes`` of its ranks on each.
With balanced routing each of a token's ``top_k`` copies goes to any rank of the group alike.

* Plain all-to-all (``route_nodes = 0``): every copy travels once, straight to its expert's
  rank: (g - 1) / ep of the copies over NVLink, (nodes - 1) / nodes over the network.
* Node-limited routing (DeepSeek-V3, arXiv 2412.19437 Section 2.1.2: each token's experts lie
  on at most M = ``route_nodes`` nodes) with its dispatch (Section 3.2.2): a token crosses the
  network once per remote target node, to the rank of the same in-node index, which forwards
  it over NVLink to the experts' ranks there. A token reaching min(M, top_k, nodes) nodes (the
  most it can), its own node among them with probability min(M, top_k, nodes) / nodes,
  sends min(M, top_k, nodes) (nodes - 1) / nodes copies over the network and (g - 1) / g of its
  top_k copies over NVLink. The combine returns the same way, reduced per node first.

Both links run at once (Section 3.2.2: "IB and NVLink communications are fully overlapped"),
so an all-to-all takes the longer of the two transfers.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class RoutingError(ValueError):
    """A routing option that cannot be used; the message says what to change."""


class LinkShares(NamedTuple):
    """Bytes sent over NVLink and over the network per byte of a rank's routed token copies."""

    intra: float
    inter: float


def ep_nodes(ep: int, tp: int, gpus_per_node: int) -> int:
    """Nodes one expert-parallel group spans."""
    return max(1, math.ceil(ep * tp / gpus_per_node))


def check_route_nodes(route_nodes: int, ep: int, tp: int, gpus_per_node: int) -> None:
    """Refuse node-limited routing to more nodes than the expert-parallel group spans."""
    nodes = ep_nodes(ep, tp, gpus_per_node)
    if route_nodes > nodes:
        raise RoutingError(
            f"route_nodes={route_nodes} exceeds the {nodes} node(s) an ep={ep} group spans "
            f"({gpus_per_node} GPUs per node, tp={tp}); use route_nodes <= {nodes}, or 0 to route freely, "
            f"or make ep span at least {route_nodes} nodes (ep >= {route_nodes * max(1, gpus_per_node // tp)})")


def link_shares(top_k: int, ep: int, tp: int, gpus_per_node: int, route_nodes: int = 0) -> LinkShares:
    """NVLink and network bytes per byte of routed copies (module docstring)."""
    nodes = ep_nodes(ep, tp, gpus_per_node)
    if nodes == 1:
        return LinkShares((ep - 1) / ep, 0.0)
    per_node = ep / nodes
    if route_nodes == 0:
        return LinkShares((per_node - 1) / ep, (nodes - 1) / nodes)
    reached = min(route_nodes, top_k, nodes)
    return LinkShares((per_node - 1) / per_node, reached * (nodes - 1) / nodes / top_k)
