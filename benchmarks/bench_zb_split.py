"""What splitting the backward costs: forward + B + W against an eager forward + backward.

One process, one pipeline stage of the preset (its first half of the layers, no embedding,
no head), one micro-batch. The zero-bubble path is the runner's own: `WeightGradDeferral`
around the forward, B as `torch.autograd.grad` for the input and the parameters it does
not defer, W as `apply_deferred_weight_grads`. The two cases alternate; each is timed in
this thread's CPU seconds (what the work costs, whatever the machine's load) and the
table reports the median of the per-round ratios and the page faults per step.

    PYTHONPATH=$PWD python benchmarks/bench_zb_split.py --config small --rounds 30
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from fivefold.config import load_config
from fivefold.model import Transformer
from fivefold.parallel.pipeline import PendingWeightGrad, WeightGradDeferral, apply_deferred_weight_grads


def eager_step(chunk: Transformer, x0: torch.Tensor, dy: torch.Tensor) -> None:
    x = x0.clone().requires_grad_()
    out, _ = chunk(x)
    torch.autograd.backward([out], [dy])


def split_step(chunk: Transformer, deferral: WeightGradDeferral, x0: torch.Tensor, dy: torch.Tensor) -> None:
    x = x0.clone().requires_grad_()
    pending: list[PendingWeightGrad] = []
    with deferral.collect(pending) as deferred:
        out, _ = chunk(x)
    params = list(chunk.parameters())
    others = [p for p in params if id(p) not in deferred]
    grads = torch.autograd.grad([out], [x, *others], [dy], allow_unused=True)  # B
    held = {id(p): (p, g) for p, g in zip(others, grads[1:]) if g is not None}
    apply_deferred_weight_grads(pending, held, params[::-1])  # W


def measured(step) -> tuple[float, int]:
    """CPU seconds of this thread and minor page faults of one call."""
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    step()
    return time.thread_time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config)
    model, seq = config.model, config.train.seq_len
    with torch.device("meta"):
        chunk = Transformer(model, layer_ids=range(model.layers // 2), with_embedding=False, with_head=False)
    chunk.to_empty(device="cpu").init_weights(config.train.seed)
    deferral = WeightGradDeferral(chunk)
    x0, dy = torch.randn(args.micro_batch, seq, model.hidden), torch.randn(args.micro_batch, seq, model.hidden)
    cases = {"eager F+B": lambda: eager_step(chunk, x0, dy), "zero-bubble F+B+W": lambda: split_step(chunk, deferral, x0, dy)}
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
    for r in range(args.rounds + 2):  # two warm-up rounds, dropped
        for name in (list(cases) if r % 2 else list(cases)[::-1]):
            results[name].append(measured(cases[name]))
    eager, split = (results[name][2:] for name in cases)
    ratio = statistics.median(s[0] / e[0] for s, e in zip(split, eager))
    for name, rows in zip(cases, (eager, split)):
        print(f"{name:18s} CPU {statistics.median(r[0] for r in rows) * 1e3:7.1f} ms   "
              f"page faults {statistics.median(r[1] for r in rows):6.0f}")
    print(f"zero-bubble / eager, median of {len(eager)} per-round CPU-time ratios: {ratio:.3f}")


if __name__ == "__main__":
    main()
