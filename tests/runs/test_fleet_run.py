"""`python -m experiments.run cluster.replicas=N router=...` end to end: files with a replica
column, per-replica metrics and plots, sweeps, one-line config errors; and the qualitative claim of
cache-aware routing on a shared-prefix workload."""
import json

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from test_experiments_run import cli, expect_one_line_error

from experiments import run as run_module

SMALL = ["progress=false", "seed=2"]


def test_a_two_replica_run_writes_fleet_traces_metrics_and_plots(tmp_path):
    res = cli("cluster.replicas=2", "router=session", "workload=sessions", "workload.num_sessions=8",
              "blocks=prefix", *SMALL, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "run"
    requests = pd.read_parquet(out / "requests.parquet")
    steps = pd.read_parquet(out / "steps.parquet")
    assert set(requests["replica"]) == {0, 1} and set(steps["replica"]) == {0, 1}
    sessions = requests.assign(session=requests["request_id"].str.split("-").str[0])
    assert (sessions.groupby("session")["replica"].nunique() == 1).all()  # session affinity
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["replicas"] == 2 and summary["run"]["router"] == "session"
    assert summary["completed"] == len(requests) and set(summary["per_replica"]) == {"0", "1"}
    assert summary["config"]["cluster"]["replicas"] == 2
    for name in ("kv_blocks_replica0.png", "kv_blocks_replica1.png", "queues_replica1.png", "latency_cdf.png"):
        assert (out / name).stat().st_size > 0, name


def test_routers_sweep_with_multirun(tmp_path):
    res = cli("-m", "router=round_robin,least_requests", "cluster.replicas=2,3", "workload.num_requests=12",
              "plots=false", *SMALL, f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    seen = set()
    for path in sorted((tmp_path / "sweep").glob("*/summary.json")):
        s = json.loads(path.read_text())
        seen.add((s["run"]["router"], s["run"]["replicas"]))
        assert s["completed"] == 12 and len(s["routing"]["requests_per_replica"]) == s["run"]["replicas"]
    assert seen == {(r, n) for r in ("round_robin", "least_requests") for n in (2, 3)}


@pytest.mark.parametrize("override, key", [
    ("cluster.replicas=0", "cluster.replicas=0 is invalid"),
    ("cluster.replicas=two", "cluster.replicas"),
    ("cluster.refresh_s=-1 cluster.replicas=2", "cluster.refresh_s=-1"),
    ("+cluster.racks=2", "key cluster.racks is unknown"),
    ("cluster.replicas=2 cluster.hardware=[h200]", "cluster.hardware=['h200'] is invalid"),
    ("cluster.replicas=2 cluster.hardware=[h200,tpu]", "cluster.hardware[1]='tpu' is unknown"),
    ("cluster.replicas=2 cluster.hardware=[h200,a100] latency=profiled",
     "cluster.hardware[1]='a100' has no latency profile: latency=profiled reads each replica's profile"),
    ("cluster.hardware=[a100] latency=profiled", "cluster.hardware[0]='a100' has no latency profile"),
    ("cluster.replicas=2 cluster.hardware=[h200,a100] latency=operators",
     "cluster.hardware[1]='a100' (replica 1's GPU): latency.gpu='a100' is invalid"),
    ("router=lottery", "router/lottery"),
    ("router=prefix_aware router.cache_threshold=2 cluster.replicas=2", "router.cache_threshold=2 is invalid"),
    ("+router.cache_threshold=0.3", "key router.cache_threshold is unknown"),  # not a round_robin knob
    ("router=session router.key=user cluster.replicas=2", "router.key='user' is invalid"),
    ("backend=server cluster.replicas=2", "cluster.replicas=2 is invalid with backend=server"),
    ("backend=engine cluster.replicas=2 cluster.hardware=[h200,h200]", "cluster.hardware=['h200', 'h200'] is invalid with backend=engine"),
    ("workload=azure +workload.block_tokens=4", "key workload.block_tokens is unknown"),
])
def test_bad_fleet_config_is_one_line_naming_the_key(override, key, monkeypatch, capsys, tmp_path):
    expect_one_line_error([*override.split(), "workload.num_requests=5", *SMALL, f"hydra.run.dir={tmp_path}"],
                          key, monkeypatch, capsys)


def test_one_profile_for_mixed_gpus_is_refused_naming_the_replica(tmp_path):
    """latency.path names one file for every replica: a replica whose GPU is not the one the
    profile was measured on is refused, naming it, rather than priced as another GPU."""
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "cluster.replicas=2", "cluster.hardware=[h200,a100]", "latency=profiled",
            "latency.path=experiments/profiles/h200-qwen3-0.6b-async.csv", "workload.num_requests=6",
            "plots=false", *SMALL])
    with pytest.raises(ValueError, match=r"cluster.hardware\[1\]='a100'.*measured on device='NVIDIA H200'"):
        run_module.run(cfg, tmp_path / "run")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        same = compose(config_name="config", overrides=[
            "cluster.replicas=2", "cluster.hardware=[h200,h200]", "latency=profiled",
            "latency.path=experiments/profiles/h200-qwen3-0.6b-async.csv", "workload.num_requests=6",
            "plots=false", *SMALL])
    summary = run_module.run(same, tmp_path / "same")
    assert summary["completed"] == 6
    assert [r["hardware"] for r in summary["run"]["replica_info"]] == ["h200", "h200"]


def test_prefix_aware_beats_round_robin_on_shared_system_prompts(tmp_path):
    """Preble's and SGLang's claim, in the simulator: on a workload whose prompts share a few
    system prompts, routing by cached prefix raises the prefix hit rate and lowers TTFT."""
    summaries = {}
    for router in ("round_robin", "prefix_aware"):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                f"router={router}", "cluster.replicas=4", "workload=system_prompts", "workload.num_requests=160",
                "workload.rate=150", "blocks=prefix", "blocks.kv_cache_gib=0.5", "plots=false", *SMALL])
        summaries[router] = run_module.run(cfg, tmp_path / router)
    rr, pa = summaries["round_robin"], summaries["prefix_aware"]
    assert rr["completed"] == pa["completed"] == 160
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1
    assert pa["ttft"]["mean"] < 0.7 * rr["ttft"]["mean"]
