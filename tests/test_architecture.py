"""The import rules of docs/architecture.md, checked on the source (lazy imports included).

Imports flow downward: cli -> run and tools -> train -> parallelize -> parallel/ -> mesh, comm
-> model -> config. A module may import its own layer or any layer below it, never above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fivefold"

# Lower numbers are lower in the stack. A module not named here is a tool (layer TOOLS): it
# may use the whole runtime, and nothing in the runtime may use it.
CONFIG, PURE, MODEL, MESH, PARALLEL, COMPOSE, LOOP, TOOLS, CLI = range(9)
LAYERS: dict[str, int] = {
    "fivefold": CONFIG,
    "fivefold.config": CONFIG,
    "fivefold.layout": PURE,
    "fivefold.precision": PURE,
    "fivefold.volumes": PURE,
    "fivefold.flops": PURE,
    "fivefold.stages": PURE,
    "fivefold.held_memory": PURE,
    "fivefold.textfiles": PURE,
    "fivefold.data": PURE,
    "fivefold.indexed": PURE,
    "fivefold.packing": PURE,
    "fivefold.blend": PURE,
    "fivefold.planner": PURE,  # the cost model: pure functions of config and layout
    "fivefold.planner.auto": TOOLS,  # reads the machine: devices, calibration
    "fivefold.planner.compare": TOOLS,  # draws figures
    "fivefold.planner.cli": TOOLS,
    "fivefold.model": MODEL,
    "fivefold.step": MODEL,  # what a step is made of, below the strategies and the loop
    "fivefold.mesh": MESH,
    "fivefold.parallel": PARALLEL,
    "fivefold.regional_compile": PARALLEL,  # a transformation the composition point applies, like a strategy
    "fivefold.parallel.comm": MESH,
    "fivefold.parallel.schedules": PURE,
    "fivefold.parallelize": COMPOSE,
    "fivefold.train": LOOP,
    "fivefold.metrics": LOOP,  # FLOPs, MFU and the per-step measurements the loop logs
    "fivefold.prediction": LOOP,  # the planner's prediction for the run, beside its measurements
    # A run's checkpoints (regions, state, format, reader, resume, convert): the run layer,
    # which the tools use; a strategy never imports it.
    "fivefold.checkpoint": TOOLS,
    "fivefold.tools": TOOLS,  # parity, diagnosis, dry run, reports, benchmarks, HF folders, test harness
    "fivefold.cli": CLI,
}


def layer_of(module: str) -> int:
    """The layer of `module`: its own entry, else its nearest package's, else a tool's."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS and (end == len(parts) or name != "fivefold"):
            return LAYERS[name]
    return TOOLS


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every fivefold module `path` imports, at module level or inside functions."""
    own = module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{alias.name}" for alias in node.names]
            found.update(n if _is_module(n) else target for n in names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "fivefold" or name.startswith("fivefold.")}


def _is_module(dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", sources(), ids=lambda p: module_name(p))
def test_imports_flow_downward(path: Path) -> None:
    here = module_name(path)
    upward = [m for m in imported_modules(path) if layer_of(m) > layer_of(here)]
    assert not upward, f"{here} (layer {layer_of(here)}) imports {upward} from a higher layer"


def test_the_model_is_plain_pytorch() -> None:
    for path in (PACKAGE / "model").rglob("*.py"):
        text = path.read_text()
        assert "torch.distributed" not in text, f"{path.name} uses torch.distributed"
        outside = {m for m in imported_modules(path) if not m.startswith(("fivefold.model", "fivefold.config"))}
        assert not outside, f"{path.name} imports {outside}: the model may use only the config"


def test_strategies_do_not_import_the_loop_or_the_composition_point() -> None:
    for path in (PACKAGE / "parallel").rglob("*.py"):
        above = {m for m in imported_modules(path) if layer_of(m) >= COMPOSE}
        assert not above, f"{module_name(path)} imports {above}"


def test_the_rule_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checks above are only as good as the import finder: prove it on known cases."""
    found = imported_modules(PACKAGE / "parallelize.py")
    assert "fivefold.parallel.tensor_parallel" in found  # imported inside a function
    assert "fivefold.config" in found  # `from .config import Config`
    assert layer_of("fivefold.parallel.zero") == PARALLEL
    assert layer_of("fivefold.some_new_tool") == TOOLS
