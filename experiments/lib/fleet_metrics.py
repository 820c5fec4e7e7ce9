"""Metrics of a fleet run (docs/metrics.md): the single-run summary over all replicas' traces, with
the prefix hit rate summed over replicas, plus `routing` (requests per replica, imbalance) and
`per_replica` (each replica's role and headline metrics); a disaggregated run adds `disaggregation`
(the TTFT split and the transfers, over the finished requests that were handed off).

With prefill and decode replicas a request's row is written where it ends (the decode replica for a
handed-off one), so rows alone would count a prefill replica's work as nothing: each replica's
count is what its router gave it (a prefill or mixed replica: the arrivals the first router sent
it; a decode replica: the hand-offs it received), imbalance is taken within each role (the two
routers balance different replicas), and a prefill replica's row says how many prompts it
prefilled and handed off. A prefill replica's blocks hold prompts waiting for or in transfer, not
running sequences (`kv_tokens`), so its KV utilisation is null and the fleet's is over the
replicas that decode."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from experiments.lib.metrics import kv_metrics, stats, summarize
from policies.disagg import ReplicaRole

PER_REPLICA_KEYS = ("num_requests", "completed", "aborted", "request_throughput", "output_throughput",
                    "ttft", "tpot", "e2e", "queueing_time", "num_steps", "mean_batch_size",
                    "num_preemptions", "prefix_hit_rate", "kv_utilization", "gpu_block_usage_mean")
PREFILL, DECODE, MIXED = ReplicaRole.PREFILL, ReplicaRole.DECODE, ReplicaRole.MIXED


def prefix_hit_rate(steps: pd.DataFrame) -> float | None:
    """Prefix-cache hits / queries over all replicas (each replica's step rows carry cumulative counts)."""
    if steps.empty:
        return None
    last = steps.groupby("replica", sort=True)[["prefix_hits", "prefix_queries"]].last()
    queries = int(last["prefix_queries"].sum())
    return float(last["prefix_hits"].sum() / queries) if queries else None


def _named(requests: pd.DataFrame, column: str, replica: int) -> pd.Series:
    """Rows whose hand-off column `column` names `replica` (all False without the column)."""
    if column not in requests:
        return pd.Series(False, index=requests.index)
    return requests[column] == replica


def requests_taken(requests: pd.DataFrame, replica: int, role: str) -> int:
    """The requests `replica`'s router gave it: a mixed replica's rows; a prefill replica's rows and
    the handed-off rows naming it `prefill_replica`; a decode replica's received hand-offs (rows
    naming it `decode_replica`)."""
    if role == DECODE:
        return int(_named(requests, "decode_replica", replica).sum())
    return int(((requests["replica"] == replica) | _named(requests, "prefill_replica", replica)).sum())


def prefill_work(requests: pd.DataFrame, replica: int) -> dict[str, int]:
    """A prefill replica's prompts: `prefills` (first tokens computed there) and `handed_off` (those
    passed to a decode replica: received there, or dropped on the way, which end aborted there)."""
    moved = int(_named(requests, "prefill_replica", replica).sum())
    here = requests[(requests["replica"] == replica) & requests["first_token_time"].notna()]
    return {"prefills": moved + len(here), "handed_off": moved + int((here["status"] == "aborted").sum())}


def imbalance(counts: Sequence[int]) -> float | None:
    """The largest count over their mean (1: even); None without any."""
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean else None


def routing(counts: list[int], roles: Sequence[str]) -> dict[str, Any]:
    """`requests_per_replica` and `imbalance`, the largest within a role; with several roles also
    `imbalance_per_role`."""
    per_role = {role: imbalance([c for c, r in zip(counts, roles) if r == role]) for role in dict.fromkeys(roles)}
    values = [v for v in per_role.values() if v is not None]
    out: dict[str, Any] = {"requests_per_replica": counts, "imbalance": max(values) if values else None}
    if len(per_role) > 1:
        out["imbalance_per_role"] = per_role
    return out


def fleet_summary(requests: pd.DataFrame, steps: pd.DataFrame, block_size: int, num_replicas: int,
                  slo: Mapping[str, Any] | None = None, roles: Sequence[str] | None = None) -> dict[str, Any]:
    """`roles`: each replica's (prefill, decode, mixed); None: all mixed."""
    roles = list(roles) if roles is not None else [MIXED] * num_replicas
    if len(roles) != num_replicas:
        raise ValueError(f"roles={roles!r} has {len(roles)} roles for {num_replicas} replicas")
    summary = summarize(requests, steps, block_size, slo)
    summary["prefix_hit_rate"] = prefix_hit_rate(steps)
    prefill = [r for r, role in enumerate(roles) if role == PREFILL]
    if prefill:  # the fleet's KV use: the replicas whose running sequences hold it
        kv = kv_metrics(steps[~steps["replica"].isin(prefill)], block_size)
        summary.update(kv_utilization=kv["kv_utilization"], kv_waste=kv["kv_waste"])
    counts = [requests_taken(requests, r, role) for r, role in enumerate(roles)]
    summary["routing"] = routing(counts, roles)
    per_replica = {}
    for r, role in enumerate(roles):
        s = summarize(requests[requests["replica"] == r], steps[steps["replica"] == r], block_size, slo)
        row: dict[str, Any] = {"role": role, **{k: s[k] for k in PER_REPLICA_KEYS}}
        if role == PREFILL:
            row.update(prefill_work(requests, r), kv_utilization=None)
        elif role == DECODE:
            row["received"] = counts[r]
        per_replica[str(r)] = row
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
