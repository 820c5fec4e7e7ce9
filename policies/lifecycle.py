"""What happens to sequences around the scheduling decisions: arrival, sampled tokens and the stop
rules, forking parallel samples, finishing and aborting, and the bookkeeping of live requests.

The stop rules, checked per sampled token, are `StopRule`s (policies/stop_rule.py), one per live sequence.
A request ends when all its sequences have; its finish_reason is then sample 0's ("abort:<why>"
when aborted). Ended requests are handed out once by `take_ended` (and aborted ones once more by
`take_aborted`, for `SchedulerOutput.aborted`).

On a prefill replica of a disaggregated fleet a `PrefillSide` (policies/disagg/) sets `handoff`:
sequences then end at their first token with reason "handoff" (policies/stop_rule.py), keep their
blocks, and their request goes to `handoff.hand_off` instead of ending here. `adopt` is the decode
side's door: sequences built from a hand-off join the running queue as a live request (listed in
`joined` until the next schedule(): the step in flight may be looked past with them, lookahead.py).

Steps looked past before their tokens are known, and decode runs applied at once, are applied by
the `TokensAhead` half (policies/lifecycle_ahead.py).
"""
from __future__ import annotations

from collections.abc import Collection

from policies.blocks.base import BlockManager
from policies.lifecycle_ahead import TokensAhead, tokens_for
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.preemption import Preemptor
from policies.queues import SchedulerQueues, seq_cost
from policies.request import Request
from policies.sampling_path import may_need_full_sampler
from policies.sequence import Sequence, SequenceStatus
from policies.stop_rule import HANDOFF_REASON, StopRule
from policies.trace import TraceRecorder

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED
FINISHED = SequenceStatus.FINISHED_STOPPED  # statuses >= this are finished


class Lifecycle(TokensAhead):
    def __init__(self, queues: SchedulerQueues, block_manager: BlockManager, recorder: TraceRecorder,
                 preemptor: Preemptor, max_model_len: int) -> None:
        self.queues = queues
        self.block_manager = block_manager
        self.recorder = recorder
        self.preemptor = preemptor
        self.max_model_len = max_model_len
        self.families: dict[str, list[Sequence]] = {}  # live request id -> its sequences, sample order
        self.seen: set[str] = set()
        self.stop_rules: dict[Sequence, StopRule] = {}  # per live sequence
        self.decode_entries: dict[Sequence, ScheduledSeq] = {}  # reused by every decode step
        self.aborted_in_flight = False  # a running sequence was aborted after schedule()
        self.num_full_sampler = 0  # live requests that may need the full sampler (policies/sampling_path.py)
        self.num_with_stops = 0  # live sequences with stop tokens (`StopRule.stops`)
        overridden = type(block_manager).mark_computed is not BlockManager.mark_computed
        self._mark_computed = block_manager.mark_computed if overridden else None
        self._block_mask = block_manager.block_size - 1
        self._ended: list[Request] = []
        self._aborted: list[Request] = []
        self._next_seq_id = 0
        self.handoff = None  # a policies.disagg.PrefillSide on a prefill replica
        self.transfer_sides: list = []  # Prefill/DecodeSides holding blocks of sequences outside the queues
        self.joined: list[Sequence] = []  # sequences `adopt` put in the running queue since the last schedule()

    def arrive(self, request: Request, now: float) -> None:
        """A validated, new request: its first sequence joins the waiting queue."""
        self.seen.add(request.request_id)
        seq = Sequence.from_request(self.new_seq_id(), request)
        seq.arrival_index = len(self.seen) - 1
        self.families[request.request_id] = [seq]
        self.num_full_sampler += may_need_full_sampler(request.sampling_params)
        self.recorder.arrived(request, now)
        self._register(seq)
        self.queues.add_waiting(seq)

    def adopt(self, request: Request, family: list[Sequence], now: float) -> None:
        """Sequences built elsewhere (a decode replica receiving a hand-off: blocks allocated,
        progress and first tokens set) join as a live request, each in the running queue, or
        finished where its sample already ended."""
        self.seen.add(request.request_id)
        self.families[request.request_id] = family
        self.num_full_sampler += may_need_full_sampler(request.sampling_params)
        for seq in family:
            seq.arrival_index = len(self.seen) - 1
            self._register(seq)
            if not seq.is_finished:
                self.queues.add_running(seq)
                self.joined.append(seq)

    def blocks_in_transfer(self) -> bool:
        """Whether a hand-off holds blocks of this pool (they come back when its transfer ends)."""
        return any(side.holds_blocks for side in self.transfer_sides)

    def release_blocks(self, seq: Sequence, reason: str) -> None:
        """Free an ending sequence's blocks, unless it is handed off: the prefill side keeps them
        until its transfer is done (`PrefillSide.finish_transfer`)."""
        if reason != HANDOFF_REASON or self.handoff is None:
            self.block_manager.free(seq)
        else:
            self.handoff.keep(seq)

    def take_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    def take_aborted(self) -> list[Request]:
        aborted, self._aborted = self._aborted, []
        return aborted

    # ---- after a step -----------------------------------------------------------------------
    def apply(self, out: SchedulerOutput, new_token_ids: dict[int, list[int]], now: float,
              stop_seq_ids: Collection[int]) -> None:
        """Advance progress and append the sampled tokens of every scheduled sequence (the hot loop:
        one decode token per sequence)."""
        scheduled = out.scheduled
        if self.aborted_in_flight:  # sequences aborted between schedule() and update() advance nothing
            self.queues.kv_tokens -= sum(num_new for seq, num_new, _ in scheduled if seq.status is not RUNNING)
            scheduled = [entry for entry in scheduled if entry.seq.status is RUNNING]
            self.aborted_in_flight = False
        mark = self._mark_computed
        # mark_computed is due after a prefill chunk, after a decode that fills a block, and after
        # any step that ran block copies (contiguous releases their sources then).
        mask = 0 if out.copy else self._block_mask
        stop_rules, first_token, finish = self.stop_rules, self.recorder.first_token, self._finish
        for seq, num_new, num_samples in scheduled:
            computed = seq.num_computed_tokens + num_new
            seq.num_computed_tokens = computed
            if mark is not None and (num_new != 1 or not computed & mask):
                mark(seq)
            if num_samples != 1:
                if num_samples:
                    self._fork(seq, tokens_for(seq, num_samples, new_token_ids), now, stop_seq_ids)
                continue
            try:
                (token,) = new_token_ids[seq.seq_id]
            except (KeyError, TypeError, ValueError):
                tokens_for(seq, 1, new_token_ids)  # raises a ValueError naming the sequence
                raise
            seq.token_ids.append(token)
            rule = stop_rules[seq]
            times = rule.token_times
            if times is not None:
                if not times:
                    first_token(seq, now)
                times.append(now)
            # The sampled token is the first one without KV: num_tokens == computed + 1. Below its
            # length limit, only a stop token or the backend's stop can end it (so most skip `ending`).
            stops = rule.stops
            if computed >= rule.stop_len or (stops is not None and token in stops) or stop_seq_ids:
                ending = rule.ending(token, bool(stop_seq_ids) and seq.seq_id in stop_seq_ids, computed)
                if ending is not None:
                    finish(seq, *ending, now)

    def _append_token(self, seq: Sequence, token: int, now: float, stop_seq_ids: Collection,
                      stopped: bool = False) -> None:
        """`stopped`: the backend saw this token complete a stop string (besides `stop_seq_ids`)."""
        seq.token_ids.append(token)
        times = self.stop_rules[seq].token_times
        if times is not None:
            if not times:
                self.recorder.first_token(seq, now)
            times.append(now)
        stopped = stopped or (bool(stop_seq_ids) and seq.seq_id in stop_seq_ids)
        self._end_if_stopped(seq, token, stopped, len(seq.token_ids) - 1, now)

    def _end_if_stopped(self, seq: Sequence, token: int, stopped: bool, computed: int, now: float) -> None:
        ending = self.stop_rules[seq].ending(token, stopped, computed)
        if ending is not None:
            self._finish(seq, *ending, now)

    def _fork(self, parent: Sequence, tokens: list[int], now: float, stop_seq_ids: Collection[int]) -> None:
        """A parallel-sampling prompt is done: n - 1 children share its blocks (copy-on-write) and
        join the running queue right after it; each sample gets one of the n tokens."""
        family = self.families[parent.request.request_id]
        children = []
        for sample_index in range(1, len(tokens)):
            child = parent.fork(self.new_seq_id(), sample_index)
            self.block_manager.fork(parent, child)
            family.append(child)
            self._register(child)
            self.queues.add_running(child, cost=0)  # the parent held n slots since admission
            children.append(child)
        self.decode_entries[parent] = ScheduledSeq(parent, 1, 1)
        for seq, token in zip([parent, *children], tokens):
            # A child's first token is named (parent seq id, sample index): its id is new here.
            stopped = bool(stop_seq_ids) and (parent.seq_id, seq.sample_index) in stop_seq_ids
            self._append_token(seq, token, now, stop_seq_ids, stopped)

    # ---- endings ----------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus, reason: str, now: float) -> None:
        self.queues.remove(seq)
        self.release_blocks(seq, reason)
        seq.status, seq.finish_reason = status, reason
        family = self.families[seq.request.request_id]
        if all(s.status >= FINISHED for s in family):
            seq.request.finish_reason = family[0].finish_reason  # sample 0 speaks for the request
            self._end(seq.request, family, now, aborted=False)

    def abort(self, request: Request, reason: str, now: float) -> None:
        """End a live request: every unfinished sequence leaves its queue and frees its blocks."""
        family = self.families[request.request_id]
        for seq in family:
            status = seq.status
            if status >= FINISHED:
                if seq.finish_reason == HANDOFF_REASON and self.handoff is not None:
                    # Ended at its first token by a step looked past, not yet handed off: the hand-off
                    # no longer happens, so its kept blocks go (a later step may reuse them: it runs
                    # after the step in flight, which writes them last).
                    self.handoff.release(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED_ABORTED, f"abort:{reason}"
                continue
            if not (status is WAITING and self.preemptor.discard(seq)):
                self.queues.remove(seq)
            if status is RUNNING or status is SWAPPED:
                self.block_manager.free(seq)
                self.aborted_in_flight = True
            seq.status, seq.finish_reason = SequenceStatus.FINISHED_ABORTED, f"abort:{reason}"
        request.finish_reason = f"abort:{reason}"
        self._end(request, family, now, aborted=True)

    def _end(self, request: Request, family: list[Sequence], now: float, aborted: bool) -> None:
        del self.families[request.request_id]
        self.num_full_sampler -= may_need_full_sampler(request.sampling_params)
        for seq in family:
            rule = self.stop_rules.pop(seq, None)
            if rule is not None and rule.stops is not None:
                self.num_with_stops -= 1
            self.decode_entries.pop(seq, None)
        if not aborted and self.handoff is not None and any(s.finish_reason == HANDOFF_REASON for s in family):
            request.finish_reason = None  # not ended: its decode replica ends it
            self.handoff.hand_off(request, family, now)
            return
        if aborted:
            self.recorder.aborted(request, family, now)
            self._aborted.append(request)
        else:
            self.recorder.finished(request, family, now)
        self._ended.append(request)

    # ---- bookkeeping ------------------------------------------------------------------------
    def new_seq_id(self) -> int:
        """A sequence id unused by this scheduler (also the decode side's, for adopted sequences)."""
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _register(self, seq: Sequence) -> None:
        times = self.recorder.token_list(seq.request) if seq.sample_index == 0 else None
        rule = self.stop_rules[seq] = StopRule.of(seq, self.max_model_len, times, self.handoff is not None)
        self.num_with_stops += rule.stops is not None
        # A decode samples n tokens only for an unforked parallel prompt's last token.
        self.decode_entries[seq] = ScheduledSeq(seq, 1, seq_cost(seq))

