"""How requests reach an `LLMEngine` (engine/offline/llm_engine.py) and leave it other than by
ending in a step: `add_request` (validated in the caller's thread), `abort_request`, the engine's own
aborts of requests whose handling raised, and the hand-over of live requests between the two engines
of a disaggregated pair (`hand_over_request`, `take_over_request`).

Threads: `add_request` and `abort_request` may be called from another thread than the one calling
`step()` (an online server's). They validate in the caller's thread and hand the request (or the
abort) over through an inbox; the stepping thread takes the inbox at the start of each step, or at
once when no step is running (so a single-threaded caller sees its request in the scheduler
straight away). Only one thread steps at a time. A duplicate request id is refused in the caller.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from collections import deque
from dataclasses import dataclass

from engine.offline.outputs import RequestOutput
from engine.offline.tokenizer import encode_prompt
from policies.request import Request, SamplingParams


@dataclass(slots=True)
class _Arrival:
    """A validated request on its way from `add_request` (any thread) to the scheduler."""

    request: Request
    prompt: str | None
    output_len: int | None


def stepping(method):
    """Run `method` as the one stepping thread, after taking what other threads handed over."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._step_lock:
            self._take_inbox()
            return method(self, *args, **kwargs)

    return run


class RequestIntake:
    """Mixed into `LLMEngine`: the inbox's state is its own (`_init_intake`); the rest is the engine's
    (its scheduler, output processor, runner, clock, tokenizer and limits)."""

    __slots__ = ()

    def _init_intake(self) -> None:
        """The hand-over from add_request / abort_request (any thread) to the stepping thread."""
        # Arrivals and aborts (a request id: the user's; (id, reason): the engine's own), in call order.
        self._inbox: deque[_Arrival | str | tuple[str, str]] = deque()
        self._pending: set[str] = set()  # ids of the arrivals in the inbox
        self._aborting: set[str] = set()  # ids whose abort was asked for and that have not ended yet
        self._inbox_lock = threading.Lock()  # guards the three above and the scheduler's id check
        self._step_lock = threading.Lock()  # held by the thread stepping (or taking the inbox)

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, output_len: int | None = None, abort_too_long: bool = False,
                    tenant: str | None = None) -> None:
        """Queue a request; raises ValueError (naming the field) on bad input or a request id already
        used, adding nothing. Safe from any thread (module docstring). `output_len`: end each sample
        with finish_reason "stop" after that many tokens, as a workload replay's stop rule (the
        simulator does the same). `abort_too_long`: a prompt longer than max_model_len is not refused
        but ends at once with finish_reason "abort:too_long" (a workload replay goes on, as the
        simulator's does). `tenant`: the client served (fair-share policies such as vtc, per-tenant
        metrics); None for none."""
        if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
            raise ValueError(f"output_len={output_len!r} is invalid: None or an integer >= 1")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"sampling_params={params!r:.80} is invalid: must be a SamplingParams")
        params.validate()
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is invalid: at most max_logprobs={self.max_logprobs} "
                             "top logprobs per token (an engine argument)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} is invalid: stop strings need a tokenizer and model "
                             f"{self.model_config.name!r} has none (dummy weights); use stop_token_ids")
        if self._extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(params,
                                         stop_token_ids=[*params.stop_token_ids, *self._extra_eos_ids])
        if isinstance(prompt, str):
            text, token_ids = prompt, encode_prompt(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(  # noqa: TRY004
                f"prompt={prompt!r:.80} is invalid: must be a string or a list of token ids")
        now = self.now()
        request = Request(request_id, token_ids, params, now if arrival_time is None else arrival_time,
                          priority, eos_token_id=self.eos_token_id, tenant=tenant)
        request.validate(None if abort_too_long else self.max_model_len, self.vocab_size)
        with self._inbox_lock:
            if request_id in self._pending:
                raise ValueError(f"request_id={request_id!r} is invalid: already added to this engine")
            self.scheduler.check(request, too_long_ok=abort_too_long)
            self._pending.add(request_id)
            self._inbox.append(_Arrival(request, text, output_len))
        self._take_inbox_if_idle()

    def _admit(self, arrival: _Arrival) -> None:
        """An arrival into the scheduler (stepping thread, inbox lock held)."""
        request, request_id = arrival.request, arrival.request.request_id
        # A prompt over max_model_len (abort_too_long) ends in add; its sequences still get an output.
        self.output_processor.add(request, arrival.prompt, self.scheduler.add(request, self.now()))
        if arrival.output_len is not None:
            self._output_lens[request_id] = arrival.output_len

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request; its final output (finish_reason "abort:user") comes out
        of the next `step()`. False if the request is unknown, already ended or already aborted.
        Safe from any thread; there, a request that ends in the step running meanwhile ends as it
        would have, and the abort does nothing."""
        if not isinstance(request_id, str):
            return False
        with self._inbox_lock:
            if request_id in self._aborting or not (request_id in self._pending or request_id in self._live):
                return False
            self._aborting.add(request_id)
            self._inbox.append(request_id)
        self._take_inbox_if_idle()
        return True

    def hand_over_request(self, request_id: str) -> None:
        """A live request that left this engine's scheduler for another engine (a prefill engine's
        hand-off, engine/disagg/): forgotten here without an output. Stepping thread only."""
        live = self.output_processor.drop(request_id)
        self._output_lens.pop(request_id, None)
        self._aborting.discard(request_id)
        self.runner.release([seq.seq_id for seq in live.seqs])

    def take_over_request(self, request: Request, prompt: str | None, seqs: list,
                          output_len: int | None = None) -> RequestOutput | None:
        """A request whose sequences joined this engine's scheduler from another engine (a decode
        engine receiving a hand-off, engine/disagg/), holding the tokens sampled there: its outputs
        come from this engine from now on (`output_len`: its forced output length, as
        `add_request`'s). Returns its output now (those tokens) if it streams. Stepping thread only."""
        with self._inbox_lock:
            output = self.output_processor.take_over(request, prompt, seqs)
            if output_len is not None:
                self._output_lens[request.request_id] = output_len
        return output

    def _take_inbox_if_idle(self) -> None:
        if self._step_lock.acquire(blocking=False):  # no step running: hand over now
            try:
                self._take_inbox()
            finally:
                self._step_lock.release()

    def _take_inbox(self) -> None:
        """Arrivals into the scheduler and aborts applied, in call order (step lock held)."""
        with self._inbox_lock:
            while self._inbox:
                entry = self._inbox.popleft()
                if isinstance(entry, (str, tuple)):
                    request_id, reason = (entry, "user") if isinstance(entry, str) else entry
                    if not self.scheduler.abort(request_id, reason, self.now()):
                        self._aborting.discard(request_id)  # it ended meanwhile
                    continue
                self._admit(entry)
                self._pending.discard(entry.request.request_id)

    def has_unfinished_requests(self) -> bool:
        with self._inbox_lock:
            return bool(self._live or self._pending)

    def get_num_unfinished_requests(self) -> int:
        with self._inbox_lock:
            return len(self._live) + len(self._pending)

    def _abort_failed(self) -> None:
        """Abort the requests whose handling raised in this step, as a user's abort is: through the
        inbox, at the start of the next step (finish_reason "abort:error"; their final output, with
        the error, comes out of that step)."""
        with self._inbox_lock:
            for request_id in self.output_processor.to_abort:
                if request_id not in self._aborting:
                    self._aborting.add(request_id)
                    self._inbox.append((request_id, "error"))
        self.output_processor.to_abort.clear()
