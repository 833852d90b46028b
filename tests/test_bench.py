"""The benchmark summary: which pairs it states and how it computes their ratios."""

from __future__ import annotations

import pytest

from fivefold.tools.bench import headline_rows, per_round_ratio, suite_markdown


def _case(seconds: list[float], rss: float) -> dict:
    return {"seconds": seconds, "peak_rss_mb": rss, "median_s": sorted(seconds)[len(seconds) // 2]}


def test_per_round_ratio_pairs_rounds_before_taking_the_median():
    # Medians of each side alone would give 2.0 / 2.0 = 1; the rounds say the peer is slower.
    assert per_round_ratio([3.0, 2.0, 1.5], [1.0, 2.0, 1.0]) == pytest.approx(1.5)


def test_the_summary_states_peer_over_fivefold_for_pairs_run_side_by_side():
    outcomes = {
        "dp": [
            {"title": "dp vs ddp", "baseline": "fivefold-dp", "ratios": {"fivefold-dp": 1.0, "torch-ddp": 1.1},
             "cases": {"fivefold-dp": _case([1.0, 1.0, 1.0], 100.0), "torch-ddp": _case([1.1, 1.2, 1.0], 150.0)}},
            {"title": "zero2 alone", "baseline": "fivefold-zero2", "ratios": {"fivefold-zero2": 1.0},
             "cases": {"fivefold-zero2": _case([1.0], 90.0)}},
        ],
        "tp": "exit code 1",
    }
    rows = headline_rows(outcomes)
    assert rows == [("dp=2 vs torch DDP", "dp vs ddp", pytest.approx(1.1), pytest.approx(1.5))]
    markdown = suite_markdown(outcomes, {"cores": "2"})
    assert "| dp=2 vs torch DDP | dp vs ddp | 1.100 | 1.50 |" in markdown
    assert "did not finish: exit code 1" in markdown and "cores: 2" in markdown
    assert "ZeRO-2 vs fivefold dp" not in markdown  # zero2 never ran beside dp: no row, no guess
