"""The fast-forward half of the `Scheduler`'s interface: how many decode steps a backend may apply
at once (`decode_run_limit`), and applying them (`advance_decodes`). The work itself is in
policies/decode_run.py; this mixin keeps the scheduler's own state (its step counter, clock, last
step and queues' order) in step with it, as schedule()/update() pairs would."""
from __future__ import annotations

from collections.abc import Mapping

from policies import decode_run, lookahead
from policies.outputs import SchedulerOutput
from policies.sequence import Sequence


class DecodeRunCalls:
    """Mixed into `Scheduler`: every method reads and writes the scheduler's state."""

    __slots__ = ()

    def decode_run_limit(self, max_steps: int, token: int, output_lens: Mapping[str, int] | None = None,
                         quiet: bool = False) -> int:
        """How many of the next steps (<= max_steps) `advance_decodes` may apply at once if every
        sample is `token`, `output_lens` end requests at those output lengths (as stop_seq_ids)
        and nothing arrives or is aborted before the last one starts; 0 if the next is not one.
        `quiet` (a backend scheduling ahead: the next step is decided before such a step's update):
        steps that finish nothing, and a last one that finishes sequences only by length rules
        (known when it is looked past), unless a running sequence may stop on `token`. The next
        step may be scheduled already (by schedule_ahead, not looked past): the run then starts
        with it. Its sequences may differ from those of the step looked past (a swap-in, a
        preemption), so whether the steps after it are decided ahead too, which needs them to
        sample on the device, is asked here."""
        runs = self._all_decoding and self._looked_past is None and (
            not quiet or lookahead.samples_on_device(self.state, self.queues.running))
        self._decode_run = decode_run.run_limit(self.state, self._step, max_steps, token, output_lens) \
            if runs else decode_run.NO_RUN
        permit = self._decode_run
        if quiet and permit.limit > permit.quiet \
                and not self.lifecycle.stops_known_ahead(self.queues.running, token):
            return permit.quiet
        return permit.limit

    @property
    def decode_run_quiet(self) -> int:
        """Of the steps the last `decode_run_limit` allowed, how many finish nothing."""
        return self._decode_run.quiet

    def could_schedule_ahead(self) -> bool:
        """In `advance_decodes`, once the run's progress is in (before its last step's endings): whether
        `schedule_ahead` would have looked past the run's last step, so that the next step is decided
        at that step's start. Requests may wait by then (they arrived during the run's second-to-last
        step, after it decided the last one)."""
        if self.queues.reorders and self.state.may_force and self.queues.waiting:
            return False  # as schedule_ahead: whether the head may force is known only after the step
        return self._all_decoding and lookahead.next_step_safe(self.state, ahead=0)

    def _observe_decode_run(self, running: list[Sequence], num_steps: int) -> None:
        """The policy's per-step refreshes and observes of a run's steps not decided yet. What they
        re-sort is what stepping's `_reorder` would: the running queue when a step next needs it,
        the waiting and swapped queues (requests that arrived during the run's last step) now."""
        queues = self.queues
        names = set(self.policy.observe_decode_run(running, num_steps)) & queues.reorders
        if "running" in names:
            self._running_unsorted = True
        if names - {"running"}:
            queues.reorder(names - {"running"})

    def advance_decodes(self, times: list[float], token: int, output_lens: Mapping[str, int] | None = None,
                        decide_at: float | None = None) -> SchedulerOutput | None:
        """Apply len(times) - 1 of them, step s from times[s] to times[s + 1], as schedule(times[s]);
        update(out, {seq_id: [token] for each seq}, times[s + 1], stop_seq_ids) would.
        `decide_at` (a backend scheduling ahead: the last step's start, times[-2]): the step after the
        run is decided then, before the last step's update, as `schedule_ahead` would, and returned
        (requests that wait arrived before decide_at); None, deciding nothing, where it would not
        have looked past the last step: then call `schedule` (policies/decode_run.py: `advance`)."""
        running = list(self.queues.running) if self._observes_runs else None
        # A run may start with the step scheduled ahead (not updated yet): the policy observed it then.
        observed = self._last is not None and not self._last_updated
        num_steps = len(times) - 1
        nxt = None

        def observe() -> None:
            if running is not None and num_steps - observed:
                self._observe_decode_run(running, num_steps - observed)

        def decide() -> None:
            nonlocal nxt
            observe()  # the run's steps were decided (and observed) before the next one
            self.num_scheduled_ahead += 1
            nxt = self._schedule_ahead_of_update(decide_at)

        ahead = None if decide_at is None else decode_run.AheadDecision(self.could_schedule_ahead, decide)
        if not decode_run.advance(self.state, self._decode_run, self._step, times, token, output_lens, ahead):
            observe()
        self._step += num_steps
        self._now, self._decode_run = times[-1], decode_run.NO_RUN
        if nxt is None:
            self._last = None
        self._last_update = times[-1]
        return nxt
