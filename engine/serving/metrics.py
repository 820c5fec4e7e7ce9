"""`GET /metrics`: Prometheus text with vLLM's metric names, so existing scrapers and Grafana boards work.

Scheduler state and token totals are read from `AsyncLLMEngine.stats()` at scrape time (gauges
`vllm:num_requests_running|waiting|swapped`, `vllm:kv_cache_usage_perc` and v0's
`vllm:gpu_cache_usage_perc`; counters `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`). The latency histograms (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`) and the
`vllm:request_success_total` counter take one `RequestStats` per ended request from the engine
(`AsyncLLMEngine.add_finished_observer`). Every metric carries the `model_name` label, as vLLM's do. Each app has its
own registry (several servers in one process do not share metrics).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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
    """Reads the engine's stats when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        for name, help_text, attr, kind in ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, attr)))
            yield family


class ServingMetrics:
    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (s).", labels,
                              registry=self.registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens (s).", labels,
                             registry=self.registry, buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to end (s).", labels,
                             registry=self.registry, buckets=E2E_BUCKETS)
        for histogram in (self.ttft, self.itl, self.e2e):
            histogram.labels(model_name)  # the series exist (at zero) before the first request
        self.finished = Counter("vllm:request_success", "Requests ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def observe(self, request: Any) -> None:
        """One ended request's `engine.online.engine_stats.RequestStats` (AsyncLLMEngine's finished observer)."""
        name = self.model_name
        if request.ttft is not None:
            self.ttft.labels(name).observe(request.ttft)
        itl = self.itl.labels(name)
        for gap in request.inter_token_latencies:
            itl.observe(gap)
        self.e2e.labels(name).observe(request.e2e)
        self.finished.labels(name, finish_reason_label(request.finish_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def finish_reason_label(reason: str | None) -> str:
    """vLLM's finished_reason label values: stop, length, abort."""
    if reason is None or reason.startswith("abort"):
        return "abort"
    return reason
