"""The prefill side of a hand-off: a prefill replica's `Scheduler` that hands requests off after
their first token and keeps their KV blocks until the transfer is done.

    side = PrefillSide(scheduler, block_bytes=kv_block_bytes(shape, block_size, tp), replica=0)
    ...  scheduler.schedule / update as always ...
    for handoff in side.take_handoffs():        # after each update: prefills that finished
        ...  a decode replica reserves blocks (DecodeSide.reserve), the backend moves the bytes ...
        side.finish_transfer(handoff, now)      # done (or given up): blocks freed, exactly once

A request whose prompt is computed and whose first token is sampled leaves the running queue as
"transferring": it is no longer in the scheduler (`Scheduler.abort` no longer knows it, `update`
does not return it) and its sequences keep their blocks. A request that ends on the prefill side
for good (its first token is a stop token, max_tokens=1, an abort before its first token) ends
here as in a co-located run, with its row in this replica's trace.

Parallel sampling (n > 1): the prompt forks here as usual, each sample gets its first token; the
hand-off carries every sample's first token and moves the prompt's blocks once (the samples share
them); samples that already stopped come along as finished.

Abort while transferring (`abort`): the hand-off is marked; the backend stops it where it is (a
queued hand-off is dropped, a transfer in flight runs to its end: its source blocks are being read)
and calls `finish_transfer`, which frees the blocks and writes the request's aborted row here.
"""
from __future__ import annotations

from policies.disagg.handoff import KVHandoff
from policies.request import Request
from policies.sequence import Sequence
from policies.stop_rule import HANDOFF_REASON


class PrefillSide:
    def __init__(self, scheduler, block_bytes: int, replica: int = 0) -> None:
        """`scheduler`: a fresh `policies.Scheduler` (no request added yet); `block_bytes`: one KV
        block's bytes per tensor-parallel rank (`kv_block_bytes`)."""
        if scheduler.lifecycle.seen:
            raise ValueError("PrefillSide needs a scheduler no request was added to yet")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes!r} is invalid: must be an integer >= 1")
        self.scheduler = scheduler
        self.block_bytes = block_bytes
        self.replica = replica
        scheduler.lifecycle.handoff = self
        scheduler.lifecycle.transfer_sides.append(self)
        self.transferring: dict[str, KVHandoff] = {}  # request id -> its hand-off, until finish_transfer
        self._held: dict[str, list[Sequence]] = {}  # request id -> its sequences (holding blocks)
        self._ready: list[KVHandoff] = []  # handed off since the last take_handoffs
        # Sequences that ended "handoff" while their request has not (a step looked past ended
        # them; the request is handed off at that step's update): their blocks are kept.
        self._kept: set[int] = set()
        self.num_handed_off = 0  # transfers finished, aborted ones excluded

    # ---- called by the scheduler's Lifecycle -----------------------------------------------------
    def hand_off(self, request: Request, family: list[Sequence], now: float) -> None:
        """Every sample of `request` has its first token and one or more of them end "handoff"."""
        seq0 = family[0]
        computed = seq0.num_computed_tokens
        holder = next(s for s in family if s.finish_reason == HANDOFF_REASON)
        block_ids = list(holder.block_table[:-(-computed // self.scheduler.block_manager.block_size)])
        first_scheduled, num_preemptions = self.scheduler.recorder.live_progress(request.request_id)
        handoff = KVHandoff(
            request=request, num_computed_tokens=computed,
            first_token_ids=[s.token_ids[s.num_prompt_tokens] for s in family],
            finished_samples={s.sample_index: s.finish_reason for s in family if s.finish_reason != HANDOFF_REASON},
            block_ids=block_ids, num_bytes=len(block_ids) * self.block_bytes, prefill_replica=self.replica,
            prefill_end_time=now, first_scheduled_time=first_scheduled, num_preemptions=num_preemptions)
        self._kept.difference_update(s.seq_id for s in family)
        self.transferring[request.request_id] = handoff
        self._held[request.request_id] = family
        self._ready.append(handoff)

    def keep(self, seq: Sequence) -> None:
        """`seq` ended "handoff": its blocks stay until the transfer (its request's hand-off follows)."""
        self._kept.add(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """A kept sequence will not be handed off after all (its token turned out to stop it, or its
        request was aborted before the update of the step that ended it)."""
        self._kept.discard(seq.seq_id)
        self.scheduler.block_manager.free(seq)

    # ---- called by the backend -------------------------------------------------------------------
    def take_handoffs(self) -> list[KVHandoff]:
        """The hand-offs made since the last call, in the order their prefills finished."""
        ready, self._ready = self._ready, []
        return ready

    def abort(self, request_id: str, reason: str, now: float) -> bool:
        """Abort a request here: still scheduled (`Scheduler.abort`), or transferring (its hand-off
        gets `abort_reason`; module docstring). False for an unknown or ended one."""
        if self.scheduler.abort(request_id, reason, now):
            return True
        handoff = self.transferring.get(request_id)
        if handoff is None or handoff.abort_reason is not None:
            return False
        handoff.abort_reason = str(reason)
        return True

    def finish_transfer(self, handoff: KVHandoff, now: float) -> Request | None:
        """The transfer of `handoff` is over (done, or stopped for an abort): its blocks are freed,
        and the request leaves this replica: handed over to the decode side's trace, or, aborted,
        with its aborted row written here (then returned, as `update` returns ended requests).
        A second call for the same hand-off is a ValueError (blocks are freed exactly once)."""
        family = self._held.pop(handoff.request_id, None)
        if family is None or self.transferring.get(handoff.request_id) is not handoff:
            raise ValueError(f"hand-off of {handoff.request_id!r} is not transferring from replica {self.replica} "
                             "(finished already, or never handed off here)")
        del self.transferring[handoff.request_id]
        free = self.scheduler.block_manager.free
        for seq in family:
            if seq.finish_reason == HANDOFF_REASON:  # the others freed theirs when they stopped
                free(seq)
        request, recorder = handoff.request, self.scheduler.recorder
        if handoff.abort_reason is None:
            recorder.hand_over(request, now)
            self.num_handed_off += 1
            return None
        request.finish_reason = f"abort:{handoff.abort_reason}"
        for seq in family:
            if seq.finish_reason == HANDOFF_REASON:
                seq.status, seq.finish_reason = seq.status.FINISHED_ABORTED, request.finish_reason
        recorder.aborted(request, family, now)
        return request

    @property
    def holds_blocks(self) -> bool:
        """Whether a transfer holds blocks here (admission waits for them rather than giving up)."""
        return bool(self._held or self._kept)

    def held_sequences(self) -> list[Sequence]:
        """Sequences whose blocks are held for a transfer (the block manager's invariants count them)."""
        return [seq for family in self._held.values() for seq in family if seq.finish_reason == HANDOFF_REASON]
