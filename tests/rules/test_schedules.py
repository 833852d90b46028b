"""Invariants of the pipeline schedule tables, checked without processes."""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter

import pytest

from fivefold.rules.schedules import (
    Action,
    ActionKind,
    DeadlockError,
    build_schedule,
    executor_model,
    group_steps,
    peers,
    placement_of,
    rank_chunk_of,
    simulate,
    stage_of,
)

K = ActionKind
COMPUTE = (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
PPS = (1, 2, 3, 4, 8)


def _configs() -> list[tuple[str, int, int, int]]:
    """Every (schedule, pp, m, vpp) the tables must support, where valid."""
    out = []
    for name, pp in itertools.product(("gpipe", "1f1b", "interleaved", "zb-h1"), PPS):
        for m in sorted({1, 2, pp, 2 * pp, 8, 13}):
            vpps = (1, 2, 3) if name == "interleaved" and pp > 1 else (1,)
            for vpp in vpps:
                if name == "interleaved" and m % pp:
                    continue
                out.append((name, pp, m, vpp))
    for pp in PPS:  # DualPipeV: two chunks per rank, from its fewest micro-batches (2 pp - 1) on
        out += [("dualpipev", pp, m, 2) for m in sorted({2 * pp - 1, 2 * pp, 8, 13}) if m >= 2 * pp - 1]
    return out


CONFIGS = _configs()
IDS = [f"{n}-pp{p}-m{m}-v{v}" for n, p, m, v in CONFIGS]


def _vpp_of(table: list[list[Action]]) -> int:
    return 1 + max(a.chunk for row in table for a in row)


def _stage(rank: int, a: Action, pp: int, name: str = "1f1b") -> int:
    return stage_of(rank, a.chunk, pp, placement_of(name))


def _simulate(name: str, table, pp: int, *args, **kwargs):
    """`simulate` under the chunk placement of schedule `name`."""
    return simulate(table, pp, *args, placement=placement_of(name), **kwargs)


def _split(name: str) -> bool:
    """Whether the schedule splits the backward into input and weight steps."""
    return name in ("zb-h1", "dualpipev")


@functools.lru_cache(maxsize=None)
def _table(name: str, pp: int, m: int, vpp: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, build_schedule(name, pp, m, vpp)))


@pytest.fixture(params=CONFIGS, ids=IDS)
def case(request):
    name, pp, m, vpp = request.param
    return name, pp, m, vpp, [list(row) for row in _table(name, pp, m, vpp)]


# ----------------------------------------------------------------- helpers / format


def test_stage_mapping_round_trips_and_wraps():
    pp, vpp = 4, 3
    for rank, chunk in itertools.product(range(pp), range(vpp)):
        assert rank_chunk_of(stage_of(rank, chunk, pp), pp) == (rank, chunk)
    assert stage_of(2, 1, 4) == 6
    assert peers(0, 0, pp, vpp) == (None, 1)
    assert peers(pp - 1, 0, pp, vpp) == (pp - 2, 0)  # wraps to rank 0, chunk 1
    assert peers(0, 1, pp, vpp) == (pp - 1, 1)
    assert peers(pp - 1, vpp - 1, pp, vpp) == (pp - 2, None)
    assert peers(0, 0, 1, 1) == (None, None)


def test_v_placement_round_trips_and_turns_at_the_last_rank():
    pp = 4
    for rank, chunk in itertools.product(range(pp), range(2)):
        assert rank_chunk_of(stage_of(rank, chunk, pp, "v"), pp, "v") == (rank, chunk)
    assert [stage_of(r, 0, pp, "v") for r in range(pp)] == [0, 1, 2, 3]
    assert [stage_of(r, 1, pp, "v") for r in range(pp)] == [7, 6, 5, 4]  # first and last stage on rank 0
    assert peers(pp - 1, 0, pp, 2, "v") == (pp - 2, pp - 1)  # the tip feeds its own chunk 1
    assert peers(0, 1, pp, 2, "v") == (1, None)
    assert placement_of("dualpipev") == "v" and placement_of("interleaved") == "loop"


def test_dualpipev_pairs_forward_and_backward_in_the_steady_state():
    """Rank 0 (m = 8, pp = 2): chunk 0's forward of micro-batch k + 2 runs next to chunk 1's
    backward of k, and chunk 1's forward of k + 1 next to chunk 0's backward of k - 1: each
    forward sits beside another micro-batch's backward (I then W: a full backward)."""
    row = [a for a in build_schedule("dualpipev", 2, 8, 2)[0] if a.kind.is_compute]
    steady = [repr(a) for a in row[7:19]]
    assert steady == ["F3.0", "I1.1", "W1.1", "F2.1", "I0.0", "W0.0", "F4.0", "I2.1", "W2.1", "F3.1", "I1.0", "W1.0"]


def test_dualpipev_bubble_rule_matches_the_table():
    """`rules.stages.bubble_units` (the planner's and the timeline's bubble) equals the idle
    time of the simulated table with F = B = W, in whole-device micro-batch units."""
    from fivefold.rules.stages import bubble_units

    for pp, m in [(2, 3), (2, 8), (4, 8), (8, 16)]:
        result = simulate(build_schedule("dualpipev", pp, m, 2), pp, 1.0, 2.0, 1.0, placement="v")
        idle = result.makespan - result.ideal
        assert idle == pytest.approx(pp - 1)
        assert bubble_units("dualpipev", pp, m, 2) == pytest.approx(idle / 6)  # a device's micro-batch is 6 units
        zb = simulate(build_schedule("zb-h1", pp, m), pp, 1.0, 2.0, 1.0)
        assert idle / result.ideal == pytest.approx(zb.bubble / 2)  # half of ZB-H1's bubble


def test_group_steps_batches_consecutive_communication():
    row = build_schedule("1f1b", 4, 8)[1]
    steps = group_steps(row)
    assert [a for step in steps for a in step] == row
    for step in steps:
        kinds = {a.kind.is_comm for a in step}
        assert len(kinds) == 1
        if not step[0].kind.is_comm:
            assert len(step) == 1
    for before, after in zip(steps, steps[1:]):  # batches are maximal
        assert not (before[0].kind.is_comm and after[0].kind.is_comm)


def test_actions_are_frozen_values():
    a = Action(K.SEND_ACT, 3, 1, 2)
    assert a == Action(K.SEND_ACT, microbatch=3, chunk=1, peer=2)
    with pytest.raises(AttributeError):
        a.microbatch = 4  # type: ignore[misc]


def test_single_stage_has_no_communication():
    for name in ("gpipe", "1f1b", "zb-h1"):
        (row,) = build_schedule(name, 1, 5)
        assert all(not a.kind.is_comm for a in row)


def test_aliases_and_degenerate_interleaving():
    assert build_schedule("zero-bubble", 4, 8) == build_schedule("zb-h1", 4, 8)
    for pp, m in [(2, 4), (4, 8), (8, 8)]:
        assert build_schedule("interleaved", pp, m, 1) == build_schedule("1f1b", pp, m)


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "args, message",
    [
        (("interleaved", 4, 6, 2), "multiple of pp=4, got 6; e.g. 4 or 8"),
        (("interleaved", 4, 3, 2), "e.g. 4"),
        (("interleaved", 1, 4, 2), "needs pp >= 2"),
        (("gpipe", 4, 8, 2), "vpp=2 needs the 'interleaved' schedule"),
        (("1f1b", 0, 8), "pp must be >= 1"),
        (("1f1b", 4, 0), "num_microbatches must be >= 1"),
        (("interleaved", 4, 8, 0), "vpp must be >= 1"),
        (("pipedream", 4, 8), "unknown pipeline schedule"),
        (("dualpipev", 4, 8, 1), "use vpp=2, got vpp=1"),
        (("dualpipev", 4, 6, 2), "needs at least 2 x pp - 1 = 7 micro-batches, got 6; use num_microbatches >= 7"),
    ],
)
def test_invalid_arguments_say_what_works(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(*args)


# ------------------------------------------------------------- table invariants


def test_every_unit_computed_exactly_once(case):
    name, pp, m, vpp, table = case
    counts = Counter(
        (a.kind, a.microbatch, _stage(r, a, pp, name))
        for r, row in enumerate(table)
        for a in row
        if a.kind in COMPUTE
    )
    split = _split(name)
    expected_kinds = (
        (K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT) if split else (K.FORWARD, K.BACKWARD)
    )
    expected = {
        (kind, mb, s): 1
        for kind in expected_kinds
        for mb in range(m)
        for s in range(pp * vpp)
    }
    assert dict(counts) == expected
    assert _vpp_of(table) == vpp


def test_forward_before_backward_and_weight_after_input(case):
    _, pp, m, vpp, table = case
    for row in table:
        pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(row)}
        for mb, chunk in itertools.product(range(m), range(vpp)):
            f = pos[(K.FORWARD, mb, chunk)]
            if (K.BACKWARD, mb, chunk) in pos:
                assert f < pos[(K.BACKWARD, mb, chunk)]
            else:
                assert f < pos[(K.BACKWARD_INPUT, mb, chunk)] < pos[(K.BACKWARD_WEIGHT, mb, chunk)]


def test_receives_precede_consumers_and_sends_follow_producers(case):
    """A neighbour stage on the same rank (the tip of DualPipeV's V) is no message."""
    name, pp, m, vpp, table = case
    for rank, row in enumerate(table):
        pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(row)}
        for a in row:
            key = (a.microbatch, a.chunk)
            nb = peers(rank, a.chunk, pp, vpp, placement_of(name))
            remote_prev, remote_next = nb.prev not in (None, rank), nb.next not in (None, rank)
            backward = K.BACKWARD if (K.BACKWARD, *key) in pos else K.BACKWARD_INPUT
            if a.kind is K.FORWARD and remote_prev:
                assert pos[(K.RECV_ACT, *key)] < pos[(K.FORWARD, *key)]
            if a.kind is K.FORWARD and remote_next:
                assert pos[(K.FORWARD, *key)] < pos[(K.SEND_ACT, *key)]
            if a.kind in (K.BACKWARD, K.BACKWARD_INPUT) and remote_next:
                assert pos[(K.RECV_GRAD, *key)] < pos[(backward, *key)]
            if a.kind in (K.BACKWARD, K.BACKWARD_INPUT) and remote_prev:
                assert pos[(backward, *key)] < pos[(K.SEND_GRAD, *key)]


def test_sends_and_receives_pair_one_to_one_in_order(case):
    """The n-th send from rank a to rank b is the n-th receive of b from a: same
    micro-batch, same kind of tensor, adjacent virtual stages. This is what lets the
    executor post p2p ops in list order without tags."""
    name, pp, m, vpp, table = case
    sends: dict[tuple[int, int], list[tuple[K, int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[K, int, int]]] = {}
    for rank, row in enumerate(table):
        for a in row:
            if not a.kind.is_comm:
                continue
            assert a.peer is not None and a.peer != rank
            nb = peers(rank, a.chunk, pp, vpp, placement_of(name))
            stage = _stage(rank, a, pp, name)
            if a.kind is K.SEND_ACT:
                assert a.peer == nb.next
                sends.setdefault((rank, a.peer), []).append((K.RECV_ACT, a.microbatch, stage + 1))
            elif a.kind is K.SEND_GRAD:
                assert a.peer == nb.prev
                sends.setdefault((rank, a.peer), []).append((K.RECV_GRAD, a.microbatch, stage - 1))
            else:
                assert a.peer == (nb.prev if a.kind is K.RECV_ACT else nb.next)
                recvs.setdefault((a.peer, rank), []).append((a.kind, a.microbatch, stage))
    assert sends == recvs
    crossings = sum(  # stage boundaries between two ranks
        stage_rank(s) != stage_rank(s + 1) for s in range(pp * vpp - 1)
        for stage_rank in [lambda s: rank_chunk_of(s, pp, placement_of(name))[0]]
    )
    assert sum(map(len, sends.values())) == 2 * m * crossings


# ------------------------------------------------------------------ simulation


def test_simulation_finishes_and_respects_dependencies(case):
    name, pp, m, vpp, table = case
    result = _simulate(name, table, pp, w_time=1.0 if _split(name) else None)
    done: dict[tuple[str, int, int], tuple[float, float]] = {}
    for rank, timeline in enumerate(result.timelines):
        for start, end, a in timeline:
            tag = "F" if a.kind is K.FORWARD else a.kind.value
            done[(tag, a.microbatch, _stage(rank, a, pp, name))] = (start, end)
    last = pp * vpp - 1
    for (tag, mb, s), (start, _) in done.items():
        if tag == "F" and s > 0:
            assert start >= done[("F", mb, s - 1)][1]
        if tag in ("B", "I"):
            assert start >= done[("F", mb, s)][1]
            if s < last:
                assert start >= done[(tag, mb, s + 1)][1]
        if tag == "W":
            assert start >= done[("I", mb, s)][1]


def test_no_deadlock_whatever_the_timing(case):
    """Deadlock freedom does not rest on the durations the tables were planned for."""
    name, pp, _, _, table = case
    rng = random.Random(0)
    for _ in range(3):
        f, b = rng.uniform(0.2, 3), rng.uniform(0.2, 3)
        w, comm = rng.uniform(0, b), rng.uniform(0, 1)
        result = _simulate(name, table, pp, f_time=f, b_time=b, w_time=w, comm_time=comm)
        assert result.makespan >= result.ideal > 0


def test_peak_in_flight(case):
    name, pp, m, vpp, table = case
    peaks = _simulate(name, table, pp).peak_in_flight
    if name == "dualpipev":
        # the DualPipe table's activation per device, PP + 1 chunk units for PP = 2 pp stages;
        # one less on rank 0 when it has no steady state (m = 2 pp - 1)
        expected = [2 * pp + 1] * pp
        expected[0] -= m == 2 * pp - 1
        assert peaks == tuple(expected)
    elif name == "gpipe":
        assert peaks == tuple([m] * pp)
    elif name in ("1f1b", "interleaved"):
        # 1F1B: rank r holds min(m, pp - r); interleaving adds (vpp - 1) * pp chunk units.
        assert peaks == tuple(min(m * vpp, vpp * pp - r) for r in range(pp))
    else:
        # ZB-H1 keeps the 1F1B peak, pp, on every rank: W postponed by r on rank r.
        assert peaks == tuple([min(m, pp)] * pp)


def test_published_bubble_formulas(case):
    """f=1, b=2 (ZB: F=B=W=1, i.e. b_time=2 split 1+1), no communication cost."""
    name, pp, m, vpp, table = case
    result = _simulate(name, table, pp, f_time=1.0, b_time=2.0, w_time=1.0, comm_time=0.0)
    assert result.ideal == m * vpp * 3.0
    if name == "dualpipev":
        # (PP/2 - 1)(F&B + B - 3W) over PP = 2 pp chunk stages, F&B = F + B + W run one
        # after the other: (pp - 1)(1 + 3 - 3) = pp - 1 idle per rank, of 6 m of work
        expected = (pp - 1) / (6 * m)
    elif name in ("gpipe", "1f1b"):
        expected = (pp - 1) / m
    elif name == "interleaved":
        expected = (pp - 1) / (m * vpp)
    elif m >= pp:
        # ZB-H1 bubble time (p-1)(F+B-W) = p-1: one third of 1F1B's (p-1)(F+B+W).
        expected = (pp - 1) / (3 * m)
    else:
        # Too few micro-batches to fill the tail with W: (p-1)(F+B) - (m-1)W.
        expected = (2 * (pp - 1) - (m - 1)) / (3 * m)
    assert result.bubble == pytest.approx(expected, abs=1e-12)
    assert result.makespan == pytest.approx(result.ideal * (1 + expected))
    assert result.idle_fraction == pytest.approx(expected / (1 + expected))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 13), (8, 16)])
def test_zero_bubble_is_one_third_of_1f1b(pp, m):
    zb = simulate(build_schedule("zb-h1", pp, m), pp, b_time=2.0, w_time=1.0)
    ofob = simulate(build_schedule("1f1b", pp, m), pp, b_time=2.0)
    assert zb.makespan - zb.ideal == pytest.approx(pp - 1)
    assert zb.bubble == pytest.approx(ofob.bubble / 3)


PLAN = {K.FORWARD: 1.0, K.BACKWARD: 2.0, K.BACKWARD_INPUT: 1.0, K.BACKWARD_WEIGHT: 1.0}


def _model_makespan(table, pp: int, latency: float = 0.0) -> float:
    times = executor_model(table, pp, lambda rank, a: PLAN[a.kind], latency)
    return max((t[-1][1] for t in times if t), default=0.0)


def test_executor_model_without_latency_keeps_the_blocking_makespan(case):
    """With the planned durations and free transfers, posting sends early and waiting for a
    receive only at its consumer finishes exactly when the blocking simulator does."""
    name, pp, _, _, table = case
    planned = executor_model(table, pp, lambda rank, a: PLAN[a.kind], placement=placement_of(name))
    makespan = max((t[-1][1] for t in planned if t), default=0.0)
    assert makespan == pytest.approx(_simulate(name, table, pp, 1.0, 2.0, 1.0).makespan)


@pytest.mark.parametrize("name, pp, m, transfers", [
    ("gpipe", 2, 8, 2), ("gpipe", 4, 8, 6),  # the first micro-batch's way down and back: 2(pp-1)
    ("1f1b", 2, 4, 4), ("1f1b", 2, 8, 8),  # pp=2 steady state is in lock-step: one per micro-batch
    ("zb-h1", 2, 8, 4), ("zb-h1", 2, 16, 4),  # deferred W gives the steady state slack
])
def test_executor_model_exposes_each_schedules_transfer_latency(name, pp, m, transfers):
    """How many transfer latencies lie on a schedule's critical path: the share of the measured
    bubble that transfers can explain."""
    table = build_schedule(name, pp, m)
    latency = 0.125
    added = _model_makespan(table, pp, latency) - _model_makespan(table, pp)
    assert added == pytest.approx(transfers * latency)


def test_executor_model_takes_per_rank_durations():
    """A rank slower by d per action stretches 1F1B by d per action of its steady state."""
    table = build_schedule("1f1b", 2, 4)
    slow = executor_model(table, 2, lambda rank, a: PLAN[a.kind] * (1.5 if rank == 1 else 1.0))
    assert [len(t) for t in slow] == [8, 8]
    # rank 1 runs its 4 forwards and backwards back to back once its first input is there
    assert slow[1][-1][1] == pytest.approx(1.0 + 4 * 1.5 * 3.0)


def test_comm_cost_slows_but_does_not_break():
    table = build_schedule("interleaved", 4, 8, 2)
    fast = simulate(table, 4)
    slow = simulate(table, 4, comm_time=0.1)
    assert slow.makespan > fast.makespan


# ---------------------------------------------------------- simulator as a checker


def test_simulator_reports_deadlock_with_stuck_actions():
    recv_grad = Action(K.RECV_GRAD, 0, 0, 1)
    table = [
        [Action(K.FORWARD, 0), recv_grad, Action(K.BACKWARD, 0)],
        [Action(K.RECV_ACT, 0, 0, 0), Action(K.FORWARD, 0), Action(K.BACKWARD, 0)],
    ]  # rank 0 never sends its activation
    with pytest.raises(DeadlockError) as err:
        simulate(table, 2)
    assert err.value.stuck == {0: (recv_grad,), 1: (Action(K.RECV_ACT, 0, 0, 0),)}


def test_simulator_rejects_crossed_messages():
    table = build_schedule("gpipe", 2, 2)
    rank1 = list(table[1])
    i, j = rank1.index(Action(K.RECV_ACT, 0, 0, 0)), rank1.index(Action(K.RECV_ACT, 1, 0, 0))
    rank1[i], rank1[j] = rank1[j], rank1[i]
    with pytest.raises(ValueError, match="is matched by"):
        simulate([table[0], rank1], 2)


def test_simulator_rejects_compute_without_input():
    row = [Action(K.FORWARD, 0), Action(K.BACKWARD, 0)]
    table = [row, list(row)]  # rank 1 never receives its input
    with pytest.raises(ValueError, match="comes before its (activation|gradient) is received"):
        simulate(table, 2)
