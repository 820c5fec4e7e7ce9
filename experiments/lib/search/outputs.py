"""A search's outputs: the table (csv + parquet), the Pareto front (PNG), the cheapest deployment
for the target rate (printed and in summary.json)."""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.lib.search.pareto import pareto_front, plot_front
from experiments.lib.search.status import add_status, status_counts
from experiments.lib.workloads import Workload

DEPLOYMENT_COLUMNS = ["gpu", "tensor_parallel_size", "replicas", "max_num_seqs", "max_num_batched_tokens",
                      "policy", "router"]
# The prefill/decode split (space.py): in the table, the cheapest pick and the front, kept out of
# DEPLOYMENT_COLUMNS, which tables written before it lack (the GPU check reads those too).
SPLIT_COLUMN = "pd_split"
CONFIG_FILE = "config.yaml"


@dataclass(slots=True)
class SearchResult:
    table: pd.DataFrame  # one row per deployment
    front: pd.DataFrame  # its Pareto front (cost vs capacity)
    cheapest: dict[str, Any] | None  # the cheapest deployment for the target rate (None: none sustains it)
    summary: dict[str, Any]  # summary.json


def describe(row: dict[str, Any] | pd.Series) -> str:
    split = row.get("pd_split", "mixed")
    replicas = f"{int(row['replicas'])}" if split == "mixed" else f"{int(row['replicas'])} ({split} prefill:decode)"
    return (f"{replicas} x {row['gpu']} TP{int(row['tensor_parallel_size'])} "
            f"(max_num_seqs={int(row['max_num_seqs'])}, max_num_batched_tokens={int(row['max_num_batched_tokens'])}, "
            f"policy={row['policy']}, router={row['router']})")


def finish(cfg: DictConfig, rows: list[dict[str, Any]], slo, s, mean_output: float, workload: Workload,
           out_dir: str | Path):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The composed configuration, interpolations kept: `experiments.search_check` rebuilds each
    # deployment's run config (and its workload and SLOs) from it.
    (out_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(cfg))
    table = pd.DataFrame(rows)
    for col in ("capacity_rps", "failed_rps", "ttft_p", "tpot_p", "goodput_fraction", "simulations",
                "simulated_requests", "missed_at_lowest", "failed_because", "num_requests", "failed_num_requests",
                "rate_limit_rps"):
        if col not in table:
            table[col] = np.nan
    table["capacity_rps"] = table["capacity_rps"].astype(float)
    add_status(table, s.rtol)
    table["capacity_per_gpu_rps"] = table["capacity_rps"] / table["num_gpus"]  # goodput per GPU at the SLOs
    tokens_per_hour = table["capacity_rps"] * mean_output * 3600
    table["cost_per_million_output_tokens"] = np.where(
        table["capacity_rps"] > 0, table["dollars_per_hour"] / tokens_per_hour.where(tokens_per_hour > 0) * 1e6, np.nan)
    table.to_csv(out_dir / "table.csv", index=False)
    table.to_parquet(out_dir / "table.parquet", index=False)
    ran = table[table["status"] != "pruned"]
    if not (ran["capacity_rps"] > 0).any():
        missed = Counter(f for m in ran["missed_at_lowest"] for f in str(m).split(",") if f)
        field = missed.most_common(1)[0][0] if missed else "ttft_s"
        lowest = float(ran["failed_rps"].min())
        named = "search.slo (some requests never finish)" if field == "completed" else \
            f"search.slo.{field}={getattr(slo, field)!r}"
        raise ValueError(f"{named} is met by no deployment: none of "
                         f"{len(ran)} meets {slo_text(slo)} even at {lowest:.3g} req/s (table in {out_dir / 'table.csv'})")
    if s.duration_s is None and ran["failed_rps"].isna().all():
        raise ValueError(f"search.duration_s=null measured no capacity: none of {len(ran)} deployments missed "
                         f"{slo_text(slo)} at any rate tried (up to {ran['capacity_rps'].max():.3g} req/s), as every "
                         f"run offers the same {len(workload)} requests of workload={workload.name!r}, which at a high "
                         "rate arrive as one burst the batch absorbs: set search.duration_s, the seconds of arrivals "
                         f"per run (table in {out_dir / 'table.csv'})")
    front = pareto_front(table)
    plot_front(table, front, out_dir / "pareto.png",
               f"{cfg.model.name}, {workload.name}, {slo_text(slo)}")
    able = table[table["capacity_rps"] >= s.target_rate].sort_values(
        ["dollars_per_hour", "capacity_rps"], ascending=[True, False], kind="stable")
    cheapest = None if able.empty else _plain(able.iloc[0][[*DEPLOYMENT_COLUMNS, SPLIT_COLUMN, "num_gpus", "dollars_per_hour",
                                                            "capacity_rps", "cost_per_million_output_tokens",
                                                            "ttft_p", "tpot_p", "goodput_fraction", "capacity_status",
                                                            "num_requests", "failed_rps", "failed_because",
                                                            "failed_num_requests"]].to_dict())
    counts = table["status"].value_counts().to_dict()
    summary = {"model": cfg.model.name, "workload": workload.name,
               "mean_output_tokens": mean_output, "latency": cfg.latency.name, "slo": slo.as_dict(),
               "slo_text": slo_text(slo),
               "target_rate": s.target_rate, "deployments": len(table),
               "simulated": int(counts.get("simulated", 0)), "cached": int(counts.get("cached", 0)),
               "pruned": int(counts.get("pruned", 0)), "simulations": int(table["simulations"].fillna(0).sum()),
               "simulated_requests": int(table["simulated_requests"].fillna(0).sum()),
               "duration_s": s.duration_s, "requests_per_run": len(workload) if s.duration_s is None else None,
               "rtol": s.rtol, "max_iterations": s.max_iterations, "capacities": status_counts(table),
               "cheapest": cheapest, "pareto_front": [_plain(r) for r in front[
                   [*DEPLOYMENT_COLUMNS, SPLIT_COLUMN, "num_gpus", "dollars_per_hour", "capacity_rps",
                    "cost_per_million_output_tokens", "capacity_status"]].to_dict("records")],
               "files": {"table": "table.csv", "parquet": "table.parquet", "pareto": "pareto.png",
                         "config": CONFIG_FILE}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return SearchResult(table, front, cheapest, summary)


def largest_capacity(table: pd.DataFrame, max_iterations: int | None) -> str:
    """The table's largest capacity, as words: a bound from below where the search found no failing
    rate above it (the rate only grew within `search.rate.max_iterations`)."""
    best = table.loc[table["capacity_rps"].idxmax()] if table["capacity_rps"].notna().any() else None
    if best is None:
        return "no deployment was simulated"
    if "rate_limit_rps" in table and pd.notna(best["rate_limit_rps"]):
        return (f"the largest capacity is at least {best['capacity_rps']:.3g} req/s, the most the workload's requests "
                "cover for search.duration_s: give a longer trace")
    if "failed_rps" in table and pd.isna(best["failed_rps"]):
        within = f" within {max_iterations} iterations" if max_iterations is not None else ""
        return (f"the largest capacity is at least {best['capacity_rps']:.3g} req/s: no failing rate found{within}; "
                "raise search.rate.max_iterations")
    return f"the largest capacity is {best['capacity_rps']:.3g} req/s"


def slo_text(slo) -> str:
    parts = []
    if slo.ttft_s is not None:
        parts.append(f"TTFT p{slo.ttft_percentile:g} <= {slo.ttft_s:g} s")
    if slo.tpot_s is not None:
        parts.append(f"TPOT p{slo.tpot_percentile:g} <= {slo.tpot_s * 1e3:g} ms")
    text = " and ".join(parts)
    return f"goodput >= {slo.goodput:g} of requests with {text}" if slo.goodput is not None else text


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready values: numpy scalars as Python ones, NaN (no value) as None."""
    out = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in d.items()}
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}
