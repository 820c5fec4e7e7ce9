"""Trace files of a run: recorder rows -> `requests.parquet`, `steps.parquet`, `events.parquet`;
and loading one run dir or every run under a multirun dir.

Parquet is written by pyarrow from explicit schemas-by-column-order, with no wall-clock data, so the
same config and seed give byte-identical files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from policies.disagg import HANDOFF_COLUMNS
from policies.trace import EVENT_COLUMNS, REQUEST_COLUMNS, STEP_COLUMNS, TraceRecorder

REQUESTS_FILE, STEPS_FILE, EVENTS_FILE, SUMMARY_FILE = (
    "requests.parquet", "steps.parquet", "events.parquet", "summary.json")
_FLOAT_REQUEST_COLUMNS = ("first_scheduled_time", "first_token_time", "ttft", "tpot", "queueing_time")
HANDOFF_FLOAT_COLUMNS = ("prefill_time", "decode_wait", "link_wait", "link_time", "transfer_time")


def requests_frame(recorder: TraceRecorder) -> pd.DataFrame:
    """The request rows; a disaggregated run's decode replicas add the hand-off columns
    (policies/disagg/handoff.py: HANDOFF_COLUMNS)."""
    split = any("transfer_time" in row for row in recorder.requests)
    columns = [*REQUEST_COLUMNS, *(HANDOFF_COLUMNS if split else ())]
    df = pd.DataFrame.from_records(recorder.requests, columns=columns)
    for col in _FLOAT_REQUEST_COLUMNS + (HANDOFF_FLOAT_COLUMNS if split else ()):
        df[col] = df[col].astype("float64")
    return df


def steps_frame(recorder: TraceRecorder) -> pd.DataFrame:
    if isinstance(recorder, TraceRecorder) and recorder.has_compact_steps:
        # Fast-forwarded decode runs, without building their rows; numpy infers int64 / float64 as
        # from_records does.
        columns = recorder.step_columns()
        return pd.DataFrame({name: np.asarray(values) for name, values in columns.items()})
    return pd.DataFrame.from_records(recorder.steps, columns=list(STEP_COLUMNS))


def events_frame(recorder: TraceRecorder) -> pd.DataFrame:
    df = pd.DataFrame.from_records(recorder.events, columns=list(EVENT_COLUMNS))
    df["seq_id"] = df["seq_id"].astype("Int64")
    return df


def _write(df: pd.DataFrame, path: Path) -> None:
    table = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table.replace_schema_metadata(None), path, compression="zstd")


def write_traces(recorder: TraceRecorder, out_dir: str | Path
                 ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame | None]:
    """Write the parquet files; return the (requests, steps, events or None) frames."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    requests, steps = requests_frame(recorder), steps_frame(recorder)
    _write(requests, out_dir / REQUESTS_FILE)
    _write(steps, out_dir / STEPS_FILE)
    events = None
    if recorder.record_events:
        events = events_frame(recorder)
        _write(events, out_dir / EVENTS_FILE)
    return requests, steps, events


def write_fleet_traces(recorders: list[TraceRecorder], out_dir: str | Path
                       ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame | None]:
    """A fleet's traces: each replica's rows with a leading `replica` column (its index), requests in
    end order, steps and events in time order (ties: by replica, then each replica's own order)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frames: list[tuple[pd.DataFrame, str]] = [
        (_merged([requests_frame(r) for r in recorders], "finish_time"), REQUESTS_FILE),
        (_merged([steps_frame(r) for r in recorders], "time"), STEPS_FILE)]
    if all(r.record_events for r in recorders):
        frames.append((_merged([events_frame(r) for r in recorders], "time"), EVENTS_FILE))
    for df, name in frames:
        _write(df, out_dir / name)
    return frames[0][0], frames[1][0], frames[2][0] if len(frames) > 2 else None


def _merged(frames: list[pd.DataFrame], time_column: str) -> pd.DataFrame:
    for replica, df in enumerate(frames):
        df.insert(0, "replica", np.full(len(df), replica, dtype=np.int64))
    merged = pd.concat(frames, ignore_index=True)
    if merged.empty:  # keep the replicas' column types
        return frames[0]
    order = np.lexsort((np.arange(len(merged)), merged["replica"].to_numpy(), merged[time_column].to_numpy()))
    return merged.iloc[order].reset_index(drop=True)


def write_summary(summary: dict[str, Any], out_dir: str | Path) -> None:
    Path(out_dir, SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=False, default=str) + "\n")


@dataclass(slots=True)
class Run:
    path: Path
    requests: pd.DataFrame
    steps: pd.DataFrame
    events: pd.DataFrame | None
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return str(self.summary.get("label") or self.path.name)


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not (path / REQUESTS_FILE).is_file():
        raise ValueError(f"run dir {str(path)!r} holds no {REQUESTS_FILE}")
    events = pd.read_parquet(path / EVENTS_FILE) if (path / EVENTS_FILE).is_file() else None
    summary = json.loads((path / SUMMARY_FILE).read_text()) if (path / SUMMARY_FILE).is_file() else {}
    return Run(path, pd.read_parquet(path / REQUESTS_FILE), pd.read_parquet(path / STEPS_FILE), events, summary)


def find_runs(path: str | Path) -> list[Path]:
    """A run dir itself, or every run dir below a multirun (or A/B) dir, in sorted order."""
    path = Path(path)
    if (path / REQUESTS_FILE).is_file():
        return [path]
    return sorted(p.parent for p in path.rglob(REQUESTS_FILE))


def load_runs(path: str | Path) -> list[Run]:
    runs = [load_run(p) for p in find_runs(path)]
    if not runs:
        raise ValueError(f"no run found under {str(path)!r} (looked for {REQUESTS_FILE})")
    return runs
