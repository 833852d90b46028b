"""The cases of `fivefold doctor --gpu`: what one GPU must do for fivefold, each checked on its own.

Every case is a function of a `Bench` (the device, the sizes, a scratch folder) that returns
a one-line summary and its numbers, or raises `CheckFailed` (a bound not met) or whatever
error the runtime met. The bounds below are reasoned from the formats' precision; none has
been measured on a GPU yet.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Config, load_config
from ..parallel.mesh import Mesh
from ..run import load_data, run_training
from ..train import build, train_step

# Loss per step on the device against the same run in fp32 on the CPU, relative. bf16 keeps 8
# significant bits: the test suite holds bf16 losses to 2^-8 of fp32 after two steps (measured
# 1.3e-4 on CPU); over the few steps run here the bound is two such units. TF32 keeps 11 bits,
# 8 times finer: 2^-11 per rounding, with the same two-unit allowance on top, 2^-9.
DEVICE_VS_CPU_RTOL = {"bf16": 2.0**-7, "tf32": 2.0**-9}
# Peak memory against the planner's prediction: the margin at which a run itself warns of drift.
MEMORY_RATIO_BOUNDS = (0.75, 1.25)
ONE_BILLION_SHAPES = [  # Llama-3.2-1B's layers with a 32k vocabulary: 1.1e9 parameters
    "model.hidden=2048", "model.layers=16", "model.heads=32", "model.kv_heads=8", "model.ffn_hidden=8192",
    "model.vocab_size=32000", "model.max_seq_len=2048", "train.seq_len=2048", "train.global_batch=4",
]


class CheckFailed(AssertionError):
    """A measurement outside its stated bound; the message gives both."""


@dataclass(frozen=True)
class Bench:
    """Where and how large the cases run. `quick` shrinks every model and run to seconds on a
    CPU, so the code paths can be exercised without a GPU."""

    device: torch.device
    quick: bool
    scratch: Path

    def config(self, preset: str, *overrides: str) -> Config:
        """A preset at the doctor's size, on its device, without validation passes."""
        size = (["model.layers=1", "train.seq_len=16", "train.global_batch=2", "train.steps=3"] if self.quick
                else ["train.steps=20"])
        base = [f"train.device={self.device.type}", "train.eval_interval=0", "train.warmup_steps=1"]
        return load_config(preset, base + size + list(overrides))

    def train(self, name: str, config: Config, overwrite: bool = True) -> list[dict]:
        """Train `config` into its own folder under the scratch folder; the per-step records.
        train.deterministic is process-wide: it is undone afterwards, so later cases run at full speed."""
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            # fp32 runs on CUDA train in TF32 (job/determinism.py `runs_tf32`), as users' runs do
            return run_training(config, self.scratch / name, show_progress=False, overwrite=overwrite)
        finally:
            torch.use_deterministic_algorithms(deterministic)


def _losses(records: list[dict]) -> list[float]:
    losses = [float(r["loss"]) for r in records]
    if not all(math.isfinite(x) for x in losses):
        raise CheckFailed(f"a loss is not finite: {losses}")
    return losses


def _trained(bench: Bench, name: str, config: Config) -> tuple[str, dict]:
    losses = _losses(bench.train(name, config))
    if len(losses) >= 10 and not min(losses[-3:]) < losses[0]:  # too few steps in quick runs to ask for progress
        raise CheckFailed(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps", {"losses": losses}


# ----------------------------------------------------------------------------- training cases


def dense_fp32_tf32(bench: Bench) -> tuple[str, dict]:
    return _trained(bench, "dense-fp32", bench.config("tiny"))


def dense_bf16(bench: Bench) -> tuple[str, dict]:
    return _trained(bench, "dense-bf16", bench.config("tiny", "train.dtype=bf16", "train.param_dtype=bf16"))


# Quick runs compile in fp32 at the shapes of tests/parallel/test_compile.py's single-process
# test, whose graphs inductor's on-disk cache then already holds: a CPU compiles for minutes.
QUICK_COMPILE_SHAPES = ("train.dtype=fp32", "model.layers=4", "train.global_batch=8", "layout.grad_accum=2")


def dense_compiled(bench: Bench) -> tuple[str, dict]:
    shapes = QUICK_COMPILE_SHAPES if bench.quick else ()
    config = bench.config("tiny", "train.dtype=bf16", "train.compile=true", *shapes)
    summary, data = _trained(bench, "dense-compiled", config)
    return f"{config.train.dtype}: {summary}", data


def moe_bf16(bench: Bench) -> tuple[str, dict]:
    return _trained(bench, "moe-bf16", bench.config("tiny-moe", "train.dtype=bf16", "train.param_dtype=bf16"))


def document_masking(bench: Bench) -> tuple[str, dict]:
    from ..data.prepare import prepare

    source, prepared = bench.scratch / "documents.jsonl", bench.scratch / "documents"
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(source, "w") as f:  # documents of 2..60 characters: most sequences hold several
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 10)))}) + "\n")
    prepare([str(source)], prepared, workers=1, overwrite=True)
    config = bench.config("tiny", f"data.source={prepared}", "data.document_mask=true", "train.dtype=bf16")
    return _trained(bench, "document-mask", config)


def recomputation(bench: Bench) -> tuple[str, dict]:
    """Full recomputation repeats the forward's own kernels: with deterministic kernels its
    losses equal the stored-activation run's bit for bit."""
    runs = {r: _losses(bench.train(f"recompute-{r}", bench.config("tiny", f"layout.recompute={r}", "train.deterministic=true")))
            for r in ("none", "full")}
    if runs["none"] != runs["full"]:
        raise CheckFailed(f"recomputed losses differ: {runs['full']} vs {runs['none']}")
    return f"{len(runs['full'])} losses bitwise equal with and without recomputation", runs


def save_resume_export(bench: Bench) -> tuple[str, dict]:
    """A run stopped at a checkpoint and resumed gives the uninterrupted run's losses (deterministic
    kernels, so bit for bit); its weights export to a Hugging Face folder that transformers loads."""
    from ..checkpoint.convert import export_hf

    full = bench.config("tiny", "train.deterministic=true", "train.steps=4", "checkpoint.interval=2")
    straight = _losses(bench.train("straight", full))
    _losses(bench.train("resumed", full.replace(train=_with(full.train, steps=2))))
    resumed_config = full.replace(checkpoint=_with(full.checkpoint, resume=True))
    tail = _losses(bench.train("resumed", resumed_config, overwrite=False))
    if tail != straight[2:]:
        raise CheckFailed(f"resumed losses {tail} differ from the uninterrupted run's {straight[2:]}")
    folder, _ = export_hf(bench.scratch / "resumed", bench.scratch / "exported")
    loaded = _load_in_transformers(folder)
    return f"resumed at step 2 bitwise; exported {folder.name}/ ({loaded})", {"losses": straight, "resumed": tail}


def _load_in_transformers(folder: Path) -> str:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return "transformers not installed: not loaded"
    model = AutoModelForCausalLM.from_pretrained(folder)
    return f"loaded by transformers as {type(model).__name__}"


def _with(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


def device_vs_cpu(bench: Bench) -> tuple[str, dict]:
    """The loss of every step on the device against the same run in fp32 on the CPU."""
    cpu = Bench(torch.device("cpu"), quick=True, scratch=bench.scratch)
    steps = ["train.steps=3", "model.layers=2"]
    reference = _losses(cpu.train("cpu-fp32", cpu.config("tiny", *steps)))
    kinds = {"tf32": bench.config("tiny", *steps, "train.seq_len=16", "train.global_batch=2"),
             "bf16": bench.config("tiny", *steps, "train.seq_len=16", "train.global_batch=2", "train.dtype=bf16")}
    worst: dict[str, float] = {}
    for kind, config in kinds.items():
        losses = _losses(bench.train(f"device-{kind}", config))
        worst[kind] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        if worst[kind] > DEVICE_VS_CPU_RTOL[kind]:
            raise CheckFailed(f"{kind} loss off the CPU's fp32 by {worst[kind]:.2e} (bound {DEVICE_VS_CPU_RTOL[kind]:.2e})")
    text = ", ".join(f"{k} {v:.1e} (bound {DEVICE_VS_CPU_RTOL[k]:.1e})" for k, v in worst.items())
    return f"worst relative loss difference: {text}", {"relative_diff": worst, "cpu_losses": reference}


# ----------------------------------------------------------------------------- kernels


def sdpa_kernels(bench: Bench) -> tuple[str, dict]:
    """Which SDPA kernel each attention path of the model runs, named from the profiler's events."""
    from ..model.attention import document_causal_attention, grouped_query_attention

    B, T, d = 2, (64 if bench.quick else 1024), 64
    dtype = torch.bfloat16 if bench.device.type == "cuda" else torch.float32

    def tensor(heads: int) -> torch.Tensor:  # (B, heads, T, d)
        return torch.randn(B, heads, T, d, device=bench.device, dtype=dtype, requires_grad=True)

    def inputs(kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tensor(8), tensor(kv_heads), tensor(kv_heads)

    docs = (torch.arange(T, device=bench.device) // (T // 4)).expand(B, T)
    paths: dict[str, Callable[[], torch.Tensor]] = {
        "causal": lambda: grouped_query_attention(*inputs(8)),
        "causal, grouped heads": lambda: grouped_query_attention(*inputs(2)),
        "document mask": lambda: document_causal_attention(*inputs(2), docs),  # per document, no mask
    }
    used = {name: _attention_kernels(run, bench.device) for name, run in paths.items()}
    if not all(used.values()):
        raise CheckFailed(f"no attention kernel found in the profile of {[n for n, k in used.items() if not k]}")
    return "; ".join(f"{name}: {_backend(k)}" for name, k in used.items()), {"kernels": used}


ATTENTION_KERNEL = re.compile(r"flash|fmha|efficient|cudnn|scaled_dot_product|attention|softmax", re.IGNORECASE)


def _attention_kernels(run: Callable[[], torch.Tensor], device: torch.device) -> list[str]:
    """Names of the attention kernels (device kernels on CUDA, aten ops on CPU) of a forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    run().sum().backward()  # warm-up: kernel selection and library loading stay out of the profile
    with profile(activities=activities) as prof:
        run().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    on_device = [e for e in prof.events() if e.device_type.name == "CUDA"] if device.type == "cuda" else []
    names = {e.name for e in (on_device or prof.events())}
    return sorted(n for n in names if ATTENTION_KERNEL.search(n) and n != "aten::scaled_dot_product_attention")


def _backend(kernels: list[str]) -> str:
    """The SDPA backend the kernel names belong to."""
    text = " ".join(kernels).lower()
    for backend, marks in (("cuDNN", ("cudnn",)), ("flash", ("flash",)), ("memory-efficient", ("efficient", "fmha")),
                           ("math", ("softmax", "math"))):
        if any(m in text for m in marks):
            return backend
    return "unknown"


# ----------------------------------------------------------------------------- speed and memory


def _measure_config(bench: Bench, *overrides: str) -> Config:
    shapes = [] if bench.quick else ONE_BILLION_SHAPES
    return bench.config("tiny", *shapes, "train.dtype=bf16", *overrides)


def throughput(bench: Bench) -> tuple[str, dict]:
    """Tokens/s and MFU of fivefold against transformers' LlamaForCausalLM of the same shapes
    (bf16 autocast over fp32 weights, SDPA, fused AdamW), one process."""
    from ..rules.flops import model_flops_per_token

    config = _measure_config(bench)
    flops = model_flops_per_token(config.model, config.train.seq_len)
    peak = _peak_flops(bench.device)
    rows = {"fivefold": _fivefold_steps(config, bench.device, steps=3 if bench.quick else 8)[0]}
    if _has_transformers():
        rows["transformers"] = _transformers_steps(config, bench.device, steps=3 if bench.quick else 8)
    numbers = {name: {"tokens_per_s": tps, "mfu": tps * flops / peak} for name, tps in rows.items()}
    text = "; ".join(f"{name} {v['tokens_per_s']:,.0f} tokens/s, MFU {v['mfu']:.1%}" for name, v in numbers.items())
    absent = "" if "transformers" in rows else " (transformers not installed)"
    return f"{_params_text(config)}: {text}{absent}", {"peak_flops": peak, "rows": numbers}


def peak_memory(bench: Bench) -> tuple[str, dict]:
    """The allocator's peak of each step (reset before it) against the planner's prediction for the device."""
    from ..observe.prediction import predict_run
    from ..rules.layout import validate

    # bf16 parameters and gradients with fp32 masters: the policy the planner calls "bf16"
    config = validate(_measure_config(bench, "train.param_dtype=bf16"))
    _, peaks = _fivefold_steps(config, bench.device, steps=3)
    predicted = predict_run(config, bench.device)
    if "error" in predicted:
        raise CheckFailed(predicted["error"])
    total = predicted["memory_bytes"]["total"]
    ratio = max(peaks) / total
    data = {"peak_bytes_per_step": peaks, "predicted_bytes": total, "hardware": predicted["hardware"], "ratio": ratio}
    text = f"peak {max(peaks) / 2**30:.2f} GiB vs planned {total / 2**30:.2f} GiB ({predicted['hardware']}): x{ratio:.2f}"
    if bench.device.type != "cuda":  # peak RSS holds the interpreter and torch: not the planner's quantity
        return text + " (not judged on CPU: peak RSS)", data
    low, high = MEMORY_RATIO_BOUNDS
    if not low <= ratio <= high:
        raise CheckFailed(f"{text}, outside [{low}, {high}]")
    return text, data


def _params_text(config: Config) -> str:
    from ..rules.params import total_params

    return f"{total_params(config.model) / 1e9:.2f}B parameters" if total_params(config.model) > 1e8 else \
        f"{total_params(config.model) / 1e6:.1f}M parameters"


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _peak_flops(device: torch.device) -> float:
    """The datasheet bf16 peak of the device's planner preset on CUDA; a measured one on CPU."""
    if device.type == "cuda":
        from ..observe.prediction import hardware_for
        from ..planner import HARDWARE

        return HARDWARE[hardware_for(device)].peak_flops
    from ..observe.metrics import peak_flops_for_log

    return peak_flops_for_log(torch.bfloat16, device, 1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_peak(device: torch.device) -> int:
    from ..observe.metrics import peak_memory_bytes

    return peak_memory_bytes(device)


def _fivefold_steps(config: Config, device: torch.device, steps: int) -> tuple[float, list[int]]:
    """Tokens/s over `steps` steps after one warm-up step, and the peak memory of each step."""
    from ..rules.layout import validate

    config = validate(config)
    torch.manual_seed(config.train.seed)
    _, sampler = load_data(config)
    model = build(config, Mesh.single(config.layout), device)
    train_step(model, sampler, 0)
    peaks, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        train_step(model, sampler, step)
        _synchronize(device)
        peaks.append(_step_peak(device))
    seconds = time.perf_counter() - start
    del model
    return steps * config.train.global_batch * config.train.seq_len / seconds, peaks


def _transformers_steps(config: Config, device: torch.device, steps: int) -> float:
    """Tokens/s of LlamaForCausalLM with the same shapes, batch and optimizer, after one warm-up step."""
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    m, t = config.model, config.train
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn, num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim,
        max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tied_embeddings, use_cache=False, attn_implementation="sdpa",
    )).to(device).train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    tokens = torch.randint(0, m.vocab_size, (t.global_batch, t.seq_len + 1), device=device)

    def step() -> None:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = hf(input_ids=tokens[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return steps * t.global_batch * t.seq_len / (time.perf_counter() - start)


# (name, case), in the order they run and print; a tuple, so no caller can change the list.
CASES: tuple[tuple[str, Callable[[Bench], tuple[str, dict]]], ...] = (
    ("dense fp32 (TF32)", dense_fp32_tf32),
    ("dense bf16", dense_bf16),
    ("dense compiled", dense_compiled),
    ("MoE bf16", moe_bf16),
    ("document masking", document_masking),
    ("recomputation", recomputation),
    ("save, resume, export", save_resume_export),
    ("device vs CPU loss", device_vs_cpu),
    ("SDPA kernels", sdpa_kernels),
    ("tokens/s and MFU", throughput),
    ("peak memory vs planner", peak_memory),
)
