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

Requests come in (from any thread), are aborted and move between engines through the
`RequestIntake` half (engine/offline/request_intake.py); this module holds the step loop.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Self

from engine.device.model_runner import ModelRunner
from engine.device.token_feedback import Launched
from engine.engine_args import EngineArgs
from engine.offline.detokenizer import Detokenizer
from engine.offline.output_processor import OutputProcessor
from engine.offline.outputs import RequestOutput
from engine.offline.request_intake import RequestIntake, stepping
from engine.offline.tokenizer import tokenizer_for
from policies.build import build_scheduler, check_scheduling_config
from policies.outputs import SchedulerOutput
from policies.scheduler import Scheduler
from policies.trace import TraceRecorder

SchedulerBuilder = Callable[[int, int, int], Scheduler]  # (num_gpu_blocks, num_cpu_blocks, max_model_len)


class LLMEngine(RequestIntake):
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
        self.tokenizer = tokenizer_for(args.tokenizer, self.model_config.weights)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        eos = self.model_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        # More EOS ids (Llama 3): stop token ids unless ignore_eos; one past the vocabulary is never
        # sampled, and a request's stop_token_ids must lie in it (Request.validate).
        self._extra_eos_ids = [i for i in eos_ids[1:] if 0 <= i < self.vocab_size]
        self.output_processor = OutputProcessor(self.detokenizer, args.detokenize)
        self._live = self.output_processor.live  # request id -> LiveRequest, until its final output
        self._output_lens: dict[str, int] = {}  # request id -> forced output length (trace replay)
        self._in_flight: tuple[SchedulerOutput, Launched] | None = None  # launched ahead, async scheduling
        self._init_intake()
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

    def close(self) -> None:
        """Free the model and KV cache, and end the tensor-parallel workers; no step after this."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the step -------------------------------------------------------------------------
    @stepping
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
