"""Free space of a block range as sorted, merged extents: first-fit allocation of contiguous runs.

Used by the contiguous-reservation baseline, where external fragmentation is the point: free blocks
may add up to enough while no single extent is long enough.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass(slots=True)
class ExtentAllocator:
    num_blocks: int
    # Free extents [starts[i], ends[i]), sorted, non-overlapping and never touching.
    starts: list[int] = field(init=False)
    ends: list[int] = field(init=False)
    num_free: int = field(init=False)

    def __post_init__(self) -> None:
        self.starts = [0] if self.num_blocks else []
        self.ends = [self.num_blocks] if self.num_blocks else []
        self.num_free = self.num_blocks

    @property
    def largest(self) -> int:
        return max((e - s for s, e in zip(self.starts, self.ends)), default=0)

    def capacity(self, length: int) -> int:
        """How many runs of `length` blocks first-fit could place now."""
        return sum((e - s) // length for s, e in zip(self.starts, self.ends))

    def allocate(self, length: int) -> int | None:
        """Take the first free extent that fits `length` blocks; returns its start, or None."""
        for i, (start, end) in enumerate(zip(self.starts, self.ends)):
            if end - start >= length:
                if end - start == length:
                    del self.starts[i], self.ends[i]
                else:
                    self.starts[i] = start + length
                self.num_free -= length
                return start
        return None

    def release(self, start: int, length: int) -> None:
        """Return [start, start + length) (must be in use) and merge it with its neighbours."""
        end = start + length
        i = bisect_left(self.starts, start)
        if (i < len(self.starts) and self.starts[i] < end) or (i > 0 and self.ends[i - 1] > start):
            raise RuntimeError(f"blocks [{start}, {end}) released twice")
        merge_left = i > 0 and self.ends[i - 1] == start
        merge_right = i < len(self.starts) and self.starts[i] == end
        if merge_left and merge_right:
            self.ends[i - 1] = self.ends[i]
            del self.starts[i], self.ends[i]
        elif merge_left:
            self.ends[i - 1] = end
        elif merge_right:
            self.starts[i] = start
        else:
            self.starts.insert(i, start)
            self.ends.insert(i, end)
        self.num_free += length

    def release_blocks(self, blocks: list[int]) -> None:
        """Release single blocks, grouped into maximal consecutive runs."""
        blocks = sorted(blocks)
        i = 0
        while i < len(blocks):
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                j += 1
            self.release(blocks[i], j - i)
            i = j

    def free_blocks(self) -> set[int]:
        return {b for s, e in zip(self.starts, self.ends) for b in range(s, e)}

    def check(self) -> None:
        assert len(self.starts) == len(self.ends)
        for i, (s, e) in enumerate(zip(self.starts, self.ends)):
            assert 0 <= s < e <= self.num_blocks, f"bad extent [{s}, {e})"
            if i:
                assert self.ends[i - 1] < s, f"extents touch or overlap at {s} (not merged)"
        assert self.num_free == sum(e - s for s, e in zip(self.starts, self.ends)), "free count drifted"
