"""The requests the disaggregated engine's front (engine/disagg/pd_engine.py) ends itself: faults of
the decode process or the link, and the final outputs made on the front for requests whose tokens
the decode engine never returns.

A fault (the decode process dying, or silent for `transfer_timeout_s` while the front waits for it
(requests decode there, or hand-offs aborted here wait for its answer), or leaving the front's
messages unread that long, or a message of its own unfinished that long, its pipe closing, the
link failing) is seen once (`_fail`): every request past its prefill then ends
with an error within that bound, a hand-off not yet sent frees its prefill blocks here, one whose
send is posted frees them when the link fails it, and later requests are refused. A hand-off the
decode side refuses ends alone (`_fail_handoff`). Kept apart from the front's step loop, which
moves requests; this half only ends them, on the same state.
"""
from __future__ import annotations

import time

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from policies.disagg import KVHandoff


class FrontFaults:
    """Mixed into `DisaggregatedEngine`: every method reads and writes the front's state."""

    __slots__ = ()

    def _fail_handoff(self, handoff: KVHandoff, code: str, reason: str) -> None:
        """A hand-off whose transfer will not happen: aborted with `code` (unless the user aborted it
        already), its prefill blocks freed, its final output `abort:<code>` with `reason`."""
        request_id = handoff.request_id
        self._handoffs.pop(request_id, None)
        now = self.now()
        self.side.abort(request_id, code, now)  # a hand-off aborted already keeps its reason
        self.side.finish_transfer(handoff, now)
        if request_id in self._decoding:
            self._decoding.pop(request_id, None)
            self._done_early.append(self._final(handoff, f"abort:{code}", reason))

    def _fail(self, reason: str) -> None:
        """The decode engine or the link is gone: every request past its prefill ends with an error."""
        if self._failure is not None:
            return
        self._failure = reason
        self.link.fail(reason)
        for request_id in list(self._decoding):
            handoff = self._handoffs.get(request_id)
            if handoff is None:  # transferred: it was decoding
                self._done_early.append(self._error_output(request_id, "abort:error", reason))
            elif request_id not in self._sending:
                self._fail_handoff(handoff, "error", reason)
            else:  # its send fails on the link and frees its blocks; its output goes out now
                self._decoding.pop(request_id, None)
                self._done_early.append(self._final(handoff, "abort:error", reason))
        for request_id, handoff in list(self._handoffs.items()):
            if request_id not in self._sending:  # aborted by the user (its output went out then), its
                self._fail_handoff(handoff, "error", reason)  # `Refused` will never come: blocks freed

    def _check_decode_alive(self) -> None:
        if self._failure is not None:
            return
        # Ended, or its end of the pipe closed (the pipe's reader or writer saw it).
        if not self._decode.alive or self._sender.error is not None or self._receiver.error is not None:
            self._take_messages()  # its own account first, if it sent one
            self._fail(self._decode.gone)
            self._finish_transfers()
            return
        silent = time.monotonic() - self._last_heard  # it sends at least every HEARTBEAT_S while it works
        waiting, waited = self._sender.backlog()  # the front's messages it has not read
        begun = self._receiver.incomplete()  # how long its message being read has been unfinished
        awaited = self._awaited() if silent > self._silence_s else ""
        if awaited or waited > self._silence_s or begun > self._silence_s:
            self._fail(self._hung(silent, awaited, waiting, waited))
            self._finish_transfers()

    def _awaited(self) -> str:
        """What the front waits for from the decode process, in words ('': nothing): requests
        decoding there, or hand-offs aborted here whose answer has not come (their prefill blocks
        are held until it does)."""
        if self._decoding:
            return f"{len(self._decoding)} request(s) decoding"
        unanswered = len(self._handoffs.keys() - self._sending)
        return f"{unanswered} aborted hand-off(s) awaiting its answer" if unanswered else ""

    def _hung(self, silent: float, awaited: str, waiting: int, waited: float) -> str:
        """Why the decode engine is taken for hung: silent while the front waits for it, not reading,
        or stopped mid-message."""
        signs = []
        if awaited:
            signs.append(f"nothing from it for {silent:.1f} s with {awaited}")
        unfinished = self._receiver.unfinished()
        if unfinished:
            signs.append(unfinished)
        if waiting:
            signs.append(f"{waiting} message(s) to it waiting to be sent, the oldest for {waited:.1f} s "
                         "(it is not reading its pipe)")
        return (f"the decode engine is hung (pid {self._decode.process.pid}): {'; '.join(signs)} "
                f"(transfer_timeout_s={self._silence_s:g})")

    def _send(self, message) -> None:
        """Queued for the pipe's sender thread: the front never waits for the decode loop to read
        (a decode engine that leaves it unread for transfer_timeout_s is failed as hung). Nothing
        goes to a failed decode engine but the stop (`close`)."""
        if self._failure is not None:
            return
        try:
            self._sender.send(message)
        except OSError:
            self._fail(self._decode.gone)

    # ---- outputs made here -------------------------------------------------------------------
    def _final(self, handoff: KVHandoff, reason: str, error: str | None) -> RequestOutput:
        request = handoff.request
        self._params.pop(request.request_id, None)
        prompt = self._prompts.pop(request.request_id, None)
        self._output_lens.pop(request.request_id, None)
        completions = [CompletionOutput(i, "", [token], reason) for i, token in enumerate(handoff.first_token_ids)]
        return RequestOutput(request.request_id, prompt, request.prompt_token_ids, completions, finished=True,
                             metrics=RequestMetrics(request.arrival_time, handoff.first_scheduled_time,
                                                    finished_time=self.now()), error=error)

    def _error_output(self, request_id: str, finish_reason: str, error: str | None) -> RequestOutput:
        """The final output of a request that was decoding (or arriving) at the decode process, whose
        hand-off is gone (its output tokens are not known here; its prompt is); it stops decoding."""
        self._params.pop(request_id, None)
        prompt = self._prompts.pop(request_id, None)
        prompt_token_ids = self._decoding.pop(request_id, None) or []
        self._output_lens.pop(request_id, None)
        return RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(0, "", [], finish_reason)],
                             finished=True, error=error)

