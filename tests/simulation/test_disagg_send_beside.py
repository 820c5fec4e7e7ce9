"""A KV message posted during its prefill replica's step: its gather shares the GPU with the
forward, and the receive profile's `send_beside_step` lengthens its time on the wire."""
from __future__ import annotations

import pandas as pd
import pytest
from test_disagg_sim import _scheduler
from test_disagg_sim_receive import PREFILL_S, _profile, _starts
from test_sim import Constant

from experiments.lab.send_beside_step import beside_seconds, parse_list, write_into_profile
from policies import Request, SamplingParams
from policies.disagg import ReplicaRole
from policies.routing import make_router
from sim.fleet import ReplicaSpec
from sim.fleet.disagg import DisaggFleetSimulator, HandoffHost
from sim.latency.kv_receive import KVReceivePrice, read_receive_profile
from sim.latency.shapes import Link

LINK = Link(10.0, 1e-5, 1e-3)  # 10 GB/s, 10 us, 1 ms a message
ROLES = [ReplicaRole.PREFILL, ReplicaRole.DECODE]


def _price(points: tuple[tuple[float, float], ...]) -> KVReceivePrice:
    return KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0), source="t",
                          send_beside_bytes_at=tuple(b for b, _ in points),
                          send_beside_s_at=tuple(s for _, s in points))


def test_the_price_is_linear_between_its_sizes_flat_outside_and_zero_without_points():
    price = _price(((1e6, 1e-4), (3e6, 3e-4)))
    assert price.send_beside_s(2e6) == pytest.approx(2e-4)
    assert price.send_beside_s(1e3) == pytest.approx(1e-4) and price.send_beside_s(1e9) == pytest.approx(3e-4)
    assert _price(((5e6, 2e-4),)).send_beside_s(1.0) == pytest.approx(2e-4)
    assert KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0)).send_beside_s(1e9) == 0.0


@pytest.mark.parametrize(("line", "match"), [
    ("2e6:1e-4 1e6:2e-4", "ascending"),
    ("0:1e-4", "sizes in bytes > 0"),
    ("1e6:-1e-4", r"seconds in \[0, 1\)"),
    ("1e6-1e-4", r"send_beside_step='1e6-1e-4' is invalid: `bytes:seconds` pairs"),
    ("", "send_beside_step is empty"),
])
def test_a_bad_send_beside_line_names_the_file_and_the_field(tmp_path, line, match):
    path = _profile(tmp_path)
    with open(path, "a") as f:
        f.write(f"# send_beside_step: {line}\n")
    with pytest.raises(ValueError, match=match) as e:
        read_receive_profile(path)
    assert str(path) in str(e.value) and "send_beside_step" in str(e.value)


def _run(receive: KVReceivePrice) -> pd.DataFrame:
    """A 1P + 1D pair, prefill steps of 10 ms, each side acting at once (no hop, no step
    boundaries: a message's link time is its wire time); the decode side's request rows."""
    requests = [Request(f"r{i}", list(range(30 + 7 * (i % 5))), SamplingParams(max_tokens=4, ignore_eos=True),
                        arrival_time=0.006 * i + 0.0013 * (i % 3)) for i in range(30)]
    specs = [ReplicaSpec(_scheduler(400), Constant(PREFILL_S)), ReplicaSpec(_scheduler(400), Constant(0.003))]
    DisaggFleetSimulator(specs, ROLES, make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), requests, [LINK, None], [4096, 0],
                         host=HandoffHost(hop_s=0.0, step_boundaries=False), receive=receive).run()
    return pd.DataFrame(specs[1].scheduler.recorder.requests)


def test_a_message_whose_turn_comes_during_a_prefill_step_is_longer_on_the_wire_by_the_price():
    extra = 0.0007
    rows = _run(_price(((1.0, extra),)))
    assert len(rows) == 30
    start = _starts(rows)
    wire = LINK.transfer_time(1) - 1 / 10e9 + rows["transfer_bytes"].groupby(start).transform("sum") / 10e9
    lost = (rows["link_time"] - wire).round(12)
    # A message sent as the prefill replica's next step starts pays the price; one sent with the
    # replica idle (no request waiting) does not: both happen in this run.
    assert set(lost.round(9)) == {0.0, round(extra, 9)}
    plain = _run(_price(((1.0, 0.0),)))  # a zero price: every message at the link's own time
    start = _starts(plain)
    wire = LINK.transfer_time(1) - 1 / 10e9 + plain["transfer_bytes"].groupby(start).transform("sum") / 10e9
    assert (plain["link_time"] - wire).abs().max() < 1e-9

def test_the_tools_figures_go_into_a_profile_the_simulator_reads(tmp_path):
    alone = {20: [1e-4, 1.2e-4, 1.1e-4], 40: [2e-4, 2e-4, 2e-4]}
    beside = {20: [3e-4, 3.1e-4, 2.9e-4], 40: [1.5e-4, 1.9e-4, 1.8e-4]}
    lost = beside_seconds(alone, beside)
    assert lost[20] == pytest.approx(1.9e-4) and lost[40] == 0.0  # never below 0
    path = _profile(tmp_path)
    before = path.read_text()
    write_into_profile(path, [(1e7, lost[20]), (2e7, lost[40])], "a test")
    write_into_profile(path, [(1e7, lost[20]), (2e7, 1e-5)], "again")  # replaces, never repeats
    text = path.read_text()
    assert text.startswith(before.rstrip("\n")) and text.count("# send_beside_step:") == 1
    assert "# send_beside_from: again" in text
    price = read_receive_profile(path)
    assert price.send_beside_s(1.5e7) == pytest.approx((1.9e-4 + 1e-5) / 2)
    with pytest.raises(ValueError, match="seconds in"):
        write_into_profile(path, [(1e7, 2.0)], "bad")
    assert read_receive_profile(path).send_beside_s(2e7) == pytest.approx(1e-5)  # the bad write left it
    assert parse_list("0.5,0.1,0.5", float, "--delays", 0.0, 0.95) == [0.1, 0.5]
    with pytest.raises(ValueError, match=r"--delays='0.1,x' is invalid"):
        parse_list("0.1,x", float, "--delays", 0.0, 0.95)
    with pytest.raises(ValueError, match=r"--blocks='0' is invalid"):
        parse_list("0", int, "--blocks", 1, 100_000)


def test_the_host_time_after_a_synchronous_step_is_not_a_step():
    """A synchronous prefill replica's host time after its step keeps `step_end` ahead, but its GPU
    is idle then: a message whose turn comes in that gap pays nothing."""
    one = [Request("r0", list(range(40)), SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)]
    specs = [ReplicaSpec(_scheduler(400), Constant(PREFILL_S)), ReplicaSpec(_scheduler(400), Constant(0.003))]
    DisaggFleetSimulator(specs, ROLES, make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), one, [LINK, None], [4096, 0],
                         host=HandoffHost(hop_s=0.0, step_boundaries=False, per_step_s=0.005),
                         receive=_price(((1.0, 0.0007),))).run()
    row = pd.DataFrame(specs[1].scheduler.recorder.requests).iloc[0]
    assert row["link_time"] == pytest.approx(LINK.transfer_time(row["transfer_bytes"]), abs=1e-12)


def test_the_gather_wait_holds_the_link_but_puts_no_bytes_on_the_wire(monkeypatch):
    """The busy-link charges (the decode side's share of a step with bytes on the wire) count a
    message from its first byte: its interval is the link's own time, after any gather wait."""
    from sim.fleet import busy_link

    added = []
    monkeypatch.setattr(busy_link.BusyLinkCharge, "add", lambda self, begin, end: added.append(end - begin))
    extra = 0.0007
    price = KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0), (1.0,), (2.0,), "t",
                           send_beside_bytes_at=(1.0,), send_beside_s_at=(extra,))
    rows = _run(price)
    start = _starts(rows)
    wire = (LINK.transfer_time(1) - 1 / 10e9
            + rows["transfer_bytes"].groupby(start).sum() / 10e9).round(12)
    lost = (rows.groupby(start)["link_time"].first() - wire).round(9)
    assert set(lost) == {0.0, round(extra, 9)}  # some messages waited for their gather
    assert sorted(round(a, 12) for a in added) == sorted(wire)
