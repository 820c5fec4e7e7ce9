"""PagedAttention's block manager (vLLM v0): fixed-size blocks with reference counts, copy-on-write
after fork, a watermark on admission (waived in an idle pool: `admission_status`), and a CPU pool for swap preemption.

Swap with shared blocks: `swap_out`/`swap_in` work one sequence at a time. When a block is copied to
the other device while another sequence still holds it, the pair (gpu block, cpu block) is remembered
as a *mirror*: a sibling that moves later maps the same block to the same copy (so two forked
sequences swapped out together share one CPU block, and share one GPU block again once both are back).
A mirror is forgotten when either side is freed or the GPU side is written in place.

Ordering within one step (the backend runs swap_out, swap_in, copy, then the forward): plan swap-outs
before swap-ins, and never free or swap out a sequence after calling `append_slots` on it in the same
step; then no block released while planning is overwritten before the step reads it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from policies.blocks.base import (
    AllocStatus,
    BlockManager,
    BlockUsage,
    admission_status,
    fits_idle_pool,
    register_block_manager,
)
from policies.blocks.paged_decode_run import PagedDecodeRuns
from policies.blocks.pool import BlockPool, OutOfBlocksError
from policies.sequence import Sequence


@register_block_manager("paged")
class PagedBlockManager(PagedDecodeRuns, BlockManager):
    # Whether two requests may hold the same block (prefix caching); forked siblings always may.
    shares_across_requests = False

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, max_model_len: int | None = None) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len)
        self.gpu = self._make_gpu_pool()
        self.cpu = BlockPool(num_cpu_blocks, "cpu")
        self._refs = self.gpu.ref_counts  # hot-path aliases
        self._shift = block_size.bit_length() - 1
        self._swapped: set[int] = set()  # seq ids whose block_table holds CPU block ids
        self._gpu_mirror: dict[int, int] = {}  # gpu block -> cpu block with the same contents
        self._cpu_mirror: dict[int, int] = {}  # the inverse
        # Whether a GPU block may be held twice (a fork, a resident copy shared at swap-in, or the
        # prefix cache): until then no decode writes a shared block, and decode runs skip that check.
        self.may_share_gpu_blocks = self.shares_across_requests

    def _make_gpu_pool(self) -> BlockPool:
        return BlockPool(self.num_gpu_blocks, "gpu")

    # -- admission -------------------------------------------------------------------------------
    def _admit(self, needed: int) -> AllocStatus:
        return admission_status(needed, self.gpu.num_free, self.num_gpu_blocks, self.watermark_blocks)

    def can_allocate(self, seq: Sequence) -> AllocStatus:
        if not fits_idle_pool(self.max_seq_tokens(seq), self.block_size, self.num_gpu_blocks):
            return AllocStatus.NEVER
        return self._admit(self.blocks_for(seq.num_tokens))

    def allocate(self, seq: Sequence) -> None:
        self._require_no_blocks(seq)
        needed = self.blocks_for(seq.num_tokens)
        if needed > self.gpu.num_free:
            raise OutOfBlocksError(f"seq {seq.seq_id} needs {needed} GPU blocks, {self.gpu.num_free} free")
        seq.block_table.extend(self.gpu.allocate_many(needed))

    def _require_no_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            raise ValueError(f"seq.block_table={seq.block_table!r} of seq {seq.seq_id} is invalid: "
                             f"it must be empty (free the sequence before allocating it again)")

    # -- decode / prefill chunks (hot path: O(blocks written), no scans) --------------------------
    def _append_cost(self, seq: Sequence, num_new_tokens: int) -> int:
        table = seq.block_table
        start = seq.num_computed_tokens
        end_block = (start + num_new_tokens + self.block_size - 1) >> self._shift
        have = len(table)
        cost = end_block - have if end_block > have else 0
        refs = self._refs
        for i in range(start >> self._shift, min(have, end_block)):
            if refs[table[i]] > 1:
                cost += 1
        return cost

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        if num_new_tokens == 1:  # a decode needs at most one block
            if self.gpu.num_free:
                return True
            i = seq.num_computed_tokens >> self._shift
            return i < len(seq.block_table) and self._refs[seq.block_table[i]] == 1
        return self._append_cost(seq, num_new_tokens) <= self.gpu.num_free

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        if self._swapped and seq.seq_id in self._swapped:
            raise ValueError(f"seq {seq.seq_id} is swapped out: swap it in before append_slots")
        table = seq.block_table
        start = seq.num_computed_tokens
        if num_new_tokens == 1:  # decode fast path: write in place, or open one new block
            i = start >> self._shift
            if i == len(table):
                table.append(self.gpu.allocate())
                return []
            if i < len(table) and self._refs[table[i]] == 1:
                if self._gpu_mirror:
                    self._forget_gpu_mirror(table[i])  # written in place: its CPU copy goes stale
                return []
        end_block = (start + num_new_tokens + self.block_size - 1) >> self._shift
        have = len(table)
        gpu, refs = self.gpu, self._refs
        copies: list[tuple[int, int]] = []
        for i in range(start >> self._shift, min(have, end_block)):
            block = table[i]
            if refs[block] > 1:  # shared after fork: write into a private copy
                new = gpu.allocate()
                refs[block] -= 1
                table[i] = new
                copies.append((block, new))
            elif self._gpu_mirror:
                self._forget_gpu_mirror(block)
        for _ in range(have, end_block):
            table.append(gpu.allocate())
        return copies

    def append_decode_slots(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        if not self.decode_slots_fit(seqs):
            return None
        if self._swapped and any(seq.seq_id in self._swapped for seq in seqs):
            raise ValueError("append_decode_slots got a swapped-out sequence: swap it in first")
        copies: list[tuple[int, int]] = []
        shift, refs, allocate, mirror = self._shift, self._refs, self.gpu.allocate, self._gpu_mirror
        for seq in seqs:
            table = seq.block_table
            i = seq.num_computed_tokens >> shift
            if i == len(table):
                table.append(allocate())
            elif refs[table[i]] == 1:
                if mirror:
                    self._forget_gpu_mirror(table[i])
            else:
                copies.extend(self.append_slots(seq, 1))
        return copies

    # -- sharing ---------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._require_no_blocks(child)
        on_cpu = parent.seq_id in self._swapped
        self.may_share_gpu_blocks = True  # siblings share blocks: on the GPU now, or once swapped back in
        pool = self.cpu if on_cpu else self.gpu
        for block in parent.block_table:
            pool.incref(block)
        child.block_table.extend(parent.block_table)
        if on_cpu:
            self._swapped.add(child.seq_id)

    def free(self, seq: Sequence) -> None:
        if seq.seq_id in self._swapped:
            self._swapped.discard(seq.seq_id)
            self._release_cpu(seq.block_table)
        else:
            self._release_gpu(seq.block_table)
        seq.block_table.clear()

    def _release_gpu(self, blocks: list[int]) -> None:
        # Tail first: with prefix caching, blocks released together are evicted tail first.
        freed = self.gpu.decref_many(blocks[::-1])
        if self._gpu_mirror:
            for block in freed:
                self._forget_gpu_mirror(block)

    def _release_cpu(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.cpu.decref(block) and block in self._cpu_mirror:
                del self._gpu_mirror[self._cpu_mirror.pop(block)]

    def _forget_gpu_mirror(self, block: int) -> None:
        cpu_block = self._gpu_mirror.pop(block, None)
        if cpu_block is not None:
            del self._cpu_mirror[cpu_block]

    # -- swap ------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        if seq.seq_id in self._swapped or not seq.block_table:
            return False
        needed = sum(1 for block in seq.block_table if block not in self._gpu_mirror)
        return needed <= self.cpu.num_free

    def swap_out(self, seq: Sequence) -> dict[int, int]:
        if not self.can_swap_out(seq):
            raise ValueError(f"seq {seq.seq_id} cannot be swapped out (already swapped, no blocks, "
                             f"or too few free CPU blocks: {self.cpu.num_free}); check can_swap_out")
        mapping: dict[int, int] = {}
        cpu_table: list[int] = []
        for gpu_block in seq.block_table:
            cpu_block = self._gpu_mirror.get(gpu_block)
            if cpu_block is None:
                cpu_block = self.cpu.allocate()
                mapping[gpu_block] = cpu_block
                self._gpu_mirror[gpu_block] = cpu_block
                self._cpu_mirror[cpu_block] = gpu_block
            else:
                self.cpu.incref(cpu_block)
            cpu_table.append(cpu_block)
        self._release_gpu(seq.block_table)  # forgets the mirrors of blocks nobody holds any more
        seq.block_table[:] = cpu_table
        self._swapped.add(seq.seq_id)
        return mapping

    def _resident_copy(self, seq: Sequence, index: int, cpu_block: int) -> int | None:
        """A GPU block that already holds the contents of seq's `index`-th (CPU) block, or None."""
        return self._cpu_mirror.get(cpu_block)

    def _share_resident(self, gpu_block: int) -> None:
        self.may_share_gpu_blocks = True
        self.gpu.incref(gpu_block)

    def _swap_in_plan(self, seq: Sequence) -> tuple[list[int | None], int]:
        """Resident copies per block, and how many free GPU blocks swapping in consumes."""
        if seq.seq_id not in self._swapped:
            raise ValueError(f"seq {seq.seq_id} is not swapped out")
        sources = [self._resident_copy(seq, i, c) for i, c in enumerate(seq.block_table)]
        refs = self._refs
        return sources, sum(1 for g in sources if g is None or refs[g] == 0)

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        _, needed = self._swap_in_plan(seq)
        if len(seq.block_table) > self.num_gpu_blocks:
            return AllocStatus.NEVER
        return self._admit(needed)

    def swap_in(self, seq: Sequence) -> dict[int, int]:
        sources, needed = self._swap_in_plan(seq)
        if needed > self.gpu.num_free:
            raise OutOfBlocksError(f"seq {seq.seq_id} needs {needed} GPU blocks to swap in, "
                                   f"{self.gpu.num_free} free")
        for gpu_block in sources:  # take the resident copies first so allocating cannot evict them
            if gpu_block is not None:
                self._share_resident(gpu_block)
        mapping: dict[int, int] = {}
        gpu_table: list[int] = []
        for cpu_block, gpu_block in zip(seq.block_table, sources):
            if gpu_block is None:
                gpu_block = self.gpu.allocate()
                mapping[cpu_block] = gpu_block
                self._cpu_mirror[cpu_block] = gpu_block
                self._gpu_mirror[gpu_block] = cpu_block
            gpu_table.append(gpu_block)
        self._release_cpu(seq.block_table)
        seq.block_table[:] = gpu_table
        self._swapped.discard(seq.seq_id)
        return mapping

    # -- accounting ------------------------------------------------------------------------------
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    def usage(self) -> BlockUsage:
        return BlockUsage(self.num_gpu_blocks - self.gpu.num_free, self.num_gpu_blocks,
                          self.num_cpu_blocks - self.cpu.num_free, self.num_cpu_blocks)

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        gpu_refs: Counter[int] = Counter()
        cpu_refs: Counter[int] = Counter()
        owners: dict[tuple[bool, int], set[str]] = {}
        for seq in seqs:
            table = seq.block_table
            on_cpu = seq.seq_id in self._swapped
            assert len(set(table)) == len(table), f"seq {seq.seq_id} holds a block twice: {table}"
            if table:
                assert self.blocks_for(seq.num_computed_tokens) <= len(table), \
                    f"seq {seq.seq_id}: {seq.num_computed_tokens} computed tokens but {len(table)} blocks"
            elif not seq.is_finished:
                assert seq.num_computed_tokens == 0, f"seq {seq.seq_id} has computed tokens but no blocks"
            (cpu_refs if on_cpu else gpu_refs).update(table)
            for block in table:
                owners.setdefault((on_cpu, block), set()).add(seq.request.request_id)
        live = {seq.seq_id for seq in seqs}
        assert self._swapped <= live, f"swapped seqs {sorted(self._swapped - live)} are not live"
        self.gpu.check(gpu_refs)
        self.cpu.check(cpu_refs)
        if not self.shares_across_requests:
            for (on_cpu, block), requests in owners.items():
                assert len(requests) == 1, f"{'cpu' if on_cpu else 'gpu'} block {block} is held by " \
                                           f"unrelated requests {sorted(requests)}"
        assert {c: g for g, c in self._gpu_mirror.items()} == self._cpu_mirror, "mirrors disagree"
        for gpu_block, cpu_block in self._gpu_mirror.items():
            assert self.gpu.ref_counts[gpu_block] > 0 and self.cpu.ref_counts[cpu_block] > 0, \
                f"mirror {gpu_block}<->{cpu_block} outlived one of its blocks"
