"""One deployment in the simulator: its run at a given request rate, judged against the SLOs, and
its capacity (the bisection of capacity.py over such runs). Runs in a joblib worker: its input is a
plain resolved config dict, its output a plain dict."""
from __future__ import annotations

import math
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.lib import factory
from experiments.lib.backends import run_backend
from experiments.lib.search.capacity import RateProbe, max_sustained_rate
from experiments.lib.search.slo import SearchSlo
from experiments.lib.traces import requests_frame
from experiments.lib.workloads import Workload
from policies.trace import TraceRecorder


def arrival_rate(workload: Workload) -> float:
    """A workload's mean arrival rate (requests per second of its arrival span); 0 when every
    request arrives at once."""
    times = [r.arrival_time for r in workload.requests]
    span = max(times) - min(times) if times else 0.0
    return (len(times) - 1) / span if span > 0 else 0.0


def at_rate(workload: Workload, rate: float) -> Workload:
    """The workload with its arrival times scaled to mean `rate` (the arrival pattern kept)."""
    scale = arrival_rate(workload) / rate
    for r in workload.requests:
        r.arrival_time *= scale
    return workload


MIN_REQUESTS = 20


def run_at_rate(cfg: DictConfig, rate: float, slo: SearchSlo, duration_s: float | None = None) -> RateProbe:
    """One run at `rate` (req/s); with `duration_s`, of rate x duration_s requests (at least
    MIN_REQUESTS), so that a rate above the deployment's capacity builds a queue as long as at any
    other rate: a fixed count of requests arrives, at a high rate, as one burst a batch absorbs."""
    if duration_s is not None:
        cfg = cfg.copy()
        cfg.workload.num_requests = max(MIN_REQUESTS, math.ceil(rate * duration_s))
    wl = at_rate(factory.workload(cfg), rate)  # fresh requests: a run mutates them
    recorder = TraceRecorder(record_events=False)
    result = run_backend(cfg, wl, recorder)
    recorders = result.replica_recorders or [recorder]
    requests = pd.concat([requests_frame(r) for r in recorders], ignore_index=True)
    met, metrics, missed = slo.check(requests)
    metrics["num_requests"] = len(wl)
    return RateProbe(rate, met, metrics, missed)


def deployment_capacity(run_cfg: dict[str, Any], slo: dict[str, Any], start: float, max_iterations: int,
                        rtol: float, growth: float, duration_s: float | None = None) -> dict[str, Any]:
    """The capacity of one deployment (`run_cfg`: its resolved `experiments.run` config) as a row:
    the rate, the metrics measured at it, the probes run."""
    cfg = OmegaConf.create(run_cfg)
    search_slo = SearchSlo.from_dict(slo)
    cap = max_sustained_rate(lambda r: run_at_rate(cfg, r, search_slo, duration_s), start, max_iterations, rtol, growth)
    best = max((p for p in cap.probes if p.met), key=lambda p: p.rate, default=None)
    lowest = min(cap.probes, key=lambda p: p.rate)
    row: dict[str, Any] = {"capacity_rps": cap.rate, "failed_rps": cap.upper, "simulations": len(cap.probes),
                           "simulated_requests": sum(p.metrics["num_requests"] for p in cap.probes),
                           "missed_at_lowest": ",".join(lowest.missed)}
    for key, value in (best.metrics if best is not None else lowest.metrics).items():
        row[key] = value
    return row
