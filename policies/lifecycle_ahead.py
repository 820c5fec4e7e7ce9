"""The `Lifecycle`'s side of steps whose tokens come later or in bulk: a step looked past before its
tokens are known (policies/lookahead.py: `look_past`, then `settle` once they are in) and a run of
decode steps applied at once (policies/decode_run.py: how many steps end nothing, then the run's
tokens and its last step's stop rules). Kept apart from the per-step rules (policies/lifecycle.py)
because only the two fast paths call it; it acts on the same state and ends sequences through the
same `_finish`/`_end`, so a fast path and a plain step end a request alike."""
from __future__ import annotations

from collections.abc import Collection, Mapping

from policies.output_lens import holds_output_len
from policies.outputs import SameTokens, SchedulerOutput
from policies.sequence import PENDING, Sequence, SequenceStatus
from policies.stop_rule import HANDOFF_REASON, STOPPED

RUNNING, ABORTED = SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED
FINISHED = SequenceStatus.FINISHED_STOPPED  # statuses >= this are finished


class TokensAhead:
    """Mixed into `Lifecycle`: every method reads and writes the lifecycle's state."""

    __slots__ = ()

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
                tokens_for(seq, 1, new_token_ids)  # raises a ValueError naming the sequence
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


def tokens_for(seq: Sequence, num_samples: int, new_token_ids: dict[int, list[int]]) -> list[int]:
    """The `num_samples` tokens sampled for `seq`; a ValueError naming the sequence if the backend's
    `new_token_ids` lacks them or holds another count."""
    tokens = new_token_ids.get(seq.seq_id) if isinstance(new_token_ids, dict) else None
    if not isinstance(tokens, (list, tuple)) or len(tokens) != num_samples:
        raise ValueError(f"new_token_ids[{seq.seq_id}]={tokens!r} is invalid: sequence {seq.seq_id} "
                         f"was scheduled to sample {num_samples} token(s)")
    return list(tokens)
