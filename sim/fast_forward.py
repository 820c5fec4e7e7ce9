"""The simulator's fast-forward (`fast_forward=True`, the default; `backend.fast_forward` in
conf/backend/sim.yaml): most steps are decode steps of an unchanged batch. Before each step the
engine process (sim/simulator.py) asks the scheduler how many such steps lie ahead
(`decode_run_limit`: nothing waiting, preempted or short of blocks, and only the last may finish a
sequence), prices them with the latency model's `decode_times`, keeps those that start before the
next arrival (`_decode_run`), and applies them with one `advance_decodes` after one timeout (an
arrival during the last step is in the waiting queue by then, as it is in that step's update). The
clock values are the ones stepping one by one computes (each step's end = its start + its
duration), so the traces are byte-identical to `fast_forward=False`; steps whose end SimPy could
not reach exactly from now with one delay (only possible early on) go one by one.

Async scheduling (`scheduler.async_scheduling`, sim/simulator.py): a fast-forward then starts from a
step scheduled ahead whose sequences all sample on the device (others are not looked past); its
steps finish nothing but the last, which may end sequences by length
(`decode_run_limit(quiet=True)`), and end before the next arrival, or, when that arrival falls
strictly inside step N of the run and nothing else arrives until step N + 1 ends, the run keeps N
and N + 1 (decided at N's start, before the arrival; `_decides_past_arrival`). `advance_decodes` is
told the last step's start: the step after the run is decided then, as scheduling ahead would have
(None where it would not have looked past the last step: decided synchronously), and a run may
start from it at once. Traces are again identical to stepping one by one.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate, islice
from math import inf

SIM_TOKEN = 1  # every simulated sample's token (the simulator's, and the one a decode run assumes)
MAX_RUN_STEPS = 1 << 16  # steps per fast-forwarded decode run at most
FIRST_CHUNK_STEPS = 32  # steps priced at once while looking for the end of a run, if no guess


class FastForward:
    """Mixed into `Simulator`: every method reads the simulator's state (its scheduler, latency
    model, clock, requests and pending arrival); `_decode_run` keeps its step-time guess there."""

    def _decode_run(self) -> list[float] | None:
        """Times [t_0 = now, ..., t_K] of K >= 1 decode steps `advance_decodes` can apply at once:
        nothing arrives before the last one starts, nor exactly when one ends (which of the two
        SimPy runs first would then depend on its event ids; such a step is stepped normally)."""
        sched, start = self.scheduler, self.env.now
        # Scheduling ahead, the step after the run is decided at the last run step's start: the run
        # keeps to steps that finish nothing and end before the next arrival (see the module docstring).
        limit = sched.decode_run_limit(MAX_RUN_STEPS, SIM_TOKEN, self.stop_lens, quiet=self.ahead)
        if not limit:
            return None
        num_seqs, context = sched.num_running, sched.queues.kv_tokens + sched.num_running
        longest = {}  # the longest decode's context (one token more each step), for models that price it
        if self.latency.uses_longest_context:
            longest["max_context_tokens"] = max(s.num_computed_tokens for s in sched.queues.running) + 1
        shared = {}  # the batch's re-read KV entries (the same every step), for models that price them
        if self.latency.prices_shared_reads:
            shared["num_shared_context_tokens"] = self.latency.shared_context_tokens(sched.queues.running)
        times, until = [start], self._next_arrival_at
        # Price about as many steps as fit before the arrival, judged by the last run's step time.
        guess = self._step_time_guess
        chunk = int((until - start) / guess) + 2 if until < inf and guess > 0 else FIRST_CHUNK_STEPS
        # Step ends as SimPy's timeouts compute them (start + duration, one step after the other),
        # up to the first one at or after the next arrival (scheduling ahead: and one more, in case
        # the run may keep the arrival's step and the next, `_decides_past_arrival`).
        lo, quiet = 1, sched.decode_run_quiet
        while len(times) <= limit:
            num_steps = min(chunk, limit + 1 - len(times))
            grown = {k: v + len(times) - 1 for k, v in longest.items()}
            step_times = self.latency.decode_times(num_seqs, context + (len(times) - 1) * num_seqs,
                                                   num_seqs, num_steps, **grown, **shared)
            if step_times is None:
                return None
            times.extend(islice(accumulate(step_times, initial=times[-1]), 1, None))
            cut = bisect_left(times, until, lo)
            if cut == len(times):
                lo = cut
            elif not self.ahead:
                del times[cut + (times[cut] != until and self.runs_cross_arrivals):]
                break
            elif cut + 1 < len(times) or len(times) > limit:
                del times[cut + 2 * (self.runs_cross_arrivals and cut + 1 <= quiet
                                     and self._decides_past_arrival(times, cut)):]
                break
            chunk = 2 * chunk
        self._step_time_guess = times[-1] - times[-2] if len(times) > 1 else self._step_time_guess
        if len(times) < 2 or start + (times[-1] - start) != times[-1]:
            return None
        return times

    def _decides_past_arrival(self, times: list[float], cut: int) -> bool:
        """Scheduling ahead, with the pending arrival strictly inside step `cut - 1` of a run (from
        times[cut - 1] to times[cut]): whether the run may keep that step and the next one. That
        next step was decided at the arrival step's start, before the arrival, so it is a plain decode
        too; the step after it is decided at its start, times[cut], with what arrived, and nothing
        may arrive from then until the next step's end. Without admission costs only (the arrivals
        are then handed over as they come)."""
        if self.latency.admission_s or cut + 1 >= len(times) or times[cut] == self._next_arrival_at:
            return False
        requests, at = self.requests, self._next_arrival_at
        for k in range(self._next_index + 1, len(requests)):
            arrival = requests[k].arrival_time
            if arrival > at:
                at += arrival - at  # the time SimPy computes for that arrival's timeout
                if at >= times[cut]:
                    return at > times[cut + 1]
        return True
