"""The trace recorder: request rows, step rows, lifecycle events and metric definitions."""
from __future__ import annotations

import math

import pytest
from scheduler_helpers import make_scheduler, request, run_to_end

from policies import Scheduler, TraceRecorder
from policies.trace import EVENT_COLUMNS, REQUEST_COLUMNS, STEP_COLUMNS


def rows_by_id(s):
    return {r["request_id"]: r for r in s.recorder.requests}


def test_request_row_metrics_follow_vllm_definitions():
    s = make_scheduler(max_num_batched_tokens=4, max_num_seqs=1)
    s.add(request("first", 4, 1, arrival=0.0), now=0.0)
    s.add(request("r", 4, 3, arrival=0.5, priority=2), now=0.5)
    run_to_end(s, now=1.0, dt=1.0)  # first runs 1.0->2.0; r is scheduled at 2.0, tokens at 3, 4, 5
    row = rows_by_id(s)["r"]
    assert tuple(row) == REQUEST_COLUMNS
    assert row["first_scheduled_time"] == 2.0 and row["queueing_time"] == 1.5
    assert row["token_times"] == [3.0, 4.0, 5.0] and row["first_token_time"] == 3.0
    assert row["ttft"] == 2.5 and row["e2e"] == 4.5 and row["finish_time"] == 5.0
    assert math.isclose(row["tpot"], (4.5 - 2.5) / 2)
    assert (row["prompt_len"], row["output_len"], row["n"], row["priority"]) == (4, 3, 1, 2)
    assert (row["status"], row["finish_reason"], row["num_preemptions"], row["num_swaps"]) == \
        ("finished", "length", 0, 0)
    assert rows_by_id(s)["first"]["tpot"] is None  # one output token: no inter-token time


def test_aborted_request_row_has_no_token_metrics():
    s = make_scheduler()
    s.add(request("r", 4, 3, arrival=1.0), now=1.0)
    assert s.abort("r", reason="timeout", now=3.0)
    [row] = s.recorder.requests
    assert row["status"] == "aborted" and row["finish_reason"] == "abort:timeout"
    assert row["ttft"] is None and row["tpot"] is None and row["first_scheduled_time"] is None
    assert row["e2e"] == 2.0 and row["output_len"] == 0 and row["token_times"] == []


def test_step_rows_count_the_batch_the_pools_and_kv_tokens():
    s = make_scheduler(max_num_batched_tokens=8, num_gpu_blocks=16)
    s.add(request("a", 6, 3), now=0.0)
    s.add(request("b", 9, 2, arrival=0.1), now=0.0)
    run_to_end(s, now=0.0, dt=0.25)
    steps = s.recorder.steps
    assert all(tuple(r) == STEP_COLUMNS for r in steps)
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert all(r["duration"] == 0.25 for r in steps) and steps[1]["time"] == 0.25
    # step 0: a's prompt (6) + 2 tokens of b; step 1: a decodes, b's last 7 prompt tokens.
    assert [(r["num_prefill_tokens"], r["num_prefill_seqs"], r["num_decode_seqs"]) for r in steps[:2]] == \
        [(8, 2, 0), (7, 1, 1)]
    assert steps[0]["num_batched_tokens"] == 8 and steps[1]["num_batched_tokens"] == 8
    # After step 1: a has 7 computed tokens (2 blocks), b 9 (3 blocks).
    assert (steps[1]["kv_tokens"], steps[1]["gpu_blocks_used"], steps[1]["gpu_blocks_total"]) == (16, 5, 16)
    assert (steps[1]["num_running"], steps[1]["num_waiting"], steps[1]["num_swapped"]) == (2, 0, 0)
    assert steps[-1]["gpu_blocks_used"] == 0 and steps[-1]["kv_tokens"] == 0
    assert sum(r["num_finished"] for r in steps) == 2 and sum(r["num_aborted"] for r in steps) == 0


def test_lifecycle_events_of_a_swapped_request():
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, max_num_batched_tokens=16, preemption_mode="swap")
    s.add(request("a", 4, 10), now=0.0)
    s.add(request("b", 4, 10, arrival=0.1), now=0.0)
    run_to_end(s)
    events = [(e[0], e[1], e[4]) for e in s.recorder.events if e[2] == "b"]
    assert events == [(0.0, "arrived", ""), (0.0, "scheduled", ""), (1.0, "first_token", ""),
                      (5.0, "preempted", "swap"), (5.0, "swapped_out", ""), (10.0, "swapped_in", ""),
                      (15.0, "finished", "length")]
    assert all(len(e) == len(EVENT_COLUMNS) for e in s.recorder.events)


def test_every_request_gets_exactly_one_row_and_the_recorder_forgets_it():
    s = make_scheduler(num_gpu_blocks=6, max_num_batched_tokens=16)
    for i in range(6):
        s.add(request(f"r{i}", 3 + i, 4 + i, arrival=i, n=1 + i % 2), now=float(i))
    s.abort("r5")
    run_to_end(s)
    assert sorted(r["request_id"] for r in s.recorder.requests) == [f"r{i}" for i in range(6)]
    assert s.recorder.num_live == 0
    par = rows_by_id(s)["r1"]
    assert par["n"] == 2 and par["output_len"] == 2 * 5


def test_recorder_rejects_an_unknown_preemption_mode_and_can_skip_events():
    s = make_scheduler()
    s.add(request("r", 4, 1), now=0.0)
    with pytest.raises(ValueError, match="mode"):
        s.recorder.preempted(s.queues.waiting[0], "drop", 0.0)
    quiet = TraceRecorder(record_events=False)
    s2 = Scheduler(s.config, s.policy, s.block_manager.__class__(4, 16), quiet)
    s2.add(request("r", 4, 2), now=0.0)
    run_to_end(s2)
    assert quiet.events == [] and len(quiet.requests) == 1 and len(quiet.steps) == 2
