"""Data parallel and ZeRO against torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

Same model (fivefold's Transformer, `small` preset), same global batch, dp=2 on CPU/gloo, one
optimizer step (forward + backward + clip + AdamW) per timed call, alternating cases in one
run. Launch:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 -m torch.distributed.run \\
        --standalone --nproc-per-node 2 benchmarks/bench_dp.py [--rounds 3] [--case NAME]

Without --case every case is timed (median per-round ratio against its peer), and each case's
peak RSS per rank is measured around its own steps; the models of the other cases stay resident
meanwhile, so `--case NAME` runs one case alone for a peak that counts nothing else. The ZeRO
stages are also compared with fivefold's plain data parallel, in wall time and in CPU time per
step (all threads of the process: compute, gloo's, copies), which a loaded machine disturbs less.

`--collectives` times bare gloo collectives instead, on one flat buffer of the model's
gradient size, alternating: all-reduce, reduce-scatter and all-gather of the same bytes, torch's
and fivefold's (comm.py, as ZeRO calls them).

`--zero3-floor` times fivefold's dp, ZeRO-2 and ZeRO-3 steps beside dp's step followed by the
bare all-gathers ZeRO-3 adds to dp's bytes (its backward's gathers), in wall and CPU time: what
ZeRO-3 would cost if its extra collectives were all it added. It prints a verdict on the CPU
seconds of both ranks per step (gloo's transfers included), which other load on the machine
disturbs far less than wall time: each stage against dp and the 3% bound, and ZeRO-3 against
that floor. A fifth case issues the same all-gathers before dp's step and waits for them after
it, so they run beside its compute as ZeRO-3's do: what sharing the cores with compute adds.

`--floor` times torch DDP, ZeroRedundancyOptimizer and fivefold's dp and ZeRO-1 beside the
parts of a step alone: each rank's forward + backward + clip + fused AdamW on its local batch
with no collective (all parameters, or one ZeRO-1 shard's worth), and the bare collectives of
the gradients' bytes. The floor of a step is the CPU of both parts, summed over the ranks, over
the cores (gloo's sums and copies run on the cores that compute), and never less than one
rank's compute alone. Per round it bounds each step's wall time on a quiet machine from CPU
seconds and the main threads' waits on collectives (`floor_report`), which load moves little,
and prints per peer the most any implementation could gain on it (peer's bound / floor), in
work alone and in wall time, each with a verdict (LIMIT / NO LIMIT / UNDECIDED against 1.05,
from the interval of the median over rounds), beside the measured assumptions (cores,
threads, load, CPU on gloo's threads, utilisation).

Every torch peer runs torch's fused AdamW (`fused=True`), the kernel kind fivefold runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fivefold.tools import bench  # noqa: E402
from fivefold.config import Config, load_config  # noqa: E402
from fivefold.data.sources import Sampler, load_tokenizer, load_tokens  # noqa: E402
from fivefold.rules.layout import validate  # noqa: E402
from fivefold.job.malloc import MALLOC_SETTINGS, MallocState, apply_malloc  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.model import build_model  # noqa: E402
from fivefold.parallelize import cross_entropy_sum  # noqa: E402
from fivefold.train import build, train_step  # noqa: E402

PAIRS = {  # fivefold case: its peers (a case list can be narrowed with --only)
    "fivefold-dp": ["torch-ddp"],
    "fivefold-zero1": ["torch-zero1", "deepspeed-zero1"],
    "fivefold-zero2": ["deepspeed-zero2"],
    "fivefold-zero3": ["torch-fsdp2", "deepspeed-zero3"],
}


def fivefold_case(config: Config, zero: int, sampler: Sampler) -> Callable[[], None]:
    cfg = validate(config.replace(layout=config.layout.__class__(dp=2, zero=zero)), 2)
    model = build(cfg, Mesh.build(cfg.layout), torch.device("cpu"))
    state = {"step": 0}

    def step() -> None:
        train_step(model, sampler, state["step"])
        state["step"] += 1

    return step


def local_batch(config: Config, sampler: Sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return sampler.local_batch_at(step, dist.get_rank(), dist.get_world_size())


def peer_step(config: Config, sampler: Sampler, model, optimizer, clip: Callable[[], None]) -> Callable[[], None]:
    """One step of a torch-style peer: the same loss normalisation and clipping as fivefold."""
    state = {"step": 0}
    scale = 1.0 / (config.train.global_batch * config.train.seq_len)

    def step() -> None:
        x, y = local_batch(config, sampler, state["step"])
        logits, _ = model(x)
        (cross_entropy_sum(logits, y) * scale).backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1

    return step


def adamw_settings(config: Config) -> dict:
    """torch.optim.AdamW's arguments for the run's settings. `fused=True`: the peers run torch's
    fused kernel, the kind fivefold runs (on CPU torch's default is the slower single-tensor loop)."""
    t = config.train
    return {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps, "weight_decay": t.weight_decay, "fused": True}


def adamw(params, config: Config) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **adamw_settings(config))


def torch_ddp_case(config: Config, sampler: Sampler, zero1: bool) -> Callable[[], None]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_model(config.model, config.train.seed), bucket_cap_mb=25, gradient_as_bucket_view=True)
    t = config.train
    if zero1:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw_settings(config))
    else:
        opt = adamw(model.parameters(), config)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)  # noqa: E731
    return peer_step(config, sampler, model, opt, clip)


def fsdp2_case(config: Config, sampler: Sampler) -> Callable[[], None]:
    from torch.distributed.fsdp import fully_shard

    model = build_model(config.model, config.train.seed)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = adamw(model.parameters(), config)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)  # noqa: E731
    return peer_step(config, sampler, model, opt, clip)


def deepspeed_case(config: Config, sampler: Sampler, stage: int) -> Callable[[], None]:
    import deepspeed

    t = config.train
    model = build_model(config.model, config.train.seed)
    ds_config = {
        "train_micro_batch_size_per_gpu": t.global_batch // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 25 * 2**20 // 4, "overlap_comm": True},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters(), config), config=ds_config)
    state = {"step": 0}
    scale = 1.0 / (t.global_batch * t.seq_len)

    def step() -> None:
        x, y = local_batch(config, sampler, state["step"])
        logits, _ = engine(x)
        # DeepSpeed divides by the data-parallel size when averaging; undo it so gradients match
        engine.backward(cross_entropy_sum(logits, y) * scale * dist.get_world_size())
        engine.step()
        state["step"] += 1

    return step


class Usage(NamedTuple):
    """Counters read before and after a call; their differences are the call's."""

    cpu: float  # CPU seconds of every thread of the process (gloo's included)
    faults: int  # minor page faults (fresh pages: what a large temporary costs on top of writing it)
    main_cpu: float  # CPU seconds of the calling (main) thread; cpu - main_cpu is gloo's threads
    main_queued: float  # seconds the main thread was runnable but waited for a core
    wall: float

    def __sub__(self, other: "Usage") -> "Usage":  # type: ignore[override]
        return Usage(*(a - b for a, b in zip(self, other)))


def usage_now() -> Usage:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    main_cpu, main_queued = bench.thread_schedstat()
    return Usage(usage.ru_utime + usage.ru_stime, usage.ru_minflt, main_cpu, main_queued, time.perf_counter())


def cpu_timed(step: Callable[[], None], record: list[Usage]) -> Callable[[], None]:
    def timed() -> None:
        before = usage_now()
        step()
        record.append(usage_now() - before)

    return timed


def collective_cases(numel: int) -> dict[str, Callable[[], None]]:
    """Bare collectives over the same bytes: torch's, and fivefold's as ZeRO calls them (in
    place, on a buffer it gives up: on gloo an in-place all-reduce and one broadcast per rank)."""
    from fivefold.config import Layout
    from fivefold.parallel import comm

    axis = Mesh.build(Layout(dp=dist.get_world_size()))["dp"]
    full, shard = torch.randn(numel), torch.empty(numel // dist.get_world_size())
    own = full.chunk(dist.get_world_size())[dist.get_rank()]
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "fivefold-reduce_scatter": lambda: comm.reduce_scatter_into(own, full, axis, overwrite_input=True),
        "fivefold-all_gather": lambda: comm.all_gather_into(full, own, axis),
    }


def floor_cases(config: Config, sampler: Sampler) -> dict[str, Callable[[], None]]:
    """The real data-parallel steps beside their parts alone: each rank's forward + backward +
    clip + fused AdamW on its local batch with no collective at all (every parameter, or the
    half a ZeRO-1 rank updates), and the bare collectives of the gradients' bytes."""
    steps = ("torch-ddp", "fivefold-dp", "torch-zero1", "fivefold-zero1")
    cases = {name: make_case(name, config, sampler) for name in steps}
    for name, share in (("compute", 1.0), ("compute-zero1", 1.0 / dist.get_world_size())):
        model = build_model(config.model, config.train.seed)
        opt = adamw(leading_share(list(model.parameters()), share), config)
        clip = lambda m=model: torch.nn.utils.clip_grad_norm_(m.parameters(), config.train.grad_clip)  # noqa: E731
        cases[name] = peer_step(config, sampler, model, opt, clip)
    numel = sum(p.numel() for p in build_model(config.model, config.train.seed).parameters())
    collectives = collective_cases(numel - numel % dist.get_world_size())
    cases["all_reduce"] = collectives["all_reduce"]
    rs, ag = collectives["fivefold-reduce_scatter"], collectives["fivefold-all_gather"]
    cases["reduce_scatter+all_gather"] = lambda: (rs(), ag())
    # each peer right after its floor's parts and before its fivefold counterpart: cases next to each
    # other in a round see the most alike load (the rounds rotate the order, keeping neighbours)
    order = ("compute", "all_reduce", "torch-ddp", "fivefold-dp",
             "compute-zero1", "reduce_scatter+all_gather", "torch-zero1", "fivefold-zero1")
    return {name: cases[name] for name in order}


def zero3_floor_cases(config: Config, sampler: Sampler) -> dict[str, Callable[[], None]]:
    """fivefold's dp and ZeRO-3 steps beside dp's step followed by the bare all-gathers that ZeRO-3
    moves on top of dp's bytes: its backward gathers every unit again but the kept ones (root and
    last block), one all-gather per unit bucket of the same size, as ZeRO-3 calls it. dp's step
    already carries an all-reduce of every gradient (a reduce-scatter and an all-gather's bytes)."""
    from fivefold.config import Layout
    from fivefold.parallel import comm
    from fivefold.parallel.zero import build_units

    cases = {name: make_case(name, config, sampler) for name in ("fivefold-dp", "fivefold-zero2", "fivefold-zero3")}
    mesh = Mesh.build(Layout(dp=dist.get_world_size()))
    units = build_units([build_model(config.model, config.train.seed)], mesh)
    regathered = [b for unit in units if not unit.kept_for_backward for b in unit.buckets]
    buffers = [(torch.zeros(b.numel), torch.zeros(b.numel // b.axis.size), b.axis) for b in regathered]
    dp_step = make_case("fivefold-dp", config, sampler)  # its own model: the dp case's steps stay its own
    dp_step_overlapped = make_case("fivefold-dp", config, sampler)

    def regathers() -> list:
        return [comm.all_gather_into(full, shard, axis, async_op=True) for full, shard, axis in buffers]

    def dp_then_regathers() -> None:
        dp_step()
        for work in regathers():
            work.wait()

    def dp_beside_regathers() -> None:
        # The same gathers in flight while dp's step computes, as ZeRO-3's run beside its forward and
        # backward: what sharing the two cores with compute adds to their bare cost.
        works = regathers()
        dp_step_overlapped()
        for work in works:
            work.wait()

    cases[ZERO3_FLOOR] = dp_then_regathers
    cases[ZERO3_FLOOR_OVERLAPPED] = dp_beside_regathers
    return cases


def leading_share(params: list[torch.nn.Parameter], share: float) -> list[torch.nn.Parameter]:
    """The first parameters holding `share` of all elements (what one ZeRO-1 rank updates)."""
    total, taken, out = sum(p.numel() for p in params), 0, []
    for p in params:
        if taken >= share * total:
            break
        out.append(p)
        taken += p.numel()
    return out


def optimizer_cases(config: Config) -> dict[str, Callable[[], None]]:
    """One AdamW step over the model's parameters with random gradients: fivefold's fused update
    over one flat bucket (as dp=2 keeps it) against torch.optim.AdamW's three implementations."""
    from fivefold.parallel.mesh import Mesh as SingleMesh
    from fivefold.parallel.buckets import plan_buckets, trainable
    from fivefold.parallel.flat_adamw import flat_adamw_
    from fivefold.parallel.optim import AdamWSettings

    t = config.train
    ours = build_model(config.model, t.seed)
    (bucket,) = plan_buckets(trainable([ours]), SingleMesh.single(), 1 << 40, pad_to_axis=False)
    bucket.flatten_params_()
    grad, state = torch.randn(bucket.numel) * 1e-3, (torch.zeros(bucket.numel), torch.zeros(bucket.numel))
    settings = AdamWSettings.from_train(t)
    steps = {"n": 0}

    def fivefold_step() -> None:
        steps["n"] += 1
        flat_adamw_(bucket, 0, bucket.numel, bucket.params, grad, state, steps["n"], t.lr, settings)

    cases = {"fivefold-flat-fused": fivefold_step}
    for kind in ("single-tensor", "foreach", "fused"):
        model = build_model(config.model, t.seed)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        flags = {"foreach": kind == "foreach", "fused": kind == "fused"}
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                weight_decay=t.weight_decay, **flags)
        cases[f"torch-adamw-{kind}"] = opt.step
    return cases


def make_case(name: str, config: Config, sampler: Sampler) -> Callable[[], None]:
    if name.startswith("fivefold-"):
        zero = 0 if name == "fivefold-dp" else int(name[-1])
        return fivefold_case(config, zero, sampler)
    if name in ("torch-ddp", "torch-zero1"):
        return torch_ddp_case(config, sampler, zero1=name == "torch-zero1")
    if name == "torch-fsdp2":
        return fsdp2_case(config, sampler)
    if name.startswith("deepspeed-zero"):
        return deepspeed_case(config, sampler, int(name[-1]))
    raise SystemExit(f"unknown case {name}; cases: {', '.join(all_cases())}")


def all_cases() -> list[str]:
    return [c for ours, peers in PAIRS.items() for c in [ours, *peers]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--case", default="", help="run one case alone (for its peak RSS)")
    parser.add_argument("--skip", default="", help="comma-separated cases to leave out (e.g. DeepSpeed's)")
    parser.add_argument("--collectives", action="store_true", help="time bare gloo collectives of the model's bytes")
    parser.add_argument("--optimizer", action="store_true", help="time one AdamW step: fivefold's against torch's")
    parser.add_argument("--floor", action="store_true",
                        help="the dp and ZeRO-1 steps against their floor (CPU of compute alone + collectives alone)")
    parser.add_argument("--zero3-floor", action="store_true",
                        help="fivefold's ZeRO-3 and dp steps beside dp's step plus the bare all-gathers ZeRO-3 adds")
    parser.add_argument("--malloc", choices=MALLOC_SETTINGS, default="default",
                        help="glibc's allocator for every case alike, fivefold's and the peers' (as train.malloc)")
    parser.add_argument("--json", default="runs/bench/dp.json")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.global_batch=8")
    args = parser.parse_args()
    malloc = apply_malloc(args.malloc)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        print(f"allocator for every case, fivefold's and the peers' alike: malloc={malloc.setting} ({malloc.detail})")
    config = load_config("small", args.overrides)
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    if args.collectives or args.optimizer or args.floor or args.zero3_floor:
        run_micro_benchmark(args, config, sampler)
        dist.destroy_process_group()
        return
    skipped = set(filter(None, args.skip.split(",")))
    names = [args.case] if args.case else [c for c in all_cases() if c not in skipped]
    names = [name for name in names if bench.builds(name)]  # one case measured alone: only it
    cpu: dict[str, list[Usage]] = {name: [] for name in names}
    with contextlib.redirect_stdout(sys.stderr if dist.get_rank() else sys.stdout):
        cases = {name: cpu_timed(make_case(name, config, sampler), cpu[name]) for name in names}
        results = bench.alternate(cases, args.warmup, args.rounds, sync=dist.barrier)
    keep_cpu_records(results, cpu, args.warmup)
    bench.gather_peak_rss(results)
    if dist.get_rank() == 0:
        report(args, config, results, malloc)
    dist.destroy_process_group()


def run_micro_benchmark(args, config: Config, sampler: Sampler) -> None:
    """--collectives, --optimizer or --floor: alternate the cases on every rank, rank 0 reports."""
    if args.floor:
        with contextlib.redirect_stdout(sys.stderr if dist.get_rank() else sys.stdout):
            cases = floor_cases(config, sampler)
        baseline = "compute"
        title, meta = "data-parallel steps against their floor (dp=2, gloo, small)", {}
    elif args.zero3_floor:
        with contextlib.redirect_stdout(sys.stderr if dist.get_rank() else sys.stdout):
            cases = zero3_floor_cases(config, sampler)
        baseline = "fivefold-dp"
        title, meta = "ZeRO-2/3 against dp, and dp's step plus the all-gathers ZeRO-3 adds (dp=2, gloo, small)", {}
    elif args.collectives:
        numel = sum(p.numel() for p in build_model(config.model, config.train.seed).parameters())
        numel -= numel % dist.get_world_size()
        cases, baseline = collective_cases(numel), "all_reduce"
        title, meta = f"bare gloo collectives of {numel * 4 / 2**20:.1f} MB (fp32), dp=2", {"numel": numel}
    else:
        cases, baseline = optimizer_cases(config), "torch-adamw-single-tensor"
        title, meta = "one AdamW step over the small preset's parameters (1 thread)", {}
    cpu: dict[str, list[Usage]] = {name: [] for name in cases}
    cases = {name: cpu_timed(case, cpu[name]) for name, case in cases.items()}
    facts = machine_facts()
    results = bench.alternate(cases, args.warmup, args.rounds, sync=dist.barrier)
    facts["load_average_after"] = os.getloadavg()[0]
    keep_cpu_records(results, cpu, args.warmup)
    per_rank = {key: gather_per_rank(results, key) for key in ("cpu_seconds", "main_thread_blocked_seconds")
                if args.floor or args.zero3_floor}
    if dist.get_rank() == 0:
        comparison = bench.compare(title, results, baseline, meta)
        if args.floor:
            comparison.meta["floor"] = floor_report(results, per_rank["cpu_seconds"], per_rank["main_thread_blocked_seconds"],
                                                       facts["cores"])
            comparison.meta["machine"] = facts
        bench.print_table(comparison)
        print_cpu(results)
        if args.zero3_floor:
            comparison.meta["cpu_ratio"] = cpu_ratios(results, baseline)
            comparison.meta["zero_verdict"] = zero_verdict(results, per_rank["cpu_seconds"], facts)
            print_zero_verdict(comparison.meta["zero_verdict"])
        if args.floor:
            print_floor(comparison.meta["floor"], facts, results)
        print(f"written {bench.write_json([comparison], args.json)}")


ZERO_BOUND = 1.03  # ZeRO-2/3 within 3% of plain data parallel on the same work
ZERO3_FLOOR = "fivefold-dp+zero3-regathers"
ZERO3_FLOOR_OVERLAPPED = "fivefold-dp+zero3-regathers-overlapped"
BUSY_UTILISATION = 0.8  # below it, other processes held the cores for a fifth of the step or more


def rank_sum(counter: dict[str, list[list[float]]], name: str, r: int) -> float:
    """A per-rank measure of case `name` (CPU seconds, blocked seconds) in round r, summed over ranks."""
    return sum(per_rank[r] for per_rank in counter[name])


def zero_verdict(results: dict, cpu: dict[str, list[list[float]]], facts: dict) -> dict:
    """--zero3-floor: each ZeRO stage against dp, and ZeRO-3 against its floor, as medians over
    rounds of per-round ratios (the cases of a round ran side by side), in wall time and in the
    CPU seconds of both ranks (every thread: compute, gloo's transfers and sums, copies).

    On two cores shared by two ranks, every CPU second of the transfers is taken from compute,
    so a quiet machine's wall ratio follows the CPU ratio; under other load the wall ratio
    mostly measures who got a core when. The floor (dp's step, then the bare all-gathers ZeRO-3
    must add) is what ZeRO-3's extra bytes cost with nothing else added.
    """
    def ratio(name: str, base: str) -> dict[str, float]:
        rounds = range(len(results[base].seconds))
        return {
            "wall": statistics.median(results[name].seconds[r] / results[base].seconds[r] for r in rounds),
            "cpu": statistics.median(rank_sum(cpu, name, r) / rank_sum(cpu, base, r) for r in rounds),
            "utilisation": statistics.median(rank_sum(cpu, name, r) / (results[name].seconds[r] * facts["cores"]) for r in rounds),
        }

    stages = {name: ratio(name, "fivefold-dp") for name in ("fivefold-zero2", "fivefold-zero3", ZERO3_FLOOR)}
    return {**stages, "zero3_over_floor": ratio("fivefold-zero3", ZERO3_FLOOR),
            "overlapped_floor": ratio(ZERO3_FLOOR_OVERLAPPED, "fivefold-dp"),
            "zero3_over_overlapped_floor": ratio("fivefold-zero3", ZERO3_FLOOR_OVERLAPPED),
            "dp_utilisation": ratio("fivefold-dp", "fivefold-dp")["utilisation"], "load_average": facts["load_average"],
            "load_average_after": facts["load_average_after"], "cores": facts["cores"]}


def print_zero_verdict(v: dict) -> None:
    print(f"verdict on CPU seconds of both ranks per step (median per-round ratio; load average "
          f"{v['load_average']:.1f} before, {v['load_average_after']:.1f} after, {v['cores']} cores):")
    for name in ("fivefold-zero2", "fivefold-zero3"):
        r = v[name]
        within = "within" if r["cpu"] <= ZERO_BOUND else "NOT within"
        print(f"  {name} / fivefold-dp: {r['cpu']:.3f} CPU ({within} {ZERO_BOUND - 1:.0%}), {r['wall']:.3f} wall")
    floor, own = v[ZERO3_FLOOR], v["zero3_over_floor"]
    print(f"  ZeRO-3's floor, dp + the all-gathers ZeRO-3 must add / fivefold-dp: {floor['cpu']:.3f} CPU, "
          f"{floor['wall']:.3f} wall")
    print(f"  fivefold-zero3 / its floor: {own['cpu']:.3f} CPU, {own['wall']:.3f} wall")
    beside, over = v["overlapped_floor"], v["zero3_over_overlapped_floor"]
    print(f"  the same all-gathers in flight during dp's step / fivefold-dp: {beside['cpu']:.3f} CPU, {beside['wall']:.3f} "
          f"wall; fivefold-zero3 / that: {over['cpu']:.3f} CPU, {over['wall']:.3f} wall")
    if floor["cpu"] > ZERO_BOUND:
        print(f"  the all-gathers ZeRO-3 adds cost more than {ZERO_BOUND - 1:.0%} of dp's CPU here: no implementation "
              "that sends ZeRO-3's bytes over these cores comes within the bound")
    loaded = v["dp_utilisation"] < BUSY_UTILISATION
    print("  utilisation, both ranks' CPU / (wall x cores): " + ", ".join(
        f"{name} {v[name]['utilisation']:.2f}" for name in ("fivefold-zero2", "fivefold-zero3", ZERO3_FLOOR))
        + f", fivefold-dp {v['dp_utilisation']:.2f}"
        + (" (far below 1: other processes held the cores, the wall ratios say little)" if loaded else ""))


FLOORS = {  # peer: (its fivefold counterpart, the compute alone, the collectives alone)
    "torch-ddp": ("fivefold-dp", "compute", "all_reduce"),
    "torch-zero1": ("fivefold-zero1", "compute-zero1", "reduce_scatter+all_gather"),
}


def machine_facts() -> dict:
    """What the floor assumes, measured rather than taken for granted: the cores this process
    may run on, torch's intra-op threads, this process's threads (main, gloo's, torch's) and
    the load average (other processes on the same cores make every wall time longer)."""
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "process_threads": len(os.listdir("/proc/self/task")),
        "load_average": os.getloadavg()[0],
    }


def gather_per_rank(results: dict, key: str) -> dict[str, list[list[float]]]:
    """Every rank's `extra[key]` per round (CPU seconds, blocked seconds), per case; a
    collective: every rank calls it."""
    names = list(results)
    local = torch.tensor([results[n].extra[key] for n in names], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return {n: [g[i].tolist() for g in gathered] for i, n in enumerate(names)}


def floor_report(results: dict, cpu: dict[str, list[list[float]]], blocked: dict[str, list[list[float]]],
                 cores: int) -> dict[str, dict]:
    """Per peer, per round (the cases of a round ran side by side), each step against the floor.

    The floor is the time no implementation of the same work can go below on this machine:
    every rank must spend the CPU of its compute alone (forward, backward, clip, AdamW, no
    communication) and the CPU of the gradients' collectives (gloo's sums and copies, on the
    same cores, measured bare on the same bytes). With those CPU seconds summed over the ranks,
    wall time is at least that sum / cores, and at least one rank's compute alone.

    A step's wall time on a loaded machine says little about its wall time on a quiet one, so
    the ceiling is built from what load moves little: CPU seconds (cases alternated in one round
    are inflated alike), and the seconds each rank's main thread was blocked (neither running
    nor waiting for a core: waiting on a collective). With one rank per core, a core can only
    idle while some main thread is blocked, so on a quiet machine a step's wall is at most (CPU
    of all ranks + their blocked seconds) / cores. A rank that arrives at a collective before
    the other also waits for the other's arrival; the ranks do the same work, so on a quiet
    machine they arrive together and that skew is the load's (a rank that lost its core): only
    the blocked seconds of the rank that waited least, counted for every rank, enter the bound.
    What remains (waiting for the collective itself, e.g. the last bucket's) only grows with
    load. `ceiling` = that bound for the peer over the floor, per round: the most any
    implementation of the same work could gain on the peer here.
    Returned per peer: the per-round ceilings (peer's and fivefold's bound over the floor), the
    medians of wall / floor and CPU / floor, utilisation (CPU of all ranks / (wall x cores)),
    the peer / fivefold ratio measured, and the verdict line.
    """
    ranks = len(cpu["compute"])
    spare_cores = max(0, cores - ranks)  # cores no main thread runs on may idle at any time

    def quiet_bound(name: str, r: int) -> float:
        wall = results[name].seconds[r]
        return (rank_sum(cpu, name, r) + ranks * least_blocked(name, r) + spare_cores * wall) / cores

    def least_blocked(name: str, r: int) -> float:
        return min(per_rank[r] for per_rank in blocked[name])

    out = {}
    for peer, (ours, compute, collectives) in FLOORS.items():
        rounds = range(len(results[peer].seconds))
        floor_cpu = [rank_sum(cpu, compute, r) + rank_sum(cpu, collectives, r) for r in rounds]
        floor_wall = [max(f / cores, max(c[r] for c in cpu[compute])) for r, f in zip(rounds, floor_cpu)]
        row: dict = {}
        for name, key in ((peer, "peer"), (ours, "fivefold")):
            wall = results[name].seconds
            row[f"{key}_bound_over_floor"] = [round(quiet_bound(name, r) / floor_wall[r], 4) for r in rounds]
            row[f"{key}_blocked_share"] = statistics.median(
                ranks * least_blocked(name, r) / (rank_sum(cpu, name, r) + ranks * least_blocked(name, r))
                for r in rounds)
            row[f"{key}_skew_s"] = statistics.median(
                rank_sum(blocked, name, r) - ranks * least_blocked(name, r) for r in rounds)
            row[f"{key}_wall_over_floor"] = statistics.median(wall[r] / floor_wall[r] for r in rounds)
            row[f"{key}_cpu_over_floor"] = statistics.median(rank_sum(cpu, name, r) / floor_cpu[r] for r in rounds)
            row[f"{key}_utilisation"] = statistics.median(rank_sum(cpu, name, r) / (wall[r] * cores) for r in rounds)
        row["ceiling"] = row["peer_bound_over_floor"]
        row["cpu_ceiling"] = [round(rank_sum(cpu, peer, r) / floor_cpu[r], 4) for r in rounds]
        row["measured_wall_per_round"] = [round(p / o, 4) for p, o in zip(results[peer].seconds, results[ours].seconds)]
        row["measured_wall"] = statistics.median(row["measured_wall_per_round"])
        row["measured_cpu"] = statistics.median(rank_sum(cpu, peer, r) / rank_sum(cpu, ours, r) for r in rounds)
        row["floor_wall_s"] = statistics.median(floor_wall)
        row["floor_cpu_s_per_rank"] = statistics.median(floor_cpu) / ranks
        row["verdict"] = bench.ceiling_verdict(peer, row["ceiling"])
        row["cpu_verdict"] = bench.ceiling_verdict(f"{peer} in CPU seconds", row["cpu_ceiling"])
        out[peer] = row
    return out


def print_floor(floor: dict[str, dict], facts: dict, results: dict) -> None:
    print(f"assumptions, measured: {facts['cores']} cores for this process (of {facts['cpu_count']}), "
          f"{facts['torch_threads']} torch thread(s), {facts['process_threads']} threads per process "
          f"(main, gloo's, torch's), load average {facts['load_average']:.1f} before and "
          f"{facts['load_average_after']:.1f} after (load stretches the measured wall times; the bounds and "
          "the verdict use CPU seconds and the waits on collectives, which load moves little)")
    print("rank 0, share of CPU on threads other than the main one (gloo's): " + ", ".join(
        f"{n} {1 - statistics.median(r.extra['main_thread_cpu_seconds']) / statistics.median(r.extra['cpu_seconds']):.0%}"
        for n, r in results.items()))
    print("rank 0, main thread per call, median s: running / waiting for a core / blocked on collectives: " + "; ".join(
        f"{n} " + " / ".join(f"{statistics.median(r.extra[f'main_thread_{k}_seconds']):.3f}"
                             for k in ("cpu", "queued", "blocked"))
        for n, r in results.items()))
    for peer, r in floor.items():
        ours = FLOORS[peer][0]
        peer_interval, ours_interval = (bench.median_interval(r[f"{k}_bound_over_floor"]) for k in ("peer", "fivefold"))
        print(f"floor for {peer} / {ours}: {r['floor_wall_s']:.3f} s wall, {r['floor_cpu_s_per_rank']:.3f} CPU s per rank "
              f"(compute alone + {FLOORS[peer][2]} alone)")
        print(f"  {peer} / floor: quiet-wall bound {statistics.median(r['peer_bound_over_floor']):.3f} "
              f"({peer_interval.low:.3f}-{peer_interval.high:.3f}; blocked on collectives {r['peer_blocked_share']:.1%} of "
              f"CPU + blocked, plus {r['peer_skew_s']:.3f} s of the ranks waiting for each other, left out), CPU {r['peer_cpu_over_floor']:.3f}, wall as measured {r['peer_wall_over_floor']:.3f} "
              f"(utilisation {r['peer_utilisation']:.2f})")
        print(f"  {ours} / floor: quiet-wall bound {statistics.median(r['fivefold_bound_over_floor']):.3f} "
              f"({ours_interval.low:.3f}-{ours_interval.high:.3f}; blocked on collectives {r['fivefold_blocked_share']:.1%} of "
              f"CPU + blocked, plus {r['fivefold_skew_s']:.3f} s of the ranks waiting for each other, left out), CPU {r['fivefold_cpu_over_floor']:.3f}, wall as measured {r['fivefold_wall_over_floor']:.3f} "
              f"(utilisation {r['fivefold_utilisation']:.2f})")
        print(f"  {peer} / {ours} measured {r['measured_wall']:.3f} wall, {r['measured_cpu']:.3f} CPU")
        print(f"  work alone (CPU, every wait left out): {r['cpu_verdict'].removeprefix('verdict: ')}")
        print(f"  wall on a quiet machine (CPU + waits on collectives): {r['verdict']}")


def keep_cpu_records(results: dict, cpu: dict[str, list[Usage]], warmup: int) -> None:
    """Per call of the timed rounds (the warm-up calls dropped): CPU seconds of the process,
    minor faults, and the main thread's time split into running, waiting for a core, and
    blocked (the rest of the call's wall time: waiting on collectives, i.e. on the other rank)."""
    for name, records in cpu.items():
        timed = records[warmup:]
        extra = results[name].extra
        extra["cpu_seconds"] = [u.cpu for u in timed]
        extra["minor_faults"] = [u.faults for u in timed]
        extra["main_thread_cpu_seconds"] = [u.main_cpu for u in timed]
        extra["main_thread_queued_seconds"] = [u.main_queued for u in timed]
        extra["main_thread_blocked_seconds"] = [max(0.0, u.wall - u.main_cpu - u.main_queued) for u in timed]


def print_cpu(results: dict) -> None:
    print("rank 0, median per call: " + "; ".join(
        f"{n} {statistics.median(r.extra['cpu_seconds']):.3f} CPU s, "
        f"{statistics.median(r.extra['minor_faults']):.0f} minor faults"
        for n, r in results.items()
    ))


def report(args, config: Config, results: dict, malloc: MallocState) -> None:
    meta = {"preset": "small", "dp": 2, "global_batch": config.train.global_batch, "seq_len": config.train.seq_len,
            "malloc": malloc.to_dict()}
    if args.case:
        res = results[args.case]
        per_rank = ", ".join(f"{r:.0f}" for r in res.extra["peak_rss_mb_per_rank"])
        print(f"{args.case}: median step {res.median:.3f} s; peak RSS per rank MB: {per_rank}")
        return
    comparisons = []
    for ours, peers in PAIRS.items():
        peers = [p for p in peers if p in results]
        if ours not in results or not peers:
            continue
        subset = {n: results[n] for n in [ours, *peers]}
        comparison = bench.compare(f"{ours} vs {', '.join(peers)} (dp=2, gloo, small)", subset, ours, meta)
        comparison.meta["cpu_ratio"] = cpu_ratios(subset, ours)
        bench.print_table(comparison)
        print(f"CPU time per step vs {ours} (median per-round ratio): "
              + ", ".join(f"{n} {r:.3f}" for n, r in comparison.meta["cpu_ratio"].items()))
        comparisons.append(comparison)
    stages = [n for n in ("fivefold-dp", "fivefold-zero1", "fivefold-zero2", "fivefold-zero3") if n in results]
    if "fivefold-dp" in stages and len(stages) > 1:
        subset = {n: results[n] for n in stages}
        title = "fivefold ZeRO stages vs plain data parallel (dp=2, gloo, small)"
        comparison = bench.compare(title, subset, "fivefold-dp", meta)
        comparison.meta["cpu_ratio_vs_dp"] = cpu_ratios(subset, "fivefold-dp")
        bench.print_table(comparison)
        print("CPU time per step vs fivefold-dp (median per-round ratio): "
              + ", ".join(f"{n} {r:.3f}" for n, r in comparison.meta["cpu_ratio_vs_dp"].items()))
        print_cpu(subset)
        comparisons.append(comparison)
    print(f"written {bench.write_json(comparisons, args.json)}")


def cpu_ratios(results: dict, baseline: str) -> dict[str, float]:
    """Per case, the median over rounds of its CPU seconds / the baseline's in the same round."""
    base = results[baseline].extra["cpu_seconds"]
    return {n: statistics.median(c / b for c, b in zip(r.extra["cpu_seconds"], base)) for n, r in results.items()}


if __name__ == "__main__":
    main()
