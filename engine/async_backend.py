"""What `AsyncLLMEngine` drives: an engine backend, and the typed hand-offs between the two.

`AsyncLLMEngine` owns the requests' streams, the waiting cap, aborts and the death of the loop; a
backend owns where the engine runs and how requests reach it:
- `ThreadBackend` (engine/thread_backend.py): an `LLMEngine` stepped in a worker thread of this
  process, one `submit` per step;
- `CoreBackend` (engine/core_backend.py): the engine in a child process that steps by itself
  (engine/engine_core.py); `submit` only sends.
Both hand every step's results to the same sink on the event loop, as `StepResult`s, and the loop's
death (or the core process's) as the exception that caused it.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.engine_stats import EngineStats, RequestStats, StatsTracker
from engine.outputs import RequestOutput
from policies.request import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A checked request on its way from `generate()` to the engine's scheduler."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    tenant: str | None
    arrival: float  # time.monotonic() when generate() was called


@dataclass(slots=True)
class StepResult:
    """What one step (or one batch of the core's) gave back."""

    errors: dict[str, ValueError]  # request id -> why the engine refused it (it fails alone)
    outputs: list[tuple[RequestOutput, RequestStats | None]]  # each with its RequestStats if it ended


def hand_over(engine: Any, tracker: StatsTracker, new: list[NewRequest], aborts: set[str],
              errors: dict[str, ValueError]) -> None:
    """Add `new` to the LLMEngine and abort `aborts`, in the thread that steps it; a request the
    engine refuses goes into `errors` (a plain ValueError, which pickles) and fails alone."""
    for r in new:
        try:
            engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority, tenant=r.tenant)
        except ValueError as exc:
            errors[r.request_id] = ValueError(str(exc))
            continue
        tracker.arrived(r.request_id, r.arrival, r.params.output_kind == "delta")
    for request_id in aborts:
        engine.abort_request(request_id)


ResultSink = Callable[[StepResult | BaseException], None]  # called on the event loop


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """The facts about the served model a front end checks requests against."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the model's tokenizer, or None (dummy weights: token-id prompts only)


class EngineBackend(ABC):
    """Where the engine runs. Every method is called on the event loop that `bind` named last."""

    info: ModelInfo

    @abstractmethod
    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        """From now on, hand results to `sink` on `loop` (called again when the engine moves to
        another event loop)."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while `submit` must be called again even with nothing new (an engine stepped by the
        caller with requests unfinished); False for an engine that steps by itself."""

    @abstractmethod
    async def submit(self, new: list[NewRequest], aborts: set[str]) -> None:
        """Hand over the requests and aborts that came in since the last call (and, for an engine
        stepped by the caller, run one step). Raising means the engine is dead."""

    @abstractmethod
    def num_waiting(self) -> int:
        """Requests handed over and not yet running: the waiting cap counts these."""

    @abstractmethod
    def stats(self, num_pending: int) -> EngineStats:
        """Counts as of the last step; `num_pending` requests not yet handed over count as waiting."""

    @abstractmethod
    def health_problem(self) -> str | None:
        """Why the engine cannot serve (its process exited), or None."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop what this backend started (worker thread, core process, the engine's workers)."""
