"""The duty-sweep table (experiments/lib/kv_receive_duty.py): steps binned by the share of them the
wire was busy, the `busy_share_curve` the simulator reads, and the bench's wire intervals."""
import time
from types import SimpleNamespace

import numpy as np
import pytest

from experiments.lib.kv_receive_duty import busy_share_curve, share_bins, step_shares, summarise, sweep_rows
from experiments.lib.kv_send_duty import MAX_IN_FLIGHT, send_rows, send_sweep, summarise_send
from sim.latency.kv_receive import KVReceivePrice


def test_the_curve_has_a_point_per_busy_bin_with_enough_steps():
    shares = np.array([0.0] * 6 + [0.4] * 5 + [0.6] * 4 + [1.0] * 5)
    ratios = np.array([1.5] * 6 + [1.2] * 4 + [1.4] + [3.0] * 4 + [0.9] * 5)
    bins = share_bins(shares, ratios)
    assert [(b.label, b.steps) for b in bins] == [("0", 6), ("0.25-0.5", 5), ("0.5-0.75", 4), ("1", 5)]
    assert bins[1].median == pytest.approx(1.2) and bins[1].mean == pytest.approx(1.24)
    # No point for the idle wire (1.0 there by definition) nor for 4 steps; a ratio below 1 floored.
    curve = busy_share_curve(bins)
    assert curve == "0.4000:1.2000 1.0000:1.0000"
    price = KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0), (0.4, 1.0), (1.2, 1.0))
    assert price.busy_factor(0.2) == pytest.approx(1.1)
    assert busy_share_curve(share_bins(np.zeros(9), np.ones(9))) == "1:1"


def test_a_message_is_on_the_wire_from_the_later_of_its_posting_and_its_send():
    # Receive posted at 1.0, sent at 1.002, complete at 1.006; steps [1.000, 1.004], [1.004, 1.008].
    sweep = {"receives": [(0.5, 0.002, 1.0, 1.006)], "steps": [(0.5, 0.002, 1.0, 1.004), (0.5, 0.002, 1.004, 1.008)]}
    rows = sweep_rows(sweep, [1.002], 0.004)
    assert [r["share"] for r in rows] == [0.5, 0.5] and [r["over_idle"] for r in rows] == [1.0, 1.0]
    assert [r["posted"] for r in rows] == [1.0, 0.5] and rows[0]["lead_ms"] == 2.0
    assert rows[1]["start_s"] == pytest.approx(0.004) and rows[0]["setting"] == 0.5
    assert step_shares([0.0], [1.0], [(0.2, 0.4), (0.3, 0.6), (2.0, 3.0)]).tolist() == pytest.approx([0.4])
    with pytest.raises(RuntimeError, match="posted 1 receives for 2 sends"):
        sweep_rows(sweep, [1.0, 1.1], 0.004)


def test_the_summary_takes_the_curve_from_the_first_lead():
    rows = [{"setting": 1.0, "lead_ms": lead, "share": share, "posted": 1.0, "over_idle": ratio}
            for lead, share, ratio in [(0.0, 0.6, 1.5)] * 5 + [(13.0, 0.6, 2.0)] * 5 + [(13.0, 0.0, 1.1)] * 5]
    curve, meta, text = summarise(rows, [0.0, 13.0])
    assert curve == "0.6000:1.5000"
    assert meta["share_bin lead 13ms 0.5-0.75"] == "steps 5 share 0.6000 median 2.0000 mean 2.0000"
    assert meta["wire idle, posted lead 13ms"] == "steps 5 median over idle 1.1000"
    assert meta["wire idle, posted"] == "steps 0" and "duty 1 lead 13ms" in meta
    assert "receives posted 13 ms before their send" in text


class _FakeTransfer:
    def __init__(self, posted_at: float):
        self.posted_at, self.finished_at, self.error = posted_at, None, None
        self.staging = bytearray(1024)  # what the sweep must not keep once the receive has ended


class _FakeLink:
    """Every receive ends at the poll after its send was asked for; `fail` ends one with an error."""

    def __init__(self, fail: int | None = None):
        self.open, self.sent, self.finished, self.fail, self.count = [], 0, [], fail, 0

    def post(self) -> _FakeTransfer:
        t = _FakeTransfer(len(self.finished) + len(self.open))
        self.open.append(t)
        return t

    def ask(self) -> None:
        self.sent += 1

    @property
    def num_in_flight(self) -> int:
        return len(self.open)

    def poll(self) -> list:
        ended = []
        while self.open and self.sent > 0:
            t = self.open.pop(0)
            self.sent -= 1
            t.finished_at = t.posted_at + 0.001
            self.count += 1
            if self.count == self.fail:
                t.error = RuntimeError("peer gone")
            ended.append(t)
        return ended

    def wait_all(self, timeout_s: float) -> list:
        return self.poll()


def test_the_sweep_keeps_the_times_of_ended_receives_not_their_buffers():
    import time
    import weakref

    from experiments.lib.kv_receive_duty import duty_sweep

    link, refs = _FakeLink(), []

    def post():
        t = link.post()
        refs.append(weakref.ref(t))
        return t

    out = duty_sweep(link, lambda: None, link.ask, post, [(1.0, 0.0)], 20, time.monotonic() + 5, 1.0)
    assert len(out["receives"]) == len(refs) >= 4 and len(out["steps"]) == 20
    assert all(len(r) == 4 and r[3] == pytest.approx(r[2] + 0.001) for r in out["receives"])
    assert [r() for r in refs] == [None] * len(refs)  # nothing holds an ended receive's staging
    bad = _FakeLink(fail=2)
    with pytest.raises(RuntimeError, match="did not complete"):
        duty_sweep(bad, lambda: None, bad.ask, bad.post, [(1.0, 0.0)], 5, time.monotonic() + 5, 1.0)


def test_a_failed_link_names_where_the_sweep_was():
    import time

    from experiments.lib.kv_receive_duty import duty_sweep

    link = _FakeLink()
    calls = []

    def post():
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("made no progress")
        return link.post()

    with pytest.raises(RuntimeError, match=r"utilisation 0.5, lead 0 ms: 4 receives posted, .* made no progress"):
        duty_sweep(link, lambda: time.sleep(0.001), link.ask, post, [(0.5, 0.0)], 50, time.monotonic() + 5, 1.0)


def test_a_bench_step_waits_for_the_compute_stream_not_the_link(monkeypatch):
    """A device-wide sync would wait for the link's side stream too: a receive posted ahead of its
    send (asked for only after the step) would never end."""
    import torch

    from experiments.lib import kv_receive_sides

    waited = []

    class Stream:
        def synchronize(self):
            waited.append("compute")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waited.append("device"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())

    class Runner:
        def launch(self, step):
            waited.append("step")
            return "launched"

        def collect(self, launched):
            waited.append(f"collect {launched}")

    kv_receive_sides.Steps(Runner(), object(), torch.device("cuda", 0), sync=True)()
    assert waited == ["step", "collect launched", "compute"]


def test_bench_steps_scheduled_ahead_keep_one_step_in_flight():
    """By default a call launches its step, then waits for the one launched before it (the engines'
    async scheduling); `drain` waits for the last one. Nothing syncs the device."""
    from experiments.lib import kv_receive_sides

    calls = []

    class Runner:
        def launch(self, step):
            calls.append(("launch", len(calls)))
            return len(calls) - 1

        def collect(self, launched):
            calls.append(("collect", launched))

    steps = kv_receive_sides.Steps(Runner(), object(), None, sync=False)
    steps()
    steps()
    steps()
    assert calls == [("launch", 0), ("launch", 1), ("collect", 0), ("launch", 3), ("collect", 1)]
    steps.drain()
    assert calls[-1] == ("collect", 3) and steps.in_flight is None
    steps.drain()  # nothing in flight: nothing waited for
    assert len(calls) == 6


class _InstantLink:
    """A sending link whose messages end as they are sent (gloo on one host, small messages)."""

    def __init__(self) -> None:
        self.ended, self.num_in_flight = [], 0

    def send(self) -> None:
        now = time.monotonic()
        self.ended.append(SimpleNamespace(posted_at=now, finished_at=now + 1e-5, error=None))

    def poll(self) -> list:
        ended, self.ended = self.ended, []
        return ended

    def wait_all(self, timeout_s: float) -> list:
        return self.poll()


def test_the_send_sweep_sends_what_is_due_and_no_backlog_when_posting_is_slower_than_the_period():
    link = _InstantLink()

    def send_one() -> None:  # posting (the receiver's answer, the send call) takes longer than a period
        time.sleep(0.0005)
        link.send()

    def step() -> None:
        time.sleep(0.002)

    sweep = send_sweep(link, step, send_one, [1.0], 10, 3, time.monotonic() + 30, 1.0)
    assert len(sweep["idle"]) == 3 and len([s for s in sweep["steps"] if s[0] == 1.0]) == 10
    sends = [s for s in sweep["sends"] if s[0] == 1.0]
    # A period of 10 us, posting 500 us: at most MAX_IN_FLIGHT sends before each step, no backlog.
    assert 10 <= len(sends) <= 10 * MAX_IN_FLIGHT
    rows = send_rows(sweep)
    assert len(rows) == 10 and all(r["share"] >= 0 and r["over_idle"] > 0 for r in rows)
    curve, meta, text = summarise_send(rows)
    assert "send duty 1" in meta and "prefill steps beside sends" in text and curve


def test_the_send_sweep_posts_after_the_launch_inside_the_steps_time():
    """`after_launch`: the sends due at a step are posted once it is launched and before it is
    waited for (as the pair's front posts them mid-step), inside the step's timed window."""
    link, order = _InstantLink(), []

    def send_one() -> None:
        order.append("send")
        link.send()

    class Step:
        def __call__(self) -> None:
            order.append("idle step")
            time.sleep(0.001)

        def launch(self) -> None:
            order.append("launch")

        def finish(self) -> None:
            order.append("finish")
            time.sleep(0.001)

    sweep = send_sweep(link, Step(), send_one, [1.0], 5, 2, time.monotonic() + 30, 1.0, after_launch=True)
    busy = order[order.index("launch"):]
    assert busy[:3] == ["launch", "send", "finish"] and busy.count("launch") == 5 == busy.count("finish")
    # Every send of the sweep follows a launch (or another send), so lies between a launch and its finish.
    assert all(busy[i - 1] in ("launch", "send") for i, o in enumerate(busy) if o == "send")
    assert len([s for s in sweep["steps"] if s[0] == 1.0]) == 5


def test_send_rows_share_is_the_sends_cover_of_each_step():
    sweep = {"idle": [0.004, 0.004, 0.004], "steps": [(1.0, 1.0, 1.004), (1.0, 1.004, 1.008)],
             "sends": [(0.0, 0.5, 0.6), (1.0, 1.002, 1.006)]}
    rows = send_rows(sweep)
    assert [r["share"] for r in rows] == [0.5, 0.5] and [r["over_idle"] for r in rows] == [1.0, 1.0]
    assert rows[1]["start_s"] == pytest.approx(0.004)
