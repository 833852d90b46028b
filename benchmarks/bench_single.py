"""Single-process training throughput: fivefold against transformers' LlamaForCausalLM.

Both train the same Llama shape (fivefold's weights are copied into the Hugging Face model,
and the script checks that the parameter counts and the logits agree) on the same batches
of the embedded corpus, with the same loss normalisation, gradient clipping, AdamW
hyper-parameters, dtype and torch thread count. fivefold runs its real training step
(`fivefold.train.build` + `train_step`); transformers runs the usual loop (forward, cross
entropy, backward, `clip_grad_norm_`, fused `torch.optim.AdamW.step`, `zero_grad`). A second pair
of cases times forward + backward only, without an optimizer step. Both sides hold the same
tensors in both pairs: the model and its AdamW state (fivefold allocates the state when it
builds the model; transformers' optimizer is given its state up front), so that the memory
measured per case compares like with like.

A fp32 (or bf16) GEMM of the model's largest matmul shape is timed in the same rounds, so
model FLOPs utilisation (fivefold.observe.metrics) is stated against the FLOP/s this machine
reached while the benchmark ran. All cases alternate after a warm-up (fivefold.tools.bench).

    fivefold bench single --rounds 5 --steps 2 --dtype fp32
    python benchmarks/bench_single.py --dtype fp32,bf16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run directly from a checkout

from fivefold.tools.bench import CaseResult, Comparison, alternate, builds, compare, write_json  # noqa: E402
from fivefold.config import Config, ModelConfig, load_config  # noqa: E402
from fivefold.data.sources import Sampler, load_tokenizer, load_tokens  # noqa: E402
from fivefold.rules.layout import validate  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.observe.metrics import DTYPES, matmul_operands  # noqa: E402
from fivefold.rules.flops import model_flops_per_token  # noqa: E402
from fivefold.model import count_parameters  # noqa: E402
from fivefold.parallel.optim import decays, lr_at  # noqa: E402
from fivefold.parallelize import ParallelModel  # noqa: E402
from fivefold.train import build, forward_backward, local_micro_batches, train_step  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fivefold bench single", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="dense preset to train (default: small)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 (autocast) or both: fp32,bf16")
    p.add_argument("--steps", type=int, default=2, help="training steps per case and round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds after the warm-up")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of every case first")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both")
    p.add_argument("--matmul-reps", type=int, default=0, help="GEMMs per matmul case (0: about one step's FLOPs)")
    p.add_argument("--out", default="bench_results/single.json")
    p.add_argument("--compile", action="store_true",
                   help="also time fivefold with train.compile=true (each block compiled); reports the compile time")
    p.add_argument("--floor", action="store_true",
                   help="also time the step's GEMM, attention and AdamW kernels replayed alone (step_floor.py): "
                        "transformers' time / that is the largest speed-up any compilation can reach")
    p.add_argument("--autograd-swiglu", action="store_true",
                   help="also time fivefold's fwd_bwd with SwiGLU differentiated by autograd (silu(gate) * up) "
                        "instead of its in-place function, alternated with the rest; prints the CPU-time ratio")
    p.add_argument("--profile", type=int, default=0, metavar="ROUNDS",
                   help="after timing, profile ROUNDS alternated train steps of each side and print "
                        "self CPU seconds and calls per aten op, per step (torch.profiler); with --compile, "
                        "each of inductor's fused kernels is named in the profile too")
    return p.parse_args(argv)


# --- the transformers peer ----------------------------------------------------------------


def hf_model_like(m: ModelConfig):
    """LlamaForCausalLM of the same shape: GQA, SwiGLU, RMSNorm, RoPE, no biases, untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if m.is_moe:
        raise SystemExit(f"bench single compares dense models; preset {m.name} is Mixture-of-Experts")
    hc = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.n_kv_heads,
        head_dim=m.head_dim, max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tied_embeddings, use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hc).train()


def hf_name(name: str) -> str:
    """fivefold parameter name -> LlamaForCausalLM parameter name."""
    fixed = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # layers.{i}.{module}.{leaf}.weight
    module = {
        "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    }[".".join(parts[2:-1])]
    return f"model.layers.{parts[1]}.{module}.weight"


@torch.no_grad()
def copy_weights(source: torch.nn.Module, hf: torch.nn.Module) -> None:
    target = dict(hf.named_parameters())
    for name, param in source.named_parameters():
        target[hf_name(name)].copy_(param)


def hf_optimizer(hf: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    """torch AdamW with fivefold's hyper-parameters; decay on matrices only, as fivefold does.
    `fused=True`: torch's fused kernel, the kind fivefold runs (on CPU torch's default is the
    slower single-tensor loop, which would flatter fivefold)."""
    t = config.train
    named = list(hf.named_parameters())
    groups = [
        {"params": [p for _, p in named if decays(p.dim())], "weight_decay": t.weight_decay},
        {"params": [p for _, p in named if not decays(p.dim())], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    allocate_adamw_state(opt)
    return opt


def allocate_adamw_state(opt: torch.optim.AdamW) -> None:
    """Allocate now what AdamW's first step would (a step count and two moments per parameter,
    as torch's fused AdamW initialises them): fivefold's optimizer allocates its state when it
    is built, so with this both sides hold the same tensors in every case, including forward +
    backward only, where no optimizer steps."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def hf_loss(hf, inputs: torch.Tensor, targets: torch.Tensor, config: Config) -> torch.Tensor:
    """fivefold's normalisation: sum of token losses over the tokens of the global batch."""
    with autocast(config):
        logits = hf(input_ids=inputs).logits  # (B, T, V)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return ce / (config.train.global_batch * config.train.seq_len)


def autocast(config: Config) -> contextlib.AbstractContextManager:
    if config.train.dtype == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --- cases ----------------------------------------------------------------------------------


class Counter:
    """Step index shared by the cases of one side, so both sides see the same batches."""

    def __init__(self) -> None:
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value - 1


def fivefold_cases(model: ParallelModel, sampler: Sampler, steps: int) -> dict[str, Callable[[], None]]:
    counter, device = Counter(), torch.device("cpu")

    def train() -> None:
        for _ in range(steps):
            train_step(model, sampler, counter.next())

    def fwd_bwd() -> None:
        for _ in range(steps):
            forward_backward(model, local_micro_batches(model, sampler, counter.next()), device)
            model.optimizer.zero_grad()

    return {"train": train, "fwd_bwd": fwd_bwd}


def transformers_cases(hf, config: Config, sampler: Sampler, steps: int) -> dict[str, Callable[[], None]]:
    counter, opt = Counter(), hf_optimizer(hf, config) if hf is not None else None  # None: not built

    def train() -> None:
        for _ in range(steps):
            step = counter.next()
            inputs, targets = sampler.global_batch_at(step)
            hf_loss(hf, inputs, targets, config).backward()
            if config.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), config.train.grad_clip)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, config.train)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def fwd_bwd() -> None:
        for _ in range(steps):
            inputs, targets = sampler.global_batch_at(counter.next())
            hf_loss(hf, inputs, targets, config).backward()
            opt.zero_grad(set_to_none=True)

    return {"train": train, "fwd_bwd": fwd_bwd}


def with_autograd_swiglu(case: Callable[[], None]) -> Callable[[], None]:
    """`case` with the model's SwiGLU as autograd differentiates it: the ablation of its function."""
    from fivefold.model import llama

    def run() -> None:
        ours, llama.swiglu = llama.swiglu, lambda gate, up: F.silu(gate) * up
        try:
            case()
        finally:
            llama.swiglu = ours

    return run


def matmul_case(config: Config, reps: int) -> tuple[Callable[[], None], float]:
    """`reps` GEMMs of the model's SwiGLU up-projection shape (B*T, h) @ (h, ffn); returns FLOPs."""
    m, t = config.model, config.train
    shape = (t.global_batch * t.seq_len, m.hidden, m.ffn)
    a, b = matmul_operands(shape, DTYPES[t.dtype])
    out = a @ b

    def run() -> None:
        for _ in range(reps):
            torch.matmul(a, b, out=out)

    return run, 2.0 * shape[0] * shape[1] * shape[2] * reps


# --- setup and equivalence ----------------------------------------------------------------


def setup(preset: str, dtype: str):
    config = validate(load_config(preset, [f"train.dtype={dtype}", "train.eval_interval=0"]))
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    # with one case measured alone (FIVEFOLD_BENCH_ALONE) the other side is not built
    ours = builds("fivefold train", "fivefold fwd_bwd")
    model = build(config, Mesh.single(config.layout), torch.device("cpu")) if ours else None
    hf = hf_model_like(config.model) if builds("transformers train", "transformers fwd_bwd") else None
    if model is not None and hf is not None:
        copy_weights(model.chunks[0], hf)
    return config, sampler, model, hf


def compiled_cases(config: Config, sampler: Sampler, steps: int, name_kernels: bool = False
                   ) -> tuple[dict[str, Callable[[], None]], float]:
    """fivefold's cases with train.compile=true, and the wall seconds of the first call (compiling).

    `name_kernels`: inductor records each generated kernel as a profiler event of its own
    (one more event per kernel call, about a hundred per step), so that a profile shows what
    the fused element-wise work costs, kernel by kernel, instead of lumping it into the call
    of each compiled graph. The setting stays on for the rest of the process (it is part of
    inductor's cache key); outside a profile each kernel call only checks that none is active."""
    if name_kernels:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    config = config.replace(train=dataclasses.replace(config.train, compile=True))
    cases = fivefold_cases(build(config, Mesh.single(config.layout), torch.device("cpu")), sampler, steps)
    start = time.perf_counter()
    cases["fwd_bwd"]()
    return cases, time.perf_counter() - start


@torch.no_grad()
def check_same_model(model: ParallelModel, hf, sampler: Sampler) -> dict:
    """Parameter counts of both, and how far apart their fp32 logits are on one batch."""
    counts = {"fivefold": count_parameters(model.chunks[0]), "transformers": count_parameters(hf)}
    if counts["fivefold"] != counts["transformers"]:
        raise SystemExit(f"parameter counts differ: {counts}")
    inputs, _ = sampler.global_batch_at(0)
    ours, _ = model.chunks[0](inputs[:2])
    theirs = hf(input_ids=inputs[:2]).logits
    return {"params": counts, "max_logit_diff_fp32": float((ours - theirs).abs().max())}


# --- reporting --------------------------------------------------------------------------------


# Op kinds of the profile's summary: the matrix products both models run with the same
# shapes, the attention kernels, and the rest (element-wise, reductions, copies, optimizer).
OP_KINDS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
}


def profile_ops(cases: dict[str, Callable[[], None]], rounds: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per case, {op: (calls, self CPU seconds)} per call of the case over `rounds` alternated
    calls: the calls' median, the seconds' minimum (another process taking the core only ever
    adds time, so the fastest round is the closest to the op's own cost)."""
    from torch.profiler import ProfilerActivity, profile

    samples: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            seen = {event.key: (float(event.count), event.self_cpu_time_total / 1e6) for event in prof.key_averages()}
            for op in set(seen) | set(samples[name]):
                samples[name].setdefault(op, []).append(seen.get(op, (0.0, 0.0)))
    return {
        name: {op: (statistics.median(c for c, _ in values), min(t for _, t in values))
               for op, values in ops.items()}
        for name, ops in samples.items()
    }


# Inductor's generated C++ kernels (with cpp.enable_kernel_profile) are recorded as
# "graph_<n>_cpp_fused_<ops>_<i>": the element-wise and reduction work a compiled region fuses.
FUSED_KIND, FUSED_MARK = "inductor fused kernels", "_cpp_fused_"


def op_kind(op: str) -> str:
    if FUSED_MARK in op:
        return FUSED_KIND
    return next((kind for kind, names in OP_KINDS.items() if op in names), "everything else")


def print_op_profile(ops: dict[str, dict[str, tuple[float, float]]], steps: int, top: int = 30) -> None:
    """The `top` ops by self CPU time in any case, the ops whose call counts differ, and the
    time by op kind, the cases side by side, per training step."""
    def cost(op: str) -> float:
        return max(case.get(op, (0.0, 0.0))[1] for case in ops.values())

    def row(op: str) -> str:
        cells = [case.get(op, (0.0, 0.0)) for case in ops.values()]
        return f"{op[:58]:58s} " + " | ".join(f"{c / steps:6.0f} {t / steps:8.4f}" for c, t in cells)

    names = sorted({op for case in ops.values() for op in case}, key=lambda op: -cost(op))
    header = " | ".join(ops)
    print(f"self CPU per train step, by op (calls: median, seconds: fastest round): {header}")
    for op in names[:top]:
        print(row(op))
    differ = [op for op in names if len({round(case.get(op, (0.0, 0.0))[0]) for case in ops.values()}) > 1]
    print(f"ops called a different number of times (calls, seconds): {header}")
    for op in differ:
        print(row(op))
    print(f"self CPU s per step by kind: {header}")
    for kind in (*OP_KINDS, FUSED_KIND, "everything else"):
        totals = [sum(t for op, (_, t) in case.items() if op_kind(op) == kind) / steps for case in ops.values()]
        print(f"  {kind:22s} " + " | ".join(f"{t:.3f}" for t in totals))
    print("  total                  " + " | ".join(
        f"{sum(t for _, t in case.values()) / steps:.3f}" for case in ops.values()))
    print_rest_budget(ops, steps)


def print_rest_budget(ops: dict[str, dict[str, tuple[float, float]]], steps: int, target: float = 1.05) -> None:
    """What 'everything else' may cost fivefold for `target` x transformers' speed, with the
    matrix products and attention costing what they cost transformers (same calls, same shapes)."""
    if "fivefold" not in ops or "transformers" not in ops:
        return
    def by_kind(case: str, kind: str) -> float:
        return sum(t for op, (_, t) in ops[case].items() if op_kind(op) == kind) / steps

    theirs_total = sum(t for _, t in ops["transformers"].values()) / steps
    shared = sum(by_kind("transformers", kind) for kind in OP_KINDS)
    print(f"for {target:.2f}x transformers with its matrix products and attention ({shared:.3f} s), everything "
          f"else must fit in {theirs_total / target - shared:.3f} s per step: fivefold's takes "
          f"{by_kind('fivefold', 'everything else'):.3f} s, transformers' {by_kind('transformers', 'everything else'):.3f} s")


class CpuClock:
    """Wraps a case to record the process CPU seconds of each call, beside the wall time that
    `alternate` records: time spent waiting for a core on a shared machine does not count."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.seconds = fn, []

    def __call__(self) -> None:
        start = time.process_time()
        self.fn()
        self.seconds.append(time.process_time() - start)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_spread(times: list[float], baseline: list[float]) -> dict:
    """Per-round throughput ratio baseline_time / time, summarised."""
    return spread([b / t for t, b in zip(times, baseline)])


def summarize(results: dict[str, CaseResult], cpu: dict[str, list[float]], config: Config, steps: int,
              matmul_flops: float) -> tuple[list[Comparison], dict]:
    """Two comparisons (train step, fwd+bwd) with tokens/s, per-round ratios and MFU per case."""
    t = config.train
    tokens = steps * t.global_batch * t.seq_len
    step_flops = tokens * model_flops_per_token(config.model, t.seq_len)
    peaks = [matmul_flops / s for s in results["matmul"].seconds]  # FLOP/s, one per round
    cpu_peaks = [matmul_flops / s for s in cpu["matmul"]]
    summary = {
        "matmul_gflops": spread([p / 1e9 for p in peaks]),
        "matmul_gflops_cpu_time": spread([p / 1e9 for p in cpu_peaks]),
        "model_gflop_per_step": step_flops / steps / 1e9,
    }
    comparisons = []
    for kind, title in (("train", "train step (fwd+bwd+clip+AdamW)"), ("fwd_bwd", "forward + backward only")):
        names = {f"fivefold {kind}": "fivefold", f"transformers {kind}": "transformers"}
        if f"fivefold+compile {kind}" in results:
            names[f"fivefold+compile {kind}"] = "fivefold+compile"
        for key in names:
            res, base = results[key], f"transformers {kind}"
            res.extra["tokens_per_s"] = tokens / res.median
            res.extra["mfu"] = spread([step_flops / s / p for s, p in zip(res.seconds, peaks)])
            res.extra["mfu_cpu_time"] = spread([step_flops / s / p for s, p in zip(cpu[key], cpu_peaks)])
            res.extra["throughput_vs_transformers"] = ratio_spread(res.seconds, results[base].seconds)
            res.extra["throughput_vs_transformers_cpu_time"] = ratio_spread(cpu[key], cpu[base])
            res.extra["cpu_seconds"] = cpu[key]
        meta = {"kind": kind, "dtype": t.dtype, "threads": torch.get_num_threads(), "steps_per_round": steps} | summary
        subset = {label: results[key] for key, label in names.items()}
        comparisons.append(compare(f"{title}, {config.model.name}, {t.dtype}", subset, "transformers", meta))
    return comparisons, summary


def _fmt(s: dict, scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    return f"{scale * s['median']:.{digits}f}{unit} [{scale * s['min']:.{digits}f}-{scale * s['max']:.{digits}f}]"


def print_report(comparisons: list[Comparison], summary: dict, equivalence: dict, config: Config) -> None:
    from rich.console import Console
    from rich.table import Table

    t = config.train
    table = Table(title=f"single process, {config.model.name}, {t.dtype}, batch {t.global_batch} x {t.seq_len}, "
                        f"{torch.get_num_threads()} threads; median \\[min-max] over rounds")
    steps = comparisons[0].meta["steps_per_round"]
    for column in ("case", f"wall s / {steps} steps", "tokens/s", "fivefold / transformers tokens/s",
                   "same, by CPU time", "MFU (wall)", "MFU (CPU time)"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for comparison in comparisons:
        for name, res in comparison.cases.items():
            x = res.extra
            ours = name.startswith("fivefold")
            table.add_row(
                f"{name} {comparison.meta['kind']}", f"{res.median:.3f}", f"{x['tokens_per_s']:,.0f}",
                _fmt(x["throughput_vs_transformers"]) if ours else "",
                _fmt(x["throughput_vs_transformers_cpu_time"]) if ours else "",
                _fmt(x["mfu"], 100, 1, "%"), _fmt(x["mfu_cpu_time"], 100, 1, "%"),
            )
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)  # a log file keeps whole rows
    console.print(table)
    params = equivalence["params"]
    console.print(
        f"parameters: fivefold {params['fivefold']:,}, transformers {params['transformers']:,}; "
        f"max |logit diff| fp32 {equivalence['max_logit_diff_fp32']:.2e}\n"
        f"measured {t.dtype} GEMM GFLOP/s: wall {_fmt(summary['matmul_gflops'], digits=1)}, "
        f"CPU time {_fmt(summary['matmul_gflops_cpu_time'], digits=1)}; "
        f"model {summary['model_gflop_per_step']:.1f} GFLOP per step (fivefold.observe.metrics: 6N + 12LHQT)"
    )


def run_dtype(args: argparse.Namespace, dtype: str) -> list[Comparison]:
    config, sampler, model, hf = setup(args.preset, dtype)
    equivalence = check_same_model(model, hf, sampler) if model is not None and hf is not None else {}
    ours = fivefold_cases(model, sampler, args.steps)
    theirs = transformers_cases(hf, config, sampler, args.steps)
    per_step = config.train.global_batch * config.train.seq_len * model_flops_per_token(config.model, config.train.seq_len)
    shape_flops = 2 * config.train.global_batch * config.train.seq_len * config.model.hidden * config.model.ffn
    reps = args.matmul_reps or max(1, round(per_step / shape_flops))
    matmul, matmul_flops = matmul_case(config, reps) if builds("matmul") else ((lambda: None), 0.0)
    cases = {
        "fivefold train": ours["train"], "transformers train": theirs["train"],
        "fivefold fwd_bwd": ours["fwd_bwd"], "transformers fwd_bwd": theirs["fwd_bwd"], "matmul": matmul,
    }
    compile_s = None
    if args.compile and builds("fivefold+compile train", "fivefold+compile fwd_bwd"):
        compiled, compile_s = compiled_cases(config, sampler, args.steps, name_kernels=args.profile > 0)
        cases |= {"fivefold+compile train": compiled["train"], "fivefold+compile fwd_bwd": compiled["fwd_bwd"]}
    if args.autograd_swiglu and model is not None:
        cases["fivefold autograd-swiglu fwd_bwd"] = with_autograd_swiglu(ours["fwd_bwd"])
    if args.floor and hf is not None:
        from step_floor import floor_case

        cases["floor"] = floor_case(theirs["train"])
    clocks = {name: CpuClock(fn) for name, fn in cases.items()}
    results = alternate(clocks, warmup=args.warmup, rounds=args.rounds)
    cpu = {name: clock.seconds[args.warmup:] for name, clock in clocks.items()}  # drop the warm-up calls
    comparisons, summary = summarize(results, cpu, config, args.steps, matmul_flops)
    for c in comparisons:
        c.meta |= {"equivalence": equivalence, "matmul_reps": reps, "matmul_rounds_s": results["matmul"].seconds,
                   "compile_first_call_s": compile_s}
    print_report(comparisons, summary, equivalence, config)
    if compile_s is not None:
        print(f"train.compile: first fwd_bwd call (compilation included) took {compile_s:.1f} s")
    if "fivefold autograd-swiglu fwd_bwd" in cpu:
        ratio = ratio_spread(cpu["fivefold fwd_bwd"], cpu["fivefold autograd-swiglu fwd_bwd"])
        print(f"fwd_bwd CPU time, SwiGLU by autograd / by fivefold's function, per-round: {_fmt(ratio)}")
    if "floor" in results:
        from step_floor import floor_ratios

        for clock, seconds in (("wall", {n: r.seconds for n, r in results.items()}), ("CPU time", cpu)):
            train = {name: s for name, s in seconds.items() if name.endswith(" train") or name == "floor"}
            print(f"train step / floor (GEMM, attention and AdamW kernels alone), {clock}, median over rounds: "
                  + ", ".join(f"{name} {ratio:.3f}" for name, ratio in floor_ratios(train).items()))
    if args.profile:
        profiled = {"fivefold": ours["train"], "transformers": theirs["train"]}
        if args.compile:
            profiled["fivefold+compile"] = compiled["train"]
        print_op_profile(profile_ops(profiled, args.profile), args.steps)
    return comparisons


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtype: unknown {unknown}; use fp32, bf16 or fp32,bf16")
    comparisons = [c for dtype in dtypes for c in run_dtype(args, dtype)]
    print(f"wrote {write_json(comparisons, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
