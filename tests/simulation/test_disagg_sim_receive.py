"""What a KV message costs the engines beside the link (sim/latency/kv_receive.py, priced by
sim/fleet/kv_messages.py): the decode replica's scatter before its next step, its steps beside a receive
on the wire, a synchronous prefill replica's host time per message posted; read from a receive
profile (experiments.bench_kv_receive's CSV) or the hardware's copy rate; off by default."""
import pandas as pd
import pytest
from omegaconf import OmegaConf
from test_disagg_sim import _cfg, _scheduler
from test_sim import Constant

from experiments.lib import factory
from experiments.lib.disagg_backend import receive_price
from experiments.lib.fleet_backend import cluster_config
from experiments.lib.traces import steps_frame
from policies import Request, SamplingParams
from policies.disagg import ReplicaRole
from policies.routing import make_router
from sim.fleet import ReplicaSpec
from sim.fleet.disagg import DisaggFleetSimulator, HandoffHost
from sim.latency.kv_receive import (
    KVReceivePrice,
    hardware_price,
    load_kv_receive,
    read_receive_profile,
    wire_share,
    write_receive_profile,
)
from sim.latency.shapes import Link

DECODE_S, PREFILL_S = 0.003, 0.01


def _profile(tmp_path, scatter_s=0.0, send_host_s=0.0, curve="1:1", name="receive.csv", send_curve=None):
    path = tmp_path / name
    rows = [{"blocks": b, "bytes": b * 4096, "scatter_s": scatter_s, "send_host_s": send_host_s} for b in (1, 64)]
    meta = {"model": "tiny", "busy_step_factor": 2.5, "busy_share_curve": curve}
    write_receive_profile(path, meta | ({} if send_curve is None else {"send_busy_share_curve": send_curve}), rows)
    return path


def test_a_receive_profile_prices_between_and_past_its_sizes(tmp_path):
    path = tmp_path / "p.csv"
    write_receive_profile(path, {"busy_step_factor": 2.6, "busy_share_curve": "0.5:1.2 1:1.6"}, [
        {"blocks": 1, "bytes": 1000, "scatter_s": 1e-4, "send_host_s": 5e-4},
        {"blocks": 3, "bytes": 3000, "scatter_s": 3e-4, "send_host_s": 6e-4}])
    price = read_receive_profile(path)
    assert price.busy_share_at == (0.5, 1.0) and price.busy_factor_at == (1.2, 1.6)
    assert price.scatter_s(2000) == pytest.approx(2e-4) and price.send_host_s(2000) == pytest.approx(5.5e-4)
    assert price.scatter_s(5000) == pytest.approx(5e-4)  # along the last segment
    assert price.scatter_s(0) == pytest.approx(0.0)  # along the first, never below 0
    # The device's copy rate: a copy reads and writes each byte.
    assert hardware_price(4e12).scatter_s(1e9) == pytest.approx(2e9 / 4e12)
    assert not hardware_price(4e12).prices_busy_link
    assert load_kv_receive(None, 4e12) is None and load_kv_receive("hardware", 4e12).send_host_s(1e9) == 0.0


def test_a_step_is_priced_by_the_curve_at_the_share_of_it_the_wire_is_busy():
    price = KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0), (0.25, 0.5, 0.9), (1.1, 1.3, 2.0), "t")
    assert price.busy_factor(0.0) == 1.0  # an idle wire: the step's price
    assert price.busy_factor(0.125) == pytest.approx(1.05)  # from (0, 1) to the first point
    assert price.busy_factor(0.5) == pytest.approx(1.3)
    assert price.busy_factor(0.7) == pytest.approx(1.65)
    assert price.busy_factor(1.0) == pytest.approx(2.0)  # past the last point: its factor
    # The share: the union of the intervals within the step, once; those outside it not at all.
    assert wire_share(10.0, 10.004, []) == 0.0
    assert wire_share(10.0, 10.004, [(9.0, 11.0)]) == pytest.approx(1.0)
    assert wire_share(10.0, 10.004, [(10.002, 11.0)]) == pytest.approx(0.5)
    assert wire_share(10.0, 10.004, [(10.0, 10.002), (10.001, 10.003), (11.0, 12.0)]) == pytest.approx(0.75)


def test_a_format_1_profile_is_refused_naming_the_file_and_the_field(tmp_path):
    path = tmp_path / "old.csv"
    write_receive_profile(path, {"busy_step_factor": 2.6244}, [
        {"blocks": 1, "bytes": 1, "scatter_s": 0, "send_host_s": 0},
        {"blocks": 2, "bytes": 2, "scatter_s": 0, "send_host_s": 0}])
    with pytest.raises(ValueError, match=r"old.csv: no busy_share_curve .*busy_step_factor=2.6244.*# busy_share_curve: 1:1"):
        read_receive_profile(path)
    with path.open("a") as f:  # the way out the error names: its scatter and send times alone
        f.write("# busy_share_curve: 1:1\n")
    assert not read_receive_profile(path).prices_busy_link


def _two_rows(path, curve: str, send_curve: str | None = None) -> None:
    meta = {"busy_share_curve": curve} | ({} if send_curve is None else {"send_busy_share_curve": send_curve})
    write_receive_profile(path, meta, [
        {"blocks": 1, "bytes": 1, "scatter_s": 0, "send_host_s": 0},
        {"blocks": 2, "bytes": 2, "scatter_s": 0, "send_host_s": 0}])


@pytest.mark.parametrize(("write", "match"), [
    (lambda p: p.write_text("blocks,bytes\n1,2\n"), "needs the columns"),
    (lambda p: _two_rows(p, "0.5:0.5"), r"busy_share_curve='0.5:0.5' is invalid: factors must be"),
    (lambda p: _two_rows(p, "0.5:1.2 0.25:1.1"), "shares must be ascending in"),
    (lambda p: _two_rows(p, "1.5:1.2"), "shares must be ascending in"),
    (lambda p: _two_rows(p, "0.5-1.2"), r"busy_share_curve='0.5-1.2' is invalid: `share:factor` pairs"),
    (lambda p: _two_rows(p, ""), "busy_share_curve is empty"),
    (lambda p: _two_rows(p, "1:1", "0.5-1.2"), r"send_busy_share_curve='0.5-1.2' is invalid: `share:factor` pairs"),
    (lambda p: _two_rows(p, "1:1", "0.5:0.9"), r"send_busy_share_curve='0.5:0.9' is invalid: factors must be"),
    (lambda p: _two_rows(p, "1:1", "0.5:1.2 0.4:1.3"), r"send_busy_share_curve=.* shares must be ascending"),
    (lambda p: write_receive_profile(p, {"busy_share_curve": "1:1"}, [
        {"blocks": 1, "bytes": 1, "scatter_s": -1, "send_host_s": 0},
        {"blocks": 2, "bytes": 2, "scatter_s": 0, "send_host_s": 0}]), "scatter_s values must be seconds"),
    (lambda p: write_receive_profile(p, {"busy_share_curve": "1:1"},
                                     [{"blocks": 1, "bytes": 1, "scatter_s": 0, "send_host_s": 0}]),
     "at least two sizes"),
])
def test_a_bad_receive_profile_names_the_file_and_the_field(tmp_path, write, match):
    path = tmp_path / "bad.csv"
    write(path)
    with pytest.raises(ValueError, match=match) as e:
        read_receive_profile(path)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError, match=r"cluster.kv_receive_profile='nope.csv'.*no such file"):
        read_receive_profile("nope.csv")


def test_the_setting_is_off_by_default_and_checked():
    assert cluster_config(_cfg()).kv_receive_profile is None
    with pytest.raises(ValueError, match="cluster.kv_receive_profile=5 is invalid"):
        cluster_config(_cfg("cluster.kv_receive_profile=5"))
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "cluster.kv_receive_profile=hardware",
               "hardware=h200")
    price = receive_price(cluster_config(cfg), [cfg, cfg])
    assert price.scatter_s(1e9) == pytest.approx(2e9 / factory.hardware(cfg).hbm_bandwidth)


def _run(receive: KVReceivePrice | None, every_s: float = 0.012, sends_mid_step: bool = True):
    """A 1P + 1D pair (prefill steps of 10 ms, decode steps of 3 ms, an arrival about each `every_s`,
    irregular enough that KV lands mid-step), each side acting between its steps (the prefill side
    posting its sends during them, with `sends_mid_step`); its decode rows and each replica's steps."""
    requests = [Request(f"r{i}", list(range(30 + 7 * (i % 5))), SamplingParams(max_tokens=12, ignore_eos=True),
                        arrival_time=every_s * i + 0.0013 * (i % 3)) for i in range(30)]
    specs = [ReplicaSpec(_scheduler(400), Constant(PREFILL_S)), ReplicaSpec(_scheduler(400), Constant(DECODE_S))]
    DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5, 1e-3), None], [4096, 0],
                         host=HandoffHost(hop_s=1e-4, step_boundaries=True, sends_mid_step=sends_mid_step),
                         receive=receive).run()
    rows = pd.DataFrame(specs[1].scheduler.recorder.requests)
    return rows, [steps_frame(spec.scheduler.recorder) for spec in specs]


def _starts(rows: pd.DataFrame) -> pd.Series:
    """Each request's transfer start (a message's requests share one)."""
    return (rows["arrival_time"] + rows["queueing_time"] + rows["prefill_time"] + rows["decode_wait"]
            + rows["link_wait"]).round(12)


def _messages(rows: pd.DataFrame) -> int:
    return _starts(rows).nunique()


def _wire(rows: pd.DataFrame) -> list[tuple[float, float]]:
    """Each message's turn on the link to its last byte (the link of `_run`: 10 GB/s, 10 us, 1 ms)."""
    start = _starts(rows)
    done = start + rows["transfer_bytes"].groupby(start.round(12)).transform("sum") / 10e9 + 1e-5 + 1e-3
    return sorted(set(zip(start.round(12), done.round(12))))


def test_the_decode_replicas_next_step_after_a_receive_waits_for_its_scatter(tmp_path):
    scatter = 0.0017
    rows, (_, decode) = _run(read_receive_profile(_profile(tmp_path, scatter_s=scatter)))
    assert len(rows) == 30
    extra = (decode["duration"] - DECODE_S).round(9)
    assert set(extra) <= {0.0, round(scatter, 9), round(2 * scatter, 9)}
    assert extra.sum() == pytest.approx(scatter * _messages(rows))
    first = rows["arrival_time"] + rows["queueing_time"] + rows["prefill_time"] + rows["transfer_time"]
    slowed = decode.loc[extra > 0, "time"]
    assert all(((slowed >= t - 1e-12)).any() for t in first)  # each after a receive
    _, (_, off) = _run(None)
    assert (off["duration"] - DECODE_S).abs().max() < 1e-12  # off: every step at its price


def test_decode_steps_pay_the_curve_at_the_share_of_them_the_wire_is_busy(tmp_path):
    """A step pays (factor(share) - 1) x its price, share from the link's own transfer intervals
    (the message's turn on the link to its last byte; posted and not sent: not busy): at its start
    for the wire known then, the rest of its whole share with the next step."""
    rows, (_, decode) = _run(read_receive_profile(_profile(tmp_path, curve="0.5:1.5 1:2")))
    wire = _wire(rows)
    decode = decode.sort_values("time")
    extra = (decode["duration"] - DECODE_S).to_numpy()
    factor = [1.0 + min(s, 1.0) for s in (wire_share(t, t + DECODE_S, wire) for t in decode["time"])]
    owed = [(f - 1.0) * DECODE_S for f in factor]
    assert max(owed) > 0 and 0 < min(o for o in owed if o > 0) < DECODE_S - 1e-9  # partly covered steps
    # Every step's busy-link seconds are paid, by itself or the step after it.
    assert extra.sum() == pytest.approx(sum(owed[:-1]) + min(owed[-1], extra[-1]), abs=1e-9)
    known = [(f - 1.0) * DECODE_S for f in (1.0 + min(wire_share(t, t + DECODE_S, [w for w in wire if w[0] <= t]), 1.0)
                                          for t in decode["time"])]
    late = [o - k for o, k in zip(owed, known)]
    assert extra[1:] == pytest.approx([k + lt for k, lt in zip(known[1:], late[:-1])], abs=1e-9)
    assert max(late) > 0  # transfers reached the wire mid-step


def test_a_send_side_curve_is_optional_and_prices_by_share():
    price = KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0), (1.0,), (1.0,), "t", (0.5, 1.0), (1.2, 1.6))
    assert price.prices_send_busy_link and not price.prices_busy_link
    assert price.send_busy_factor(0.25) == pytest.approx(1.1) and price.send_busy_factor(1.0) == pytest.approx(1.6)
    assert price.busy_factor(0.5) == 1.0  # the decode side's own curve
    assert KVReceivePrice((0.0, 1.0), (0.0, 0.0), (0.0, 0.0)).send_busy_factor(0.5) == 1.0  # none: factor 1


def test_prefill_steps_pay_the_send_curve_at_the_share_of_them_their_link_sends(tmp_path):
    """A prefill step pays (send_factor(share) - 1) x its price, share from its outgoing link's
    transfer intervals (the decode side's rule); without the key its steps cost their price."""
    price = read_receive_profile(_profile(tmp_path, send_curve="0.5:1.5 1:2"))
    assert price.send_busy_share_at == (0.5, 1.0) and price.send_busy_factor_at == (1.5, 2.0)
    rows, (prefill, decode) = _run(price)
    assert len(rows) == 30
    wire, prefill = _wire(rows), prefill.sort_values("time")
    extra = (prefill["duration"] - PREFILL_S).to_numpy()
    owed = [min(wire_share(t, t + PREFILL_S, wire), 1.0) * PREFILL_S for t in prefill["time"]]
    assert max(owed) > 0 and 0 < min(o for o in owed if o > 0) < PREFILL_S - 1e-9  # partly covered steps
    # Every step's busy-link seconds are paid, by itself or the step after it.
    assert extra.sum() == pytest.approx(sum(owed[:-1]) + min(owed[-1], extra[-1]), abs=1e-9)
    assert (decode["duration"] - DECODE_S).abs().max() < 1e-12  # the decode side's curve is 1:1
    _, (off, _) = _run(read_receive_profile(_profile(tmp_path, name="no-send.csv")))
    assert (off["duration"] - PREFILL_S).abs().max() < 1e-12


def _gaps(steps: pd.DataFrame):
    steps = steps.sort_values("time")
    return steps["time"].iloc[1:].to_numpy() - (steps["time"] + steps["duration"]).iloc[:-1].to_numpy()


def test_a_synchronous_prefill_replica_pays_each_messages_send_before_a_later_step(tmp_path):
    """Sends posted when the prefill replica's step ends (`sends_mid_step=False`)."""
    send = 0.004
    rows, (prefill, _) = _run(read_receive_profile(_profile(tmp_path, send_host_s=send)), every_s=0.004,
                              sends_mid_step=False)
    gaps = _gaps(prefill)  # arrivals outpace its steps: never idle, every gap is host time
    assert set((gaps / send).round(9)) <= {0.0, 1.0, 2.0}
    start = _starts(rows).drop_duplicates().sort_values()
    last, before_last = prefill["time"].max(), prefill["time"].nlargest(2).min()
    # Each send is paid at the prefill replica's next step boundary (one after the last step: never).
    assert (start < before_last).sum() <= round(gaps.sum() / send) <= (start < last).sum()
    assert gaps.sum() > 0
    _, (off, _) = _run(None, every_s=0.004)
    assert _gaps(off).max() < 1e-12


def test_a_send_posted_mid_step_starts_a_hop_after_its_reservation_and_costs_no_gap(tmp_path):
    """With `sends_mid_step` (the engine pair's default) the decode side's answer is acted on as it
    reaches the busy prefill replica: the send starts `hop_s` after the reservation (the link free),
    never at the step's end, and its host time is spent while the host waits for the step."""
    receive = read_receive_profile(_profile(tmp_path, send_host_s=0.004))
    rows, (prefill, _) = _run(receive, every_s=0.004)
    assert _gaps(prefill).max() < 1e-12  # busy throughout, every send posted mid-step
    assert rows["link_wait"].min() == pytest.approx(1e-4, abs=1e-12)  # the hop back, the link free
    end_rows, _ = _run(receive, every_s=0.004, sends_mid_step=False)
    assert rows["link_wait"].mean() < end_rows["link_wait"].mean() - 1e-3  # not a step later
    with pytest.raises(ValueError, match="cluster.prefill_sends_mid_step='no' is invalid: must be true or false"):
        HandoffHost(sends_mid_step="no")
    cluster = cluster_config(OmegaConf.create({"cluster": {"replicas": 2, "roles": ["prefill", "decode"],
                                                            "prefill_sends_mid_step": False}}))
    assert cluster.prefill_sends_mid_step is False


class _Admitting(Constant):
    admission_s = 0.0005


def test_a_synchronous_prefill_replica_admits_its_arrivals_between_its_steps():
    """`cluster.prefill_admits_between_steps`: the requests routed to a synchronous prefill replica
    during a step cost it `admission_s` each before its next step; off, nothing."""
    def gaps(admits: bool):
        requests = [Request(f"r{i}", list(range(40)), SamplingParams(max_tokens=2, ignore_eos=True),
                            arrival_time=0.003 * i) for i in range(20)]
        specs = [ReplicaSpec(_scheduler(400), _Admitting(PREFILL_S)), ReplicaSpec(_scheduler(400), Constant(DECODE_S))]
        DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                             make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5), None], [4096, 0],
                             host=HandoffHost(admits_between_steps=admits)).run()
        steps = steps_frame(specs[0].scheduler.recorder).sort_values("time")
        return _gaps(steps), steps
    on, steps = gaps(True)
    ends, at = (steps["time"] + steps["duration"]).tolist(), [0.003 * i for i in range(20)]
    # Paid after each step: the requests routed since the step before it ended.
    routed = [sum(a < end + 1e-12 for a in at) for end in ends]
    assert on.max() > 0 and on == pytest.approx([0.0005 * (b - a) for a, b in zip([0, *routed], routed)][:-1],
                                                abs=1e-9)
    off, _ = gaps(False)
    assert off.max() < 1e-12
    with pytest.raises(ValueError, match="cluster.prefill_admits_between_steps=1 is invalid"):
        HandoffHost(admits_between_steps=1)


def test_kv_send_busy_off_keeps_the_profile_but_not_its_send_curve(tmp_path):
    """`cluster.kv_send_busy=false`: the receive profile prices as before, the prefill replicas'
    steps at their price; a non-boolean names the key."""
    path = _profile(tmp_path, send_curve="0.5:1.5 1:2")
    path.write_text(path.read_text().replace("# model: tiny", "# model: qwen3-0.6b"))  # the run's model
    base = ["cluster.replicas=2", "cluster.roles=[prefill,decode]", f"cluster.kv_receive_profile={path}",
            "hardware=h200"]
    cfg = _cfg(*base)
    on = receive_price(cluster_config(cfg), [cfg, cfg])
    assert cluster_config(cfg).kv_send_busy is True and on.prices_send_busy_link
    cfg = _cfg(*base, "cluster.kv_send_busy=false")
    off = receive_price(cluster_config(cfg), [cfg, cfg])
    assert not off.prices_send_busy_link and off.send_busy_factor(0.5) == 1.0
    assert (off.bytes_at, off.scatter_at, off.busy_factor_at) == (on.bytes_at, on.scatter_at, on.busy_factor_at)
    with pytest.raises(ValueError, match="cluster.kv_send_busy='no' is invalid: must be true or false"):
        cluster_config(_cfg(*base, "cluster.kv_send_busy=no"))
