"""A block manager with a knob of its own: paged blocks, with `headroom_tokens` of KV kept free at
admission beyond the watermark (room for the running sequences' next decode tokens).

The knob lives in the block manager's config dataclass and is a keyword argument of its
constructor; nothing else changes. It is then set from a yaml (`conf/blocks/headroom.yaml` or
`blocks.kind=headroom +blocks.headroom_tokens=64`), checked like any other key (a typo is an error
naming the file and key), and reaches the simulator and the engine through policies/build.py
(`LLM(..., block_manager="headroom", block_manager_config={"headroom_tokens": 64})`).
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.blocks import BlockManagerConfig, PagedBlockManager, register_block_manager


@dataclass(kw_only=True)
class HeadroomConfig(BlockManagerConfig):
    headroom_tokens: int = 0  # KV tokens kept free at admission, beyond `watermark`


@register_block_manager("headroom", config=HeadroomConfig)
class HeadroomBlockManager(PagedBlockManager):
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, max_model_len: int | None = None, headroom_tokens: int = 0) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len)
        if isinstance(headroom_tokens, bool) or not isinstance(headroom_tokens, int) or headroom_tokens < 0:
            raise ValueError(f"headroom_tokens={headroom_tokens!r} is invalid: must be an integer >= 0")
        self.watermark_blocks += -(-headroom_tokens // block_size)
