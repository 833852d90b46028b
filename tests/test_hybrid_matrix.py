"""The layout parity matrix: every pair of axes and 3D/4D combinations against one process.

Each layout trains the tiny dense or MoE model for two steps from the same seed and data as
the single-process reference; per-step loss and final parameters must match (DESIGN.md).
Layouts of one world size share one pool call.
"""

from __future__ import annotations


from fivefold.config import load_config

from helpers import many_layout_parity


def _cfg(preset: str, **layout):
    overrides = [f"layout.{k}={v}" for k, v in layout.items()]
    return load_config(preset, ["train.seq_len=16", *overrides])  # divisible by 2*cp*tp for every entry


FOUR_RANKS = [
    _cfg("tiny", dp=2, tp=2),
    _cfg("tiny", dp=2, tp=2, sequence_parallel=True, zero=1),
    _cfg("tiny", dp=2, pp=2, grad_accum=2),
    _cfg("tiny", dp=2, pp=2, zero=2, pp_schedule="gpipe", grad_accum=4),
    _cfg("tiny", dp=2, cp=2, cp_algorithm="ring"),
    _cfg("tiny", dp=2, cp=2, cp_algorithm="allgather", zero=1),
    _cfg("tiny-moe", dp=4, ep=2),
    _cfg("tiny", tp=2, pp=2, grad_accum=2),
    _cfg("tiny", tp=2, pp=2, sequence_parallel=True, vpp=2, pp_schedule="interleaved", grad_accum=2),
    _cfg("tiny", tp=2, cp=2, cp_algorithm="allgather"),
    _cfg("tiny", tp=2, cp=2, cp_algorithm="ring"),
    _cfg("tiny", pp=2, cp=2, cp_algorithm="ring", grad_accum=2),
    _cfg("tiny-moe", pp=2, dp=2, ep=2, grad_accum=2),
    _cfg("tiny-moe", dp=2, cp=2, ep=2, cp_algorithm="ulysses"),
    _cfg("tiny-moe", tp=2, dp=2, ep=2),
]

EIGHT_RANKS = [
    _cfg("tiny", dp=2, tp=2, pp=2, grad_accum=2),  # 3D
    _cfg("tiny", tp=2, cp=2, pp=2, cp_algorithm="ring", grad_accum=2),
    _cfg("tiny-moe", dp=2, ep=2, tp=2, pp=2, zero=1, grad_accum=2),  # 4D with experts
    _cfg("tiny-moe", dp=2, cp=2, ep=4, tp=2, cp_algorithm="allgather"),  # 4D with experts
    _cfg("tiny", pp=2, tp=2, cp=2, cp_algorithm="ring", sequence_parallel=True, grad_accum=2),
    _cfg("tiny", dp=2, tp=2, cp=2, zero=3, cp_algorithm="ring"),  # ZeRO-3 with tp and cp (with pp: test_zero3_pipeline.py)
    _cfg("tiny", dp=2, tp=2, pp=2, zero=1, pp_schedule="zb-h1", grad_accum=4),
    _cfg("tiny", dp=2, tp=2, cp=2, cp_algorithm="allgather", sequence_parallel=True),
    _cfg("tiny-moe", tp=2, cp=2, pp=2, ep=2, cp_algorithm="ring", grad_accum=2),  # 4D with experts
    _cfg("tiny-moe", dp=4, tp=2, ep=4, zero=2),
]


def test_four_rank_layouts(pools, reference):
    many_layout_parity(pools, reference, FOUR_RANKS)


def test_eight_rank_layouts(pools, reference):
    many_layout_parity(pools, reference, EIGHT_RANKS)


def test_matrix_covers_every_pair_of_axes():
    axes = ("dp", "tp", "pp", "cp", "ep")
    covered = set()
    for config in FOUR_RANKS + EIGHT_RANKS:
        used = [a for a in axes if getattr(config.layout, a) > 1]
        covered |= {(a, b) for a in used for b in used if a < b}
    missing = {(a, b) for a in axes for b in axes if a < b} - covered
    assert not missing
    assert len(FOUR_RANKS) + len(EIGHT_RANKS) >= 24
