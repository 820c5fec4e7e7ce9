"""One replica of a simulated fleet: a `Simulator`'s engine process on the fleet's SimPy clock,
fed by the fleet's router instead of its own arrival process.

The fleet calls `deliver` for each request routed here and `skip` for each routed elsewhere, so
`_arrived` counts the fleet's requests this replica is done waiting for and the engine ends once
every request of the fleet is accounted for and its own have ended. A latency model's
`admission_s` is paid by the replica's host, one request after another: the requests routed here
at one instant are admitted together, and those routed while it admits wait in `inbox` and are
admitted together next (as the single-replica simulator admits what arrived while it was admitting). Decode runs end before the fleet's next routing decision or
snapshot refresh (`expect`), so the router reads the state that stepping one by one shows.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from math import inf

import simpy

from policies.request import Request
from sim.latency.base import LatencyModel
from sim.simulator import Simulator


class ReplicaSimulator(Simulator):
    runs_cross_arrivals = False

    def __init__(self, replica: int, env: simpy.Environment, scheduler, latency: LatencyModel,
                 requests: Sequence[Request], stop_lens: Mapping[str, int] | None = None,
                 on_done: Callable[[int], None] | None = None, fast_forward: bool = True) -> None:
        """`requests`: all of the fleet's (their count tells the engine when nothing more can come)."""
        super().__init__(scheduler, latency, requests, stop_lens, on_done, fast_forward)
        self.env = env
        self.replica = replica
        self.num_routed = 0
        self.num_left = 0  # routed here, then ended elsewhere (handed off, or aborted before it arrived)
        self.inbox: list[Request] = []  # routed here, waiting for the host to admit them
        self._admitting = False
        self._expected = 0.0  # the fleet's next routing decision or refresh

    @property
    def num_outstanding(self) -> int:
        """Requests routed here and neither ended here nor gone elsewhere."""
        return self.num_routed - len(self.scheduler.recorder.requests) - self.num_left

    def process(self) -> simpy.Process:
        return self.env.process(self._engine())

    def expect(self, at: float) -> None:
        """The fleet's next event (a routing decision or a snapshot refresh) is at `at`."""
        self._expected = at
        if not self._admitting:
            self._next_arrival_at = at

    def deliver(self, request: Request) -> None:
        """`request` was routed here now."""
        self.num_routed += 1
        if not self.latency.admission_s:
            self.scheduler.add(request, self.env.now)
            self._account(1, added=True)
            return
        self.inbox.append(request)

    def admit_routed(self) -> None:
        """The requests that arrived now are routed: the host starts admitting those routed here,
        unless it is still admitting earlier ones (they wait for the next batch)."""
        if self.inbox and not self._admitting:
            self._admit()

    def _more_may_come(self) -> bool:
        """An arrival is left, or a KV transfer holds blocks of this replica (their end wakes it)."""
        lifecycle = getattr(self.scheduler, "lifecycle", None)
        return super()._more_may_come() or (lifecycle is not None and lifecycle.blocks_in_transfer())

    def wake(self) -> None:
        """Something was added here outside the arrivals (a received hand-off): wake the idle engine."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def close(self) -> None:
        """Nothing more can come here (a decode replica once the prefill side is done): the engine
        ends when its requests have."""
        self._arrived = len(self.requests)
        self.wake()

    def skip(self) -> None:
        """A request of the fleet was routed to another replica."""
        self._account(1, added=False)

    def _account(self, n: int, added: bool) -> None:
        """n more requests accounted for; wake the idle engine if they were added here or if
        nothing more can come (it then ends)."""
        self._arrived += n
        if (added or self._arrived == len(self.requests)) and self._wake is not None \
                and not self._wake.triggered:
            self._wake.succeed()

    def _admit(self) -> None:
        batch, self.inbox = self.inbox, []
        self._admitting = True
        delay = len(batch) * self.latency.admission_s
        self._next_arrival_at = self.env.now + delay
        self.env.timeout(delay).callbacks.append(lambda _: self._admitted(batch))

    def _admitted(self, batch: list[Request]) -> None:
        add, now = self.scheduler.add, self.env.now
        for request in batch:
            add(request, now)
        self._admitting = False
        self._next_arrival_at = self._expected
        self._account(len(batch), added=True)
        if self.inbox:
            self._admit()

    def arrivals_done(self) -> None:
        """Every request of the fleet has been routed."""
        self.expect(inf)
