"""Hand-worked cases for prefix caching (block_size 4): hits, the never-cached last block,
LRU eviction order, counters, and copy-on-write next to cached blocks."""
from policies.blocks import AllocStatus, PagedBlockManager, PrefixCachingBlockManager
from policies.request import Request, SamplingParams
from policies.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int], n: int = 1) -> Sequence:
    return Sequence.from_request(seq_id, Request(f"r{seq_id}", tokens, SamplingParams(max_tokens=8, n=n)))


def run_prefill(mgr: PrefixCachingBlockManager, seq: Sequence) -> None:
    """Allocate, compute every uncomputed token, publish the full blocks."""
    mgr.allocate(seq)
    assert mgr.append_slots(seq, seq.num_uncomputed_tokens) == []
    seq.num_computed_tokens = seq.num_tokens
    mgr.mark_computed(seq)


def decode(mgr, seq: Sequence, token: int) -> list[tuple[int, int]]:
    seq.token_ids.append(token)
    copies = mgr.append_slots(seq, 1)
    seq.num_computed_tokens += 1
    mgr.mark_computed(seq)
    return copies


def test_hit_reuses_cached_blocks_and_skips_their_compute():
    mgr = PrefixCachingBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    a = make_seq(0, list(range(10)))
    run_prefill(mgr, a)
    assert a.block_table == [0, 1, 2]
    b = make_seq(1, list(range(8)) + [100, 101])
    mgr.allocate(b)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert mgr.gpu.ref_counts[:4] == [2, 2, 1, 1]
    usage = mgr.usage()
    assert (usage.prefix_hits, usage.prefix_queries, usage.gpu_used) == (2, 4, 4)
    mgr.check_invariants([a, b])


def test_fully_cached_prompt_still_computes_its_last_block():
    mgr = PrefixCachingBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    a = make_seq(0, list(range(8)))
    run_prefill(mgr, a)
    mgr.free(a)
    assert list(mgr.gpu.evictor) == [1, 0] and mgr.usage().gpu_used == 0  # cached blocks count as free
    c = make_seq(1, list(range(8)))
    mgr.allocate(c)
    assert c.block_table == [0, 2] and c.num_computed_tokens == 4  # block 1 is never written again
    assert mgr.append_slots(c, 4) == []
    c.num_computed_tokens = 8
    mgr.mark_computed(c)
    assert mgr.gpu.block_hash[2] is None  # a duplicate of cached block 1 stays private
    assert mgr.gpu.lookup(mgr._seq_hashes[c.seq_id][1]) == 1
    mgr.check_invariants([c])
    mgr.free(c)
    assert list(mgr.gpu.evictor) == [1, 0] and mgr.gpu.free_ids[-1] == 2
    mgr.check_invariants([])


def test_eviction_takes_free_blocks_first_then_least_recently_freed_tail_first():
    mgr = PrefixCachingBlockManager(4, num_gpu_blocks=6, watermark=0.0)
    a = make_seq(0, list(range(8)))
    b = make_seq(1, list(range(100, 108)))
    run_prefill(mgr, a)
    run_prefill(mgr, b)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    mgr.free(a)
    mgr.free(b)
    assert list(mgr.gpu.evictor) == [1, 0, 3, 2]
    c = make_seq(2, list(range(200, 212)))
    mgr.allocate(c)
    assert c.block_table == [4, 5, 1]  # both truly free blocks, then a's tail (least recent)
    assert mgr.gpu.num_evictions == 1
    d = make_seq(3, list(range(8)) + [50])
    assert mgr.can_allocate(d) is AllocStatus.OK
    mgr.allocate(d)
    assert d.block_table == [0, 3, 2] and d.num_computed_tokens == 4  # a's head survived; b evicted
    usage = mgr.usage()
    assert (usage.prefix_hits, usage.prefix_queries, usage.gpu_used) == (1, 6, 6)
    mgr.check_invariants([c, d])


def test_live_hits_cost_no_free_blocks_at_admission():
    prefix = PrefixCachingBlockManager(4, num_gpu_blocks=3, watermark=0.0, max_model_len=12)
    paged = PagedBlockManager(4, num_gpu_blocks=3, watermark=0.0, max_model_len=12)
    for mgr in (prefix, paged):
        a = make_seq(0, list(range(8)))
        mgr.allocate(a)
        a.num_computed_tokens = 8
        mgr.mark_computed(a)
    b = make_seq(1, list(range(8)) + [9])
    assert paged.can_allocate(b) is AllocStatus.LATER
    assert prefix.can_allocate(b) is AllocStatus.OK  # 2 of its 3 blocks are already resident
    prefix.allocate(b)
    assert b.block_table == [0, 1, 2] and prefix.gpu.ref_counts == [2, 2, 1]


def test_copy_on_write_keeps_each_branch_cached_under_its_own_hash():
    mgr = PrefixCachingBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    parent = make_seq(0, list(range(6)), n=2)
    run_prefill(mgr, parent)
    assert parent.block_table == [0, 1] and mgr.gpu.block_hash[1] is None  # block 1 is not full
    child = parent.fork(1, sample_index=1)
    mgr.fork(parent, child)
    assert decode(mgr, parent, 6) == [(1, 2)]
    assert decode(mgr, parent, 7) == []  # block 2 is full and computed: cached
    assert decode(mgr, child, 60) == []
    assert decode(mgr, child, 70) == []  # block 1 is full: cached under the child's tokens
    assert (parent.block_table, child.block_table) == ([0, 2], [0, 1])
    mgr.check_invariants([parent, child])
    mgr.free(parent)
    mgr.free(child)
    again = make_seq(2, list(range(8)) + [8])
    other = make_seq(3, list(range(6)) + [60, 70, 80])
    mgr.allocate(again)
    mgr.allocate(other)
    assert again.block_table[:2] == [0, 2] and other.block_table[:2] == [0, 1]
    assert again.num_computed_tokens == other.num_computed_tokens == 8
    mgr.check_invariants([again, other])


def test_swap_in_reuses_blocks_still_cached_on_the_gpu():
    mgr = PrefixCachingBlockManager(4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a = make_seq(0, list(range(9)))
    run_prefill(mgr, a)
    assert mgr.swap_out(a) == {0: 0, 1: 1, 2: 2}
    assert list(mgr.gpu.evictor) == [1, 0] and mgr.usage().gpu_used == 0
    b = make_seq(1, list(range(8)) + [5])
    mgr.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_computed_tokens == 8
    assert mgr.can_swap_in(a) is AllocStatus.OK
    assert mgr.swap_in(a) == {2: 3}  # blocks 0 and 1 are still cached on the GPU: no copy back
    assert a.block_table == [0, 1, 3] and mgr.gpu.ref_counts[:4] == [2, 2, 1, 1]
    mgr.check_invariants([a, b])
    mgr.free(a)
    mgr.free(b)
    assert mgr.usage().gpu_used == 0 and mgr.usage().cpu_used == 0
    mgr.check_invariants([])


def test_a_blocked_waiting_head_is_hashed_once(monkeypatch):
    from policies.blocks import prefix

    calls = []
    real = prefix.block_hash
    monkeypatch.setattr(prefix, "block_hash", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    mgr = PrefixCachingBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    a, filler = make_seq(0, list(range(12))), make_seq(1, list(range(100, 116)))
    run_prefill(mgr, a)
    mgr.allocate(filler)
    calls.clear()
    head = make_seq(2, list(range(12)) + [5, 6, 7, 8, 9])  # 3 cached blocks, then 2 to allocate, 1 free
    for _ in range(5):
        assert mgr.can_allocate(head) is AllocStatus.LATER
    assert len(calls) == 4  # 3 hits and the first miss, once
    mgr.free(filler)
    mgr.allocate(head)
    assert len(calls) == 4 and head.block_table[:3] == a.block_table and head.num_computed_tokens == 12
    mgr.check_invariants([a, head])
