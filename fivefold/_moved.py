"""Import paths that moved when the package took its layered tree, kept for one release.

`import fivefold.layout` or `from fivefold.metrics import mfu` still work and warn
(DeprecationWarning) with the new path; the old paths go in the next release. Two kinds:

- a module that moved: `MOVED_MODULES` maps the old name to the new one; a finder installed
  by `fivefold/__init__.py` hands out the new module under the old name;
- a name that moved to another module: the module that lost it answers for it through
  `moved_names` (PEP 562's module `__getattr__`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Sequence

MOVED_MODULES = {
    "fivefold.layout": "fivefold.rules.layout",
    "fivefold.precision": "fivefold.rules.precision",
    "fivefold.volumes": "fivefold.rules.volumes",
    "fivefold.flops": "fivefold.rules.flops",
    "fivefold.stages": "fivefold.rules.stages",
    "fivefold.parallel.schedules": "fivefold.rules.schedules",
    "fivefold.textfiles": "fivefold.data.textfiles",
    "fivefold.prepare": "fivefold.data.prepare",
    "fivefold.indexed": "fivefold.data.indexed",
    "fivefold.packing": "fivefold.data.packing",
    "fivefold.blend": "fivefold.data.blend",
    "fivefold.loader": "fivefold.data.loader",
    "fivefold.step": "fivefold.model.step",
    "fivefold.mesh": "fivefold.parallel.mesh",
    "fivefold.regional_compile": "fivefold.parallel.compile",
    "fivefold.held_memory": "fivefold.observe.held_memory",
    "fivefold.metrics": "fivefold.observe.metrics",
    "fivefold.prediction": "fivefold.observe.prediction",
    "fivefold.tools.timeline": "fivefold.observe.timeline",
    "fivefold.tools.hf": "fivefold.checkpoint.hf",
    "fivefold.launch": "fivefold.job.launch",
    "fivefold.cluster": "fivefold.job.cluster",
    "fivefold.rundir": "fivefold.job.rundir",
    "fivefold.malloc": "fivefold.job.malloc",
    "fivefold.planner.auto": "fivefold.tools.auto_layout",
    "fivefold.planner.compare": "fivefold.tools.plan_compare",
    "fivefold.planner.cli": "fivefold.tools.plan_cli",
    "fivefold.planner.render": "fivefold.tools.plan_render",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there ({old} goes in the next release)",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old module name as the module that now holds its code."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # the import system overwrites __spec__; exec_module restores it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules (and nothing else)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED_MODULES[fullname]))


def install() -> None:
    """Put the finder on `sys.meta_path` once (after the path finder: real modules win)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def moved_names(module: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for names that moved out of `module`: name -> new module (a
    name may also have been renamed there: "module:new_name")."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new_name = homes[name].partition(":")
        _warn(f"{module}.{name}", f"{home}.{new_name or name}")
        return getattr(importlib.import_module(home), new_name or name)

    return __getattr__
