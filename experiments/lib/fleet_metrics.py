"""Metrics of a fleet run (docs/metrics.md): the single-run summary over all replicas' traces, with
the prefix hit rate summed over replicas, plus `routing` (requests per replica, imbalance) and
`per_replica` (each replica's headline metrics)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from experiments.lib.metrics import summarize

PER_REPLICA_KEYS = ("num_requests", "completed", "aborted", "request_throughput", "output_throughput",
                    "ttft", "tpot", "e2e", "queueing_time", "num_steps", "mean_batch_size",
                    "num_preemptions", "prefix_hit_rate", "kv_utilization", "gpu_block_usage_mean")


def prefix_hit_rate(steps: pd.DataFrame) -> float | None:
    """Prefix-cache hits / queries over all replicas (each replica's step rows carry cumulative counts)."""
    if steps.empty:
        return None
    last = steps.groupby("replica", sort=True)[["prefix_hits", "prefix_queries"]].last()
    queries = int(last["prefix_queries"].sum())
    return float(last["prefix_hits"].sum() / queries) if queries else None


def fleet_summary(requests: pd.DataFrame, steps: pd.DataFrame, block_size: int, num_replicas: int,
                  slo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    summary = summarize(requests, steps, block_size, slo)
    summary["prefix_hit_rate"] = prefix_hit_rate(steps)
    counts = [int((requests["replica"] == r).sum()) for r in range(num_replicas)]
    mean = sum(counts) / num_replicas
    summary["routing"] = {"requests_per_replica": counts,
                          "imbalance": max(counts) / mean if mean else None}  # max / mean
    per_replica = {}
    for r in range(num_replicas):
        s = summarize(requests[requests["replica"] == r], steps[steps["replica"] == r], block_size, slo)
        per_replica[str(r)] = {k: s[k] for k in PER_REPLICA_KEYS}
    summary["per_replica"] = per_replica
    return summary
