"""The share of a GPU's memory its KV pool may be sized from (`gpu_memory_utilization`): one rule
for the engine (`CacheConfig`, experiments/lib/engine_backend.py) and the simulator's block counts
(experiments/lib/factory.py `kv_block_counts`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FIELD = "gpu_memory_utilization"
DEFAULT = 0.9  # where a config leaves the field out: vLLM's default, the engine's and conf/blocks'


def check_memory_utilization(value: object, field: str = FIELD, allow_none: bool = True) -> float | None:
    """`value` if it is a number in (0, 1], or None with `allow_none` (the pool sized another way);
    else ValueError naming `field`, the value and what is allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{field}={value!r} is invalid: must be in (0, 1]")
    return float(value)


def pool_memory_utilization(value: object, sized: bool, prefix: str = "") -> float | None:
    """`value` checked as `check_memory_utilization` does, None allowed only where the pool is
    `sized` another way (by `num_gpu_blocks` or `kv_cache_gib`): without a size of its own the pool
    is sized from GPU memory, which needs the share. `prefix`: where the fields sit in the caller's
    config ("blocks." in a run config), for the error's names."""
    util = check_memory_utilization(value, prefix + FIELD)
    if util is None and not sized:
        raise ValueError(f"{prefix}{FIELD}=None is invalid: must be in (0, 1] to size the KV pool from GPU "
                         f"memory (or set {prefix}kv_cache_gib or {prefix}num_gpu_blocks)")
    return util


def blocks_memory_utilization(blocks: Mapping[str, Any], prefix: str = "blocks.") -> float | None:
    """A run config's `blocks` section's share, checked by `pool_memory_utilization`: the default where
    the section leaves it out, None allowed where `num_gpu_blocks` or `kv_cache_gib` sizes the pool."""
    sized = blocks.get("num_gpu_blocks") is not None or blocks.get("kv_cache_gib") is not None
    return pool_memory_utilization(blocks.get(FIELD, DEFAULT), sized, prefix)
