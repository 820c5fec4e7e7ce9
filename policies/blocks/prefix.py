"""Paged block manager with automatic prefix caching (vLLM's APC).

A full block is identified by a chained hash: hash(parent block's hash, its token ids). `allocate`
walks a sequence's full blocks in order and reuses every cached physical block until the first miss,
then sets `seq.num_computed_tokens` past the hits. The block holding the last token is never taken
from the cache, so at least one token is always computed (the step must produce logits) and nothing
ever writes into a cached block. `mark_computed` publishes blocks once they are full and computed.
Unreferenced cached blocks wait in an LRU evictor and count as free (see caching_pool.py); blocks of
one sequence released together are evicted tail first, so shared prefixes survive longest.

Counters: `prefix_queries` counts the full blocks eligible for a hit at each `allocate`
((num_tokens - 1) // block_size of them), `prefix_hits` those served from the cache.
Swap: the GPU originals of swapped-out blocks stay cached (in the evictor once unreferenced), and
`swap_in` reuses any that are still cached instead of copying them back; other swapped-in blocks
are fresh private copies and are not published again.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from policies.blocks.base import AllocStatus, BlockUsage, fits_idle_pool, register_block_manager
from policies.blocks.caching_pool import CachingBlockPool
from policies.blocks.paged import PagedBlockManager
from policies.blocks.pool import OutOfBlocksError
from policies.sequence import Sequence

ROOT_HASH = 0x5E12_7E1AB  # the "parent hash" of a sequence's first block


def block_hash(parent_hash: int, token_ids: list[int]) -> int:
    return hash((parent_hash, *token_ids))


@register_block_manager("prefix")
class PrefixCachingBlockManager(PagedBlockManager):
    shares_across_requests = True
    gpu: CachingBlockPool

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, max_model_len: int | None = None) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len)
        # Chained hashes of each allocated sequence's leading full blocks, as far as known so far.
        self._seq_hashes: dict[int, list[int]] = {}
        self._query_key: tuple[int, int] | None = None  # (seq id, num tokens) of _query_hashes
        self._query_hashes: list[int] = []
        self.prefix_hits = 0
        self.prefix_queries = 0

    def _make_gpu_pool(self) -> CachingBlockPool:
        return CachingBlockPool(self.num_gpu_blocks, "gpu")

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int], int]:
        """(hashes, cached blocks) of the longest cached run of leading blocks, and how many blocks
        were eligible. Stops at the first miss, so a cold prompt costs one hash; the hashes of the
        last sequence asked about are kept, so a waiting head asked every step is hashed once."""
        tokens, bs = seq.token_ids, self.block_size
        eligible = (len(tokens) - 1) // bs  # never the block holding the last token
        if self._query_key != (seq.seq_id, len(tokens)):  # tokens only grow: same length, same tokens
            self._query_key, self._query_hashes = (seq.seq_id, len(tokens)), []
        hashes, lookup = self._query_hashes, self.gpu.lookup
        blocks: list[int] = []
        for i in range(eligible):
            if i == len(hashes):
                hashes.append(block_hash(hashes[-1] if i else ROOT_HASH, tokens[i * bs:(i + 1) * bs]))
            block = lookup(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return hashes[:len(blocks)], blocks, eligible

    def _blocks_to_take(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks an allocation consumes: fresh ones plus hits revived from the evictor."""
        refs = self.gpu.ref_counts
        return self.blocks_for(seq.num_tokens) - sum(1 for block in hits if refs[block] > 0)

    def can_allocate(self, seq: Sequence) -> AllocStatus:
        if not fits_idle_pool(self.max_seq_tokens(seq), self.block_size, self.num_gpu_blocks):
            return AllocStatus.NEVER
        _, hits, _ = self._cached_prefix(seq)
        return self._admit(self._blocks_to_take(seq, hits))

    def allocate(self, seq: Sequence) -> None:
        self._require_no_blocks(seq)
        hashes, hits, eligible = self._cached_prefix(seq)
        needed = self._blocks_to_take(seq, hits)
        if needed > self.gpu.num_free:
            raise OutOfBlocksError(f"seq {seq.seq_id} needs {needed} GPU blocks, {self.gpu.num_free} free")
        for block in hits:  # take the hits first so fresh allocations cannot evict them
            self.gpu.acquire_cached(block)
        seq.block_table.extend(hits)
        seq.block_table.extend(self.gpu.allocate_many(self.blocks_for(seq.num_tokens) - len(hits)))
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens is None:  # the first allocation counts (a preempted one recomputes)
            seq.num_cached_tokens = seq.num_computed_tokens
        self._seq_hashes[seq.seq_id] = hashes
        self.prefix_queries += eligible
        self.prefix_hits += len(hits)

    def mark_computed(self, seq: Sequence) -> None:
        hashes = self._seq_hashes.get(seq.seq_id)
        if hashes is None or (num_full := seq.num_computed_tokens >> self._shift) <= len(hashes) \
                or seq.seq_id in self._swapped:
            return
        bs = self.block_size
        tokens, table = seq.token_ids, seq.block_table
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            self.gpu.register(table[i], parent)  # a duplicate of a cached block stays private
            hashes.append(parent)

    def _resident_copy(self, seq: Sequence, index: int, cpu_block: int) -> int | None:
        mirror = self._cpu_mirror.get(cpu_block)
        if mirror is not None:
            return mirror
        hashes = self._seq_hashes.get(seq.seq_id)
        return self.gpu.lookup(hashes[index]) if hashes and index < len(hashes) else None

    def _share_resident(self, gpu_block: int) -> None:
        self.gpu.acquire_cached(gpu_block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        hashes = self._seq_hashes.get(parent.seq_id)
        if hashes is not None:
            self._seq_hashes[child.seq_id] = list(hashes)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._seq_hashes.pop(seq.seq_id, None)

    def cached_block_hashes(self) -> AbstractSet[int]:
        return self.gpu.hash_to_block.keys()

    def usage(self) -> BlockUsage:
        usage = super().usage()
        usage.prefix_hits = self.prefix_hits
        usage.prefix_queries = self.prefix_queries
        return usage

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        super().check_invariants(seqs)
        for seq in seqs:
            hashes = self._seq_hashes.get(seq.seq_id)
            if hashes is None or seq.seq_id in self._swapped:
                continue
            assert len(hashes) <= len(seq.block_table), f"seq {seq.seq_id} hashed more blocks than it has"
            assert len(hashes) * self.block_size <= seq.num_tokens, f"seq {seq.seq_id} hashed past its tokens"
            for i in range(seq.num_computed_tokens // self.block_size, len(seq.block_table)):
                block = seq.block_table[i]
                assert self.gpu.block_hash[block] is None, \
                    f"seq {seq.seq_id} will write block {block} (index {i}) which is in the prefix cache"
        assert self.prefix_hits <= self.prefix_queries
