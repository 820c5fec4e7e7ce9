"""The front end's way from a request body to its first chunk: bodies parsed and validated in one
pass with the same 400s as before (engine/serving/errors.py: parse_request), token-id prompts
checked without per-token Python, and the hop-by-hop timeline bench_online reports
(experiments/lib/request_timeline.py) measured on a real app."""
from __future__ import annotations

import asyncio
import json

import pytest
from optional_deps import require_serving

require_serving()

from engine.offline.llm import parse_prompt
from engine.online.engine_stats import RequestStats
from engine.serving.errors import APIError, parse_request
from engine.serving.protocol import ChatCompletionRequest, CompletionRequest
from experiments.lib.frontend_host_stub import InstantHost, scope_for
from experiments.lib.request_timeline import TimedApp, hops


def _error(body: bytes, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(body, model)
    return info.value


def test_a_good_body_parses_as_the_model():
    req = parse_request(b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": true}', CompletionRequest)
    assert req.prompt == [1, 2, 3] and req.max_tokens == 4 and req.stream
    chat = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', ChatCompletionRequest)
    assert chat.messages[0].content == "hi"


@pytest.mark.parametrize("body", [b"{bad", b"", b"\xff\xfe\x00", b'{"model": "m", "prompt": [1,'])
def test_a_body_that_is_not_json_is_a_400_saying_so(body):
    err = _error(body)
    assert err.status == 400 and err.message.startswith("the request body is not valid JSON: ")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_field_errors_name_the_field_as_before():
    assert _error(b'{"model": "m", "prompt": [1], "bogus": 1}').param == "bogus"
    assert _error(b'{"model": "m", "prompt": [1], "temperature": "hot"}').param == "temperature"
    assert _error(b'[1, 2]').status == 400
    # A lone surrogate's escape is JSON that pydantic's parser refuses: Python's reads it, and the
    # model names the field, as FastAPI's json.loads path did.
    err = _error(b'{"model": "m", "prompt": "a\\ud800b"}')
    assert err.param == "prompt" and "lone surrogate" in err.message
    err = _error(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', ChatCompletionRequest)
    assert err.param.startswith("messages") and "lone surrogate" in err.message


@pytest.mark.parametrize("prompt,ok", [([1, 2, 3], True), ((4, 5), True), ([1, True], False), ([1, 2.0], False),
                                       ([], False), ([1, "2"], False)])
def test_token_ids_are_plain_ints_only(prompt, ok):
    if ok:
        assert parse_prompt(prompt, "prompt") == list(prompt)
    else:
        with pytest.raises(ValueError, match="prompt"):
            parse_prompt(prompt, "prompt")


def test_an_int_subclass_is_still_a_token_id():
    class TokenId(int):
        pass

    assert parse_prompt([TokenId(3), 4], "prompt") == [3, 4]


def test_the_timeline_splits_each_request_at_generate_and_at_its_first_token():
    from engine.online.async_llm_engine import AsyncLLMEngine
    from engine.serving.app import build_app

    host = InstantHost(tokens=3)
    engine = AsyncLLMEngine(host)
    records: list[RequestStats] = []
    engine.add_finished_observer(records.append)
    timed = TimedApp(build_app(engine, "front-cpu"))
    body = json.dumps({"model": "front-cpu", "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}).encode()

    async def call() -> list[bytes]:
        sent: list[bytes] = []
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        await timed(scope_for(body), receive, send)
        return sent

    chunks = asyncio.run(call())
    request_id = json.loads(chunks[0].removeprefix(b"data: "))["id"]
    assert list(timed.times) == [request_id]
    called, written = timed.times[request_id]
    assert written > called
    # The host answers without an engine: its records carry no arrival, so give one inside the call.
    arrival, ttft = called + 0.25 * (written - called), 0.5 * (written - called)
    record = RequestStats(request_id, "length", 3, 3, ttft, [], 0.0, arrival=arrival)
    row = hops(timed.times, [record, RequestStats("other", "length", 1, 1, 0.1, [], 0.1, arrival=0.0)])
    assert list(row["request_id"]) == [request_id]
    r = row.iloc[0]
    assert r["way_in"] + r["engine"] + r["way_out"] == pytest.approx(r["server"]) == pytest.approx(written - called)
    assert r["way_in"] == pytest.approx(arrival - called) and r["engine"] == ttft


def test_a_requests_gaps_observed_at_once_expose_as_one_by_one():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from engine.serving.metrics import ITL_BUCKETS, observe_all

    gaps = [0.0, -1.0, 1e9, *ITL_BUCKETS[:-1], *(0.0004 * k for k in range(1, 400))]

    def exposition(observe) -> list[str]:
        registry = CollectorRegistry()
        child = Histogram("itl", "gaps", ["model_name"], registry=registry, buckets=ITL_BUCKETS).labels("m")
        observe(child)
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    def one_by_one(child) -> None:
        for gap in gaps:
            child.observe(gap)

    expected = exposition(one_by_one)
    assert exposition(lambda child: observe_all(child, gaps)) == expected
    assert exposition(lambda child: observe_all(child, [])) == exposition(lambda child: None)

    class Plain:  # a histogram without prometheus_client's bucket fields: observed one by one
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    plain = Plain()
    observe_all(plain, gaps)
    assert plain.seen == gaps
