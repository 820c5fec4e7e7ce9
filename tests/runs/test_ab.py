"""A/B comparison: override parsing, paired bootstrap, and a fcfs-vs-priority run on one stream."""
import numpy as np
import pandas as pd
import pytest

from experiments.ab import _main, split_overrides
from experiments.lib.ab_compare import _warmups, combine_tables, compose_pair, markdown
from experiments.lib.bootstrap import paired_bootstrap


def test_split_overrides():
    assert split_overrides("[policy=fcfs]", "a") == ["policy=fcfs"]
    assert split_overrides("[policy=priority,workload.priority.values=[0,1],x='a,b']", "a") == \
        ["policy=priority", "workload.priority.values=[0,1]", "x='a,b'"]
    assert split_overrides("policy=fcfs", "a") == ["policy=fcfs"]
    assert split_overrides("[]", "a") == []
    with pytest.raises(ValueError, match="a=.*unbalanced"):
        split_overrides("[x=[1,2]", "a")


def test_paired_bootstrap():
    a = np.arange(100.0)
    assert paired_bootstrap(a, a + 1) == (1.0, 1.0, 1.0)  # a constant shift has no spread
    rng = np.random.default_rng(1)
    x = rng.exponential(1.0, 2000)
    y = x + 0.5 + rng.normal(0, 0.2, 2000)
    diff, low, high = paired_bootstrap(x, y, "mean", resamples=500)
    assert low < 0.5 < high and high - low < 0.05
    assert paired_bootstrap(x, y, "mean", resamples=500) == (diff, low, high)  # seeded
    d90, l90, h90 = paired_bootstrap(x, y, "p90", resamples=300)
    assert l90 <= d90 <= h90
    with pytest.raises(ValueError, match="stat='p42' is unknown"):
        paired_bootstrap(x, y, "p42")


def test_priority_beats_fcfs_for_the_urgent_class(tmp_path):
    # 300 requests in ~0.3 s into 1500 KV blocks: requests queue, so the policy's order decides
    common = ["workload=priority", "workload.num_requests=300", "workload.rate=1000", "blocks.num_gpu_blocks=1500",
              "progress=false", "plots=false"]
    result = _main(["a=[policy=fcfs]", "b=[policy=priority]", *common, "--out", str(tmp_path), "--resamples", "200"])
    t = result.table
    for name in ("a/requests.parquet", "b/requests.parquet", "ab.csv", "ab.md", "ab.png", "ab_cdf.png"):
        assert (tmp_path / name).is_file(), name
    assert result.summary_a["run"]["policy"] == "fcfs" and result.summary_b["run"]["policy"] == "priority"
    ttft = t[(t.metric == "ttft") & (t.stat == "mean")].set_index("scope")
    assert {"all", "priority=0", "priority=1"} <= set(ttft.index)
    assert ttft.loc["all", "n"] == 300
    urgent = ttft.loc["priority=0"]
    assert urgent["diff"] < 0 and urgent["ci_high"] < 0 and urgent["significant"]  # class 0 is served first
    row = t[(t.metric == "request_throughput")].iloc[0]
    assert row.a == pytest.approx(result.summary_a["request_throughput"])
    assert pd.read_csv(tmp_path / "ab.csv").shape[0] == len(t)


def test_a_and_b_must_share_the_workload():
    with pytest.raises(ValueError, match="a and b differ in workload"):
        compose_pair([], ["workload.rate=1"], ["workload.rate=2"])
    with pytest.raises(ValueError, match="a and b are required"):
        _main(["a=[policy=fcfs]"])


def _row(metric, a, b, lo, hi, stat="mean"):
    return {"metric": metric, "stat": stat, "scope": "all", "n": 10, "a": a, "b": b, "diff": b - a,
            "ci_low": lo, "ci_high": hi, "rel_diff": (b - a) / a, "significant": bool(lo > 0 or hi < 0)}


def test_rounds_keep_only_the_changes_that_reproduce():
    """Two rounds of an A/B on a wall-clock backend: TTFT -20% in both (significant), e2e +2% then -2%
    with each round's interval excluding 0 (not significant: host drift), throughput per run."""
    r1 = pd.DataFrame([_row("ttft", 1.0, 0.8, -0.25, -0.15), _row("e2e", 2.0, 2.04, 0.01, 0.07),
                       _row("request_throughput", 10.0, 11.0, np.nan, np.nan, "run")])
    r2 = pd.DataFrame([_row("ttft", 1.1, 0.88, -0.27, -0.17), _row("e2e", 2.1, 2.058, -0.07, -0.01),
                       _row("request_throughput", 10.2, 11.1, np.nan, np.nan, "run")])
    t = combine_tables([r1, r2]).set_index("metric")
    assert t.loc["ttft", "significant"] and t.loc["ttft", "a"] == pytest.approx(1.05)
    assert t.loc["ttft", "round_changes"] == "-20.0% -20.0%"
    assert not t.loc["e2e", "significant"] and t.loc["e2e", "rounds"] == 2
    assert t.loc["request_throughput", "significant"]  # +1.0 and +0.9 against a spread of 0.1
    md = markdown(t.reset_index(), "fcfs", "priority", 0.95)
    assert "in each of 2 rounds" in md and md.count(" *") == 2


def test_ab_rounds_on_the_simulator(tmp_path):
    """`--rounds 2` on the (deterministic) simulator: both rounds' run dirs, identical rounds, and the
    urgent class's TTFT cut stays significant."""
    common = ["workload=priority", "workload.num_requests=300", "workload.rate=1000", "blocks.num_gpu_blocks=1500",
              "progress=false", "plots=false"]
    result = _main(["a=[policy=fcfs]", "b=[policy=priority]", *common, "--out", str(tmp_path), "--resamples", "100",
                    "--rounds", "2"])
    for name in ("a", "b", "a_r2", "b_r2"):
        assert (tmp_path / name / "requests.parquet").is_file(), name
    assert not (tmp_path / "_warmup").exists()  # the simulator needs no warm-up
    t = result.table
    urgent = t[(t.metric == "ttft") & (t.stat == "mean") & (t.scope == "priority=0")].iloc[0]
    assert urgent["significant"] and urgent["rounds"] == 2
    first, second = urgent["round_changes"].split()
    assert first == second  # the simulator repeats itself exactly
    with pytest.raises(ValueError, match="rounds=0 is invalid"):
        _main(["a=[policy=fcfs]", "b=[policy=priority]", *common, "--out", str(tmp_path / "x"), "--rounds", "0"])


def test_warmups_cover_each_engine_config():
    """A warms up on the engine; B too only when it runs another engine; the simulator never."""
    engine = ["backend=engine", "backend.device=cpu", "blocks.num_gpu_blocks=64", "scheduler.max_model_len=1024"]
    names = lambda a, b, flag=None: [w[0] for w in _warmups(a, b, flag, "a", "b")]
    assert names(*compose_pair(engine, ["policy=fcfs"], ["policy=priority"])) == ["_warmup"]
    assert names(*compose_pair(engine, ["backend.decode_kernel=packed"], ["backend.decode_kernel=per-head"])) == \
        ["_warmup", "_warmup_b"]
    assert names(*compose_pair([], ["backend=sim"], engine)) == ["_warmup_b"]
    assert names(*compose_pair([], ["policy=fcfs"], ["policy=priority"])) == []
    assert names(*compose_pair(engine, ["policy=fcfs"], ["policy=priority"]), False) == []


def test_vtc_serves_the_light_tenant_before_the_heavy_ones_backlog(tmp_path):
    """A heavy tenant floods the queue: under fcfs the light tenant waits behind it, under vtc it is
    served first (the A/B reports per tenant)."""
    common = ["workload=tenants", "workload.tenants.rates=[1000,100]", "workload.tenants.num_requests=[300,30]",
              "blocks.num_gpu_blocks=1500", "progress=false", "plots=false"]
    result = _main(["a=[policy=fcfs]", "b=[policy=vtc]", *common, "--out", str(tmp_path), "--resamples", "200"])
    ttft = result.table[(result.table.metric == "ttft") & (result.table.stat == "mean")].set_index("scope")
    assert {"tenant=heavy", "tenant=light"} <= set(ttft.index)
    light = ttft.loc["tenant=light"]
    assert light["ci_high"] < 0 and light["b"] < 0.5 * light["a"]
    assert result.summary_b["per_tenant"]["service_gap_max"] < result.summary_a["per_tenant"]["service_gap_max"]
