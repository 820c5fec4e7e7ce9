"""The server's way in: uvicorn's I/O (uvloop and httptools where installed, the `serve` extra, and a
warning naming what is missing otherwise) and the request body's prompt shapes."""
from __future__ import annotations

import importlib.util

import pytest
from optional_deps import require_serving

require_serving()

from engine.serving.server import slow_io_warning, uvicorn_config


def test_uvicorn_takes_uvloop_and_httptools_when_installed():
    config = uvicorn_config(app=None)
    assert (config.loop, config.http, config.access_log) == ("auto", "auto", False)


def test_a_missing_fast_loop_or_parser_is_named(monkeypatch):
    find_spec = importlib.util.find_spec
    present = {"uvloop": True, "httptools": False}  # whatever this environment has installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: (object() if present[name] else None) if name in present else find_spec(name))
    warning = slow_io_warning()
    assert warning is not None and warning.startswith("httptools not installed") and "h11" in warning
    present["uvloop"] = False
    assert slow_io_warning().startswith("uvloop and httptools not installed")
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert (slow_io_warning() is None) == all(find_spec(n) is not None for n in ("uvloop", "httptools"))


@pytest.mark.parametrize("prompt,prompts", [
    ("hi", ["hi"]),
    ([5, 6], [[5, 6]]),
    (["1", "2"], ["1", "2"]),  # two text prompts: digits in strings are never token ids
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_prompt_shapes_keep_their_kind(prompt, prompts):
    from engine.serving.protocol import CompletionRequest

    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts() == prompts
