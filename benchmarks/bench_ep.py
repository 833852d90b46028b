"""Expert-parallel MoE layer: fivefold against DeepSpeed's MoE, and grouped vs looped experts.

Run on CPU with gloo (2 ranks, ep = 2):
  DS_ACCELERATOR=cpu PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 -m torch.distributed.run \
      --standalone --nproc-per-node 2 benchmarks/bench_ep.py
`--profile N` then profiles N steps of every case per round (torch.profiler, each rank) and
prints, per rank, the self time per step of each operator and of each kind of work (GEMMs,
all-to-all, index/permutation, element-wise, other), summed over the alternated rounds.

Every case is one forward + backward of one MoE layer (8 SwiGLU experts, top-2, capacity
factor 1.25) with its experts sharded over the two ranks, alternated in one run. Memory is the
bytes autograd saves for backward in one forward (activations).

The layers compute the same function, checked before timing (`check_same_function`): DeepSpeed
gets fivefold's router and expert weights, routes top-2 without its random second-expert
sampling, and the input is one sequence per rank (--batch 1), where DeepSpeed's per-micro-batch
capacity and fivefold's per-sequence capacity are the same rule (ceil(1.25 * 512 * 2 / 8) = 160
slots per expert, first choices before second choices, earlier tokens first). Both keep the same
slots and give the same output for every token with no dropped slot (DeepSpeed renormalises the
gate weights over the kept slots, fivefold over the top-k; that is one division either way).
The one difference in work is the point of each design: DeepSpeed pads every expert to its
capacity (1280 rows per rank through the experts and the all-to-all), fivefold sends and
computes the kept rows only, after exchanging the counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from fivefold.tools.bench import alternate, builds, compare, gather_peak_rss, print_table, write_json
from fivefold.config import Layout
from fivefold.parallel.mesh import Mesh
from fivefold.model.mlp import MLP as SwiGLU  # one expert, as DeepSpeed wants it: a module it copies
from fivefold.model.moe import MoE
from fivefold.parallel.expert_parallel import ExpertParallelDispatcher


def fivefold_layer(args, mesh: Mesh, kernel: str) -> MoE:
    """fivefold's MoE with this rank's block of experts, random weights (seeded by the caller)."""
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


def deepspeed_layer(args, weights_from: MoE) -> nn.Module:
    """DeepSpeed's MoE holding the same router and local expert weights as `weights_from`."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    moe = DeepSpeedMoE(
        hidden_size=args.hidden, expert=SwiGLU(args.hidden, args.ffn), num_experts=args.experts, ep_size=args.ep,
        k=args.top_k, capacity_factor=args.capacity, eval_capacity_factor=args.capacity, min_capacity=0,
        drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False,  # fivefold's top-k, no noise
    )
    moe.set_deepspeed_parallelism()
    inner = moe.deepspeed_moe
    with torch.no_grad():
        inner.gate.wg.weight.copy_(weights_from.router.gate.weight)
        for e, expert in enumerate(inner.experts.deepspeed_experts):
            for name in ("gate", "up", "down"):
                getattr(expert, name).weight.copy_(getattr(weights_from.experts, name)[e])
    return moe


def check_same_function(deepspeed_moe: nn.Module, moe: MoE, x: torch.Tensor) -> None:
    """Raise unless both layers keep the same token-slots and agree on every token none of
    whose slots was dropped (see the module docstring for why those are the ones compared)."""
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        ids = moe.router(x)[2]  # (B, T, k)
        keep = moe._keep_mask(ids, x.shape[1]).reshape(flat.shape[0], -1)  # (S, k)
        ours_kept = torch.zeros(flat.shape[0], moe.num_experts, dtype=torch.bool)
        ours_kept.scatter_(1, ids.reshape(flat.shape[0], -1), keep)
        dispatch_mask = deepspeed_moe.deepspeed_moe.gate(flat)[2]  # (S, E, C)
        theirs_kept = dispatch_mask.any(dim=-1)
        ours, theirs = moe(x)[0].reshape_as(flat), deepspeed_moe(x)[0].reshape_as(flat)
    if not torch.equal(ours_kept, theirs_kept):
        raise RuntimeError(f"DeepSpeed and fivefold keep different slots ({(ours_kept != theirs_kept).sum()} differ)")
    whole = keep.all(dim=1)
    torch.testing.assert_close(ours[whole], theirs[whole], rtol=1e-5, atol=1e-6)


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


def repeated(step, times: int, cpu_seconds: list[float]):
    """One timed call = `times` steps: one step is ~75 ms, short enough for a single descheduling
    on a shared machine to swing a round's ratio by 10%. Appends the process CPU time per step
    (all threads, gloo's included) of every call to `cpu_seconds`: it does not count waiting,
    so it depends less on what else the machine runs than wall time does."""
    def run() -> None:
        start = time.process_time()
        for _ in range(times):
            step()
        cpu_seconds.append((time.process_time() - start) / times)

    return run


def print_cpu_ratios(cpu: dict[str, list[float]], baseline: str) -> None:
    """Rank 0 prints, per rank and case, the median CPU time per step and the median over rounds
    of baseline CPU / case CPU (above 1: the case uses less CPU than the baseline)."""
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, cpu)
    if dist.get_rank() != 0:
        return
    for rank, cases in enumerate(per_rank):
        cells = ", ".join(
            f"{name} {statistics.median(sec) * 1e3:.1f} ms ({baseline}/this "
            f"{statistics.median(b / c for b, c in zip(cases[baseline], sec)):.3f})"
            for name, sec in cases.items()
        )
        print(f"CPU per step, rank {rank}: {cells}")


OP_KINDS = {  # operator name -> kind of work, for the --profile tables
    "gemm": ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm"),
    "all-to-all": ("_AllToAll", "_AllToAllBackward", "c10d::alltoall_base_", "c10d::alltoall_"),
    "index/permute": ("aten::index", "aten::index_select", "aten::index_copy", "aten::index_add_", "aten::index_add",
                      "aten::_index_put_impl_", "aten::scatter_", "aten::scatter_add_", "aten::gather", "aten::cat",
                      "aten::sort", "aten::argsort", "aten::nonzero", "aten::bincount", "aten::one_hot",
                      "aten::repeat_interleave", "aten::cumsum", "aten::topk", "aten::argmax"),
    "element-wise": ("aten::mul", "aten::silu", "aten::silu_backward", "aten::add", "aten::add_", "aten::sum",
                     "aten::div", "aten::pow", "aten::fill_", "aten::copy_", "aten::zero_", "aten::_softmax",
                     "aten::_softmax_backward_data", "aten::masked_fill", "aten::lt", "aten::sub", "aten::mean",
                     "aten::logsumexp", "aten::exp", "aten::log", "aten::clamp_min", "aten::clamp"),
}


def op_kind(name: str) -> str:
    return next((kind for kind, names in OP_KINDS.items() if name in names), "other")


def profile_cases(steps: dict, rounds: int, per_round: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per case: operator -> (self CPU ms per step, calls per step), over `rounds` alternated rounds."""
    from torch.profiler import ProfilerActivity, profile

    totals = {name: collections.defaultdict(lambda: [0.0, 0]) for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(per_round):
                    steps[name]()
            for event in prof.key_averages():
                totals[name][event.key][0] += event.self_cpu_time_total
                totals[name][event.key][1] += event.count
    n = rounds * per_round
    return {name: {op: (us / 1e3 / n, calls / n) for op, (us, calls) in ops.items()} for name, ops in totals.items()}


def print_profile(per_case: dict[str, dict[str, tuple[float, float]]], top: int = 25) -> None:
    """One rank's per-kind and per-operator table, cases side by side."""
    names = list(per_case)
    header = "".join(f"{name:>24}" for name in names)
    print(f"rank {dist.get_rank()}: self CPU ms per step (calls per step)\n{'kind':44}{header}")
    for kind in (*OP_KINDS, "other", "total"):
        row = [sum(ms for op, (ms, _) in per_case[n].items() if kind == "total" or op_kind(op) == kind) for n in names]
        print(f"{kind:44}" + "".join(f"{ms:24.2f}" for ms in row))
    ops = sorted({op for n in names for op in per_case[n]}, key=lambda op: -max(per_case[n].get(op, (0, 0))[0] for n in names))
    print(f"{'operator':44}{header}")
    for op in ops[:top]:
        cells = "".join(f"{per_case[n].get(op, (0, 0))[0]:16.3f} ({per_case[n].get(op, (0, 0))[1]:4.0f})" for n in names)
        print(f"{op[:43]:44}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank (1: the same capacity rule as DeepSpeed)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed call (the times are per step)")
    parser.add_argument("--out", default="runs/bench/ep.json")
    parser.add_argument("--no-deepspeed", action="store_true", help="compare the expert kernels only")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N steps per case per round and print per-operator tables")
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
    # DeepSpeed copies the grouped layer's weights, so measured alone it still builds that layer
    grouped = fivefold_layer(args, mesh, "grouped") if builds("fivefold-grouped", "deepspeed") else None
    layers = {}
    if not args.no_deepspeed and builds("deepspeed"):
        layers["deepspeed"] = (deepspeed_layer(args, grouped), True)
        if args.batch == 1 and builds("fivefold-grouped"):
            check_same_function(layers["deepspeed"][0], grouped, x)
    if builds("fivefold-grouped"):
        layers["fivefold-grouped"] = (grouped, False)
    del grouped  # alone, DeepSpeed's case keeps only its own copy of the weights
    builders = {
        "fivefold-loop": lambda: (fivefold_layer(args, mesh, "loop"), False),
        "fivefold-padded": lambda: (fivefold_layer(args, mesh, "padded"), False),
    }
    layers |= {name: build() for name, build in builders.items() if builds(name)}  # one alone: only it
    steps = {name: make_step(layer, x, ds) for name, (layer, ds) in layers.items()}
    if dist.get_rank() == 0:
        print("layers built", flush=True)
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    warmup = 2
    results = alternate({name: repeated(step, args.steps, cpu[name]) for name, step in steps.items()},
                        warmup=warmup, rounds=args.rounds, sync=dist.barrier)
    cpu = {name: sec[warmup:] for name, sec in cpu.items()}  # the timed rounds only
    for res in results.values():  # seconds per step
        res.seconds = [t / args.steps for t in res.seconds]
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
    print_cpu_ratios(cpu, comparison.baseline)
    if args.profile:
        per_case = profile_cases(steps, args.rounds, args.profile)
        for rank in range(dist.get_world_size()):
            if rank == dist.get_rank():
                print_profile(per_case)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
