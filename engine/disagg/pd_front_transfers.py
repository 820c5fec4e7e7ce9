"""How the disaggregated engine's front (engine/disagg/pd_engine.py) moves requests to the decode
process: the requests one prefill step handed off go out as one `HandoffBatch`; the decode
process's messages are taken in turn (`Reserved` -> one send on the KV link of every request it
names, gathered in one launch on the link's side stream; `Refused` -> that request ends with an
error; `DecodeStep` -> the decode engine's outputs, their prompts put back (they cross the pipe
without them); `DecodeFailed` -> the pair fails); each transfer
the link finished frees its prefill blocks (`PrefillSide.finish_transfer`). Kept apart from the
front's step loop and interface, on the same state; how the front ends requests itself is
engine/disagg/pd_front_faults.py.
"""
from __future__ import annotations

import time

from engine.disagg.kv_transfer_message import KVTransferError
from engine.disagg.messages import (
    DecodeFailed,
    DecodeOutput,
    DecodeStep,
    HandoffBatch,
    HandoffMessage,
    Refused,
    Reserved,
    TransferStarted,
)
from engine.disagg.pd_front_faults import FrontFaults
from engine.offline.outputs import RequestOutput
from policies.disagg import KVHandoff

# How long the front's read of the decode process's messages waits for one whose bytes have come
# and that the pipe's reader thread has not queued yet (it needs the interpreter lock, which the
# front's loop holds while it works): ~0.1 ms when it does, never more than this (PipeReceiver.poll).
ARRIVING_S = 0.002


class FrontTransfers(FrontFaults):
    """Mixed into `DisaggregatedEngine`: every method reads and writes the front's state."""

    __slots__ = ()

    def _hand_off_all(self, handoffs: list[KVHandoff]) -> None:
        """The hand-offs of one prefill step go to the decode process as one `HandoffBatch` (one
        pickle, one pipe write: per request, a message of its own cost more than the rest of its
        hand-off)."""
        messages = [message for message in map(self._hand_off, handoffs) if message is not None]
        if messages:
            self._send(HandoffBatch(messages))

    def _hand_off(self, handoff: KVHandoff) -> HandoffMessage | None:
        """`handoff`'s request leaves the prefill engine; its message to the decode process (None:
        it ended here, the decode side having failed)."""
        request_id = handoff.request_id
        self.prefill.hand_over_request(request_id)
        self._handoffs[request_id] = handoff
        if self._failure is not None:  # prefilled after the decode side failed: it ends here, with the error
            self._fail_handoff(handoff, "error", self._failure)
            self._done_early.append(self._final(handoff, "abort:error", self._failure))
            return None
        if not self._decoding:  # work after a time with none: its silence counts from now
            self._last_heard = time.monotonic()
        self._decoding[request_id] = handoff.request.prompt_token_ids  # its outputs get it back here
        # Pickled as it is (the decode side's copy takes the caller's params): no copies made here.
        return HandoffMessage(handoff, self._params[request_id], self._output_lens.pop(request_id, None))

    def _take_messages(self) -> list[RequestOutput]:
        """The decode process's messages, in the order they came: those read during the last prefill
        step and left for this turn first, then the pipe's."""
        outputs: list[RequestOutput] = []
        left, self._left_for_turn = self._left_for_turn, []
        for message in left:
            if self._failure is None:
                self._take(message, outputs)
        try:
            arriving = ARRIVING_S  # once a turn: messages that keep coming never hold the loop
            while self._failure is None and self._receiver.poll(0, arriving):
                arriving = 0.0
                message = self._receiver.recv()
                self._last_heard = time.monotonic()
                self._take(message, outputs)
        except (EOFError, OSError):
            self._fail(self._decode.gone)
        return outputs

    def _take(self, message: object, outputs: list[RequestOutput]) -> None:
        if isinstance(message, Reserved):
            try:
                self._start_transfer(message)
            except KVTransferError as e:  # the link failed before its completion thread said so
                self._fail(str(e))
        elif isinstance(message, Refused):
            request_id = message.request_id
            handoff = self._handoffs.get(request_id)
            if handoff is not None and request_id not in self._sending:
                self._fail_handoff(handoff, message.code, f"the decode engine refused it: {message.reason}")
            elif handoff is None and request_id in self._decoding:  # aborted as its KV arrived
                outputs.append(self._error_output(request_id, f"abort:{message.code}", None))
        elif isinstance(message, DecodeStep):
            if self._keep_trace:
                self.decode_rows.extend(message.rows)
                self.decode_steps.extend(message.steps)
            outputs += self._decode_outputs(message.outputs)
        elif isinstance(message, DecodeFailed):
            self._fail(f"the decode engine failed: {message.error.splitlines()[0]}")

    def _while_prefilling(self, slice_s: float) -> bool:
        """The prefill runner's host work while a step runs (`ModelRunner.while_waiting`, with
        `sends_mid_step`): a `Reserved` answer posts its send at once, beside the step, instead of
        a step later; the decode process's other messages wait, in order, for the loop's next turn
        (they change the prefill engine's state or make outputs, which the step's caller returns).
        Waits up to `slice_s` for a message; False once no hand-off awaits an answer."""
        if self._failure is not None or len(self._sending) >= len(self._handoffs):
            return False
        try:
            if self._receiver.poll(slice_s):
                message = self._receiver.recv()
                self._last_heard = time.monotonic()
                if not isinstance(message, Reserved):
                    self._left_for_turn.append(message)
                    return True
                try:
                    self._start_transfer(message, mid_step=True)
                except KVTransferError:  # failing the pair frees blocks: at the next turn, between steps
                    self._left_for_turn.append(message)
                    return False
        except (EOFError, OSError):
            return False  # the next turn's read meets the same end and fails the pair
        return True

    def _start_transfer(self, message: Reserved, mid_step: bool = False) -> None:
        """One send of every request the decode side reserved together (one gather, one message).
        Mid-step, or scheduled ahead, the compute stream runs a later step than the blocks' own
        (collected: its tokens were read back), which the gather need not wait for."""
        now = self.now()
        handoffs = [self._handoffs[request_id] for request_id in message.request_ids]
        for handoff, dst in zip(handoffs, message.dst_block_ids, strict=True):
            handoff.dst_block_ids = list(dst)
            handoff.transfer_start_time = now
        kv = self.prefill.runner.kv_cache
        self.link.send([(h.request_id, h.block_ids) for h in handoffs], kv.k_caches, kv.v_caches,
                       after_compute=not (mid_step or self.config.prefill_async_scheduling))
        self._sending.update(message.request_ids)
        self._send(TransferStarted(list(message.request_ids), now))

    def _finish_transfers(self) -> None:
        for transfer in self.link.poll():
            now = self.now()
            if transfer.error is not None:
                self._fail(str(transfer.error))
            for key in transfer.keys:
                handoff = self._handoffs.pop(key)
                self._sending.discard(key)
                if transfer.error is not None:
                    self.side.abort(key, "error", now)
                self.side.finish_transfer(handoff, now)

    def _decode_outputs(self, outputs: list[DecodeOutput]) -> list[RequestOutput]:
        """The decode engine's outputs as the user sees them: each with its prompt (text and token
        ids) held here; a request's last one drops what the front kept for it."""
        kept, decoding, prompts = [], self._decoding, self._prompts
        for output in outputs:
            request_id = output.request_id
            prompt_token_ids = decoding.get(request_id)
            if prompt_token_ids is None:
                continue  # aborted here while it moved: its final output went out then
            if output.finished:
                del decoding[request_id]
                self._params.pop(request_id, None)
            prompt = prompts.pop(request_id, None) if output.finished else prompts.get(request_id)
            kept.append(output.with_prompt(prompt, prompt_token_ids))
        return kept
