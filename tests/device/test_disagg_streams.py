"""Streams through a disaggregated pair on CPU (gloo; the tiny Qwen3 with its byte tokenizer): the
decode process sends its outputs without their prompts (`DecodeOutput`) and the front puts its own
copy back, so every streamed output ("delta", "cumulative") equals the co-located engine's field by
field (prompt text, prompt token ids, cached tokens, completions), no `DecodeStep` on the pipe
carries a prompt, and a stream aborted while decoding still ends with its reason, the front keeping
nothing of it."""
from __future__ import annotations

import dataclasses
import time

import pytest
from engine_helpers import ragged_prompts

from engine.disagg.messages import DecodeOutput, DecodeStep
from engine.disagg.pd_engine import DisaggregatedEngine
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from policies.request import SamplingParams

ARGS = {"num_gpu_blocks": 128, "swap_space": 0.01, "max_model_len": 96, "block_size": 4,
        "max_num_batched_tokens": 32}
# Text prompts (their text comes back in every output) and token-id prompts (None comes back).
PROMPTS = ["The quick brown fox", "jumps over the lazy dog, again and again and again", *ragged_prompts(3, seed=4, min_len=3, max_len=50)]
BOUND_S = 60.0  # a test's requests all end within this


def _params(kind: str, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def _view(output: RequestOutput) -> tuple:
    """Everything a user sees of one output but its timings (the two engines' clocks differ)."""
    return (output.prompt, list(output.prompt_token_ids), output.num_cached_tokens, output.finished, output.error,
            [dataclasses.astuple(c) for c in output.outputs], output.metrics.arrival_time is not None)


def _stream(engine, kind: str, tag: str, on_step=None) -> dict[int, list[RequestOutput]]:
    """Prompt index -> its outputs, in order; request ids `<tag>-<index>`."""
    streams: dict[int, list[RequestOutput]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", prompt, _params(kind))
        streams[i] = []
    deadline = time.monotonic() + BOUND_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not end within the bound"
        for out in engine.step():
            streams[int(out.request_id.rpartition("-")[2])].append(out)
        if on_step is not None:
            on_step(engine, streams)
    return streams


@pytest.fixture(scope="module")
def reference(model_dir):
    with LLMEngine(EngineArgs(model=model_dir, **ARGS)) as engine:
        yield {kind: _stream(engine, kind, kind) for kind in ("delta", "cumulative")}


@pytest.fixture(scope="module")
def pair(model_dir):
    with DisaggregatedEngine(EngineArgs(model=model_dir, **ARGS), "prefill=1,decode=1,transfer_timeout_s=10") as engine:
        yield engine


def _wire(pair, monkeypatch) -> list:
    """Every message the front reads from the decode process, from now on."""
    messages, recv = [], pair._receiver.recv

    def read():
        message = recv()
        messages.append(message)
        return message

    monkeypatch.setattr(pair._receiver, "recv", read)
    return messages


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_streams_equal_the_colocated_engine_field_by_field(pair, reference, kind):
    streams = _stream(pair, kind, kind)
    assert all(stream[-1].finished for stream in streams.values())
    for i, prompt in enumerate(PROMPTS):
        assert [_view(o) for o in streams[i]] == [_view(o) for o in reference[kind][i]], i
        if isinstance(prompt, str):
            assert streams[i][0].prompt == prompt and any(c.text for o in streams[i] for c in o.outputs)
        else:
            assert streams[i][0].prompt is None and streams[i][0].prompt_token_ids == prompt
    assert not pair._prompts and not pair._decoding and not pair._params


def test_decode_steps_on_the_pipe_carry_no_prompt(pair, reference, monkeypatch):
    messages = _wire(pair, monkeypatch)
    streams = _stream(pair, "delta", "wire")
    outputs = [o for m in messages if isinstance(m, DecodeStep) for o in m.outputs]
    assert len(outputs) >= sum(map(len, streams.values())) - len(PROMPTS)  # all but the prefill side's
    for output in outputs:
        assert isinstance(output, DecodeOutput)
        assert getattr(output, "prompt_token_ids", None) is None and getattr(output, "prompt", None) is None


def test_a_stream_aborted_while_decoding_ends_with_its_reason(pair, reference):
    aborted = {}

    def abort_when(engine, streams) -> None:
        if not aborted and len(streams[1]) >= 2:  # its first token and a decode step's streamed
            aborted["abort-1"] = engine.abort_request("abort-1")

    streams = _stream(pair, "delta", "abort", on_step=abort_when)
    assert aborted == {"abort-1": True}
    assert [_view(o) for o in streams[1][:2]] == [_view(o) for o in reference["delta"][1][:2]]
    last = streams[1][-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort:user"]
    assert last.prompt == PROMPTS[1] and last.prompt_token_ids == reference["delta"][1][0].prompt_token_ids
    for i in (0, 2, 3, 4):
        assert [_view(o) for o in streams[i]] == [_view(o) for o in reference["delta"][i]], i
    assert not pair._prompts and not pair._decoding and not pair._params


def test_a_decode_output_is_its_request_output_less_the_prompt():
    """Every field of `RequestOutput` but the prompt crosses the pipe, and comes back unchanged."""
    output = RequestOutput("r", "a prompt", [5, 6, 7], [CompletionOutput(0, "x", [9], "stop", 9, None)], True,
                           RequestMetrics(1.0, 2.0, 3.0, 4.0, 1), num_cached_tokens=4, error="boom")
    names = {f.name for f in dataclasses.fields(RequestOutput)} - {"prompt", "prompt_token_ids"}
    assert {f.name for f in dataclasses.fields(DecodeOutput)} == names
    assert DecodeOutput.of(output).with_prompt("a prompt", [5, 6, 7]) == output
