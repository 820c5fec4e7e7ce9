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


def requests_at(rate: float, duration_s: float) -> int:
    """The requests a run at `rate` offers for `duration_s` seconds of arrivals (at least
    MIN_REQUESTS): a rate above a deployment's capacity then builds a queue as long as at any other
    rate, where a fixed count would arrive, at a high rate, as one burst a batch absorbs."""
    return max(MIN_REQUESTS, math.ceil(round(rate * duration_s, 9)))


def workload_for(cfg: DictConfig, rate: float, duration_s: float | None) -> Workload:
    """The workload of a run at `rate`: `requests_at` requests with `duration_s`, else the
    configured `workload.num_requests` (a trace: its rows). A trace yields at most its rows."""
    if duration_s is not None:
        cfg = cfg.copy()
        cfg.workload.num_requests = requests_at(rate, duration_s)
    return factory.workload(cfg)  # fresh requests: a run mutates them


def run_at_rate(cfg: DictConfig, rate: float, slo: SearchSlo, duration_s: float | None = None,
                workload: Workload | None = None) -> RateProbe:
    """One run at `rate` (req/s) of `workload` (default `workload_for(cfg, rate, duration_s)`);
    with `duration_s`, a workload of fewer than `requests_at` requests is refused (a shorter run
    would be judged as a longer one)."""
    wl = workload_for(cfg, rate, duration_s) if workload is None else workload
    if duration_s is not None and len(wl) < requests_at(rate, duration_s):
        raise ValueError(f"search.duration_s={duration_s:g} at {rate:.4g} req/s needs {requests_at(rate, duration_s)} "
                         f"requests, but workload={wl.name!r} holds {len(wl)}: a longer trace, or a shorter "
                         "search.duration_s")
    wl = at_rate(wl, rate)
    recorder = TraceRecorder(record_events=False)
    result = run_backend(cfg, wl, recorder)
    recorders = result.replica_recorders or [recorder]
    requests = pd.concat([requests_frame(r) for r in recorders], ignore_index=True)
    met, metrics, missed = slo.check(requests)
    metrics["num_requests"] = len(wl)
    return RateProbe(rate, met, metrics, missed, slo.explain(requests, metrics, missed))


def deployment_capacity(run_cfg: dict[str, Any], slo: dict[str, Any], start: float, max_iterations: int,
                        rtol: float, growth: float, duration_s: float | None = None) -> dict[str, Any]:
    """The capacity of one deployment (`run_cfg`: its resolved `experiments.run` config) as a row:
    the rate, the metrics measured at it, the lowest failing rate's reason and request count, the
    probes run. With `duration_s`, a rate whose run would need more requests than the workload
    holds (a trace's rows) is run at the most they cover instead (`rate_limit_rps` where reached)."""
    cfg = OmegaConf.create(run_cfg)
    search_slo = SearchSlo.from_dict(slo)

    def probe(rate: float) -> RateProbe:
        wl = workload_for(cfg, rate, duration_s)
        if duration_s is not None and len(wl) < requests_at(rate, duration_s):
            rate = len(wl) / duration_s
        return run_at_rate(cfg, rate, search_slo, duration_s, wl)

    cap = max_sustained_rate(probe, start, max_iterations, rtol, growth)
    best = max((p for p in cap.probes if p.met), key=lambda p: p.rate, default=None)
    lowest = min(cap.probes, key=lambda p: p.rate)
    failed = min((p for p in cap.probes if not p.met), key=lambda p: p.rate, default=None)
    row: dict[str, Any] = {"capacity_rps": cap.rate, "failed_rps": cap.upper, "simulations": len(cap.probes),
                           "simulated_requests": sum(p.metrics["num_requests"] for p in cap.probes),
                           "missed_at_lowest": ",".join(lowest.missed),
                           "failed_because": "" if failed is None else failed.reason,
                           "failed_num_requests": None if failed is None else failed.metrics["num_requests"],
                           "rate_limit_rps": cap.limit}
    for key, value in (best.metrics if best is not None else lowest.metrics).items():
        row[key] = value
    return row
