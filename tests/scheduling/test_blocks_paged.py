"""Hand-worked cases for the paged block manager (block_size 4): exact block tables after each call."""
import pytest

from policies.blocks import AllocStatus, OutOfBlocksError, PagedBlockManager, make_block_manager
from policies.request import Request, SamplingParams
from policies.sequence import Sequence


def make_seq(seq_id: int, num_tokens: int, max_tokens: int = 4, n: int = 1, first: int = 0) -> Sequence:
    request = Request(f"r{seq_id}", list(range(first, first + num_tokens)),
                      SamplingParams(max_tokens=max_tokens, n=n))
    return Sequence.from_request(seq_id, request)


def computed(seq: Sequence) -> Sequence:
    seq.num_computed_tokens = seq.num_tokens
    return seq


def decode(mgr, seq: Sequence, token: int = 99) -> list[tuple[int, int]]:
    """One decode step: sample a token, then reserve the slot for it."""
    seq.token_ids.append(token)
    copies = mgr.append_slots(seq, 1)
    seq.num_computed_tokens += 1
    return copies


def fork(mgr, parent: Sequence, seq_id: int) -> Sequence:
    child = parent.fork(seq_id, sample_index=1)
    mgr.fork(parent, child)
    return child


def test_allocate_free_reuses_blocks_lowest_first():
    mgr = PagedBlockManager(4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a, b = make_seq(0, 10), make_seq(1, 4)
    mgr.allocate(a)
    mgr.allocate(b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3])
    mgr.free(a)
    assert a.block_table == []
    c = make_seq(2, 6)
    mgr.allocate(c)
    assert c.block_table == [0, 1]
    assert mgr.usage().gpu_used == 3 and mgr.num_free_gpu_blocks() == 5
    mgr.check_invariants([b, c])
    mgr.free(b)
    mgr.free(c)
    mgr.free(c)  # a second free is a no-op
    assert mgr.usage().gpu_used == 0
    mgr.check_invariants([])


def test_append_slots_opens_a_block_every_block_size_tokens():
    mgr = PagedBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    seq = computed(make_seq(0, 4))
    mgr.allocate(seq)
    assert decode(mgr, seq) == [] and seq.block_table == [0, 1]
    for _ in range(3):
        assert decode(mgr, seq) == []
    assert seq.block_table == [0, 1]
    decode(mgr, seq)
    assert seq.block_table == [0, 1, 2]
    # A prefill chunk over several blocks allocates them all at once.
    long = make_seq(1, 14)
    mgr.allocate(long)
    assert long.block_table == [3, 4, 5, 6]
    assert mgr.can_append_slots(long, 14) and mgr.append_slots(long, 14) == []
    mgr.check_invariants([seq, long])


def test_fork_shares_blocks_and_copies_on_write():
    mgr = PagedBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    parent = computed(make_seq(0, 6, n=2))
    mgr.allocate(parent)
    child = fork(mgr, parent, 1)
    assert child.block_table == [0, 1] and mgr.gpu.ref_counts[:2] == [2, 2]
    mgr.check_invariants([parent, child])
    assert decode(mgr, parent) == [(1, 2)]  # block 1 is shared: the parent writes a private copy
    assert parent.block_table == [0, 2] and mgr.gpu.ref_counts[:3] == [2, 1, 1]
    assert decode(mgr, child) == []  # now the child is the only holder of block 1
    assert child.block_table == [0, 1]
    mgr.check_invariants([parent, child])
    mgr.free(parent)
    mgr.free(child)
    assert mgr.usage().gpu_used == 0


def test_watermark_gives_later_and_too_long_gives_never():
    mgr = PagedBlockManager(4, num_gpu_blocks=10, watermark=0.1)  # 1 block of headroom
    assert mgr.watermark_blocks == 1
    assert mgr.can_allocate(make_seq(0, 36)) is AllocStatus.OK  # 9 blocks, 1 left
    # 10 blocks, 0 left: past the watermark, but an idle pool takes whatever fits it.
    assert mgr.can_allocate(make_seq(1, 37, max_tokens=3)) is AllocStatus.OK
    assert mgr.can_allocate(make_seq(2, 8, max_tokens=40)) is AllocStatus.NEVER  # 48 tokens: 12 blocks
    capped = PagedBlockManager(4, num_gpu_blocks=10, watermark=0.1, max_model_len=40)
    assert capped.can_allocate(make_seq(2, 8, max_tokens=40)) is AllocStatus.OK  # at most 40 tokens
    mgr.allocate(make_seq(3, 32))
    assert mgr.can_allocate(make_seq(4, 4)) is AllocStatus.OK  # 2 free - 1 >= 1
    assert mgr.can_allocate(make_seq(5, 5)) is AllocStatus.LATER
    assert mgr.can_allocate(make_seq(6, 37, max_tokens=3)) is AllocStatus.LATER  # not idle now


def test_swap_out_and_in_with_shared_blocks():
    mgr = PagedBlockManager(4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a = computed(make_seq(0, 6, n=2))
    mgr.allocate(a)
    b = fork(mgr, a, 1)
    # a leaves alone: it gets its own CPU copy, b keeps the GPU blocks.
    assert mgr.can_swap_out(a)
    assert mgr.swap_out(a) == {0: 0, 1: 1}
    assert a.block_table == [0, 1] and b.block_table == [0, 1]
    assert mgr.usage().gpu_used == 2 and mgr.usage().cpu_used == 2
    mgr.check_invariants([a, b])
    # b follows unchanged: both blocks were already copied for a, so nothing moves.
    assert mgr.swap_out(b) == {}
    assert b.block_table == [0, 1] and mgr.cpu.ref_counts[:2] == [2, 2]
    assert mgr.usage().gpu_used == 0
    mgr.check_invariants([a, b])
    # Back in: a copies, b shares a's fresh GPU blocks again.
    assert mgr.can_swap_in(a) is AllocStatus.OK
    assert mgr.swap_in(a) == {0: 0, 1: 1}
    assert mgr.swap_in(b) == {}
    assert a.block_table == b.block_table == [0, 1] and mgr.gpu.ref_counts[:2] == [2, 2]
    assert mgr.usage().cpu_used == 0
    mgr.check_invariants([a, b])
    assert decode(mgr, a) == [(1, 2)]  # still copy-on-write after the round trip


@pytest.mark.parametrize("append", ["append_slots", "append_decode_slots", "chunk"])
def test_in_place_write_makes_the_cpu_copy_stale(append):
    mgr = PagedBlockManager(4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a = computed(make_seq(0, 6, n=2))
    mgr.allocate(a)
    b = fork(mgr, a, 1)
    assert mgr.swap_out(a) == {0: 0, 1: 1}
    # b alone holds block 1 now and writes position 6 (or 6..7) in place
    b.token_ids += [98, 99]
    if append == "append_slots":
        assert mgr.append_slots(b, 1) == []
    elif append == "append_decode_slots":
        b.num_computed_tokens += 1  # positions 6 and 7 known, 7 is the decode
        assert mgr.append_decode_slots([b]) == []
    else:
        assert mgr.append_slots(b, 2) == []
    assert mgr.swap_out(b) == {1: 2}  # block 0 still matches cpu 0; block 1 must be copied again
    assert b.block_table == [0, 2]
    mgr.check_invariants([a, b])
    mgr.free(a)
    mgr.free(b)
    assert mgr.usage().cpu_used == 0 and mgr.usage().gpu_used == 0
    mgr.check_invariants([])


def test_swap_capacity_checks():
    mgr = PagedBlockManager(4, num_gpu_blocks=10, num_cpu_blocks=2, watermark=0.1)
    big, small = computed(make_seq(0, 12)), computed(make_seq(1, 8))
    mgr.allocate(big)
    mgr.allocate(small)
    assert not mgr.can_swap_out(big)  # 3 blocks, 2 free CPU blocks
    with pytest.raises(ValueError, match="cannot be swapped out"):
        mgr.swap_out(big)
    assert mgr.swap_out(small) == {3: 0, 4: 1}
    assert not mgr.can_swap_out(small)  # already swapped
    with pytest.raises(ValueError, match="swapped out"):
        mgr.append_slots(small, 1)
    filler = make_seq(2, 24)
    mgr.allocate(filler)  # 6 blocks: 1 GPU block left, below watermark + need
    assert mgr.can_swap_in(small) is AllocStatus.LATER
    mgr.free(filler)
    assert mgr.can_swap_in(small) is AllocStatus.OK
    mgr.free(small)  # a swapped sequence gives back its CPU blocks
    assert mgr.usage().cpu_used == 0
    mgr.check_invariants([big])


def test_append_decode_slots_is_all_or_nothing():
    mgr = PagedBlockManager(4, num_gpu_blocks=5, watermark=0.0)
    a = computed(make_seq(0, 4, n=2))
    mgr.allocate(a)
    b = fork(mgr, a, 1)
    c = computed(make_seq(2, 6))
    mgr.allocate(c)
    for seq in (a, b, c):
        seq.token_ids.append(7)
    assert mgr.append_decode_slots([a, b, c]) is None  # 2 free blocks < 3 decodes: nothing changed
    assert a.block_table == b.block_table == [0] and c.block_table == [1, 2]
    assert mgr.append_decode_slots([a, c]) == []
    assert a.block_table == [0, 3] and c.block_table == [1, 2]
    mgr.check_invariants([a, b, c])


def test_bad_input_raises_value_errors():
    with pytest.raises(ValueError, match="kind='ring' is unknown.*contiguous.*paged.*prefix"):
        make_block_manager("ring", 16, 8)
    with pytest.raises(ValueError, match="block_size=3"):
        make_block_manager("paged", 3, 8)
    with pytest.raises(ValueError, match="num_gpu_blocks=0"):
        make_block_manager("prefix", 16, 0)
    with pytest.raises(ValueError, match="num_cpu_blocks=-1"):
        make_block_manager("paged", 16, 8, num_cpu_blocks=-1)
    with pytest.raises(ValueError, match="watermark='0.1'"):
        make_block_manager("contiguous", 16, 8, watermark="0.1")
    with pytest.raises(ValueError, match="max_model_len=0"):
        make_block_manager("paged", 16, 8, max_model_len=0)
    mgr = make_block_manager("paged", 4, 2, watermark=0.0)
    seq = make_seq(0, 4)
    mgr.allocate(seq)
    with pytest.raises(ValueError, match="block_table"):
        mgr.allocate(seq)
    with pytest.raises(OutOfBlocksError):
        mgr.allocate(make_seq(1, 12))
    mgr.check_invariants([seq])  # the failed allocation changed nothing


def test_check_invariants_catches_a_leak_and_a_foreign_share():
    mgr = PagedBlockManager(4, num_gpu_blocks=4, watermark=0.0)
    a, b = make_seq(0, 4), make_seq(1, 4)
    mgr.allocate(a)
    with pytest.raises(AssertionError, match="ref count"):
        mgr.check_invariants([])  # a's block is referenced by nobody the caller knows
    mgr.allocate(b)
    b.block_table[0] = a.block_table[0]
    mgr.gpu.ref_counts[0], mgr.gpu.ref_counts[1] = 2, 0
    mgr.gpu.free_ids.append(1)
    mgr.gpu.num_free += 1
    with pytest.raises(AssertionError, match="unrelated requests"):
        mgr.check_invariants([a, b])
