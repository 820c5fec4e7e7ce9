"""What `AsyncLLMEngine` tells a metrics endpoint: a typed snapshot of the engine (`EngineStats`,
vLLM's gauges and counters) and one record per ended request (`RequestStats`, for the TTFT,
inter-token and end-to-end latency histograms).

The tracker runs in the engine's worker thread after each step: it reads the scheduler's newest
step row (queues, blocks, preemptions, prefill tokens) and the step's outputs (generated tokens and
their times). Latencies are on the server's clock (`time.monotonic()`), from the moment
`generate()` was called: what a client sees, less the transport.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise

from engine.offline.outputs import RequestOutput


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int  # sequences in the running queue
    num_waiting: int  # sequences in the waiting queue, plus requests on their way to it
    num_swapped: int
    kv_cache_usage: float  # fraction of the GPU KV blocks in use, in [0, 1]
    num_preemptions_total: int
    prompt_tokens_total: int  # prefill tokens computed (recomputation after a preemption included)
    generation_tokens_total: int
    num_requests_finished_total: int  # ended requests, aborted ones included
    num_steps_total: int


@dataclass(slots=True, frozen=True)
class RequestStats:
    request_id: str
    finish_reason: str | None  # sample 0's: "stop", "length" or "abort:<why>"
    num_prompt_tokens: int
    num_generation_tokens: int
    ttft: float | None  # seconds from generate() to the first output token (None: none came)
    inter_token_latencies: list[float]  # seconds between consecutive steps that brought tokens
    e2e: float  # seconds from generate() to the final output
    replica: int | None = None  # the data-parallel replica that served it (engine/online/replica_set.py)
    arrival: float | None = None  # time.monotonic() at generate() (a request's timeline, across processes)


@dataclass(slots=True)
class _Timing:
    arrival: float
    delta: bool  # the request's outputs are deltas (else cumulative)
    num_tokens: int = 0  # output tokens seen so far (all samples)
    token_times: list[float] = field(default_factory=list)
    end: float | None = None


class StatsTracker:
    def __init__(self, engine, keep_trace: bool = False) -> None:
        """`keep_trace=False`: the engine's trace rows are dropped once read, so a long-running server
        holds no growing trace."""
        self.engine = engine
        self.keep_trace = keep_trace
        self._lock = threading.Lock()
        self._timings: dict[str, _Timing] = {}
        self._num_steps_seen = 0
        self.num_running = self.num_waiting = self.num_swapped = 0
        self.kv_cache_usage = 0.0
        self.num_preemptions = self.prompt_tokens = self.generation_tokens = 0
        self.num_finished = self.num_steps = 0

    def arrived(self, request_id: str, arrival: float, delta: bool) -> None:
        self._timings[request_id] = _Timing(arrival, delta)

    def stepped(self, outputs: list[RequestOutput]) -> None:
        """After a step, in the worker thread."""
        now = time.monotonic()
        generated = 0
        for output in outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:
                continue
            count = sum(len(c.token_ids) for c in output.outputs)
            new = count if timing.delta else count - timing.num_tokens
            if new > 0:
                timing.num_tokens += new
                timing.token_times.append(now)
                generated += new
            if output.finished:
                timing.end = now
        scheduler = self.engine.scheduler
        recorder = scheduler.recorder
        steps = recorder.steps
        with self._lock:
            for row in steps[self._num_steps_seen:]:
                self.num_preemptions += row["num_preempted_recompute"] + row["num_preempted_swap"]
                self.prompt_tokens += row["num_prefill_tokens"]
                self.num_steps += 1
                if row["gpu_blocks_total"]:
                    self.kv_cache_usage = row["gpu_blocks_used"] / row["gpu_blocks_total"]
            self.generation_tokens += generated
            self.num_running, self.num_waiting = scheduler.num_running, scheduler.num_waiting
            self.num_swapped = scheduler.num_swapped
        if self.keep_trace:
            self._num_steps_seen = len(steps)
        else:
            steps.clear()
            recorder.requests.clear()
            recorder.events.clear()

    def finished(self, output: RequestOutput) -> RequestStats:
        """For a final output, after `stepped` saw it (in the thread that steps)."""
        timing = self._timings.pop(output.request_id, None)
        now = time.monotonic()
        if timing is None:
            timing = _Timing(now, False)
        times, end = timing.token_times, timing.end or now
        with self._lock:
            self.num_finished += 1
        return RequestStats(output.request_id, output.outputs[0].finish_reason if output.outputs else None,
                            len(output.prompt_token_ids), timing.num_tokens,
                            times[0] - timing.arrival if times else None,
                            [b - a for a, b in pairwise(times)], end - timing.arrival, arrival=timing.arrival)

    def snapshot(self, num_pending: int) -> EngineStats:
        with self._lock:
            return EngineStats(self.num_running, self.num_waiting + num_pending, self.num_swapped,
                               self.kv_cache_usage, self.num_preemptions, self.prompt_tokens,
                               self.generation_tokens, self.num_finished, self.num_steps)
