"""`ThreadBackend`: an `LLMEngine` stepped in one worker thread of the server's process.

Each `submit` runs `add_request` / `abort_request` / `step()` in the worker thread (so the event loop
stays free to stream) and hands the step's outputs to the sink. The engine is only ever touched
from that thread, so new requests join the scheduler between steps, as vLLM's do.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.async_backend import EngineBackend, ModelInfo, NewRequest, ResultSink, StepResult, hand_over
from engine.engine_stats import EngineStats, StatsTracker
from engine.llm_engine import LLMEngine


class ThreadBackend(EngineBackend):
    def __init__(self, engine: LLMEngine, keep_trace: bool = False, close_engine: bool = False) -> None:
        """`close_engine`: `shutdown` closes the engine too (its model, KV cache and tensor-parallel
        workers), for an engine the caller does not keep."""
        self.engine = engine
        self.close_engine = close_engine
        self.info = ModelInfo(engine.model_config.name, engine.max_model_len, engine.vocab_size, engine.tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-engine",
                                            initializer=_use_device, initargs=(getattr(engine.runner, "device", None),))
        self._tracker = StatsTracker(engine, keep_trace)
        self._sink: ResultSink | None = None
        self._admitting = 0  # requests handed to the step in progress

    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        self._sink = sink

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    async def submit(self, new: list[NewRequest], aborts: set[str]) -> None:
        self._admitting = len(new)
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, self._step, new, aborts)
        finally:
            self._admitting = 0
        self._sink(result)

    def _step(self, new: list[NewRequest], aborts: set[str]) -> StepResult:
        """In the worker thread: admit, abort, step once."""
        engine, tracker, errors = self.engine, self._tracker, {}
        hand_over(engine, tracker, new, aborts, errors)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        tracker.stepped(outputs)
        return StepResult(errors, [(o, tracker.finished(o) if o.finished else None) for o in outputs])

    def num_waiting(self) -> int:
        return self._tracker.num_waiting + self._admitting

    def stats(self, num_pending: int) -> EngineStats:
        return self._tracker.snapshot(num_pending=num_pending + self._admitting)

    def health_problem(self) -> str | None:
        return None

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._executor.shutdown, True)
        if self.close_engine:
            self.engine.close()


def _use_device(device) -> None:
    """The worker thread's current CUDA device is the engine's (a thread starts on device 0, and
    graph replays and streams follow the current device)."""
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.set_device(device)
