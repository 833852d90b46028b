"""The import rules of docs/architecture.md, checked on the source (lazy and type-only imports included).

The tree is the layer map: each line of `LAYERS` is one package (or one module of the main
path), bottom to top. A module may import its own line and the lines below it, never a line
above; inside `fivefold.tools`, whose modules build on each other, `TOOLS` orders them the
same way. Every module must fall under a line (there is no default layer), and no two files
may import each other, directly or through others.

`python tests/test_architecture.py` prints the counts the rules keep: modules, loose modules
beside the packages, import circles and upward imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fivefold"

# Bottom to top. A module may import from its own line and every line above it in this list.
LAYERS: tuple[str, ...] = (
    "fivefold._moved",  # the old import paths of moved modules, kept for one release
    "fivefold",  # the package itself: its version
    "fivefold.config",  # frozen values and TOML presets
    "fivefold.rules",  # pure rules the runtime and the planner share
    "fivefold.planner",  # the cost model: functions of config and rules
    "fivefold.data",  # tokens in, batches out
    "fivefold.model",  # plain PyTorch
    "fivefold.parallel",  # the mesh, every collective, the strategies
    "fivefold.parallelize",  # the composition point
    "fivefold.observe",  # what a run measures
    "fivefold.train",  # one step
    "fivefold.job",  # processes, folders, the machine's settings
    "fivefold.checkpoint",  # saving, resuming, Hugging Face in and out
    "fivefold.run",  # a whole run
    "fivefold.tools",  # built on the runtime (ordered inside by TOOLS)
    "fivefold.cli",  # the command line
)

# Inside fivefold.tools, bottom to top: a tool may import the tools before it, never after.
TOOLS: tuple[str, ...] = (
    "fivefold.tools",
    "fivefold.tools.testing",
    "fivefold.tools.host_syncs",
    "fivefold.tools.saved_activations",
    "fivefold.tools.plan_render",
    "fivefold.tools.plan_compare",
    "fivefold.tools.auto_layout",
    "fivefold.tools.plan_cli",
    "fivefold.tools.parity",
    "fivefold.tools.diagnose",
    "fivefold.tools.parity_cli",
    "fivefold.tools.dryrun",
    "fivefold.tools.generate",
    "fivefold.tools.report",
    "fivefold.tools.bench",
    "fivefold.tools.doctor_cases",
    "fivefold.tools.doctor",
)


class ImportMap:
    """The fivefold modules under one package root and the fivefold modules each imports."""

    def __init__(self, package: Path) -> None:
        self.package = package
        self.paths = {self.module_name(p): p for p in sorted(package.rglob("*.py"))}
        self.edges = {name: self.imported_modules(path) - {name} for name, path in self.paths.items()}

    def module_name(self, path: Path) -> str:
        parts = list(path.relative_to(self.package.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def is_module(self, dotted: str) -> bool:
        relative = Path(*dotted.split(".")[1:])
        return (self.package / relative).with_suffix(".py").exists() or (self.package / relative / "__init__.py").exists()

    def imported_modules(self, path: Path) -> set[str]:
        """Every fivefold module `path` imports, at module level, inside functions or for types only."""
        own = self.module_name(path).split(".")
        package = own if path.name == "__init__.py" else own[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{alias.name}" for alias in node.names]
                found.update(n if self.is_module(n) else target for n in names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        return {name for name in found if name == "fivefold" or name.startswith("fivefold.")}

    def cycles(self) -> list[list[str]]:
        """The import circles: strongly connected sets of more than one module (Tarjan)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        found: list[list[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            for w in sorted(self.edges.get(v, ())):
                if w not in self.edges:
                    continue
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

        for v in sorted(self.edges):
            if v not in index:
                visit(v)
        return found


def line_of(module: str, lines: tuple[str, ...]) -> int | None:
    """The index of the line `module` falls under (its longest listed prefix), None if none."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in lines:
            return lines.index(".".join(parts[:end]))
    return None


def rank(module: str) -> tuple[int, int]:
    """(layer, position among the tools): what an import may not increase."""
    layer = line_of(module, LAYERS)
    if layer is None:
        raise KeyError(module)
    inside = line_of(module, TOOLS) if LAYERS[layer] == "fivefold.tools" else 0
    return layer, inside if inside is not None else -1


def unplaced(imports: ImportMap) -> list[str]:
    """Modules under no line: a new package or tool must be given its place."""
    out = []
    for module in imports.paths:
        layer = line_of(module, LAYERS)
        if layer is None or (module != "fivefold" and LAYERS[layer] == "fivefold"):
            out.append(module)
        elif LAYERS[layer] == "fivefold.tools" and line_of(module, TOOLS) in (None, 0) and module != "fivefold.tools":
            out.append(module)
    return out


def upward_imports(imports: ImportMap) -> list[str]:
    """`importer -> imported` for every import that goes up the map."""
    bad = []
    for module, targets in sorted(imports.edges.items()):
        for target in sorted(targets):
            if target in imports.paths and rank(target) > rank(module):
                bad.append(f"{module} -> {target}")
    return bad


def loose_modules(imports: ImportMap) -> list[str]:
    """Modules directly in fivefold/ beside its packages (the package's own __init__ excluded)."""
    return sorted(m for m, p in imports.paths.items() if p.parent == imports.package and p.name != "__init__.py")


@pytest.fixture(scope="module")
def fivefold_imports() -> ImportMap:
    return ImportMap(PACKAGE)


def test_every_module_has_its_place_on_the_map(fivefold_imports: ImportMap) -> None:
    assert not unplaced(fivefold_imports), f"add these to LAYERS or TOOLS: {unplaced(fivefold_imports)}"


def test_imports_flow_downward(fivefold_imports: ImportMap) -> None:
    assert not upward_imports(fivefold_imports), "imports going up the layer map:\n" + "\n".join(
        upward_imports(fivefold_imports))


def test_no_import_circles(fivefold_imports: ImportMap) -> None:
    assert not fivefold_imports.cycles(), f"import circles: {fivefold_imports.cycles()}"


def test_the_main_path_stays_short(fivefold_imports: ImportMap) -> None:
    assert len(loose_modules(fivefold_imports)) <= 8, loose_modules(fivefold_imports)


def test_the_model_is_plain_pytorch(fivefold_imports: ImportMap) -> None:
    for module, path in fivefold_imports.paths.items():
        if not module.startswith("fivefold.model"):
            continue
        assert "torch.distributed" not in path.read_text(), f"{module} uses torch.distributed"
        outside = {m for m in fivefold_imports.edges[module] if not m.startswith(("fivefold.model", "fivefold.config"))}
        assert not outside, f"{module} imports {outside}: the model may use only the config"


def test_strategies_do_not_import_the_loop_or_the_composition_point(fivefold_imports: ImportMap) -> None:
    composition = LAYERS.index("fivefold.parallelize")
    for module, targets in fivefold_imports.edges.items():
        if module.startswith("fivefold.parallel."):
            above = {m for m in targets if rank(m)[0] >= composition}
            assert not above, f"{module} imports {above}"


# ----------------------------------------------------------------------------- the checker, proven


def _plant(root: Path, files: dict[str, str]) -> ImportMap:
    """A throwaway fivefold tree under `root` holding `files` (relative path -> source)."""
    package = root / "fivefold"
    for relative, source in {"__init__.py": "", **files}.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return ImportMap(package)


def test_the_checker_sees_lazy_relative_and_type_only_imports(tmp_path: Path) -> None:
    imports = _plant(tmp_path, {
        "config/__init__.py": "",
        "model/__init__.py": "",
        "model/llama.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..train import Step\n",
        "model/moe.py": "def f():\n    from . import llama\n",
        "train.py": "",
    })
    assert imports.edges["fivefold.model.llama"] == {"fivefold.train"}
    assert imports.edges["fivefold.model.moe"] == {"fivefold.model.llama"}


def test_the_checker_finds_an_upward_import(tmp_path: Path) -> None:
    imports = _plant(tmp_path, {"model/__init__.py": "", "model/llama.py": "def f():\n    from ..train import step\n",
                                "train.py": ""})
    assert upward_imports(imports) == ["fivefold.model.llama -> fivefold.train"]


def test_the_checker_finds_a_circle(tmp_path: Path) -> None:
    imports = _plant(tmp_path, {"model/__init__.py": "", "model/a.py": "from . import b\n",
                                "model/b.py": "def f():\n    from .a import g\n"})
    assert imports.cycles() == [["fivefold.model.a", "fivefold.model.b"]]
    assert not upward_imports(imports)  # one line of the map: only the circle test sees it


def test_the_checker_finds_a_module_without_a_place(tmp_path: Path) -> None:
    imports = _plant(tmp_path, {"helpers.py": "", "tools/__init__.py": "", "tools/new_tool.py": "",
                                "tools/parity.py": ""})
    assert unplaced(imports) == ["fivefold.helpers", "fivefold.tools.new_tool"]


def test_the_checker_orders_the_tools(tmp_path: Path) -> None:
    imports = _plant(tmp_path, {"tools/__init__.py": "", "tools/parity.py": "from .report import draw\n",
                                "tools/report.py": "from .parity import compare\n"})
    assert upward_imports(imports) == ["fivefold.tools.parity -> fivefold.tools.report"]


def main() -> None:
    """Print the counts these rules keep (the tree's shape, measured)."""
    imports = ImportMap(PACKAGE)
    packages = sorted({m for m, p in imports.paths.items() if p.name == "__init__.py"})
    print(f"modules: {len(imports.paths)} in {len(packages)} packages")
    print(f"loose modules beside the packages: {len(loose_modules(imports))} ({', '.join(loose_modules(imports))})")
    print(f"import arrows between modules: {sum(len(t & set(imports.paths)) for t in imports.edges.values())}")
    print(f"import circles: {len(imports.cycles())} {imports.cycles() or ''}")
    print(f"upward imports: {len(upward_imports(imports))}")
    for line in upward_imports(imports):
        print(f"  {line}")
    print(f"modules without a place on the map: {unplaced(imports) or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
