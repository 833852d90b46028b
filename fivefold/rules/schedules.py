"""Pipeline schedules as pure tables of actions, and a simulator that checks them.

A schedule is a ``list[list[Action]]``: one list per pipeline rank, read front to back.
Nothing here touches processes or ``torch.distributed``; the executor in ``pipeline.py``
runs any table, and the tests prove properties of the tables with :func:`simulate`.

Model chunks and virtual stages
    Rank ``r`` holds ``vpp`` model chunks. Chunk ``c`` of rank ``r`` is virtual stage
    ``c * pp + r`` (:func:`stage_of`), so the model is cut into ``pp * vpp`` stages that
    visit the ranks round-robin. Without interleaving ``vpp == 1`` and stage == rank.

The executor contract
    1. Walk ``table[rank]`` in order.
    2. A compute action (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) runs
       synchronously on the local chunk ``action.chunk`` for ``action.microbatch``.
    3. A maximal run of consecutive communication actions is ONE batch: post all of them
       with a single ``torch.distributed.batch_isend_irecv`` call, in list order, and wait
       for every request of the batch before moving on (an executor may wait later: for
       a receive, just before the compute that consumes it; for a send, at any time
       before its buffer is reused; waiting later never adds a wait, so it cannot add a
       deadlock either). :func:`group_steps` does the grouping. Post them in list order:
       point-to-point messages between two ranks are matched first-in first-out, and the
       tables are built so that the n-th send from rank a to rank b is the n-th receive of
       rank b from rank a.
       Do not move a send or a receive out of its batch where the backend runs a rank's
       batches in order and a send waits for its receive, as NCCL does once a message
       exceeds its buffering: a send posted ahead in a batch of its own holds up the rank's
       later batches until the peer's receive runs, and the peer may be waiting on one of
       them (1F1B at pp=2: rank 0's next activation against rank 1's gradient, which
       the table puts in one batch with it). The batches are where both ends meet, which
       is what :func:`simulate` checks; ``rules.p2p_order.check_p2p_order`` checks the
       order an executor actually issues. Only a backend that runs each operation on its
       own (gloo) lets an executor post sends and receives ahead of their place, keeping
       the order per peer.
    4. Which tensor each communication action carries (``mb`` = microbatch, ``c`` = chunk
       of the rank holding the action):
         SEND_ACT  output of FORWARD(mb, c), to ``peer`` (next virtual stage)
         RECV_ACT  input of FORWARD(mb, c), from ``peer`` (previous virtual stage)
         SEND_GRAD gradient w.r.t. the input of chunk c, produced by BACKWARD or
                   BACKWARD_INPUT(mb, c), to ``peer`` (previous virtual stage)
         RECV_GRAD gradient w.r.t. the output of chunk c, needed by BACKWARD or
                   BACKWARD_INPUT(mb, c), from ``peer`` (next virtual stage)
       Activations and gradients of a stage boundary have the same shape.
    5. A receive always comes before the compute that consumes it and a send after the
       compute that produces it, so a compute action never waits on the network. Neither
       is necessarily adjacent: a receive can arrive a few computes early and a send can
       leave a few computes late (that is what keeps both ends in step), so the executor
       keys its buffers by (microbatch, chunk) and frees a buffer once it is consumed or
       sent. The last virtual stage starts its backward from the loss; stage 0 sends no
       gradient. With pp=1 a table has no communication at all.

Why this cannot deadlock
    Every table is checked by :func:`simulate`, which models a batch as blocking until
    each of its operations is matched by the peer, first-in first-out per (sender,
    receiver) pair: every send waits for its receive, so this holds for any message size.
    The construction also gives an argument: the communication actions
    are placed so that there is one global order of transfers that every rank's
    communication actions follow. Take the earliest transfer, in that order, that is
    stuck; its unposted side belongs to a rank blocked on a batch that is earlier in
    that rank's list, hence holds an earlier stuck transfer: contradiction.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .layout import SCHEDULES, dualpipev_min_microbatches
from .placement import Placement, placement_of, rank_chunk_of, stage_of


class ActionKind(enum.Enum):
    """What one entry of a rank's list asks the executor to do."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble "B")
    BACKWARD_WEIGHT = "W"  # weight gradient only, deferred
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_comm(self) -> bool:
        return self in _COMM_KINDS

    @property
    def is_compute(self) -> bool:
        return not self.is_comm


_COMM_KINDS = frozenset(
    {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    ``chunk`` is the local chunk index on the rank that holds the action (0..vpp-1);
    ``peer`` is the pipeline rank on the other end of a communication action and None
    for compute.
    """

    kind: ActionKind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind.value}{self.microbatch}.{self.chunk}{peer}"


Table = list[list[Action]]
Step = tuple[Action, ...]

F, B, I, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


# --------------------------------------------------------------------------- topology


class Peers(NamedTuple):
    """Ranks of the previous and next virtual stage (None at the ends of the model)."""

    prev: int | None
    next: int | None


def peers(rank: int, chunk: int, pp: int, vpp: int = 1, placement: Placement = "loop") -> Peers:
    """Neighbours of chunk ``chunk`` on ``rank``.

    Under the loop placement the last rank's chunk c feeds rank 0's chunk c+1, which is
    why the next rank is not simply ``rank + 1``; under the V placement the last rank's
    chunk 0 feeds its own chunk 1 (the peer is the rank itself: no message).
    """
    stage = stage_of(rank, chunk, pp, placement)
    prev = rank_chunk_of(stage - 1, pp, placement)[0] if stage > 0 else None
    nxt = rank_chunk_of(stage + 1, pp, placement)[0] if stage < pp * vpp - 1 else None
    return Peers(prev, nxt)


def group_steps(actions: list[Action]) -> list[Step]:
    """Split one rank's list into executor steps.

    A compute action is a step of its own; a maximal run of communication actions is one
    step, to be posted as one ``batch_isend_irecv`` and waited for as a whole.
    """
    steps: list[Step] = []
    run: list[Action] = []
    for action in actions:
        if action.kind.is_comm:
            run.append(action)
            continue
        if run:
            steps.append(tuple(run))
            run = []
        steps.append((action,))
    if run:
        steps.append(tuple(run))
    return steps


# ----------------------------------------------------------------- compute orders
# Each function returns, for one rank, the order of its compute actions only; the
# communication is added afterwards by _with_communication, the same way for all.


def _gpipe_order(rank: int, pp: int, m: int) -> list[Action]:
    """All forwards, then all backwards in the same micro-batch order."""
    return [Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)]


def _warmup(rank: int, pp: int, m: int) -> int:
    """Forwards a rank runs before its first backward can possibly arrive."""
    return min(pp - rank - 1, m)


def _one_f_one_b_order(rank: int, pp: int, m: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward / one backward, then drain.

    Rank r keeps at most pp - r micro-batches alive, instead of GPipe's m.
    """
    w = _warmup(rank, pp, m)
    order = [Action(F, i) for i in range(w)]
    for k in range(m - w):
        order += [Action(F, w + k), Action(B, k)]
    order += [Action(B, k) for k in range(m - w, m)]
    return order


def _interleaved_unit(k: int, pp: int, vpp: int, backward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward (or backward) in interleaved order.

    Micro-batches go in groups of pp: a group runs through chunk 0, then chunk 1, ...
    (backwards: the last chunk first). pp consecutive units of one chunk are exactly what
    keeps every rank busy while the group travels around the ring of ranks.
    """
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if backward:
        chunk = vpp - 1 - chunk
    return group * pp + within % pp, chunk


def _interleaved_order(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    """1F1B over the rank's m * vpp (micro-batch, chunk) units.

    The warm-up covers the (vpp - 1) * pp units that precede the first backward of the
    last virtual stage, plus the plain 1F1B warm-up of the rank, so that with vpp=1 this
    is exactly 1F1B. More warm-up would only hold more activations: the simulated bubble
    already equals the ideal (pp - 1) / (m * vpp).
    """
    total = m * vpp
    w = min((vpp - 1) * pp + pp - rank - 1, total)
    fwd = [Action(F, *_interleaved_unit(k, pp, vpp, False)) for k in range(total)]
    bwd = [Action(B, *_interleaved_unit(k, pp, vpp, True)) for k in range(total)]
    order = fwd[:w]
    for k in range(total - w):
        order += [fwd[w + k], bwd[k]]
    order += bwd[total - w :]
    return order


def _zb_h1_order(rank: int, pp: int, m: int) -> list[Action]:
    """1F1B with the backward split, weight gradients deferred into the bubbles.

    Rank r keeps the 1F1B warm-up and postpones its weight gradients by r slots: the
    ranks near the end of the pipeline have the longest idle tail in 1F1B and fill it
    with postponed W. Live micro-batches (forward done, W not done) stay <= pp, 1F1B's
    peak.
    """
    w = _warmup(rank, pp, m)
    delay = rank
    order = [Action(F, i) for i in range(w)]
    pending: deque[int] = deque()

    def backward(k: int) -> None:
        order.append(Action(I, k))
        pending.append(k)
        if len(pending) > delay:
            order.append(Action(W, pending.popleft()))

    for k in range(m - w):
        order.append(Action(F, w + k))
        backward(k)
    for k in range(m - w, m):
        backward(k)
    order += [Action(W, k) for k in pending]
    return order


class _DualPipeVOrder:
    """Builds one rank's DualPipeV compute order; see :func:`dualpipev`.

    Chunk 0 (down the V) and chunk 1 (back up) each take their micro-batches in order, so
    the order is a sequence of "next forward / next backward of chunk c" steps. A split
    backward either runs its weight part at once (I then W: a full backward) or defers it
    to a first-in first-out queue drained by later W steps.
    """

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.deferred: deque[Action] = deque()

    def forward(self, chunk: int) -> None:
        self.order.append(Action(F, self.next_forward[chunk], chunk))
        self.next_forward[chunk] += 1

    def backward(self, chunk: int, defer_weight: bool = False) -> None:
        mb = self.next_backward[chunk]
        self.next_backward[chunk] += 1
        self.order.append(Action(I, mb, chunk))
        if defer_weight:
            self.deferred.append(Action(W, mb, chunk))
        else:
            self.order.append(Action(W, mb, chunk))

    def weight(self) -> None:
        self.order.append(self.deferred.popleft())


def _dualpipev_order(rank: int, pp: int, m: int) -> list[Action]:
    """DualPipeV's eight phases on rank r (DeepSeek's DualPipe repository, "cut-in-half").

    1. 2(pp - r - 1) forwards of chunk 0: fill the way down to the tip of the V.
    2. r + 1 pairs F0 F1: chunk 1's first micro-batches come back up.
    3. pp - r - 1 times B1 W1 F1: backward starts at the tip, forward still climbs.
    4. m - 2pp + r + 1 times F0 B1 F1 B0: the steady state, each forward paired with the
       backward of an older micro-batch (the pairs whose communication DualPipe overlaps).
    5. pp - r - 1 times B1 F1 B0: the last forwards.
    6. r + 1 pairs B1 B0; from the middle pair on, the weight part is deferred.
    7. pp - r - 1 times W B0 (weight deferred): deferred W fill the gaps of the drain.
    8. The remaining deferred W.
    """
    build = _DualPipeVOrder()
    down, up = 0, 1
    for _ in range(2 * (pp - rank - 1)):
        build.forward(down)
    for _ in range(rank + 1):
        build.forward(down)
        build.forward(up)
    for _ in range(pp - rank - 1):
        build.backward(up)
        build.forward(up)
    for _ in range(m - 2 * pp + rank + 1):
        build.forward(down)
        build.backward(up)
        build.forward(up)
        build.backward(down)
    for _ in range(pp - rank - 1):
        build.backward(up)
        build.forward(up)
        build.backward(down)
    middle = (rank + 1) // 2
    for i in range(rank + 1):
        # odd ranks start deferring with this pair's B1, even ranks with its B0
        build.backward(up, defer_weight=i > middle or (i == middle and rank % 2 == 1))
        build.backward(down, defer_weight=i >= middle)
    for _ in range(pp - rank - 1):
        build.weight()
        build.backward(down, defer_weight=True)
    while build.deferred:
        build.weight()
    return build.order


# ------------------------------------------------------------------ communication


# Durations the tables are planned for: forward 1, full backward 2 (input 1 + weight 1).
# Only the placement of communication depends on them, never the correctness.
_PLAN_TIME = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


def _input_key(action: Action, stage: int, last: int) -> tuple[str, int, int] | None:
    """Name of the tensor a compute action needs from another stage, if any."""
    if action.kind is F and stage > 0:
        return ("act", action.microbatch, stage)
    if action.kind in (B, I) and stage < last:
        return ("grad", action.microbatch, stage)
    return None


def _output_key(action: Action, stage: int, last: int) -> tuple[str, int, int] | None:
    """Name of the tensor a compute action hands to another stage, if any."""
    if action.kind is F and stage < last:
        return ("act", action.microbatch, stage + 1)
    if action.kind in (B, I) and stage > 0:
        return ("grad", action.microbatch, stage - 1)
    return None


Times = list[tuple[float, float]]  # (start, end) of each compute action of one rank


Duration = Callable[[int, Action], float]  # seconds (or units) of a compute action on a rank


def _planned_times(
    orders: list[list[Action]], pp: int, vpp: int, duration: Duration | None = None, latency: float = 0.0,
    placement: Placement = "loop",
) -> list[Times]:
    """(start, end) of every compute action when each starts as soon as its rank is free and
    its input exists, `latency` after the compute that made it.

    That is the executor's own rule (a send is posted once its tensor exists, a receive is
    waited for just before the compute that consumes it), so with measured durations and
    the measured transfer latency this is the executor's step without contention. Tables are
    planned with `_PLAN_TIME` and no latency.
    """
    cost = duration or (lambda rank, action: _PLAN_TIME[action.kind])
    last = pp * vpp - 1
    ready: dict[tuple[str, int, int], float] = {}
    times: list[Times] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            while len(times[rank]) < len(order):
                action = order[len(times[rank])]
                stage = stage_of(rank, action.chunk, pp, placement)
                need = _input_key(action, stage, last)
                if need is not None and need not in ready:
                    break
                start = max(clock[rank], ready[need] + latency if need else 0.0)
                clock[rank] = start + cost(rank, action)
                times[rank].append((start, clock[rank]))
                out = _output_key(action, stage, last)
                if out is not None:
                    ready[out] = clock[rank]
                progressed = True
    if any(len(t) < len(o) for t, o in zip(times, orders)):
        raise RuntimeError("compute orders wait on each other in a cycle")
    return times


def executor_model(table: Table, pp: int, duration: Duration, latency: float = 0.0,
                   placement: Placement = "loop") -> list[Times]:
    """(start, end) of each rank's compute actions, in list order, as the executor runs
    `table` on a machine without contention: compute action a of rank r lasts
    `duration(r, a)` and a transfer arrives `latency` after its tensor exists.

    Unlike :func:`simulate` (a batch blocks until matched), this follows the executor's
    placement of transfers, so measured per-action times and transfer latency put in here
    give the step the schedule allows; what a measured step has beyond it is contention.
    """
    orders = [[a for a in row if a.kind.is_compute] for row in table]
    vpp = 1 + max((a.chunk for row in orders for a in row), default=0)
    return _planned_times(orders, pp, vpp, duration, latency, placement)


def _free_at(times: Times, t: float) -> float:
    """Earliest moment >= t at which a rank is not in the middle of a compute action."""
    for start, end in times:
        if start < t < end:
            return end
    return t


def _rendezvous(ta: Times, tb: Times, t: float) -> float:
    """Earliest moment >= t at which two ranks both stand between compute actions."""
    while True:
        ta_free = _free_at(ta, t)
        tb_free = _free_at(tb, ta_free)
        if tb_free == ta_free:
            return ta_free
        t = tb_free


def _with_communication(orders: list[list[Action]], pp: int, vpp: int, placement: Placement = "loop") -> Table:
    """Insert the sends and receives into per-rank compute orders.

    Every transfer is given one moment: the first time, after its producer finishes,
    when sender and receiver both stand between compute actions in the planned timeline
    (at the latest when the consumer starts). Each rank's communication actions sit at
    their moment, in order of (moment, tie-break). That is one global order of transfers
    which every rank follows, so no rank can wait on a peer that waits on it, and point
    to point messages between a pair of ranks match first-in first-out. With the planned
    durations both sides reach each batch at the same time: the blocking executor
    reproduces the planned timeline exactly. A transfer between two chunks of one rank
    (the tip of the V placement) is no message and gets no action.
    """
    last = pp * vpp - 1
    times = _planned_times(orders, pp, vpp, placement=placement)
    consumer: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, order in enumerate(orders):
        for i, action in enumerate(order):
            need = _input_key(action, stage_of(rank, action.chunk, pp, placement), last)
            if need is not None:
                consumer[need] = (rank, i)
    comms: list[list[tuple[tuple, Action]]] = [[] for _ in range(pp)]
    for rank, order in enumerate(orders):
        for i, action in enumerate(order):
            out = _output_key(action, stage_of(rank, action.chunk, pp, placement), last)
            if out is None:
                continue
            dst, j = consumer[out]
            if dst == rank:
                continue
            moment = min(_rendezvous(times[rank], times[dst], times[rank][i][1]), times[dst][j][0])
            key = (moment, rank, dst, out)
            send_kind = ActionKind.SEND_ACT if out[0] == "act" else ActionKind.SEND_GRAD
            recv_kind = ActionKind.RECV_ACT if out[0] == "act" else ActionKind.RECV_GRAD
            comms[rank].append((key, Action(send_kind, action.microbatch, action.chunk, dst)))
            comms[dst].append((key, Action(recv_kind, out[1], orders[dst][j].chunk, rank)))
    return [
        _merge(order, t, sorted(c, key=lambda kc: kc[0]))
        for order, t, c in zip(orders, times, comms)
    ]


def _merge(order: list[Action], times: Times, comms: list[tuple[tuple, Action]]) -> list[Action]:
    """Put each communication action after every compute action that started before its
    moment; comms arrive sorted by moment, so the list keeps the global order."""
    merged: list[Action] = []
    i = 0
    for key, action in comms:
        while i < len(order) and times[i][0] < key[0]:
            merged.append(order[i])
            i += 1
        merged.append(action)
    return merged + order[i:]


# ------------------------------------------------------------------- public builders


def _check_sizes(pp: int, num_microbatches: int, vpp: int) -> None:
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if vpp < 1:
        raise ValueError(f"vpp must be >= 1, got {vpp}")


def _build(order: Callable[[int], list[Action]], pp: int, vpp: int, placement: Placement = "loop") -> Table:
    return _with_communication([order(rank) for rank in range(pp)], pp, vpp, placement)


def gpipe(pp: int, num_microbatches: int) -> Table:
    """GPipe: every micro-batch forward, then every backward; m micro-batches live."""
    _check_sizes(pp, num_microbatches, 1)
    return _build(lambda r: _gpipe_order(r, pp, num_microbatches), pp, 1)


def one_f_one_b(pp: int, num_microbatches: int) -> Table:
    """1F1B (PipeDream-flush): GPipe's bubble, at most pp - rank micro-batches live."""
    _check_sizes(pp, num_microbatches, 1)
    return _build(lambda r: _one_f_one_b_order(r, pp, num_microbatches), pp, 1)


def interleaved_1f1b(pp: int, num_microbatches: int, vpp: int) -> Table:
    """Interleaved 1F1B: vpp chunks per rank cut the bubble by a factor vpp."""
    _check_sizes(pp, num_microbatches, vpp)
    if pp < 2 and vpp > 1:
        raise ValueError(
            "interleaved schedule with vpp > 1 needs pp >= 2 (with pp=1 there is no "
            "bubble to shrink); use '1f1b' or vpp=1"
        )
    if num_microbatches % pp:
        lo = num_microbatches - num_microbatches % pp
        hi = lo + pp
        hint = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(
            f"interleaved schedule needs num_microbatches to be a multiple of pp={pp}, "
            f"got {num_microbatches}; e.g. {hint}"
        )
    return _build(lambda r: _interleaved_order(r, pp, num_microbatches, vpp), pp, vpp)


def zero_bubble_h1(pp: int, num_microbatches: int) -> Table:
    """ZB-H1: backward split into input (B) and weight (W) gradients, W fills bubbles.

    With F = B = W the simulated bubble time is (pp - 1)(F + B - W), a third of 1F1B's
    (pp - 1)(F + B + W), when m >= pp; with fewer micro-batches there are too few W to
    fill the tail and it is (pp - 1)(F + B) - (m - 1)W.
    """
    _check_sizes(pp, num_microbatches, 1)
    return _build(lambda r: _zb_h1_order(r, pp, num_microbatches), pp, 1)


def dualpipev(pp: int, num_microbatches: int) -> Table:
    """DualPipeV: 2 pp chunks placed in a V (rank r holds stages r and 2 pp - 1 - r), the
    backward split into input (I) and weight (W) steps, and in the steady state every
    forward of one micro-batch paired with the backward of another on the same rank."""
    _check_sizes(pp, num_microbatches, 2)
    least = dualpipev_min_microbatches(pp)
    if num_microbatches < least:
        raise ValueError(
            f"dualpipev with pp={pp} needs at least 2 x pp - 1 = {least} micro-batches, got {num_microbatches}; "
            f"use num_microbatches >= {least}"
        )
    return _build(lambda r: _dualpipev_order(r, pp, num_microbatches), pp, 2, "v")


ALIASES = {"zero-bubble": "zb-h1"}  # other names accepted for the schedules of layout.SCHEDULES


def build_schedule(name: str, pp: int, num_microbatches: int, vpp: int = 1) -> Table:
    """Table of actions for one of `fivefold.rules.layout.SCHEDULES`, one list per pipeline rank."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    if key == "interleaved":
        return interleaved_1f1b(pp, num_microbatches, vpp)
    if key == "dualpipev":
        if vpp != 2:
            raise ValueError(f"'dualpipev' runs two chunks per rank in a V; use vpp=2, got vpp={vpp}")
        return dualpipev(pp, num_microbatches)
    if vpp != 1:
        raise ValueError(
            f"vpp={vpp} needs the 'interleaved' schedule; {name!r} runs one chunk per rank"
        )
    if key == "gpipe":
        return gpipe(pp, num_microbatches)
    if key == "1f1b":
        return one_f_one_b(pp, num_microbatches)
    return zero_bubble_h1(pp, num_microbatches)


# ---------------------------------------------------------------------- simulator


class DeadlockError(RuntimeError):
    """The table cannot finish: every unfinished rank waits on an unmatched batch."""

    def __init__(self, stuck: dict[int, tuple[Action, ...]]):
        self.stuck = stuck
        lines = [f"rank {r}: waits on {list(actions)}" for r, actions in stuck.items()]
        super().__init__("pipeline schedule deadlocks:\n  " + "\n  ".join(lines))


class Interval(NamedTuple):
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    ``ideal`` is one rank's pure compute time (m * vpp * (f + b) for a balanced table),
    ``bubble`` the pipeline-bubble ratio of the papers, (makespan - ideal) / ideal, and
    ``idle_fraction`` the share of rank-time spent not computing. ``peak_in_flight``
    counts, per rank, (micro-batch, chunk) units whose forward ran and whose backward
    (the W part for a split backward) has not: the activations it must keep.
    """

    makespan: float
    ideal: float
    bubble: float
    idle_fraction: float
    busy: tuple[float, ...]
    timelines: tuple[tuple[Interval, ...], ...]
    peak_in_flight: tuple[int, ...]


@dataclass
class _Op:
    """A posted send or receive waiting for its partner."""

    rank: int
    action: Action
    posted: float
    matched: float | None = None


@dataclass
class _Rank:
    """Progress of one rank through its list during a simulation."""

    pos: int = 0
    clock: float = 0.0
    batch: list[_Op] | None = None
    forward: set[tuple[int, int]] = field(default_factory=set)
    input_grad: set[tuple[int, int]] = field(default_factory=set)
    weight_grad: set[tuple[int, int]] = field(default_factory=set)
    got_act: set[tuple[int, int]] = field(default_factory=set)
    got_grad: set[tuple[int, int]] = field(default_factory=set)
    live: int = 0
    peak: int = 0
    busy: float = 0.0
    timeline: list[Interval] = field(default_factory=list)


class _Simulation:
    """Discrete-event run of a table; times are maxima over dependencies, so the result
    does not depend on the order in which ranks are stepped."""

    def __init__(self, table: Table, pp: int, durations: dict[ActionKind, float], comm_time: float,
                 placement: Placement = "loop"):
        self.table, self.pp, self.durations, self.comm_time = table, pp, durations, comm_time
        self.placement = placement
        self.vpp = 1 + max((a.chunk for row in table for a in row), default=0)
        self.ranks = [_Rank() for _ in range(pp)]
        self.sends: dict[tuple[int, int], deque[_Op]] = {}
        self.recvs: dict[tuple[int, int], deque[_Op]] = {}

    def stage(self, rank: int, action: Action) -> int:
        if not 0 <= action.chunk < self.vpp:
            raise ValueError(f"rank {rank}: {action} has chunk outside 0..{self.vpp - 1}")
        return stage_of(rank, action.chunk, self.pp, self.placement)

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for rank in range(self.pp):
                while self.step(rank):
                    progressed = True
        stuck = {
            r: tuple(op.action for op in st.batch) if st.batch else (self.table[r][st.pos],)
            for r, st in enumerate(self.ranks)
            if st.batch or st.pos < len(self.table[r])
        }
        if stuck:
            raise DeadlockError(stuck)

    def step(self, rank: int) -> bool:
        """Advance one rank by one step if it can; False when it must wait or is done."""
        st = self.ranks[rank]
        if st.batch is not None:
            return self.finish_batch(rank, st)
        row = self.table[rank]
        if st.pos == len(row):
            return False
        if row[st.pos].kind.is_comm:
            end = st.pos
            while end < len(row) and row[end].kind.is_comm:
                end += 1
            st.batch = [self.post(rank, a, st.clock) for a in row[st.pos : end]]
            st.pos = end
            return True
        self.compute(rank, st, row[st.pos])
        st.pos += 1
        return True

    def compute(self, rank: int, st: _Rank, a: Action) -> None:
        key, stage, last = (a.microbatch, a.chunk), self.stage(rank, a), self.pp * self.vpp - 1
        where = f"rank {rank}: {a}"
        if a.kind is F:
            if key in st.forward:
                raise ValueError(f"{where} runs twice")
            if stage > 0 and key not in st.got_act:
                raise ValueError(f"{where} comes before its activation is received")
            st.forward.add(key)
            st.live += 1
            st.peak = max(st.peak, st.live)
        elif a.kind in (B, I):
            if key not in st.forward or key in st.input_grad:
                raise ValueError(f"{where} comes before its forward, or runs twice")
            if stage < last and key not in st.got_grad:
                raise ValueError(f"{where} comes before its gradient is received")
            st.input_grad.add(key)
            if a.kind is B:
                st.weight_grad.add(key)
                st.live -= 1
        else:
            if key not in st.input_grad or key in st.weight_grad:
                raise ValueError(f"{where} comes before its input-gradient part, or twice")
            st.weight_grad.add(key)
            st.live -= 1
        self.hand_over_locally(rank, st, a, stage)
        start = st.clock
        st.clock += self.durations[a.kind]
        st.busy += st.clock - start
        st.timeline.append(Interval(start, st.clock, a))

    def hand_over_locally(self, rank: int, st: _Rank, a: Action, stage: int) -> None:
        """A forward output (input gradient) whose consumer is another chunk of this rank
        arrives there at once, without a message."""
        if a.kind is F and stage < self.pp * self.vpp - 1:
            to_rank, to_chunk = rank_chunk_of(stage + 1, self.pp, self.placement)
            if to_rank == rank:
                st.got_act.add((a.microbatch, to_chunk))
        elif a.kind in (B, I) and stage > 0:
            to_rank, to_chunk = rank_chunk_of(stage - 1, self.pp, self.placement)
            if to_rank == rank:
                st.got_grad.add((a.microbatch, to_chunk))

    def post(self, rank: int, a: Action, now: float) -> _Op:
        self.stage(rank, a)  # validates the chunk index
        nb, st = peers(rank, a.chunk, self.pp, self.vpp, self.placement), self.ranks[rank]
        key = (a.microbatch, a.chunk)
        expected = {
            ActionKind.SEND_ACT: (nb.next, key in st.forward),
            ActionKind.SEND_GRAD: (nb.prev, key in st.input_grad),
            ActionKind.RECV_ACT: (nb.prev, True),
            ActionKind.RECV_GRAD: (nb.next, True),
        }[a.kind]
        if a.peer is None or a.peer != expected[0] or a.peer == rank:
            raise ValueError(f"rank {rank}: {a} should name peer {expected[0]}")
        if not expected[1]:
            raise ValueError(f"rank {rank}: {a} sends a result not yet computed")
        op = _Op(rank, a, now)
        sending = a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
        channel = (rank, a.peer) if sending else (a.peer, rank)
        (self.sends if sending else self.recvs).setdefault(channel, deque()).append(op)
        self.match(channel)
        return op

    def match(self, channel: tuple[int, int]) -> None:
        """Pair posted sends and receives of one channel, first-in first-out."""
        sends, recvs = self.sends.get(channel), self.recvs.get(channel)
        while sends and recvs:
            s, r = sends.popleft(), recvs.popleft()
            act = s.action.kind is ActionKind.SEND_ACT
            want = ActionKind.RECV_ACT if act else ActionKind.RECV_GRAD
            step = 1 if act else -1
            ok = (
                r.action.kind is want
                and r.action.microbatch == s.action.microbatch
                and self.stage(r.rank, r.action) == self.stage(s.rank, s.action) + step
            )
            if not ok:
                raise ValueError(
                    f"rank {s.rank}: {s.action} is matched by rank {r.rank}: {r.action}"
                )
            s.matched = r.matched = max(s.posted, r.posted)

    def finish_batch(self, rank: int, st: _Rank) -> bool:
        batch = st.batch or []
        matched = [op.matched for op in batch]
        if any(t is None for t in matched):
            return False
        st.clock = max(st.clock, max(t for t in matched if t is not None) + self.comm_time)
        for op in batch:
            key = (op.action.microbatch, op.action.chunk)
            if op.action.kind is ActionKind.RECV_ACT:
                st.got_act.add(key)
            elif op.action.kind is ActionKind.RECV_GRAD:
                st.got_grad.add(key)
        st.batch = None
        return True


def simulate(
    table: Table,
    pp: int,
    f_time: float = 1.0,
    b_time: float = 2.0,
    w_time: float | None = None,
    comm_time: float = 0.0,
    placement: Placement = "loop",
) -> SimResult:
    """Run a table on an idealised machine and measure it.

    ``b_time`` is a full BACKWARD; a split backward spends ``w_time`` (default half of
    ``b_time``) on BACKWARD_WEIGHT and the rest on BACKWARD_INPUT, so every schedule
    does the same work. A batch of communication actions blocks its rank until each
    operation is matched by the peer (first-in first-out per sender/receiver pair), then
    takes ``comm_time``. Raises :class:`DeadlockError` if the table cannot finish and
    ``ValueError`` if it breaks a data dependency or pairs mismatched messages.
    ``placement`` says which virtual stage each (rank, chunk) is (`rules.placement`).
    """
    if len(table) != pp:
        raise ValueError(f"table has {len(table)} rank lists, expected pp={pp}")
    w = b_time / 2 if w_time is None else w_time
    if not 0 <= w <= b_time:
        raise ValueError(f"w_time={w_time} must lie in [0, b_time={b_time}]")
    durations = {F: f_time, B: b_time, I: b_time - w, W: w}
    sim = _Simulation(table, pp, durations, comm_time, placement)
    sim.run()
    makespan = max(st.clock for st in sim.ranks)
    busy = tuple(st.busy for st in sim.ranks)
    ideal = max(busy)
    return SimResult(
        makespan=makespan,
        ideal=ideal,
        bubble=(makespan - ideal) / ideal if ideal else 0.0,
        idle_fraction=sum(makespan - b for b in busy) / (makespan * pp) if makespan else 0.0,
        busy=busy,
        timelines=tuple(tuple(st.timeline) for st in sim.ranks),
        peak_in_flight=tuple(st.peak for st in sim.ranks),
    )
