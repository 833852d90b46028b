"""Context parallel attention on a long sequence: ring, all-gather and Ulysses at cp=2 vs cp=1.

Run with two ranks (gloo on CPU):
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/bench_cp.py --seq 4096 --layers 2

One step here is the forward and backward of one sequence (the optimizer update is the same
for every case and is left out). The cp=1 case runs the whole sequence on rank 0 while rank 1
waits. Memory per case: activations saved for backward by one forward (measured with
autograd's saved-tensor hooks), and the resident-memory high-water mark during one step above
the level before it (sampled; rough, since the allocator keeps freed pages). torch's own
context parallel (torch.distributed.tensor.experimental.context_parallel) is tried and its
outcome reported: on CPU it has no sharding rule for the CPU flash-attention kernel.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from fivefold.tools.bench import (
    CaseResult,
    alternate,
    builds,
    compare,
    gather_peak_rss,
    print_table,
    write_json,
)
from fivefold.config import load_config
from fivefold.rules.layout import validate
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.context_parallel import saved_activation_bytes


def _build(config, mesh):
    """The parallel model; cp > 1 needs dp x cp > 1 optimizer machinery that is not used here."""
    import fivefold.parallelize as parallelize
    from fivefold.parallel.optim import AdamWSettings, ReplicatedAdamW

    original = parallelize.build_optimizer
    parallelize.build_optimizer = lambda chunks, m, c, finalizers=(): ReplicatedAdamW(
        list(chunks), m, AdamWSettings.from_train(c.train))
    try:
        return parallelize.parallelize(config, mesh)
    finally:
        parallelize.build_optimizer = original


def _step_fn(model, inputs, targets):
    batch = model.shard_sequence(inputs, targets)
    scale = 1.0 / inputs.numel()

    def step() -> None:
        logits, _ = model.chunks[0](batch.inputs, batch.positions)
        (model.loss_fn(logits, batch.targets) * scale).backward()
        for p in model.chunks[0].parameters():
            p.grad = None

    def forward() -> None:
        logits, _ = model.chunks[0](batch.inputs, batch.positions)
        model.loss_fn(logits, batch.targets)

    return step, forward


def try_torch_context_parallel(seq: int) -> str:
    """Whether torch's context_parallel runs causal SDPA on this device (CPU here)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 6, seq, 64) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as err:  # report why, the benchmark goes on without it
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/cp.json")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = [f"model.layers={args.layers}", f"model.max_seq_len={args.seq}", f"train.seq_len={args.seq}",
                 "train.global_batch=1"]
    single = validate(load_config("small", overrides), 1)
    inputs = torch.randint(0, single.model.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
    targets = inputs.roll(-1, dims=1)
    cases, forwards = {}, {}
    if rank == 0 and builds("cp1"):
        cases["cp1"], forwards["cp1"] = _step_fn(_build(single, Mesh.single(single.layout)), inputs, targets)
    else:
        cases["cp1"], forwards["cp1"] = (lambda: None), (lambda: None)
    mesh = None
    for algorithm in ("ring", "allgather", "ulysses"):
        if not builds(algorithm):  # another case measured alone
            continue
        config = validate(load_config("small", overrides + [f"layout.cp={world}", f"layout.cp_algorithm={algorithm}"]), world)
        mesh = mesh or Mesh.build(config.layout)
        cases[algorithm], forwards[algorithm] = _step_fn(_build(config, mesh), inputs, targets)
    torch_cp = try_torch_context_parallel(256)
    results = alternate(cases, warmup=1, rounds=args.rounds, sync=dist.barrier)
    gather_peak_rss(results)
    for name in cases:
        dist.barrier()
        results[name].extra["saved_activations_mb"] = saved_activation_bytes(forwards[name]) / 2**20
    mesh.stats.reset()
    cases["ring"]()
    report(results, mesh, rank, args, torch_cp)
    dist.destroy_process_group()


def report(results: dict[str, CaseResult], mesh: Mesh, rank: int, args, torch_cp: str) -> None:
    if rank != 0:
        return
    meta = {"seq": args.seq, "layers": args.layers, "preset": "small", "torch_context_parallel_on_cpu": torch_cp,
            "ring_cp_bytes_per_step": mesh.stats.axis_bytes("cp")}
    comparison = compare(f"context parallel, seq {args.seq}, cp=2 (rank 0)", results, "cp1", meta)
    print_table(comparison)
    for name, res in results.items():
        print(f"{name:10s} saved activations {res.extra['saved_activations_mb']:8.1f} MB   "
              f"peak RSS {res.peak_rss_mb:8.1f} MB (step rise {res.extra['step_rise_mb']:6.1f} MB)")
    print(f"torch context_parallel on CPU/gloo: {torch_cp}")
    print(f"ring attention bytes on the cp axis for one step: {meta['ring_cp_bytes_per_step']}")
    print(f"wrote {write_json([comparison], args.out)}")


if __name__ == "__main__":
    main()
