"""Decode runs on the paged managers (`paged`, `prefix`): many decode steps of one batch at once.

In a decode step a sequence writes position c (its computed tokens) in place into its current
block, or opens a new block when c reaches the end of its block table. So over a run of steps each
sequence opens a block every `block_size` steps from a known first step, and (prefix caching)
publishes a block every `block_size` steps as one fills. `append_decode_run` replays exactly these
events in step order (within a step: the block openings of `append_decode_slots` in batch order,
then the `mark_computed` calls of the step's update in batch order), so block ids, evictions and
cache registrations match step-by-step decoding; the steps in between cost nothing.
"""
from __future__ import annotations

from policies.blocks.base import BlockManager
from policies.sequence import Sequence


def _openings(firsts: list[int], last_step: int, block_size: int) -> int:
    """Blocks opened in steps 0..last_step by sequences whose first opening is at step firsts[i]."""
    return sum((last_step - f) // block_size + 1 for f in firsts if f <= last_step)


class PagedDecodeRuns:
    """The decode runs of `PagedBlockManager` (a base it inherits from): they read its GPU pool
    (`gpu`, `num_gpu_blocks`, `block_size`, `_shift`, `_refs`, `_gpu_mirror`)."""

    __slots__ = ()

    def decode_run_limit(self, seqs: list[Sequence], max_steps: int) -> int:
        """Steps (<= max_steps) before one would write a shared block (copy-on-write) or find fewer free
        blocks than `len(seqs)` (`append_decode_slots` then falls back to the one-by-one path)."""
        spare = self.gpu.num_free - len(seqs)  # blocks the run may open before a step lacks them
        # Swap mirrors (which a write in place would forget) outlive no swapped-out sequence, and the
        # scheduler runs no decode run while one is swapped out: with mirrors, step one by one.
        if spare < 0 or max_steps < 1 or self._gpu_mirror:
            return 0
        shift, refs, limit = self._shift, self._refs, max_steps
        for seq in seqs if self.may_share_gpu_blocks else ():
            table = seq.block_table
            current = seq.num_computed_tokens >> shift
            if current < len(table) and (refs[table[current]] != 1 or current + 1 < len(table)):
                computed = seq.num_computed_tokens
                for i in range(current, len(table)):  # the blocks it will write into: any shared?
                    if refs[table[i]] != 1:
                        limit = min(limit, max((i << shift) - computed, 0))
                        break
        bs = self.block_size
        if limit < 2 or len(seqs) * ((limit - 2) // bs + 1) <= spare:
            return limit
        firsts = [(len(seq.block_table) << shift) - seq.num_computed_tokens for seq in seqs]
        if _openings(firsts, limit - 2, bs) <= spare:
            return limit
        # Step s + 1 is the first short of blocks, where s is the step of the (spare + 1)-th opening.
        low, high = 0, limit - 2  # the smallest last step whose openings exceed spare is in [low, high]
        while low < high:
            mid = (low + high) // 2
            if _openings(firsts, mid, bs) > spare:
                high = mid
            else:
                low = mid + 1
        return low + 1

    def append_decode_run(self, seqs: list[Sequence], num_steps: int) -> list[int]:
        """`BlockManager.append_decode_run` for the paged managers, event by event."""
        shift, bs, n = self._shift, self.block_size, len(seqs)
        marks = type(self).mark_computed is not BlockManager.mark_computed
        starts = [seq.num_computed_tokens for seq in seqs] if marks else []
        opens: list[int] = []  # step * n + index in seqs: step order, then batch order
        closes: list[int] = []  # the same for the blocks that fill (mark_computed after the step)
        end, stride = num_steps * n, bs * n
        for index, seq in enumerate(seqs):
            computed = seq.num_computed_tokens
            first = (len(seq.block_table) << shift) - computed  # the step that writes past the table
            if first < num_steps:
                opens.extend(range(first * n + index, end, stride))
            if marks:  # after step s the sequence holds computed + s + 1 tokens of KV
                closes.extend(range(((-computed - 1) % bs) * n + index, end, stride))
            seq.num_computed_tokens = computed + num_steps
        gpu = self.gpu
        if closes and len(opens) > len(gpu.free_ids):
            return _interleaved(self, seqs, starts, sorted(opens), sorted(closes), num_steps)
        # Fresh blocks come off the free stack: no eviction, so the openings commute with the marks.
        used_now = self.num_gpu_blocks - gpu.num_free
        used: list[int] = []  # after each step
        if opens:
            opens.sort()
            for key, block in zip(opens, gpu.allocate_many(len(opens))):
                step, index = divmod(key, n)
                if len(used) < step:
                    used.extend([used_now] * (step - len(used)))
                seqs[index].block_table.append(block)
                used_now += 1
        used.extend([used_now] * (num_steps - len(used)))
        if closes:
            closes.sort()
            _mark(self, seqs, starts, closes, num_steps)
        return used


def _mark(manager: PagedDecodeRuns, seqs: list[Sequence], starts: list[int], closes: list[int],
          num_steps: int) -> None:
    """mark_computed at each close (step * n + index) with the tokens computed after that step;
    leaves the seqs at starts + num_steps computed tokens."""
    n, mark = len(seqs), manager.mark_computed
    for key in closes:
        step, index = divmod(key, n)
        seq = seqs[index]
        seq.num_computed_tokens = starts[index] + step + 1
        mark(seq)
        seq.num_computed_tokens = starts[index] + num_steps


def _interleaved(manager: PagedDecodeRuns, seqs: list[Sequence], starts: list[int], opens: list[int],
                 closes: list[int], num_steps: int) -> list[int]:
    """Openings that may evict cached blocks, with marks: every event in step order (within a step,
    the openings of the step's schedule before the marks of its update)."""
    n, allocate = len(seqs), manager.gpu.allocate
    used_now = manager.num_gpu_blocks - manager.gpu.num_free
    used: list[int] = []
    events = sorted([(key // n, 0, key) for key in opens] + [(key // n, 1, key) for key in closes])
    for step, is_mark, key in events:
        if len(used) < step:
            used.extend([used_now] * (step - len(used)))
        if is_mark:
            _mark(manager, seqs, starts, [key], num_steps)
        else:
            seqs[key % n].block_table.append(allocate())
            used_now += 1
    used.extend([used_now] * (num_steps - len(used)))
    return used
