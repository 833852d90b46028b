"""The balanced stage split (rules/stages.py `balanced_counts`) against a plain reference: the
same dynamic programme written as nested Python loops (the implementation before it compared
candidates as numpy blocks), on random costs with many exact ties; and the planner's bound on depth."""

from __future__ import annotations

import random

import pytest

from fivefold.planner import PlanError
from fivefold.planner.spec import MAX_PLANNED_LAYERS, ModelSpec
from fivefold.rules.stages import balanced_counts


def reference_counts(costs: list[float], stages: int, last_extra: float = 0.0) -> list[int]:
    """Minimise the costliest stage, then the sum of squared stage costs; the smallest cut wins ties."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"), 0)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0, 0)
    for s in range(1, stages + 1):
        extra = last_extra if s == stages else 0.0
        for i in range(s, n - (stages - s) + 1):
            chosen = inf
            for j in range(i - 1, s - 2, -1):
                cost = prefix[i] - prefix[j] + extra
                p = best[s - 1][j]
                candidate = (max(p[0], cost), p[1] + cost * cost, j)
                if candidate[:2] <= chosen[:2]:
                    chosen = candidate
            best[s][i] = chosen
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = best[s][i][2]
        counts.append(i - j)
        i = j
    return counts[::-1]


def _costs(rng: random.Random, n: int) -> list[float]:
    kind = rng.randrange(3)
    if kind == 0:
        return [float(rng.randint(0, 3)) for _ in range(n)]  # many exact ties, zero-cost layers
    if kind == 1:
        return [rng.choice([1.0, 2.5]) for _ in range(n)]  # dense and MoE blocks
    return [rng.random() for _ in range(n)]


def test_the_split_equals_the_reference_on_random_costs():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 40)
        stages = rng.randint(1, n)
        costs, extra = _costs(rng, n), rng.choice([0.0, 1.0, rng.random() * 5])
        assert balanced_counts(costs, stages, extra) == reference_counts(costs, stages, extra), (costs, stages, extra)


@pytest.mark.parametrize("stages", [4, 16])
def test_a_deep_model_is_cut_as_the_reference_cuts_it(stages):
    costs = [1.0 + 0.7 * (i % 3 == 2) for i in range(300)]  # every third block an expert layer
    assert balanced_counts(costs, stages, 3.0) == reference_counts(costs, stages, 3.0)


def test_the_planner_refuses_a_model_deeper_than_it_handles_in_one_line():
    ModelSpec(layers=MAX_PLANNED_LAYERS, hidden=64, heads=4, vocab=256)
    with pytest.raises(PlanError, match="layers=1,000,000 is more than the planner handles"):
        ModelSpec(layers=10**6, hidden=64, heads=4, vocab=256)
