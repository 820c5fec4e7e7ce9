"""A disaggregated engine pair on CPU (gloo): the prefill engine here, the decode engine in its own
process, KV blocks moved on the link. Greedy tokens equal the co-located engine's in float32
(chunked prefill, async scheduling on the decode side, n = 2, preemption by swap and by recompute on
the decode side, one transfer in flight at a time), requests that end at their first token end on the prefill side, an abort holds
its meaning before, during and after the hand-off, and a decode process killed mid-transfer ends
every request past its prefill with an error within the bound. Start-up: the link moves one block
before the pair takes requests, the pair's clock starts once it is ready (on both engines), and a
decode process that dies or hangs in that transfer fails the start-up within its bound."""
from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time

import pytest
from disagg_helpers import SignalAtFirstHandOff
from engine_helpers import ragged_prompts
from process_helpers import gone

from engine.disagg import link_warmup
from engine.disagg.config import DisaggregationConfig
from engine.disagg.messages import HandoffBatch, HandoffMessage
from engine.disagg.pd_engine import JOIN_TIMEOUT_S, DisaggregatedEngine
from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams
from policies.trace import STEP_COLUMNS

ARGS = {"model": "tiny-llama", "num_gpu_blocks": 128, "swap_space": 0.01, "max_model_len": 96, "block_size": 4,
        "max_num_batched_tokens": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ragged_prompts(6, seed=1, min_len=3, max_len=60)
TIMEOUT_S = 5.0
BOUND_S = 60.0  # a test's requests all end within this


_runs = itertools.count()


def _run(engine, prompts=PROMPTS, params=GREEDY, on_step=None, tag: str | None = None) -> dict[int, tuple]:
    """Prompt index -> (token ids per sample, finish reasons, error); request ids `<tag>-<index>`."""
    tag = tag or f"run{next(_runs)}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    done, deadline = {}, time.monotonic() + BOUND_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not end within the bound"
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.rpartition("-")[2])] = ([c.token_ids for c in out.outputs], [c.finish_reason for c in out.outputs],
                                        out.error)
        if on_step is not None:
            on_step(engine)
    return done


@pytest.fixture(scope="module")
def reference():
    with LLMEngine(EngineArgs(**ARGS)) as engine:
        yield {"greedy": _run(engine), "fork": _run(engine, PROMPTS[:3], _fork())}


def _fork() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def pair():
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    yield engine
    engine.close()


def test_greedy_tokens_equal_the_colocated_engine(pair, reference):
    assert _run(pair) == reference["greedy"]
    rows = {r["request_id"]: r for r in pair.decode_rows}
    row = rows[max(rows)]
    assert row["prefill_replica"] == 0 and row["decode_replica"] == 1 and row["transfer_bytes"] > 0
    assert row["transfer_time"] >= row["link_time"] >= 0 and row["ttft"] >= row["prefill_time"] > 0


def test_one_step_s_hand_offs_go_to_the_decode_process_as_one_message(pair, monkeypatch):
    per_step, messages = [], []
    take, send = pair.side.take_handoffs, pair._sender.send

    def taken():
        handoffs = take()
        if handoffs:
            per_step.append([h.request_id for h in handoffs])
        return handoffs

    def sent(message):
        messages.append(message)
        send(message)

    monkeypatch.setattr(pair.side, "take_handoffs", taken)
    monkeypatch.setattr(pair._sender, "send", sent)
    done = _run(pair, ragged_prompts(8, seed=2, min_len=3, max_len=6), tag="batched")
    assert len(done) == 8 and all(len(tokens[0]) == GREEDY.max_tokens for tokens, _, _ in done.values())
    batches = [[m.handoff.request_id for m in message.handoffs] for message in messages
               if isinstance(message, HandoffBatch)]
    assert not [m for m in messages if isinstance(m, HandoffMessage)]
    assert batches == per_step and max(map(len, batches)) > 1


def test_parallel_samples_move_together(pair, reference):
    assert _run(pair, PROMPTS[:3], _fork()) == reference["fork"]


def test_a_request_ending_at_its_first_token_ends_on_the_prefill_side(pair):
    done = _run(pair, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert [len(done[i][0][0]) for i in range(2)] == [1, 1]
    assert all(reason == ["length"] for _, reason, _ in done.values())


def test_abort_before_during_and_after_the_hand_off(pair, reference):
    check_aborts_around_the_hand_off(pair, reference)


def check_aborts_around_the_hand_off(pair, reference) -> None:
    """Requests aborted while prefilling, handed off (blocks not yet on the decode side) and
    decoding end with `abort:user`, the others as the co-located engine's, no prefill block held."""
    aborted = {}

    def abort_when(engine) -> None:
        if 0 not in aborted:  # still prefilling (the first step has not run it to its end)
            aborted[0] = engine.abort_request("abort-0")
        if 1 not in aborted and "abort-1" in engine._handoffs:  # handed off, blocks not yet on the decode side
            aborted[1] = engine.abort_request("abort-1")
        if 2 not in aborted and "abort-2" in engine._decoding and "abort-2" not in engine._handoffs:  # decoding
            aborted[2] = engine.abort_request("abort-2")

    done = _run(pair, on_step=abort_when, tag="abort")
    assert aborted[0] and done[0][1] == ["abort:user"]
    assert aborted.get(1) or aborted.get(2)
    for i in (1, 2):
        if aborted.get(i):
            assert done[i][1] == ["abort:user"], i
    for i in range(3, len(PROMPTS)):
        assert done[i] == reference["greedy"][i]
    assert pair.prefill.scheduler.block_manager.num_free_gpu_blocks() == pair.prefill.runner.num_gpu_blocks
    assert not pair.side.transferring


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_the_decode_side_keeps_the_tokens(mode, reference):
    config = DisaggregationConfig(transfer_timeout_s=TIMEOUT_S, max_transfers_in_flight=1,  # reserved ones wait
                                  decode_args={"num_gpu_blocks": 24, "preemption_mode": mode})
    with DisaggregatedEngine(EngineArgs(**ARGS), config) as engine:
        assert _run(engine) == reference["greedy"]
        assert sum(r["num_preemptions"] for r in engine.decode_rows) > 0


def test_offline_llm_runs_the_pair(reference):
    llm = LLM(disaggregation="prefill=1,decode=1,transfer_timeout_s=5", **ARGS)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()
    assert [o.outputs[0].token_ids for o in outputs] == [reference["greedy"][i][0][0] for i in range(len(PROMPTS))]


def test_a_killed_decode_process_ends_the_handed_off_requests_with_an_error():
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    kill = SignalAtFirstHandOff(signal.SIGKILL)
    try:
        done = _run(engine, on_step=kill)
        ended = time.monotonic()
        assert kill.sent_at and ended - kill.sent_at[0] < TIMEOUT_S + 2.0
        errors = [i for i, (_, _, error) in done.items() if error is not None]
        assert errors and all(done[i][1][0] == "abort:error" for i in errors)
        assert all("decode engine" in done[i][2] for i in errors)
        assert len(done) == len(PROMPTS)
        with pytest.raises(RuntimeError, match="the decode engine failed"):
            engine.add_request("late", PROMPTS[0], GREEDY)
        assert engine.prefill.scheduler.block_manager.num_free_gpu_blocks() == engine.prefill.runner.num_gpu_blocks
    finally:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 2.0


def test_requests_prefilled_after_the_decode_process_died_end_with_an_error():
    """The decode process is gone before the requests are prefilled: each hand-off made after the
    failure ends at once with abort:error (none is left unfinished), its prefill blocks freed."""
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    try:
        os.kill(engine.decode_pid, signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT_S
        while engine._decode.alive:
            assert time.monotonic() < deadline, "the killed decode process did not exit"
            time.sleep(0.01)
        done = _run(engine)
        assert len(done) == len(PROMPTS)
        assert all(reasons == ["abort:error"] and "decode engine" in error for _, reasons, error in done.values())
        assert engine.prefill.scheduler.block_manager.num_free_gpu_blocks() == engine.prefill.runner.num_gpu_blocks
    finally:
        engine.close()


def test_a_stopped_decode_process_is_hung_and_its_requests_end_with_an_error():
    """Alive but silent (SIGSTOP) with requests decoding: ended as hung within transfer_timeout_s."""
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    stop = SignalAtFirstHandOff(signal.SIGSTOP)
    try:
        done = _run(engine, on_step=stop)
        assert stop.sent_at and time.monotonic() - stop.sent_at[0] < TIMEOUT_S + 2.0
        errors = [i for i, (_, _, error) in done.items() if error is not None]
        # Two bounds of transfer_timeout_s race: the front's silence check ("hung") and, for a
        # request still in transfer when the signal came, the KV link's wait ("died or hung").
        texts = [done[i][2] for i in errors]
        assert errors and all("the decode engine is hung" in t or "the peer died or hung" in t for t in texts), texts
        assert len(done) == len(PROMPTS)
    finally:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 2.0


@pytest.mark.parametrize(("spec", "message"), [
    ("prefill=2,decode=1", "is not supported"),
    ("prefill=1,decode", "key=value pairs"),
    ("prefill=1,decoders=1", r"keys \['decoders'\] are unknown"),
    ("transfer_timeout_s=0", "transfer_timeout_s=0.0 is invalid"),
    ("max_queue=0", r"max_queue=0 is invalid: must be an integer >= 1 .* or null"),
    ("decode_device=tpu", "decode_device='tpu' is invalid"),
])
def test_bad_disaggregation_settings_name_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        DisaggregationConfig.parse(spec)


def test_the_decode_engines_hand_off_queue_is_unbounded_by_default():
    """The simulator's rule (policies/disagg/decode_side.py): backpressure unless a bound is set."""
    assert DisaggregationConfig().max_queue is None
    assert DisaggregationConfig.parse("max_queue=null").max_queue is None
    assert DisaggregationConfig.parse("max_queue=8").max_queue == 8


def test_decode_args_may_not_change_the_kv_layout():
    config = DisaggregationConfig(decode_args={"block_size": 8})
    with pytest.raises(ValueError, match=r"may not set \['block_size'\]"):
        DisaggregatedEngine(EngineArgs(**ARGS), config)


def test_a_pair_idle_past_its_timeout_is_not_hung(reference):
    """Silence counts only while requests decode: work after an idle spell longer than
    transfer_timeout_s still runs."""
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=1.0))
    try:
        time.sleep(1.5)
        assert _run(engine) == reference["greedy"]
    finally:
        engine.close()


def test_a_stream_gets_its_first_token_as_it_arrives(pair, reference):
    """A delta stream's first output holds the first token alone (sent when the KV arrived, before the
    decode engine's first step); the deltas add up to the greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind="delta")
    pair.add_request("stream-0", PROMPTS[0], params)
    deltas, deadline = [], time.monotonic() + BOUND_S
    while pair.has_unfinished_requests():
        assert time.monotonic() < deadline
        deltas += [o.outputs[0].token_ids for o in pair.step() if o.outputs]
    assert len(deltas[0]) == 1 and [t for d in deltas for t in d] == reference["greedy"][0][0][0]


def test_a_hand_off_left_waiting_for_blocks_ends_as_in_the_simulator(reference):
    """Hand-offs that wait longer than queue_timeout_s for the decode engine's blocks end with the
    simulator's finish reason, abort:handoff_timeout, their rows written by the prefill engine; the
    others decode as usual."""
    config = DisaggregationConfig(transfer_timeout_s=TIMEOUT_S, queue_timeout_s=0.001,
                                  decode_args={"num_gpu_blocks": 24})
    with DisaggregatedEngine(EngineArgs(**ARGS), config) as engine:
        done = _run(engine)
        rows = {r["request_id"]: r for r in engine.recorder.requests}
        free = engine.prefill.scheduler.block_manager.num_free_gpu_blocks()
        assert free == engine.prefill.runner.num_gpu_blocks
    timed_out = [i for i, (_, reasons, _) in done.items() if reasons == ["abort:handoff_timeout"]]
    assert timed_out and len(timed_out) < len(PROMPTS)
    for i in timed_out:
        assert "queue_timeout_s" in done[i][2]
    assert {r["finish_reason"] for r in rows.values()} == {"abort:handoff_timeout"}
    for i in set(range(len(PROMPTS))) - set(timed_out):
        assert done[i] == reference["greedy"][i]


def _slow_front_warm_up(monkeypatch, delay_s: float, signal_decode: int | None = None) -> list[tuple[int, float]]:
    """The front's start-up transfer begins `delay_s` late (after sending `signal_decode` to the
    decode process starting, if given, noting its pid and when (`time.monotonic()`) in the list
    returned; a module fixture's pair is left alone)."""
    real = link_warmup.warm_send
    signalled: list[tuple[int, float]] = []
    others = {child.pid for child in multiprocessing.active_children()}

    def warm_send(link, k_caches, v_caches):
        if signal_decode is not None:
            for child in multiprocessing.active_children():
                if child.name == "servelab-decode" and child.pid not in others:
                    os.kill(child.pid, signal_decode)
                    signalled.append((child.pid, time.monotonic()))
        time.sleep(delay_s)
        return real(link, k_caches, v_caches)

    monkeypatch.setattr(link_warmup, "warm_send", warm_send)
    return signalled


def test_the_link_moves_a_block_and_the_clock_starts_once_the_pair_is_ready(monkeypatch, reference):
    """The link's first message is the start-up transfer's, not a request's; t=0 is when the pair is
    ready, on both engines: a start-up 1 s longer moves neither clock (a decode engine still
    counting from its own start would stamp its rows 1 s late)."""
    delay_s = 1.0
    _slow_front_warm_up(monkeypatch, delay_s)
    with DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S)) as engine:
        assert engine.now() < delay_s
        assert engine.link.num_posted == 1 and engine.link_warm.num_bytes > 0
        assert _run(engine) == reference["greedy"]
        assert engine.link.num_posted >= 2
        rows, steps, end = engine.decode_rows, engine.decode_steps, engine.now()
    assert len(rows) == len(PROMPTS)
    for row in rows:
        assert row["first_token_time"] <= row["finish_time"] < row["first_token_time"] + delay_s
    _assert_decode_steps(steps, rows, end)


def _assert_decode_steps(steps: list[dict], rows: list[dict], end: float) -> None:
    """The decode engine's step rows: the prefill engine's columns, in step order on the pair's clock,
    within the requests' decode span, every decoded token in one of them."""
    assert steps and all(set(s) == set(STEP_COLUMNS) for s in steps)
    assert [s["step"] for s in steps] == list(range(len(steps)))
    times = [s["time"] for s in steps]
    assert times == sorted(times) and all(s["duration"] >= 0 for s in steps)
    assert min(r["first_token_time"] for r in rows) <= times[0] and times[-1] + steps[-1]["duration"] <= end
    assert all(s["num_prefill_tokens"] == 0 and s["num_decode_seqs"] > 0 for s in steps)  # no preemption here
    # Each request's decode steps compute the KV of its tokens but the last (the first came from prefill).
    assert sum(s["num_batched_tokens"] for s in steps) == sum(r["output_len"] - 1 for r in rows)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_decode_process_that_dies_or_hangs_in_the_link_warm_up_fails_the_start_up(monkeypatch, sig):
    signalled = _slow_front_warm_up(monkeypatch, 0.2, signal_decode=sig)
    with pytest.raises((RuntimeError, TimeoutError), match="the KV link's start-up transfer"):
        DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    # Counted from the signal: building the two engines before it is no part of the bound.
    assert len(signalled) == 1 and time.monotonic() - signalled[0][1] < TIMEOUT_S + JOIN_TIMEOUT_S + 5.0
    assert gone(signalled[0][0])
