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
