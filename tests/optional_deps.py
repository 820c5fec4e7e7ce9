"""The suite's optional packages. A test module that needs one imports it through `pytest.importorskip`
before anything that imports it, so a machine without the dev extras (a GPU box with only torch and
pytest) collects every module and `pytest -m gpu` runs every test that can run; the guard is
tests/project/test_suite_setup.py, which collects the suite with these packages hidden."""
from __future__ import annotations

import pytest

# What `engine.serving` imports at module level (the `serve` extra; starlette comes with fastapi).
SERVING = ("fastapi", "uvicorn", "pydantic", "prometheus_client")
# Every package the suite may lack, by import name: the serving stack, its clients, the notebook's runner,
# Ray (the `ray` extra: replicas on a Ray cluster).
# httpx2 is not here: huggingface_hub (through transformers) needs it, so the suite cannot run without it.
OPTIONAL = (*SERVING, "openai", "aiohttp", "uvloop", "httptools", "nbformat", "nbclient", "ipykernel", "ray")


def require_serving() -> None:
    """Skip the calling test module unless `engine.serving` can be imported."""
    for name in SERVING:
        pytest.importorskip(name)
