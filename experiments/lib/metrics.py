"""Metrics over a run's traces, with vLLM's serving-benchmark definitions (docs/metrics.md).

Duration = first arrival -> last request end. Throughputs count completed (not aborted) requests.
TTFT = first token - arrival; TPOT = (E2E - TTFT) / (output_len - 1); ITL = gaps between
consecutive output tokens (`token_times`); E2E = finish - arrival; queueing = first scheduled -
arrival. Each latency gets mean / median / std / p90 / p99 (seconds). Goodput = completed
requests per second meeting every SLO that is set (`slo.ttft_s`, `slo.tpot_s`, `slo.e2el_s`).
KV utilisation = used token slots / allocated slots (`kv_tokens / (gpu_blocks_used * block_size)`)
and waste = the allocated slots left unfilled, max(0, 1 - that ratio) per step (a step whose
sequences share blocks counts none), both weighted by step duration.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from experiments.lib.tenant_metrics import per_tenant

LATENCIES = ("ttft", "tpot", "itl", "e2e", "queueing_time")
STATS = ("mean", "median", "std", "p90", "p99")


def stats(values: np.ndarray) -> dict[str, float | None]:
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return {s: None for s in STATS}
    return {"mean": float(v.mean()), "median": float(np.median(v)), "std": float(v.std()),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99))}


def inter_token_latencies(requests: pd.DataFrame) -> np.ndarray:
    gaps = [np.diff(np.asarray(t, dtype=float)) for t in requests["token_times"] if t is not None and len(t) > 1]
    return np.concatenate(gaps) if gaps else np.empty(0)


def _weighted_mean(x: pd.Series, w: pd.Series) -> float | None:
    total = float(w.sum())
    return float((x * w).sum() / total) if total > 0 else None


SLO_KEYS = ("ttft_s", "tpot_s", "e2el_s")  # the run config's `slo` thresholds (null: off)


def check_slo_seconds(value: Any, key: str) -> float | None:
    """One SLO threshold: a finite number of seconds > 0, or None (the objective off). A threshold
    of 0 or below no request meets (goodput 0), so it is refused rather than measured."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < math.inf):
        raise ValueError(f"{key}={value!r} is invalid: must be a number > 0 (seconds) or null")
    return value


def check_slo(slo: Mapping[str, Any], where: str = "slo") -> dict[str, Any]:
    """The run config's `slo` section, each threshold checked (ValueError naming `where.key`)."""
    for key in SLO_KEYS:
        check_slo_seconds(slo.get(key), f"{where}.{key}")
    return dict(slo)


def meets_slo(requests: pd.DataFrame, slo: Mapping[str, Any] | None) -> pd.Series:
    ok = pd.Series(True, index=requests.index)
    slo = slo or {}
    for key, col in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("e2el_s", "e2e")):
        limit = slo.get(key)
        if limit is not None:
            values = requests[col].fillna(0.0) if col == "tpot" else requests[col]
            ok &= values <= limit
    return ok


def goodput(requests: pd.DataFrame, duration_s: float, slo: Mapping[str, Any] | None,
            num_gpus: int = 1) -> float:
    """Finished requests meeting every SLO that is set, per second (per GPU with `num_gpus`): vLLM's
    goodput, and DistServe's goodput per GPU."""
    if not duration_s > 0:
        return math.nan
    done = requests[requests["status"] == "finished"]
    return int(meets_slo(done, slo).sum()) / duration_s / num_gpus


def kv_metrics(steps: pd.DataFrame, block_size: int) -> dict[str, float | None]:
    if steps.empty:
        return {"kv_utilization": None, "kv_waste": None, "gpu_blocks_used_mean": None,
                "gpu_blocks_used_peak": None, "gpu_block_usage_mean": None, "cpu_blocks_used_peak": None}
    w = steps["duration"].astype(float)
    allocated = steps["gpu_blocks_used"] * block_size
    busy = allocated > 0
    ratio = steps["kv_tokens"][busy] / allocated[busy]
    util = _weighted_mean(ratio, w[busy])
    # Shared blocks (forked samples, a prefix cache) count once in the pool and once per sequence in
    # kv_tokens, so a step's ratio can pass 1; its unfilled slots cannot be told apart then: none.
    waste = _weighted_mean((1.0 - ratio).clip(lower=0.0), w[busy])
    return {
        "kv_utilization": util,
        "kv_waste": waste,
        "gpu_blocks_used_mean": _weighted_mean(steps["gpu_blocks_used"].astype(float), w),
        "gpu_blocks_used_peak": int(steps["gpu_blocks_used"].max()),
        "gpu_block_usage_mean": _weighted_mean(steps["gpu_blocks_used"] / steps["gpu_blocks_total"], w),
        "cpu_blocks_used_peak": int(steps["cpu_blocks_used"].max()),
    }


def per_class(done: pd.DataFrame) -> dict[str, dict[str, Any]]:
    if done["priority"].nunique() < 2:
        return {}
    out = {}
    for prio, group in done.groupby("priority", sort=True):
        out[str(prio)] = {"num_requests": len(group), "ttft": stats(group["ttft"].to_numpy()),
                          "tpot": stats(group["tpot"].to_numpy()), "e2e": stats(group["e2e"].to_numpy())}
    return out


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, block_size: int,
              slo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    done = requests[requests["status"] == "finished"]
    aborted = requests[requests["status"] == "aborted"]
    if len(requests):
        duration = float(requests["finish_time"].max() - requests["arrival_time"].min())
    else:
        duration = 0.0
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    out_tokens = int(done["output_len"].sum())
    prompt_tokens = int(done["prompt_len"].sum())
    batch = steps["num_prefill_seqs"] + steps["num_decode_seqs"] if len(steps) else pd.Series(dtype=float)
    summary: dict[str, Any] = {
        "num_requests": len(requests),
        "completed": len(done),
        "aborted": len(aborted),
        "abort_reasons": {str(k): int(v) for k, v in aborted["finish_reason"].value_counts().sort_index().items()},
        "duration_s": duration,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(out_tokens + prompt_tokens),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "goodput": goodput(requests, duration, slo),
        "slo": dict(slo or {}),
    }
    for name in LATENCIES:
        values = inter_token_latencies(done) if name == "itl" else done[name].to_numpy()
        summary[name] = stats(values)
    summary.update({
        "num_steps": len(steps),
        "mean_batch_size": float(batch.mean()) if len(batch) else None,
        "mean_running": _weighted_mean(steps["num_running"].astype(float), steps["duration"]) if len(steps) else None,
        "num_preemptions": int(requests["num_preemptions"].sum()),
        "num_preempted_recompute": int(steps["num_preempted_recompute"].sum()) if len(steps) else 0,
        "num_preempted_swap": int(steps["num_preempted_swap"].sum()) if len(steps) else 0,
        "num_swap_fallbacks": int(steps["num_swap_fallbacks"].sum()) if len(steps) else 0,
        "swap_out_blocks": int(steps["num_swap_out_blocks"].sum()) if len(steps) else 0,
        "swap_in_blocks": int(steps["num_swap_in_blocks"].sum()) if len(steps) else 0,
        "prefix_hit_rate": (float(steps["prefix_hits"].iloc[-1] / steps["prefix_queries"].iloc[-1])
                            if len(steps) and steps["prefix_queries"].iloc[-1] else None),
    })
    summary.update(kv_metrics(steps, block_size))
    summary["per_priority"] = per_class(done)
    summary["per_tenant"] = per_tenant(requests, duration, stats)
    return summary


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def summary_table(s: Mapping[str, Any]) -> str:
    """A short human-readable table of the headline metrics."""
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    rows = [
        ("requests (completed / aborted)", f"{s['completed']} / {s['aborted']}"
         + "".join(f", {n} {reason}" for reason, n in s.get("abort_reasons", {}).items())),
        ("duration (s)", fmt(s["duration_s"], ".2f")),
        ("request throughput (req/s)", fmt(s["request_throughput"], ".2f")),
        ("output throughput (tok/s)", fmt(s["output_throughput"], ".1f")),
        ("total throughput (tok/s)", fmt(s["total_token_throughput"], ".1f")),
        ("goodput (req/s)", fmt(s["goodput"], ".2f")),
    ]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        st = s[name]
        rows.append((f"{label} mean / p50 / p99 (ms)", f"{_ms(st['mean'])} / {_ms(st['median'])} / {_ms(st['p99'])}"))
        if name == "ttft":  # per priority class: where scheduling policies differ most
            for prio, cls in s.get("per_priority", {}).items():
                c = cls["ttft"]
                rows.append((f"  of priority {prio} ({cls['num_requests']} req)",
                             f"{_ms(c['mean'])} / {_ms(c['median'])} / {_ms(c['p99'])}"))
            for tenant, cls in (s.get("per_tenant") or {}).get("tenants", {}).items():
                c = cls["ttft"]
                rows.append((f"  of tenant {tenant} ({cls['num_requests']} req)",
                             f"{_ms(c['mean'])} / {_ms(c['median'])} / {_ms(c['p99'])}"))
    rows += [
        ("mean batch size", fmt(s["mean_batch_size"], ".1f")),
        ("preemptions (recompute / swap)",
         f"{s['num_preempted_recompute']} / {s['num_preempted_swap']}"
         + (f" ({s['num_swap_fallbacks']} swaps fell back to recompute)" if s.get("num_swap_fallbacks") else "")),
        ("KV utilisation / waste", f"{fmt(s['kv_utilization'], '.1%')} / {fmt(s['kv_waste'], '.1%')}"),
    ]
    if s.get("per_tenant"):
        rows.append(("max service gap (weighted tokens)", fmt(s["per_tenant"]["service_gap_max"], ".0f")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
