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
    if layout.schedule == "dualpipev":
        # DualPipe's repository (deepseek-ai/DualPipe, its table of schedules): PP + 1 chunks'
        # activations per device for PP = 2p chunks, i.e. p + 1/2 of a device's layers, on
        # every device alike (the V puts an early and a late chunk on each)
        return min(float(m), p + 0.5)
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
    two_chunks = layout.schedule == "dualpipev" or (layout.schedule == "interleaved" and layout.vpp > 1)
    rounds = 2 if two_chunks else 1
    return float(min(m, rounds * layout.pp))


def in_flight_output(layout: LayoutSpec) -> float:
    """Micro-batches whose logits the last stage holds: m for GPipe, otherwise 1."""
    if layout.pp > 1 and layout.schedule == "gpipe":
        return float(layout.num_micro_batches)
    return 1.0


def bubble_units(layout: LayoutSpec, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle time per device per step, in units of one micro-batch's F+B+W time, with the
    F/B/W times of the layer (`fivefold.rules.stages.bubble_units`, which the runtime's timeline
    also uses); DualPipeV's by `dualpipev_bubble_units`."""
    if layout.schedule == "dualpipev" and layout.pp > 1:
        return dualpipev_bubble_units(layout.pp, t_f, t_b, t_w)
    return stage_bubble_units(layout.schedule, layout.pp, layout.num_micro_batches, layout.vpp, t_f, t_b, t_w)


def bubble_fraction(layout: LayoutSpec, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Bubble time over ideal compute time: `bubble_units` / m."""
    return bubble_units(layout, t_f, t_b, t_w) / layout.num_micro_batches


def dualpipev_bubble_units(pp: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """DualPipeV's bubble, a planner formula until the runtime's schedule tables have it.

    DualPipe's repository (deepseek-ai/DualPipe) gives DualPipeV's bubble on p devices of two
    chunks each as (p - 1)(F&B + B - 3W) in chunk times, with B the full backward (input and
    weight gradients) and F&B an overlapped forward-backward pair (DeepSeek-V3, arXiv
    2412.19437, Table 2). A chunk holds half a device's layers, so with this device's F, B
    (input gradient) and W per micro-batch, F&B = (F + B + W) / 2 (the communication a pair
    leaves exposed scales the unit, as for every schedule) and the bubble is
    (p - 1)(F + 2B - W) / 2, here in units of F + B + W."""
    idle = (pp - 1) * (t_f + 2 * t_b - t_w) / 2
    return max(idle, 0.0) / (t_f + t_b + t_w)


# Streaming multiprocessors DeepSeek-V3's all-to-all kernels occupy while DualPipe overlaps them
# with computation (arXiv 2412.19437, Section 3.2.2: "only 20 SMs are sufficient").
DUALPIPE_COMM_SMS = 20


def dualpipev_compute_share(sm_count: int, ep: int) -> float:
    """The share of a device's SMs left to computation under DualPipeV with expert parallelism
    (`DUALPIPE_COMM_SMS` run the all-to-alls); 1 without an SM count or without ep."""
    if ep == 1 or sm_count <= DUALPIPE_COMM_SMS:
        return 1.0
    return (sm_count - DUALPIPE_COMM_SMS) / sm_count


def dualpipev_exposed(comm_s: float, compute_s: float, pp: int, mbs: int) -> float:
    """Seconds of a step's expert and pipeline communication (``comm_s``) that DualPipeV leaves
    exposed. Each forward chunk runs beside another micro-batch's backward chunk, whose compute
    hides its all-to-alls and sends (DeepSeek-V3, Section 3.2.1), up to that compute. The
    forwards of the first p micro-batches (warm-up) and the backwards of the last p (cool-down)
    have no partner: p / m of the communication stays exposed."""
    unpaired = min(1.0, pp / mbs)
    paired = 1.0 - unpaired
    return unpaired * comm_s + max(0.0, paired * comm_s - paired * compute_s)
