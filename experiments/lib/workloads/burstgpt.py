"""BurstGPT traces (github.com/HPMLL/BurstGPT), CSV:

    Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
    5,ChatGPT,472,18,490,Conversation log

`Timestamp` (seconds) -> arrival time, relative to the trace's first request; `Request tokens` ->
prompt length (drawn token ids, seeded); `Response tokens` -> output length (0 marks a failed
request: see `drop_empty`, imported.py). `Model` and `Log Type` select rows: `model` (e.g. ChatGPT,
GPT-4) and `log_type` (e.g. "Conversation log", "API log"), null for all. `Total tokens` is not
read. Config: `path`, `num_requests` (first N rows, before selection), `time_scale`, `drop_empty`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from experiments.lib.workloads.azure import AzureWorkloadConfig
from experiments.lib.workloads.base import WORKLOADS, Workload
from experiments.lib.workloads.imported import LengthRows, drop_empty
from experiments.lib.workloads.replay import number, trace_rows


def _selector(cfg: Mapping[str, Any], key: str, where: str) -> str | None:
    v = cfg.get(key)
    if v is not None and (not isinstance(v, str) or not v):
        raise ValueError(f"{where}.{key}={v!r} is invalid: must be a non-empty string or null (all rows)")
    return v


@dataclass(kw_only=True)
class BurstgptWorkloadConfig(AzureWorkloadConfig):
    model: str | None = None
    log_type: str | None = None


@WORKLOADS.register("burstgpt", config=BurstgptWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    path, rows, scale = trace_rows(cfg, where, "BurstGPT .csv")
    kept = LengthRows(path, where, drop_empty(cfg, where))
    model, log_type = _selector(cfg, "model", where), _selector(cfg, "log_type", where)
    for line, row in rows:
        if (model is not None and row.get("Model") != model) or \
                (log_type is not None and row.get("Log Type") != log_type):
            continue
        kept.add(line, row, number(path, line, row, "Timestamp"), "Request tokens", "Response tokens")
    if not kept.items and not kept.dropped:
        raise ValueError(f"{where}.model={model!r}, {where}.log_type={log_type!r} select no row of {path}")
    return kept.workload(str(cfg.get("name", "burstgpt")), seed, vocab_size, scale)
