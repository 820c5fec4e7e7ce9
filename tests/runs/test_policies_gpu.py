"""On the GPU engine, the literature's policies change what the simulator says they change, in sign:
sjf/srpt (oracle lengths) and mlfq cut the mean e2e latency of a heavy-tailed overload against fcfs,
vtc cuts the light tenant's TTFT under a heavy tenant's flood. Small, overloaded streams (a few
seconds each) of Qwen3-0.6B with dummy weights; the runs of record are the A/B commands in
docs/results.md."""
from __future__ import annotations

import pytest

from experiments.ab import _main

HEAVY_TAIL = ["workload=sharegpt", "workload.num_requests=300", "workload.rate=150", "workload.max_tokens=4096",
              "workload.output_len={dist: lognormal, mean: 338, sigma: 1.5, min: 4, max: 4096}",
              "+workload.length_correlation=0.6", "blocks.kv_cache_gib=2"]
TENANTS = ["workload=tenants", "workload.tenants.rates=[200,10]", "workload.tenants.num_requests=[400,20]",
           "blocks.kv_cache_gib=2"]


@pytest.mark.gpu
@pytest.mark.parametrize(("policy", "workload", "metric", "scope"), [
    ("[policy=sjf,policy.predictor=oracle]", HEAVY_TAIL, "e2e", "all"),
    ("[policy=srpt,policy.predictor=oracle]", HEAVY_TAIL, "e2e", "all"),
    ("[policy=mlfq]", HEAVY_TAIL, "e2e", "all"),
    ("[policy=vtc]", TENANTS, "ttft", "tenant=light"),
])
def test_policy_beats_fcfs_on_the_engine(tmp_path, policy, workload, metric, scope):
    result = _main(["a=[policy=fcfs]", f"b={policy}", *workload, "backend=engine", "model=qwen3-0.6b",
                    "progress=false", "plots=false", "--out", str(tmp_path), "--resamples", "200"])
    t = result.table
    row = t[(t.metric == metric) & (t.stat == "mean") & (t.scope == scope)].iloc[0]
    assert row["ci_high"] < 0, f"{policy}: {metric} mean of {scope} {row['a']:.3f} -> {row['b']:.3f} s"
