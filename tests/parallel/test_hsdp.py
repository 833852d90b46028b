"""Hybrid sharding (HSDP): ZeRO state sharded over groups of `dp_shard` data-parallel ranks and
replicated over the dp / dp_shard groups; parity with one process in every ZeRO stage and
with tp, cp, ep and pp; the rank order of the groups; bad input refused before launch."""

from __future__ import annotations

import pytest

from fivefold.config import load_config
from fivefold.rules.layout import LayoutError, group_ranks, validate

from helpers import many_layout_parity


def _cfg(preset: str, *extra: str, **layout):
    overrides = [f"layout.{k}={v}" for k, v in layout.items()]
    return load_config(preset, ["train.seq_len=16", *extra, *overrides])


def test_shard_groups_are_neighbouring_ranks_and_replicas_sit_a_group_apart():
    layout = _cfg("tiny", dp=4, dp_shard=2, zero=2, tp=2).layout
    assert group_ranks(layout, "dp_cp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(layout, "dp_cp_rep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = _cfg("tiny", dp=6, dp_shard=2, zero=3).layout
    assert group_ranks(layout, "dp_cp_shard") == [[0, 1], [2, 3], [4, 5]]
    assert group_ranks(layout, "dp_cp_rep") == [[0, 2, 4], [1, 3, 5]]
    # with cp, a shard group is dp_shard x cp consecutive ranks
    layout = _cfg("tiny", dp=2, dp_shard=1, cp=2, zero=3).layout
    assert group_ranks(layout, "dp_cp_shard") == [[0, 1], [2, 3]]
    assert group_ranks(layout, "dp_cp_rep") == [[0, 2], [1, 3]]


def test_expert_shard_groups_lie_inside_the_data_shard_groups():
    layout = _cfg("tiny-moe", dp=8, dp_shard=4, ep=2, zero=2).layout
    assert group_ranks(layout, "edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert group_ranks(layout, "edp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(layout, "edp_rep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # experts spanning whole shard groups: nothing left to shard them over, every copy a replica
    layout = _cfg("tiny-moe", dp=4, dp_shard=2, ep=4, zero=2).layout
    assert group_ranks(layout, "edp_shard") == [[0], [1], [2], [3]]
    assert group_ranks(layout, "edp_rep") == [[0], [1], [2], [3]]


@pytest.mark.parametrize("layout, message", [
    (dict(dp=4, dp_shard=3, zero=2), "layout.dp_shard=3 does not divide dp=4; use one of 1, 2, 4"),
    (dict(dp=4, dp_shard=2), "layout.dp_shard=2 shards ZeRO state but zero=0; set layout.zero"),
    (dict(dp=4, dp_shard=1, zero=1), "layout.dp_shard=1 with cp=1 leaves one rank per shard group"),
])
def test_bad_shard_degree_is_refused_with_what_to_change(layout, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        validate(_cfg("tiny", **layout))


def test_experts_straddling_shard_groups_are_refused():
    with pytest.raises(LayoutError, match=r"ep=4 neither divides nor is a multiple of the shard group"):
        validate(_cfg("tiny-moe", "train.global_batch=12", dp=12, dp_shard=6, ep=4, zero=2))


FOUR_RANKS = [
    _cfg("tiny", dp=4, dp_shard=2, zero=1, grad_accum=2),
    _cfg("tiny", dp=4, dp_shard=2, zero=2, grad_accum=2),
    _cfg("tiny", dp=4, dp_shard=2, zero=3),
    _cfg("tiny", dp=2, dp_shard=1, cp=2, zero=3, cp_algorithm="ring"),  # shard over cp, replicate over dp
    _cfg("tiny-moe", dp=4, dp_shard=2, ep=2, zero=2),
]

EIGHT_RANKS = [
    _cfg("tiny", dp=4, dp_shard=2, tp=2, zero=3),
    _cfg("tiny", dp=4, dp_shard=2, tp=2, sequence_parallel=True, zero=2),
    _cfg("tiny", dp=4, dp_shard=2, pp=2, zero=2, grad_accum=2),
]


def test_hsdp_four_ranks_match_one_process(pools, reference):
    many_layout_parity(pools, reference, FOUR_RANKS)


def test_hsdp_eight_ranks_match_one_process(pools, reference):
    many_layout_parity(pools, reference, EIGHT_RANKS)


def test_three_replicas_match_one_process(pools, reference):
    configs = [_cfg("tiny", "train.global_batch=12", dp=6, dp_shard=2, zero=z) for z in (2, 3)]
    many_layout_parity(pools, reference, configs)


# ------------------------------------------------------------------ the planner's side of the rule


@pytest.mark.parametrize("preset, layout", [
    ("tiny", dict(dp=4, dp_shard=2, zero=2, tp=2)), ("tiny", dict(dp=6, dp_shard=3, zero=3, cp=2)),
    ("tiny", dict(dp=4, zero=1)), ("tiny", dict(dp=4, dp_shard=2, zero=0)),
    ("tiny-moe", dict(dp=8, dp_shard=4, ep=2, zero=2)), ("tiny-moe", dict(dp=4, dp_shard=2, ep=4, zero=3)),
    ("tiny-moe", dict(dp=2, dp_shard=1, cp=2, ep=4, zero=1)),
])
def test_the_planners_group_sizes_are_the_runtimes_groups(preset, layout):
    """`zero_groups` (what the planner costs) gives the sizes of the groups the mesh builds."""
    from fivefold.rules.layout import HYBRID_AXES, is_hybrid, zero_groups

    lay = load_config(preset, [f"layout.{k}={v}" for k, v in layout.items()]).layout
    groups = zero_groups(lay.dp, lay.cp, lay.ep, lay.zero, lay.dp_shard)
    if is_hybrid(lay):
        sizes = {axis: {len(g) for g in group_ranks(lay, axis)} for pair in HYBRID_AXES.values() for axis in pair}
    else:  # the mesh shards over the whole data axes, and has no replicas
        sizes = {"dp_cp_shard": {len(g) for g in group_ranks(lay, "dp_cp")}, "dp_cp_rep": {1},
                 "edp_shard": {len(g) for g in group_ranks(lay, "edp")}, "edp_rep": {1}}
    assert sizes == {"dp_cp_shard": {groups.dense_shard}, "dp_cp_rep": {groups.dense_replicas},
                     "edp_shard": {groups.expert_shard}, "edp_rep": {groups.expert_replicas}}


def test_plan_search_offers_node_sized_shard_groups_and_every_one_is_accepted():
    from fivefold.planner import load_model, search
    from fivefold.planner.bridge import runtime_config

    model = load_model("llama3-70b")
    found = search(model, gpus=64, hardware="H100-80GB", global_batch=512, top=None)
    hybrid = [lay for lay, _ in found if lay.zero_groups.dense_replicas > 1]
    assert hybrid, "no hybrid-sharded layout among the candidates"
    for lay in hybrid:
        assert lay.dp_shard * lay.cp * lay.tp == 8  # one shard group per node
        validate(runtime_config(model, lay))  # the runtime accepts what the planner proposes


def test_plan_compare_hsdp_shows_flat_zero3_against_each_shard_degree(capsys):
    from fivefold.tools.plan_cli import run_plan_cli

    assert run_plan_cli(["--compare", "hsdp", "--model", "llama3-70b", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "dp=64" in line]
    assert len(rows) == 6 and "dp_shard" not in rows[0]  # flat ZeRO-3 first, then shard groups of 32 .. 2
    states = [float(line.split("│")[4]) for line in rows]
    assert states == sorted(states) and states[-1] > 30 * states[0]  # sharding over fewer devices holds more


def test_planner_rejects_a_shard_degree_that_does_not_divide_dp():
    from fivefold.planner import LayoutSpec, PlanError

    with pytest.raises(PlanError, match="LayoutSpec.dp_shard=3 does not divide dp=4"):
        LayoutSpec(dp=4, dp_shard=3, zero=3, global_batch=4)
