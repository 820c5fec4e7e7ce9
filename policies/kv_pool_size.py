"""The share of a GPU's memory its KV pool may be sized from (`gpu_memory_utilization`): one rule
for the engine (`CacheConfig`, experiments/lib/engine_backend.py) and the simulator's block counts
(experiments/lib/factory.py `kv_block_counts`)."""
from __future__ import annotations

FIELD = "gpu_memory_utilization"


def check_memory_utilization(value: object, field: str = FIELD, allow_none: bool = True) -> float | None:
    """`value` if it is a number in (0, 1], or None with `allow_none` (the pool sized another way);
    else ValueError naming `field`, the value and what is allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{field}={value!r} is invalid: must be in (0, 1]")
    return float(value)


def memory_utilization_needed(field: str = FIELD, sizes: str = "kv_cache_gib or num_gpu_blocks") -> ValueError:
    """The error for a null `field` where the pool is to be sized from GPU memory."""
    return ValueError(f"{field}=None is invalid: must be in (0, 1] to size the KV pool from GPU memory "
                      f"(or set {sizes})")
