"""Exact schedules for small hand-worked cases (block_size 4, watermark 0 unless said otherwise).

Every case runs through `KVStoreBackend`, which checks that each attention read sees the right tokens.
"""
from __future__ import annotations

import itertools

from scheduler_helpers import KVStoreBackend, compact, make_scheduler, request, run_to_end, sample_tokens


def drive(scheduler, arrivals=(), steps=40, tokens=None):
    """Step the scheduler; `arrivals` = [(step, request)]. Returns per step (schedule, preempted,
    swap_out, swap_in, copy, ended request ids)."""
    tokens = tokens or itertools.repeat(7).__next__
    backend = KVStoreBackend(scheduler.block_manager.block_size)
    log = []
    for step in range(steps):
        for at, req in arrivals:
            if at == step:
                scheduler.add(req, now=float(step))
        if not scheduler.has_unfinished():
            if all(at <= step for at, _ in arrivals):
                break
            continue
        out = scheduler.schedule(float(step))
        backend.execute(out)
        ended = scheduler.update(out, sample_tokens(out, tokens), float(step + 1))
        scheduler.check_invariants()
        preempted = [f"{s.request.request_id}/{s.sample_index}" for s in out.preempted]
        log.append((compact(out), preempted, out.swap_out, out.swap_in, out.copy,
                    [r.request_id for r in ended]))
    assert not scheduler.has_unfinished()
    return log


def schedules(log):
    return [entry[0] for entry in log]


def test_fcfs_admits_in_arrival_order_not_add_order():
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    log = drive(s, [(0, request("late", 4, 2, arrival=1.0)), (0, request("early", 4, 2, arrival=0.5)),
                    (0, request("third", 4, 2, arrival=2.0))])
    assert schedules(log) == [
        [("early/0", 4, 1), ("late/0", 4, 1)],  # token budget and max_num_seqs both full
        [("early/0", 1, 1), ("late/0", 1, 1)],
        [("third/0", 4, 1)],
        [("third/0", 1, 1)],
    ]
    assert [e[5] for e in log] == [[], ["early", "late"], [], ["third"]]


def test_chunked_prefill_splits_a_long_prompt_while_decodes_run_every_step():
    s = make_scheduler(max_num_batched_tokens=8)
    log = drive(s, [(0, request("short", 4, 6)), (0, request("long", 20, 2, arrival=0.1))])
    assert schedules(log) == [
        [("short/0", 4, 1), ("long/0", 4, 0)],  # a partial chunk samples nothing
        [("short/0", 1, 1), ("long/0", 7, 0)],  # decodes first, the rest of the budget to the prefill
        [("short/0", 1, 1), ("long/0", 7, 0)],
        [("short/0", 1, 1), ("long/0", 2, 1)],  # the last chunk samples
        [("short/0", 1, 1), ("long/0", 1, 1)],
        [("short/0", 1, 1)],
    ]
    steps = s.recorder.steps
    assert [r["num_prefill_tokens"] for r in steps] == [8, 7, 7, 2, 0, 0]
    assert [r["num_decode_seqs"] for r in steps] == [0, 1, 1, 1, 2, 1]


def test_recompute_preemption_evicts_the_latest_arrival_and_recomputes_its_tokens():
    # 4 GPU blocks of 4 slots. Both sequences fill 2 blocks after 8 tokens; the 9th needs a third.
    s = make_scheduler(num_gpu_blocks=4, max_num_batched_tokens=16)
    log = drive(s, [(0, request("a", 4, 10)), (0, request("b", 4, 10, arrival=0.1))])
    both, a_only, b_only = [("a/0", 1, 1), ("b/0", 1, 1)], [("a/0", 1, 1)], [("b/0", 1, 1)]
    assert schedules(log) == ([[("a/0", 4, 1), ("b/0", 4, 1)]] + [both] * 4 + [a_only] * 5
                              + [[("b/0", 9, 1)]]  # prompt + 5 generated tokens, recomputed
                              + [b_only] * 4)
    assert log[5][1] == ["b/0"] and all(not e[1] for i, e in enumerate(log) if i != 5)
    assert s.recorder.steps[5]["num_preempted_recompute"] == 1
    b_row = next(r for r in s.recorder.requests if r["request_id"] == "b")
    assert b_row["num_preemptions"] == 1 and b_row["output_len"] == 10 and b_row["finish_reason"] == "length"


def test_swap_out_then_swap_in_when_blocks_free_up():
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, max_num_batched_tokens=16, preemption_mode="swap")
    log = drive(s, [(0, request("a", 4, 10)), (0, request("b", 4, 10, arrival=0.1))])
    assert log[5][1] == ["b/0"] and len(log[5][2]) == 2  # b's 2 blocks go to the CPU pool
    assert set(log[5][2]) == {1, 3}  # b was allocated GPU blocks 1 (prompt) and 3 (step 1)
    assert schedules(log)[5:10] == [[("a/0", 1, 1)]] * 5
    assert log[10][3] and set(log[10][3]) == set(log[5][2].values())  # swapped back in at step 10
    assert schedules(log)[10:] == [[("b/0", 1, 1)]] * 5  # no recompute: it resumes decoding
    steps = s.recorder.steps
    assert steps[5]["num_preempted_swap"] == 1 and steps[5]["num_swap_out_blocks"] == 2
    assert steps[6]["num_swapped"] == 1 and steps[6]["cpu_blocks_used"] == 2
    assert steps[10]["num_swap_in_blocks"] == 2 and steps[10]["num_swapped"] == 0
    b_row = next(r for r in s.recorder.requests if r["request_id"] == "b")
    assert b_row["num_swaps"] == 2 and b_row["num_preemptions"] == 1


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=1, max_num_batched_tokens=16, preemption_mode="swap")
    log = drive(s, [(0, request("a", 4, 10)), (0, request("b", 4, 10, arrival=0.1))])
    assert log[5][1] == ["b/0"] and not log[5][2]  # preempted, but nothing swapped
    assert schedules(log)[10] == [("b/0", 9, 1)]  # recomputed
    assert [e for e in s.recorder.events if e[1] == "preempted"] == [(5.0, "preempted", "b", 1,
                                                                      "recompute_fallback")]
    assert [r["num_swap_fallbacks"] for r in s.recorder.steps] == [0] * 5 + [1] + [0] * 9
    assert s.recorder.steps[5]["num_preempted_recompute"] == 1 and s.recorder.steps[5]["num_preempted_swap"] == 0


def test_priority_request_preempts_a_lower_priority_one():
    s = make_scheduler("priority", num_gpu_blocks=4, max_num_batched_tokens=16)
    log = drive(s, [(0, request("low", 8, 8, priority=5)),
                    (2, request("high", 8, 2, priority=0, arrival=2.0))])
    assert schedules(log) == [
        [("low/0", 8, 1)], [("low/0", 1, 1)],
        [("high/0", 8, 1)],  # low (3 blocks) is pushed out so high (2 blocks) fits
        [("high/0", 1, 1)],
        [("low/0", 10, 1)],  # low recomputes prompt + its 2 tokens
    ] + [[("low/0", 1, 1)]] * 5
    assert log[2][1] == ["low/0"]


def test_priority_without_preempt_running_waits_for_memory():
    s = make_scheduler("priority", num_gpu_blocks=4, max_num_batched_tokens=16, preempt_running=False)
    log = drive(s, [(0, request("low", 8, 8, priority=5)),
                    (2, request("high", 8, 2, priority=0, arrival=2.0))])
    assert schedules(log) == [[("low/0", 8, 1)]] + [[("low/0", 1, 1)]] * 7 + [
        [("high/0", 8, 1)], [("high/0", 1, 1)]]
    assert not any(e[1] for e in log)


def test_priority_orders_admission_by_priority_then_arrival():
    s = make_scheduler("priority", max_num_batched_tokens=4, max_num_seqs=1)
    log = drive(s, [(0, request("c", 4, 1, priority=2, arrival=0.0)), (0, request("a", 4, 1, priority=0, arrival=0.2)),
                    (0, request("b", 4, 1, priority=0, arrival=0.3))])
    assert schedules(log) == [[("a/0", 4, 1)], [("b/0", 4, 1)], [("c/0", 4, 1)]]


def test_parallel_sampling_forks_copy_on_write_after_the_prompt():
    s = make_scheduler()
    tokens = itertools.count(1).__next__
    s.add(request("par", 6, 3, n=2), now=0.0)
    family = s.sequences("par")  # the engine keeps this list to build its outputs
    log = drive(s, [(0, request("other", 3, 2, arrival=1.0))], tokens=tokens)
    assert schedules(log) == [
        [("par/0", 6, 2), ("other/0", 3, 1)],  # the prompt samples n=2 tokens
        [("par/0", 1, 1), ("par/1", 1, 1), ("other/0", 1, 1)],  # the child runs right after its parent
        [("par/0", 1, 1), ("par/1", 1, 1)],
    ]
    # Position 6 lies in the shared block 1: the first writer gets a private copy, the last writes in place.
    assert log[1][4] == [(1, 3)]
    assert log[0][4] == [] and log[2][4] == []
    par = next(r for r in s.recorder.requests if r["request_id"] == "par")
    assert par["n"] == 2 and par["output_len"] == 6 and par["token_times"] == [1.0, 2.0, 3.0]
    assert [(q.sample_index, q.output_token_ids, q.finish_reason) for q in family] == [
        (0, [1, 4, 7], "length"), (1, [2, 5, 8], "length")]


def test_prefix_cache_hit_skips_computed_tokens():
    s = make_scheduler(blocks="prefix")
    log = drive(s, [(0, request("first", 10, 1)), (2, request("second", 10, 1, arrival=2.0))])
    # The second prompt's 2 leading full blocks are cached: only 10 - 8 tokens are computed.
    assert schedules(log) == [[("first/0", 10, 1)], [("second/0", 2, 1)]]
    last = s.recorder.steps[-1]
    assert (last["prefix_hits"], last["prefix_queries"]) == (2, 4)


def test_request_that_can_never_fit_is_aborted_while_the_others_run():
    s = make_scheduler(num_gpu_blocks=4, max_num_batched_tokens=16)
    log = drive(s, [(0, request("ok", 4, 3)), (0, request("huge", 20, 1, arrival=0.1)),
                    (0, request("ok2", 4, 2, arrival=0.2))])
    assert schedules(log) == [[("ok/0", 4, 1), ("ok2/0", 4, 1)], [("ok/0", 1, 1), ("ok2/0", 1, 1)],
                              [("ok/0", 1, 1)]]
    assert log[0][5] == ["huge"]  # returned by the first update
    rows = {r["request_id"]: r for r in s.recorder.requests}
    assert rows["huge"]["status"] == "aborted" and rows["huge"]["finish_reason"] == "abort:too_long"
    assert rows["ok"]["status"] == rows["ok2"]["status"] == "finished"


def test_the_watermark_holds_a_prompt_back_until_the_pool_is_idle():
    # 4 blocks, watermark 2: a 3-block prompt waits while another request holds a block, and is
    # admitted once the pool is idle (whether a request can run depends on its length alone).
    s = make_scheduler(num_gpu_blocks=4, watermark=0.5, max_num_batched_tokens=16)
    s.add(request("short", 2, 2, ignore_eos=True), now=0.0)
    s.add(request("wide", 12, 1), now=0.0)
    out = s.schedule(0.0)
    assert compact(out) == [("short/0", 2, 1)] and not out.aborted
    ended = s.update(out, {out.scheduled[0].seq.seq_id: [7]}, 1.0)
    out = s.schedule(1.0)
    assert compact(out) == [("short/0", 1, 1)]
    ended = s.update(out, {out.scheduled[0].seq.seq_id: [7]}, 2.0)
    assert [r.request_id for r in ended] == ["short"]
    out = s.schedule(2.0)
    assert compact(out) == [("wide/0", 12, 1)]
    assert [r.finish_reason for r in s.update(out, {out.scheduled[0].seq.seq_id: [7]}, 3.0)] == ["length"]


def test_without_chunked_prefill_a_step_is_prefill_only():
    s = make_scheduler(max_num_batched_tokens=64, chunked=False)
    log = drive(s, [(0, request("a", 4, 4)), (2, request("b", 30, 2, arrival=2.0))])
    assert schedules(log) == [
        [("a/0", 4, 1)], [("a/0", 1, 1)],
        [("b/0", 30, 1)],  # b's whole prompt; a's decode waits one step
        [("a/0", 1, 1), ("b/0", 1, 1)],
        [("a/0", 1, 1)],
    ]


def test_token_budget_and_max_num_seqs_bound_every_step():
    s = make_scheduler(max_num_batched_tokens=6, max_num_seqs=3, num_gpu_blocks=64)
    for i in range(7):
        s.add(request(f"r{i}", 5, 3, arrival=i * 0.1), now=0.0)
    for out in run_to_end(s):
        assert sum(e.num_new_tokens for e in out.scheduled) <= 6
        assert len(out.scheduled) <= 3


def test_parallel_sampling_reserves_n_sequence_slots_at_admission():
    s = make_scheduler(max_num_seqs=3)
    s.add(request("pair", 4, 2, n=2), now=0.0)
    s.add(request("x", 4, 2, arrival=0.1), now=0.0)
    s.add(request("y", 4, 2, arrival=0.2), now=0.0)
    out = s.schedule(0.0)
    assert compact(out) == [("pair/0", 4, 2), ("x/0", 4, 1)]  # 2 + 1 slots: y must wait


def test_swapped_siblings_come_back_sharing_one_copy():
    # 3 GPU blocks, 1 CPU block. At step 1 the three samples of "par" share block 1; par/0 needs a
    # private copy, so par/2 and then par/1 are swapped out (one CPU copy for both).
    s = make_scheduler(num_gpu_blocks=3, num_cpu_blocks=1, max_num_batched_tokens=16, preemption_mode="swap")
    log = drive(s, [(0, request("long", 4, 4)), (0, request("par", 1, 3, n=3, arrival=0.1))])
    assert schedules(log) == [
        [("long/0", 4, 1), ("par/0", 1, 3)],
        [("long/0", 1, 1), ("par/0", 1, 1)], [("long/0", 1, 1), ("par/0", 1, 1)],
        [("long/0", 1, 1)],  # par/1 and par/2 are back but share a block no free block can split yet
        [("par/1", 1, 1), ("par/2", 1, 1)], [("par/1", 1, 1), ("par/2", 1, 1)],
    ]
    assert log[1][1] == ["par/2", "par/1"] and log[1][2] == {1: 0}
    assert log[3][3] == {0: 1}  # one swap-in copy for both siblings
    assert log[4][4] == [(1, 0)]  # then copy-on-write splits them
