"""Shared fixtures: the pool of gloo worker processes and cached single-process references."""

from __future__ import annotations

import functools
import os
import sys

import pytest

# Test files mirror the packages (tests/parallel/, tests/planner/, ...) and some share helpers by
# module name (test_zero uses test_data_parallel's matrix): every test folder is importable, in
# this process and in the worker pool's (spawned workers inherit sys.path).
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(
    os.path.join(_TESTS, d) for d in os.listdir(_TESTS) if os.path.isdir(os.path.join(_TESTS, d)) and not d.startswith((".", "_"))
)

from fivefold.tools.testing import PoolSet  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """Gloo worker pools of 2, 4 and 8 ranks, started on first use and kept for the session.

    A call that hangs (its ranks idle for 60 s) or keeps running past its cap fails with the
    ranks' stacks; on a slow machine multiply those limits with FIVEFOLD_TEST_TIMEOUT_SCALE
    (fivefold/tools/testing.py)."""
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()


@functools.lru_cache(maxsize=None)
def _reference_of_single(config, steps: int):
    from fivefold.tools.parity import run_reference

    return run_reference(config, steps)


def cached_reference(config, steps: int):
    from fivefold.tools.parity import reference_config

    return _reference_of_single(reference_config(config), steps)


@pytest.fixture(scope="session")
def reference():
    """reference(config, steps): the single-process trace of `config`, computed once per session."""
    return cached_reference


SLOW_TESTS_ENV = "FIVEFOLD_SLOW_TESTS"


def pytest_configure(config) -> None:  # noqa: ANN001
    config.addinivalue_line(
        "markers", f"slow: part of the opt-in slow suite (README, Tests); runs only with {SLOW_TESTS_ENV}=1")


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    """Tests marked `slow` are skipped, with the reason, unless FIVEFOLD_SLOW_TESTS=1."""
    if os.environ.get(SLOW_TESTS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"opt-in slow test; set {SLOW_TESTS_ENV}=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
