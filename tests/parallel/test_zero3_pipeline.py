"""ZeRO-3 inside each pipeline stage: parameters gathered per block around each micro-batch's
forward and backward, for every schedule; parity with one process, the tied embedding included."""

from __future__ import annotations

from fivefold.config import load_config

from helpers import many_layout_parity


def _cfg(*extra: str, **layout):
    return load_config("tiny", ["train.seq_len=16", *extra, *(f"layout.{k}={v}" for k, v in layout.items())])


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
