"""Import paths that moved keep working for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from fivefold._moved import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_imports_the_new_module_and_warns(old: str) -> None:
    # A fresh interpreter: this one may have imported the old name already (no second warning).
    code = (f"import importlib, warnings\nwarnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as w:\n    print(w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"{old} moved to {MOVED_MODULES[old]}" in out.stdout, out.stdout + out.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED_MODULES[old])
    assert module.__spec__.name == MOVED_MODULES[old]  # the module keeps its own identity


@pytest.mark.parametrize("module, name, home", [
    ("fivefold.data", "Sampler", "fivefold.data.sources"),
    ("fivefold.observe.metrics", "parameter_count", "fivefold.rules.params"),
    ("fivefold.observe.prediction", "PLANNER_AXIS", "fivefold.rules.volumes"),
    ("fivefold.parallel.data_parallel", "make_bucket", "fivefold.parallel.buckets"),
])
def test_a_moved_name_is_still_found_where_it_was(module: str, name: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=home):
        getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        importlib.import_module("fivefold.data").nothing_here
