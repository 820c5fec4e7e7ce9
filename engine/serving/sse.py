"""Server-sent events as OpenAI streams them: `data: <json>` blocks, then `data: [DONE]`."""
from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def frame(json_text: str) -> str:
    return f"data: {json_text}\n\n"


def event(body: dict[str, Any]) -> str:
    return frame(json.dumps(body, separators=(",", ":")))
