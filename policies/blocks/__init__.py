"""KV block managers: `paged` (PagedAttention), `prefix` (paged + automatic prefix caching) and
`contiguous` (the pre-PagedAttention reservation baseline), built by name with `make_block_manager`.
A new one subclasses `BlockManager`, registers with `@register_block_manager("name", config=...)`
(its config: `BlockManagerConfig` or a subclass adding its own knobs) and is imported below."""
from __future__ import annotations

from policies.blocks.base import (
    BLOCK_MANAGERS,
    AllocStatus,
    BlockManager,
    BlockManagerConfig,
    BlockUsage,
    register_block_manager,
)
from policies.blocks.contiguous import ContiguousBlockManager
from policies.blocks.paged import PagedBlockManager
from policies.blocks.pool import OutOfBlocksError
from policies.blocks.prefix import PrefixCachingBlockManager


def make_block_manager(kind: str, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                       watermark: float = 0.01, max_model_len: int | None = None) -> BlockManager:
    return BLOCK_MANAGERS.get(kind)(block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len)


__all__ = [
    "BLOCK_MANAGERS",
    "AllocStatus",
    "BlockManager",
    "BlockManagerConfig",
    "BlockUsage",
    "ContiguousBlockManager",
    "OutOfBlocksError",
    "PagedBlockManager",
    "PrefixCachingBlockManager",
    "make_block_manager",
    "register_block_manager",
]
