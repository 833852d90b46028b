"""``fivefold plan``: search layouts or cost one layout from the command line."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from ..planner.errors import PlanError
from ..planner.estimate import check_kept_gather_fits, estimate
from ..planner.explain import explain
from ..planner.hardware import HARDWARE, calibrate, calibration_path
from ..planner.models import MODELS, load_model
from .plan_render import format_breakdown, format_table, to_json
from ..planner.search import search
from ..planner.spec import parse_layout


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fivefold plan",
        description="Predict memory, time and MFU of parallel layouts and rank them.")
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(MODELS)}) or a .json/.toml file of ModelSpec fields")
    p.add_argument("--gpus", type=int, default=None, help="number of devices (default: the layout's, or 8)")
    p.add_argument("--hardware", default="H100-80GB", help=f"one of {', '.join(HARDWARE)}")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: 8 per device)")
    p.add_argument("--layout", default=None,
                   help='cost one layout, e.g. "dp=2,tp=4,pp=2,zero=1,sp=1,recompute=selective,mb=1"')
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine, save it as the 'cpu' hardware, and plan for it")
    p.add_argument("--top", type=int, default=10, help="how many layouts to show")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"),
                   help="fp8: the linear layers DeepSeek-V3 runs in FP8 at the FP8 peak, the rest as bf16")
    p.add_argument("--optimizer", default="adam", help="adam, adamw or sgd")
    p.add_argument("--compare", choices=("zero", "schedule", "axes", "hsdp", "zero3-pp"), default=None,
                   help="zero: memory per ZeRO stage; schedule: bubble and activations per pipeline schedule "
                        "(and their ideal Gantt charts as a PNG); axes: the five strategies side by side; "
                        "hsdp: ZeRO-3 over every device against hybrid sharding; zero3-pp: ZeRO-3 with and "
                        "without pipeline stages")
    p.add_argument("--out", default="plan-schedules.png", help="PNG written by --compare schedule")
    return p


def run_plan_cli(argv: list[str]) -> int:
    """Run ``fivefold plan``; returns the process exit code (2 for bad input)."""
    args = build_parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    try:
        return _run(args, out, err)
    except PlanError as exc:
        err.print(f"[bold red]fivefold plan:[/] {exc}", highlight=False, soft_wrap=True)  # one line, whatever the width
        return 2


def _run(args: argparse.Namespace, out: Console, err: Console) -> int:
    hardware = args.hardware
    if args.calibrate:
        hw = calibrate(save=True)
        err.print(f"calibrated cpu: {hw.peak_flops / 1e9:.1f} GFLOP/s, gloo all-reduce "
                  f"{hw.intra_node_bw / 1e9:.2f} GB/s; saved to {calibration_path()}")
        hardware = "cpu"
    if args.top < 1:
        raise PlanError(f"--top must be at least 1, got {args.top}")
    for flag, value in (("--gpus", args.gpus), ("--seq-len", args.seq_len), ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise PlanError(f"{flag} must be at least 1, got {value}")
    model = load_model(args.model)
    if args.seq_len is not None:
        model = model.replace(seq_len=args.seq_len)
    if args.compare:
        from .plan_compare import run_compare

        return run_compare(args, model, hardware, out)
    if args.layout:
        return _one_layout(args, model, hardware, out)
    gpus = 8 if args.gpus is None else args.gpus
    gb = 8 * gpus if args.global_batch is None else args.global_batch
    cands = search(model, gpus=gpus, hardware=hardware, global_batch=gb, precision=args.precision,
                   optimizer=args.optimizer, top=max(args.top, 10))
    from .plan_compare import rules_of_thumb

    text = "\n".join([explain(model, cands), *rules_of_thumb(model, cands[0][1])])
    if args.json:
        print(to_json(cands, top=args.top, explanation=text))
    else:
        out.print(format_table(cands, top=args.top))
        out.print(text, highlight=False)
        _print_runtime_gaps(model, out)
    return 0


def _one_layout(args: argparse.Namespace, model, hardware: str, out: Console) -> int:
    defaults = {"global_batch": args.global_batch} if args.global_batch else {}
    layout = parse_layout(args.layout, **defaults)
    if not args.global_batch and "global_batch" not in args.layout and "gb=" not in args.layout:
        layout = layout.replace(global_batch=layout.dp * layout.micro_batch)
    if args.gpus is not None and args.gpus != layout.world:
        raise PlanError(f"--layout uses {layout.world} devices but --gpus={args.gpus}; "
                        f"make dp*tp*pp*cp equal {args.gpus} or drop --gpus")
    e = estimate(model, layout, hardware, args.precision, args.optimizer)
    check_kept_gather_fits(e)
    if args.json:
        print(to_json(e))
    else:
        out.print(format_breakdown(e))
        _print_runtime_gaps(model, out, layout)
    return 0


def _print_runtime_gaps(model, out: Console, layout=None) -> None:
    """Say which parts of a planned shape or layout `fivefold train` cannot train: the plan is
    the planner's alone there."""
    for gap in (*model.runtime_gaps(), *(layout.runtime_gaps() if layout else ())):
        out.print(f"[bold yellow]planner only:[/] fivefold train cannot train {gap}", highlight=False)


def main() -> None:  # pragma: no cover - thin wrapper
    sys.exit(run_plan_cli(sys.argv[1:]))


if __name__ == "__main__":  # pragma: no cover
    main()
