"""What `LLMEngine.step` and `LLM.generate` hand back (vLLM's `RequestOutput` shape).

Times are seconds on the engine clock (`time.perf_counter()` relative to engine start), the same
clock the scheduler and the trace recorder use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_ERROR_CHARS = 300  # a short error's length at most (the traceback belongs in the log)


class RequestFailedError(RuntimeError):
    """The engine could not serve one request (an exception while handling its data): that request
    ends with this error, the others go on."""


def short_error(exc: BaseException) -> str:
    """`Type: first line of the message`, at most MAX_ERROR_CHARS: what a client may be told about
    an exception (no traceback, no file paths)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


@dataclass(slots=True)
class CompletionOutput:
    """One of the request's `n` samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort:<why>" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token_id: logprob} for the sampled token and the top-k (when asked).
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Arrival -> first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival -> last token (or abort)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (block_manager=prefix)
    error: str | None = None  # why the engine failed the request (finish_reason "abort:error"), short

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_len - 1) over the first sample (vLLM's serving definition)."""
        ttft, e2e = self.metrics.ttft, self.metrics.e2e
        if ttft is None or e2e is None or not self.outputs or len(self.outputs[0].token_ids) < 2:
            return None
        return (e2e - ttft) / (len(self.outputs[0].token_ids) - 1)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.outputs)
