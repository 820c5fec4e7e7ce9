"""The profile grid (config group `profile_grid`) and the CSV file the profiler writes.

Step rows cover the full grid prefill tokens x decode sequences x context per decode that
`sim/latency/step_grid.py` interpolates over (rows with 0 decodes stand for every context value).
With `context_ratios` (optional), the decode-only rows of two or more sequences are measured once
per ratio of the longest decode context to the mean (the batch-shape axis: a program-per-sequence
decode kernel's time on a one-wave batch follows the longest); the other rows keep the C/4..7C/4
spread and stand for every ratio.
Each prefill is one sequence with no prefix; the `split` rows (the same prefill tokens over more
sequences) measure what another layout (several prompts, chunks over a prefix) saves, written as
the metadata the profiled model prices such layouts with: `prefill_tile_s`, seconds per key tile on
the prefill kernel's critical path (sim/latency/prefill_schedule.py), and the older per-pair slope
`prefill_pair_s`.
"""
from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.lib.profiling.synthetic import StepShape, split_tokens
from sim.latency.prefill_schedule import PrefillSchedule
from sim.latency.profile_io import COLUMNS, RATIO_COLUMN

# Optional: the row's context ratio (the batch-shape axis; empty: every ratio); time_s = forward_s +
# host_s (readers ignore them); sync_time_s (async profiles): the step when scheduled synchronously
# (sim/latency/profiled.py prices such steps with it).
EXTRA_COLUMNS = (RATIO_COLUMN, "forward_s", "host_s", "sync_time_s")


def _int_list(d: Mapping[str, Any], key: str, low: int) -> list[int]:
    v = d.get(key)
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(x, bool) or not isinstance(x, int) or x < low for x in v):
        raise ValueError(f"profile_grid.{key}={v!r} is invalid: must be a non-empty list of integers >= {low}")
    if len(set(v)) != len(v):
        raise ValueError(f"profile_grid.{key}={list(v)!r} is invalid: values must be distinct")
    return sorted(v)


@dataclass(slots=True)
class ProfileGrid:
    prefill_tokens: list[int]
    decode_seqs: list[int]
    context_per_decode: list[int]
    swap_blocks: list[int]
    split_prefill_tokens: list[int]
    split_counts: list[int]
    context_ratios: list[float]  # [] : no batch-shape axis

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProfileGrid:
        ratios = d.get("context_ratios") or []
        if not isinstance(ratios, (list, tuple)) or any(
                isinstance(r, bool) or not isinstance(r, (int, float)) or r < 1 for r in ratios) \
                or len(set(ratios)) != len(ratios):
            raise ValueError(f"profile_grid.context_ratios={ratios!r} is invalid: a list of distinct numbers >= 1 "
                             "(the longest decode context over the mean), or empty")
        grid = cls(_int_list(d, "prefill_tokens", 0), _int_list(d, "decode_seqs", 0),
                   _int_list(d, "context_per_decode", 2), _int_list(d, "swap_blocks", 1),
                   _int_list(d, "split_prefill_tokens", 2), _int_list(d, "split_counts", 1),
                   sorted(float(r) for r in ratios))
        if grid.prefill_tokens == [0] and grid.decode_seqs == [0]:
            raise ValueError("profile_grid: prefill_tokens and decode_seqs are both [0]: no step to measure")
        if 1 in grid.prefill_tokens:
            raise ValueError("profile_grid.prefill_tokens holds 1: a one-token chunk is a decode, use >= 2")
        missing = sorted(set(grid.split_prefill_tokens) - set(grid.prefill_tokens))
        if missing:
            raise ValueError(f"profile_grid.split_prefill_tokens={grid.split_prefill_tokens} is invalid: "
                             f"{missing} not in prefill_tokens (its one-sequence row is the grid's)")
        if max(grid.split_counts) > min(grid.split_prefill_tokens):
            raise ValueError(f"profile_grid.split_counts={grid.split_counts} is invalid: each count must be <= "
                             f"every split_prefill_tokens value {grid.split_prefill_tokens}")
        return grid

    def step_shapes(self) -> list[StepShape]:
        shapes = []
        for p in self.prefill_tokens:
            for d in self.decode_seqs:
                for c in (self.context_per_decode if d else [0]):
                    ratios = self.context_ratios if p == 0 and d >= 2 and self.context_ratios else [None]
                    if p or d:
                        shapes += [StepShape(p, 1 if p else 0, d, c, r) for r in ratios]
        return shapes

    def split_shapes(self) -> list[StepShape]:
        """Pure prefill steps of the same tokens over 1, 2, 4, ... sequences (1: a grid row too)."""
        return [StepShape(p, k, 0, 0) for p in self.split_prefill_tokens for k in self.split_counts]


def fit_prefill_pair_s(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(prefill tokens, attention pairs, seconds) of the split rows -> (seconds per pair to use, the
    fitted slope, its standard error). The slope is the within-group least-squares fit (one
    intercept per prefill-token count); it is used only when positive and at least twice its
    standard error: on an engine whose prefill steps are bound by host launch overhead the
    attention cost hides under it, and a slope fitted to noise would misprice other layouts."""
    groups: dict[int, list[tuple[int, float]]] = {}
    for p, pairs, t in points:
        groups.setdefault(p, []).append((pairs, t))
    centred = []
    for rows in groups.values():
        mx = sum(x for x, _ in rows) / len(rows)
        my = sum(y for _, y in rows) / len(rows)
        centred += [(x - mx, y - my) for x, y in rows]
    return _slope_through_origin(centred, len(groups))


def fit_prefill_tile_s(points: list[tuple[int, int, float]], schedule: PrefillSchedule) -> tuple[float, float, float]:
    """(prefill tokens, sequences, seconds) of the split rows -> (seconds per critical-path key
    tile to use, the fitted slope, its standard error): least squares through the origin of each
    row's time minus its one-sequence row's against the makespan difference; used under the same
    rule as `fit_prefill_pair_s`."""
    single = {p: t for p, k, t in points if k == 1}
    diffs = [(schedule.makespan(tuple((q, 0) for q in split_tokens(p, k))) - schedule.single(p), t - single[p])
             for p, k, t in points if k > 1 and p in single]
    return _slope_through_origin(diffs, 0)


def _slope_through_origin(points: list[tuple[float, float]], intercepts: int) -> tuple[float, float, float]:
    """(slope to use, least-squares slope through the origin of `points`, its standard error), the
    points' fit having spent `intercepts` more degrees of freedom; the slope is used only when
    positive and at least twice its standard error, else 0."""
    sxx = sum(x * x for x, _ in points)
    if sxx <= 0:
        return 0.0, 0.0, math.inf
    slope = sum(x * y for x, y in points) / sxx
    dof = len(points) - intercepts - 1
    sse = sum((y - slope * x) ** 2 for x, y in points)
    se = math.sqrt(sse / dof / sxx) if dof > 0 else math.inf
    return (slope if slope > 0 and slope >= 2 * se else 0.0), slope, se


def write_profile(path: str | Path, meta: Mapping[str, Any], rows: list[Mapping[str, Any]]) -> Path:
    """`# key: value` metadata lines, then the v1 columns plus `EXTRA_COLUMNS`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        for key, value in meta.items():
            text = str(value).replace("\n", " ")
            f.write(f"# {key}: {text}\n")
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *EXTRA_COLUMNS], lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k)) for k in writer.fieldnames})
    return path


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6e}"
    return str(v)
