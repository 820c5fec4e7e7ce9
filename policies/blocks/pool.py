"""A pool of fixed-size KV blocks with reference counts: the allocator under the paged managers.

Free ids live on a stack that starts as [n-1, ..., 1, 0], so a fresh pool hands out 0, 1, 2, ...
and a freed block is the next one reused (LIFO). Every operation is O(1); `num_free` is a plain
counter because the scheduler reads it for every decode.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocksError(RuntimeError):
    """An allocation was attempted without checking capacity first (a caller bug)."""


@dataclass(slots=True)
class BlockPool:
    num_blocks: int
    device: str = "gpu"
    ref_counts: list[int] = field(init=False)
    free_ids: list[int] = field(init=False)
    num_free: int = field(init=False)

    def __post_init__(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))
        self.num_free = self.num_blocks

    def allocate(self) -> int:
        block = self._take_unreferenced()
        self.ref_counts[block] = 1
        self.num_free -= 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        """The blocks `count` allocate() calls would return, in that order (one slice of the free
        stack when it holds them; subclasses take from it first)."""
        free = self.free_ids
        if count > len(free):
            return [self.allocate() for _ in range(count)]
        blocks = free[len(free) - count:]
        del free[len(free) - count:]
        blocks.reverse()
        refs = self.ref_counts
        for block in blocks:
            refs[block] = 1
        self.num_free -= count
        return blocks

    def _take_unreferenced(self) -> int:
        """An unreferenced block for a new allocation (subclasses may evict)."""
        if not self.free_ids:
            raise OutOfBlocksError(f"no free {self.device} block (pool of {self.num_blocks}); "
                                   f"check capacity before allocating")
        return self.free_ids.pop()

    def _release(self, block: int) -> None:
        """Where a block goes when its last reference is dropped (subclasses may keep it cached)."""
        self.free_ids.append(block)

    def _release_many(self, blocks: list[int]) -> None:
        """`_release` of each block, in order."""
        self.free_ids.extend(blocks)

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when the block became free."""
        refs = self.ref_counts[block] - 1
        if refs < 0:
            raise RuntimeError(f"{self.device} block {block} freed more often than it was referenced")
        self.ref_counts[block] = refs
        if refs:
            return False
        self._release(block)
        self.num_free += 1
        return True

    def decref_many(self, blocks: list[int]) -> list[int]:
        """decref() each block in order; returns those that became free, in that order."""
        refs, freed = self.ref_counts, []
        for block in blocks:
            left = refs[block] - 1
            if left < 0:
                raise RuntimeError(f"{self.device} block {block} freed more often than it was referenced")
            refs[block] = left
            if not left:
                freed.append(block)
        self._release_many(freed)
        self.num_free += len(freed)
        return freed

    def check(self, expected_refs: dict[int, int]) -> None:
        """Assert ref counts equal `expected_refs` (block -> references; absent = 0) and that the
        free stack holds exactly the unreferenced blocks, once each."""
        free = self._check_refs(expected_refs)
        assert self.num_free == len(free), f"{self.device} free counter {self.num_free} != {len(free)}"
        unreferenced = {b for b, r in enumerate(self.ref_counts) if r == 0}
        assert free == unreferenced, (f"{self.device} free list {sorted(free)[:8]}... != "
                                      f"unreferenced blocks {sorted(unreferenced)[:8]}...")

    def _check_refs(self, expected_refs: dict[int, int]) -> set[int]:
        """Assert ref counts equal `expected_refs` and the free stack has no duplicates; returns it."""
        for block, refs in enumerate(self.ref_counts):
            want = expected_refs.get(block, 0)
            assert refs == want, f"{self.device} block {block}: ref count {refs} != {want} references"
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), f"{self.device} free list holds duplicates"
        return free
