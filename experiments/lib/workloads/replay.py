"""Replay a recorded trace: CSV or JSONL (by extension), one request per row/line.

Fields: `arrival_time` (finite seconds >= 0, required), `prompt_token_ids` (JSONL: a list of ints; CSV:
space-separated ints) or `prompt_len` (then random token ids, seeded), `output_len` (>= 1,
required), `priority` (int, default 0), `request_id` (default: the row index), `max_tokens`
(optional cap >= output_len), `tenant` (the client's id, a non-empty string; default none). No
other field (a CSV column, a JSON key) is allowed: a misspelt one would otherwise be dropped
unnoticed. `prompt_len` next to `prompt_token_ids` must be its length. Rows are sorted by arrival
(stable). Config: `path`, optional `num_requests` (first N rows), `time_scale` (multiplies arrival
times; 0.5 = twice the rate); a `rate` is refused (the trace's arrivals are its own).
A malformed row raises ValueError naming the file, the line and the field; a file that is not UTF-8
text, one naming the file, the line and the byte; CSV text the csv module cannot parse (a field
longer than the longest prompt's ids, MAX_LENGTH x ID_CHARS characters), one naming file and line. Lengths and the memory the prompts take are
bounded (common.py: MAX_LENGTH, MAX_PROMPT_BYTES), and every row is checked before any token id is
drawn.
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.lib.paths import resolve_path
from experiments.lib.workloads.base import WORKLOADS, Workload, WorkloadConfig
from experiments.lib.workloads.common import (
    COUNT,
    LENGTH,
    MAX_LENGTH,
    MAX_REQUESTS,
    PromptMemory,
    get_int,
    get_positive,
    int_error,
    is_int,
    is_num,
    make_request,
)
from sim.latency.file_meta import text_lines

FIELDS = ("request_id", "arrival_time", "prompt_token_ids", "prompt_len", "output_len", "max_tokens", "priority",
          "tenant")
# The most characters a CSV trace's field may hold, per token id of the longest prompt (MAX_LENGTH):
# up to 11 digits and a space. csv's default limit, 131,072 characters, is a prompt of ~20k ids.
ID_CHARS = 12


def bad_field(path: Path, line: int, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{path}:{line}: field {field}={value!r} is invalid: {allowed}")


def as_int(path: Path, line: int, row: Mapping[str, Any], field: str, low: int,
           bound: tuple[int, str] | None = None) -> int:
    """An integer >= low (CSV text or JSON number); with `bound` (common.LENGTH), at most its maximum."""
    v = _parsed(row.get(field), int)
    error = int_error(v, low, bound)
    if error:
        raise bad_field(path, line, field, row.get(field), error)
    return v


def number(path: Path, line: int, row: Mapping[str, Any], field: str) -> float:
    """A finite number >= 0 (CSV text or JSON number)."""
    v = _parsed(row.get(field), float)
    if not is_num(v) or not 0 <= v < math.inf:
        raise bad_field(path, line, field, row.get(field), "must be a finite number >= 0")
    return float(v)


def _parsed(v: Any, kind: type) -> Any:
    """CSV text as `kind` where it parses; anything else as it is."""
    if isinstance(v, str):
        try:
            return kind(v.strip())
        except ValueError:
            pass
    return v


def _known(path: Path, line: int, keys: Any, fields: tuple[str, ...] | None) -> None:
    """With `fields`, a ValueError naming the file, line and first key of `keys` not among them (and
    saying so when it is empty, which a trailing comma in a CSV header makes)."""
    unknown = [] if fields is None else [k for k in keys if k not in fields]
    if unknown:
        empty = "" if unknown[0] else (" (an empty column name: a trailing comma in the header?)"
                                       if path.suffix == ".csv" else " (an empty key)")
        raise ValueError(f"{path}:{line}: field {unknown[0]!r} is unknown{empty}: allowed are {list(fields)}")


class _Lines:
    """A file's lines (text_lines) as csv reads them, counted: `number` is the last one read, the
    one a csv.Error is about."""

    def __init__(self, path: Path) -> None:
        self.number = 0
        self._lines = text_lines(path)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.number += 1
        return line


@contextmanager
def _csv_field_limit(chars: int) -> Iterator[None]:
    """csv's field size limit (process-wide) at `chars` while a trace is read, then as it was."""
    before = csv.field_size_limit(chars)
    try:
        yield
    finally:
        csv.field_size_limit(before)


def _csv_rows(path: Path, limit: int | None, fields: tuple[str, ...] | None) -> list[tuple[int, dict[str, Any]]]:
    """read_rows of a CSV file; a field longer than the longest prompt's ids can be, or any other
    text csv cannot parse, is a ValueError naming the file and line."""
    rows, lines, chars = [], _Lines(path), MAX_LENGTH * ID_CHARS
    reader = csv.DictReader(lines)
    try:
        with _csv_field_limit(chars):
            _known(path, 1, reader.fieldnames or [], fields)
            while limit is None or len(rows) < limit:
                row = next(reader, None)
                if row is None:
                    break
                if fields is not None and None in row:  # DictReader's key for values past the header's
                    raise ValueError(f"{path}:{reader.line_num}: {len(row) - 1 + len(row[None])} values, more "
                                     f"than the header's {len(row) - 1} columns")
                rows.append((reader.line_num, row))  # the row's (last) line: blank lines count
    except csv.Error as e:
        if "field larger than field limit" in str(e):
            raise ValueError(f"{path}:{lines.number}: a field of more than {chars:,} characters, longer than "
                             f"the {MAX_LENGTH:,} token ids of the longest prompt can be") from None
        raise ValueError(f"{path}:{lines.number}: not valid CSV ({e})") from None
    return rows


def read_rows(path: Path, limit: int | None = None, fields: tuple[str, ...] | None = None
              ) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) for each request in a CSV or JSONL file (UTF-8): the first `limit` (None:
    all); the rest of the file is not read. With `fields`, a column or key not among them, or a CSV
    row with more values than the header has columns, is an error naming the file and line."""
    if path.suffix not in (".csv", ".jsonl", ".json"):
        raise ValueError(f"workload.path={str(path)!r} is invalid: must end in .csv or .jsonl")
    if path.suffix == ".csv":
        return _csv_rows(path, limit, fields)
    rows = []
    for k, line in enumerate(text_lines(path), start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{k}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{k}: must be a JSON object, got {type(row).__name__}")  # noqa: TRY004
        _known(path, k, row, fields)
        rows.append((k, row))
    return rows


def more_prompt_tokens(memory: PromptMemory, n: int, path: Path, line: int, where: str, drawn: int | None = None,
                       fix: str = "") -> None:
    """Counts a row's n prompt tokens and the ids drawn or read afresh for them (default: n) in the
    trace's `memory` (common.PromptMemory); past the bound, an error naming the row."""
    memory.add(n, n if drawn is None else drawn, f"{path}:{line}",
               f"set {where}.num_requests to replay fewer rows{fix}")


def _prompt(path: Path, line: int, row: Mapping[str, Any], vocab_size: int, memory: PromptMemory, where: str
            ) -> list[int] | int:
    """The row's prompt (its token ids, or the number of ids to draw), counted in `memory` (read ids
    are int objects of their own, as drawn ones are)."""
    ids = row.get("prompt_token_ids")
    if ids in (None, ""):
        n = as_int(path, line, row, "prompt_len", 1, LENGTH)
        more_prompt_tokens(memory, n, path, line, where)
        return n
    if isinstance(ids, str):
        try:
            ids = [int(t) for t in ids.split()]
        except ValueError:
            raise bad_field(path, line, "prompt_token_ids", row["prompt_token_ids"],
                       "must be space-separated integers") from None
    if not isinstance(ids, list) or not ids or not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise bad_field(path, line, "prompt_token_ids", ids, f"must be a non-empty list of integers in [0, {vocab_size})")
    if len(ids) > MAX_LENGTH:
        raise bad_field(path, line, "prompt_token_ids", f"<{len(ids):,} ids>",
                        f"must hold at most {MAX_LENGTH:,} ids{LENGTH[1]}")
    if row.get("prompt_len") not in (None, "") and as_int(path, line, row, "prompt_len", 1, LENGTH) != len(ids):
        raise bad_field(path, line, "prompt_len", row["prompt_len"], f"must equal the number of prompt_token_ids "
                        f"({len(ids)}) when both are given")
    more_prompt_tokens(memory, len(ids), path, line, where)
    return ids


def trace_rows(cfg: Mapping[str, Any], where: str, kind: str = ".csv or .jsonl",
               fields: tuple[str, ...] | None = None) -> tuple[Path, list[tuple[int, dict[str, Any]]], float]:
    """(file, its first `num_requests` rows with their line numbers, `time_scale`) of a trace
    workload's config (`path`, `num_requests`, `time_scale`), each checked, and no `rate` (a
    trace's arrivals are its own); with `fields`, the only columns or keys the rows may have (read_rows)."""
    if not cfg.get("path"):
        raise ValueError(f"{where}.path={cfg.get('path')!r} is invalid: give a {kind} trace file")
    path = resolve_path(cfg["path"])
    if not path.is_file():
        raise ValueError(f"{where}.path={str(cfg['path'])!r} is invalid: no such file")
    if cfg.get("rate") is not None:  # else a sweep over rates would rerun the trace unchanged
        raise ValueError(f"{where}.rate={cfg['rate']!r} is invalid with {where}.kind={cfg.get('kind')}: a trace "
                         f"replays its own arrival times; scale them with {where}.time_scale (0.5: twice the rate)")
    scale = get_positive(cfg, "time_scale", where) if cfg.get("time_scale") is not None else 1.0
    limit = get_int(cfg, "num_requests", where, 1, COUNT) if cfg.get("num_requests") is not None else None
    rows = read_rows(path, MAX_REQUESTS + 1 if limit is None else limit, fields)
    if len(rows) > MAX_REQUESTS:
        raise ValueError(f"{where}.path={str(path)!r} holds more than {MAX_REQUESTS:,} requests, the most a workload "
                         f"may hold: set {where}.num_requests to replay its first rows")
    if not rows:
        raise ValueError(f"{where}.path={str(path)!r} holds no requests")
    return path, rows, scale


@dataclass(kw_only=True)
class ReplayWorkloadConfig(WorkloadConfig):
    path: str | None = None
    time_scale: float | None = None


@WORKLOADS.register("replay", config=ReplayWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    path, rows, scale = trace_rows(cfg, where, fields=FIELDS)
    items, seen, memory = [], set(), PromptMemory()
    for index, (line, row) in enumerate(rows):  # every row checked before any token id is drawn
        t = number(path, line, row, "arrival_time")
        prompt = _prompt(path, line, row, vocab_size, memory, where)
        out = as_int(path, line, row, "output_len", 1, LENGTH)
        prio = as_int(path, line, row, "priority", -2**31) if row.get("priority") not in (None, "") else 0
        cap = as_int(path, line, row, "max_tokens", out, LENGTH) if row.get("max_tokens") not in (None, "") else None
        tenant = row.get("tenant")
        if tenant in (None, ""):
            tenant = None
        elif not isinstance(tenant, (str, int)) or isinstance(tenant, bool):
            raise bad_field(path, line, "tenant", tenant, "must be a non-empty string")
        rid = row.get("request_id")
        rid = str(index) if rid is None or rid == "" else str(rid)  # 0 is an id, not a missing one
        if rid in seen:
            raise bad_field(path, line, "request_id", rid, "must be unique in the trace")
        seen.add(rid)
        items.append((float(t) * scale, index, rid, prompt, out, cap, prio, None if tenant is None else str(tenant)))
    rng = np.random.default_rng(seed)
    requests = [make_request(rid, rng.integers(0, vocab_size, size=prompt).tolist() if is_int(prompt) else prompt,
                             out, cap, t, prio, tenant=tenant)
                for t, _, rid, prompt, out, cap, prio, tenant in items]  # file order: the draws' order
    order = sorted(range(len(items)), key=lambda k: items[k][:2])
    return Workload(str(cfg.get("name", "replay")), [requests[k] for k in order], [items[k][4] for k in order])
