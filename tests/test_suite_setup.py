"""The suite's own set-up: CI's property tests draw the same examples on every run, and the
Triton interpreter switch follows what the run selects."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from conftest import selects_gpu_tests
from hypothesis import settings
from property_settings import examples

PROPERTY_MODULES = sorted(p.stem for p in Path(__file__).parent.glob("test_*.py")
                          if p.name != Path(__file__).name and "@given" in p.read_text())


def test_ci_profile_is_derandomized():
    assert settings.get_current_profile_name() == "ci"
    assert settings.default.derandomize and settings.default.database is None
    assert examples(60) == 60


@pytest.mark.parametrize("module", PROPERTY_MODULES)
def test_every_property_test_runs_the_fixed_profile(module):
    """A test's own @settings are made at import: they must inherit the derandomized profile and
    scale their example count through `examples(n)` (so `make soak` can raise it)."""
    mod = importlib.import_module(module)
    tests = [f for _, f in inspect.getmembers(mod, inspect.isfunction)
             if getattr(f, "is_hypothesis_test", False)]
    assert tests, f"{module} holds no @given test"
    for f in tests:
        assert f._hypothesis_internal_use_settings.derandomize, f.__name__
    source = inspect.getsource(mod)
    assert "max_examples=" not in source.replace("max_examples=examples(", ""), (
        f"{module}: write max_examples=examples(n)")


@pytest.mark.parametrize(("expr", "gpu"), [("gpu", True), ("gpu and not slow", True), ("", False),
                                           ("not gpu", False), ("slow", False)])
def test_gpu_selection_turns_the_interpreter_off(expr, gpu):
    assert selects_gpu_tests(expr) is gpu
