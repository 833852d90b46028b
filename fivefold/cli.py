"""`fivefold train | generate | plan | parity | bench | convert`.

Configuration flags are dotted keys (`--train.steps 50`, `--layout.tp 2`, or
`--layout "dp=2,tp=2"`); every key is checked. A layout of more than one process restarts
the command as a job of local ranks supervised by `fivefold.launch` (gloo on CPU, NCCL on
CUDA) unless it already runs under torchrun or the launcher.
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import Config, ConfigError, load_config, preset_names
from .layout import LayoutError, parse_layout_string, validate


class CliError(Exception):
    pass


def split_dotted(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--section.key value` / `--section.key=value` overrides from other arguments."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key = arg[2:]
            if "=" in key:
                overrides.append(key)
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{arg} needs a value")
                overrides.append(f"{key}={argv[i + 1]}")
                i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def config_from_args(config_name: str | None, layout: str | None, overrides: list[str]) -> Config:
    extra = list(overrides)
    if layout and layout != "auto":
        extra = [f"layout.{k}={v}" for k, v in parse_layout_string(layout).items()] + extra
    return load_config(config_name or "small", extra)


def launch_local_ranks(config: Config, argv: list[str]) -> int:
    """Re-run this `train` command as the local ranks of a job supervised by fivefold.launch
    (restarts with --resume, collective watchdog, signals); the job's exit status."""
    from .launch import Job, check_fault_settings, run_job
    from .run import new_run_dir

    check_fault_settings(config.train)
    run_dir = new_run_dir(config)
    if not config.train.run_dir:  # every rank and every attempt must write the same folder
        argv = [*argv, "--run-dir", str(run_dir)]
    job = Job(
        world_size=config.layout.world_size,
        command=("-m", "fivefold.cli", *argv),
        resume_args=("--resume",),
        max_restarts=config.train.max_restarts,
        collective_timeout_s=config.train.collective_timeout_s,
        stop_grace_s=config.train.stop_grace_s,
        flight_dir=run_dir / "flight_records",
    )
    return run_job(job)


def cmd_train(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    config = config_from_args(args.config, args.layout, overrides)
    if args.run_dir:
        config = config.replace(train=_replace(config.train, run_dir=args.run_dir))
    if args.resume:
        config = config.replace(checkpoint=_replace(config.checkpoint, resume=True))
    if args.layout == "auto":
        config = choose_layout_automatically(config, args.world_size)
    config = validate(config)  # before any process starts
    under_torchrun = "RANK" in os.environ
    if config.layout.world_size > 1 and not under_torchrun:
        argv = [a for a in argv]
        if args.layout == "auto":
            argv = _replace_layout_arg(argv, config)
        return launch_local_ranks(config, argv)
    from .run import run_training

    run_training(config)
    return 0


def _replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _replace_layout_arg(argv: list[str], config: Config) -> list[str]:
    layout = config.layout
    text = (
        f"dp={layout.dp},tp={layout.tp},pp={layout.pp},cp={layout.cp},ep={layout.ep},zero={layout.zero},"
        f"vpp={layout.vpp},pp_schedule={layout.pp_schedule},sequence_parallel={layout.sequence_parallel},"
        f"cp_algorithm={layout.cp_algorithm},recompute={layout.recompute},micro_batch={layout.micro_batch},"
        f"grad_accum={layout.grad_accum}"
    )
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--layout":
            out += ["--layout", text]
            skip = True
        elif a.startswith("--layout="):
            out.append(f"--layout={text}")
        else:
            out.append(a)
    return out


def choose_layout_automatically(config: Config, world_size: int | None) -> Config:
    try:
        from .planner.auto import choose_layout
    except ImportError:
        raise CliError("--layout auto needs the planner (fivefold.planner)") from None
    return choose_layout(config, world_size)


def cmd_generate(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .generate import generate_text

    print(generate_text(args.run, args.prompt, args.max_new_tokens, args.temperature, args.seed))
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .planner.cli import run_plan_cli

    return run_plan_cli(argv[1:])


def cmd_parity(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .parity_cli import run_parity_cli

    return run_parity_cli(args, overrides)


def cmd_bench(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .bench import run_bench_cli

    return run_bench_cli(argv[1:])


def cmd_convert(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .checkpoint import run_convert_cli

    return run_convert_cli(argv[1:])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fivefold",
        description="Train LLMs with data, tensor, pipeline, expert and context parallelism.",
        epilog="Config keys are set with dotted flags, e.g. --train.steps 50 --layout.tp 2. "
        f"Presets: {', '.join(preset_names())}.",
    )
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="train a model (default: the small preset on the embedded corpus)")
    train.add_argument("--config", default=None, help="preset name or TOML path (default: small)")
    train.add_argument("--layout", default=None, help='e.g. "dp=2,tp=2,pp=2", or "auto" to let the planner choose')
    train.add_argument("--run-dir", default=None, help="where metrics, checkpoints and weights go")
    train.add_argument("--world-size", type=int, default=None, help="processes for --layout auto")
    train.add_argument(
        "--resume", action="store_true",
        help="continue from the newest complete checkpoint of --run-dir (start fresh if there is none); "
        "checkpoints are written every --checkpoint.interval steps",
    )
    train.set_defaults(func=cmd_train)

    gen = sub.add_parser("generate", help="sample text from a trained run")
    gen.add_argument("--run", required=True, help="run directory with model.safetensors")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)

    plan = sub.add_parser("plan", help="predict memory, time and communication of layouts", add_help=False)
    plan.set_defaults(func=cmd_plan)

    parity = sub.add_parser("parity", help="compare a layout with the single-process run, step by step")
    parity.add_argument("--config", default="tiny")
    parity.add_argument("--layout", required=True, help='e.g. "dp=2,tp=2,pp=2"')
    parity.add_argument("--steps", type=int, default=3)
    parity.set_defaults(func=cmd_parity)

    bench = sub.add_parser("bench", help="side-by-side benchmarks against peers", add_help=False)
    bench.set_defaults(func=cmd_bench)

    convert = sub.add_parser("convert", help="export to / import from Hugging Face folders", add_help=False)
    convert.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["train"]
    parser = build_parser()
    try:
        if argv[0] in ("plan", "bench", "convert"):
            args = argparse.Namespace(func={"plan": cmd_plan, "bench": cmd_bench, "convert": cmd_convert}[argv[0]])
            return args.func(args, [], argv)
        rest, overrides = split_dotted(argv)
        args = parser.parse_args(rest)
        if args.command is None:
            parser.print_help()
            return 0
        return args.func(args, overrides, argv)
    except (ConfigError, LayoutError, CliError, ValueError, FileNotFoundError) as err:
        print(f"fivefold: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
