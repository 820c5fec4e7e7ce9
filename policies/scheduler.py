"""The Scheduler: continuous batching over waiting / running / swapped queues (vLLM v0 semantics).

Each step, `schedule(now)`:
  0. (policies that allow it, e.g. priority) lets the waiting head force out running sequences it
     may preempt until it fits;
  1. schedules running sequences in policy order: decodes first (1 token each, preempting the
     policy's victim among not-yet-scheduled running sequences when KV runs out), then the next
     chunk of running prefills from the remaining token budget (policies/running_pass.py);
  2. if step 1 preempted nothing, serves the swapped and waiting queues merged in policy order
     (swap in / admit, policies/admission.py) while the budgets and the block manager allow; the
     first that must wait stops the walk (head-of-line, so no request overtakes an earlier one), one
     that can never fit is aborted as `too_long`.
Without chunked prefill (vLLM v0 default): a step that can admit waiting prompts (whole, within
the token budget) is prefill-only; otherwise it runs step 1 and then swaps in.
`update(out, tokens, now)` advances progress, appends tokens, forks parallel samples, applies the
stop rules (policies/stop_rule.py), frees finished sequences and records the step. The phases are
functions of the state they are handed (`SchedulerState`, `ScheduledStep`: policies/phase_state.py),
never of the Scheduler. See preemption.py and queues.py (the queues keep the policy order).
A policy whose keys change over time (`Policy.reorders`: remaining work, a queue level, a tenant's
service) has its queues re-sorted at the start of each step, before anything reads their order; the
running queue only when its order decides something (something waits or is swapped, a sequence
still prefills, or the decodes may not all fit): otherwise every running sequence is scheduled.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from policies import admission, decode_run, lookahead
from policies.blocks.base import BlockManager
from policies.lifecycle import Lifecycle
from policies.output_lens import reaching_output_len
from policies.outputs import SchedulerOutput
from policies.phase_state import ScheduledStep, SchedulerState
from policies.policy.base import QUEUE_NAMES, OrderHint, Policy
from policies.preemption import Preemptor
from policies.queues import SchedulerQueues
from policies.request import Request
from policies.running_pass import RunningPass
from policies.scheduler_config import SchedulerConfig
from policies.scheduler_decode_runs import DecodeRunCalls
from policies.sequence import Sequence
from policies.step_stats import StepStats
from policies.trace import TraceRecorder


class Scheduler(DecodeRunCalls):
    def __init__(self, config: SchedulerConfig, policy: Policy, block_manager: BlockManager,
                 recorder: TraceRecorder | None = None) -> None:
        self.config = config
        self.policy = policy
        self.block_manager = block_manager
        self.recorder = TraceRecorder() if recorder is None else recorder
        bad = set(policy.reorders) - set(QUEUE_NAMES)
        if bad:
            raise ValueError(f"policy {policy.name!r} reorders={sorted(policy.reorders)} is invalid: "
                             f"queue names are {list(QUEUE_NAMES)}")
        self.queues = SchedulerQueues(policy.key, policy.reorders)
        self.preemptor = Preemptor(self.queues, block_manager, policy, self.recorder)
        self.lifecycle = Lifecycle(self.queues, block_manager, self.recorder, self.preemptor,
                                   config.max_model_len)
        # What the phases (running pass, admission, look-past, decode runs) are handed.
        self.state = SchedulerState(config, self.queues, block_manager, self.preemptor, self.lifecycle,
                                    self.recorder, type(policy).may_preempt is not Policy.may_preempt)
        self.running_pass = RunningPass(self.state)
        # Decode fast path: every running sequence has exactly one token to compute.
        self._all_decoding = False
        self._now = 0.0
        self._step = 0
        self._last: ScheduledStep | None = None  # the last step scheduled, until a decode run replaces it
        self._decode_run = decode_run.NO_RUN  # what decode_run_limit allowed
        self._looked_past: lookahead.LookedPast | None = None  # schedule_ahead's step awaiting update
        self._last_update = 0.0
        self.num_scheduled_ahead = 0  # steps schedule_ahead returned
        cls = type(policy)
        self._observes = cls.observe is not Policy.observe
        self._observes_runs = cls.observe_decode_run is not Policy.observe_decode_run
        self._decided_version = -1  # the running queue's version when the last step was decided
        self._running_unsorted = False  # a re-sort of the running queue was left for a step that needs it
        self._last_updated = False  # the last step schedule() decided has had its update

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    @property
    def num_swapped(self) -> int:
        return len(self.queues.swapped)

    @property
    def may_force(self) -> bool:
        """Whether the policy may force running sequences out for the waiting queue's head."""
        return self.state.may_force

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()

    def sequences(self, request_id: str) -> list[Sequence]:
        """A live request's sequences in sample order. The list itself (children are appended as
        samples fork) stays valid after the request ends, so the engine can build its outputs."""
        return self.lifecycle.families[request_id]

    def check_invariants(self) -> None:
        """For tests, between steps: queues ordered and consistent, every live sequence queued or
        finished, sequence slots within max_num_seqs, and the block manager's own invariants."""
        self.queues.check()
        live = [seq for family in self.lifecycle.families.values() for seq in family]
        queued = {id(seq) for queue in (self.queues.waiting, self.queues.running, self.queues.swapped)
                  for seq in queue}
        assert all(seq.is_finished or id(seq) in queued for seq in live), "a live sequence is lost"
        assert len(queued) == sum(not seq.is_finished for seq in live), "a queued sequence is not live"
        assert self.queues.running_cost <= self.config.max_num_seqs, "running sequences exceed max_num_seqs"
        # Sequences whose blocks a hand-off holds: transferring out, or reserved for one coming in.
        live.extend(seq for side in self.lifecycle.transfer_sides for seq in side.held_sequences())
        self.block_manager.check_invariants(live)

    # ---- requests -------------------------------------------------------------------------
    def add(self, request: Request, now: float) -> list[Sequence]:
        """Validate and queue a request (ValueError naming the field on bad input). A prompt longer
        than max_model_len can never run: it arrives and ends at once with abort:too_long, in the
        next update's result (a workload run goes on without it; `LLMEngine.add_request` refuses
        it unless asked to abort it). `now` stamps the `arrived` event; ordering and latency
        metrics use `request.arrival_time`. Returns the request's sequences (`sequences()`)."""
        self.check(request, too_long_ok=True)
        self.lifecycle.arrive(request, now)
        seqs = self.lifecycle.families[request.request_id]
        if request.num_prompt_tokens > self.config.max_model_len:
            self.lifecycle.abort(request, "too_long", now)
        return seqs

    def check(self, request: Request, too_long_ok: bool = False) -> None:
        """`add`'s validation alone (fields, n <= max_num_seqs, a new id; the prompt within
        max_model_len unless `too_long_ok`): ValueError naming the field, nothing queued. The
        engine checks here before it hands a request over to be added."""
        request.validate(None if too_long_ok else self.config.max_model_len)
        n = request.sampling_params.n
        if n > self.config.max_num_seqs:
            raise ValueError(f"n={n} is invalid: a request's samples must fit in one batch, "
                             f"n <= max_num_seqs={self.config.max_num_seqs}")
        if request.request_id in self.lifecycle.seen:
            raise ValueError(f"request_id={request.request_id!r} is invalid: already added to this scheduler")

    def abort(self, request_id: str, reason: str = "user", now: float | None = None) -> bool:
        """End a live request with finish_reason "abort:<reason>"; False (never an exception) for an
        unknown or already ended id. It shows up in the next `out.aborted` and `update()` result."""
        family = self.lifecycle.families.get(request_id) if isinstance(request_id, str) else None
        if family is None:
            return False
        self.lifecycle.abort(family[0].request, str(reason), self._now if now is None else now)
        return True

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step (module docstring); the backend runs it, then calls `update`."""
        self._now, self._decode_run = now, decode_run.NO_RUN
        out = SchedulerOutput(now)
        self._last = step = ScheduledStep(out, StepStats())
        self._last_updated = False
        state, queues, budget = self.state, self.queues, self.config.max_num_batched_tokens
        if self.lifecycle.joined:  # this step sees them: the next look-past asks about later joins only
            self.lifecycle.joined = []
        all_decoding = self._all_decoding  # every running sequence has sampled and decodes next
        if queues.reorders:
            self._reorder(now, budget)
        self.preemptor.begin_step()
        if state.may_force and queues.waiting and queues.running:
            self.preemptor.force_for(queues.waiting[0], out, now, self.config.max_num_seqs)
        if self.config.enable_chunked_prefill:
            budget, preempted = self.running_pass.schedule(step, budget, all_decoding)
            if not preempted and (queues.waiting or queues.swapped):
                admission.admit(state, step, budget, take_waiting=True, take_swapped=True)
        elif not admission.admit(state, step, budget, take_waiting=True, take_swapped=False)[1]:
            budget, preempted = self.running_pass.schedule(step, budget, all_decoding)
            if not preempted:
                admission.admit(state, step, budget, take_waiting=False, take_swapped=True)
        self.preemptor.end_step()
        stats = step.stats  # admission may have recounted it (an abort mid-step)
        stats.num_running = len(queues.running)
        stats.fill_totals(out)
        out.decode_only = all_decoding and not stats.num_chunks  # the running decodes alone
        out.aborted = self.lifecycle.take_aborted()  # since the last schedule(), too_long ones included
        self._decided_version = queues.running_version
        if self._observes:
            self.policy.observe(out)
        return out

    def _reorder(self, now: float, budget: int) -> None:
        """Re-sort the queues whose order the policy's keys may have changed (module docstring)."""
        queues = self.queues
        uniform = self._all_decoding and queues.running_version == self._decided_version
        names = set(self.policy.refresh(queues, OrderHint(now, uniform))) & queues.reorders
        if self._running_unsorted:
            names.add("running")
        self._running_unsorted = False
        if "running" in names and self._all_decoding and not queues.waiting and not queues.swapped \
                and len(queues.running) <= budget and self.block_manager.decode_slots_fit(queues.running):
            names.discard("running")  # every running sequence decodes this step: no decision reads the order
            self._running_unsorted = True
        if names:
            queues.reorder(names)

    def schedule_ahead(self, now: float, output_lens: Mapping[str, int] | None = None) -> SchedulerOutput | None:
        """The next step, decided while the last one (schedule()'s output) still runs; its update
        comes after this (policies/lookahead.py). None, changing nothing, when that step cannot be
        looked past: then update it and call `schedule`. An empty step (`is_empty`) need not run:
        the next `schedule` replaces it. `output_lens`: the backend's forced output lengths, applied
        here to the step looked past."""
        last = self._last
        if last is None or self._looked_past is not None:
            raise ValueError("schedule_ahead() needs a step from schedule() or schedule_ahead() whose update "
                             "has not come, and no looked-past step awaiting its update")
        if self.queues.reorders and self.state.may_force and self.queues.waiting:
            return None  # the step looked past changes keys: whether the head may force is known only then
        if not lookahead.can_look_past(self.state, last):
            return None
        self._looked_past = lookahead.look_past(self.state, last, max(self._last_update, last.out.now), output_lens)
        # After the step looked past every running sequence decodes next, but a prompt it chunked.
        self._all_decoding = not last.stats.num_partial
        self.num_scheduled_ahead += 1
        return self._schedule_ahead_of_update(now)

    def _schedule_ahead_of_update(self, now: float) -> SchedulerOutput:
        """`schedule(now)` for a step decided before the last one's update."""
        out = self.schedule(now)
        out.ahead = True
        # Until the next look-past: whether this step is a plain decode of every running sequence (a
        # fast-forward may start with it, `decode_run_limit`); the look-past sets it again.
        stats = self._last.stats
        self._all_decoding = (not (out.copy or out.swap_in or out.swap_out) and stats.num_prefill_seqs == 0
                              and stats.num_decode_seqs == stats.num_samples == len(self.queues.running))
        return out

    # ---- update ---------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, new_token_ids: dict[int, list[int]], now: float,
               stop_seq_ids: Collection[int | tuple[int, int]] = (),
               output_lens: Mapping[str, int] | None = None) -> list[Request]:
        """Apply the step `out` that just ran: `new_token_ids[seq_id]` holds `num_samples` tokens per
        sampling sequence, `stop_seq_ids` the sequences the backend saw hit a stop string (for a
        prompt sampling n > 1 tokens, `(seq_id, i)` names token i, whose child is forked here),
        `output_lens` the backend's forced output lengths (policies/output_lens.py; a step looked
        past had them applied then). Returns the requests that ended since the last update
        (finished, or aborted from anywhere)."""
        self._now = now
        past = self._looked_past
        if past is not None:
            if past.out is not out:
                raise ValueError("update() got an output that is not the step schedule_ahead() looked past")
            return self._update_looked_past(past, new_token_ids, now, stop_seq_ids)
        last = self._last
        if last is None or last.out is not out:
            raise ValueError("update() got an output that is not the last one schedule() returned")
        if output_lens:
            stop_seq_ids = [*stop_seq_ids, *reaching_output_len(out.scheduled, output_lens)]
        last_update, self._last_update = self._last_update, now
        self._last_updated = True
        stats, skip_aborted = last.stats, self.lifecycle.aborted_in_flight
        self.queues.kv_tokens += stats.num_prefill_tokens + stats.num_decode_seqs
        self.lifecycle.apply(out, new_token_ids, now, stop_seq_ids)
        # Every running sequence sampled this step: each now has exactly one token to compute.
        self._all_decoding = (not skip_aborted and
                              len(out.scheduled) - stats.num_partial == stats.num_running)
        ended = self.lifecycle.take_ended()
        # A step scheduled ahead but updated here began when the one before it ended, not when decided.
        self.recorder.step(stats.row(self._step, out, now, self.queues.sizes(), self.block_manager.usage(),
                                     self.preemptor.counts, ended, start=max(out.now, last_update)))
        self._step += 1
        return ended

    def _update_looked_past(self, past: lookahead.LookedPast, new_token_ids: dict[int, list[int]],
                            now: float, stop_seq_ids: Collection[int | tuple[int, int]]) -> list[Request]:
        self._looked_past, self._last_update = None, now
        self.lifecycle.settle(past.sampled, past.ending, new_token_ids, now, stop_seq_ids)
        if self.lifecycle.aborted_in_flight:
            self._all_decoding = False
        ended = self.lifecycle.take_ended()
        self.recorder.step(past.stats.row(self._step, past.out, now, past.queues, past.usage, past.counts, ended,
                                          start=past.start))
        self._step += 1
        return ended

