"""Tensor parallel (tp=2, CPU/gloo): fivefold against torch DTensor `parallelize_module`.

Both train the same model (`small` preset unless --config), from the same weights, on the
same global batch, one optimizer step per case, alternating in one run. The DTensor peer
uses torchtitan's plan: ColwiseParallel / RowwiseParallel for the projections,
SequenceParallel for the norms, PrepareModuleInput to gather the sequence before attention
and the MLP, a vocab-parallel embedding and head, and `loss_parallel` for the loss.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 \\
        python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_tp.py

With --overlap-case (default) a third case, "fivefold_overlap", trains the same model with
`layout.tp_overlap` switched: each tp region's backward starts the input gradient's
reduce-scatter (all-reduce without SP) asynchronously and computes the column layers' weight
gradients while it travels. --probe times that overlap in isolation on one layer's shapes
(communication alone, weight-gradient matmuls alone, one after the other, overlapped), which
shows how much of the communication the matmuls can hide on this machine. --forward-probe
times the forward side of async TP the same way: each region's sequence all-gather started
asynchronously and the column matmuls of the rows already here (this rank's own) run while
it travels, the other ranks' rows after it, against all-gather then matmul (the outputs are
checked bitwise equal).

Reported per case: median step time, the median per-round ratio to fivefold, the peak
resident memory during a step (the kernel's high-water mark reset before each step; the
fixed mmap threshold makes freed tensors leave the process so the mark is per step), and
the rise of that mark above the resident size at the start of the step, and
the bytes autograd saves for backward in one forward pass (saved-tensor hooks).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.tools import bench
from fivefold.tools.saved_activations import measure_saved_bytes
from fivefold.config import load_config
from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
from fivefold.rules.layout import validate
from fivefold.parallel.mesh import Mesh
from fivefold.model import build_model
from fivefold.parallel.optim import decays
from fivefold.train import build, train_step


def dtensor_plan(model, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in model.layers:
        p = f"layers.{i}."
        plan.update({
            p + "attn.wq": ColwiseParallel(), p + "attn.wk": ColwiseParallel(), p + "attn.wv": ColwiseParallel(),
            p + "attn.wo": RowwiseParallel(output_layouts=residual),
            p + "mlp.gate": ColwiseParallel(), p + "mlp.up": ColwiseParallel(),
            p + "mlp.down": RowwiseParallel(output_layouts=residual),
        })
        if sequence_parallel:
            plan.update({
                p + "attn_norm": SequenceParallel(), p + "mlp_norm": SequenceParallel(),
                # attention's inputs: x, the rotary tables, the document ids (None here)
                p + "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                               desired_input_layouts=(Replicate(), None, None)),
                p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
    return plan


def clip_mixed(params: list, max_norm: float) -> None:
    """clip_grad_norm_ over DTensor and plain parameters together (torch's refuses the mix:
    without sequence parallel the norm weights are not DTensors)."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups = [[p for p in params if hasattr(p, "to_local")], [p for p in params if not hasattr(p, "to_local")]]
    norms = []
    for group in groups:
        norm = get_total_norm([p.grad for p in group if p.grad is not None]) if group else torch.zeros(())
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups:
        if group:
            clip_grads_with_norm_(group, max_norm, total)


class DTensorTrainer:
    """The same model and step with DTensor tensor parallelism and torch's AdamW."""

    def __init__(self, config, sequence_parallel: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        self.config = config
        self.model = build_model(config.model, config.train.seed)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(self.model, mesh, dtensor_plan(self.model, sequence_parallel))
        named = list(self.model.named_parameters())
        groups = [
            {"params": [p for _, p in named if decays(p.dim())], "weight_decay": config.train.weight_decay},
            {"params": [p for _, p in named if not decays(p.dim())], "weight_decay": 0.0},
        ]
        t = config.train
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss; the global batch is one micro-batch here, as in fivefold's run.

        Call inside `loss_parallel`, once: contexts must not nest (the inner one switches
        the vocab-parallel loss off on exit, and backward then fails on mixed tensors).
        """
        logits, _ = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    def loss_parallel_forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return self.loss(inputs, targets)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        t = self.config.train
        with loss_parallel():
            self.loss(inputs, targets).backward()
        clip_mixed(list(self.model.parameters()), t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def saved_mb(model, inputs: torch.Tensor, loss) -> float:
    saved = measure_saved_bytes(model, lambda: loss(inputs), dict(model.layers.items()))
    return (sum(saved.per_layer.values()) + saved.shared + saved.outside_layers) / 2**20


def compare_one(config, sequence_parallel: bool, rounds: int, overlap_case: bool) -> bench.Comparison:
    config = validate(config, dist.get_world_size())
    mesh = Mesh.build(config.layout)
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    inputs, targets = sampler.local_batch_at(0, 0, 1)
    ours = build(config, mesh, torch.device("cpu")) if bench.builds("fivefold") else None
    peer = DTensorTrainer(config, sequence_parallel) if bench.builds("dtensor") else None
    cases = {
        "fivefold": lambda: train_step(ours, sampler, 0),
        "dtensor": lambda: peer.step(inputs, targets),
    }
    if overlap_case:
        switched = config.replace(layout=dataclasses.replace(config.layout, tp_overlap=not config.layout.tp_overlap))
        wanted = bench.builds("fivefold_overlap", "fivefold_no_overlap")
        other = build(switched, mesh, torch.device("cpu")) if wanted else None
        cases["fivefold_overlap" if switched.layout.tp_overlap else "fivefold_no_overlap"] = lambda: train_step(other, sampler, 0)
    results = bench.alternate(cases, warmup=1, rounds=rounds, sync=dist.barrier)
    bench.gather_peak_rss(results)
    chunk = ours.chunks[0]
    saved = {
        "fivefold": saved_mb(chunk, inputs, lambda x: ours.loss_fn(chunk(x)[0], targets)),
        "dtensor": saved_mb(peer.model, inputs, lambda x: peer.loss_parallel_forward(x, targets)),
    }
    for name, res in results.items():
        res.extra["saved_for_backward_mb"] = saved.get(name, saved["fivefold"])  # overlap saves the same tensors
    title = f"tp={config.layout.tp} {'with' if sequence_parallel else 'without'} sequence parallel, {config.model.name}"
    meta = {"tp": config.layout.tp, "sequence_parallel": sequence_parallel, "tp_overlap": config.layout.tp_overlap,
            "global_batch": config.train.global_batch,
            "seq_len": config.train.seq_len, "threads": torch.get_num_threads()}
    return bench.compare(title, results, "fivefold", meta)


def overlap_probe(config, rounds: int) -> bench.Comparison:
    """One layer's backward on the config's shapes: the input gradient's tp collective alone,
    the column layers' weight-gradient matmuls alone, both one after the other, and both
    overlapped (collective started asynchronously, matmuls, wait). Sequence parallel:
    reduce-scatter of the (T, B, h) input gradient, as `_OverlappedEntry` does."""
    from fivefold.parallel import comm

    mesh = Mesh.build(validate(config, dist.get_world_size()).layout)
    m, t = config.model, dist.get_world_size()
    tokens = config.train.global_batch * config.train.seq_len
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, m.hidden, generator=gen)
    widths = [m.heads * m.head_dim // t] + [m.n_kv_heads * m.head_dim // t] * 2 + [m.ffn // t] * 2  # q, k, v, gate, up
    dys = [torch.randn(tokens, w, generator=gen) for w in widths]
    dx = torch.randn(config.train.seq_len, config.train.global_batch, m.hidden, generator=gen)

    def weight_grads() -> None:
        for dy in dys:
            dy.t().matmul(x)

    def collective() -> None:
        comm.reduce_scatter(dx, mesh.tp)

    def sequential() -> None:
        collective()
        weight_grads()

    def overlapped() -> None:
        _, work = comm.reduce_scatter(dx, mesh.tp, async_op=True)
        weight_grads()
        work.wait()

    cases = {"sequential": sequential, "overlapped": overlapped, "collective": collective, "weight_grads": weight_grads}
    results = bench.alternate(cases, warmup=2, rounds=rounds, sync=dist.barrier)
    title = f"one layer's backward, tp={t}: reduce-scatter of dx vs the column layers' dW matmuls, {config.model.name}"
    return bench.compare(title, results, "sequential", {"tokens": tokens, "dx_mb": dx.numel() * 4 / 2**20})


def forward_probe(config, rounds: int) -> bench.Comparison:
    """One layer's column projections on the config's shapes under sequence parallel, each
    region (attention: q, k, v; MLP: gate, up) entered the plain way -- all-gather the
    sequence, then the matmuls -- against the chunked way of async TP: start the all-gather,
    multiply this rank's own rows while it travels, wait, multiply the other ranks' rows and
    concatenate (in the (B, T, C) layout a rank's rows are not contiguous in the output, so
    the pieces are copied; "chunked_unassembled" leaves them apart, a lower bound). Both make
    the gathered input contiguous (the column layers keep it for backward). Also checks that the chunked outputs equal the plain ones bit for bit."""
    from fivefold.parallel import comm

    mesh = Mesh.build(validate(config, dist.get_world_size()).layout)
    m, t, rank = config.model, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    local = config.train.seq_len // t
    x = torch.randn(config.train.global_batch, local, m.hidden, generator=gen)
    kv = m.n_kv_heads * m.head_dim // t
    regions = [[m.heads * m.head_dim // t, kv, kv], [m.ffn // t] * 2]  # q, k, v | gate, up
    weights = [[torch.randn(w, m.hidden, generator=gen) for w in widths] for widths in regions]

    def plain() -> list[torch.Tensor]:
        outs = []
        for region in weights:
            full = comm.all_gather(x, mesh.tp, dim=1).contiguous()
            outs += [F.linear(full, w) for w in region]
        return outs

    def chunked(assemble: bool = True) -> list[torch.Tensor]:
        outs = []
        for region in weights:
            gathered, work = comm.all_gather(x, mesh.tp, dim=1, async_op=True)
            own = [F.linear(x, w) for w in region]
            work.wait()
            # The gather lands sequence-major, (T, B, h): each rank's rows are one contiguous block.
            by_rank = gathered.movedim(1, 0).chunk(t)
            for w, mine in zip(region, own):
                pieces = [mine if j == rank else F.linear(part, w).movedim(0, 1) for j, part in enumerate(by_rank)]
                outs.append(torch.cat(pieces, dim=1) if assemble else pieces[0])
            gathered.contiguous()  # kept for backward, as the plain entry keeps it
        return outs

    def gather_alone() -> None:
        for _ in weights:
            comm.all_gather(x, mesh.tp, dim=1).contiguous()

    def matmuls_alone() -> None:
        full = torch.randn(config.train.global_batch, config.train.seq_len, m.hidden, generator=gen)
        for region in weights:
            for w in region:
                F.linear(full, w)

    exact = all(torch.equal(a, b) for a, b in zip(plain(), chunked()))
    cases = {"plain": plain, "chunked": chunked, "all_gather": gather_alone, "matmuls": matmuls_alone,
             "chunked_unassembled": lambda: chunked(assemble=False)}  # a bound: outputs left in pieces
    results = bench.alternate(cases, warmup=2, rounds=rounds, sync=dist.barrier)
    title = f"one layer's forward column projections, tp={t}, SP: all-gather then matmul vs chunked, {config.model.name}"
    return bench.compare(title, results, "plain", {"bitwise_equal": exact, "x_local_mb": x.numel() * 4 / 2**20})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="sp,nosp", help="comma list of sp, nosp (empty: none)")
    parser.add_argument("--out", default="runs/bench/tp.json")
    parser.add_argument("--no-overlap-case", dest="overlap_case", action="store_false",
                        help="leave out the case with layout.tp_overlap switched")
    parser.add_argument("--probe", action="store_true", help="also time one layer's overlap in isolation")
    parser.add_argument("--forward-probe", action="store_true",
                        help="also time one layer's column projections with the input all-gather chunked (async TP)")
    args, overrides = parser.parse_known_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    comparisons = []
    for mode in filter(None, args.modes.split(",")):  # --modes "" --probe: the probe alone
        sp = mode == "sp"
        config = load_config(args.config, [f"layout.tp={world}", f"layout.sequence_parallel={sp}", *overrides])
        comparisons.append(compare_one(config, sp, args.rounds, args.overlap_case))
    if args.probe:
        config = load_config(args.config, [f"layout.tp={world}", "layout.sequence_parallel=true", *overrides])
        comparisons.append(overlap_probe(config, args.rounds))
    if args.forward_probe:
        config = load_config(args.config, [f"layout.tp={world}", "layout.sequence_parallel=true", *overrides])
        comparisons.append(forward_probe(config, args.rounds))
    if dist.get_rank() == 0:
        for c in comparisons:
            bench.print_table(c)
            if "bitwise_equal" in c.meta:
                print(f"  chunked outputs bitwise equal to plain: {c.meta['bitwise_equal']}")
            for name, res in c.cases.items():
                if "saved_for_backward_mb" not in res.extra:
                    continue
                print(f"  {name}: step raises resident memory by {res.extra['step_rise_mb']:.1f} MB at its peak; "
                      f"saved for backward {res.extra['saved_for_backward_mb']:.1f} MB per forward")
        print(f"wrote {bench.write_json(comparisons, args.out)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
