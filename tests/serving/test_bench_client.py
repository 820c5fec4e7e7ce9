"""The serving benchmark's client (experiments/lib/serving_client.py) as a client of any server: one
keep-alive connection for requests sent one after another, as OpenAI's client keeps it."""
from __future__ import annotations

import asyncio
import json

import pytest
from optional_deps import require_serving

require_serving()
pytest.importorskip("aiohttp")

from engine.serving.server import ServerThread

PAUSE_S = 0.2  # between `data: [DONE]` and the end of the chunked body


class SlowEndSSE:
    """An OpenAI-shaped stream (two chunks with a choice, usage, [DONE]) whose body ends PAUSE_S
    after [DONE], as a server's last write may reach the client after the event; it notes the
    client address of every request."""

    def __init__(self, pause_s: float = PAUSE_S) -> None:
        self.clients: list[tuple] = []
        self.pause_s = pause_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.clients.append(tuple(scope["client"]))
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for reason in (None, "length"):
            chunk = {"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": reason}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
        usage = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode(),
                    "more_body": True})
        await asyncio.sleep(self.pause_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _three_requests(app: SlowEndSSE) -> tuple[list, float]:
    """Three requests one after another on one session: their timings and the seconds they took."""
    import time

    import aiohttp

    from experiments.lib.serving_client import _one, _Timing

    with ServerThread(app) as server:
        async def main() -> tuple[list[_Timing], float]:
            timings, t0 = [], time.perf_counter()
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    timing = _Timing(arrival=0.0)
                    await _one(session, server.url, {"model": "m", "prompt": [1, 2, 3], "stream": True},
                               0.0, timing, [])
                    timings.append(timing)
            return timings, time.perf_counter() - t0

        return asyncio.run(main())


def test_requests_one_after_another_share_one_connection():
    app = SlowEndSSE()
    timings, _ = _three_requests(app)
    assert len(app.clients) == 3 and len(set(app.clients)) == 1  # one connection, kept alive
    for t in timings:
        assert t.error is None and t.num_chunks == 2 and t.usage_tokens == 2 and t.finish_reason == "length"
        # The request ends at [DONE], not when the body's end is read after it.
        assert 0 < t.first_token <= t.finish < t.first_token + PAUSE_S / 2


def test_a_body_held_open_after_done_is_waited_for_a_bounded_time(monkeypatch):
    """A server that keeps the body open after [DONE]: each request still ends at [DONE], the client
    waits DRAIN_S for the rest, then drops the connection and the next request gets a new one."""
    from experiments.lib import serving_client

    monkeypatch.setattr(serving_client, "DRAIN_S", 0.05)
    app = SlowEndSSE(pause_s=3.0)
    timings, seconds = _three_requests(app)
    assert seconds < 2.0  # never the server's 3 s per request
    assert len(set(app.clients)) == 3
    assert all(t.error is None and t.num_chunks == 2 and t.usage_tokens == 2 for t in timings)
