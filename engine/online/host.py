"""What `AsyncLLMEngine` drives: an engine host, and the typed hand-offs between the two.

`AsyncLLMEngine` owns the requests' streams, the waiting cap, aborts and the death of the loop; a
host owns where the engine runs and how requests reach it:
- `ThreadHost` (engine/online/thread_host.py): an `LLMEngine` stepped in a worker thread of this
  process by a task on the event loop, which takes what was handed over between steps;
- `ProcessHost` (engine/online/process_host.py): the engine in a child process that steps by itself
  (engine/online/engine_core.py); each request and abort is sent to it at once.
Both hand every step's results to the same sink on the event loop, as `StepResult`s, and the loop's
death (or the core process's) as the exception that caused it.
"""
from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.offline.outputs import RequestFailedError, RequestOutput, short_error
from engine.online.engine_stats import EngineStats, RequestStats, StatsTracker
from policies.request import SamplingParams
from policies.routing.replica_report import ReplicaReport

_log = logging.getLogger(__name__)


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

    errors: dict[str, Exception]  # request id -> why the engine refused it (it fails alone)
    outputs: list[tuple[RequestOutput, RequestStats | None]]  # each with its RequestStats if it ended
    report: ReplicaReport | None = None  # the scheduler's state after the step (a core process's)


def hand_over(engine: Any, tracker: StatsTracker, new: list[NewRequest], aborts: set[str],
              errors: dict[str, Exception]) -> None:
    """Add `new` to the LLMEngine and abort `aborts`, in the thread that steps it; a request the
    engine refuses goes into `errors` and fails alone: a plain ValueError (bad input, naming the
    field), or a RequestFailedError with a short message for any other exception (logged with
    its traceback). Both pickle."""
    for r in new:
        try:
            engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority, tenant=r.tenant)
        except ValueError as exc:
            errors[r.request_id] = ValueError(str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 (one request's failure: it alone is refused)
            _log.error("request %s could not be added", r.request_id, exc_info=exc)
            errors[r.request_id] = RequestFailedError(short_error(exc))
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
    max_logprobs: int  # the most top logprobs a request may ask for


class EngineHost(ABC):
    """Where the engine runs. Every method is called on the event loop that `bind` named last."""

    info: ModelInfo

    @abstractmethod
    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        """From now on, serve on `loop` and hand results to `sink` there (called again when the
        engine moves to another event loop)."""

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """Bound to a loop and able to take requests."""

    @abstractmethod
    def add(self, request: NewRequest) -> None:
        """Hand a checked request over (it reaches the scheduler before the engine's next step)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request handed over (its final output comes with the next step)."""

    @abstractmethod
    def num_waiting(self) -> int:
        """Requests handed over and not yet running: the waiting cap counts these."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Counts as of the last step; requests handed over and not yet admitted count as waiting."""

    @abstractmethod
    def health_problem(self) -> str | None:
        """Why the engine cannot serve (its process exited), or None."""

    def replica_status(self) -> list | None:
        """Per data-parallel replica, its `ReplicaStatus` (engine/online/replica_set.py); None: one engine."""
        return None

    def health_detail(self) -> dict[str, Any] | None:
        """What /health shows beside its status (each replica's state), or None."""
        return None

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop what this host started (worker thread, core process, the engine's workers)."""

    async def terminate(self) -> None:
        """Stop an engine that no longer answers, without asking it and waiting on it (a host of a
        core process overrides this: terminate, then kill it)."""
        await self.shutdown()
