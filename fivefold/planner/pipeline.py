"""Pipeline stages: layer split, micro-batches in flight, and the bubble of each schedule."""

from __future__ import annotations

from ..rules.stages import bubble_units as stage_bubble_units
from ..rules.stages import rank_layer_ids, stage_layer_counts
from .bridge import model_config
from .spec import LayoutSpec, ModelSpec


def stage_layers(model: ModelSpec, layout: LayoutSpec) -> list[list[int]]:
    """Layer indices held by each pipeline device (all of its ``vpp`` chunks): the runtime's
    split (`fivefold.rules.stages`), including ``layout.pp_layers``."""
    counts = stage_layer_counts(model_config(model), model.seq_len, layout.pp, layout.vpp, layout.pp_layers)
    return rank_layer_ids(counts, layout.pp)


def in_flight(layout: LayoutSpec, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's
    full set of layers.

    * no pipeline: 1 (gradient accumulation runs forward and backward per micro-batch);
    * GPipe (Huang et al. 2019): all m forwards run before the first backward: m;
    * 1F1B (Narayanan et al. 2021, PipeDream-Flush) and ZB-H1 (Qi et al. 2023, same peak
      memory as 1F1B): stage i warms up with p - i forwards: min(m, p - i);
    * interleaved: fivefold's table (`rules.schedules.interleaved_1f1b`) holds at most
      v p - i chunk forwards on stage i, each 1/v of the stage's layers: p on the first
      stage whatever v. Megatron-LM's table warms up longer, 2(p - i - 1) + (v - 1)p + 1
      chunks (the factor p(1 + (p - 1)/(p v)) of Korthikanti et al. 2022, Section 4.2.3);
      fivefold plans for the table it runs (tests/rules/test_shared_rules.py replays it).
    """
    p, m, v = layout.pp, layout.num_micro_batches, layout.vpp
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved":
        return min(v * p - stage, m * v) / v
    return float(min(m, p - stage))


def in_flight_embedding(layout: LayoutSpec) -> float:
    """Micro-batches whose embedding activations the first stage holds at peak: the
    forwards its first chunk runs before that chunk's first backward (with interleaving,
    fivefold's table runs two rounds of p before it)."""
    if layout.pp == 1:
        return 1.0
    m = layout.num_micro_batches
    if layout.schedule == "gpipe":
        return float(m)
    rounds = 2 if layout.schedule == "interleaved" and layout.vpp > 1 else 1
    return float(min(m, rounds * layout.pp))


def in_flight_output(layout: LayoutSpec) -> float:
    """Micro-batches whose logits the last stage holds: m for GPipe, otherwise 1."""
    if layout.pp > 1 and layout.schedule == "gpipe":
        return float(layout.num_micro_batches)
    return 1.0


def bubble_units(layout: LayoutSpec, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle time per device per step, in units of one micro-batch's F+B+W time, with the
    F/B/W times of the layer (`fivefold.rules.stages.bubble_units`, which the runtime's timeline
    also uses)."""
    return stage_bubble_units(layout.schedule, layout.pp, layout.num_micro_batches, layout.vpp, t_f, t_b, t_w)


def bubble_fraction(layout: LayoutSpec, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Bubble time over ideal compute time: `bubble_units` / m."""
    return bubble_units(layout, t_f, t_b, t_w) / layout.num_micro_batches
