"""`fivefold doctor --gpu`: check, on one GPU, what the CPU test suite cannot.

The test suite runs on CPUs. This command runs the GPU-only parts once, on the installed
torch and without a network, in a few minutes: training in fp32 (TF32), bf16 and compiled,
dense and MoE, document masking, recomputation, save + resume + export, the loss against the
CPU's, the SDPA kernel of each attention path, tokens/s and MFU next to transformers, and the
peak memory next to the planner's. Each case is caught on its own: one failing case is recorded
with the first line of its error and the others still run. It prints one table and writes JSON.

`--device cpu --quick` runs the same cases at small sizes on the CPU, so the code is tested
without a GPU; it says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .doctor_cases import CASES, Bench


class DoctorRefused(ValueError):
    """The doctor cannot run here; the message says what to change."""


@dataclass
class CaseOutcome:
    name: str
    passed: bool
    summary: str  # what it measured, or the first line of its error
    seconds: float
    data: dict = field(default_factory=dict)


def check_can_run(device: str, quick: bool) -> torch.device:
    """Refuse, before anything runs, a GPU check without a GPU, or a full-size one on a CPU."""
    if device == "cpu":
        if not quick:
            raise DoctorRefused("--device cpu runs the cases at test sizes only; add --quick")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise DoctorRefused(f"doctor --gpu needs a CUDA GPU, but {build} (torch {torch.__version__}); "
                            "run it on a machine with a GPU")
    return torch.device("cuda", torch.cuda.current_device())


def run_case(name: str, case, bench: Bench) -> CaseOutcome:
    start = time.perf_counter()
    try:
        summary, data = case(bench)
        passed = True
    except Exception as err:  # every failure is a result of the check, never the end of it
        summary, data, passed = first_error_line(err), {}, False
    return CaseOutcome(name, passed, summary, time.perf_counter() - start, data)


def first_error_line(err: BaseException) -> str:
    """The error's type and first line; where it has no message (a bare assert), where it was raised."""
    lines = str(err).strip().splitlines()
    if lines:
        return f"{type(err).__name__}: {lines[0]}"
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    where = f"{Path(frame.filename).name}:{frame.lineno} {frame.line}" if frame else "no message"
    return f"{type(err).__name__} at {where}"


def run_cases(bench: Bench, only: list[str] | None = None) -> list[CaseOutcome]:
    outcomes = []
    for name, case in CASES:
        if only and name not in only:
            continue
        outcomes.append(run_case(name, case, bench))
        print(f"  {'ok  ' if outcomes[-1].passed else 'FAIL'} {name} ({outcomes[-1].seconds:.1f} s)", flush=True)
    return outcomes


def machine_record(device: torch.device, quick: bool) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "quick": quick, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def print_table(outcomes: list[CaseOutcome], machine: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fivefold doctor on {machine['device']} (torch {machine['torch']})")
    for column in ("case", "result", "seconds", "measured"):
        table.add_column(column)
    for o in outcomes:
        table.add_row(o.name, "pass" if o.passed else "FAIL", f"{o.seconds:.1f}", o.summary)
    Console(width=200).print(table)


def write_report(outcomes: list[CaseOutcome], machine: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "cases": [asdict(o) for o in outcomes]}, indent=1, default=str))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold doctor", description="check fivefold on this machine's GPU")
    parser.add_argument("--gpu", action="store_true", help="run the single-GPU checks (the only checks so far)")
    parser.add_argument("--out", default="doctor.json", help="where the JSON results go (default: doctor.json)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="testing only: cpu runs the cases on the CPU (with --quick)")
    parser.add_argument("--quick", action="store_true", help="testing only: every case at small sizes")
    parser.add_argument("--case", action="append", default=None, help="run only this case (repeatable)")
    return parser


def run_doctor_cli(argv: list[str]) -> int:
    """Returns 0 when every case passed, 1 when one failed; a refusal raises DoctorRefused (exit 2)."""
    args = build_parser().parse_args(argv)
    if not args.gpu:
        raise DoctorRefused("say what to check: fivefold doctor --gpu")
    names = [name for name, _ in CASES]
    unknown = [c for c in args.case or [] if c not in names]
    if unknown:
        raise DoctorRefused(f"--case {unknown[0]!r} is unknown; use one of: {', '.join(names)}")
    device = check_can_run(args.device, args.quick)
    machine = machine_record(device, args.quick)
    with tempfile.TemporaryDirectory(prefix="fivefold-doctor-") as scratch:
        outcomes = run_cases(Bench(device, args.quick, Path(scratch)), args.case)
    print_table(outcomes, machine)
    write_report(outcomes, machine, Path(args.out))
    failed = [o.name for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} cases passed; results: {args.out}")
    return 1 if failed else 0
