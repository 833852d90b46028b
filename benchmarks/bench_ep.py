"""Expert-parallel MoE layer: fivefold against DeepSpeed's MoE, and grouped vs looped experts.

Run on CPU with gloo (2 ranks, ep = 2):
  DS_ACCELERATOR=cpu PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 -m torch.distributed.run \
      --standalone --nproc-per-node 2 benchmarks/bench_ep.py

Every case is one forward + backward of one MoE layer (same experts: 8 SwiGLU experts, top-2,
capacity factor 1.25, same input) with its experts sharded over the two ranks, alternated in
one run. Memory is the bytes autograd saves for backward in one forward (activations).
DeepSpeed's capacity is per micro-batch, fivefold's per sequence: both drop tokens.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from fivefold.tools.bench import alternate, builds, compare, gather_peak_rss, print_table, write_json
from fivefold.config import Layout
from fivefold.mesh import Mesh
from fivefold.model.llama import MLP as SwiGLU  # one expert, as DeepSpeed wants it: a module it copies
from fivefold.model.moe import MoE
from fivefold.parallel.expert_parallel import ExpertParallelDispatcher


def fivefold_layer(args, mesh: Mesh, kernel: str) -> MoE:
    moe = MoE(args.hidden, args.experts, args.top_k, args.ffn, dropless=False, capacity_factor=args.capacity)
    local = args.experts // mesh.ep.size
    with torch.no_grad():
        moe.experts.gate = nn.Parameter(torch.randn(local, args.ffn, args.hidden) * 0.02)
        moe.experts.up = nn.Parameter(torch.randn(local, args.ffn, args.hidden) * 0.02)
        moe.experts.down = nn.Parameter(torch.randn(local, args.hidden, args.ffn) * 0.02)
        moe.router.gate.weight.normal_(0, 0.02)
    moe.experts.kernel = kernel
    moe.dispatcher = ExpertParallelDispatcher(mesh.ep, args.experts)
    return moe


def deepspeed_layer(args) -> nn.Module:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    moe = DeepSpeedMoE(
        hidden_size=args.hidden, expert=SwiGLU(args.hidden, args.ffn), num_experts=args.experts, ep_size=args.ep,
        k=args.top_k, capacity_factor=args.capacity, eval_capacity_factor=args.capacity, min_capacity=0,
        drop_tokens=True, use_rts=False,
    )
    moe.set_deepspeed_parallelism()
    return moe


def saved_bytes(step) -> int:
    """Bytes autograd keeps for backward during one forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(backward=False)
    del out
    return total


def make_step(layer: nn.Module, x: torch.Tensor, is_deepspeed: bool):
    def step(backward: bool = True):
        inp = x.detach().requires_grad_()
        y = layer(inp)[0]
        if not backward:
            return y
        loss = y.float().pow(2).mean()
        loss.backward()
        layer.zero_grad(set_to_none=True)
        return None

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="runs/bench/ep.json")
    parser.add_argument("--no-deepspeed", action="store_true", help="compare the expert kernels only")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.no_deepspeed:
        dist.init_process_group("gloo")
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.set_num_threads(1)
    args.ep = dist.get_world_size()
    mesh = Mesh.build(Layout(dp=args.ep, ep=args.ep))
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randn(args.batch, args.seq, args.hidden)
    builders = {} if args.no_deepspeed else {"deepspeed": lambda: (deepspeed_layer(args), True)}
    builders |= {
        "fivefold-grouped": lambda: (fivefold_layer(args, mesh, "grouped"), False),
        "fivefold-loop": lambda: (fivefold_layer(args, mesh, "loop"), False),
        "fivefold-padded": lambda: (fivefold_layer(args, mesh, "padded"), False),
    }
    layers = {name: build() for name, build in builders.items() if builds(name)}  # one alone: only it
    steps = {name: make_step(layer, x, ds) for name, (layer, ds) in layers.items()}
    if dist.get_rank() == 0:
        print("layers built", flush=True)
    results = alternate(steps, warmup=2, rounds=args.rounds, sync=dist.barrier)
    gather_peak_rss(results)
    for name, step in steps.items():
        results[name].extra["saved_activation_mb"] = saved_bytes(step) / 2**20
    comparison = compare(
        f"MoE layer fwd+bwd, ep={args.ep}, {args.experts} experts top-{args.top_k}, capacity {args.capacity}, "
        f"tokens/rank {args.batch * args.seq}, hidden {args.hidden}, expert ffn {args.ffn}",
        results, baseline="fivefold-loop" if args.no_deepspeed else "deepspeed", meta=vars(args),
    )
    if dist.get_rank() == 0:
        print_table(comparison)
        for name, res in results.items():
            print(f"{name}: saved activations {res.extra['saved_activation_mb']:.2f} MB")
        print("json:", write_json([comparison], args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
