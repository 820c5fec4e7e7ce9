"""`FleetFeed`: the parent's loop of an engine fleet run (experiments/lib/engine_fleet.py): each
request goes to its replica at its arrival time on the wall clock, while the replicas' step reports
come back.

The run's t=0 is taken once every replica is ready for it (`start_together`: each has taken the
run's config and workload and reset its engine, and said so), not when the run is sent: a request
due at 0 then reaches a replica that can take it, instead of waiting in its pipe while the replica
unpickles the workload and builds its scheduler (~0.1 s at 2000 requests).

Two rules keep the dispatch hop (arrival -> the request in its replica's pipe) as short as one
message:
- A request is sent the moment it is due, also while reports are pending: the reports are read
  one at a time, and the due requests are sent between two of them (each routed with the reports
  read so far, the newest the router can have), never after a whole backlog.
- The loop wakes at the arrival time, not up to a millisecond after it:
  `multiprocessing.connection.wait` rounds its timeout up to whole milliseconds (the selectors
  do), so `wait_until` sleeps in whole milliseconds short of the deadline and polls the rest (a
  busy loop of at most a millisecond per arrival).
A replica takes new requests only between two of its steps, right after it sent its report; a
request sent late misses that boundary and waits one step more (in the runs measured before these
rules, 40% of the requests did: docs/fleet.md, "The dispatch hop").
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from policies.request import Request

_TICK_S = 1e-3  # the granularity `wait` rounds its timeout up to


def wait_until(objects: Sequence[Any], deadline: float, clock: Callable[[], float] = time.perf_counter,
               waiter: Callable[[Sequence[Any], float], list] = wait) -> list:
    """The objects of `objects` that are ready, as soon as one is; [] once `clock()` reaches
    `deadline` (a finite value of `clock`), not a tick later (module docstring)."""
    while True:
        left = deadline - clock()
        if left <= 0:
            return waiter(objects, 0)
        ready = waiter(objects, max(left - _TICK_S, 0.0))
        if ready:
            return ready


def start_together(conns: Sequence[Connection], sentinels: Sequence[int], timeout_s: float,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """The run's t=0 (a `clock` value), taken once every connection sent ("ready",) and sent to each
    as ("start", t0). RuntimeError if a replica process exits (its sentinel) or sends anything else
    first, TimeoutError if one is not ready within `timeout_s`."""
    waiting = dict(enumerate(conns))
    by_sentinel = {s: i for i, s in enumerate(sentinels)}
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        ready = wait([*waiting.values(), *by_sentinel], max(left, 0.0)) if left > 0 else []
        if not ready:
            raise TimeoutError(f"engine replicas {sorted(waiting)} were not ready for the run within {timeout_s} s")
        for obj in ready:
            if obj in by_sentinel:
                raise RuntimeError(f"engine replica {by_sentinel[obj]} exited before the run started")
            i = next(i for i, c in waiting.items() if c is obj)
            message = obj.recv()
            if isinstance(message, BaseException):
                raise message
            if message != ("ready",):
                raise RuntimeError(f"engine replica {i} sent {message!r} before the run started (expected ('ready',))")
            del waiting[i]
    start = clock()
    for conn in conns:
        conn.send(("start", start))
    return start


@dataclass(slots=True)
class FleetFeed:
    """One run's feed: `requests` (by arrival time, seconds after `start`, a `clock` value) go out
    through `dispatch(request, now)`; each message of replica i's connection goes to
    `receive(i, message)`."""

    conns: Sequence[Connection]
    sentinels: Sequence[int]  # the replica processes' sentinels, in the order of `conns`
    requests: Sequence[Request]
    start: float
    dispatch: Callable[[Request, float], None]
    receive: Callable[[int, Any], None]
    end_timeout_s: float
    clock: Callable[[], float] = time.perf_counter
    next_req: int = 0

    def dispatch_due(self) -> None:
        """Send every request due by now."""
        requests = self.requests
        while self.next_req < len(requests):
            now = self.clock() - self.start
            if requests[self.next_req].arrival_time > now:
                return
            self.dispatch(requests[self.next_req], now)
            self.next_req += 1

    def run(self, finished: Callable[[], bool]) -> None:
        """Feed until `finished()`: every request sent, then ("end",) to each replica. Raises
        RuntimeError when a replica process exits, TimeoutError when the replicas send nothing for
        `end_timeout_s` after the last request went out."""
        by_conn = {c: i for i, c in enumerate(self.conns)}
        by_sentinel = {s: i for i, s in enumerate(self.sentinels)}
        watched = [*self.conns, *self.sentinels]
        ended_sent = False
        while not finished():
            self.dispatch_due()
            if self.next_req < len(self.requests):
                ready = wait_until(watched, self.start + self.requests[self.next_req].arrival_time, self.clock)
            else:
                if not ended_sent:
                    self.send_end()
                    ended_sent = True
                ready = wait(watched, self.end_timeout_s)
                if not ready:
                    raise TimeoutError(f"the engine replicas reported nothing for {self.end_timeout_s} s "
                                       "with requests unfinished")
            for obj in ready:
                if obj in by_sentinel:
                    raise RuntimeError(f"engine replica {by_sentinel[obj]} exited during the run")
                i = by_conn[obj]
                while not finished() and obj.poll():
                    self.receive(i, obj.recv())
                    self.dispatch_due()
        if not ended_sent:
            self.send_end()

    def send_end(self) -> None:
        for conn in self.conns:
            conn.send(("end",))
