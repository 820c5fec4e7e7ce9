"""What checking many commands reads over and over, read once: Hydra's compositions and the yaml
files under them. None of them changes while the tests run; each caller gets its own copy (the
engine caches GGUF metadata itself, `engine.device.weights._gguf_metadata`).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest

_COMPOSED: dict[tuple, Any] = {}  # (config, overrides, mode, search path) -> the config or the error
_FILES: dict[tuple[str, str], Any] = {}  # (package, yaml path) -> what Hydra loaded from it


def cache_compositions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra composes a config the same way each time; the pages and the modules compose the same
    ones over and over, so each is composed once (callers get their own copy)."""
    from hydra._internal.hydra import Hydra
    compose_config = Hydra.compose_config

    def cached(self, config_name, overrides, run_mode, *args, **kwargs):
        sources = tuple((s.provider, s.path) for s in self.config_loader.get_sources())
        key = (config_name, tuple(overrides), run_mode, sources, args, tuple(sorted(kwargs.items())))
        if key not in _COMPOSED:
            try:
                _COMPOSED[key] = compose_config(self, config_name, overrides, run_mode, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 (a config that does not compose fails the same each time)
                _COMPOSED[key] = exc
        if isinstance(_COMPOSED[key], Exception):
            raise _COMPOSED[key]
        return copy.deepcopy(_COMPOSED[key])
    monkeypatch.setattr(Hydra, "compose_config", cached)
    # Each composition reads its yaml files again; the files do not change while the test runs.
    from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource
    load_config = ImportlibResourcesConfigSource.load_config

    def cached_file(self, config_path: str):
        key = (self.path, config_path)
        if key not in _FILES:
            _FILES[key] = load_config(self, config_path)
        loaded = copy.copy(_FILES[key])
        loaded.config, loaded.header = copy.deepcopy(loaded.config), dict(loaded.header)
        return loaded
    monkeypatch.setattr(ImportlibResourcesConfigSource, "load_config", cached_file)
