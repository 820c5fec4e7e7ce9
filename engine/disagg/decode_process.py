"""The decode engine of a disaggregated pair, in its own process (spawned by the front,
engine/disagg/pd_engine.py).

It builds an `LLMEngine` on its device, puts a `DecodeSide` (policies/disagg/) on its scheduler,
reports `DecodeStarted`, joins the pair's `KVLink` as the receiving end, receives the link's
start-up transfer (engine/disagg/link_warmup.py: one block through the serving path, so the first
request pays no set-up) and reports `DecodeReady`, then loops:
1. take the front's messages: the clock's origin (`ClockOrigin`: the front's, so both engines'
   times are on one clock, counted from when the pair was ready), hand-offs into the `DecodeSide`'s queue (refused only when a bounded one is full),
   transfer start times, aborts (a queued hand-off is withdrawn, one whose receive is posted runs
   to its end and is dropped there, a live request is aborted in the engine);
2. hand-offs queued longer than `queue_timeout_s`, or too long for this KV pool, are refused;
3. `reserve_ready`: blocks allocated for the hand-offs that fit; then, while fewer than
   `max_transfers_in_flight` receives are posted (each holds a staging buffer), one receive is
   `Reserved` names every hand-off reserved so far (up to `max_blocks_per_transfer` blocks) to the
   front, which sends them as one message, and then their one receive is posted (the receiver
   allocates before the send; the hand-offs of one prefill step share one message, one gather,
   one scatter);
4. receives that completed are scattered into their blocks (one launch per message, on the compute
   stream behind the step in flight) and their requests join the running batch (`DecodeSide.receive`,
   `LLMEngine.take_over_request`): with async scheduling they enter the step after the one in
   flight, scheduled ahead in the next engine step and launched after the scatter, so the device
   orders the KV before its reads (`join_ahead`, policies/lookahead.py);
5. one engine step, its outputs (as `DecodeOutput`s: the front puts their prompts back) and the
   trace rows of the requests that ended, and its step rows, to the front.
Waiting: it blocks on the pipe when it has nothing to do, polls every millisecond while a transfer
or a queued hand-off waits, and does not wait while requests run.

It ends when the front says stop, when the pipe closes (the front ended) or when the front's
process is gone (a watchdog thread), and on any failure of its engine or link (reported first as
`DecodeFailed`).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection

from engine.disagg.config import DisaggregationConfig
from engine.disagg.kv_transfer import RECV_RANK, KVLink, join_store
from engine.disagg.kv_transfer_message import KVTransferError
from engine.disagg.link_warmup import warm_recv
from engine.disagg.messages import (
    AbortMessage,
    ClockOrigin,
    DecodeFailed,
    DecodeOutput,
    DecodeReady,
    DecodeStarted,
    DecodeStep,
    HandoffBatch,
    HandoffMessage,
    Refused,
    Reserved,
    TransferStarted,
)
from engine.distributed.worker import exit_with_parent
from engine.engine_args import EngineArgs
from engine.online.engine_core import HEARTBEAT_S
from policies.disagg import DecodeSide, KVHandoff, transfer_batches
from policies.trace import TraceRecorder

DECODE_REPLICA = 1
_IDLE_POLL_S, _BUSY_POLL_S = 1.0, 0.001


def decode_main(args: EngineArgs, config: DisaggregationConfig, port: int, conn: Connection,
                keep_steps: bool = True) -> None:
    """The process's body; `keep_steps`: send the engine's step rows to the front (its trace)."""
    exit_with_parent("decode-parent-watchdog")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front stops this process in order
    from engine.offline.llm_engine import LLMEngine

    try:
        if args.resolve_device().startswith("cuda"):  # streams, graphs and NCCL follow the current device
            import torch

            torch.cuda.set_device(torch.device(args.resolve_device()))
        engine = LLMEngine(args, recorder=TraceRecorder(record_events=False))  # events would be discarded
        side = DecodeSide(engine.scheduler, config.max_queue, config.queue_timeout_s, replica=DECODE_REPLICA)
        conn.send(DecodeStarted(os.getpid(), engine.runner.num_gpu_blocks))
        link = KVLink(RECV_RANK, join_store(port, config.transfer_timeout_s), engine.runner.device,
                      config.transfer_timeout_s)
        warm = warm_recv(link, engine.runner.kv_cache.k_caches, engine.runner.kv_cache.v_caches)
        conn.send(DecodeReady(warm.seconds, warm.num_bytes))
        DecodeLoop(engine, side, link, conn, config.max_transfers_in_flight, config.max_blocks_per_transfer,
                   keep_steps).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the front is gone
    except BaseException as e:  # noqa: BLE001 (reported to the front, which fails the requests)
        try:
            conn.send(DecodeFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        except OSError:
            pass
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (the link's threads, the CUDA context)


class DecodeLoop:
    def __init__(self, engine, side: DecodeSide, link: KVLink, conn: Connection, max_in_flight: int,
                 max_blocks: int, keep_steps: bool = True) -> None:
        self.engine, self.side, self.link, self.conn = engine, side, link, conn
        self.max_in_flight, self.max_blocks = max_in_flight, max_blocks
        self.in_flight = 0  # receives posted and not yet scattered (each holds a staging buffer)
        self.queued: dict[str, KVHandoff] = {}  # request id -> hand-off waiting for blocks
        self.reserved: deque[KVHandoff] = deque()  # blocks allocated, receive not yet posted (in-flight cap)
        self.receiving: dict[str, tuple[KVHandoff, object]] = {}  # request id -> (hand-off, its Transfer)
        self.output_lens: dict[str, int | None] = {}  # request id -> its forced output length, until it runs
        self.last_sent = time.monotonic()  # when the last DecodeStep went to the front
        self.keep_steps = keep_steps
        self.steps: list[dict] = []  # the engine's step rows not yet sent (with the next DecodeStep)

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            if engine.has_unfinished_requests():
                timeout = 0.0
            elif self.receiving or self.reserved or self.queued:
                timeout = _BUSY_POLL_S
            else:
                timeout = _IDLE_POLL_S
            while conn.poll(timeout):
                message = conn.recv()
                if message is None:
                    self.link.close()
                    return
                self._take(message)
                timeout = 0.0
            self._admit()
            outputs = self._receive()  # streams get their first token as it arrives
            if engine.has_unfinished_requests():
                outputs += engine.step()
            recorder = engine.recorder
            rows = recorder.requests.copy()
            # The front keeps the rows (or not); nothing grows here in a long-running server.
            recorder.requests.clear()
            if self.keep_steps:
                self.steps += recorder.steps
            recorder.steps.clear()
            now = time.monotonic()
            busy = engine.has_unfinished_requests()
            # While it works, a step with nothing to say still goes out every HEARTBEAT_S: the front
            # takes a decode process silent for transfer_timeout_s with requests in hand for hung.
            # Step rows ride along (at the latest then, or when the engine goes idle).
            if outputs or rows or (busy and now - self.last_sent >= HEARTBEAT_S) or (self.steps and not busy):
                conn.send(DecodeStep([DecodeOutput.of(output) for output in outputs], rows, self.steps))
                self.steps = []
                self.last_sent = now

    def _take(self, message) -> None:
        now = self.engine.now()
        if isinstance(message, HandoffBatch):
            for item in message.handoffs:
                self._enqueue(item, now)
        elif isinstance(message, TransferStarted):
            for request_id in message.request_ids:
                entry = self.receiving.get(request_id)
                if entry is not None:
                    entry[0].transfer_start_time = message.time
        elif isinstance(message, AbortMessage):
            self._abort(message.request_id)
        elif isinstance(message, ClockOrigin):
            self.engine.align_clock(message.origin)
        else:
            raise TypeError(f"unexpected message from the front: {type(message).__name__}")

    def _enqueue(self, message: HandoffMessage, now: float) -> None:
        side, handoff = self.side, message.handoff
        handoff.request.sampling_params = message.sampling_params  # its own copy, unpickled
        if side.enqueue(handoff, now):
            self.queued[handoff.request_id] = handoff
            self.output_lens[handoff.request_id] = message.output_len
        else:
            self.conn.send(Refused(handoff.request_id, "handoff_queue_full", f"the decode engine's hand-off "
                                                                             f"queue is full (max_queue={side.max_queue})"))

    def _abort(self, request_id: str) -> None:
        queued = self.queued.pop(request_id, None)
        if queued is not None and self.side.withdraw(queued):
            self.output_lens.pop(request_id, None)
            self.conn.send(Refused(request_id, "user", "aborted"))
            return
        entry = self.receiving.get(request_id)
        if entry is not None:  # its receive is posted: the transfer runs to its end, then it is dropped
            entry[0].abort_reason = "user"
            return
        for handoff in self.reserved:
            if handoff.request_id == request_id:  # blocks reserved, the front not yet told: dropped here
                self.reserved.remove(handoff)
                handoff.abort_reason = "user"
                self.side.receive(handoff, self.engine.now())  # gives its blocks back
                self._refuse(handoff, "user", "aborted")
                return
        self.engine.abort_request(request_id)  # live here (or ended already: nothing to do)

    def _admit(self) -> None:
        now = self.engine.now()
        for handoff in self.side.expire(now):
            self._refuse(handoff, "handoff_timeout", f"waited longer than queue_timeout_s={self.side.timeout_s} for KV blocks on the "
                                  "decode engine")
        reserved, never = self.side.reserve_ready(now)
        for handoff in never:
            self._refuse(handoff, "too_long", f"its {handoff.num_computed_tokens + 1} tokens (n={len(handoff.first_token_ids)}) "
                                  "never fit the decode engine's KV cache or max_num_seqs")
        for handoff in reserved:
            self.queued.pop(handoff.request_id, None)
        self.reserved.extend(reserved)
        if not self.reserved or self.in_flight >= self.max_in_flight:  # staging memory stays bounded
            return
        kv = self.engine.runner.kv_cache
        for batch in transfer_batches(self.reserved, self.max_blocks)[:self.max_in_flight - self.in_flight]:
            for _ in batch:
                self.reserved.popleft()
            parts = [(h.request_id, list(h.dst_block_ids[:h.num_blocks])) for h in batch]
            # The front is told first: posting the receive (its staging buffer, the backend's call)
            # then overlaps the answer's way to the front. The blocks are allocated already, and a
            # send posted before its receive waits for it on the link's stream, not on a host.
            self.conn.send(Reserved([key for key, _ in parts], [blocks for _, blocks in parts]))
            transfer = self.link.recv(parts, kv.k_caches)
            self.in_flight += 1
            for handoff in batch:
                self.receiving[handoff.request_id] = (handoff, transfer)

    def _refuse(self, handoff: KVHandoff, code: str, reason: str) -> None:
        self.queued.pop(handoff.request_id, None)
        self.output_lens.pop(handoff.request_id, None)
        self.conn.send(Refused(handoff.request_id, code, reason))

    def _receive(self) -> list:
        """Completed receives into their blocks, their requests into the engine; the outputs of
        those that stream."""
        kv, engine, outputs = self.engine.runner.kv_cache, self.engine, []
        for transfer in self.link.poll():
            if transfer.error is not None:
                raise KVTransferError(f"the KV link failed: {transfer.error}")
            self.in_flight -= 1
            self.link.scatter(transfer, kv.k_caches, kv.v_caches)
            for key in transfer.keys:
                handoff, _ = self.receiving.pop(key)
                if handoff.transfer_start_time is None:  # its start message is still on its way
                    handoff.transfer_start_time = handoff.reserved_time
                output_len = self.output_lens.pop(handoff.request_id, None)
                family = self.side.receive(handoff, engine.now())
                if family is None:  # aborted while it moved: the front may still wait for its end
                    self.conn.send(Refused(handoff.request_id, "user", "aborted"))
                else:
                    # No prompt text: it never leaves the front (its outputs go without it).
                    output = engine.take_over_request(handoff.request, None, family, output_len)
                    if output is not None:
                        outputs.append(output)
        return outputs
