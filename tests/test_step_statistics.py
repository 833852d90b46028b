"""What a training step measures besides training, and what that costs."""

from __future__ import annotations

import json

import torch

import fivefold.train
from fivefold.cli import main
from fivefold.config import load_config
from fivefold.observe.held_memory import held_memory
from fivefold.model import Transformer


def test_held_memory_is_walked_only_at_the_step_a_run_reports_it(tmp_path, monkeypatch):
    """Runs report held bytes at their first step; a walk over every tensor at every other step
    (about a millisecond on the small preset) would only be thrown away. The one reported is
    the storage really held: fp32 AdamW holds 4 + 4 + 8 bytes per parameter."""
    walks = []

    def counted(chunks, optimizer):
        walks.append(len(walks))
        return held_memory(chunks, optimizer)

    monkeypatch.setattr(fivefold.train, "held_memory", counted)
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--train.steps", "3", "--run-dir", str(run_dir)]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert len(walks) == 1
    assert [("held_bytes" in r) for r in records] == [True, False, False]
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(load_config("tiny").model).parameters())
    assert records[0]["held_bytes"] == [{"params": 4 * params, "grads": 4 * params, "optimizer": 8 * params}]


def test_moe_routing_statistics_count_each_slot_once_under_full_recomputation():
    """Full recomputation runs each block's forward again inside its backward; the routing
    counters (tokens per expert, dropped slots, the ep dispatcher's) must not count that
    second pass, or every statistic and the aux-loss-free bias update would see twice the load."""
    from fivefold.rules.layout import validate
    from fivefold.parallel.mesh import Mesh
    from fivefold.tools.parity import train_trace

    traces = {}
    for recompute in ("none", "full"):
        config = validate(load_config("tiny-moe", [f"layout.recompute={recompute}", "model.capacity_factor=1.0",
                                                   "model.dropless=false", "model.layers=2"]))
        traces[recompute] = train_trace(config, Mesh.single(config.layout), steps=1, keep_params=False)
    plain, recomputed = traces["none"].moe[0], traces["full"].moe[0]
    assert any(layer["dropped_fraction"] > 0 for layer in plain.values())  # drops are counted too
    assert recomputed == plain
