"""Whether an order of point-to-point operations can deadlock under NCCL's rules.

gloo runs each send and receive on its own: one that waits for its peer holds up nothing
else. NCCL does not. Every `batch_isend_irecv` call is one group (ncclGroupStart/End), and
the groups a rank issues on a communicator run one after another, in issue order, on one
stream; a send larger than NCCL's internal buffering does not finish until the peer's
matching receive runs (a rendezvous). So a group can run only once every group this rank
issued before it has finished, and an operation finishes only once its counterpart's group
is running too.

`check_p2p_order` plays that out for the groups every rank recorded (comm.py records them
when `CommStats.recording_p2p` is on) and raises `P2PDeadlock` naming the first group that
can never finish. Every send is taken as a rendezvous unless it is at most `eager_bytes`
long: with `eager_bytes=0` (the default) an order that passes is safe for any message size,
since a buffered send only finishes earlier than a rendezvous one.

Messages from one rank to another match first-in first-out: the n-th send from a to b is
the n-th receive of b from a, whatever the groups they sit in.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class P2POp(NamedTuple):
    """One send or receive as a rank issued it; `peer` is the other end's global rank."""

    kind: Literal["send", "recv"]
    peer: int
    nbytes: int

    def __repr__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind}{arrow}{self.peer}({self.nbytes} B)"


P2PGroup = tuple[P2POp, ...]  # the operations of one batch_isend_irecv call


class OpRef(NamedTuple):
    """Where an operation sits: rank, index of its group in that rank's issue order, index in the group."""

    rank: int
    group: int
    op: int


class P2PDeadlock(RuntimeError):
    """A group that can never finish: it waits on an operation whose counterpart's group
    never runs. `rank`, `group` and `ops` name the first such group (lowest rank)."""

    def __init__(self, rank: int, group: int, ops: P2PGroup, waits_on: list[OpRef]) -> None:
        self.rank, self.group, self.ops, self.waits_on = rank, group, ops, waits_on
        blocked = ", ".join(f"rank {w.rank} group {w.group}" for w in waits_on)
        super().__init__(
            f"point-to-point order deadlocks when sends wait for their receives: rank {rank}'s group {group} "
            f"{list(ops)} never finishes; its counterparts sit in {blocked}, behind groups that wait on it"
        )


def match_operations(groups: dict[int, list[P2PGroup]]) -> dict[OpRef, OpRef]:
    """Pair every send with its receive, first-in first-out per (sender, receiver).

    Raises ValueError for a send or receive without a counterpart, or a pair whose sizes
    differ (the receive would read a message of another size)."""
    sends: dict[tuple[int, int], list[OpRef]] = {}
    recvs: dict[tuple[int, int], list[OpRef]] = {}
    for rank, rank_groups in groups.items():
        for g, group in enumerate(rank_groups):
            for i, op in enumerate(group):
                channel = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                (sends if op.kind == "send" else recvs).setdefault(channel, []).append(OpRef(rank, g, i))
    pairs: dict[OpRef, OpRef] = {}
    for channel in sorted(set(sends) | set(recvs)):
        out, into = sends.get(channel, []), recvs.get(channel, [])
        if len(out) != len(into):
            raise ValueError(f"rank {channel[0]} sends {len(out)} messages to rank {channel[1]}, "
                             f"which receives {len(into)}")
        for s, r in zip(out, into):
            sent, received = _op(groups, s), _op(groups, r)
            if sent.nbytes != received.nbytes:
                raise ValueError(f"rank {s.rank} group {s.group} sends {sent} but rank {r.rank} "
                                 f"group {r.group} receives it as {received}")
            pairs[s], pairs[r] = r, s
    return pairs


def _op(groups: dict[int, list[P2PGroup]], ref: OpRef) -> P2POp:
    return groups[ref.rank][ref.group][ref.op]


def check_p2p_order(groups: dict[int, list[P2PGroup]], eager_bytes: int = 0) -> None:
    """Raise `P2PDeadlock` if the recorded groups (per global rank, in issue order) cannot
    all finish under NCCL's rules; see the module docstring. Returns None when they can."""
    pairs = match_operations(groups)
    head = {rank: 0 for rank in groups}  # per rank: index of the group now running
    done: set[OpRef] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank in groups:
            while head[rank] < len(groups[rank]) and _finishes(groups, pairs, head, done, rank, eager_bytes):
                head[rank] += 1
                progressed = True
    for rank in sorted(groups):
        if head[rank] < len(groups[rank]):
            g = head[rank]
            waiting = [OpRef(rank, g, i) for i in range(len(groups[rank][g])) if OpRef(rank, g, i) not in done]
            raise P2PDeadlock(rank, g, groups[rank][g], [pairs[ref] for ref in waiting])


def _finishes(groups: dict[int, list[P2PGroup]], pairs: dict[OpRef, OpRef], head: dict[int, int],
              done: set[OpRef], rank: int, eager_bytes: int) -> bool:
    """Whether the running group of `rank` finishes now: each of its operations is done, or
    becomes done because its counterpart's group has started (a buffered send needs nothing)."""
    g = head[rank]
    for i, op in enumerate(groups[rank][g]):
        ref = OpRef(rank, g, i)
        if ref in done:
            continue
        other = pairs[ref]
        buffered = op.kind == "send" and op.nbytes <= eager_bytes
        if buffered or head[other.rank] >= other.group:
            done.add(ref)
    return all(OpRef(rank, g, i) in done for i in range(len(groups[rank][g])))
