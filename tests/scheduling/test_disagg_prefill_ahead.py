"""A prefill side that schedules ahead (`Scheduler.schedule_ahead` with a `PrefillSide`, the engine
pair's `prefill_async_scheduling`): a sequence whose prompt a step finishes ends at that step's
first token and is never scheduled past it (no decode on the prefill side, no KV written into its
blocks after its prefill), outputs equal a co-located run's, and an abort at any point frees its
blocks once."""
from __future__ import annotations

from disagg_helpers import DisaggPair, sampled
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples
from scheduler_helpers import make_scheduler, request
from test_disagg_handoff import colocated_outputs

from policies.disagg import PrefillSide


def assert_never_past_the_prompt(pair: DisaggPair) -> None:
    """Every prefill step computes prompt positions only: no sequence is scheduled past its first token."""
    for row in pair.prefill_rows:
        for seq, start, num_new in row:
            assert start + num_new <= seq.num_prompt_tokens, (
                f"seq {seq.seq_id} of {seq.request.request_id} scheduled at positions {start}..{start + num_new - 1} "
                f"past its prompt of {seq.num_prompt_tokens} on the prefill side")


def test_outputs_equal_colocated_with_chunks_and_n2():
    reqs = lambda: [request(f"r{i}", 3 + 5 * i, max_tokens=5 + i, n=1 + i % 2) for i in range(6)]
    pair = DisaggPair(make_scheduler(num_gpu_blocks=40, max_num_batched_tokens=12), make_scheduler(num_gpu_blocks=40),
                      prefill_ahead=True)
    ended = pair.run(reqs())
    assert len(ended) == 6 and all(r.finish_reason == "length" for r in ended.values())
    disagg = {rid: [s.output_token_ids for s in fam] for rid, fam in pair.families.items()}
    assert disagg == colocated_outputs(reqs(), num_gpu_blocks=40)
    assert pair.prefill.num_scheduled_ahead > 0  # the prefill side did look ahead (chunks, whole prompts)
    assert any(n < s.num_prompt_tokens for row in pair.prefill_rows for s, _, n in row)  # a prompt was chunked
    assert_never_past_the_prompt(pair)
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 40


def test_abort_of_a_prefill_ended_in_a_step_looked_past_frees_its_blocks():
    prefill = make_scheduler(num_gpu_blocks=16)
    side = PrefillSide(prefill, block_bytes=8)
    prefill.add(request("a", 6, max_tokens=8), 0.0)
    out = prefill.schedule(0.0)
    nxt = prefill.schedule_ahead(0.1)  # "a"'s prompt ends in `out`: it leaves the running queue, blocks kept
    assert nxt is not None and nxt.is_empty and side.holds_blocks
    assert prefill.abort("a", "user", 0.2)  # before its step's update: it will not be handed off
    assert not side.holds_blocks and prefill.block_manager.num_free_gpu_blocks() == 16
    ended = prefill.update(out, sampled(out), 0.3)
    assert [r.request_id for r in ended] == ["a"] and ended[0].finish_reason == "abort:user"
    assert side.take_handoffs() == [] and not side.transferring
    (row,) = prefill.recorder.requests
    assert row["status"] == "aborted"
    prefill.check_invariants()


@settings(max_examples=examples(40), deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 2)), min_size=1, max_size=8),
       decode_blocks=st.integers(6, 24), chunk=st.sampled_from([4, 64]),
       aborts=st.dictionaries(st.integers(0, 7), st.integers(0, 12), max_size=3))
def test_prefill_ahead_never_schedules_past_the_first_token(lens, decode_blocks, chunk, aborts):
    pair = DisaggPair(make_scheduler(num_gpu_blocks=24, max_num_batched_tokens=chunk),
                      make_scheduler(num_gpu_blocks=decode_blocks, max_num_batched_tokens=chunk), max_queue=3,
                      abort_at={f"r{i}": at for i, at in aborts.items()}, prefill_ahead=True)
    reqs = [request(f"r{i}", p, max_tokens=m, n=n) for i, (p, m, n) in enumerate(lens)]
    ended = pair.run(reqs)
    assert set(ended) == {r.request_id for r in reqs}  # every request ends, once
    rows = pair.prefill.recorder.requests + pair.decode.recorder.requests
    assert sorted(row["request_id"] for row in rows) == sorted(ended)
    assert_never_past_the_prompt(pair)
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 24  # freed, and only once
    assert pair.decode.block_manager.num_free_gpu_blocks() == decode_blocks
