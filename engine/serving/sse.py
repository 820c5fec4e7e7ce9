"""Server-sent events as OpenAI streams them: `data: <json>` blocks, then `data: [DONE]`.

`SSEResponse` streams them without the task that starlette's `StreamingResponse` starts per response
to listen for the client's disconnect (an anyio task group per request, on the path to the first
token): the request's `Generation` watches the client already and aborts its engine requests,
which ends the stream within a step.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(json_text: str) -> str:
    return f"data: {json_text}\n\n"


def event(body: dict[str, Any]) -> str:
    return frame(json.dumps(body, separators=(",", ":")))


class SSEResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
