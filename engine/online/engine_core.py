"""The engine core in its own process (vLLM v1's EngineCore): `AsyncLLMEngine(engine_process=True)`.

An online server's front end (HTTP parsing, one coroutine per stream, JSON, SSE) is Python work per
request per step; in the engine's process it shares the interpreter lock with the thread that
schedules and launches steps, so steps get slower as clients get more. Here the engine runs in a
child process (multiprocessing `spawn`) as a busy loop: take the new requests and aborts the front
end sent, `step()`, send the step's outputs back; with no work it blocks on its inbox (no spin).

Messages (two one-way pipes, pickled and framed by engine/online/core_channel.py; the core blocks on its
ends, the front end reads and writes its ends from its event loop):
- front end -> core: `(new requests, abort ids)` batches (`engine.online.host.NewRequest`s), or
  None to stop.
- core -> front end: `CoreInfo` once (or `CoreFailed` if the engine could not be built), then one
  `CoreStep` per step that produced anything (two when it brought new requests' first tokens and
  running streams' tokens: the first ones in a message of their own, ahead): per-request errors, how many arrivals were taken,
  the outputs in a compact form (engine/online/output_wire.py: no objects, no prompt but a text
  prompt's token ids once, a running stream's new token as its id, tokens and text), the
  `RequestStats` of the requests that ended, and the engine's counters; `CoreFailed` if the loop
  dies. Text is decoded in the core, where stop strings must be matched before the next step.
  While it steps, the core sends a `CoreStep` at least every `HEARTBEAT_S` even when its steps
  produce nothing (a long prompt's prefill chunks, `final_only` requests), so that a front end
  hears from a core that works: a replica set takes a core silent for long with requests in hand
  for hung (engine/online/replica_set.py).

The core exits when its inbox closes (the front end ended, even killed) or its outbox breaks, and it
ignores SIGINT (a Ctrl-C reaches the whole process group; the front end stops it in order). The
client kills it if the front end drops it without `shutdown` (a finalizer), so no core outlives it.
"""
from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, fields
from operator import attrgetter

from engine.engine_args import EngineArgs
from engine.offline.outputs import RequestOutput, short_error
from engine.offline.tokenizer import tokenizer_for
from engine.online.core_channel import LoopChannel, read_message, readable, write_message
from engine.online.engine_stats import EngineStats, RequestStats, StatsTracker
from engine.online.host import hand_over
from engine.online.output_wire import OutputPacker, PackedOutput
from policies.routing.replica_report import ReplicaReport, report

HEARTBEAT_S = 1.0  # the longest a stepping core stays silent


@dataclass(slots=True, frozen=True)
class CoreInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_logprobs: int


@dataclass(slots=True, frozen=True)
class CoreFailed:
    """The core's failure as text (any exception pickles this way)."""

    error: str  # `Type: message`, short: what a client may be told (a ValueError: its whole message)
    traceback: str  # the whole traceback, for the server's log
    bad_input: bool = False  # a ValueError: the engine arguments (or the model they name) are wrong


def _values(cls) -> attrgetter:
    """A dataclass instance's field values as a tuple, in the order its constructor takes them."""
    return attrgetter(*(f.name for f in fields(cls)))


_REQUEST_STATS, _ENGINE_STATS, _REPORT = _values(RequestStats), _values(EngineStats), _values(ReplicaReport)


@dataclass(slots=True)
class CoreStep:
    errors: dict[str, Exception]  # request id -> why add_request refused it (host.hand_over)
    num_taken: int  # arrivals taken off the inbox (admitted or refused)
    outputs: list[PackedOutput]  # engine/online/output_wire.py
    finished: list[RequestStats]
    stats: EngineStats
    report: ReplicaReport  # the scheduler's state after the step, for a router in front of replicas

    def __reduce__(self) -> tuple:
        # Pickled as builtins, rebuilt by one function: pickle's own way with these frozen
        # dataclasses (a class lookup and a Python-level __setstate__ each) took ~20 us per step
        # each way, on the way of every step's outputs to their streams; this way it takes ~4.
        return _core_step, (self.errors, self.num_taken, self.outputs, [_REQUEST_STATS(r) for r in self.finished],
                            _ENGINE_STATS(self.stats), _REPORT(self.report))


def _core_step(errors: dict[str, Exception], num_taken: int, outputs: list[PackedOutput], finished: list[tuple],
               stats: tuple, report: tuple) -> CoreStep:
    return CoreStep(errors, num_taken, outputs, [RequestStats(*r) for r in finished], EngineStats(*stats),
                    ReplicaReport(*report))


def _failure(exc: BaseException) -> CoreFailed:
    bad_input = isinstance(exc, ValueError)
    return CoreFailed(str(exc) if bad_input else short_error(exc), "".join(traceback.format_exception(exc)).strip(),
                      bad_input)


def run_core(args: EngineArgs, keep_trace: bool, inbox, outbox, report_index: bool = False) -> None:
    """The child process's main: build the engine, then serve the front end's batches until told to
    stop or until either pipe closes. `report_index`: each step's report carries the changes to the
    prefix index (a router in front reads it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Started as a daemon (the front end's exit ends it), it may still start the tensor-parallel
    # workers of its engine, which are daemons of its own: a daemon process may not have children.
    multiprocessing.current_process().daemon = False
    from engine.offline.llm_engine import LLMEngine

    out = outbox.fileno()
    try:
        pin_device(args.device)
        engine = LLMEngine(args)
    except BaseException as exc:  # noqa: BLE001 (reported to the front end, which raises it)
        write_message(out, _failure(exc))
        return
    write_message(out, core_info(engine))
    try:
        serve(engine, keep_trace, inbox.fileno(), out, set() if report_index else None)
    finally:
        engine.close()  # its tensor-parallel workers stop with the core


def pin_device(device: str | None) -> None:
    """Make `cuda:<i>` this process's current device before its engine is built (a data-parallel
    replica's): streams, CUDA-graph captures and kernel launches follow the current device."""
    if device is not None and device.startswith("cuda:"):
        import torch
        torch.cuda.set_device(torch.device(device))


def core_info(engine) -> CoreInfo:
    runner = engine.runner
    return CoreInfo(engine.model_config.name, engine.max_model_len, engine.vocab_size, runner.num_gpu_blocks,
                    runner.num_cpu_blocks, engine.max_logprobs)


def serve(engine, keep_trace: bool, inbox: int, outbox: int, sent_index: set[int] | None) -> None:
    """The core's loop: take the batches, step, send what the step gave (`sent_index`: the prefix
    index as last reported, or None: not reported)."""
    tracker = StatsTracker(engine, keep_trace)
    packer = OutputPacker()
    last_sent = time.monotonic()
    try:
        while True:
            batches = [] if engine.has_unfinished_requests() else [read_message(inbox)]  # idle: block
            while readable(inbox):
                batches.append(read_message(inbox))
            errors, taken = {}, 0
            for batch in batches:
                if batch is None:
                    return
                new, aborts = batch
                taken += len(new)
                hand_over(engine, tracker, new, aborts, errors)
            stepped = engine.has_unfinished_requests()
            outputs = engine.step() if stepped else []
            tracker.stepped(outputs)
            now = time.monotonic()
            if not (outputs or errors or taken or batches or (stepped and now - last_sent >= HEARTBEAT_S)):
                continue
            last_sent = now
            stats, rep = _stats(engine, tracker), report(engine.scheduler, sent_index)
            for part in _first_apart(packer, outputs):
                write_message(outbox, CoreStep(errors, taken, [packer.pack(o) for o in part],
                                               [tracker.finished(o) for o in part if o.finished], stats, rep))
                errors, taken = {}, 0
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the front end is gone
    except BaseException as exc:
        try:
            write_message(outbox, _failure(exc))
        except OSError:
            pass
        raise SystemExit(1) from exc


def _first_apart(packer: OutputPacker, outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """A step's outputs as the messages that carry them: its first outputs (new requests' first
    tokens) in a message of their own ahead of the others when it has both, so a first token leaves
    without waiting for every running stream's output to be packed and pickled (~0.75 us a stream)."""
    if len(outputs) > 1:
        first, running = [], []
        for o in outputs:
            (first if packer.is_first(o) else running).append(o)
        if first and running:
            return [first, running]
    return [outputs]


def _stats(engine, tracker: StatsTracker) -> EngineStats:
    """The tracker's counters, with KV usage read off the block manager now (it stays true after an
    abort that needed no step)."""
    s = tracker.snapshot(num_pending=0)
    usage = engine.scheduler.block_manager.usage()
    total = engine.runner.num_gpu_blocks
    return EngineStats(s.num_running, s.num_waiting, s.num_swapped, usage.gpu_used / total if total else 0.0,
                       s.num_preemptions_total, s.prompt_tokens_total, s.generation_tokens_total,
                       s.num_requests_finished_total, s.num_steps_total)


class EngineCoreClient:
    """The front end's handle on the core process: start it (blocks until the engine is built),
    its pipes as a `LoopChannel` for the front end's event loop, stop it."""

    def __init__(self, args: EngineArgs, keep_trace: bool = False, start_timeout_s: float = 900.0,
                 report_index: bool = False) -> None:
        self.args = args
        ctx = multiprocessing.get_context("spawn")
        inbox_r, self._inbox = ctx.Pipe(duplex=False)
        self._outbox, outbox_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_core, args=(args, keep_trace, inbox_r, outbox_w, report_index),
                                   name="servelab-engine-core", daemon=True)
        self.process.start()
        inbox_r.close()
        outbox_w.close()
        self._finalizer = weakref.finalize(self, _stop, self.process, self._inbox, 0.0)
        try:
            first = read_message(self._outbox.fileno(), start_timeout_s)
        except TimeoutError:
            self._finalizer()
            raise TimeoutError(f"the engine process did not start within {start_timeout_s} s") from None
        except EOFError:
            self._finalizer()
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})") from None
        if isinstance(first, CoreFailed):
            self._finalizer()
            if first.bad_input:  # the arguments are wrong: a ValueError naming the value, as in-process
                raise ValueError(first.error)
            raise RuntimeError(f"the engine process could not build the engine:\n{first.traceback}")  # noqa: TRY004
        self.info: CoreInfo = first
        self.channel = LoopChannel(self._inbox.fileno(), self._outbox.fileno())
        self.tokenizer = tokenizer_for(args.tokenizer, args.model_config().weights)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_reason(self, wait_s: float) -> str:
        """How the core ended, once it has (waiting up to `wait_s` for its exit code)."""
        self.process.join(wait_s)
        return f"the engine process exited (exit code {self.process.exitcode})"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop and wait for it; terminate, then kill, what does not."""
        self._finalizer.detach()
        self.channel.detach(close=True)
        if self.channel.pending:  # a message half written: a stop message would not parse
            _stop(self.process, None, 0.0)
        else:
            _stop(self.process, self._inbox, timeout_s)
        self._inbox.close()
        self._outbox.close()


def _stop(process, inbox, timeout_s: float) -> None:
    """Send the stop message (unless `inbox` is None), wait `timeout_s`, then terminate and kill."""
    if inbox is not None:
        try:
            write_message(inbox.fileno(), None)
        except OSError:  # closed, broken, or full (a core that reads nothing more is terminated below)
            pass
    process.join(timeout_s)
    if process.is_alive():
        process.terminate()
        process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)
