"""`GET /metrics`: Prometheus text with vLLM's metric names, so existing scrapers and Grafana boards work.

Scheduler state and token totals are read from `AsyncLLMEngine.stats()` at scrape time (gauges
`vllm:num_requests_running|waiting|swapped`, `vllm:kv_cache_usage_perc` and v0's
`vllm:gpu_cache_usage_perc`; counters `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`). The latency histograms (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`) and the
`vllm:request_success_total` counter take one `RequestStats` per ended request from the engine
(`AsyncLLMEngine.add_finished_observer`). Every metric carries the `model_name` label, as vLLM's do. Each app has its
own registry (several servers in one process do not share metrics).

With data-parallel replicas (`replica_status`, engine/online/replica_set.py) every metric has one
series per replica, labelled `replica="<id>"`, beside the fleet's series under the same name and
labels as with one engine (no `replica` label): sums over the replicas (KV usage: over their pools
together; the gauges: over the live ones). `servelab:replica_up{replica}` is 1 while a replica
serves and 0 once it has stopped. PromQL: `{replica=""}` selects the fleet, `{replica!=""}` the
replicas.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from math import inf
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's bucket edges (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# (metric, help, EngineStats attribute, kind); kind "gauge" or "counter".
ENGINE_METRICS = (
    ("vllm:num_requests_running", "Requests in the running batch.", "num_running", "gauge"),
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting", "gauge"),
    ("vllm:num_requests_swapped", "Requests swapped out to CPU memory.", "num_swapped", "gauge"),
    ("vllm:kv_cache_usage_perc", "Fraction of GPU KV blocks in use (1 = full).", "kv_cache_usage", "gauge"),
    ("vllm:gpu_cache_usage_perc", "Fraction of GPU KV blocks in use (vLLM v0's name).", "kv_cache_usage",
     "gauge"),
    ("vllm:num_preemptions", "Preemptions since start.", "num_preemptions_total", "counter"),
    ("vllm:prompt_tokens", "Prefill tokens processed since start.", "prompt_tokens_total", "counter"),
    ("vllm:generation_tokens", "Tokens generated since start.", "generation_tokens_total", "counter"),
)


class EngineCollector(Collector):
    """Reads the engine's stats when Prometheus scrapes (and each replica's, with `replicas`)."""

    def __init__(self, stats: Callable[[], Any], model_name: str,
                 replicas: Callable[[], list | None] | None = None) -> None:
        self.stats, self.model_name, self.replicas = stats, model_name, replicas

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        replicas = self.replicas() if self.replicas is not None else None
        for name, help_text, attr, kind in ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, attr)))
            fleet = family.samples[-1]
            for r in replicas or ():
                value = float(getattr(r.stats, attr)) if r.alive or kind == "counter" else 0.0
                family.samples.append(fleet._replace(labels={**fleet.labels, "replica": str(r.replica)}, value=value))
            yield family
        if replicas is not None:
            up = GaugeMetricFamily("servelab:replica_up", "1 while the replica serves, 0 once it has stopped.",
                                   labels=["model_name", "replica"])
            for r in replicas:
                up.add_metric([self.model_name, str(r.replica)], 1.0 if r.alive else 0.0)
            yield up


class FleetTotals(Collector):
    """The request metrics of a replica set: each labelled by replica, plus the fleet's series (the
    sums over replicas, without the label; `_created`: the earliest)."""

    def __init__(self, metrics: list[Any]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        for metric in self.metrics:
            for family in metric.collect():
                totals: dict[tuple, float] = {}
                for s in family.samples:
                    labels = tuple((k, v) for k, v in s.labels.items() if k != "replica")
                    key = (s.name, labels)
                    if s.name.endswith("_created"):
                        totals[key] = min(totals.get(key, s.value), s.value)
                    else:
                        totals[key] = totals.get(key, 0.0) + s.value
                family.samples.extend(Sample(name, dict(labels), value) for (name, labels), value in totals.items())
                yield family


class ServingMetrics:
    def __init__(self, stats: Callable[[], Any], model_name: str,
                 replica_status: Callable[[], list | None] | None = None) -> None:
        """`replica_status`: each replica's `ReplicaStatus` (a replica set), or None (one engine)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        replicas = replica_status() if replica_status is not None else None
        self.registry.register(EngineCollector(stats, model_name, replica_status if replicas is not None else None))
        self._replica_ids = [str(r.replica) for r in replicas] if replicas is not None else None
        labels = ["model_name"] if replicas is None else ["model_name", "replica"]
        registry = self.registry if replicas is None else None  # a replica set's: through FleetTotals
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (s).", labels,
                              registry=registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens (s).", labels,
                             registry=registry, buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to end (s).", labels,
                             registry=registry, buckets=E2E_BUCKETS)
        for histogram in (self.ttft, self.itl, self.e2e):  # the series exist (at zero) before the first request
            for key in self._series_keys():
                histogram.labels(*key)
        self.finished = Counter("vllm:request_success", "Requests ended, by finish reason.",
                                [*labels, "finished_reason"], registry=registry)
        if replicas is not None:
            self.registry.register(FleetTotals([self.ttft, self.itl, self.e2e, self.finished]))

    def _series_keys(self) -> list[tuple[str, ...]]:
        if self._replica_ids is None:
            return [(self.model_name,)]
        return [(self.model_name, r) for r in self._replica_ids]

    def observe(self, request: Any) -> None:
        """One ended request's `engine.online.engine_stats.RequestStats` (AsyncLLMEngine's finished observer)."""
        key = (self.model_name,) if self._replica_ids is None else (self.model_name, str(request.replica))
        if request.ttft is not None:
            self.ttft.labels(*key).observe(request.ttft)
        observe_all(self.itl.labels(*key), request.inter_token_latencies)
        self.e2e.labels(*key).observe(request.e2e)
        self.finished.labels(*key, finish_reason_label(request.finish_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def finish_reason_label(reason: str | None) -> str:
    """vLLM's finished_reason label values: stop, length, abort."""
    if reason is None or reason.startswith("abort"):
        return "abort"
    return reason


def observe_all(histogram: Any, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every value, with one increment per bucket hit: a request's
    hundreds of inter-token gaps are observed at its end, on the event loop that streams every
    response, and prometheus_client's `observe` walks the buckets and takes a lock per value. Falls
    back to `observe` per value where the histogram's buckets are not where this expects them."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or bounds[-1] != inf:
        for value in values:
            histogram.observe(value)
        return
    if not values:
        return
    total.inc(sum(values))
    ordered, below = sorted(values), 0
    for bound, bucket in zip(bounds, buckets):  # a value counts in the first bucket whose bound it is <=
        upto = bisect_right(ordered, bound)
        if upto > below:
            bucket.inc(upto - below)
            below = upto
