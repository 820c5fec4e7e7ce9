"""The pre-PagedAttention baseline: every sequence reserves, on admission, one contiguous run of blocks
for its longest possible length, min(prompt + max_tokens, max_model_len) tokens, placed first-fit.
Memory a sequence never grows into is reserved anyway (internal waste), and free blocks split into
runs too short for the next request (external fragmentation): `usage()` shows both as used/free.

`append_slots` never allocates. Nothing is shared, so there is no copy-on-write; parallel sampling
(n > 1) reserves n runs up front (the prompt's sequence's own plus one per future child), because a
contiguous system cannot grow a request later. `fork(parent, child)` gives the child a reserved run
and records copies of the parent's computed blocks into it; they are handed out by the child's next
`append_slots` (put them in that step's `out.copy`). Until then the parent's source blocks stay
pinned (even if the parent is freed) and the child cannot be swapped out (`can_swap_out` is False: its
run does not hold its prefix yet; preempt it by recompute). The pins are dropped by `mark_computed`
(after the step that ran the copies) or by `free`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from policies.blocks.base import (
    AllocStatus,
    BlockManager,
    BlockUsage,
    admission_status,
    register_block_manager,
)
from policies.blocks.extents import ExtentAllocator
from policies.blocks.pool import BlockPool, OutOfBlocksError
from policies.sequence import Sequence


@register_block_manager("contiguous")
class ContiguousBlockManager(BlockManager):
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, max_model_len: int | None = None) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len)
        self.extents = ExtentAllocator(num_gpu_blocks)
        # Holders of each GPU block: the sequence whose run it is, a reservation, a pinned copy source.
        self.gpu_refs = [0] * num_gpu_blocks
        self.cpu = BlockPool(num_cpu_blocks, "cpu")
        self._swapped: set[int] = set()
        self._reserved: dict[int, list[list[int]]] = {}  # parent seq id -> runs kept for its children
        self._pending: dict[int, list[tuple[int, int]]] = {}  # child seq id -> fork copies not handed out
        self._in_flight: dict[int, list[int]] = {}  # child seq id -> sources of copies handed out

    def _num_runs(self, seq: Sequence) -> int:
        """Runs to reserve: one per sequence, plus the children of a prompt that will still fork."""
        n = seq.request.sampling_params.n
        return n if n > 1 and seq.sample_index == 0 and seq.num_output_tokens == 0 else 1

    def _take_run(self, length: int) -> list[int]:
        start = self.extents.allocate(length)
        if start is None:
            raise OutOfBlocksError(f"no contiguous run of {length} free GPU blocks "
                                   f"(largest {self.extents.largest}, {self.extents.num_free} free)")
        run = list(range(start, start + length))
        for block in run:
            self.gpu_refs[block] = 1
        return run

    def _unref(self, blocks: Iterable[int]) -> None:
        freed = []
        for block in blocks:
            self.gpu_refs[block] -= 1
            if self.gpu_refs[block] == 0:
                freed.append(block)
        self.extents.release_blocks(freed)

    def _admit(self, run_blocks: int, runs: int) -> AllocStatus:
        status = admission_status(run_blocks * runs, self.extents.num_free, self.num_gpu_blocks,
                                  self.watermark_blocks)
        if status is AllocStatus.OK and self.extents.capacity(run_blocks) < runs:
            return AllocStatus.LATER  # free blocks, but not in runs that long
        return status

    def _reserve_children(self, seq: Sequence, run_blocks: int, runs: int) -> None:
        if runs > 1:
            self._reserved[seq.seq_id] = [self._take_run(run_blocks) for _ in range(runs - 1)]

    # -- admission and growth ---------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> AllocStatus:
        return self._admit(self.blocks_for(self.max_seq_tokens(seq)), self._num_runs(seq))

    def allocate(self, seq: Sequence) -> None:
        if seq.block_table:
            raise ValueError(f"seq.block_table={seq.block_table!r} of seq {seq.seq_id} is invalid: "
                             f"it must be empty (free the sequence before allocating it again)")
        run_blocks, runs = self.blocks_for(self.max_seq_tokens(seq)), self._num_runs(seq)
        if self.extents.capacity(run_blocks) < runs:
            raise OutOfBlocksError(f"seq {seq.seq_id} needs {runs} contiguous runs of {run_blocks} blocks")
        seq.block_table.extend(self._take_run(run_blocks))
        self._reserve_children(seq, run_blocks, runs)

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        if seq.num_computed_tokens + num_new_tokens > len(seq.block_table) * self.block_size \
                or seq.seq_id in self._swapped:
            raise ValueError(f"seq {seq.seq_id}: positions < {seq.num_computed_tokens + num_new_tokens} "
                             f"exceed its reservation of {len(seq.block_table)} blocks (or it is swapped out)")
        if not self._pending:
            return []
        copies = self._pending.pop(seq.seq_id, None)
        if copies is None:
            return []
        self._in_flight[seq.seq_id] = [src for src, _ in copies]
        return copies

    def decode_slots_fit(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        bs = self.block_size
        return not any(seq.num_computed_tokens + ahead >= len(seq.block_table) * bs for seq in seqs)

    def append_decode_slots(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        if not self.decode_slots_fit(seqs):
            return None
        if not self._pending:
            return []
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            copies.extend(self.append_slots(seq, 1))
        return copies

    def decode_run_limit(self, seqs: list[Sequence], max_steps: int) -> int:
        if self._pending or self._in_flight:  # fork copies to hand out or to unpin after a step
            return 0
        room = min((len(seq.block_table) * self.block_size - seq.num_computed_tokens for seq in seqs),
                   default=max_steps)
        return max(min(room, max_steps), 0)

    def append_decode_run(self, seqs: list[Sequence], num_steps: int) -> list[int]:
        for seq in seqs:  # reserved runs: nothing to allocate, and mark_computed has nothing to unpin
            seq.num_computed_tokens += num_steps
        return [self.num_gpu_blocks - self.extents.num_free] * num_steps

    def mark_computed(self, seq: Sequence) -> None:
        if self._in_flight:
            sources = self._in_flight.pop(seq.seq_id, None)
            if sources:
                self._unref(sources)

    # -- fork and free ----------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.block_table:
            raise ValueError(f"seq.block_table={child.block_table!r} of child {child.seq_id} must be empty")
        if parent.seq_id in self._swapped or parent.seq_id in self._pending:
            raise ValueError(f"parent seq {parent.seq_id} must be on the GPU with its prefix in place to fork")
        runs = self._reserved.get(parent.seq_id)
        if runs:
            run = runs.pop(0)
            if not runs:
                del self._reserved[parent.seq_id]
        else:
            run = self._take_run(len(parent.block_table))
        child.block_table.extend(run)
        num_copies = self.blocks_for(parent.num_computed_tokens)
        if num_copies:
            sources = parent.block_table[:num_copies]
            for block in sources:
                self.gpu_refs[block] += 1
            self._pending[child.seq_id] = list(zip(sources, run))

    def free(self, seq: Sequence) -> None:
        if seq.seq_id in self._swapped:
            self._swapped.discard(seq.seq_id)
            for block in seq.block_table:
                self.cpu.decref(block)
        else:
            self._unref(seq.block_table)
        seq.block_table.clear()
        for run in self._reserved.pop(seq.seq_id, ()):
            self._unref(run)
        copies = self._pending.pop(seq.seq_id, None)
        if copies:
            self._unref(src for src, _ in copies)
        self._unref(self._in_flight.pop(seq.seq_id, ()))

    # -- swap -------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return (bool(seq.block_table) and seq.seq_id not in self._swapped
                and seq.seq_id not in self._pending and len(seq.block_table) <= self.cpu.num_free)

    def swap_out(self, seq: Sequence) -> dict[int, int]:
        if not self.can_swap_out(seq):
            raise ValueError(f"seq {seq.seq_id} cannot be swapped out (already swapped, no blocks, fork "
                             f"copies pending, or too few free CPU blocks: {self.cpu.num_free})")
        mapping = {gpu_block: self.cpu.allocate() for gpu_block in seq.block_table}
        self._unref(seq.block_table)
        for run in self._reserved.pop(seq.seq_id, ()):  # re-reserved at swap-in if still needed
            self._unref(run)
        seq.block_table[:] = mapping.values()
        self._swapped.add(seq.seq_id)
        return mapping

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        if seq.seq_id not in self._swapped:
            raise ValueError(f"seq {seq.seq_id} is not swapped out")
        return self._admit(len(seq.block_table), self._num_runs(seq))

    def swap_in(self, seq: Sequence) -> dict[int, int]:
        if self.can_swap_in(seq) is AllocStatus.NEVER or \
                self.extents.capacity(len(seq.block_table)) < self._num_runs(seq):
            raise OutOfBlocksError(f"seq {seq.seq_id}: no contiguous run of {len(seq.block_table)} GPU blocks")
        run = self._take_run(len(seq.block_table))
        mapping = dict(zip(seq.block_table, run))
        for cpu_block in seq.block_table:
            self.cpu.decref(cpu_block)
        seq.block_table[:] = run
        self._swapped.discard(seq.seq_id)
        self._reserve_children(seq, len(run), self._num_runs(seq))
        return mapping

    # -- accounting -------------------------------------------------------------------------------
    def num_free_gpu_blocks(self) -> int:
        return self.extents.num_free

    def usage(self) -> BlockUsage:
        return BlockUsage(self.num_gpu_blocks - self.extents.num_free, self.num_gpu_blocks,
                          self.num_cpu_blocks - self.cpu.num_free, self.num_cpu_blocks)

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        holders: Counter[int] = Counter()
        owners: Counter[int] = Counter()
        cpu_refs: Counter[int] = Counter()
        for seq in seqs:
            table = seq.block_table
            if seq.seq_id in self._swapped:
                cpu_refs.update(table)
                continue
            if table:
                assert table == list(range(table[0], table[0] + len(table))), \
                    f"seq {seq.seq_id}: block table {table} is not one contiguous run"
                assert seq.num_computed_tokens <= len(table) * self.block_size, \
                    f"seq {seq.seq_id}: {seq.num_computed_tokens} computed tokens exceed its reservation"
            elif not seq.is_finished:
                assert seq.num_computed_tokens == 0, f"seq {seq.seq_id} has computed tokens but no blocks"
            owners.update(table)
        holders.update(owners)
        for runs in self._reserved.values():
            for run in runs:
                holders.update(run)
        for copies in self._pending.values():
            holders.update(src for src, _ in copies)
        for sources in self._in_flight.values():
            holders.update(sources)
        shared = [b for b, n in owners.items() if n > 1]
        assert not shared, f"blocks {shared[:8]} are in two sequences' runs"
        for block, refs in enumerate(self.gpu_refs):
            assert refs == holders.get(block, 0), f"gpu block {block}: {refs} holders counted, " \
                                                  f"{holders.get(block, 0)} found"
        self.extents.check()
        assert self.extents.free_blocks() == {b for b, r in enumerate(self.gpu_refs) if r == 0}, \
            "free extents != unheld blocks"
        self.cpu.check(cpu_refs)
        live = {seq.seq_id for seq in seqs}
        for name, ids in (("swapped", self._swapped), ("reserved", self._reserved),
                          ("pending", self._pending), ("in-flight", self._in_flight)):
            assert set(ids) <= live, f"{name} seqs {sorted(set(ids) - live)} are not live"
