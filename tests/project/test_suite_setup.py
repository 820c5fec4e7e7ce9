"""The suite's own set-up: CI's property tests draw the same examples on every run, the Triton
interpreter switch follows what the run selects, the suite collects without its optional packages,
and CI lints before it tests."""
from __future__ import annotations

import importlib
import inspect
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import selects_gpu_tests
from hypothesis import settings
from optional_deps import OPTIONAL
from property_settings import examples

ROOT = Path(__file__).resolve().parents[2]

TESTS = Path(__file__).resolve().parents[1]
PROPERTY_FILES = {p.stem: p for p in sorted(TESTS.rglob("test_*.py"))
                  if p.name != Path(__file__).name and "@given" in p.read_text()}
PROPERTY_MODULES = sorted(PROPERTY_FILES)


def test_ci_profile_is_derandomized():
    assert settings.get_current_profile_name() == "ci"
    assert settings.default.derandomize and settings.default.database is None
    assert examples(60) == 60


@pytest.mark.parametrize("module", PROPERTY_MODULES)
def test_every_property_test_runs_the_fixed_profile(module):
    """A test's own @settings are made at import: they must inherit the derandomized profile and
    scale their example count through `examples(n)` (so `make soak` can raise it)."""
    folder = str(PROPERTY_FILES[module].parent)  # as pytest imports a test module: its folder on the path
    if folder not in sys.path:
        sys.path.insert(0, folder)
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


# Collects the suite in a fresh interpreter where the optional packages cannot be imported. Whether a
# module collects does not depend on pytest's assertion rewriting, which would compile every module again.
HIDDEN_COLLECT = """
import importlib.abc, os, sys
hidden = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.path.insert(0, os.getcwd())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--assert=plain", "tests"]))
"""


def test_the_suite_collects_without_its_optional_packages():
    """A GPU machine without the dev extras: every module collects (those that need a missing
    package skip), so `pytest -m gpu` runs what it can instead of stopping at collection."""
    res = subprocess.run([sys.executable, "-c", HIDDEN_COLLECT, ",".join(OPTIONAL)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    assert res.returncode == 0 and "error" not in summary, res.stdout[-3000:] + res.stderr[-2000:]


def test_every_extra_package_is_optional_or_needed_by_the_suite():
    """A package added to an extra is either hidden by the collection test above or one the suite
    needs to run at all (pytest, its workers' plugin pytest-xdist, hypothesis) or not a module the tests
    import (ruff, a Hydra plugin)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", req)[0].lower().replace("-", "_") for reqs in extras.values()
             for req in reqs}
    assert names - set(OPTIONAL) <= {"pytest", "pytest_xdist", "hypothesis", "ruff", "hydra_joblib_launcher"}


def test_ci_lints_before_it_tests():
    steps = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert steps[:2] == ["make lint", "make test"]
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert {"F", "E4", "E7", "E9", "W", "I", "B"} <= set(lint["select"])  # named, not ruff's defaults


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is not installed (the dev extra has it)")
def test_the_tree_passes_its_lint_rules():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    res = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout[-3000:]
