"""`fivefold train | generate | plan | parity | bench | convert | report | doctor`.

Configuration flags are dotted keys (`--train.steps 50`, `--layout.tp 2`, or
`--layout "dp=2,tp=2"`); every key is checked. A layout of more than one process restarts
the command as a job of local ranks supervised by `fivefold.job.launch` (gloo on CPU, NCCL on
CUDA) unless it already runs under torchrun or the launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from .job.cluster import adopt_slurm_environment, job_world_size, where_prefix
from .job.rundir import check_resume_or_overwrite
from .config import DEVICES, Config, ConfigError, Layout, preset_names, with_overrides
from .rules.layout import LayoutError, config_from_args, layout_overrides, validate


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


def cmd_train(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    adopt_slurm_environment()  # srun tasks join one job like torchrun's workers
    if args.world_size is not None and args.world_size < 1:
        raise CliError(f"--world-size={args.world_size} must be at least 1 (the number of processes for --layout auto)")
    check_resume_or_overwrite(args.resume, args.overwrite)  # before either reads or deletes the folder
    config = train_config(args, overrides)
    if args.run_dir:
        config = config.replace(train=_replace(config.train, run_dir=args.run_dir))
    if args.resume:
        config = config.replace(checkpoint=_replace(config.checkpoint, resume=True))
    if args.layout == "auto":
        config = choose_layout_automatically(config, args.world_size or job_world_size())
    config = validate(config)  # before any process starts
    from .job.rundir import removed_if_left_empty
    from .run import RunError, check_machine, check_steps_left, new_run_dir, run_training

    run_dir = new_run_dir(config)
    try:
        with removed_if_left_empty(run_dir):  # a refused run leaves no folder behind
            check_steps_left(config)
            check_machine(config)
            under_torchrun = "RANK" in os.environ
            if config.layout.world_size > 1 and not under_torchrun:
                return launch_training(config, args, argv, run_dir)
            records = run_training(config, run_dir, overwrite=args.overwrite)
    except RunError as err:
        print(f"fivefold: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the steps (loading, the final save) or a second Ctrl-C
        print(f"fivefold: interrupted (SIGINT) without a new checkpoint; {run_dir} keeps its earlier ones",
              file=sys.stderr)
        return 128 + signal.SIGINT
    return stop_status(records.stopped_by, run_dir, under_torchrun)


def stop_status(stopped_by: int, run_dir: Path, under_torchrun: bool) -> int:
    """The exit status of a run stopped by a signal after its checkpoint: 128 + the signal, as the
    launcher exits for a multi-process job. A rank under a launcher exits 0: its launcher
    (fivefold's or torchrun) reports the signal, and torchrun would count a nonzero rank as failed."""
    if not stopped_by or under_torchrun:
        return 0
    print(f"fivefold: stopped by {signal.Signals(stopped_by).name} after a checkpoint; continue with "
          f"fivefold train --run-dir {run_dir} --resume", file=sys.stderr)
    return 128 + stopped_by


def train_config(args: argparse.Namespace, overrides: list[str]) -> Config:
    """The config `train` runs: the preset or TOML file of --config (default small), except that
    --resume without --config continues the run folder's own saved config. The --layout string
    and dotted overrides apply on top; a --layout string describes the whole layout, as it does
    over a preset, while --layout.KEY changes one key of the saved layout."""
    from .job.rundir import saved_run_config

    saved = saved_run_config(Path(args.run_dir)) if args.resume and args.run_dir and args.config is None else None
    if saved is None:
        return config_from_args(args.config, args.layout, overrides)
    layout = layout_overrides(args.layout)
    return with_overrides(saved.replace(layout=Layout()) if layout else saved, layout + overrides)


def launch_training(config: Config, args: argparse.Namespace, argv: list[str], run_dir: Path) -> int:
    """Check the run folder and the data here, then start the layout's local ranks as a job that
    fivefold.job.launch supervises (restarts with --resume, collective watchdog, signals), every rank
    and every attempt writing to that folder. Returns the job's exit status."""
    from .job.launch import Job, run_job
    from .data.loader import check_data_source
    from .job.rundir import claim

    claim(run_dir, config.checkpoint.resume, args.overwrite).release()  # refuse before spawning
    check_data_source(config)  # a missing or bad data file is reported before any process starts
    if args.layout == "auto":
        argv = _replace_layout_arg(argv, config)
    if not args.run_dir:  # every rank must use the folder named here, not its own time stamp
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
    status = run_job(job)
    if status > 128:  # stopped by a signal: say where the run can go on from
        print(resume_hint(run_dir), file=sys.stderr)
    return status


def resume_hint(run_dir: Path) -> str:
    """The line after a stopped multi-process job: its last checkpoint and the command that continues it."""
    from .checkpoint import checkpoint_root, list_checkpoints

    found = list_checkpoints(checkpoint_root(run_dir))
    if not found:
        return f"fivefold: {run_dir} holds no checkpoint; start again with --overwrite"
    return f"fivefold: last checkpoint {found[0]}; continue with fivefold train --run-dir {run_dir} --resume"


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
        from .tools.auto_layout import choose_layout
    except ImportError:
        raise CliError("--layout auto needs the planner (fivefold.planner)") from None
    return choose_layout(config, world_size)


def cmd_generate(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .tools.generate import check_sampling_args, generate_text

    check_sampling_args(args.max_new_tokens, args.temperature, args.seed)

    print(generate_text(args.run, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.device))
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .tools.plan_cli import run_plan_cli

    return run_plan_cli(argv[1:])


def cmd_report(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .tools.report import run_report_cli

    return run_report_cli(argv[1:])


def cmd_parity(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    if args.steps < 1:
        raise CliError(f"--steps={args.steps} must be at least 1: parity compares the losses of that many steps")
    from .tools.parity_cli import run_parity_cli

    return run_parity_cli(args, overrides)


def cmd_bench(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .tools.bench import run_bench_cli

    return run_bench_cli(argv[1:])


def cmd_data(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .data.prepare import run_data_cli

    return run_data_cli(argv[1:])


def cmd_convert(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .checkpoint import run_convert_cli

    return run_convert_cli(argv[1:])


def cmd_doctor(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .tools.doctor import run_doctor_cli

    return run_doctor_cli(argv[1:])


def cmd_dryrun(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from .tools.dryrun import run_dryrun_cli

    config = config_from_args(args.config, args.layout, overrides)
    return run_dryrun_cli(config, args.world_size, args.rank, args.hardware)


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
        "--overwrite", action="store_true",
        help="replace the run already in --run-dir (what a run wrote there is deleted, other files are kept); "
        "without it, or --resume, a run folder that is not empty is refused",
    )
    train.add_argument(
        "--resume", action="store_true",
        help="continue from the newest complete checkpoint of --run-dir (start fresh if there is none) with "
        "the run's own saved config unless --config is given; checkpoints are written every "
        "--checkpoint.interval steps",
    )
    train.set_defaults(func=cmd_train)

    gen = sub.add_parser("generate", help="sample text from a trained run")
    gen.add_argument("--run", required=True, help="run directory with model.safetensors")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", choices=DEVICES, default="cpu", help="where to sample (auto: the GPU when there is one)")
    gen.set_defaults(func=cmd_generate)

    plan = sub.add_parser("plan", help="predict memory, time and communication of layouts", add_help=False)
    plan.set_defaults(func=cmd_plan)

    parity = sub.add_parser("parity", help="compare a layout with the single-process run, step by step")
    parity.add_argument("--config", default="tiny")
    parity.add_argument("--layout", required=True, help='e.g. "dp=2,tp=2,pp=2"')
    parity.add_argument("--steps", type=int, default=3)
    parity.set_defaults(func=cmd_parity)

    dry = sub.add_parser(
        "dryrun", help="build ranks of a real-size layout on this CPU with fake tensors; compare with the planner"
    )
    dry.add_argument("--config", default="llama3-8b", help="preset name or TOML path (default: llama3-8b)")
    dry.add_argument("--layout", required=True, help='e.g. "tp=8,pp=16,dp=128"')
    dry.add_argument("--world-size", type=int, default=None, help="ranks of the layout (checked against it)")
    dry.add_argument("--rank", type=int, action="append", default=None, help="rank to build (repeatable; default 0)")
    dry.add_argument("--hardware", default="H100-80GB", help="device whose memory the peak is held against")
    dry.set_defaults(func=cmd_dryrun)

    bench = sub.add_parser("bench", help="side-by-side benchmarks against peers", add_help=False)
    bench.set_defaults(func=cmd_bench)

    convert = sub.add_parser("convert", help="export to / import from Hugging Face folders", add_help=False)
    convert.set_defaults(func=cmd_convert)

    report = sub.add_parser("report", help="HTML page and PNG figures of a run folder", add_help=False)
    report.set_defaults(func=cmd_report)
    doctor = sub.add_parser("doctor", help="check fivefold on this machine's GPU: fivefold doctor --gpu", add_help=False)
    doctor.set_defaults(func=cmd_doctor)
    data = sub.add_parser("data", help="prepare training data: fivefold data prepare FILES --out DIR", add_help=False)
    data.set_defaults(func=cmd_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["train"]
    parser = build_parser()
    try:
        if argv[0] in ("plan", "bench", "convert", "report", "data", "doctor"):
            commands = {"plan": cmd_plan, "bench": cmd_bench, "convert": cmd_convert, "report": cmd_report,
                        "data": cmd_data, "doctor": cmd_doctor}
            args = argparse.Namespace(func=commands[argv[0]])
            return args.func(args, [], argv)
        rest, overrides = split_dotted(argv)
        args = parser.parse_args(rest)
        if args.command is None:
            parser.print_help()
            return 0
        return args.func(args, overrides, argv)
    except (ConfigError, LayoutError, CliError, ValueError, FileNotFoundError) as err:
        print(f"fivefold: error: {where_prefix()}{err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk or a read-only folder met while writing (bad input is caught above)
        print(f"fivefold: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
