"""A run config's parts as checked objects: its sections, the model (whole and one GPU's share at
`parallel.tensor_parallel_size`), the hardware, the KV block size. Errors name the config key;
experiments/lib/factory.py, which builds the run's objects from them, re-exports each.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from policies.tensor_parallel import check_tensor_parallel_size
from sim.latency import Hardware, ModelShape
from sim.latency.tensor_parallel import shard_shape


def section(cfg: DictConfig, key: str) -> dict[str, Any]:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{key} is missing from the config")
    return OmegaConf.to_container(cfg[key], resolve=True)  # type: ignore[return-value]


def model_shape(cfg: DictConfig) -> ModelShape:
    return ModelShape.from_dict(section(cfg, "model"))


def hardware(cfg: DictConfig) -> Hardware:
    return Hardware.from_dict(section(cfg, "hardware"))


def tensor_parallel_size(cfg: DictConfig) -> int:
    """`parallel.tensor_parallel_size` (1 when the config has no `parallel` block)."""
    size = (cfg.get("parallel") or {}).get("tensor_parallel_size", 1)
    return check_tensor_parallel_size(size, "parallel.tensor_parallel_size")


def gpu_model_shape(cfg: DictConfig) -> ModelShape:
    """The model one GPU holds under `parallel.tensor_parallel_size` (the whole model for 1)."""
    model, size = model_shape(cfg), tensor_parallel_size(cfg)  # each names its own key
    try:
        return shard_shape(model, size)
    except ValueError as e:
        raise ValueError(f"parallel.{e}" if str(e).startswith("tensor_parallel_size") else f"model.{e}") from None


def block_size(cfg: DictConfig) -> int:
    bs = cfg.blocks.get("block_size")
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
        raise ValueError(f"blocks.block_size={bs!r} is invalid: must be a power of two >= 1")
    return bs
