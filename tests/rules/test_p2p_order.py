"""The NCCL-order checker: groups run in issue order per rank, every send waits for its receive."""

from __future__ import annotations

import pytest

from fivefold.rules.p2p_order import OpRef, P2PDeadlock, P2POp, check_p2p_order, match_operations
from fivefold.rules.schedules import ActionKind, build_schedule, group_steps

SIZE = 4096


def send(peer: int, nbytes: int = SIZE) -> P2POp:
    return P2POp("send", peer, nbytes)


def recv(peer: int, nbytes: int = SIZE) -> P2POp:
    return P2POp("recv", peer, nbytes)


# Each rank sends first, in a group of its own, then receives: gloo finishes it, NCCL does
# not once the messages are larger than its buffering.
SEND_FIRST = {0: [(send(1),), (recv(1),)], 1: [(send(0),), (recv(0),)]}


def test_sends_issued_ahead_of_the_receives_they_wait_on_deadlock():
    with pytest.raises(P2PDeadlock) as err:
        check_p2p_order(SEND_FIRST)
    assert (err.value.rank, err.value.group, err.value.ops) == (0, 0, (send(1),))
    assert err.value.waits_on == [OpRef(1, 1, 0)]  # rank 1's receive, behind rank 1's own send
    assert "rank 0's group 0 [send->1(4096 B)] never finishes" in str(err.value)


def test_buffered_sends_finish_without_their_receive():
    check_p2p_order(SEND_FIRST, eager_bytes=SIZE)  # small messages: NCCL buffers them
    with pytest.raises(P2PDeadlock):
        check_p2p_order(SEND_FIRST, eager_bytes=SIZE - 1)


def test_a_send_in_the_group_of_the_receive_it_meets_finishes():
    check_p2p_order({0: [(send(1), recv(1))], 1: [(send(0), recv(0))]})
    check_p2p_order({0: [(send(1),), (recv(1),)], 1: [(recv(0),), (send(0),)]})  # opposite orders meet


def test_a_ring_of_three_deadlocks_only_when_every_rank_sends_first():
    """A cycle through three ranks: each rank's send waits on the next rank's receive."""
    ring = {0: [(send(1),), (recv(2),)], 1: [(recv(0),), (send(2),)], 2: [(recv(1),), (send(0),)]}
    check_p2p_order(ring)  # rank 0 starts the ring, the others pass it on
    ring[1], ring[2] = [(send(2),), (recv(0),)], [(send(0),), (recv(1),)]
    with pytest.raises(P2PDeadlock) as err:
        check_p2p_order(ring)
    assert (err.value.rank, err.value.group, err.value.waits_on) == (0, 0, [OpRef(1, 1, 0)])


def test_messages_match_first_in_first_out_and_must_agree():
    pairs = match_operations({0: [(send(1),), (send(1),)], 1: [(recv(0), recv(0))]})
    assert pairs[OpRef(0, 0, 0)] == OpRef(1, 0, 0) and pairs[OpRef(0, 1, 0)] == OpRef(1, 0, 1)
    with pytest.raises(ValueError, match="rank 0 sends 2 messages to rank 1, which receives 1"):
        check_p2p_order({0: [(send(1),), (send(1),)], 1: [(recv(0),)]})
    with pytest.raises(ValueError, match="receives it as recv<-0"):
        check_p2p_order({0: [(send(1),)], 1: [(recv(0, SIZE // 2),)]})


def _table_groups(name: str, pp: int, m: int, vpp: int) -> dict[int, list[tuple[P2POp, ...]]]:
    """The batches of a schedule table as groups of operations (every message of one size)."""
    sending = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
    groups: dict[int, list[tuple[P2POp, ...]]] = {}
    for rank, row in enumerate(build_schedule(name, pp, m, vpp)):
        steps = [step for step in group_steps(row) if step[0].kind.is_comm]
        groups[rank] = [tuple(P2POp("send" if a.kind in sending else "recv", a.peer, SIZE) for a in step)
                        for step in steps]
    return groups


@pytest.mark.parametrize("name, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_table_posted_batch_by_batch_holds(name, vpp, pp):
    """The executor's order under NCCL is the table's batches: they hold at any size."""
    for m in (pp, 2 * pp) if name == "interleaved" else (1, pp - 1, pp + 1, 2 * pp):
        check_p2p_order(_table_groups(name, pp, max(m, 1), vpp))
