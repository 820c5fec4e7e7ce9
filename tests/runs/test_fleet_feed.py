"""The engine fleet's feed (experiments/lib/fleet_feed.py): a request due while a replica's reports
are pending goes out before the backlog is read, the loop wakes at an arrival time, not a
rounded-up millisecond after it, and the run's t=0 comes once every replica is ready for it."""
from __future__ import annotations

import math
import threading
import time
from multiprocessing import Pipe

import pytest

from experiments.lib.fleet_feed import FleetFeed, start_together, wait_until
from policies.request import Request, SamplingParams


def _request(request_id: str, arrival: float) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=1), arrival)


def test_a_request_due_while_reports_are_pending_is_sent_before_the_backlog_is_read():
    parent, child = Pipe()
    num_reports = 200
    for k in range(num_reports):
        child.send(("step", 0, k))
    order: list[str] = []

    def receive(i: int, message) -> None:
        time.sleep(2e-4)  # a report's handling: 200 of them outlast the arrival below
        order.append(f"report {message[2]}")

    feed = FleetFeed([parent], [], [_request("r", 0.005)], time.perf_counter(),
                     lambda r, now: order.append(f"sent {r.request_id}"), receive, end_timeout_s=5.0)
    feed.run(lambda: len(order) == num_reports + 1)
    sent_at = order.index("sent r")
    assert 0 < sent_at < num_reports // 2, order[:5]
    assert child.recv() == ("end",)


class _TickClock:
    """A clock and a `wait` that, as multiprocessing's does, sleeps its timeout rounded up to whole
    milliseconds (a poll with timeout 0 costs 10 us)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait(self, objects, timeout: float) -> list:
        self.now += math.ceil(timeout * 1e3) * 1e-3 if timeout > 0 else 1e-5
        return []


def test_wait_until_wakes_at_the_deadline_not_a_rounded_up_millisecond_later():
    for deadline in (0.0004, 0.0025, 0.0101, 0.7):
        t = _TickClock()
        assert wait_until([], deadline, t.clock, t.wait) == []
        assert deadline <= t.now < deadline + 2e-5, (deadline, t.now)


def test_the_runs_t0_is_taken_once_every_replica_is_ready():
    """A replica slow to take the run (its workload, its scheduler) delays t=0, so a request due at
    0 is not sent to a replica that cannot take it yet; each replica gets the same t=0."""
    pipes = [Pipe(), Pipe()]
    ready_at: list[float] = []

    def replica(conn, delay_s: float) -> None:
        time.sleep(delay_s)
        ready_at.append(time.perf_counter())
        conn.send(("ready",))

    threads = [threading.Thread(target=replica, args=(child, d)) for (_, child), d in zip(pipes, (0.0, 0.3))]
    for t in threads:
        t.start()
    start = start_together([parent for parent, _ in pipes], [], timeout_s=10.0)
    for t in threads:
        t.join()
    assert start >= max(ready_at)
    assert [child.recv() for _, child in pipes] == [("start", start), ("start", start)]


def test_a_replica_not_ready_for_the_run_fails_it_within_the_bound():
    parent, child = Pipe()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"engine replicas \[0\] were not ready for the run within 0.2 s"):
        start_together([parent], [], timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    child.send(("step", 0, None))
    with pytest.raises(RuntimeError, match="sent .* before the run started"):
        start_together([parent], [], timeout_s=1.0)
