"""`DisaggregatedEngine`: a prefill engine and a decode engine, each in its own process, behind
`LLMEngine`'s interface (`add_request`, `abort_request`, `step`, `has_unfinished_requests`,
`close`), so `LLM(..., disaggregation="prefill=1,decode=1")` and the OpenAI server's thread host
drive it as they drive one engine.

    engine = DisaggregatedEngine(EngineArgs(model="qwen3-0.6b"), DisaggregationConfig())
    # prefill on the engine's device (cuda:0) in this process, decode on cuda:1 in a child process

Start-up (bounded): both engines build at once, the link opens and moves one block through the
serving path (engine/disagg/link_warmup.py, `_warm_link`), then both clocks start at 0 (`reset_clock`).

This process (the front) runs the prefill engine; `step()`:
1. takes the decode process's messages: `Reserved` -> the blocks of the requests it names are
   sent on the link as one message (gathered in one launch on the link's side stream, which the
   compute stream never waits for: the next prefill step overlaps the transfer); `Refused` -> the
   request ends with an error; `DecodeStep` -> the decode engine's outputs, returned;
2. runs one prefill step (when it has work), whose `PrefillSide` (policies/disagg/) hands off every
   request whose first token it sampled: the request is forgotten by the prefill engine's outputs
   and goes to the decode process, the step's hand-offs in one `HandoffBatch`;
3. frees the prefill blocks of each transfer the link finished (`PrefillSide.finish_transfer`).
With `sends_mid_step` (the default), while the prefill step of 2. runs the front waits for its tokens
in slices and takes a `Reserved` that comes meanwhile at once: its send starts beside the step, not
after it (`ModelRunner.while_waiting`; the decode process's other messages wait for the next turn).
By default the prefill engine schedules synchronously (the next step is scheduled after the last
one's outputs are processed). With `prefill_async_scheduling` it schedules ahead as a co-located
engine does (policies/lookahead.py): step N+1 is scheduled and launched while step N runs; a
sequence whose prompt step N finishes ends at its first token ("handoff") when step N is looked
past, so it is in no later step and nothing writes into its blocks, which stay held; its request is
handed off when step N is collected, carrying the token, as without it.

Mid-transfer (docs/disaggregation.md): an abort of a request still prefilling is the prefill
engine's; of a handed-off request, its final output ("abort:user") comes at once, a hand-off still
queued on the decode side is withdrawn and its blocks freed, a transfer already posted runs to its
end (its source blocks are being read) and the decode side drops it; of a decoding request, the
decode engine's abort. Preemption happens inside each engine as without disaggregation (a request
is never preempted while transferring: it is in neither scheduler's queues). n > 1: the prompt
forks on the prefill side, every sample's first token and the prompt's blocks (once) move together.

Faults: the decode process dying, or silent for `transfer_timeout_s` while requests decode there
or hand-offs aborted here wait for its answer (it sends a step at least every HEARTBEAT_S while it
works: silence is a hang), or leaving the front's messages unread that long (they queue on the
pipe's sender thread, engine/disagg/pipe_sender.py: the front never waits for the decode loop to
read), or leaving a message of its own unfinished that long (the pipe's reader thread,
engine/disagg/pipe_receiver.py, reads it whole: the front never waits for it), or the link failing
(a peer dead, or no progress for `transfer_timeout_s`) ends every request handed off or decoding
with an error within that bound,
and the pair refuses new requests (`RuntimeError`); `close()` ends the decode process within
`JOIN_TIMEOUT_S`. How the front moves requests to the decode process (hand-offs, its messages,
transfers) is engine/disagg/pd_front_transfers.py; how it ends requests itself (faults, and their
outputs) engine/disagg/pd_front_faults.py.
"""
from __future__ import annotations

import dataclasses
import time

from engine.disagg import link_warmup
from engine.disagg.config import DisaggregationConfig
from engine.disagg.decode_client import JOIN_TIMEOUT_S, DecodeClient, decode_engine_args
from engine.disagg.kv_transfer import SEND_RANK, KVLink, open_store
from engine.disagg.kv_transfer_message import KVTransferError
from engine.disagg.messages import (
    AbortMessage,
    ClockOrigin,
    DecodeReady,
    DecodeStarted,
)
from engine.disagg.pd_front_transfers import FrontTransfers
from engine.distributed.worker_faults import refuse_in_spawn_bootstrap
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine, SchedulerBuilder
from engine.offline.outputs import RequestOutput
from policies.disagg import KVHandoff, PrefillSide, kv_block_bytes
from policies.request import SamplingParams

__all__ = ["JOIN_TIMEOUT_S", "DisaggregatedEngine"]

PREFILL_REPLICA = 0
_WAIT_S = 0.002  # how long an idle front waits for the decode process before returning


class DisaggregatedEngine(FrontTransfers):
    def __init__(self, args: EngineArgs, config: DisaggregationConfig | str | dict | None = None,
                 build_scheduler: SchedulerBuilder | None = None, keep_trace: bool = True) -> None:
        """`build_scheduler`: the prefill engine's scheduler (as `LLMEngine`'s; it schedules ahead
        exactly when `config.prefill_async_scheduling` says), e.g. an experiment's; the decode
        engine's comes from `args` and `decode_args`.
        `keep_trace`: keep the decode engine's request and step rows in `decode_rows` and
        `decode_steps` (False: a server's; its step rows are then not even sent)."""
        refuse_in_spawn_bootstrap()
        config = DisaggregationConfig.parse(config if config is not None else DisaggregationConfig())
        if args.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size} is not supported with disaggregation: "
                             "the engine pair runs one GPU per engine")
        self.config = config
        decode_args = decode_engine_args(args, config)
        self._failure: str | None = None
        self._closed = False
        store = open_store(max(10.0, config.transfer_timeout_s))
        self._decode = DecodeClient(decode_args, config, store.port, keep_steps=keep_trace)
        self._receiver = self._decode.receiver  # the pipe's reads, never blocking the front
        self._sender = self._decode.sender  # and its writes
        try:  # the two engines build at once
            ahead = config.prefill_async_scheduling
            self.prefill = LLMEngine(dataclasses.replace(args, async_scheduling=ahead),
                                     build_scheduler=build_scheduler)
            if self.prefill.scheduler.config.async_scheduling != ahead:
                raise ValueError(f"the prefill engine's scheduler has async_scheduling="
                                 f"{self.prefill.scheduler.config.async_scheduling}, the pair's "
                                 f"disaggregation.prefill_async_scheduling={ahead}: build it in the pair's mode")
            started = self._decode.await_message(DecodeStarted, config.startup_timeout_s, "starting",
                                                 "startup_timeout_s")
            self.link = KVLink(SEND_RANK, store, self.prefill.runner.device, config.transfer_timeout_s)
            kv = self.prefill.runner.kv_cache
            self.link_warm = _warm_link(self.link, self._decode, kv.k_caches, kv.v_caches)
        except BaseException:
            self.close()
            raise
        runner = self.prefill.runner
        block_bytes = kv_block_bytes(self.prefill.model_config, runner.block_size, 1, runner.dtype.itemsize)
        self.side = PrefillSide(self.prefill.scheduler, block_bytes, replica=PREFILL_REPLICA)
        self.decode_pid, self.decode_num_gpu_blocks = started.pid, started.num_gpu_blocks
        self.decode_device = decode_args.device
        self.tokenizer, self.model_config = self.prefill.tokenizer, self.prefill.model_config
        self.max_model_len, self.vocab_size = self.prefill.max_model_len, self.prefill.vocab_size
        self.max_logprobs = 0  # logprobs are refused (add_request)
        self.args = args
        self._params: dict[str, SamplingParams] = {}  # request id -> the caller's params, while live
        self._prompts: dict[str, str | None] = {}  # request id -> its prompt's text (None: token ids), while live
        self._output_lens: dict[str, int] = {}  # request id -> forced output length, while live
        self._handoffs: dict[str, KVHandoff] = {}  # handed off, prefill blocks held (until the send ends)
        self._sending: set[str] = set()  # of those, the ones whose send is posted
        # Handed off and not ended (at the decode process) -> its prompt's token ids: the decode
        # process's outputs come without their prompts (`DecodeOutput`), the front puts them back.
        self._decoding: dict[str, list[int]] = {}
        self._last_heard = time.monotonic()  # when the decode process last sent a message
        self._silence_s = config.transfer_timeout_s  # silent this long with requests decoding: hung
        self._done_early: list[RequestOutput] = []  # final outputs made here, returned by the next step
        self._left_for_turn: list[object] = []  # the decode process's messages read mid-step, for the next turn
        if config.sends_mid_step:
            self.prefill.runner.while_waiting = self._while_prefilling
        self.decode_rows: list[dict] = []  # the decode engine's trace rows (requests that ended there)
        self.decode_steps: list[dict] = []  # and its step rows (policies/trace.py STEP_COLUMNS)
        self._keep_trace = keep_trace
        self.reset_clock()  # t=0: the pair is ready (both engines built, the link warm)

    # ---- LLMEngine's interface ----------------------------------------------------------------
    @property
    def recorder(self):
        """The prefill engine's trace (requests that ended there); `decode_rows` holds the others."""
        return self.prefill.recorder

    @property
    def runner(self):
        return self.prefill.runner

    @property
    def scheduler(self):
        """The prefill engine's (a server's counters: its queues and steps)."""
        return self.prefill.scheduler

    def now(self) -> float:
        return self.prefill.now()

    def reset_clock(self, origin: float | None = None) -> None:
        """Both engines' clocks count from `origin` (a `time.perf_counter()` value; default now), as
        `LLMEngine.reset(start=...)`: a run's t=0 once the pair takes requests. Only with no request
        in flight."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"reset_clock() with {len(self._params)} requests in flight: finish or abort them first")
        origin = time.perf_counter() if origin is None else origin
        self.prefill.align_clock(origin)
        self._send(ClockOrigin(origin))

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, output_len: int | None = None,
                    abort_too_long: bool = False, tenant: str | None = None) -> None:
        """As `LLMEngine.add_request`; `RuntimeError` once the decode engine has failed."""
        if self._failure is not None:
            raise RuntimeError(f"the decode engine failed: {self._failure}")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams) and params.logprobs is not None:
            raise ValueError(f"logprobs={params.logprobs} is not supported with disaggregation: the first token's "
                             "logprobs stay on the prefill engine")
        if request_id in self._params:
            raise ValueError(f"request_id={request_id!r} is invalid: already added to this engine")
        prefill_params = params
        if isinstance(params, SamplingParams) and params.streams:
            prefill_params = dataclasses.replace(params, output_kind="final_only")  # decode streams it
        self.prefill.add_request(request_id, prompt, prefill_params, arrival_time, priority, output_len,
                                 abort_too_long, tenant)
        self._params[request_id] = params
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        if output_len is not None:
            self._output_lens[request_id] = output_len

    def abort_request(self, request_id: str) -> bool:
        """As `LLMEngine.abort_request`, wherever the request is (module docstring)."""
        if request_id in self._handoffs and request_id not in self._decoding:
            return False  # already aborted while transferring
        if request_id in self._handoffs:
            handoff = self._handoffs[request_id]
            self.side.abort(request_id, "user", self.now())
            self._decoding.pop(request_id, None)
            self._send(AbortMessage(request_id))
            self._done_early.append(self._final(handoff, "abort:user", None))
            return True
        if request_id in self._decoding:
            self._send(AbortMessage(request_id))
            return True
        return self.prefill.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._params or self._handoffs or self._done_early) or self.prefill.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._params)

    def step(self) -> list[RequestOutput]:
        outputs, self._done_early = self._done_early, []
        outputs += self._take_messages()
        if self.prefill.has_unfinished_requests():
            for output in self.prefill.step():  # requests that ended on the prefill side
                self._params.pop(output.request_id, None)
                self._prompts.pop(output.request_id, None)
                self._output_lens.pop(output.request_id, None)
                outputs.append(output)
            self._hand_off_all(self.side.take_handoffs())
        self._finish_transfers()
        self._check_decode_alive()
        outputs += self._done_early
        self._done_early = []
        if not outputs and not self.prefill.has_unfinished_requests() and self._failure is None:
            self._receiver.poll(_WAIT_S)  # only the decode side is busy: do not spin
        return outputs

    def close(self) -> None:
        """Stop the decode process (killed if it does not stop within JOIN_TIMEOUT_S), close the link,
        free the prefill engine."""
        if self._closed:
            return
        self._closed = True
        self._decode.close()
        link = getattr(self, "link", None)
        if link is not None:
            link.close()
        prefill = getattr(self, "prefill", None)
        if prefill is not None:
            prefill.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _warm_link(link: KVLink, decode: DecodeClient, k_caches, v_caches) -> link_warmup.WarmTransfer:
    """The front's part of the pair's start-up: its send (`link_warmup.warm_send`), then the decode
    process's `DecodeReady` (its receive, scatter and restore done), each within the link's
    `timeout_s`. A decode process that dies or hangs meanwhile raises a RuntimeError (or
    TimeoutError) saying so."""
    what = "the KV link's start-up transfer"
    try:
        warm = link_warmup.warm_send(link, k_caches, v_caches)
    except KVTransferError as e:
        if not decode.alive:
            raise RuntimeError(f"{decode.gone} during {what}") from e
        raise RuntimeError(f"the decode engine did not complete {what}: {e}") from e
    decode.await_message(DecodeReady, link.timeout_s, f"running {what}", "transfer_timeout_s")
    return warm
