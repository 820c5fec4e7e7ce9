"""A GPU block pool that remembers what its blocks hold: the prefix cache and its LRU evictor.

A block whose full contents were registered under a chained hash stays in `hash_to_block` after its
last reference is dropped: it goes to the evictor instead of the free stack, and a later request
with the same prefix can revive it. Fresh allocations take truly free blocks first and only then
evict the least recently released cached block (dropping its hash). Cached-but-unreferenced blocks
count as free.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from policies.blocks.pool import BlockPool


@dataclass(slots=True)
class CachingBlockPool(BlockPool):
    block_hash: list[int | None] = field(init=False)
    hash_to_block: dict[int, int] = field(init=False)
    # Unreferenced cached blocks, least recently released first (the eviction order).
    evictor: OrderedDict[int, None] = field(init=False)
    num_evictions: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        BlockPool.__post_init__(self)
        self.block_hash = [None] * self.num_blocks
        self.hash_to_block = {}
        self.evictor = OrderedDict()

    def _take_unreferenced(self) -> int:
        if self.free_ids or not self.evictor:
            return BlockPool._take_unreferenced(self)
        block, _ = self.evictor.popitem(last=False)
        del self.hash_to_block[self.block_hash[block]]
        self.block_hash[block] = None
        self.num_evictions += 1
        return block

    def _release(self, block: int) -> None:
        if self.block_hash[block] is None:
            self.free_ids.append(block)
        else:
            self.evictor[block] = None

    def _release_many(self, blocks: list[int]) -> None:
        for block in blocks:
            self._release(block)

    def lookup(self, block_hash: int) -> int | None:
        return self.hash_to_block.get(block_hash)

    def acquire_cached(self, block: int) -> None:
        """Take a reference on a cached block, reviving it from the evictor if it was unreferenced."""
        if self.ref_counts[block] == 0:
            del self.evictor[block]
            self.num_free -= 1
        self.ref_counts[block] += 1

    def register(self, block: int, block_hash: int) -> bool:
        """Publish a referenced, fully computed block under `block_hash`. Returns False (and leaves the
        block private) when another block already holds that content or this one is registered."""
        if block_hash in self.hash_to_block or self.block_hash[block] is not None:
            return False
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block
        return True

    def check(self, expected_refs: dict[int, int]) -> None:
        free = self._check_refs(expected_refs)
        assert not free & set(self.evictor), "a block is both free and in the evictor"
        assert self.num_free == len(free) + len(self.evictor), "free counter drifted"
        unreferenced = {b for b, r in enumerate(self.ref_counts) if r == 0}
        assert free | set(self.evictor) == unreferenced, "free + evictor != unreferenced blocks"
        assert all(self.block_hash[b] is None for b in free), "a free block still carries a hash"
        assert all(self.block_hash[b] is not None for b in self.evictor), "an evictor block has no hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash table maps {h} to block {b} which holds {self.block_hash[b]}"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block), \
            "a block carries a hash the table does not know"
