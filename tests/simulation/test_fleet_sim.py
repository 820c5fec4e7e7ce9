"""The simulated fleet (sim/fleet/, experiments/lib/fleet_backend.py): one replica is the
single-replica run; runs are deterministic and fast-forward leaves the traces of stepping one by
one; stale snapshots and mixed hardware do what they say."""
import json

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from property_settings import examples
from test_sim import Constant

from experiments.lib import factory
from experiments.lib.backends import run_sim
from experiments.lib.fleet_backend import cluster_config, run_fleet
from experiments.lib.traces import events_frame, requests_frame, steps_frame, write_fleet_traces
from experiments.run import run
from policies import Request, SamplingParams, Scheduler, SchedulerConfig, make_block_manager, make_policy
from policies.routing import ROUTERS, make_router
from policies.trace import TraceRecorder
from sim.fleet import FleetSimulator, ReplicaSpec

SMALL = ["workload.num_requests=40", "progress=false", "plots=false", "seed=5"]
FILES = ("requests.parquet", "steps.parquet", "events.parquet")


def _cfg(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*SMALL, *overrides])


def _frames(recorder):
    return requests_frame(recorder), steps_frame(recorder), events_frame(recorder)


@pytest.mark.parametrize("overrides", [
    [],  # the default run: priority workload, async scheduling, fcfs, paged
    ["scheduler.async_scheduling=false", "blocks=prefix", "workload.shared_prefix_len=64", "router=prefix_aware"],
    ["workload=offline", "router=least_kv", "policy=priority", "blocks.num_gpu_blocks=300"],
    ["backend.fast_forward=false", "router=session", "workload=gamma"],
    # the host's admission cost (profiled): a burst at one instant is admitted together
    ["latency=profiled", "workload=offline"],
    ["latency=profiled", "workload=gamma", "workload.rate=2000", "router=least_requests"],
])
def test_one_replica_fleet_gives_the_single_run_traces(tmp_path, overrides):
    cfg = _cfg(*overrides)
    single = TraceRecorder()
    run_sim(cfg, factory.workload(cfg), single, lambda n: None)
    fleet = run_fleet(cfg, factory.workload(cfg), lambda n: None, cluster_config(cfg))
    assert len(fleet.replica_recorders) == 1
    merged = write_fleet_traces(fleet.replica_recorders, tmp_path)
    for want, got in zip(_frames(single), merged):
        assert (got["replica"] == 0).all()
        pd.testing.assert_frame_equal(got.drop(columns="replica"), want)


def test_fleet_runs_are_byte_identical_and_carry_a_replica_column(tmp_path):
    overrides = ["cluster.replicas=3", "router=prefix_aware", "blocks=prefix", "workload.shared_prefix_len=48"]
    first = run(_cfg(*overrides), tmp_path / "a", "a")
    run(_cfg(*overrides), tmp_path / "b", "b")
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    requests = pd.read_parquet(tmp_path / "a" / "requests.parquet")
    assert requests.columns[0] == "replica" and len(requests) == 40 and requests["request_id"].is_unique
    assert sorted(requests["replica"].unique()) == [0, 1, 2]
    assert first["routing"]["requests_per_replica"] == [int((requests["replica"] == r).sum()) for r in range(3)]
    assert set(first["per_replica"]) == {"0", "1", "2"}
    assert first["run"]["replicas"] == 3 and first["run"]["router"] == "prefix_aware"
    assert sum(first["per_replica"][r]["completed"] for r in "012") == first["completed"] == 40
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["routing"] == first["routing"]


@pytest.mark.parametrize("router, refresh_s", [("least_kv", 0.0), ("least_tokens", 0.0), ("prefix_aware", 0.0),
                                               ("least_kv", 0.013), ("prefix_aware", 0.05)])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fast_forward_leaves_the_fleet_traces_of_stepping_one_by_one(tmp_path, router, refresh_s,
                                                                     async_scheduling):
    """Routers reading KV state see at each arrival (or refresh) what stepping one by one shows."""
    base = ["cluster.replicas=2", f"router={router}", f"scheduler.async_scheduling={async_scheduling}",
            "blocks=prefix", "workload.shared_prefix_len=32", "workload=poisson", "workload.rate=200",
            f"cluster.refresh_s={refresh_s}"]
    ff_cfg, slow_cfg = _cfg(*base), _cfg(*base, "backend.fast_forward=false")
    ff = run_fleet(ff_cfg, factory.workload(ff_cfg), lambda n: None, cluster_config(ff_cfg))
    slow = run_fleet(slow_cfg, factory.workload(slow_cfg), lambda n: None, cluster_config(slow_cfg))
    assert ff.num_steps == slow.num_steps
    for a, b in zip(ff.replica_recorders, slow.replica_recorders):
        for fa, fb in zip(_frames(a), _frames(b)):
            pd.testing.assert_frame_equal(fa, fb)


def _fleet(cfg, router, refresh_s, replicas=2):
    wl = factory.workload(cfg)
    specs = []
    for _ in range(replicas):
        gpu, cpu = factory.kv_block_counts(cfg)
        specs.append(ReplicaSpec(factory.build_scheduler(cfg, gpu, cpu, TraceRecorder(), wl), factory.build_latency(cfg)))
    return FleetSimulator(specs, router, wl.requests, refresh_s, wl.stop_lens)


def test_the_dispatch_hop_delays_each_request_into_its_replica_not_its_arrival():
    cfg = _cfg("cluster.replicas=2")
    hop = 2e-3
    fleets = {}
    for h in (0.0, hop):
        wl = factory.workload(cfg)
        recorders = [TraceRecorder(), TraceRecorder()]
        specs = [ReplicaSpec(factory.build_scheduler(cfg, *factory.kv_block_counts(cfg), rec, wl),
                             factory.build_latency(cfg)) for rec in recorders]
        FleetSimulator(specs, make_router({"name": "round_robin"}), wl.requests, 0.0, wl.stop_lens,
                       dispatch_hop_s=h).run()
        fleets[h] = pd.concat([events_frame(rec) for rec in recorders]).query("event == 'arrived'").set_index("request_id")
        fleets[h]["arrival"] = pd.concat([requests_frame(rec) for rec in recorders]).set_index("request_id")["arrival_time"]
    plain, hopped = fleets[0.0], fleets[hop].loc[fleets[0.0].index]
    assert (hopped["arrival"] == plain["arrival"]).all()
    assert ((plain["time"] - plain["arrival"]).abs() < 1e-12).all()
    assert ((hopped["time"] - hopped["arrival"] - hop).abs() < 1e-9).all()


def test_a_bad_dispatch_hop_is_one_line():
    with pytest.raises(ValueError, match=r"^cluster.dispatch_hop_s=-0.001 is invalid"):
        cluster_config(_cfg("cluster.replicas=2", "cluster.dispatch_hop_s=-0.001"))


def test_stale_snapshots_herd_a_router_blind_to_its_own_routing():
    """A burst between two refreshes: blind least_requests sends all of it to one replica; counting
    its own routing, it alternates."""
    cfg = _cfg("workload=offline", "workload.num_requests=10")
    blind = _fleet(cfg, make_router({"name": "least_requests", "count_routed": False}), refresh_s=1.0).run()
    counting = _fleet(cfg, make_router({"name": "least_requests"}), refresh_s=1.0).run()
    exact = _fleet(cfg, make_router({"name": "least_requests", "count_routed": False}), refresh_s=0.0).run()
    assert blind.num_routed == [10, 0]
    assert counting.num_routed == [5, 5] and exact.num_routed == [5, 5]


def test_mixed_hardware_replicas_each_get_their_own_pool_and_speed(tmp_path):
    summary = run(_cfg("cluster.replicas=2", "cluster.hardware=[h200,a100]", "blocks.kv_cache_gib=null",
                       "workload=offline", "router=round_robin"), tmp_path, "mixed")
    info = summary["run"]["replica_info"]
    assert [r["hardware"] for r in info] == ["h200", "a100"]
    assert info[0]["num_gpu_blocks"] > info[1]["num_gpu_blocks"]  # 141 GB vs 80 GB
    assert [r["num_routed"] for r in info] == [20, 20]
    per = summary["per_replica"]
    assert per["0"]["tpot"]["mean"] < per["1"]["tpot"]["mean"]  # the H200 decodes faster


def test_measured_block_counts_reach_every_replica():
    """experiments.fidelity hands the simulator the engine's KV block counts as blocks.num_gpu_blocks /
    num_cpu_blocks (over a kv_cache_gib that would size the pool otherwise): every replica's pool
    has them, as its steps trace and replica_info show."""
    cfg = _cfg("cluster.replicas=3", "blocks=prefix", "blocks.kv_cache_gib=2", "blocks.num_gpu_blocks=77",
               "blocks.num_cpu_blocks=5", "workload=offline", "scheduler.max_model_len=1232")  # 77 blocks' tokens
    fleet = run_fleet(cfg, factory.workload(cfg), lambda n: None, cluster_config(cfg))
    assert [(r["num_gpu_blocks"], r["num_cpu_blocks"]) for r in fleet.info["replica_info"]] == [(77, 5)] * 3
    for recorder in fleet.replica_recorders:
        steps = steps_frame(recorder)
        assert len(steps) and (steps["gpu_blocks_total"] == 77).all() and (steps["cpu_blocks_total"] == 5).all()


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(router=st.sampled_from(ROUTERS.names()), replicas=st.integers(1, 4),
       refresh_s=st.sampled_from([0.0, 0.005, 0.1]), admission_s=st.sampled_from([0.0, 0.001]),
       arrivals=st.lists(st.tuples(st.sampled_from([0.0, 0.01, 0.013, 0.05]), st.integers(1, 70),
                                   st.integers(1, 30), st.sampled_from([None, "a", "b"])), min_size=1, max_size=25),
       blocks=st.integers(6, 40))
def test_no_request_is_lost_and_each_ends_on_the_replica_it_was_routed_to(router, replicas, refresh_s,
                                                                           admission_s, arrivals, blocks):
    """Small pools (preemption, too-long aborts), arrival ties, stale snapshots, admission cost."""
    specs = []
    for _ in range(replicas):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128),
                          make_policy("fcfs"), make_block_manager("prefix", 4, blocks, 0, 0.0, 128), TraceRecorder())
        latency = Constant(0.004)
        latency.admission_s = admission_s
        specs.append(ReplicaSpec(sched, latency))
    requests = []
    for i, (t, prompt_len, out, session) in enumerate(arrivals):
        r = Request(f"r{i}", [k % 3 for k in range(prompt_len)], SamplingParams(max_tokens=out, ignore_eos=True),
                    arrival_time=t)
        r.session_id = session
        requests.append(r)
    result = FleetSimulator(specs, make_router({"name": router}, 3), requests, refresh_s).run()
    ended = [[row["request_id"] for row in spec.scheduler.recorder.requests] for spec in specs]
    assert sorted(rid for rows in ended for rid in rows) == sorted(r.request_id for r in requests)
    assert [len(rows) for rows in ended] == result.num_routed
    for spec in specs:
        assert not spec.scheduler.has_unfinished()
