"""The share of a GPU's memory its KV pool may be sized from (`gpu_memory_utilization`), and the
least pool a run may start with (one longest sequence): one rule each for the engine (`CacheConfig`,
`EngineArgs.check`, the model runner; experiments/lib/engine_backend.py) and the simulator's block
counts (experiments/lib/kv_pool.py `kv_block_counts`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.blocks.base import blocks_for_tokens, fits_idle_pool

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


def check_holds_one_sequence(num_gpu_blocks: int, block_size: int, max_model_len: int, field: str, value: object,
                             least: object | None = None, max_len_field: str = "max_model_len") -> None:
    """A pool of `num_gpu_blocks` blocks that cannot hold one sequence of `max_model_len` tokens
    (`fits_idle_pool`, admission's rule) would abort every request that long as too long: the engine
    refuses to start with it, as vLLM does, and the simulator refuses the run alike. ValueError
    naming `field` (the setting that sized the pool), its `value` and `least`, the smallest value
    that holds one (None: not known here)."""
    if fits_idle_pool(max_model_len, block_size, num_gpu_blocks):
        return
    need = blocks_for_tokens(max_model_len, block_size)
    fix = f"set it to at least {least}" if least is not None else "raise it"
    raise ValueError(f"{field}={value!r} is invalid: its KV pool of {num_gpu_blocks} x {block_size}-token blocks "
                     f"cannot hold one {max_len_field}={max_model_len} sequence, which takes {need} of them: {fix}, "
                     f"or lower {max_len_field}")


def check_num_gpu_blocks(num_gpu_blocks: int, block_size: int, max_model_len: int, field: str = "num_gpu_blocks",
                         max_len_field: str = "max_model_len") -> None:
    """`check_holds_one_sequence` of a pool whose size `field` gives in blocks."""
    check_holds_one_sequence(num_gpu_blocks, block_size, max_model_len, field, num_gpu_blocks,
                             blocks_for_tokens(max_model_len, block_size), max_len_field)
