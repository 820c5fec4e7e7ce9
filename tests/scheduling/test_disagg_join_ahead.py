"""A decode side that schedules ahead (`Scheduler.schedule_ahead` with a `DecodeSide`, the engine
pair's decode engine): a request received while a step is in flight joins the step after it, which
is still scheduled ahead (`SchedulerConfig.join_ahead`, policies/lookahead.py); with `join_ahead`
off the receive makes the step in flight synchronous. Either way its first decode reads the KV that
was copied in, outputs equal a co-located run's, and every request ends once with a reason."""
from __future__ import annotations

import pytest
from disagg_helpers import DisaggPair, sampled
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples
from scheduler_helpers import make_scheduler, request
from test_disagg_handoff import colocated_outputs

from policies import SchedulerConfig
from policies.disagg import DecodeSide, KVHandoff, PrefillSide
from policies.lookahead import joins_ready


def handoff_of(req) -> KVHandoff:
    """`req` prefilled on a prefill scheduler of its own, handed off."""
    prefill = make_scheduler(num_gpu_blocks=64)
    side = PrefillSide(prefill, block_bytes=8)
    prefill.add(req, 0.0)
    out = prefill.schedule(0.0)
    prefill.update(out, sampled(out), 0.5)
    (handoff,) = side.take_handoffs()
    handoff.transfer_start_time = 0.5
    return handoff


def receive(side: DecodeSide, handoff: KVHandoff, now: float) -> list:
    assert side.enqueue(handoff, now)
    assert side.reserve_ready(now)[0] == [handoff]
    return side.receive(handoff, now)


def decoding(join_ahead: bool = True, num_gpu_blocks: int = 32, max_tokens: int = 20):
    """A decode scheduler with one received request decoding, a step in flight and none looked past."""
    decode = make_scheduler(num_gpu_blocks=num_gpu_blocks, join_ahead=join_ahead)
    side = DecodeSide(decode, replica=1)
    receive(side, handoff_of(request("a", 6, max_tokens=max_tokens)), 1.0)
    out = decode.schedule(1.0)
    nxt = decode.schedule_ahead(1.1)
    assert nxt is not None
    decode.update(out, sampled(out), 1.5)
    return decode, side, nxt


def test_a_request_received_while_a_step_runs_joins_the_next_step_scheduled_ahead():
    decode, side, in_flight = decoding()
    (b,) = receive(side, handoff_of(request("b", 5, max_tokens=8, first_token=300)), 1.6)
    assert joins_ready(decode.state) == 1
    nxt = decode.schedule_ahead(1.7)
    assert nxt is not None and nxt.ahead
    assert [(e.seq.request.request_id, e.num_new_tokens, e.num_samples) for e in nxt.scheduled] == [
        ("a", 1, 1), ("b", 1, 1)]
    assert b.num_computed_tokens == 5 and len(b.token_ids) == 6  # decodes its first token, known on the host
    assert decode.lifecycle.joined == []  # the step scheduled saw it
    decode.update(in_flight, sampled(in_flight), 2.0)
    decode.check_invariants()


def test_with_join_ahead_off_a_receive_makes_the_step_in_flight_synchronous():
    decode, side, in_flight = decoding(join_ahead=False)
    receive(side, handoff_of(request("b", 5, max_tokens=8, first_token=300)), 1.6)
    assert joins_ready(decode.state) is None
    assert decode.schedule_ahead(1.7) is None
    decode.update(in_flight, sampled(in_flight), 2.0)
    out = decode.schedule(2.1)
    assert not out.ahead and [e.seq.request.request_id for e in out.scheduled] == ["a", "b"]


def test_a_join_is_looked_past_only_when_the_next_step_surely_has_its_slot():
    # 4 blocks of 4: "a" holds 2 (6 prompt tokens + 1), "b" the other 2 (5 + 1): no block is left for
    # "a"'s ninth token, so the next step may have to preempt: it is decided after the update.
    decode, side, _ = decoding(num_gpu_blocks=4, max_tokens=4)
    receive(side, handoff_of(request("b", 5, max_tokens=3, first_token=300)), 1.6)
    assert joins_ready(decode.state) == 1 and decode.block_manager.num_free_gpu_blocks() < decode.num_running
    assert decode.schedule_ahead(1.7) is None


def test_an_abort_of_a_joined_request_before_the_look_past_makes_the_step_synchronous():
    decode, side, in_flight = decoding()
    receive(side, handoff_of(request("b", 5, max_tokens=8, first_token=300)), 1.6)
    assert decode.abort("b", "user", 1.65)
    assert decode.schedule_ahead(1.7) is None
    ended = decode.update(in_flight, sampled(in_flight), 2.0)
    assert [(r.request_id, r.finish_reason) for r in ended] == [("b", "abort:user")]
    decode.check_invariants()


def test_join_ahead_must_be_a_bool():
    with pytest.raises(ValueError, match=r"join_ahead='yes' is invalid: must be True or False"):
        SchedulerConfig(join_ahead="yes")


def _busy_pair(join_ahead: bool) -> DisaggPair:
    """6-token prompts prefilled one a round (a 6-token budget) and decoded for 30 tokens: the
    decode side is never idle once the first has arrived, and receives one request a round."""
    return DisaggPair(make_scheduler(num_gpu_blocks=64, max_num_batched_tokens=6),
                      make_scheduler(num_gpu_blocks=64, join_ahead=join_ahead), decode_ahead=True)


@pytest.mark.parametrize("join_ahead", [True, False])
def test_outputs_equal_colocated_and_only_a_cold_start_is_synchronous(join_ahead):
    reqs = lambda: [request(f"r{i}", 6, max_tokens=30, first_token=100 * (i + 1)) for i in range(6)]
    pair = _busy_pair(join_ahead)
    ended = pair.run(reqs())
    assert len(ended) == 6 and all(r.finish_reason == "length" for r in ended.values())
    disagg = {rid: [s.output_token_ids for s in fam] for rid, fam in pair.families.items()}
    assert disagg == colocated_outputs(reqs(), num_gpu_blocks=64)
    # The first decode step starts cold. Each of the five later receives joins a step scheduled
    # ahead; with join_ahead off it makes the step in flight synchronous, and the synchronous step
    # after it takes the next loop turn's receive too: three breaks (receives 2+3, 4+5, 6).
    assert pair.decode_sync_steps == (1 if join_ahead else 4)
    assert pair.decode.block_manager.num_free_gpu_blocks() == 64


@settings(max_examples=examples(40), deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 3)), min_size=1, max_size=8),
       decode_blocks=st.integers(6, 24), chunk=st.sampled_from([4, 64]), mode=st.sampled_from(["recompute", "swap"]),
       aborts=st.dictionaries(st.integers(0, 7), st.integers(0, 12), max_size=3), join_ahead=st.booleans())
def test_no_request_lost_when_the_decode_side_schedules_ahead(lens, decode_blocks, chunk, mode, aborts, join_ahead):
    """Preemption (both modes) and aborts before, during and after the receive, with the decode side
    scheduling ahead: every request ends once with a reason, every block is freed once, and every
    decode reads the KV its blocks hold (the fake device checks each read)."""
    swap = 32 if mode == "swap" else 0
    pair = DisaggPair(make_scheduler(num_gpu_blocks=24, max_num_batched_tokens=chunk),
                      make_scheduler("priority" if mode == "swap" else "fcfs", num_gpu_blocks=decode_blocks,
                                     num_cpu_blocks=swap, max_num_batched_tokens=chunk, join_ahead=join_ahead),
                      max_queue=3, abort_at={f"r{i}": at for i, at in aborts.items()}, decode_ahead=True)
    reqs = [request(f"r{i}", p, max_tokens=m, n=n) for i, (p, m, n) in enumerate(lens)]
    ended = pair.run(reqs)
    assert set(ended) == {r.request_id for r in reqs}
    for r in ended.values():
        assert r.finish_reason in ("length", "stop") or r.finish_reason.startswith("abort:")
    rows = pair.prefill.recorder.requests + pair.decode.recorder.requests
    assert sorted(row["request_id"] for row in rows) == sorted(ended)
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 24
    assert pair.decode.block_manager.num_free_gpu_blocks() == decode_blocks
