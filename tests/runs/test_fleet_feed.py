"""The engine fleet's feed (experiments/lib/fleet_feed.py): a request due while a replica's reports
are pending goes out before the backlog is read, and the loop wakes at an arrival time, not a
rounded-up millisecond after it."""
from __future__ import annotations

import math
import time
from multiprocessing import Pipe

from experiments.lib.fleet_feed import FleetFeed, wait_until
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
