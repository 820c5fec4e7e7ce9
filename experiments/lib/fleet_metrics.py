"""Metrics of a fleet run (docs/metrics.md): the single-run summary over all replicas' traces, with
the prefix hit rate summed over replicas, plus `routing` (requests per replica, imbalance) and
`per_replica` (each replica's headline metrics); a disaggregated run adds `disaggregation` (the
TTFT split and the transfers, over the finished requests that were handed off)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from experiments.lib.metrics import stats, summarize

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
    if "transfer_time" in requests:
        summary["disaggregation"] = handoff_metrics(requests)
    return summary


SPLIT_COLUMNS = ("queueing_time", "prefill_time", "transfer_time", "decode_wait", "link_wait", "link_time")


def handoff_metrics(requests: pd.DataFrame) -> dict[str, Any]:
    """TTFT = queueing_time + prefill_time + transfer_time of each handed-off request, each part's
    stats; the transfer's parts (decode_wait: blocks on the decode side, link_wait: the link's queue,
    link_time: on the wire) and bytes per tensor-parallel rank."""
    done = requests[(requests["status"] == "finished") & requests["transfer_time"].notna()]
    out: dict[str, Any] = {"handed_off": int(requests["transfer_time"].notna().sum())}
    for name in SPLIT_COLUMNS:
        out[name] = stats(done[name].to_numpy())
    out["transfer_bytes_mean"] = float(done["transfer_bytes"].mean()) if len(done) else None
    return out
