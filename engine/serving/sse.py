"""Server-sent events as OpenAI streams them: `data: <json>` blocks, then `data: [DONE]`.

`SSEResponse` streams them without the task that starlette's `StreamingResponse` starts per response
to listen for the client's disconnect (an anyio task group per request, on the path to the first
token): the request's `Generation` watches the client already and aborts its engine requests,
which ends the stream within a step. Its headers, the same for every stream, are built once.
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


def _raw_headers() -> list[tuple[bytes, bytes]]:
    """A stream's headers, by starlette's own rule (`init_headers`: lower-cased, latin-1, the content
    type with its charset): the same for every stream, so built once."""
    template = StreamingResponse.__new__(StreamingResponse)
    template.media_type = "text/event-stream"
    template.init_headers(HEADERS)
    return template.raw_headers


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"
    _RAW_HEADERS = _raw_headers()

    def __init__(self, events: AsyncIterator[str]) -> None:
        # StreamingResponse.__init__ less its header building (~5 us a response, on the way of
        # every first token): each response gets its own copy, which middleware may add to.
        self.body_iterator = events
        self.status_code = 200
        self.background = None
        self.raw_headers = self._RAW_HEADERS.copy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
