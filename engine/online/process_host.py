"""`ProcessHost`: the engine in a child process (engine/online/engine_core.py) that steps by itself
(or in a Ray actor, engine/online/ray_launcher.py: a client with the same face).

Each request and abort goes to the core the moment it is handed over, written to its pipe from the
event loop (engine/online/core_channel.py: never blocking it); the core's messages are read on the event
loop when its pipe turns readable and become `StepResult`s for the sink. No thread stands in
between, so neither direction waits for another thread to be scheduled or to get the interpreter
lock. The core process failing or exiting is the engine dying.

First outputs go first: a message's first outputs (of requests with none read yet) are handed
over at once, and the others, with those of any message read in the same loop turn, one turn
later (`loop.call_soon`, so after the tasks the first outputs woke), in the order they came; the
core sends a step's first outputs in a message of their own ahead of the others
(engine/online/engine_core.py). A first token then waits for its own output's packing,
rebuilding and delivery, not for every running stream's (~3.5 us a stream on the CPU: about 0.9
ms behind 256).
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging

from engine.online.engine_core import CoreFailed, CoreStep, EngineCoreClient
from engine.online.engine_stats import EngineStats
from engine.online.host import EngineHost, ModelInfo, NewRequest, ResultSink, StepResult
from engine.online.output_wire import OutputReader

_log = logging.getLogger(__name__)


class ProcessHost(EngineHost):
    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client
        i = client.info
        self.info = ModelInfo(i.model_name, i.max_model_len, i.vocab_size, client.tokenizer, i.max_logprobs)
        self._core_stats = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0)  # the core's, as of its last message
        self._sent = 0  # requests sent to the core and not yet taken by it
        self._reader = OutputReader()  # the core's outputs, with the prompts they were sent with
        # Outputs held back behind first outputs until the loop's next turn, with their steps'
        # records; None: no first output was handed over in this turn.
        self._later: list[tuple[list, list]] | None = None
        self._later_handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: ResultSink | None = None
        self._failure: str | None = None  # the core's own account of its failure
        self._ended = False  # the core's end is reported (or this host shut down)
        self._exit_report: asyncio.Future | None = None
        gc.collect()  # as LLMEngine does in its process: what start-up made is never walked again
        gc.freeze()

    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        self._deliver_later()
        self._loop, self._sink = loop, sink
        self.client.channel.attach(loop, self._on_message, self._on_closed)

    @property
    def is_running(self) -> bool:
        return self._sink is not None and not self._ended

    def add(self, request: NewRequest) -> None:
        self._sent += 1
        self._reader.sent(request.request_id, request.prompt)
        self._send(([request], ()))

    def abort(self, request_id: str) -> None:
        self._send(([], (request_id,)))

    def _send(self, batch: tuple) -> None:
        try:
            self.client.channel.send(batch)
        except OSError as exc:  # the core's end closed: it is gone
            self._end(exc)

    def _on_message(self, message: CoreStep | CoreFailed) -> None:
        if isinstance(message, CoreFailed):
            self._deliver_later()
            _log.error("the engine process failed:\n%s", message.traceback)
            self._failure = message.error
            return
        self._sent -= message.num_taken
        self._core_stats = message.stats
        if message.errors:
            self._reader.refused(message.errors)
        reader, outputs, finished = self._reader, message.outputs, message.finished
        first, running = reader.split_first(outputs) if outputs else (outputs, outputs)
        if self._later is None and not first:  # no first output handed over this loop turn: all at once
            self._sink(StepResult(message.errors, list(reader.read(outputs, finished)), message.report))
            return
        self._sink(StepResult(message.errors, list(reader.read(first, finished)), message.report))
        if self._later is None:
            self._later = []
            self._later_handle = self._loop.call_soon(self._deliver_later)
        if running:
            self._later.append((running, finished))

    def _deliver_later(self) -> None:
        """Hand over the outputs held back behind first outputs, if any wait (in the order they came)."""
        later, self._later = self._later, None
        if later is None:
            return
        self._later_handle.cancel()
        if later:
            reader = self._reader
            self._sink(StepResult({}, [item for outputs, finished in later for item in reader.read(outputs, finished)]))

    def _on_closed(self) -> None:
        """The core's pipe ended: report how the core ended once it has (its exit code)."""
        if not self._ended:
            self._exit_report = asyncio.ensure_future(self._report_exit())

    async def _report_exit(self) -> None:
        reason = await asyncio.to_thread(self.client.exit_reason, 5.0)
        self._end(RuntimeError(self._failure or reason))

    def _end(self, error: BaseException) -> None:
        if not self._ended:
            self._deliver_later()
            self._ended = True
            self._sink(error)

    def num_waiting(self) -> int:
        return self._core_stats.num_waiting + self._sent

    def stats(self) -> EngineStats:
        s = self._core_stats
        return dataclasses.replace(s, num_waiting=s.num_waiting + self._sent)

    def health_problem(self) -> str | None:
        if self.client.alive:
            return None
        return self.client.exit_reason(0.0)

    async def shutdown(self) -> None:
        await self._stop(10.0)

    async def terminate(self) -> None:
        """No stop message waited on: the core is terminated, then killed (within 10 s)."""
        await self._stop(0.0)

    async def _stop(self, timeout_s: float) -> None:
        self._ended = True
        self.client.channel.detach(close=True)  # here, on the loop that reads it
        await asyncio.to_thread(self.client.shutdown, timeout_s)
