"""Bad input, aborts, stop rules and the update contract."""
from __future__ import annotations

import logging

import pytest
from scheduler_helpers import KVStoreBackend, make_scheduler, request, run_to_end

from policies import Request, SamplingParams, SchedulerConfig, SequenceStatus, make_block_manager


@pytest.mark.parametrize("make, field", [
    (lambda: Request("r", []), "prompt_token_ids"),
    (lambda: Request("r", [1, 2], priority=1.5), "priority"),
    (lambda: Request("r", [1, 2], priority="high"), "priority"),
    (lambda: Request("", [1, 2]), "request_id"),
    (lambda: Request("r", [1, -2]), "prompt_token_ids"),
    (lambda: request("r", 4, n=9), "n"),  # more samples than max_num_seqs=8
])
def test_add_rejects_bad_requests_naming_the_field(make, field):
    s = make_scheduler()
    with pytest.raises(ValueError, match=field):
        s.add(make(), now=0.0)
    assert not s.has_unfinished() and s.recorder.num_live == 0


def test_a_prompt_over_max_model_len_is_aborted_too_long_and_the_others_run():
    """It can never run: it ends at once (abort:too_long, in the next update) instead of stopping
    a workload run; the scheduler's check alone still refuses it (the engine API's default)."""
    s = make_scheduler()  # max_model_len 64
    s.add(request("a", 4, 3), now=0.0)
    with pytest.raises(ValueError, match="longer than max_model_len=64"):
        s.check(request("long", 65, 2))
    s.add(request("long", 65, 2), now=0.0)
    s.add(request("b", 4, 3), now=0.0)
    outs = run_to_end(s)
    assert [r.request_id for r in outs[0].aborted] == ["long"]  # ends in the first step
    rows = {row["request_id"]: row for row in s.recorder.requests}
    assert {k: r["finish_reason"] for k, r in rows.items()} == {
        "long": "abort:too_long", "a": "length", "b": "length"}
    assert rows["long"]["status"] == "aborted" and rows["long"]["first_scheduled_time"] is None


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"n": 1.5}, "n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_sampling_params_reject_bad_limits(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected_even_after_it_finished():
    s = make_scheduler()
    s.add(request("r", 4, 1), now=0.0)
    with pytest.raises(ValueError, match="request_id='r'"):
        s.add(request("r", 4, 1), now=0.0)
    run_to_end(s)
    with pytest.raises(ValueError, match="request_id"):
        s.add(request("r", 4, 1), now=9.0)


@pytest.mark.parametrize("block_size", [3, 6, 0, -4])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        make_block_manager("paged", block_size, 16)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"max_model_len": 2.5}, "max_model_len"), ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
    ({"max_num_batched_tokens": 512, "max_model_len": 1024, "enable_chunked_prefill": False},
     "max_num_batched_tokens"),
])
def test_scheduler_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_abort_unknown_or_finished_returns_false_and_never_raises():
    s = make_scheduler()
    assert s.abort("nope") is False
    assert s.abort(None) is False and s.abort(["unhashable"]) is False
    s.add(request("r", 4, 1), now=0.0)
    run_to_end(s)
    assert s.abort("r") is False


def test_abort_from_every_queue_frees_blocks_and_reports_the_request_once():
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, max_num_batched_tokens=16, preemption_mode="swap")
    s.add(request("run", 4, 12, arrival=0), now=0.0)
    s.add(request("swap", 4, 12, arrival=1), now=0.0)
    s.add(request("wait", 12, 1, arrival=2), now=0.0)  # 3 blocks: never fits beside the others
    for step in range(6):  # run and swap decode; swap is swapped out at step 5 (position 8)
        out = s.schedule(float(step))
        s.update(out, {e.seq.seq_id: [7] for e in out.scheduled if e.num_samples}, float(step + 1))
    assert (s.num_running, s.num_swapped, s.num_waiting) == (1, 1, 1)
    assert [s.abort(name, reason="client", now=6.5) for name in ["run", "swap", "wait", "run"]] == \
        [True, True, True, False]
    assert not s.has_unfinished()
    usage = s.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0
    out = s.schedule(7.0)
    assert sorted(r.request_id for r in out.aborted) == ["run", "swap", "wait"]
    ended = s.update(out, {}, 8.0)
    assert sorted((r.request_id, r.finish_reason) for r in ended) == [
        ("run", "abort:client"), ("swap", "abort:client"), ("wait", "abort:client")]
    assert s.schedule(9.0).aborted == []
    rows = {r["request_id"]: r for r in s.recorder.requests}
    assert rows["wait"]["finish_time"] == 6.5 and rows["wait"]["status"] == "aborted"


def test_abort_between_schedule_and_update_skips_the_in_flight_sequence():
    s = make_scheduler()
    s.add(request("a", 4, 5), now=0.0)
    s.add(request("b", 4, 5, arrival=0.1), now=0.0)
    out = s.schedule(0.0)
    backend = KVStoreBackend(4)
    backend.execute(out)
    assert s.abort("a")
    ended = s.update(out, {e.seq.seq_id: [7] for e in out.scheduled}, 1.0)
    assert [r.request_id for r in ended] == ["a"]
    a_seq = out.scheduled[0].seq
    assert a_seq.status is SequenceStatus.FINISHED_ABORTED and a_seq.num_output_tokens == 0
    assert s.recorder.steps[-1]["kv_tokens"] == 4  # only b's prompt is in the cache
    s.check_invariants()
    run_to_end(s, backend=backend)


def test_stop_rules_eos_min_tokens_stop_ids_ignore_eos_and_max_model_len():
    s = make_scheduler(max_model_len=12)
    s.add(request("eos", 4, 10, eos=7), now=0.0)
    s.add(request("min", 4, 10, eos=7, min_tokens=3, arrival=0.1), now=0.0)
    s.add(request("stopid", 4, 10, stop_token_ids=[7], arrival=0.2), now=0.0)
    s.add(request("ignore", 4, 5, eos=7, ignore_eos=True, arrival=0.3), now=0.0)
    s.add(request("cap", 10, 50, arrival=0.4), now=0.0)  # capped by max_model_len=12
    run_to_end(s, token_fn=lambda: 7)
    rows = {r["request_id"]: r for r in s.recorder.requests}
    got = {k: (rows[k]["finish_reason"], rows[k]["output_len"]) for k in rows}
    assert got == {"eos": ("stop", 1), "min": ("stop", 3), "stopid": ("stop", 1),
                   "ignore": ("length", 5), "cap": ("length", 2)}


def test_stop_seq_ids_from_the_backend_stop_a_sequence():
    s = make_scheduler()
    s.add(request("r", 4, 10), now=0.0)
    out = s.schedule(0.0)
    seq_id = out.scheduled[0].seq.seq_id
    s.update(out, {seq_id: [5]}, 1.0)
    out = s.schedule(1.0)
    ended = s.update(out, {seq_id: [6]}, 2.0, stop_seq_ids={seq_id})
    assert [(r.request_id, r.finish_reason) for r in ended] == [("r", "stop")]


@pytest.mark.parametrize("tokens", [{}, {0: []}, {0: [1, 2]}, {0: 5}, None])
def test_update_rejects_missing_or_wrong_sample_counts(tokens):
    s = make_scheduler()
    s.add(request("r", 4, 10), now=0.0)
    out = s.schedule(0.0)
    with pytest.raises(ValueError, match=r"new_token_ids\[0\]"):
        s.update(out, tokens, 1.0)


def test_update_rejects_an_output_it_did_not_just_schedule():
    s = make_scheduler()
    s.add(request("r", 4, 10), now=0.0)
    stale = s.schedule(0.0)
    s.update(stale, {0: [1]}, 1.0)
    s.schedule(1.0)
    with pytest.raises(ValueError, match="update"):
        s.update(stale, {0: [1]}, 2.0)


def test_a_warning_is_logged_every_50_preemptions(caplog):
    s = make_scheduler(num_gpu_blocks=4, max_num_batched_tokens=16)  # b is preempted once, at step 5
    s.add(request("a", 4, 10), now=0.0)
    s.add(request("b", 4, 10, arrival=0.1), now=0.0)
    s.preemptor.total = 49  # as if 49 preemptions had happened before
    with caplog.at_level(logging.WARNING, logger="servelab.scheduler"):
        run_to_end(s)
    assert s.preemptor.total == 50
    [record] = [r for r in caplog.records if r.name == "servelab.scheduler"]
    assert "request 'b'" in record.getMessage() and "50 preemptions" in record.getMessage()
