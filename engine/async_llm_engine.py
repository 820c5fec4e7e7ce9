"""`AsyncLLMEngine`: the online face of `LLMEngine`, for servers (vLLM's name and shape).

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=...), max_waiting_requests=256)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(output.outputs[0].text)          # cumulative; output_kind="delta" streams the new part

One background task (started by the first request, on the caller's event loop) owns the engine:
while work exists it takes the new requests and aborts that came in since the last step, and runs
`add_request` / `abort_request` / `step()` in one worker thread (so the event loop stays free to
stream), then hands each output to its request's stream; with no work it waits on an event (no
busy spin). The engine is only ever touched from that thread, so new requests join the scheduler
between steps, as vLLM's do.

- A consumer that stops iterating (`break`, `aclose()`, cancellation: a client that went away)
  aborts its request; the abort reaches the scheduler before the next step, which frees its blocks.
- A bad request fails alone: `generate` raises the ValueError `SamplingParams` / `add_request` raise
  (naming the field) and the loop goes on. If the loop itself dies, every open stream raises
  `EngineDeadError`, `errored` turns true, `check_health` raises, and new requests are refused.
- Backpressure: with `max_waiting_requests`, a request arriving while that many wait (in the
  scheduler's waiting queue or on their way to it) is refused at once with `EngineQueueFullError`.
- `stats()` is a typed snapshot for metrics; `add_finished_observer(fn)` gets one `RequestStats`
  (TTFT, inter-token latencies, e2e) per request that ends, on the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine.async_stream import RequestStream
from engine.engine_args import EngineArgs
from engine.engine_stats import EngineStats, RequestStats, StatsTracker
from engine.llm import parse_prompt
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from policies.request import SamplingParams

Prompt = str | list[int] | dict[str, Any]
_log = logging.getLogger(__name__)


class EngineQueueFullError(RuntimeError):
    """Too many requests wait already (`max_waiting_requests`): retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine's loop died; the engine serves nothing more (its cause is `__cause__`)."""


@dataclasses.dataclass(slots=True)
class _NewRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    tenant: str | None
    arrival: float  # time.monotonic() when generate() was called


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 keep_trace: bool = False) -> None:
        """`keep_trace`: keep the engine's trace (`engine.recorder`: a row per step and per request,
        for a study of the served run); by default its rows are dropped once counted, so a server's
        memory stays bounded."""
        if max_waiting_requests is not None and (not isinstance(max_waiting_requests, int)
                                                 or isinstance(max_waiting_requests, bool)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests={max_waiting_requests!r} is invalid: None (no cap) "
                             "or an integer >= 1")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._new: asyncio.Queue[_NewRequest] | None = None  # made on the loop that runs the engine
        self._aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        device = getattr(engine.runner, "device", None)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-engine",
                                            initializer=_use_device, initargs=(device,))
        self._tracker = StatsTracker(engine, keep_trace)
        self._observers: list[Callable[[RequestStats], None]] = []
        self._closed = False
        self._admitting = 0  # requests taken off the queue for the step in progress

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, max_waiting_requests: int | None = None,
                         keep_trace: bool = False) -> AsyncLLMEngine:
        return cls(LLMEngine(args), max_waiting_requests=max_waiting_requests, keep_trace=keep_trace)

    # ---- what a server asks ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer, or None (dummy weights: token-id prompts only)."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_config.name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        """The background loop is alive (it starts with the first request)."""
        return self._task is not None and not self._task.done()

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}") from self.dead_error

    def stats(self) -> EngineStats:
        """Counts as of the last step (engine/engine_stats.py)."""
        pending = self._admitting + (self._new.qsize() if self._new is not None else 0)
        return self._tracker.snapshot(num_pending=pending)

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
        """Check what can be checked at once, then queue the request for the loop."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}") from self.dead_error
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
        if cap is not None and self._tracker.num_waiting + self._admitting + self._new.qsize() >= cap:
            raise EngineQueueFullError(f"the server is at capacity: {cap} requests are waiting "
                                       "(max_waiting_requests); retry later")
        stream = RequestStream(request_id, delta=output_kind == "delta")
        self._streams[request_id] = stream
        self._new.put_nowait(_NewRequest(request_id, prompt, params, priority, tenant, time.monotonic()))
        self._wake.set()
        return stream

    def _abort_soon(self, request_id: str) -> None:
        self._aborts.add(request_id)
        if self._wake is not None:
            self._wake.set()

    # ---- the loop -------------------------------------------------------------------------------
    def _start(self) -> None:
        """Start the loop on the running event loop, or start it over there if the loop it ran on
        ended without `shutdown` (e.g. one `asyncio.run` after another): that loop's requests are
        aborted, since nobody can read their streams any more."""
        loop, task = asyncio.get_running_loop(), self._task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._aborts.update(self._streams)
        self._streams.clear()
        self._new, self._wake = asyncio.Queue(), asyncio.Event()
        self._task = loop.create_task(self._run(), name="servelab-engine-loop")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._new.empty() and not self._aborts and not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                new = [self._new.get_nowait() for _ in range(self._new.qsize())]
                aborts, self._aborts = self._aborts, set()
                self._admitting = len(new)
                errors, outputs = await loop.run_in_executor(self._executor, self._step, new, aborts)
                self._admitting = 0
                for request_id, error in errors.items():
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.fail(error)
                for output in outputs:
                    self._deliver(output)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 (any death must reach every stream)
            self._die(e)

    def _step(self, new: list[_NewRequest], aborts: set[str]) -> tuple[dict[str, ValueError], list[RequestOutput]]:
        """In the worker thread: admit, abort, step once."""
        engine, errors = self.engine, {}
        for r in new:
            try:
                engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority, tenant=r.tenant)
            except ValueError as e:
                errors[r.request_id] = e
                continue
            self._tracker.arrived(r.request_id, r.arrival, r.params.output_kind == "delta")
        for request_id in aborts:
            engine.abort_request(request_id)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        self._tracker.stepped(outputs)
        return errors, outputs

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished:
            record = self._tracker.finished(output)
            for observer in self._observers:
                try:
                    observer(record)
                except Exception:  # noqa: BLE001 (a metrics bug must not stop serving: logged with its traceback)
                    _log.exception("finished-request observer %r failed on %s", observer, record.request_id)
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"the engine loop died: {error!r}")
        dead.__cause__ = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(dead)

    async def shutdown(self) -> None:
        """Stop the loop (open streams get EngineDeadError) and the worker thread."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(EngineDeadError("the engine is shut down"))
        await asyncio.to_thread(self._executor.shutdown, True)


def _use_device(device) -> None:
    """The worker thread's current CUDA device is the engine's (a thread starts on device 0, and
    graph replays and streams follow the current device)."""
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.set_device(device)
