"""The generation routes dispatched ahead of the router answer byte for byte as the full app does."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from optional_deps import require_serving

require_serving()

from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import build_app
from experiments.lib.frontend_host_stub import MODEL, InstantHost

_VARYING = re.compile(rb'(chat)?cmpl-[0-9A-Za-z]+|"created":\s?\d+')


def _scope(method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
           root_path: str = "") -> dict:
    if headers is None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": root_path,
            "headers": [(b"host", b"127.0.0.1"), *headers], "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000)}


async def _call(app, scope: dict, body: bytes, disconnect: str = "") -> tuple[list, str | None]:
    """Every message the app sends (ids and timestamps masked) and the exception it raised, if any."""
    sent: list = []
    delivered = False

    async def receive():
        nonlocal delivered
        if disconnect == "before" or (disconnect == "after" and delivered):
            return {"type": "http.disconnect"}
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    async def send(message):
        message = dict(message)
        if "body" in message:
            message["body"] = _VARYING.sub(b"<varies>", message["body"])
        sent.append(message)

    try:
        await asyncio.wait_for(app(scope, receive, send), 10)
    except Exception as exc:  # noqa: BLE001 (compared: the full app re-raises an unhandled one too)
        return sent, f"{type(exc).__name__}: {exc}"
    return sent, None


def _completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, **fields}).encode()


CASES = {
    "stream": ("/v1/completions", _completion(stream=True, stream_options={"include_usage": True}), {}),
    "whole": ("/v1/completions", _completion(), {}),
    "n_and_logprobs_refused": ("/v1/completions", _completion(n=2, logprobs=1000), {}),
    "not_json": ("/v1/completions", b"{not json", {}),
    "bad_field": ("/v1/completions", _completion(max_tokens=-1), {}),
    "wrong_type": ("/v1/completions", _completion(temperature="hot"), {}),
    "unknown_model": ("/v1/completions", _completion(model="nope"), {}),
    "too_long": ("/v1/completions", _completion(prompt=[1] * 70000), {}),
    "bad_token_id": ("/v1/completions", _completion(prompt=[1, 10**9]), {}),
    "text_without_tokenizer": ("/v1/completions", _completion(prompt="hello"), {}),
    "chat": ("/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": 2, "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]}).encode(), {}),
    "chat_bad_messages": ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), {}),
    "declared_too_large": ("/v1/completions", b"{}", {"headers": [(b"content-length", b"99999999999")]}),
    "chunked_too_large": ("/v1/completions", b" " * (5 << 20), {"headers": [(b"transfer-encoding", b"chunked")]}),
    "disconnect_before_the_body": ("/v1/completions", _completion(), {"disconnect": "before"}),
    "disconnect_while_streaming": ("/v1/completions", _completion(stream=True, max_tokens=50), {"disconnect": "after"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_route_ahead_answers_as_the_full_app(name):
    path, body, options = CASES[name]
    app = build_app(AsyncLLMEngine(InstantHost(tokens=3)), MODEL)

    async def both():
        scope = lambda: _scope("POST", path, body, options.get("headers"))
        ahead = await _call(app, scope(), body, options.get("disconnect", ""))
        full = await _call(app.through_router, scope(), body, options.get("disconnect", ""))
        return ahead, full

    ahead, full = asyncio.run(both())
    assert ahead == full
    assert ahead[0], "the case sent nothing: it compares no response"


def test_the_api_key_is_checked_ahead_as_in_the_full_app():
    app = build_app(AsyncLLMEngine(InstantHost(tokens=3)), MODEL, api_keys=["secret"])
    body = _completion()
    cases = [None, b"Bearer wrong", b"Bearer secret"]

    async def run():
        out = []
        for key in cases:
            headers = [(b"content-length", str(len(body)).encode())] + ([(b"authorization", key)] if key else [])
            out.append((await _call(app, _scope("POST", "/v1/completions", body, headers), body),
                        await _call(app.through_router, _scope("POST", "/v1/completions", body, headers), body)))
        return out

    results = asyncio.run(run())
    assert [ahead == full for ahead, full in results] == [True] * 3
    assert [ahead[0][0]["status"] for ahead, _ in results] == [401, 401, 200]


def test_only_the_two_generation_routes_skip_the_full_app():
    app = build_app(AsyncLLMEngine(InstantHost(tokens=3)), MODEL)
    body = _completion()
    reached: list[str] = []

    async def run():
        await _call(app, _scope("GET", "/health", b""), b"")  # builds the full app's stack
        inner = app.middleware_stack

        async def recorder(scope, receive, send):
            reached.append(f"{scope['method']} {scope['path']}")
            await inner(scope, receive, send)

        app.middleware_stack = recorder
        statuses = {}
        for method, path, root in [("POST", "/v1/completions", ""), ("POST", "/v1/chat/completions", ""),
                                   ("GET", "/v1/models", ""), ("GET", "/v1/completions", ""),
                                   ("POST", "/v1/completions/", ""), ("POST", "/api/v1/completions", "/api"),
                                   ("GET", "/metrics", "")]:
            sent, _ = await _call(app, _scope(method, path, body, root_path=root), body)
            statuses[f"{method} {path}"] = sent[0]["status"]
        return statuses

    statuses = asyncio.run(run())
    assert reached == ["GET /v1/models", "GET /v1/completions", "POST /v1/completions/",
                       "POST /api/v1/completions", "GET /metrics"]
    assert statuses["GET /v1/completions"] == 405 and statuses["GET /v1/models"] == 200
