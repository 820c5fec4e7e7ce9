"""The hand-off between a prefill and a decode scheduler (policies/disagg/): KV moved block by block
into blocks the decode side allocated first, outputs equal to a co-located run, every request
ending once, blocks freed once."""
from __future__ import annotations

import pytest
from disagg_helpers import DisaggPair, sampled
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples
from scheduler_helpers import KVStoreBackend, make_scheduler, request

from policies.disagg import DecodeSide, KVHandoff, PrefillSide, kv_block_bytes, parse_roles, transfer_batches
from policies.model_shape import ModelShape
from policies.request import Request


def colocated_outputs(requests, **kw) -> dict[str, list[list[int]]]:
    sched = make_scheduler(**kw)
    families = {r.request_id: sched.add(r, 0.0) for r in requests}
    kv, now = KVStoreBackend(sched.block_manager.block_size), 0.0
    while sched.has_unfinished():
        out = sched.schedule(now)
        kv.execute(out)
        now += 1.0
        sched.update(out, sampled(out), now)
    return {rid: [s.output_token_ids for s in fam] for rid, fam in families.items()}


def test_outputs_equal_colocated_and_rows_split_ttft():
    reqs = lambda: [request(f"r{i}", 3 + 2 * i, max_tokens=5 + i, n=1 + i % 3) for i in range(6)]
    pair = DisaggPair(make_scheduler(num_gpu_blocks=40), make_scheduler(num_gpu_blocks=40))
    ended = pair.run(reqs())
    assert all(r.finish_reason == "length" for r in ended.values()) and len(ended) == 6
    disagg = {rid: [s.output_token_ids for s in fam] for rid, fam in pair.families.items()}
    assert disagg == colocated_outputs(reqs(), num_gpu_blocks=40)
    assert pair.prefill.recorder.requests == []  # rows are written where requests end: the decode side
    for row in pair.decode.recorder.requests:
        assert row["ttft"] == pytest.approx(row["queueing_time"] + row["prefill_time"] + row["transfer_time"])
        assert row["transfer_time"] == pytest.approx(row["decode_wait"] + row["link_wait"] + row["link_time"])
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 40
    assert pair.decode.block_manager.num_free_gpu_blocks() == 40


def test_decode_side_allocates_before_the_send_and_blocks_free_once():
    pair = DisaggPair(make_scheduler(), make_scheduler())
    pair.run([request("a", 6, max_tokens=4)])
    assert [e for e in pair.events] == [("handoff", "a"), ("reserved", "a"), ("received", "a")]
    prefill, decode = make_scheduler(), make_scheduler()
    pside, dside = PrefillSide(prefill, block_bytes=8), DecodeSide(decode)
    prefill.add(request("b", 6, max_tokens=4), 0.0)
    out = prefill.schedule(0.0)
    prefill.update(out, sampled(out), 1.0)
    (handoff,) = pside.take_handoffs()
    assert handoff.num_blocks == 2 and handoff.num_bytes == 16 and handoff.first_token_ids
    with pytest.raises(ValueError, match="call reserve_ready first"):
        dside.receive(handoff, 1.0)
    free = prefill.block_manager.num_free_gpu_blocks()
    assert dside.enqueue(handoff, 1.0)
    reserved, _ = dside.reserve_ready(1.0)
    assert reserved == [handoff] and len(handoff.dst_block_ids) == 2
    handoff.transfer_start_time = 1.0
    dside.receive(handoff, 2.0)
    pside.finish_transfer(handoff, 2.0)
    assert prefill.block_manager.num_free_gpu_blocks() == free + 2
    with pytest.raises(ValueError, match="not transferring"):
        pside.finish_transfer(handoff, 2.0)
    assert decode.num_running == 1 and decode.queues.running[0].num_computed_tokens == 6


def test_a_first_token_that_stops_ends_on_the_prefill_side():
    pair = DisaggPair(make_scheduler(), make_scheduler())
    req = request("s", 4, max_tokens=8, stop_token_ids=list(range(1000, 2000)))  # every sampled token stops
    ended = pair.run([req, request("one", 4, max_tokens=1)])
    assert {r: e.finish_reason for r, e in ended.items()} == {"s": "stop", "one": "length"}
    assert pair.events == [] and len(pair.prefill.recorder.requests) == 2


def test_a_full_decode_queue_aborts_the_hand_off():
    pair = DisaggPair(make_scheduler(num_gpu_blocks=64), make_scheduler(num_gpu_blocks=6), max_queue=1)
    ended = pair.run([request(f"r{i}", 8, max_tokens=12) for i in range(3)])
    assert {rid: r.finish_reason for rid, r in ended.items()} == {
        "r0": "length", "r1": "abort:handoff_queue_full", "r2": "abort:handoff_queue_full"}
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 64


@pytest.mark.parametrize("max_queue", [None, 1])
def test_a_decode_side_short_of_sequence_slots_holds_hand_offs_back(max_queue):
    """By default (max_queue None) a hand-off waits for a sequence slot, its KV held by the prefill
    side, and every request finishes; a bounded queue refuses what finds it full."""
    pair = DisaggPair(make_scheduler(num_gpu_blocks=64), make_scheduler(num_gpu_blocks=64, max_num_seqs=1),
                      max_queue=max_queue)
    ended = pair.run([request(f"r{i}", 8, max_tokens=6) for i in range(4)])
    reasons = {rid: r.finish_reason for rid, r in ended.items()}
    if max_queue is None:
        assert reasons == dict.fromkeys(("r0", "r1", "r2", "r3"), "length")
        assert [rid for what, rid in pair.events if what == "reserved"] == ["r0", "r1", "r2", "r3"]
        waits = {row["request_id"]: row["decode_wait"] for row in pair.decode.recorder.requests}
        assert min(waits["r2"], waits["r3"]) > 0  # held on the prefill side until a slot was free
    else:
        assert reasons == {"r0": "length", **dict.fromkeys(("r1", "r2", "r3"), "abort:handoff_queue_full")}
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 64


def test_the_hand_off_queue_is_unbounded_by_default_and_its_bound_checked():
    side = DecodeSide(make_scheduler())
    assert side.max_queue is None
    with pytest.raises(ValueError, match=r"max_queue=0 is invalid: must be an integer >= 1 .* or null"):
        DecodeSide(make_scheduler(), max_queue=0)


@pytest.mark.parametrize("decode_blocks", [5, 16])  # 5: r1 waits in the decode queue; 16: its transfer in flight
def test_abort_while_handed_off(decode_blocks):
    pair = DisaggPair(make_scheduler(num_gpu_blocks=64), make_scheduler(num_gpu_blocks=decode_blocks),
                      abort_at={"r1": 1})
    ended = pair.run([request("r0", 8, max_tokens=12), request("r1", 8, max_tokens=12, arrival=0.0)])
    assert ended["r1"].finish_reason == "abort:user" and ended["r0"].finish_reason == "length"
    (row,) = [r for r in pair.prefill.recorder.requests]  # the aborted row is the prefill side's
    assert row["request_id"] == "r1" and row["status"] == "aborted"
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 64
    assert pair.decode.block_manager.num_free_gpu_blocks() == decode_blocks
    assert ("received", "r1") in pair.events if decode_blocks == 16 else ("reserved", "r1") not in pair.events


@settings(max_examples=examples(40), deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 3)), min_size=1, max_size=8),
       decode_blocks=st.integers(6, 24), chunk=st.sampled_from([4, 64]), mode=st.sampled_from(["recompute", "swap"]),
       aborts=st.dictionaries(st.integers(0, 7), st.integers(0, 12), max_size=3))
def test_no_request_lost_across_the_hand_off(lens, decode_blocks, chunk, mode, aborts):
    swap = 32 if mode == "swap" else 0
    pair = DisaggPair(make_scheduler(num_gpu_blocks=24, max_num_batched_tokens=chunk),
                      make_scheduler("priority" if mode == "swap" else "fcfs", num_gpu_blocks=decode_blocks,
                                     num_cpu_blocks=swap, max_num_batched_tokens=chunk),
                      max_queue=3, abort_at={f"r{i}": at for i, at in aborts.items()})
    reqs = [request(f"r{i}", p, max_tokens=m, n=n) for i, (p, m, n) in enumerate(lens)]
    ended = pair.run(reqs)
    assert set(ended) == {r.request_id for r in reqs}  # every request ends, once
    for r in ended.values():
        assert r.finish_reason in ("length", "stop") or r.finish_reason.startswith("abort:")
    rows = pair.prefill.recorder.requests + pair.decode.recorder.requests
    assert sorted(row["request_id"] for row in rows) == sorted(ended)  # one row each
    assert pair.prefill.block_manager.num_free_gpu_blocks() == 24  # freed, and only once (pool checks)
    assert pair.decode.block_manager.num_free_gpu_blocks() == decode_blocks
    order = {}
    for what, rid in pair.events:
        order.setdefault(rid, []).append(what)
    assert all(seq in (["handoff"], ["handoff", "reserved", "received"]) for seq in order.values())


QWEN3_06B = {"name": "qwen3-0.6b", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}


def test_transfer_bytes_from_the_model_shape():
    shape = ModelShape.from_dict(QWEN3_06B)
    assert kv_block_bytes(shape, 16) == 28 * 16 * 2 * 8 * 128 * 2
    assert kv_block_bytes(shape, 16, tensor_parallel_size=2) == kv_block_bytes(shape, 16) // 2
    assert kv_block_bytes(shape, 16, tensor_parallel_size=16) == kv_block_bytes(shape, 16) // 8  # replicated heads
    assert kv_block_bytes(shape, 16, kv_dtype_bytes=1) == kv_block_bytes(shape, 16) // 2


@pytest.mark.parametrize(("roles", "n", "match"), [
    (["prefill", "gpu"], 2, r"cluster.roles\[1\]='gpu' is not a role"),
    (["prefill", "decode"], 3, "2 roles for 3 replicas"),
    (["prefill", "mixed"], 2, "0 decode replicas"),
    (["decode", "mixed"], 2, "0 prefill replicas"),
    ("prefill", 1, "give one of"),
])
def test_bad_roles_name_the_key(roles, n, match):
    with pytest.raises(ValueError, match=match):
        parse_roles(roles, n)


def test_roles_default_to_mixed():
    assert [r.value for r in parse_roles(None, 2)] == ["mixed", "mixed"]
    assert [r.takes_arrivals for r in parse_roles(["prefill", "decode", "mixed"], 3)] == [True, False, True]


def _handoff(name: str, blocks: int, prefill: int = 0) -> KVHandoff:
    return KVHandoff(Request(name, [1] * blocks), blocks, [0], {}, list(range(blocks)), 0, prefill, 0.0)


def test_hand_offs_reserved_together_share_messages_per_prefill_replica_up_to_the_block_bound():
    a, b, c, d, e = _handoff("a", 3), _handoff("b", 4), _handoff("c", 2, prefill=1), _handoff("d", 9), _handoff("e", 1)
    batches = transfer_batches([a, b, c, d, e], max_blocks=8)
    assert [[h.request_id for h in batch] for batch in batches] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert transfer_batches([], 8) == []
    with pytest.raises(ValueError, match="max_blocks=0 is invalid"):
        transfer_batches([a], 0)
