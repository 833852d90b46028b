"""Which pipeline rank holds which virtual stage: the one description of chunk placement.

The model is cut into pp x vpp virtual stages; pipeline rank r holds vpp of them, its
chunks 0..vpp-1. Two placements exist:

    loop  stages visit the ranks round-robin: chunk c of rank r is stage c * pp + r
          (GPipe, 1F1B, zb-h1 with vpp = 1; interleaved 1F1B with vpp > 1). The last
          rank's chunk c feeds rank 0's chunk c + 1.
    v     two chunks per rank, down the ranks and back up (DualPipeV): chunk 0 of rank
          r is stage r, chunk 1 is stage 2 pp - 1 - r. The first and the last stage
          both live on rank 0, and stages pp - 1 and pp are the two chunks of the last
          rank, which hand each other activations and gradients without communication.

The executor, the schedule tables, the stage split and the checkpoint code all ask here,
so they cannot disagree on which layers a rank holds.
"""

from __future__ import annotations

from typing import Literal

Placement = Literal["loop", "v"]
V_SCHEDULES = ("dualpipev",)  # schedules whose chunks are placed in a V


def placement_of(schedule: str) -> Placement:
    """The chunk placement a pipeline schedule runs on."""
    return "v" if schedule.lower() in V_SCHEDULES else "loop"


def stage_of(rank: int, chunk: int, pp: int, placement: Placement = "loop") -> int:
    """Virtual stage held by ``chunk`` of pipeline ``rank``."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_chunk_of(stage: int, pp: int, placement: Placement = "loop") -> tuple[int, int]:
    """Inverse of :func:`stage_of`: the (rank, chunk) holding a virtual stage."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def rank_of_stage(stage: int, pp: int, placement: Placement = "loop") -> int:
    """The pipeline rank holding a virtual stage."""
    return rank_chunk_of(stage, pp, placement)[0]
