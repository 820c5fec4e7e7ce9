"""The discrete-event backend: SimPy time, a scheduler, and a latency model.

Two processes share one `simpy.Environment`:
- arrivals: waits until each request's `arrival_time` and hands it to `scheduler.add`; with a
  latency model's `admission_s` (the engine's host cost of one `add_request`), the requests that have
  arrived are handed over together once the host has admitted them all, one after another (a burst of
  N at t = 0 starts its first step at N x admission_s, as the engine's serving loop does);
- engine: `out = scheduler.schedule(now)`; `yield timeout(latency.total_time(out))` (forward +
  swap transfers); `scheduler.update(out, tokens, now)` with synthetic tokens. When nothing is
  runnable it sleeps until the next arrival instead of spinning.
Generated tokens are `SIM_TOKEN` (requests from workloads carry `ignore_eos` and finish by
length); a request listed in `stop_lens` is ended at that output length through update's
`output_lens`, as the engine does. Nothing here is random, so the
same requests, scheduler and latency model give the same trace.

Fast-forward (`fast_forward=True`, the default): runs of decode steps of an unchanged batch are
priced and applied at once (`FastForward`, sim/fast_forward.py, says which steps a run keeps); the
traces are byte-identical to stepping one by one.

Async scheduling (`scheduler.async_scheduling`): each step is decided when the one before it
starts (`Scheduler.schedule_ahead`, policies/lookahead.py), so a request arriving during step N
is admitted in step N + 2 at the earliest; a fast-forward then starts from a step scheduled ahead.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import inf
from operator import attrgetter, itemgetter

import simpy

from policies.outputs import SameTokens, SchedulerOutput
from policies.request import Request
from sim.fast_forward import SIM_TOKEN, FastForward
from sim.latency.base import LatencyModel

_num_samples = itemgetter(2)
_seq_id = attrgetter("seq.seq_id")


def run_without_gc(env: simpy.Environment, until: simpy.Event) -> None:
    """`env.run(until)` with the cyclic garbage collector paused: a simulation makes next to no
    reference cycles (a dozen objects in a 2,000-request run), and the collector's passes over the
    growing token lists and traces took ~10% of the run."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        env.run(until=until)
    finally:
        if collecting:
            gc.enable()


@dataclass(slots=True)
class SimResult:
    num_requests: int
    num_steps: int
    sim_time_s: float  # simulated clock when the last request ended


class Simulator(FastForward):
    # Whether a fast-forwarded decode run may end after the next arrival (keep the steps running
    # across it). A fleet's replicas say no: a router reads their state at each arrival, which must
    # then be the state stepping one by one shows.
    runs_cross_arrivals = True

    def __init__(self, scheduler, latency: LatencyModel, requests: Iterable[Request],
                 stop_lens: Mapping[str, int] | None = None,
                 on_done: Callable[[int], None] | None = None, fast_forward: bool = True) -> None:
        """scheduler: a `policies.Scheduler`; on_done(n) is called as n requests end (progress)."""
        if type(fast_forward) is not bool:
            raise ValueError(f"fast_forward={fast_forward!r} is invalid: must be True or False")
        config = getattr(scheduler, "config", None)
        self.ahead = bool(getattr(config, "async_scheduling", False))
        # Step one by one with a stand-in scheduler without the fast-forward API, or a latency
        # model that cannot price decode runs.
        self.fast_forward = (fast_forward and hasattr(scheduler, "decode_run_limit")
                             and type(latency).decode_times is not LatencyModel.decode_times)
        self.scheduler = scheduler
        self.latency = latency
        self.requests = sorted(requests, key=lambda r: r.arrival_time)
        self.stop_lens = dict(stop_lens or {})
        self.on_done = on_done
        self.env = simpy.Environment()
        self.num_steps = 0
        # Called after each step's update (a fleet's hook); what it returns, if anything, is host time
        # this replica spends before its next step when it schedules synchronously (scheduling ahead,
        # the next step is already running on the device).
        self.after_step: Callable[[], float | None] | None = None
        self.step_start = 0.0  # when the running step started (not a decode run's)
        self.step_out: SchedulerOutput | None = None  # what it runs
        self.step_end = 0.0  # when the running step (or decode run) ends: a fleet's host loop acts after it
        self.host_gap_end = 0.0  # when the host time after the last step ends (a synchronous replica's next step starts)
        # A fleet's surcharge on a step of the given price starting now (device work queued ahead of
        # it, a link slowing it); a replica with one steps one by one.
        self.extra_step_s: Callable[[float], float] | None = None
        self.last_scheduled: list = []  # the last stepped step's scheduled sequences (a fleet's hook reads them)
        self._arrived = 0
        self._wake: simpy.Event | None = None
        self._next_arrival_at = 0.0  # SimPy time of the pending arrival (inf: none left)
        self._next_index = 0  # the pending arrival's index in self.requests
        self._step_time_guess = inf  # the last fast-forwarded step's duration
        self._one = [SIM_TOKEN]  # shared by the entries of a step (update only reads it)
        # Without parallel sampling every sampling entry of every step samples one token: one
        # mapping that answers `[SIM_TOKEN]` for any sequence serves every step.
        self._one_each = SameTokens(self._one) \
            if all(r.sampling_params.n == 1 for r in self.requests) else None

    def device_busy(self, now: float) -> bool:
        """Whether a step runs on this replica's device at `now`: inside its last step, not the host
        time after it (a synchronous replica's `step_end` covers that gap too)."""
        return self.step_start <= now < self.step_end and now >= self.host_gap_end

    def run(self) -> SimResult:
        self.env.process(self._arrivals())
        run_without_gc(self.env, self.env.process(self._engine()))
        return SimResult(len(self.requests), self.num_steps, self.env.now)

    def _arrivals(self):
        env, add, requests = self.env, self.scheduler.add, self.requests
        admission_s = self.latency.admission_s  # host seconds per admitted request
        i = 0
        while i < len(requests):
            req = requests[i]
            if req.arrival_time > env.now:
                delay = req.arrival_time - env.now
                self._next_arrival_at = env.now + delay  # the time SimPy computes for the timeout
                self._next_index = i
                yield env.timeout(delay)
            j = i + 1
            if admission_s:
                # The host admits what has arrived, one request after another, before the scheduler
                # sees any of it (the engine's serving loop: every add_request, then the next step).
                while j < len(requests) and requests[j].arrival_time <= env.now:
                    j += 1
                self._next_arrival_at = env.now + (j - i) * admission_s
                yield env.timeout((j - i) * admission_s)
            for req in requests[i:j]:
                add(req, env.now)
            self._arrived += j - i
            i = j
            if self._wake is not None and not self._wake.triggered:
                self._wake.succeed()
        self._next_arrival_at = inf

    def _more_may_come(self) -> bool:
        """Whether something may still make a stuck scheduler runnable (an arrival is left)."""
        return self._arrived < len(self.requests)

    def _idle(self) -> simpy.Event:
        self._wake = self.env.event()
        return self._wake

    def _engine(self):
        env, sched, total_time = self.env, self.scheduler, self.latency.total_time
        schedule, timeout = sched.schedule, env.timeout
        stop_lens, on_done, fast_forward = self.stop_lens, self.on_done, self.fast_forward
        ended_rows = sched.recorder.requests  # grows by one row per ended request
        reported = 0
        total = len(self.requests)
        idle_rounds = 0
        # The last batch and its synthetic tokens: decode steps often repeat the batch exactly.
        batch: list | None = None
        tokens: dict[int, list[int]] = {}
        schedule_ahead = sched.schedule_ahead if self.ahead else None
        one_each = self._one_each
        pending = None  # the step scheduled ahead, to run next
        while True:
            if on_done is not None and len(ended_rows) > reported:
                on_done(len(ended_rows) - reported)
                reported = len(ended_rows)
            if not sched.has_unfinished():
                if self._arrived == total:
                    return
                yield self._idle()
                continue
            # Fast-forward: the next plain decode steps in one timeout (scheduling ahead: from a step
            # scheduled ahead, which the run starts with).
            times = self._decode_run() if fast_forward and self.extra_step_s is None \
                and (not self.ahead or pending is not None) else None
            if times is not None:
                idle_rounds = 0
                self.step_end = times[-1]
                yield timeout(times[-1] - env.now)
                # Scheduling ahead, the step after the run is decided at its last step's start (None
                # where scheduling ahead would not have looked past that step: decided now).
                nxt = sched.advance_decodes(times, SIM_TOKEN, stop_lens, times[-2] if self.ahead else None)
                self.num_steps += len(times) - 1
                pending = None if nxt is None or nxt.is_empty else nxt
                continue
            if pending is None:
                out = schedule(env.now)
            else:
                out, pending = pending, None
            if not out.scheduled and out.is_empty:
                # Nothing to run. Record the step if it preempted or aborted something, then
                # sleep until the next arrival; with none left the scheduler is stuck.
                if out.preempted or out.aborted:
                    sched.update(out, {}, env.now)
                    if self.after_step is not None:
                        self.after_step()
                    idle_rounds += 1
                    if idle_rounds < 1000:
                        continue
                elif self._more_may_come():
                    yield self._idle()
                    continue
                elif len(ended_rows) > reported or not sched.has_unfinished():
                    continue  # the scheduler aborted the last requests (e.g. too_long)
                raise RuntimeError(
                    f"simulation stalled at t={env.now:.6f}s: the scheduler has unfinished requests "
                    f"(waiting={sched.num_waiting}, running={sched.num_running}, "
                    f"swapped={sched.num_swapped}) but schedules nothing and no arrival is left")
            idle_rounds = 0
            step_s = total_time(out)  # priced before schedule_ahead applies the step's progress
            if self.extra_step_s is not None:
                step_s += self.extra_step_s(step_s)
            # Async scheduling: the next step is decided as this one starts.
            nxt = schedule_ahead(env.now, stop_lens) if schedule_ahead is not None else None
            pending = None if nxt is None or nxt.is_empty else nxt  # schedule() replaces an empty one
            self.step_start, self.step_end, self.step_out = env.now, env.now + step_s, out
            yield timeout(step_s)
            scheduled = out.scheduled
            if one_each is not None:
                tokens = one_each
            elif scheduled != batch:
                batch, tokens = scheduled, self._sampled_tokens(scheduled)
            self.num_steps += 1
            sched.update(out, tokens, env.now, (), stop_lens)
            if self.after_step is not None:
                self.last_scheduled = scheduled
                host_s = self.after_step()
                if host_s and not self.ahead:
                    self.step_end = self.host_gap_end = env.now + host_s  # the host loop is busy until then
                    yield timeout(host_s)

    def _sampled_tokens(self, scheduled) -> dict[int, list[int]]:
        """`SIM_TOKEN` for every sample of the step (`update`'s `new_token_ids`)."""
        samples = list(map(_num_samples, scheduled))
        if samples.count(1) == len(samples):  # the common case: every entry samples one token
            return dict.fromkeys(map(_seq_id, scheduled), self._one)
        return {seq.seq_id: [SIM_TOKEN] * n for seq, _, n in scheduled if n}

