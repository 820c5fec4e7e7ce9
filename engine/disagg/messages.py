"""The typed messages between a disaggregated pair's front (the prefill engine's process) and its
decode engine process, sent pickled down one duplex pipe. The KV bytes never go this way: they
move on the pair's `KVLink` (engine/disagg/kv_transfer.py).

front -> decode: `ClockOrigin` (once ready, and when a run restarts the clock), `HandoffBatch` (the
requests one prefill step handed off, a `HandoffMessage` each: one pickle and one pipe write per
step, not per request), `TransferStarted`, `AbortMessage`, None (stop).
decode -> front: `DecodeStarted` (its engine is built: it joins the link), `DecodeReady` (the link's
start-up transfer is done, engine/disagg/link_warmup.py), `DecodeFailed` instead of either, then `Reserved` (blocks allocated for one or
more requests and one receive posted for all of them: the front sends them now, as one message), `Refused` (the request cannot be decoded there; it ends with
an error), `DecodeStep` (the decode engine's outputs as `DecodeOutput`s, without their prompts, which the front
holds; the trace rows of the requests that ended and its step rows),
`DecodeFailed` if its loop dies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from policies.disagg import KVHandoff
from policies.request import SamplingParams


@dataclass(slots=True)
class HandoffMessage:
    handoff: KVHandoff  # as the prefill side made it (its request has the prefill engine's params)
    sampling_params: SamplingParams  # the caller's (output kind included): the decode side's request gets them
    output_len: int | None = None  # a forced output length (a workload replay's stop rule)


@dataclass(slots=True, frozen=True)
class HandoffBatch:
    """The hand-offs of one front step, in the order their prefills finished."""

    handoffs: list[HandoffMessage]


@dataclass(slots=True, frozen=True)
class TransferStarted:
    request_ids: list[str]  # the requests of one `Reserved`, sent as one message on the link
    time: float  # on the pair's shared clock


@dataclass(slots=True, frozen=True)
class AbortMessage:
    request_id: str


@dataclass(slots=True, frozen=True)
class DecodeStarted:
    pid: int
    num_gpu_blocks: int


@dataclass(slots=True, frozen=True)
class DecodeReady:
    link_warm_s: float  # its end of the link's start-up transfer (receive, scatter, restore)
    link_warm_bytes: int


@dataclass(slots=True, frozen=True)
class ClockOrigin:
    """Both engines' clocks count from `origin` (a `time.perf_counter()` value of this host)."""

    origin: float


@dataclass(slots=True, frozen=True)
class DecodeFailed:
    error: str


@dataclass(slots=True, frozen=True)
class Reserved:
    """Blocks allocated for these requests, and one receive for all of them posted as this leaves:
    the front sends their blocks as one message, gathered in this order (each request's blocks in
    its order)."""

    request_ids: list[str]
    dst_block_ids: list[list[int]]


@dataclass(slots=True, frozen=True)
class Refused:
    """The hand-off will not be decoded there; the request ends with finish_reason `abort:<code>`
    (the simulator's codes: handoff_queue_full, handoff_timeout, too_long; user: its abort)."""

    request_id: str
    code: str
    reason: str  # the error a client is told


@dataclass(slots=True)
class DecodeOutput:
    """A decode engine's `RequestOutput` on the pipe, without its prompt (text and token ids): the
    front holds both from `add_request` and the hand-off until the request ends, and puts them back
    (`with_prompt`). A streaming request's every output would otherwise carry its whole prompt, each
    step (pickled in the decode process, unpickled in the front)."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int
    error: str | None

    @classmethod
    def of(cls, output: RequestOutput) -> DecodeOutput:
        return cls(output.request_id, output.outputs, output.finished, output.metrics, output.num_cached_tokens,
                   output.error)

    def with_prompt(self, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        """The output the user sees (as the decode engine made it, its prompt the front's)."""
        return RequestOutput(self.request_id, prompt, prompt_token_ids, self.outputs, self.finished, self.metrics,
                             self.num_cached_tokens, self.error)


@dataclass(slots=True)
class DecodeStep:
    outputs: list[DecodeOutput]
    rows: list[dict] = field(default_factory=list)  # trace rows of the requests that ended
    # The decode engine's step rows since its last DecodeStep (policies/trace.py's STEP_COLUMNS, on
    # the pair's clock), when the front keeps the decode engine's trace.
    steps: list[dict] = field(default_factory=list)
