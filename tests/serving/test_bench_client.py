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

    def __init__(self) -> None:
        self.clients: list[tuple] = []

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
        await asyncio.sleep(PAUSE_S)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_requests_one_after_another_share_one_connection():
    import aiohttp

    from experiments.lib.serving_client import _one, _Timing

    app = SlowEndSSE()
    with ServerThread(app) as server:
        async def main() -> list[_Timing]:
            timings = []
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    timing = _Timing(arrival=0.0)
                    await _one(session, server.url, {"model": "m", "prompt": [1, 2, 3], "stream": True},
                               0.0, timing, [])
                    timings.append(timing)
            return timings

        timings = asyncio.run(main())
    assert len(app.clients) == 3 and len(set(app.clients)) == 1  # one connection, kept alive
    for t in timings:
        assert t.error is None and t.num_chunks == 2 and t.usage_tokens == 2 and t.finish_reason == "length"
        # The request ends at [DONE], not when the body's end is read after it.
        assert 0 < t.first_token <= t.finish < t.first_token + PAUSE_S / 2
