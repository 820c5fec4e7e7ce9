"""`SSEResponse` (engine/serving/sse.py) builds its headers once: each stream's response is what
starlette's `StreamingResponse` would be with the same content type and headers, with a header list
of its own (middleware may add to it)."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from starlette.responses import StreamingResponse

from engine.serving.sse import HEADERS, SSEResponse


async def _events():
    yield "data: [DONE]\n\n"


def test_the_response_is_starlettes_own_with_a_header_list_of_its_own():
    events = _events()
    ours, theirs = SSEResponse(events), StreamingResponse(events, media_type="text/event-stream", headers=HEADERS)
    for name in ("body_iterator", "status_code", "media_type", "background", "charset", "raw_headers"):
        assert getattr(ours, name) == getattr(theirs, name), name
    other = SSEResponse(_events())
    other.headers["x-added"] = "1"
    assert ours.raw_headers == theirs.raw_headers and other.raw_headers != ours.raw_headers
