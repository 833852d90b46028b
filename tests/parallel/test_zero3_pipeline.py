"""ZeRO-3 inside each pipeline stage: parameters gathered per block around each micro-batch's
forward and backward, for every schedule; parity with one process, the tied embedding included."""

from __future__ import annotations

from fivefold.config import load_config

from helpers import many_layout_parity


def _cfg(*extra: str, preset: str = "tiny", **layout):
    return load_config(preset, ["train.seq_len=16", *extra, *(f"layout.{k}={v}" for k, v in layout.items())])


def _moe(*extra: str, **layout):
    return _cfg(*extra, preset="tiny-moe", **layout)


SCHEDULES = [
    _cfg(pp=2, dp=2, zero=3, pp_schedule="gpipe", grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="1f1b", grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="interleaved", vpp=2, grad_accum=4),
    _cfg(pp=2, dp=2, zero=3, pp_schedule="zb-h1", grad_accum=4),
    _cfg("model.tied_embeddings=true", pp=2, dp=2, zero=3, pp_schedule="1f1b", grad_accum=4),
]


def test_zero3_in_every_pipeline_schedule_matches_one_process(pools, reference):
    many_layout_parity(pools, reference, SCHEDULES)


def test_zero3_in_a_pipeline_with_hybrid_sharding_matches_one_process(pools, reference):
    """Each stage's ZeRO-3 shard groups of 2 neighbouring ranks, replicated twice."""
    many_layout_parity(pools, reference, [_cfg(pp=2, dp=4, dp_shard=2, zero=3, pp_schedule="1f1b", grad_accum=2)])


def test_zero3_in_a_pipeline_with_tensor_and_sequence_parallel_matches_one_process(pools, reference):
    """Each stage's blocks hold tp-sharded matrices, themselves ZeRO-3-sharded over dp."""
    many_layout_parity(pools, reference, [
        _cfg(pp=2, dp=2, tp=2, sequence_parallel=True, zero=3, pp_schedule="1f1b", grad_accum=2),
        _cfg(pp=2, dp=2, tp=2, sequence_parallel=True, zero=3, pp_schedule="interleaved", vpp=2, grad_accum=4),
    ])


def test_zero3_in_a_pipeline_with_expert_parallel_matches_one_process(pools, reference):
    """Experts sharded over ep ranks, then ZeRO-3-sharded over their expert-data-parallel copies."""
    many_layout_parity(pools, reference, [_moe(pp=2, dp=2, ep=2, zero=3, pp_schedule="1f1b", grad_accum=2)])
    # dp=4: each expert has two copies, so its parameters are sharded too
    many_layout_parity(pools, reference, [_moe(pp=2, dp=4, ep=2, zero=3, pp_schedule="gpipe", grad_accum=2)])
