"""Pipeline stages: layer split, micro-batches in flight, and the bubble of each schedule."""

from __future__ import annotations

from .spec import LayoutSpec, ModelSpec


def chunk_sizes(layers: int, chunks: int) -> list[int]:
    """Layers per model chunk in pipeline order (chunk j lives on device j % pp).

    Even when possible; otherwise the extra layers go to the chunks farthest from both
    ends, because the first and last chunks also carry the embedding and the output layer.
    """
    base, extra = divmod(layers, chunks)
    order = sorted(range(chunks), key=lambda j: (-min(j, chunks - 1 - j), j))
    sizes = [base] * chunks
    for j in order[:extra]:
        sizes[j] += 1
    return sizes


def stage_layers(model: ModelSpec, layout: LayoutSpec) -> list[list[int]]:
    """Layer indices held by each pipeline device (all of its ``vpp`` chunks)."""
    p, v = layout.pp, layout.vpp
    sizes = chunk_sizes(model.layers, p * v)
    stages: list[list[int]] = [[] for _ in range(p)]
    start = 0
    for j, n in enumerate(sizes):
        stages[j % p].extend(range(start, start + n))
        start += n
    return stages


def in_flight(layout: LayoutSpec, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's
    full set of layers.

    * no pipeline: 1 (gradient accumulation runs forward and backward per micro-batch);
    * GPipe (Huang et al. 2019): all m forwards run before the first backward: m;
    * 1F1B (Narayanan et al. 2021, PipeDream-Flush) and ZB-H1 (Qi et al. 2023, same peak
      memory as 1F1B): stage i warms up with p - i forwards: min(m, p - i);
    * interleaved (Narayanan et al. 2021): stage i runs 2(p - i - 1) + (v - 1)p + 1 chunk
      forwards before its first backward (Megatron-LM's warm-up count), each holding 1/v of
      the stage's layers. On the first stage this is p(1 + (p - 1)/(p v)), the factor
      reported by Korthikanti et al. 2022 (Section 4.2.3).
    """
    p, m, v = layout.pp, layout.num_micro_batches, layout.vpp
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved":
        chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
        return chunks / v
    return float(min(m, p - stage))


def in_flight_embedding(layout: LayoutSpec) -> float:
    """Micro-batches whose embedding activations the first stage holds at peak."""
    if layout.pp == 1:
        return 1.0
    m = layout.num_micro_batches
    return float(m) if layout.schedule == "gpipe" else float(min(m, layout.pp))


def in_flight_output(layout: LayoutSpec) -> float:
    """Micro-batches whose logits the last stage holds: m for GPipe, otherwise 1."""
    if layout.pp > 1 and layout.schedule == "gpipe":
        return float(layout.num_micro_batches)
    return 1.0


def bubble_units(layout: LayoutSpec, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle time per device per step, in units of one micro-batch's F+B+W time.

    With p stages, m micro-batches and v chunks per device:

    * GPipe, 1F1B: p - 1 (Narayanan et al. 2021: bubble fraction (p - 1)/m);
    * interleaved: (p - 1)/v (Narayanan et al. 2021: (p - 1)/(m v));
    * ZB-H1: splitting the backward into B (input gradient) and W (weight gradient) lets
      each stage defer W into the cool-down; Qi et al. 2023 ("Zero Bubble Pipeline
      Parallelism", Section 2.2) give the bubble as (p - 1)(T_F + T_B - T_W) instead of
      1F1B's (p - 1)(T_F + T_B + T_W). With the F/B/W times of the layer passed in
      (derived from FLOPs by the cost model) this is (p - 1)(F + B - W)/(F + B + W); for
      T_F = T_B = T_W it is one third of 1F1B's bubble. With m < p micro-batches there are
      too few W to fill the tail: (p - 1)(F + B) - (m - 1) W (the runtime's table,
      `parallel.schedules.zero_bubble_h1`, idles exactly that long).
    """
    p = layout.pp
    if p == 1:
        return 0.0
    if layout.schedule == "interleaved":
        return (p - 1) / layout.vpp
    if layout.schedule == "zb-h1":
        m = layout.num_micro_batches
        idle = (p - 1) * (t_f + t_b - t_w) if m >= p else (p - 1) * (t_f + t_b) - (m - 1) * t_w
        return max(idle, 0.0) / (t_f + t_b + t_w)
    return float(p - 1)


def bubble_fraction(layout: LayoutSpec, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Bubble time over ideal compute time: `bubble_units` / m."""
    return bubble_units(layout, t_f, t_b, t_w) / layout.num_micro_batches
