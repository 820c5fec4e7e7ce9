"""One request's stream of outputs between `AsyncLLMEngine`'s loop and its consumer.

The loop puts at most one output per step; a consumer slower than the engine gets them merged, not
queued without bound: the newest cumulative output replaces an unread one, and unread deltas are
concatenated (text, token ids and logprobs per sample), as vLLM's output collector does.
"""
from __future__ import annotations

import asyncio

from engine.offline.outputs import CompletionOutput, RequestOutput


class RequestStream:
    __slots__ = ("_error", "_pending", "_ready", "delta", "request_id", "started")

    def __init__(self, request_id: str, delta: bool) -> None:
        self.request_id = request_id
        self.delta = delta
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.started = False  # an output was put

    def put(self, output: RequestOutput) -> None:
        self.started = True
        pending = self._pending
        self._pending = output if pending is None or not self.delta else _merge_deltas(pending, output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (raised after any output not read yet)."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        while True:
            if self._pending is not None:
                output, self._pending = self._pending, None
                return output
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()


def _merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`old` (not handed out yet) followed by `new`, as one delta."""
    by_index: dict[int, CompletionOutput] = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            old.outputs.append(c)
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    old.outputs.sort(key=lambda c: c.index)
    old.finished, old.metrics = new.finished, new.metrics
    return old
