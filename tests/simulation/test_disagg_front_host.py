"""The front host profile (sim/fleet/front_host.py): its file, and a synchronous prefill replica's
loop priced unit by unit from it (per step, per message to the decode side, per KV message posted
instead of the receive profile's send_host_s); `cluster.front_host_profile` through the config."""
import numpy as np
import pandas as pd
import pytest
from test_disagg_sim import _cfg, _scheduler
from test_disagg_sim_receive import _gaps, _profile, _starts
from test_sim import Constant

from experiments.lib.disagg_backend import front_host
from experiments.lib.fleet_backend import cluster_config
from experiments.lib.traces import steps_frame
from policies import Request, SamplingParams
from policies.disagg import ReplicaRole
from policies.routing import make_router
from sim.fleet import ReplicaSpec
from sim.fleet.disagg import DisaggFleetSimulator
from sim.fleet.front_host import UNITS, FrontHostProfile, HandoffHost
from sim.latency.kv_receive import read_receive_profile
from sim.latency.shapes import Link

PROFILE = FrontHostProfile(1e-3, 7e-5, 4e-5, 9e-4, 1.5e-4, 1e-4, (("model", "qwen3-0.6b"), ("device", "H200")))


def test_a_profile_reads_back_what_was_written_and_bad_files_are_named(tmp_path):
    path = tmp_path / "front.csv"
    PROFILE.write(path)
    back = FrontHostProfile.read(path)
    assert back.as_dict() == pytest.approx(PROFILE.as_dict()) and back.model == "qwen3-0.6b"
    assert dict(back.meta)["device"] == "H200"
    text = path.read_text()
    path.write_text(text.replace("read_message_s", "reads_s"))
    with pytest.raises(ValueError, match="unit 'reads_s' is unknown"):
        FrontHostProfile.read(path)
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("step_s")))
    with pytest.raises(ValueError, match=r"units \['step_s'\] are missing"):
        FrontHostProfile.read(path)
    path.write_text(text.replace(f"{PROFILE.handoff_s:.6e}", "-1"))
    with pytest.raises(ValueError, match="handoff_s=-1.0 is invalid"):
        FrontHostProfile.read(path)
    with pytest.raises(ValueError, match="is not a file"):
        FrontHostProfile.read(tmp_path / "none.csv")
    host = HandoffHost.from_profile(PROFILE, 2e-4, False)
    assert (host.hop_s, host.step_boundaries, host.per_handoff_s, host.admits_between_steps) == (2e-4, False, 4e-5, True)
    assert (host.admission_s, host.per_step_s, host.sent_message_s, host.kv_message_s) == (7e-5, 1e-3, 1.5e-4, 9e-4)
    assert len(UNITS) == 6


def _prefill_gaps(host: HandoffHost, receive=None):
    """A 1P + 1D pair whose arrivals outpace its prefill steps (every gap is host time): the prefill
    replica's gaps, its steps and the decode rows."""
    requests = [Request(f"r{i}", list(range(30 + 7 * (i % 5))), SamplingParams(max_tokens=6, ignore_eos=True),
                        arrival_time=0.004 * i + 0.0013 * (i % 3)) for i in range(30)]
    specs = [ReplicaSpec(_scheduler(400), Constant(0.01)), ReplicaSpec(_scheduler(400), Constant(0.003))]
    DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5, 1e-3), None], [4096, 0],
                         host=host, receive=receive).run()
    prefill = steps_frame(specs[0].scheduler.recorder).sort_values("time")
    return _gaps(prefill), prefill, pd.DataFrame(specs[1].scheduler.recorder.requests)


def test_a_step_price_is_paid_after_every_prefill_step():
    gaps, _, _ = _prefill_gaps(HandoffHost(per_step_s=0.002))
    assert len(gaps) > 5 and gaps == pytest.approx([0.002] * len(gaps), abs=1e-9)
    none, _, _ = _prefill_gaps(HandoffHost())
    assert none.max() < 1e-12


def test_messages_to_the_decode_side_are_paid_per_step_with_hand_offs_and_per_kv_message():
    """Sends posted when the prefill step ends (`sends_mid_step=False`); posted during it, only the
    hand-offs' message is paid."""
    sent = 0.001
    mid_step, _, _ = _prefill_gaps(HandoffHost(sent_message_s=sent))
    assert len(mid_step) > 5 and set((mid_step / sent).round(9)) == {1.0}
    gaps, prefill, rows = _prefill_gaps(HandoffHost(sent_message_s=sent, sends_mid_step=False))
    # Its hand-offs' message, and the sends posted since the last boundary (their answers leave the
    # decode side after the hand-offs' message has left the front, so a few may meet at one boundary).
    assert set((gaps / sent).round(9)) <= {1.0, 2.0, 3.0, 4.0}
    # Every step hands off; each message posted is paid at the next step boundary.
    starts = _starts(rows).drop_duplicates()
    last = prefill["time"].max()
    paid = round(gaps.sum() / sent) - len(gaps)
    assert (starts < prefill["time"].nlargest(2).min()).sum() <= paid <= (starts < last).sum()


def test_a_profiles_kv_message_price_replaces_the_receive_profiles_send(tmp_path):
    receive = read_receive_profile(_profile(tmp_path, send_host_s=0.004))
    gaps, _, _ = _prefill_gaps(HandoffHost(kv_message_s=0.001, sends_mid_step=False), receive)
    assert gaps.sum() > 0 and set((gaps / 0.001).round(9)) <= {0.0, 1.0, 2.0}
    by_receive, _, _ = _prefill_gaps(HandoffHost(sends_mid_step=False), receive)
    assert set((by_receive / 0.004).round(9)) <= {0.0, 1.0, 2.0} and by_receive.sum() > gaps.sum()
    with pytest.raises(ValueError, match="kv_message_s=-1 is invalid"):
        HandoffHost(kv_message_s=-1)


def test_the_config_key_reads_a_profile_of_the_runs_model(tmp_path):
    assert cluster_config(_cfg()).front_host_profile is None
    with pytest.raises(ValueError, match="cluster.front_host_profile=5 is invalid"):
        cluster_config(_cfg("cluster.front_host_profile=5"))
    path = tmp_path / "front.csv"
    PROFILE.write(path)
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", f"cluster.front_host_profile={path}",
               "model=qwen3-0.6b", "cluster.handoff_host_s=0.5", "cluster.front_message_host_s=0.5")
    host, reads = front_host(cluster_config(cfg), [cfg, cfg])
    assert host.per_handoff_s == 4e-5 and host.admits_between_steps and host.per_step_s == 1e-3  # the profile's
    assert reads.message_s == 1e-4 and reads.token_s == 0.0
    other = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", f"cluster.front_host_profile={path}",
                 "model=tiny-qwen3")
    with pytest.raises(ValueError, match="was measured on model 'qwen3-0.6b'.*run 'tiny-qwen3'"):
        front_host(cluster_config(other), [other, other])
    plain = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "cluster.handoff_host_s=0.5")
    host, _ = front_host(cluster_config(plain), [plain, plain])
    assert host.per_handoff_s == 0.5 and host.per_step_s == 0.0 and host.kv_message_s is None


def test_a_hand_off_leaves_the_front_after_its_host_work_on_the_steps_hand_offs():
    """The decode side gets a step's hand-offs once the front has ended each (`per_handoff_s`) and
    pickled their message (`sent_message_s`): with neither side waiting for a step boundary and no
    hop, every decode_wait is n x per_handoff_s + sent_message_s, n the hand-offs of its step."""
    per, sent = 2e-4, 1e-3
    _, _, rows = _prefill_gaps(HandoffHost(hop_s=0.0, step_boundaries=False, per_handoff_s=per, sent_message_s=sent))
    n = ((rows["decode_wait"] - sent) / per).round(6)
    assert len(n) == 30 and (n >= 1).all() and (n == n.round()).all() and n.max() >= 2
    _, _, none = _prefill_gaps(HandoffHost(hop_s=0.0, step_boundaries=False))
    assert none["decode_wait"].max() < 1e-12


def test_an_answer_arriving_between_prefill_steps_waits_for_the_next_steps_launch():
    """Sends posted mid-step: the front reads the decode side's answers while it waits for a step,
    so no send starts inside the host time between two prefill steps; some wait for its end."""
    gap = 0.004
    gaps, prefill, rows = _prefill_gaps(HandoffHost(per_step_s=gap, hop_s=1e-4))
    assert len(gaps) > 5 and gaps == pytest.approx([gap] * len(gaps), abs=1e-9)
    prefill = prefill.sort_values("time")
    ends = (prefill["time"] + prefill["duration"]).to_numpy()[:-1]
    nexts = prefill["time"].to_numpy()[1:]
    starts = _starts(rows).drop_duplicates().to_numpy()
    inside = [(s > e + 1e-9) & (s < n - 1e-9) for e, n in zip(ends, nexts) for s in starts]
    assert not any(inside)
    at_gap_end = sum(any(abs(s - n) < 1e-9 for n in nexts) for s in starts)
    assert at_gap_end >= 1


def test_a_profiles_hop_replaces_the_clusters_and_is_optional(tmp_path):
    import dataclasses

    path = tmp_path / "front.csv"
    with_hop = dataclasses.replace(PROFILE, hop_s=9e-4)
    with_hop.write(path)
    assert "hop_s,9.000000e-04" in path.read_text()
    back = FrontHostProfile.read(path)
    assert back.hop_s == pytest.approx(9e-4) and back.as_dict()["hop_s"] == pytest.approx(9e-4)
    assert HandoffHost.from_profile(back, 1e-4).hop_s == pytest.approx(9e-4)
    PROFILE.write(path)  # none in the file: the cluster's hop
    assert FrontHostProfile.read(path).hop_s is None and "hop_s" not in path.read_text()
    assert HandoffHost.from_profile(FrontHostProfile.read(path), 2e-4).hop_s == 2e-4
    with pytest.raises(ValueError, match="front host profile: hop_s=-1 is invalid"):
        dataclasses.replace(PROFILE, hop_s=-1)


def test_an_answer_waits_for_the_running_prefill_steps_launch():
    """With the launch units the front takes no answer before `launch_s` + `launch_prompt_s` per
    prompt after a prefill step starts (its host prepares and launches it): every send posted
    during a step starts at or after that point, and some wait for it."""
    launch, per_prompt = 0.002, 0.0005
    _, prefill, rows = _prefill_gaps(HandoffHost(hop_s=1e-4, launch_s=launch, launch_prompt_s=per_prompt))
    _, _, plain = _prefill_gaps(HandoffHost(hop_s=1e-4))
    prefill = prefill.sort_values("time")
    t0, t1 = prefill["time"].to_numpy(), (prefill["time"] + prefill["duration"]).to_numpy()
    ready = t0 + launch + per_prompt * prefill["num_prefill_seqs"].to_numpy()
    starts = _starts(rows).drop_duplicates().to_numpy()
    step = np.searchsorted(t0, starts + 1e-9, side="right") - 1  # the step each send starts in or after
    during = (step >= 0) & (starts < t1[np.maximum(step, 0)] - 1e-9)
    held_until = np.minimum(ready, t1)[step[during]]
    assert during.sum() > 5 and (starts[during] >= held_until - 1e-9).all()
    assert (np.abs(starts[during] - held_until) < 1e-9).sum() >= 1  # some were held until then
    assert rows["link_wait"].mean() > plain["link_wait"].mean()
    assert HandoffHost(launch_s=0.001, launch_prompt_s=1e-4).launch_window_s(3) == pytest.approx(0.0013)
    assert HandoffHost(launch_s=0.001, sends_mid_step=False).launch_window_s(3) == 0.0
    with pytest.raises(ValueError, match="front host profile: launch_prompt_s=-1 is invalid"):
        HandoffHost(launch_prompt_s=-1)


def test_a_profiles_launch_units_are_optional_and_read_back(tmp_path):
    import dataclasses

    path = tmp_path / "front.csv"
    dataclasses.replace(PROFILE, launch_s=6e-4, launch_prompt_s=1.7e-4).write(path)
    back = FrontHostProfile.read(path)
    assert (back.launch_s, back.launch_prompt_s) == pytest.approx((6e-4, 1.7e-4))
    host = HandoffHost.from_profile(back)
    assert (host.launch_s, host.launch_prompt_s) == pytest.approx((6e-4, 1.7e-4))
    PROFILE.write(path)
    assert HandoffHost.from_profile(FrontHostProfile.read(path)).launch_window_s(4) == 0.0
