"""Per-tenant metrics (docs/metrics.md#per-tenant-metrics): what each client got, and how fairly.

Service is counted in weighted tokens, as the Virtual Token Counter counts it (Sheng et al., OSDI
2024): `input_weight` per prompt token, `output_weight` per output token (defaults 1 and 2, the
paper's; an output token costs more GPU time than a prompt token). A request's prompt is served at
its first token (the prefill ends there), each output token at its time (`token_times`, sample 0;
with n > 1 samples each time counts `output_len / len(token_times)` tokens).

A tenant is backlogged while it has a request that arrived and waits to be admitted (VTC's
definition: it has requests in the waiting queue), i.e. in [arrival, first_scheduled_time) of one of
its requests (the first token's time where a trace has no admission time, as the serving client's;
a request never admitted waits until it ends). The fairness measure
`service_gap_max` is the largest difference in service received by two tenants over any interval
in which both were backlogged the whole time: max over pairs and over such intervals [t1, t2] of
|(S_a(t2) - S_a(t1)) - (S_b(t2) - S_b(t1))|, with S the cumulative service. A fair scheduler keeps it
bounded as the run grows (VTC's guarantee); FCFS lets it grow with the heavy tenant's backlog.
"""
from __future__ import annotations

from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd

INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0


def service_events(requests: pd.DataFrame, input_weight: float = INPUT_WEIGHT,
                   output_weight: float = OUTPUT_WEIGHT) -> tuple[np.ndarray, np.ndarray]:
    """(times, weighted tokens) of the service `requests` received, sorted by time."""
    times: list[float] = []
    amounts: list[float] = []
    for first, prompt_len, output_len, token_times in zip(
            requests["first_token_time"], requests["prompt_len"], requests["output_len"], requests["token_times"]):
        if first is None or not np.isfinite(first):
            continue
        times.append(float(first))
        amounts.append(input_weight * float(prompt_len))
        if token_times is not None and len(token_times):
            per = output_weight * float(output_len) / len(token_times)
            times.extend(float(t) for t in token_times)
            amounts.extend([per] * len(token_times))
    order = np.argsort(np.asarray(times, dtype=float), kind="stable")
    return np.asarray(times, dtype=float)[order], np.asarray(amounts, dtype=float)[order]


def backlog_intervals(requests: pd.DataFrame) -> list[tuple[float, float]]:
    """The union of [arrival, admission] over `requests`: when the tenant was backlogged."""
    admitted = requests["first_scheduled_time"].astype(float)
    admitted = admitted.fillna(requests["first_token_time"].astype(float)).fillna(requests["finish_time"].astype(float))
    spans = sorted(zip(requests["arrival_time"].astype(float), admitted))
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def service_gap(a: pd.DataFrame, b: pd.DataFrame, input_weight: float = INPUT_WEIGHT,
                output_weight: float = OUTPUT_WEIGHT) -> float:
    """The largest |service of a - service of b| over an interval in which both were backlogged."""
    ta, wa = service_events(a, input_weight, output_weight)
    tb, wb = service_events(b, input_weight, output_weight)
    times = np.concatenate([ta, tb])
    order = np.argsort(times, kind="stable")
    times, diff = times[order], np.cumsum(np.concatenate([wa, -wb])[order])
    gap = 0.0
    for start, end in _intersect(backlog_intervals(a), backlog_intervals(b)):
        lo, hi = np.searchsorted(times, start, "right"), np.searchsorted(times, end, "right")
        if hi > lo:
            d = diff[lo:hi] - (diff[lo - 1] if lo else 0.0)
            gap = max(gap, float(max(d.max(), 0.0) - min(d.min(), 0.0)))
    return gap


def per_tenant(requests: pd.DataFrame, duration: float, stats, input_weight: float = INPUT_WEIGHT,
               output_weight: float = OUTPUT_WEIGHT) -> dict[str, Any]:
    """`{"tenants": {name: metrics}, "service_gap_max": ..., "service_weights": ...}`, or {} when
    the requests carry no tenant. `stats` is metrics.stats (mean / median / std / p90 / p99)."""
    if "tenant" not in requests or requests["tenant"].isna().all():
        return {}
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: float("nan"))
    tenants: dict[str, Any] = {}
    groups = {str(name): group for name, group in requests.groupby("tenant", sort=True)}
    for name, group in groups.items():
        done = group[group["status"] == "finished"]
        _, amounts = service_events(group, input_weight, output_weight)
        tenants[name] = {
            "num_requests": len(group), "completed": len(done),
            "request_throughput": rate(len(done)), "output_throughput": rate(int(done["output_len"].sum())),
            "service": float(amounts.sum()), "service_rate": rate(float(amounts.sum())),
            "ttft": stats(done["ttft"].to_numpy()), "e2e": stats(done["e2e"].to_numpy()),
        }
    gap = max((service_gap(groups[x], groups[y], input_weight, output_weight)
               for x, y in combinations(groups, 2)), default=0.0)
    return {"tenants": tenants, "service_gap_max": gap,
            "service_weights": {"input": input_weight, "output": output_weight}}
