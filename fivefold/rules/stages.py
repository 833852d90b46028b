"""Pipeline stages as arithmetic: the layer split and the bubble of each schedule.

Pure functions (no torch), shared by the runtime (`parallel.pipeline` builds the chunks
this split names, `timeline` compares the measured bubble with `bubble_share`) and the
planner (`planner.pipeline` predicts memory and time from the same split and bubble), so
the two can never disagree on which layers a pipeline rank holds or how long it idles.

Stage split
    The model is cut into pp x vpp virtual stages of consecutive layers. Without an
    explicit `layout.pp_layers`, the cut minimises the most expensive stage under a cost
    estimate (multiply-adds per token of each block, plus the head on the last stage).
    Which pipeline rank holds virtual stage s is `rules.placement`'s rule: s % pp as its
    chunk s // pp, or, under DualPipeV's V, rank s (chunk 0) or 2 pp - 1 - s (chunk 1).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..config import ModelConfig
from .placement import Placement, rank_of_stage


def layer_cost(model: ModelConfig, index: int, seq_len: int) -> float:
    """Forward multiply-adds per token of block `index`; only the ratios between stages matter."""
    h, hd = model.hidden, model.head_dim
    projections = 2 * h * model.heads * hd + 2 * h * model.n_kv_heads * hd
    scores = seq_len * model.heads * hd  # QK^T and AV, half of each under the causal mask
    if model.is_moe_layer(index):
        mlp = h * model.num_experts + (model.top_k + model.shared_experts) * 3 * h * model.expert_ffn
    else:
        mlp = 3 * h * model.ffn
    return float(projections + scores + mlp)


def head_cost(model: ModelConfig) -> float:
    """The output projection and the loss, per token (the embedding lookup is nearly free)."""
    return float(model.hidden * model.vocab_size + model.vocab_size)


def balanced_counts(costs: list[float], stages: int, last_extra: float = 0.0) -> list[int]:
    """Layers per stage, consecutive, at least one each, minimising the costliest stage.

    `last_extra` is added to the last stage. Ties are broken by the sum of squared stage
    costs, so the load is spread as evenly as the bottleneck allows; among exact ties the
    earliest cut wins.

    Dynamic programming over (stages, layers), each stage's row computed as numpy blocks of
    (layer, cut) candidates, so a model of thousands of layers is cut in a second.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages of at least one layer")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=np.float64))))
    # (bottleneck, sum of squares) of the first i layers cut into s stages, and that cut's last cut
    bottleneck, squares = np.full(n + 1, np.inf), np.full(n + 1, np.inf)
    bottleneck[0] = squares[0] = 0.0
    cuts = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for s in range(1, stages + 1):
        extra = last_extra if s == stages else 0.0
        ends = np.arange(s, n - (stages - s) + 1)
        row = _stage_row(bottleneck, squares, prefix, s, ends, extra)
        bottleneck, squares = np.full(n + 1, np.inf), np.full(n + 1, np.inf)
        bottleneck[ends], squares[ends], cuts[s, ends] = row
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = int(cuts[s, i])
        counts.append(i - j)
        i = j
    return counts[::-1]


_BLOCK_CELLS = 1 << 22  # candidates compared at once (32 MiB per float64 matrix)


def _stage_row(bottleneck: np.ndarray, squares: np.ndarray, prefix: np.ndarray, s: int, ends: np.ndarray,
               extra: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each i in `ends`: (bottleneck, sum of squares, cut j) of the best s-th stage holding
    layers j..i-1 after the best s-1 stages of the first j layers; ties go to the smallest j.

    A last stage costing more than the one-layer candidate's bottleneck cannot win, so each i
    compares only the cuts under that bound (loosened by a relative 1e-9, so that rounding
    never drops a contender)."""
    one_layer = np.maximum(bottleneck[ends - 1], prefix[ends] - prefix[ends - 1] + extra)
    slack = 1e-9 * np.maximum(np.abs(prefix[ends]), 1.0)
    first = np.maximum(np.searchsorted(prefix, prefix[ends] + extra - one_layer - slack, side="left") - 1, s - 1)
    out_b, out_sq, out_j = np.empty(len(ends)), np.empty(len(ends)), np.empty(len(ends), dtype=np.int64)
    start = 0
    while start < len(ends):
        stop = _block_end(ends, first, start)
        block = slice(start, stop)
        out_b[block], out_sq[block], out_j[block] = _best_cuts(bottleneck, squares, prefix, ends[block],
                                                               first[block], extra)
        start = stop
    return out_b, out_sq, out_j


def _block_end(ends: np.ndarray, first: np.ndarray, start: int) -> int:
    """The end of a block of rows from `start` whose (rows x cuts) matrix stays near `_BLOCK_CELLS`."""
    stop = start + 1
    while stop < len(ends) and (stop + 1 - start) * (ends[stop] - first[start]) <= _BLOCK_CELLS:
        stop = min(len(ends), start + 2 * (stop - start))
    return stop


def _best_cuts(bottleneck: np.ndarray, squares: np.ndarray, prefix: np.ndarray, ends: np.ndarray,
               first: np.ndarray, extra: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_stage_row` for one block of rows, as (rows x cuts) matrices."""
    cut = np.arange(first.min(), ends.max())[None, :]
    valid = (cut >= first[:, None]) & (cut < ends[:, None])
    cost = (prefix[ends][:, None] - prefix[cut]) + extra
    candidate_bottleneck = np.where(valid, np.maximum(bottleneck[cut], cost), np.inf)
    candidate_squares = np.where(valid, squares[cut] + cost * cost, np.inf)
    best = candidate_bottleneck.min(axis=1)
    tied = candidate_bottleneck == best[:, None]
    least = np.where(tied, candidate_squares, np.inf).min(axis=1)
    chosen = np.argmax(tied & (candidate_squares == least[:, None]), axis=1)
    return best, least, cut[0, chosen]


def stage_layer_counts(model: ModelConfig, seq_len: int, pp: int, vpp: int = 1,
                       pp_layers: Sequence[int] = ()) -> list[int]:
    """Layers of each of the pp x vpp virtual stages: `pp_layers` if given, else the balanced cut."""
    if pp_layers:
        return list(pp_layers)
    costs = [layer_cost(model, i, seq_len) for i in range(model.layers)]
    return balanced_counts(costs, pp * vpp, head_cost(model))


def stage_layer_ids(counts: Sequence[int]) -> list[list[int]]:
    """Global layer indices of every virtual stage, in model order, from its layer counts."""
    ids, start = [], 0
    for count in counts:
        ids.append(list(range(start, start + count)))
        start += count
    return ids


def rank_layer_ids(counts: Sequence[int], pp: int, placement: Placement = "loop") -> list[list[int]]:
    """Layer indices each pipeline rank holds (all of its chunks), under `placement`."""
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for stage, ids in enumerate(stage_layer_ids(counts)):
        ranks[rank_of_stage(stage, pp, placement)].extend(ids)
    return ranks


# ---------------------------------------------------------------------------------- bubble


def bubble_units(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
                 t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle time per device per step, in units of one micro-batch's F+B+W time.

    With p stages, m micro-batches and v chunks per device:

    * GPipe, 1F1B: p - 1 (Narayanan et al. 2021: bubble fraction (p - 1)/m);
    * interleaved: (p - 1)/v (Narayanan et al. 2021: (p - 1)/(m v));
    * ZB-H1: splitting the backward into B (input gradient) and W (weight gradient) lets
      each stage defer W into the cool-down; Qi et al. 2023 ("Zero Bubble Pipeline
      Parallelism", Section 2.2) give the bubble as (p - 1)(T_F + T_B - T_W) instead of
      1F1B's (p - 1)(T_F + T_B + T_W), i.e. (p - 1)(F + B - W)/(F + B + W) in these units;
      for T_F = T_B = T_W it is one third of 1F1B's bubble. With m < p micro-batches there
      are too few W to fill the tail: (p - 1)(F + B) - (m - 1) W (the runtime's table,
      `rules.schedules.zero_bubble_h1`, idles exactly that long).
    * DualPipeV: the DualPipe repository's table gives (PP/2 - 1)(F&B + B - 3W) for PP
      stages, here 2p chunks of half a device's layers each; run one after the other (no
      overlap) a paired forward and backward take F&B = F + B + W, so a device idles
      (p - 1)(F + 2B - 2W)/2 in whole-device times. The runtime's table
      (`rules.schedules.dualpipev`, planned for F = B = W) idles exactly that long with
      F = B = W: (p - 1)/6, half of ZB-H1's.
    """
    p, m = pp, num_microbatches
    if p == 1:
        return 0.0
    if schedule == "interleaved":
        return (p - 1) / vpp
    if schedule == "dualpipev":
        return max((p - 1) * (t_f + 2 * t_b - 2 * t_w) / 2, 0.0) / (t_f + t_b + t_w)
    if schedule == "zb-h1":
        idle = (p - 1) * (t_f + t_b - t_w) if m >= p else (p - 1) * (t_f + t_b) - (m - 1) * t_w
        return max(idle, 0.0) / (t_f + t_b + t_w)
    return float(p - 1)


def bubble_share(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Idle share of the whole step, idle / (busy + idle), with F = B = W (backward = 2 x forward).

    GPipe and 1F1B: (p - 1) / (m + p - 1); interleaved: (p - 1) / (v m + p - 1); ZB-H1:
    (p - 1) / (3 m + p - 1), or (2(p - 1) - (m - 1)) / (3 m + 2(p - 1) - (m - 1)) when m < p.
    """
    units = bubble_units(schedule, pp, num_microbatches, vpp)
    return units / (num_microbatches + units)
