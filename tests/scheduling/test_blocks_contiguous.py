"""Hand-worked cases for the contiguous reservation baseline (block_size 4)."""
import pytest

from policies.blocks import AllocStatus, ContiguousBlockManager
from policies.request import Request, SamplingParams
from policies.sequence import Sequence


def make_seq(seq_id: int, prompt: int, max_tokens: int, n: int = 1) -> Sequence:
    request = Request(f"r{seq_id}", list(range(prompt)), SamplingParams(max_tokens=max_tokens, n=n))
    return Sequence.from_request(seq_id, request)


def test_reserves_prompt_plus_max_tokens_up_front():
    mgr = ContiguousBlockManager(4, num_gpu_blocks=16, watermark=0.0)
    a, b = make_seq(0, 6, 10), make_seq(1, 2, 2)
    mgr.allocate(a)
    mgr.allocate(b)
    assert (a.block_table, b.block_table) == ([0, 1, 2, 3], [4])
    assert mgr.usage().gpu_used == 5  # for 8 tokens that need 3 blocks when paged
    capped = ContiguousBlockManager(4, num_gpu_blocks=16, watermark=0.0, max_model_len=20)
    c = make_seq(2, 6, 100)
    capped.allocate(c)
    assert c.block_table == [0, 1, 2, 3, 4]
    mgr.check_invariants([a, b])


def test_append_slots_stays_inside_the_reservation():
    mgr = ContiguousBlockManager(4, num_gpu_blocks=16, watermark=0.0)
    a = make_seq(0, 6, 10)
    mgr.allocate(a)
    assert mgr.can_append_slots(a, 6) and mgr.append_slots(a, 6) == []
    a.num_computed_tokens = 6
    assert mgr.can_append_slots(a, 10) and not mgr.can_append_slots(a, 11)
    with pytest.raises(ValueError, match="exceed its reservation"):
        mgr.append_slots(a, 11)
    assert a.block_table == [0, 1, 2, 3] and mgr.usage().gpu_used == 4


def test_external_fragmentation_blocks_admission():
    mgr = ContiguousBlockManager(4, num_gpu_blocks=8, watermark=0.0)
    a, b, c = make_seq(0, 4, 8), make_seq(1, 4, 4), make_seq(2, 4, 8)
    for seq in (a, b, c):
        mgr.allocate(seq)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4], [5, 6, 7])
    mgr.free(a)
    mgr.free(c)
    assert mgr.num_free_gpu_blocks() == 6 and (mgr.extents.starts, mgr.extents.ends) == ([0, 5], [3, 8])
    assert mgr.can_allocate(make_seq(3, 4, 12)) is AllocStatus.LATER  # 4 blocks: free, but not in one run
    assert mgr.can_allocate(make_seq(4, 4, 40)) is AllocStatus.NEVER  # 11 blocks > 8
    e = make_seq(5, 4, 8)
    assert mgr.can_allocate(e) is AllocStatus.OK
    mgr.allocate(e)
    assert e.block_table == [0, 1, 2]  # first fit
    mgr.free(b)
    assert (mgr.extents.starts, mgr.extents.ends) == ([3], [8])  # neighbours merged
    mgr.check_invariants([e])


def test_parallel_sampling_reserves_runs_and_fork_copies_the_prefix():
    mgr = ContiguousBlockManager(4, num_gpu_blocks=16, watermark=0.0)
    assert mgr.can_allocate(make_seq(9, 4, 4, n=9)) is AllocStatus.NEVER  # 9 runs of 2 > 16 blocks
    a = make_seq(0, 6, 2, n=3)
    mgr.allocate(a)
    assert a.block_table == [0, 1] and mgr.usage().gpu_used == 6  # plus 2 runs kept for the children
    a.num_computed_tokens = 6
    b, c = a.fork(1, 1), a.fork(2, 2)
    mgr.fork(a, b)
    mgr.fork(a, c)
    assert (b.block_table, c.block_table) == ([2, 3], [4, 5])
    assert not mgr.can_swap_out(b)  # its run does not hold the prefix yet
    mgr.check_invariants([a, b, c])
    b.token_ids.append(7)
    assert mgr.append_slots(b, 1) == [(0, 2), (1, 3)]  # the copies go into this step's out.copy
    assert mgr.append_slots(b, 1) == []  # handed out once
    mgr.free(c)  # c's pending copies are dropped with it
    mgr.free(a)  # the parent finishes before b's copies ran: its blocks stay pinned for them
    assert mgr.usage().gpu_used == 4 and mgr.extents.starts == [4]
    mgr.check_invariants([b])
    mgr.mark_computed(b)  # the step that ran b's copies is over
    assert mgr.usage().gpu_used == 2 and (mgr.extents.starts, mgr.extents.ends) == ([0, 4], [2, 16])
    mgr.check_invariants([b])


def test_swap_moves_the_whole_run_and_needs_a_contiguous_run_back():
    mgr = ContiguousBlockManager(4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a, b = make_seq(0, 4, 8), make_seq(1, 4, 4)
    mgr.allocate(a)
    mgr.allocate(b)
    a.num_computed_tokens = 4
    assert mgr.swap_out(a) == {0: 0, 1: 1, 2: 2}
    c, d = make_seq(2, 4, 4), make_seq(3, 4, 4)
    mgr.allocate(c)
    mgr.allocate(d)
    assert (c.block_table, d.block_table) == ([0, 1], [5, 6])
    assert mgr.num_free_gpu_blocks() == 2 and mgr.can_swap_in(a) is AllocStatus.LATER
    mgr.free(c)
    assert mgr.can_swap_in(a) is AllocStatus.OK
    assert mgr.swap_in(a) == {0: 0, 1: 1, 2: 2} and a.block_table == [0, 1, 2]
    assert mgr.usage().cpu_used == 0
    mgr.check_invariants([a, b, d])
    with pytest.raises(ValueError, match="not swapped out"):
        mgr.swap_in(a)
