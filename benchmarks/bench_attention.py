"""Grouped-query attention: K/V heads kept grouped (SDPA `enable_gqa`) against K/V repeated to every query head.

fivefold's attention hands K/V to SDPA with their own heads. The baseline repeats each K/V
head to the query heads it serves before SDPA (`repeat_interleave`, as fivefold did before and
as transformers' eager attention does), which copies K and V to query-head size and makes SDPA
save them at that size. Both models hold the same weights and run forward + backward of one
batch of the preset (cross entropy over all tokens) in one process, alternating
(fivefold.tools.bench). Reported per preset: the median time ratio and the bytes each layer saves for
backward (saved-tensor hooks, fivefold.tools.saved_activations), which do not depend on load, and
the median per-round ratio of the process CPU time of each call (one torch thread by default):
on a machine shared with other work it moves far less than the wall time.

    fivefold bench attention --presets small,tiny --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run directly from a checkout

from fivefold.tools.saved_activations import measure_saved_bytes  # noqa: E402
from fivefold.tools.bench import Comparison, alternate, compare, print_table, write_json  # noqa: E402
from fivefold.config import load_config  # noqa: E402
from fivefold.model.attention import AttentionCore  # noqa: E402
from fivefold.model.llama import Transformer  # noqa: E402
from fivefold.parallel.sharding import materialize  # noqa: E402


class RepeatedKVCore(AttentionCore):
    """The baseline: each K/V head copied to the query heads it serves, then plain SDPA."""

    def forward(self, q, k, v, documents=None):  # type: ignore[override]
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return super().forward(q, k, v, documents)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fivefold bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="small,tiny", help="comma-separated dense presets with kv_heads < heads")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds after the warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default="bench_results/attention.json")
    return p.parse_args(argv)


def models_of(preset: str) -> tuple[dict[str, torch.nn.Module], torch.Tensor, torch.Tensor]:
    """{"grouped": fivefold's model, "repeated": the same weights with the baseline core}, and a batch."""
    config = load_config(preset)
    if config.model.n_kv_heads == config.model.heads:
        raise SystemExit(f"preset {preset!r} has as many K/V heads as query heads: nothing to compare")
    with torch.device("meta"):
        grouped = Transformer(config.model)
    materialize(grouped, config.model, config.train.seed)
    repeated = copy.deepcopy(grouped)
    for block in repeated.layers.values():
        block.attn.core = RepeatedKVCore()
    gen = torch.Generator().manual_seed(0)
    shape = (config.train.global_batch, config.train.seq_len + 1)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    return {"grouped": grouped, "repeated": repeated}, tokens[:, :-1], tokens[:, 1:]


def step_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            cpu_seconds: list[float]) -> Callable[[], None]:
    """Forward + backward; appends the call's process CPU time to `cpu_seconds`."""

    def step() -> None:
        start = time.process_time()
        logits, _ = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)
        cpu_seconds.append(time.process_time() - start)

    return step


def compare_preset(preset: str, args: argparse.Namespace) -> Comparison:
    models, inputs, targets = models_of(preset)
    with torch.no_grad():  # same weights, same attention: the outputs agree
        difference = (models["grouped"](inputs)[0] - models["repeated"](inputs)[0]).abs().max().item()
    saved = {
        name: sum(measure_saved_bytes(m, lambda m=m: m(inputs), dict(m.layers.items())).per_layer.values())
        for name, m in models.items()
    }
    cpu: dict[str, list[float]] = {name: [] for name in models}
    results = alternate({n: step_of(m, inputs, targets, cpu[n]) for n, m in models.items()}, args.warmup, args.rounds)
    for name, res in results.items():
        res.extra["saved_layer_bytes"] = saved[name]
        res.extra["cpu_s"] = cpu[name][args.warmup:]
    cpu_ratio = statistics.median(g / r for g, r in zip(cpu["grouped"][args.warmup:], cpu["repeated"][args.warmup:]))
    config = load_config(preset).model
    meta = {"preset": preset, "heads": config.heads, "kv_heads": config.n_kv_heads, "max_logit_difference": difference,
            "saved_bytes_ratio": saved["grouped"] / saved["repeated"], "cpu_time_ratio": cpu_ratio}
    return compare(f"attention, {preset} ({config.heads} heads, {config.n_kv_heads} K/V heads): forward + backward",
                   results, "repeated", meta)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    comparisons = [compare_preset(p, args) for p in args.presets.split(",")]
    for c in comparisons:
        print_table(c)
        print(f"  saved by the layers for backward: grouped / repeated = {c.meta['saved_bytes_ratio']:.3f} "
              f"({c.cases['grouped'].extra['saved_layer_bytes']} / {c.cases['repeated'].extra['saved_layer_bytes']} bytes); "
              f"largest logit difference {c.meta['max_logit_difference']:.2e}")
        print(f"  process CPU time per call: grouped / repeated = {c.meta['cpu_time_ratio']:.3f} (median of rounds)")
    print(f"wrote {write_json(comparisons, args.out)}")


if __name__ == "__main__":
    main()
