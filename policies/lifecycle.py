"""What happens to sequences around the scheduling decisions: arrival, sampled tokens and the stop
rules, forking parallel samples, finishing and aborting, and the bookkeeping of live requests.

The stop rules, checked per sampled token, are `StopRule`s (policies/stop_rule.py), one per live sequence.
A request ends when all its sequences have; its finish_reason is then sample 0's ("abort:<why>"
when aborted). Ended requests are handed out once by `take_ended` (and aborted ones once more by
`take_aborted`, for `SchedulerOutput.aborted`).

On a prefill replica of a disaggregated fleet a `PrefillSide` (policies/disagg/) sets `handoff`:
sequences then end at their first token with reason "handoff" (policies/stop_rule.py), keep their
blocks, and their request goes to `handoff.hand_off` instead of ending here. `adopt` is the decode
side's door: sequences built from a hand-off join the running queue as a live request.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from policies.blocks.base import BlockManager
from policies.output_lens import holds_output_len
from policies.outputs import SameTokens, ScheduledSeq, SchedulerOutput
from policies.preemption import Preemptor
from policies.queues import SchedulerQueues, seq_cost
from policies.request import Request
from policies.sampling_path import may_need_full_sampler
from policies.sequence import PENDING, Sequence, SequenceStatus
from policies.stop_rule import HANDOFF_REASON, STOPPED, StopRule
from policies.trace import TraceRecorder

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED
ABORTED = SequenceStatus.FINISHED_ABORTED
FINISHED = SequenceStatus.FINISHED_STOPPED  # statuses >= this are finished


class Lifecycle:
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
                    self._fork(seq, _tokens_for(seq, num_samples, new_token_ids), now, stop_seq_ids)
                continue
            try:
                (token,) = new_token_ids[seq.seq_id]
            except (KeyError, TypeError, ValueError):
                _tokens_for(seq, 1, new_token_ids)  # raises a ValueError naming the sequence
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

    # ---- one step ahead (policies/lookahead.py) -----------------------------------------------
    def look_past(self, out: SchedulerOutput, output_lens: Mapping[str, int] | None,
                  sampled: list[Sequence]) -> list[tuple[Sequence, SequenceStatus, str]]:
        """`apply` before the tokens are known: progress advances, each sampling sequence gets a
        PENDING token (listed in `sampled`); returns the sequences a length rule ends (a forced
        output length as "stop", as `apply` treats stop_seq_ids)."""
        mark = self._mark_computed
        mask = 0 if out.copy else self._block_mask
        stop_rules, ending = self.stop_rules, []
        for seq, num_new, num_samples in out.scheduled:
            computed = seq.num_computed_tokens + num_new
            seq.num_computed_tokens = computed
            if mark is not None and (num_new != 1 or not computed & mask):
                mark(seq)
            if not num_samples:
                continue
            seq.token_ids.append(PENDING)
            sampled.append(seq)
            # PENDING is no stop token: only the length rules and a forced output length apply
            # (most sequences are below their length limit with no stop token: `ending` is skipped).
            forced = bool(output_lens) and holds_output_len(seq, output_lens)
            rule = stop_rules[seq]
            if forced or computed >= rule.stop_len or rule.stops is not None:
                end = rule.ending(PENDING, forced, computed)
                if end is not None:
                    ending.append((seq, *end))
        return ending

    def settle(self, sampled: list[Sequence], ending: list[Sequence], new_token_ids: dict[int, list[int]],
               now: float, stop_seq_ids: Collection[int]) -> None:
        """The token side of a looked-past step: each PENDING token gets its value and time, stop
        tokens and `stop_seq_ids` end their sequences (one step late: they sit in the step in
        flight, so it is marked aborted in flight), and the length-ended requests end."""
        stop_rules, first_token = self.stop_rules, self.recorder.first_token
        # Without stop tokens and the backend's stops, no token ends a sequence here.
        may_stop = bool(stop_seq_ids) or self.num_with_stops > 0
        # One token for every sequence (SameTokens): read once, not looked up per sequence.
        same = new_token_ids.tokens if type(new_token_ids) is SameTokens else None
        for seq in sampled:
            rule = stop_rules.get(seq)
            if rule is None or seq.status is ABORTED:
                continue  # its request was aborted since
            try:
                (token,) = same or new_token_ids[seq.seq_id]
            except (KeyError, TypeError, ValueError):
                _tokens_for(seq, 1, new_token_ids)  # raises a ValueError naming the sequence
                raise
            seq.token_ids[-1] = token
            times = rule.token_times
            if times is not None:
                if not times:
                    first_token(seq, now)
                times.append(now)
            if not may_stop:
                continue
            # The length rules were applied when the step was looked past; a stop condition now
            # (a stop token or the backend's stop, else `ending` is skipped).
            stopped = bool(stop_seq_ids) and seq.seq_id in stop_seq_ids
            if (stopped or (rule.stops is not None and token in rule.stops)) \
                    and rule.ending(token, stopped, seq.num_computed_tokens) is STOPPED:
                if seq.status is RUNNING:
                    self._finish(seq, SequenceStatus.FINISHED_STOPPED, "stop", now)
                    self.aborted_in_flight = True
                elif seq.status is SequenceStatus.FINISHED_LENGTH:  # a stop wins over a length limit
                    if seq.finish_reason == HANDOFF_REASON and self.handoff is not None:
                        self.handoff.release(seq)  # kept for a hand-off that no longer happens
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED_STOPPED, "stop"
        self.end_retired(ending, now)

    def end_retired(self, retired: list[Sequence], now: float) -> None:
        """The requests of sequences a looked-past step ended (policies/lookahead.py: `retire`) end
        at its update, once all their sequences have."""
        for seq in retired:
            family = self.families.get(seq.request.request_id)
            if family is not None and all(s.status >= FINISHED for s in family):
                seq.request.finish_reason = family[0].finish_reason
                self._end(seq.request, family, now, aborted=False)

    @property
    def has_pending_ends(self) -> bool:
        """Requests ended since the last update, or sequences aborted in flight."""
        return bool(self._ended or self._aborted or self.aborted_in_flight)

    def decode_steps_before_stop(self, seqs: list[Sequence], token: int, max_steps: int) -> int | None:
        """How many decode steps (<= max_steps) of `seqs` sampling `token` everywhere finish none of
        them: the step where one reaches its length limit, or may stop on `token`, is not counted.
        None when one's first token is still to come (a first_token event: no step is a run's)."""
        limit, stop_rules = max_steps, self.stop_rules
        for seq in seqs:
            rule = stop_rules[seq]
            times = rule.token_times
            if times is not None and not times:
                return None
            # Without stop tokens the length limit alone (StopRule.decode_steps_before_end).
            steps = rule.stop_len - seq.num_computed_tokens - 1 if rule.stops is None \
                else rule.decode_steps_before_end(seq.num_computed_tokens, token)
            if steps < limit:
                limit = steps
        return max(limit, 0)

    def stops_known_ahead(self, seqs: list[Sequence], token: int) -> bool:
        """Whether no sequence of `seqs` may stop on `token` (nor on PENDING): a step of them sampling
        `token` ends only sequences a length rule ends, which its look-past knows."""
        if not self.num_with_stops:
            return True
        stop_rules = self.stop_rules
        for seq in seqs:
            stops = stop_rules[seq].stops
            if stops is not None and (token in stops or PENDING in stops):
                return False
        return True

    def length_endings(self, seqs: list[Sequence], output_lens: Mapping[str, int] | None,
                       ) -> list[tuple[Sequence, SequenceStatus, str]]:
        """The sequences of a decode step whose progress is in that the step's look-past ends (as
        `look_past` finds them: length rules and forced output lengths)."""
        ending, stop_rules = [], self.stop_rules
        for seq in seqs:
            forced = bool(output_lens) and holds_output_len(seq, output_lens)
            rule = stop_rules[seq]
            # Below its length limit with no stop token and no forced length, `ending` is None.
            if forced or seq.num_computed_tokens >= rule.stop_len or rule.stops is not None:
                end = rule.ending(PENDING, forced, seq.num_computed_tokens)
                if end is not None:
                    ending.append((seq, *end))
        return ending

    def append_decode_run(self, seqs: list[Sequence], token: int, times: list[float]) -> None:
        """The token side of len(times) - 1 decode steps (step s ends at times[s + 1]) of seqs that
        already have their first token: each gets `token` per step, sample 0s their token times."""
        tokens, stamps, stop_rules = [token] * (len(times) - 1), times[1:], self.stop_rules
        for seq in seqs:
            seq.token_ids.extend(tokens)
            token_times = stop_rules[seq].token_times
            if token_times is not None:
                token_times.extend(stamps)

    def finish_decode_run(self, seqs: list[Sequence], token: int, now: float,
                          output_lens: Mapping[str, int] | None) -> None:
        """The stop rules of a decode run's last step, whose token is in (as `apply`, seq by seq;
        `output_lens` as the simulator's stop_seq_ids)."""
        for seq in seqs:
            stopped = bool(output_lens) and holds_output_len(seq, output_lens)
            self._end_if_stopped(seq, token, stopped, seq.num_computed_tokens, now)

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


def _tokens_for(seq: Sequence, num_samples: int, new_token_ids: dict[int, list[int]]) -> list[int]:
    tokens = new_token_ids.get(seq.seq_id) if isinstance(new_token_ids, dict) else None
    if not isinstance(tokens, (list, tuple)) or len(tokens) != num_samples:
        raise ValueError(f"new_token_ids[{seq.seq_id}]={tokens!r} is invalid: sequence {seq.seq_id} "
                         f"was scheduled to sample {num_samples} token(s)")
    return list(tokens)
