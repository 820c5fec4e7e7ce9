"""A simulated fleet: N replicas on one SimPy clock, each with its own scheduler, block manager and
latency model (replicas may model different GPUs), and a router in front (policies/routing/).

One arrival process routes each request at its arrival time: it builds the replicas' snapshots
(`policies.routing.observe`), asks the router, and hands the request to the chosen replica
(sim/fleet/replica.py). With `refresh_s` = 0 the snapshots are taken at each decision (exact
signals); with `refresh_s` > 0 they are taken at t = 0, refresh_s, 2 refresh_s, ... and every decision
in between reads the last ones (stale signals). A refresh at the same time as an arrival comes
first; refreshes no decision reads (none arrives before the next one) are skipped.

`dispatch_hop_s` prices the engine fleet's dispatch hop: a request is routed, and reaches its
replica, that long after its arrival (its arrival time, and so its TTFT, stay as they were). The
engine's front end routes when it sends the request down the chosen replica's pipe, so the
decision (and its snapshots) are taken at that time too. 0: at the arrival (docs/fleet.md, "The
dispatch hop").

Nothing is random outside the router's seeded generator, so the same requests, replicas and
router give the same traces. A fleet of one replica with any router gives the single-replica
simulator's traces (with latency models without admission cost, byte for byte).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import inf

import simpy

from policies.request import Request
from policies.routing import ReplicaSnapshot, Router, observe
from sim.fleet.replica import ReplicaSimulator
from sim.latency.base import LatencyModel
from sim.simulator import run_without_gc


@dataclass(slots=True)
class ReplicaSpec:
    """What one replica is made of: a `policies.Scheduler` (with its block manager and trace
    recorder) and the latency model of its hardware."""

    scheduler: object
    latency: LatencyModel


@dataclass(slots=True)
class FleetResult:
    num_requests: int
    num_steps: int  # over all replicas
    sim_time_s: float  # simulated clock when the last request ended
    num_routed: list[int]  # requests routed to each replica
    replica_steps: list[int]  # steps of each replica


class FleetSimulator:
    def __init__(self, replicas: Sequence[ReplicaSpec], router: Router, requests: Iterable[Request],
                 refresh_s: float = 0.0, stop_lens: Mapping[str, int] | None = None,
                 on_done: Callable[[int], None] | None = None, fast_forward: bool = True,
                 dispatch_hop_s: float = 0.0) -> None:
        if not replicas:
            raise ValueError("replicas=[] is invalid: a fleet needs at least one replica")
        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not 0 <= refresh_s < inf:
            raise ValueError(f"refresh_s={refresh_s!r} is invalid: must be a finite number >= 0 (0: exact)")
        if isinstance(dispatch_hop_s, bool) or not isinstance(dispatch_hop_s, (int, float)) \
                or not 0 <= dispatch_hop_s < inf:
            raise ValueError(f"dispatch_hop_s={dispatch_hop_s!r} is invalid: must be a number of seconds >= 0")
        self.env = simpy.Environment()
        self.router = router
        self.dispatch_hop_s = float(dispatch_hop_s)
        self.refresh_s = float(refresh_s)
        self.requests = sorted(requests, key=lambda r: r.arrival_time)
        self.replicas = [ReplicaSimulator(i, self.env, spec.scheduler, spec.latency, self.requests, stop_lens,
                                          on_done, fast_forward) for i, spec in enumerate(replicas)]
        self.front = self.replicas  # the replicas the router chooses among (a disaggregated fleet: not decode ones)
        self._snapshots: list[ReplicaSnapshot] = []

    def run(self) -> FleetResult:
        self.env.process(self._arrivals())
        engines = [replica.process() for replica in self.replicas]
        run_without_gc(self.env, self.env.all_of(engines))
        steps = [replica.num_steps for replica in self.replicas]
        return FleetResult(len(self.requests), sum(steps), self.env.now,
                           [replica.num_routed for replica in self.replicas], steps)

    def snapshots(self, copy_index: bool) -> list[ReplicaSnapshot]:
        now = self.env.now
        return [observe(r.replica, r.scheduler, r.num_outstanding, now, copy_index) for r in self.front]

    def _expect(self, at: float) -> None:
        for replica in self.front:
            replica.expect(at)

    def _arrivals(self):
        env, requests, refresh_s, hop = self.env, self.requests, self.refresh_s, self.dispatch_hop_s
        num_refreshes, next_refresh = 0, 0.0 if refresh_s else inf
        i = 0
        while i < len(requests):
            request = requests[i]
            due = request.arrival_time + hop  # routed then (module docstring)
            if next_refresh <= due:
                # Only the last refresh at or before this arrival is read by a decision: skip to it.
                num_refreshes = max(num_refreshes, int(due // refresh_s))
                while num_refreshes and num_refreshes * refresh_s > due:
                    num_refreshes -= 1
                next_refresh = num_refreshes * refresh_s
                if next_refresh > env.now:
                    delay = next_refresh - env.now
                    self._expect(env.now + delay)
                    yield env.timeout(delay)
                self._snapshots = self.snapshots(copy_index=True)
                num_refreshes += 1
                next_refresh = num_refreshes * refresh_s
                continue
            if due > env.now:
                delay = due - env.now
                self._expect(env.now + delay)
                yield env.timeout(delay)
            self._route(request)
            i += 1
            if i == len(requests) or requests[i].arrival_time + hop > env.now:
                for replica in self.front:  # every request of this instant is routed
                    replica.admit_routed()
        for replica in self.front:
            replica.arrivals_done()

    def _route(self, request: Request) -> None:
        snapshots = self._snapshots if self.refresh_s else self.snapshots(copy_index=False)
        chosen = self.router.route(request, snapshots)
        for replica in self.front:
            if replica.replica == chosen:
                replica.deliver(request)
            else:
                replica.skip()
