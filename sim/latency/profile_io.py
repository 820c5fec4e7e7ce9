"""The latency profile file (`experiments/profiles/<gpu>-<model>.csv`) that sim/latency/profiled.py
prices steps from: its schema, reading, writing and row parsing.

Profile schema (v1). A CSV file whose leading `# key: value` comment lines carry metadata:
`model` (conf/model name, checked against the run), `block_size` (of the swap rows), `device`
(the GPU's name, checked against the run's hardware: file_meta.py `check_device`), and free-form
`dtype`, `versions`, `date`, `command`. Then a header and one row per measurement:

    kind,num_prefill_tokens,num_decode_seqs,num_context_tokens,num_blocks,time_s

- `kind=step`: one forward step with `num_prefill_tokens` prefill tokens (new tokens of chunks
  with more than one token; 0 for a pure decode step), `num_decode_seqs` one-token decodes and
  `num_context_tokens` = total KV entries those decodes read (sum of their context lengths,
  new token included; 0 when `num_decode_seqs` is 0). `time_s` = measured step time in seconds
  (forward + sampling + per-step host overhead). `num_blocks` is empty.
- `kind=swap`: moving `num_blocks` KV blocks one way over the host link; `time_s` in seconds.
  The other columns are empty.

Step rows must form a full grid over three axes: the distinct `num_prefill_tokens` values x
the distinct `num_decode_seqs` values x the distinct context-per-decode values
(`num_context_tokens / num_decode_seqs`); rows with `num_decode_seqs = 0` stand for every context
value. Repeated measurements of one grid point are reduced to their median. Step time is
multilinear in the three axes between grid points (exact at grid points, monotone where the
data is) and extrapolated linearly outside the grid; swap time is piecewise linear in the
number of blocks (scaled by block_size / profile block_size), also extrapolated linearly.
Prefill attention over an earlier-computed prefix is not an axis: chunked prefill is priced as
a prefill of its new tokens, unless the profile carries these optional metadata keys (written by
`experiments.profile`; readers that ignore them still get a valid, coarser model):
- `prefill_pair_s`: seconds per causal-attention (query, key) pair. The grid's prefill rows are one
  sequence of P new tokens with no prefix (P (P + 1) / 2 pairs); a step whose prefill chunks have
  a different layout (several prompts, a chunk over an earlier-computed prefix) is corrected by
  `prefill_pair_s * (its pairs - P (P + 1) / 2)`.
- `prefill_schedule` and `prefill_tile_s` (preferred to `prefill_pair_s` when both are present):
  the prefill kernel's program geometry (sim/latency/prefill_schedule.py) and the seconds per key
  tile on its critical path; a step's prefill layout is corrected by
  `prefill_tile_s * (makespan(its chunks) - makespan(one sequence of P tokens))`.  At engine sizes
  the kernel's time follows how its programs pack onto the SMs, not the pair count: several short
  prompts save less than their pairs say (the H200 offline benchmark's mixed steps, 3-7 prompts,
  came out 7% too fast with the pair correction).
- `async_scheduling`: `true` or `false` (absent: false), the scheduling mode the rows were measured
  in, which the runs must share; `any` for a profile computed rather than measured.
- column `sync_time_s` (optional, profiles with `async_scheduling: true`): each step row as the
  synchronous loop pays it; steps not scheduled ahead (`SchedulerOutput.ahead` false) are priced
  from it, the others from `time_s` (the period with the host's work overlapped).
- `admission_s` (optional, >= 0): seconds of host work per request the engine admits
  (`LLMEngine.add_request`); the serving loop admits every arrived request before its next step, so
  a burst of N requests delays that step by N x admission_s (the simulator's arrivals pay it).
- `token_graph_sizes`: the engine's CUDA-graph token sizes for steps with prefill tokens; each
  prefill row's padding to them is taken out before interpolating and the priced step's own added
  (sim/latency/token_padding.py).
- column `context_ratio` (optional; the batch-shape axis): a decode-only row's longest decode context
  over its mean (1: equal contexts). A program-per-sequence decode kernel (the Gluon `tma` one) on a
  batch of one wave of programs runs as long as its longest sequence, not its total. Rows that
  carry it form a fourth grid axis; a row without it (empty, or one decode) stands for every ratio
  of its (prefill, decodes, context) point, as rows with 0 decodes stand for every context. A step
  is priced at its own ratio (`BatchShape.max_context_tokens`; a step whose longest context is not
  given at UNKNOWN_RATIO, the spread of the profiler's batches without the axis). A profile without
  the column prices every step as before the axis.
- `decode_graph_sizes` (optional; `experiments.profile` no longer writes it, its decode rows being
  engine step periods at real batch sizes): the engine's CUDA-graph batch sizes; a decode-only step
  of D sequences runs the smallest size >= D (padding rows read no KV), so it is priced at that
  many decodes with the same total context.
"""
from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sim.latency.file_meta import read_meta, text_lines

COLUMNS = ("kind", "num_prefill_tokens", "num_decode_seqs", "num_context_tokens", "num_blocks", "time_s")
STEP_FIELDS = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens")
RATIO_COLUMN = "context_ratio"  # optional: longest decode context / mean (the batch-shape axis)
ANY_RATIO = -1.0  # a row that stands for every ratio
# A step row's grid point: (prefill tokens, decodes, context per decode or -1 with no decodes, ratio).
PointKey = tuple[int, int, float, float]


def read_profile(path: str | Path) -> tuple[dict[str, str], list[tuple[int, dict[str, str]]]]:
    """Metadata dict and (line number, row) pairs; raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"latency profile {str(path)!r} does not exist")
    lines = list(text_lines(path))
    meta, body_start = read_meta(lines)
    reader = csv.DictReader(lines[body_start:])
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}:{body_start + 1}: header lacks columns {missing}; expected {list(COLUMNS)}")
    rows = [(body_start + 2 + k, row) for k, row in enumerate(reader) if any(v for v in row.values())]
    return meta, rows


def write_profile(path: str | Path, meta: dict[str, object], steps: Iterable[tuple[int, int, int, float]],
                  swaps: Iterable[tuple[int, float]]) -> Path:
    """Write a profile in this schema: meta as `# key: value` lines (include model, block_size,
    device), steps as (num_prefill_tokens, num_decode_seqs, num_context_tokens, time_s), swaps as
    (num_blocks, time_s)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {key}: {value}" for key, value in meta.items()]
    lines.append(",".join(COLUMNS))
    lines += [f"step,{p},{d},{c},,{t:.9g}" for p, d, c, t in steps]
    lines += [f"swap,,,,{n},{t:.9g}" for n, t in swaps]
    path.write_text("\n".join(lines) + "\n")
    return path


def field_number(path: Path, line: int, row: dict[str, str], name: str, integer: bool) -> float:
    raw = (row.get(name) or "").strip()
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{path}:{line}: field {name}={raw!r} is invalid: must be {kind} >= 0") from None
    if value < 0:
        raise ValueError(f"{path}:{line}: field {name}={raw!r} is invalid: must be >= 0")
    return value


def meta_number(path: Path, meta: dict[str, str], key: str) -> float:
    raw = meta.get(key)
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{path}: metadata {key}={raw!r} is invalid: must be a number >= 0")
    return value


def meta_sizes(path: Path, meta: dict[str, str], key: str) -> list[int]:
    raw = meta.get(key)
    if raw is None:
        return []
    try:
        sizes = sorted(int(x) for x in raw.replace(",", " ").split())
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{path}: metadata {key}={raw!r} is invalid: must be positive integers")
    return sizes




@dataclass(slots=True)
class ProfileRows:
    """A profile's measurements by grid point: step `time_s`, step `sync_time_s` (async profiles)
    and swap times by block count, each a list of repeats."""

    steps: dict[PointKey, list[float]] = field(default_factory=dict)
    sync_steps: dict[PointKey, list[float]] = field(default_factory=dict)
    swaps: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, path: Path, rows: list[tuple[int, dict[str, str]]]) -> ProfileRows:
        """The rows of `read_profile`; raises ValueError naming the file, line, field and value."""
        parsed = cls()
        for line, row in rows:
            kind = (row.get("kind") or "").strip()
            t = field_number(path, line, row, "time_s", integer=False)
            if kind == "step":
                key = _point_key(path, line, row)
                parsed.steps.setdefault(key, []).append(t)
                if (row.get("sync_time_s") or "").strip():
                    parsed.sync_steps.setdefault(key, []).append(
                        field_number(path, line, row, "sync_time_s", integer=False))
            elif kind == "swap":
                n = int(field_number(path, line, row, "num_blocks", integer=True))
                parsed.swaps.setdefault(n, []).append(t)
            else:
                raise ValueError(f"{path}:{line}: field kind={kind!r} is invalid: must be 'step' or 'swap'")
        if not parsed.steps:
            raise ValueError(f"latency profile {str(path)!r} has no kind=step rows")
        if not parsed.swaps:
            raise ValueError(f"latency profile {str(path)!r} has no kind=swap rows")
        return parsed


def _point_key(path: Path, line: int, row: dict[str, str]) -> PointKey:
    p, d, c = (int(field_number(path, line, row, f, integer=True)) for f in STEP_FIELDS)
    if d == 0 and c != 0:
        raise ValueError(f"{path}:{line}: field num_context_tokens={c} is invalid: must be 0 when num_decode_seqs is 0")
    ratio = ANY_RATIO
    if d > 1 and (row.get(RATIO_COLUMN) or "").strip():
        ratio = round(field_number(path, line, row, RATIO_COLUMN, integer=False), 6)
        if ratio < 1:
            raise ValueError(f"{path}:{line}: field {RATIO_COLUMN}={ratio} is invalid: must be >= 1 "
                             "(the longest decode context over the mean)")
    return p, d, round(c / d, 6) if d else -1.0, ratio
