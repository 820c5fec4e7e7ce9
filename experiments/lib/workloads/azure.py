"""Azure LLM inference traces (2023 and 2024; github.com/Azure/AzurePublicDataset), CSV:

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,4808,10

`TIMESTAMP` (ISO date and time, any number of fractional digits, with or without a UTC offset,
the same kind on every row) -> arrival time, seconds after the trace's first request;
`ContextTokens` -> prompt length (drawn token ids, seeded); `GeneratedTokens` -> output length.
Config: `path`, `num_requests` (first N rows), `time_scale`, `drop_empty` (imported.py).
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from experiments.lib.workloads.base import WORKLOADS, Workload, WorkloadConfig
from experiments.lib.workloads.imported import LengthRows, drop_empty
from experiments.lib.workloads.replay import bad_field, trace_rows


def _timestamp(path, line: int, row: Mapping[str, Any]) -> datetime.datetime:
    v = row.get("TIMESTAMP")
    try:
        return datetime.datetime.fromisoformat(str(v).strip())
    except ValueError:
        raise bad_field(path, line, "TIMESTAMP", v, "must be a date and time such as 2023-11-16 18:15:46.6805900") \
            from None


@dataclass(kw_only=True)
class AzureWorkloadConfig(WorkloadConfig):
    path: str | None = None
    time_scale: float | None = None
    drop_empty: bool = False


@WORKLOADS.register("azure", config=AzureWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    path, rows, scale = trace_rows(cfg, where, "Azure LLM inference .csv")
    kept, first = LengthRows(path, where, drop_empty(cfg, where)), None
    for line, row in rows:
        ts = _timestamp(path, line, row)
        if first is None:
            first = ts
        elif (ts.tzinfo is None) != (first.tzinfo is None):
            raise bad_field(path, line, "TIMESTAMP", row.get("TIMESTAMP"),
                       "must carry a UTC offset if the first row's does, and none otherwise")
        kept.add(line, row, (ts - first).total_seconds(), "ContextTokens", "GeneratedTokens")
    return kept.workload(str(cfg.get("name", "azure")), seed, vocab_size, scale)
