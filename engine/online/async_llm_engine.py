"""`AsyncLLMEngine`: the online face of `LLMEngine`, for servers (vLLM's name and shape).

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=...), max_waiting_requests=256)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(output.outputs[0].text)          # cumulative; output_kind="delta" streams the new part

From the first request on, the engine serves the caller's event loop: `generate` checks a request
and hands it to the engine's host (engine/online/host.py), which hands each step's outputs
back to their requests' streams. The host is an `LLMEngine` stepped in one worker thread by a
task that sleeps when idle (engine/online/thread_host.py: the event loop stays free to stream, and new
requests join the scheduler between steps, as vLLM's do), or the engine in its own process, sent
each request at once (engine/online/process_host.py). Streams, aborts, errors and backpressure are one
code path for both.

- A consumer that stops iterating (`break`, `aclose()`, cancellation: a client that went away)
  aborts its request; the abort reaches the scheduler before the next step, which frees its blocks.
- A bad request fails alone: `generate` raises the ValueError `SamplingParams` / `add_request` raise
  (naming the field) and the loop goes on. If the loop itself dies, every open stream raises
  `EngineDeadError`, `errored` turns true, `check_health` raises, and new requests are refused.
- Backpressure: with `max_waiting_requests`, a request arriving while that many wait (in the
  scheduler's waiting queue or on their way to it) is refused at once with `EngineQueueFullError`.
- `stats()` is a typed snapshot for metrics; `add_finished_observer(fn)` gets one `RequestStats`
  (TTFT, inter-token latencies, e2e) per request that ends, on the event loop.

`from_engine_args(args, engine_process=True)` runs the engine in a child process instead
(engine/online/engine_core.py): the front end's per-chunk work then no longer shares the interpreter
lock with the thread that steps the model, the core process dying is the loop dying, and `engine`
(the LLMEngine) is None. `shutdown()` stops what the engine started: the worker thread, the core
process, and an engine built by `from_engine_args` (its tensor-parallel workers included).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.engine_args import EngineArgs
from engine.offline.llm import parse_prompt
from engine.offline.llm_engine import LLMEngine
from engine.offline.outputs import RequestFailedError, RequestOutput, short_error
from engine.online.async_stream import RequestStream
from engine.online.engine_core import EngineCoreClient
from engine.online.engine_stats import EngineStats, RequestStats
from engine.online.host import EngineHost, NewRequest, StepResult
from engine.online.process_host import ProcessHost
from engine.online.thread_host import ThreadHost
from policies.request import SamplingParams

Prompt = str | list[int] | dict[str, Any]
_log = logging.getLogger(__name__)


class EngineQueueFullError(RuntimeError):
    """Too many requests wait already (`max_waiting_requests`): retry later (HTTP 503)."""


def check_max_waiting_requests(value: object) -> None:
    """None (no cap) or an integer >= 1; ValueError naming the field otherwise."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_waiting_requests={value!r} is invalid: None (no cap) or an integer >= 1")


class EngineDeadError(RuntimeError):
    """The engine's loop died; the engine serves nothing more (its cause is `__cause__`)."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | EngineCoreClient | EngineHost, *,
                 max_waiting_requests: int | None = None, keep_trace: bool = False) -> None:
        """`engine`: an LLMEngine stepped in a worker thread of this process (the caller keeps it:
        `shutdown` leaves it open), an EngineCoreClient (a core process;
        `from_engine_args(..., engine_process=True)` makes one), or a host. `keep_trace`: keep
        the engine's trace (`engine.recorder`: a row per step and per request, for a study of the
        served run); by default its rows are dropped once counted, so a server's memory stays
        bounded."""
        check_max_waiting_requests(max_waiting_requests)
        if isinstance(engine, EngineCoreClient):
            engine = ProcessHost(engine)
        elif not isinstance(engine, EngineHost):
            engine = ThreadHost(engine, keep_trace)
        self._host = engine
        self.engine: LLMEngine | None = engine.engine if isinstance(engine, ThreadHost) else None
        self._core: EngineCoreClient | None = engine.client if isinstance(engine, ProcessHost) else None
        self.max_waiting_requests = max_waiting_requests
        self.dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the engine serves
        self._observers: list[Callable[[RequestStats], None]] = []
        self._closed = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, max_waiting_requests: int | None = None,
                         keep_trace: bool = False, engine_process: bool = False) -> AsyncLLMEngine:
        """`engine_process=True`: the engine in a child process (returns once it is built). Either
        way the engine is this AsyncLLMEngine's: `shutdown` closes it."""
        host = ProcessHost(EngineCoreClient(args, keep_trace)) if engine_process else \
            ThreadHost(LLMEngine(args), keep_trace, close_engine=True)
        return cls(host, max_waiting_requests=max_waiting_requests, keep_trace=keep_trace)

    # ---- what a server asks ---------------------------------------------------------------------
    @property
    def engine_process(self) -> bool:
        return self._core is not None

    @property
    def tokenizer(self):
        """The model's tokenizer, or None (dummy weights: token-id prompts only)."""
        return self._host.info.tokenizer

    @property
    def model_name(self) -> str:
        return self._host.info.model_name

    @property
    def max_model_len(self) -> int:
        return self._host.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._host.info.vocab_size

    @property
    def max_logprobs(self) -> int:
        """The most top logprobs a request may ask for (EngineArgs.max_logprobs, capped at the vocabulary)."""
        return self._host.info.max_logprobs

    @property
    def is_running(self) -> bool:
        """The engine serves an event loop (from the first request on) and has not died."""
        return self._loop is not None and self.dead_error is None and self._host.is_running

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {short_error(self.dead_error)}") from self.dead_error
        problem = self._host.health_problem()
        if problem is not None:
            raise EngineDeadError(problem)

    def stats(self) -> EngineStats:
        """Counts as of the last step (engine/online/engine_stats.py)."""
        return self._host.stats()

    def replica_status(self) -> list | None:
        """Each data-parallel replica's state (engine/online/replica_set.py), or None for one engine."""
        return self._host.replica_status()

    def health_detail(self) -> dict[str, Any] | None:
        """What /health shows beside its status (each replica's state), or None."""
        return self._host.health_detail()

    def add_finished_observer(self, observer: Callable[[RequestStats], None]) -> None:
        """Call `observer(RequestStats)` on the event loop for every request that ends."""
        self._observers.append(observer)

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, output_kind: str = "cumulative",
                       tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until its final one (`finished`). Raises ValueError for a bad
        request (naming the field), EngineQueueFullError past the waiting cap, EngineDeadError when
        the loop is dead. Leaving the iteration early aborts the request."""
        stream = self._open(prompt, sampling_params, request_id, priority, output_kind, tenant)
        finished = False
        try:
            while True:
                output = await stream.get()
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                if not finished:
                    self._abort_soon(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final output whose finish_reason is "abort:user".
        Unknown or ended ids are ignored."""
        if request_id in self._streams:
            self._abort_soon(request_id)

    def _open(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int,
              output_kind: str, tenant: str | None = None) -> RequestStream:
        """Check what can be checked at once, then hand the request to the host."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {short_error(self.dead_error)}") from self.dead_error
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} is invalid: must be a non-empty string")
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is invalid: a request with this id is running")
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"sampling_params={params!r:.80} is invalid: must be a SamplingParams")
        if output_kind not in ("cumulative", "delta"):
            raise ValueError(f"output_kind={output_kind!r} is invalid: must be cumulative or delta")
        params.validate()
        if params.output_kind != output_kind:
            params = dataclasses.replace(params, output_kind=output_kind)
        prompt = parse_prompt(prompt, "prompt")
        self._start()
        cap = self.max_waiting_requests
        if cap is not None and self._host.num_waiting() >= cap:
            raise EngineQueueFullError(f"the server is at capacity: {cap} requests are waiting "
                                       "(max_waiting_requests); retry later")
        stream = RequestStream(request_id, delta=output_kind == "delta")
        self._streams[request_id] = stream
        self._host.add(NewRequest(request_id, prompt, params, priority, tenant, time.monotonic()))
        return stream

    def _abort_soon(self, request_id: str) -> None:
        if self.dead_error is None and not self._closed:
            self._host.abort(request_id)

    # ---- serving an event loop -----------------------------------------------------------------
    def _start(self) -> None:
        """Serve the running event loop, or move there if the loop served before ended without
        `shutdown` (e.g. one `asyncio.run` after another): that loop's requests are aborted, since
        nobody can read their streams any more."""
        loop = asyncio.get_running_loop()
        if loop is self._loop and self._host.is_running:
            return
        orphans = list(self._streams)
        self._streams.clear()
        self._loop = loop
        self._host.bind(loop, self._on_result)
        for request_id in orphans:
            self._host.abort(request_id)

    def _on_result(self, result: StepResult | BaseException) -> None:
        """The host's results, on the event loop: each output to its stream, or the engine's death."""
        if isinstance(result, BaseException):
            self._die(result)
            return
        for request_id, error in result.errors.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)
        # First outputs go first: their consumers (clients waiting for a first token) then run
        # before those of the streams already going, in the loop iteration that follows.
        later = []
        for item in result.outputs:
            stream = self._streams.get(item[0].request_id)
            if stream is not None and stream.started:
                later.append(item)
            else:
                self._deliver(*item)
        for item in later:
            self._deliver(*item)

    def _deliver(self, output: RequestOutput, record: RequestStats | None) -> None:
        if record is not None:
            for observer in self._observers:
                try:
                    observer(record)
                except Exception:  # noqa: BLE001 (a metrics bug must not stop serving: logged with its traceback)
                    _log.exception("finished-request observer %r failed on %s", observer, record.request_id)
        if output.error is not None:  # the engine failed this request alone: its stream raises why
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.fail(RequestFailedError(f"the engine failed on this request: {output.error}"))
            return
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        _log.error("the engine loop died", exc_info=error)
        dead = EngineDeadError(f"the engine loop died: {short_error(error)}")
        dead.__cause__ = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(dead)

    def end_streams(self, reason: str = "the engine is shut down") -> None:
        """Refuse new requests, end every open stream with EngineDeadError(reason) and abort its
        request: a server going away (SIGTERM, Ctrl-C) ends its responses cleanly and at once."""
        self._closed = True
        streams, self._streams = self._streams, {}
        alive = self.dead_error is None and self._host.is_running
        for request_id, stream in streams.items():
            stream.fail(EngineDeadError(reason))
            if alive:
                self._host.abort(request_id)

    async def shutdown(self) -> None:
        """Stop serving (open streams get EngineDeadError) and what the engine started: the worker
        thread, the core process, an engine built by `from_engine_args`."""
        self.end_streams()
        await self._host.shutdown()
