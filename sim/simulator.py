"""The discrete-event backend: SimPy time, a scheduler, and a latency model.

Two processes share one `simpy.Environment`:
- arrivals: waits until each request's `arrival_time` and hands it to `scheduler.add`;
- engine: `out = scheduler.schedule(now)`; `yield timeout(latency.total_time(out))` (forward +
  swap transfers); `scheduler.update(out, tokens, now)` with synthetic tokens. When nothing is
  runnable it sleeps until the next arrival instead of spinning.
Generated tokens are `SIM_TOKEN` (requests from workloads carry `ignore_eos` and finish by
length); a request listed in `stop_lens` is ended at that output length through update's
`stop_seq_ids`, the same path the engine uses for stop strings. Nothing here is random, so the
same requests, scheduler and latency model give the same trace.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter, itemgetter

import simpy

from policies.output_lens import reaching_output_len
from policies.request import Request
from sim.latency.base import LatencyModel

SIM_TOKEN = 1
_num_samples = itemgetter(2)
_seq_id = attrgetter("seq.seq_id")


@dataclass(slots=True)
class SimResult:
    num_requests: int
    num_steps: int
    sim_time_s: float  # simulated clock when the last request ended


class Simulator:
    def __init__(self, scheduler, latency: LatencyModel, requests: Iterable[Request],
                 stop_lens: Mapping[str, int] | None = None,
                 on_done: Callable[[int], None] | None = None) -> None:
        """scheduler: a `policies.Scheduler`; on_done(n) is called as n requests end (progress)."""
        self.scheduler = scheduler
        self.latency = latency
        self.requests = sorted(requests, key=lambda r: r.arrival_time)
        self.stop_lens = dict(stop_lens or {})
        self.on_done = on_done
        self.env = simpy.Environment()
        self.num_steps = 0
        self._arrived = 0
        self._wake: simpy.Event | None = None
        self._one = [SIM_TOKEN]  # shared by the entries of a step (update only reads it)

    def run(self) -> SimResult:
        self.env.process(self._arrivals())
        engine = self.env.process(self._engine())
        self.env.run(until=engine)
        return SimResult(len(self.requests), self.num_steps, self.env.now)

    def _arrivals(self):
        env, add = self.env, self.scheduler.add
        for req in self.requests:
            if req.arrival_time > env.now:
                yield env.timeout(req.arrival_time - env.now)
            add(req, env.now)
            self._arrived += 1
            if self._wake is not None and not self._wake.triggered:
                self._wake.succeed()

    def _idle(self) -> simpy.Event:
        self._wake = self.env.event()
        return self._wake

    def _engine(self):
        env, sched, total_time = self.env, self.scheduler, self.latency.total_time
        schedule, timeout = sched.schedule, env.timeout
        stop_lens, on_done = self.stop_lens, self.on_done
        ended_rows = sched.recorder.requests  # grows by one row per ended request
        reported = 0
        total = len(self.requests)
        idle_rounds = 0
        # The last batch and its synthetic tokens: decode steps often repeat the batch exactly.
        batch: list | None = None
        tokens: dict[int, list[int]] = {}
        while True:
            if on_done is not None and len(ended_rows) > reported:
                on_done(len(ended_rows) - reported)
                reported = len(ended_rows)
            if not sched.has_unfinished():
                if self._arrived == total:
                    return
                yield self._idle()
                continue
            out = schedule(env.now)
            if not out.scheduled and out.is_empty:
                # Nothing to run. Record the step if it preempted or aborted something, then
                # sleep until the next arrival; with none left the scheduler is stuck.
                if out.preempted or out.aborted:
                    sched.update(out, {}, env.now)
                    idle_rounds += 1
                    if idle_rounds < 1000:
                        continue
                elif self._arrived < total:
                    yield self._idle()
                    continue
                elif len(ended_rows) > reported or not sched.has_unfinished():
                    continue  # the scheduler aborted the last requests (e.g. too_long)
                raise RuntimeError(
                    f"simulation stalled at t={env.now:.6f}s: the scheduler has unfinished requests "
                    f"(waiting={sched.num_waiting}, running={sched.num_running}, "
                    f"swapped={sched.num_swapped}) but schedules nothing and no arrival is left")
            idle_rounds = 0
            yield timeout(total_time(out))
            scheduled = out.scheduled
            if scheduled != batch:
                batch, tokens = scheduled, self._sampled_tokens(scheduled)
            self.num_steps += 1
            stops = reaching_output_len(scheduled, stop_lens) if stop_lens else None
            if stops:
                sched.update(out, tokens, env.now, stops)
            else:
                sched.update(out, tokens, env.now)

    def _sampled_tokens(self, scheduled) -> dict[int, list[int]]:
        """`SIM_TOKEN` for every sample of the step (`update`'s `new_token_ids`)."""
        samples = list(map(_num_samples, scheduled))
        if samples.count(1) == len(samples):  # the common case: every entry samples one token
            return dict.fromkeys(map(_seq_id, scheduled), self._one)
        return {seq.seq_id: [SIM_TOKEN] * n for seq, _, n in scheduled if n}

