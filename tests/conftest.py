"""Shared pytest setup: Triton runs interpreted on CPU; `gpu` tests skip without CUDA."""
import os

# Must happen before any kernel module imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny-model CPU tests are dominated by per-op overhead; one intra-op thread is fastest on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


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


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
