"""`CoreBackend`: the engine in a child process (engine/engine_core.py) that steps by itself.

`submit` only sends each batch of new requests and aborts to the core; a reader thread takes the
core's messages off its pipe and hands them to the event loop, where they become `StepResult`s for
the sink. The core process dying (or failing) is the loop dying.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
from concurrent.futures import ThreadPoolExecutor

from engine.async_backend import EngineBackend, ModelInfo, NewRequest, ResultSink, StepResult
from engine.engine_core import CoreStep, EngineCoreClient
from engine.engine_stats import EngineStats


class CoreBackend(EngineBackend):
    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client
        i = client.info
        self.info = ModelInfo(i.model_name, i.max_model_len, i.vocab_size, client.tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-core-send")
        self._core_stats = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0)  # the core's, as of its last message
        self._sent = 0  # requests sent to the core and not yet taken by it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: ResultSink | None = None
        self._closed = False
        client.start_reader(self._from_core)
        gc.collect()  # as LLMEngine does in its process: what start-up made is never walked again
        gc.freeze()

    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        self._loop, self._sink = loop, sink

    def has_work(self) -> bool:
        return False  # the core steps by itself

    async def submit(self, new: list[NewRequest], aborts: set[str]) -> None:
        self._sent += len(new)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.client.send, new, aborts)

    def _from_core(self, message: CoreStep | BaseException) -> None:
        """On the reader thread: hand the message to the event loop the engine serves."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_core, message)
        except RuntimeError:  # that loop closed meanwhile: nobody reads its streams
            pass

    def _on_core(self, message: CoreStep | BaseException) -> None:
        if isinstance(message, BaseException):
            if not self._closed:
                self._sink(message)
            return
        self._sent -= message.num_taken
        self._core_stats = message.stats
        self._sink(StepResult(message.errors, list(self.client.outputs(message))))

    def num_waiting(self) -> int:
        return self._core_stats.num_waiting + self._sent

    def stats(self, num_pending: int) -> EngineStats:
        s = self._core_stats
        return dataclasses.replace(s, num_waiting=s.num_waiting + self._sent + num_pending)

    def health_problem(self) -> str | None:
        if self.client.alive:
            return None
        return f"the engine process exited (exit code {self.client.process.exitcode})"

    async def shutdown(self) -> None:
        self._closed = True
        await asyncio.to_thread(self._executor.shutdown, True)
        await asyncio.to_thread(self.client.shutdown)
