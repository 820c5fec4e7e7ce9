"""`ThreadHost`: an `LLMEngine` stepped in one worker thread of the server's process.

A task on the event loop steps the engine while it has work: it takes the requests and aborts
handed over since the last step, runs `add_request` / `abort_request` / `step()` in the worker
thread (so the event loop stays free to stream), and hands the step's outputs to the sink; with
no work it waits on an event (no busy spin). The engine is only ever touched from that thread, so
new requests join the scheduler between steps, as vLLM's do.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.offline.llm_engine import LLMEngine
from engine.online.engine_stats import EngineStats, StatsTracker
from engine.online.host import EngineHost, ModelInfo, NewRequest, ResultSink, StepResult, hand_over


class ThreadHost(EngineHost):
    def __init__(self, engine: LLMEngine, keep_trace: bool = False, close_engine: bool = False) -> None:
        """`close_engine`: `shutdown` closes the engine too (its model, KV cache and tensor-parallel
        workers), for an engine the caller does not keep."""
        self.engine = engine
        self.close_engine = close_engine
        self.info = ModelInfo(engine.model_config.name, engine.max_model_len, engine.vocab_size, engine.tokenizer,
                              engine.max_logprobs)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-engine",
                                            initializer=_use_device, initargs=(getattr(engine.runner, "device", None),))
        self._tracker = StatsTracker(engine, keep_trace)
        self._sink: ResultSink | None = None
        self._new: list[NewRequest] = []  # handed over, for the next step
        self._aborts: set[str] = set()
        self._admitting = 0  # requests handed to the step in progress
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        self._sink, self._wake = sink, asyncio.Event()
        self._task = loop.create_task(self._run(), name="servelab-engine-loop")

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def add(self, request: NewRequest) -> None:
        self._new.append(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._aborts.add(request_id)
        self._wake.set()

    async def _run(self) -> None:
        loop, engine = asyncio.get_running_loop(), self.engine
        try:
            while True:
                if not self._new and not self._aborts and not engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                (new, self._new), (aborts, self._aborts) = (self._new, []), (self._aborts, set())
                self._admitting = len(new)
                try:
                    result = await loop.run_in_executor(self._executor, self._step, new, aborts)
                finally:
                    self._admitting = 0
                self._sink(result)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 (any death must reach every stream)
            self._sink(e)

    def _step(self, new: list[NewRequest], aborts: set[str]) -> StepResult:
        """In the worker thread: admit, abort, step once."""
        engine, tracker, errors = self.engine, self._tracker, {}
        hand_over(engine, tracker, new, aborts, errors)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        tracker.stepped(outputs)
        return StepResult(errors, [(o, tracker.finished(o) if o.finished else None) for o in outputs])

    def num_waiting(self) -> int:
        return self._tracker.num_waiting + self._admitting + len(self._new)

    def stats(self) -> EngineStats:
        return self._tracker.snapshot(num_pending=self._admitting + len(self._new))

    def health_problem(self) -> str | None:
        return None

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self._executor.shutdown, True)
        if self.close_engine:
            self.engine.close()


def _use_device(device) -> None:
    """The worker thread's current CUDA device is the engine's (a thread starts on device 0, and
    graph replays and streams follow the current device)."""
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.set_device(device)
