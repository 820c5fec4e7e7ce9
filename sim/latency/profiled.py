"""Latency model interpolated from a measured profile (`experiments/profiles/<gpu>-<model>.csv`).

Profile schema (v1). A CSV file whose leading `# key: value` comment lines carry metadata:
`model` (conf/model name, checked against the run), `block_size` (of the swap rows), `device`,
and free-form `dtype`, `versions`, `date`, `command`. Then a header and one row per measurement:

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
import statistics
from bisect import bisect_right
from collections.abc import Iterable
from pathlib import Path

from policies.outputs import SchedulerOutput
from sim.latency.base import BatchShape, LatencyModel, shape_decode_times
from sim.latency.prefill_schedule import PrefillSchedule
from sim.latency.token_padding import padded, per_token_cost

COLUMNS = ("kind", "num_prefill_tokens", "num_decode_seqs", "num_context_tokens", "num_blocks", "time_s")
STEP_FIELDS = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens")
RATIO_COLUMN = "context_ratio"  # optional: longest decode context / mean (the batch-shape axis)
ANY_RATIO = -1.0  # a row that stands for every ratio
# The ratio a step is priced at when its longest context is not given: the profiler's batches
# without the axis spread from 1/4 to 7/4 of the mean (experiments/lib/profiling/synthetic.py).
UNKNOWN_RATIO = 1.75


def read_profile(path: str | Path) -> tuple[dict[str, str], list[tuple[int, dict[str, str]]]]:
    """Metadata dict and (line number, row) pairs; raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"latency profile {str(path)!r} does not exist")
    meta: dict[str, str] = {}
    lines = path.read_text().splitlines()
    body_start = 0
    for i, line in enumerate(lines):
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep:
                meta[key.strip()] = value.strip()
            body_start = i + 1
        elif line.strip():
            break
        else:
            body_start = i + 1
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


def _number(path: Path, line: int, row: dict[str, str], name: str, integer: bool) -> float:
    raw = (row.get(name) or "").strip()
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{path}:{line}: field {name}={raw!r} is invalid: must be {kind} >= 0") from None
    if value < 0:
        raise ValueError(f"{path}:{line}: field {name}={raw!r} is invalid: must be >= 0")
    return value


def _meta_number(path: Path, meta: dict[str, str], key: str) -> float:
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


def _meta_sizes(path: Path, meta: dict[str, str], key: str) -> list[int]:
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


def _segment(axis: list[float], x: float) -> tuple[int, float]:
    """Index i and weight w with x = (1 - w) axis[i] + w axis[i + 1]; w outside [0, 1] extrapolates."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


class ProfiledModel(LatencyModel):
    name = "profiled"

    def __init__(self, path: str | Path, block_size: int, model_name: str | None = None,
                 async_scheduling: bool | None = None, tensor_parallel_size: int = 1) -> None:
        """`async_scheduling`: the runs' scheduler mode, checked against the profile's (a profile
        without the key was taken synchronously); `tensor_parallel_size`: the runs' GPUs per model,
        checked against the profile's `tensor_parallel_size` (1 when absent): a profile's step
        times are those of the size it was measured at."""
        path = Path(path)
        self.path = path
        self.meta, rows = read_profile(path)
        measured_tp = int(self.meta.get("tensor_parallel_size", 1))
        if measured_tp != tensor_parallel_size:
            raise ValueError(f"latency profile {str(path)!r} was measured with tensor_parallel_size={measured_tp}, "
                             f"not parallel.tensor_parallel_size={tensor_parallel_size}: profile at that size "
                             "(python -m experiments.profile tensor_parallel_size=N) or pick its profile")
        if model_name is not None and self.meta.get("model") not in (None, model_name):
            raise ValueError(f"latency profile {str(path)!r} was measured for model={self.meta['model']!r}, "
                             f"not model={model_name!r}: profile that model or pick its profile")
        mode = self.meta.get("async_scheduling", "false")  # "any": computed, not measured in one mode
        profiled_ahead = mode == "true"
        if async_scheduling is not None and mode != "any" and async_scheduling != profiled_ahead:
            raise ValueError(f"scheduler.async_scheduling={async_scheduling} is invalid with latency profile "
                             f"{str(path)!r}, measured with async_scheduling={profiled_ahead}: profile in the runs' "
                             "mode (python -m experiments.profile async_scheduling=...)")
        profile_bs = int(self.meta.get("block_size", block_size))
        self._block_scale = block_size / profile_bs
        points: dict[tuple[int, int, float, float], list[float]] = {}
        sync_points: dict[tuple[int, int, float, float], list[float]] = {}
        swaps: dict[int, list[float]] = {}
        for line, row in rows:
            kind = (row.get("kind") or "").strip()
            t = _number(path, line, row, "time_s", integer=False)
            if kind == "step":
                p, d, c = (int(_number(path, line, row, f, integer=True)) for f in STEP_FIELDS)
                if d == 0 and c != 0:
                    raise ValueError(f"{path}:{line}: field num_context_tokens={c} is invalid: "
                                     "must be 0 when num_decode_seqs is 0")
                ratio = ANY_RATIO
                if d > 1 and (row.get(RATIO_COLUMN) or "").strip():
                    ratio = round(_number(path, line, row, RATIO_COLUMN, integer=False), 6)
                    if ratio < 1:
                        raise ValueError(f"{path}:{line}: field {RATIO_COLUMN}={ratio} is invalid: must be >= 1 "
                                         "(the longest decode context over the mean)")
                key = (p, d, round(c / d, 6) if d else -1.0, ratio)
                points.setdefault(key, []).append(t)
                if (row.get("sync_time_s") or "").strip():
                    sync_points.setdefault(key, []).append(_number(path, line, row, "sync_time_s", integer=False))
            elif kind == "swap":
                n = int(_number(path, line, row, "num_blocks", integer=True))
                swaps.setdefault(n, []).append(t)
            else:
                raise ValueError(f"{path}:{line}: field kind={kind!r} is invalid: must be 'step' or 'swap'")
        if not points:
            raise ValueError(f"latency profile {str(path)!r} has no kind=step rows")
        if not swaps:
            raise ValueError(f"latency profile {str(path)!r} has no kind=swap rows")
        self.prefill_axis = sorted({k[0] for k in points})
        self.decode_axis = sorted({k[1] for k in points})
        self.context_axis = sorted({k[2] for k in points if k[1] > 0}) or [0.0]
        self.ratio_axis = sorted({k[3] for k in points if k[3] != ANY_RATIO}) or [ANY_RATIO]
        self.uses_longest_context = self.ratio_axis != [ANY_RATIO]
        self._grid = self._build_grid(path, points, "time_s")
        # Async profiles: each row also as the synchronous loop pays it, for steps not scheduled ahead.
        self._sync_grid = self._build_grid(path, sync_points, "sync_time_s") if sync_points else None
        self.prefill_pair_s = _meta_number(path, self.meta, "prefill_pair_s")
        self.prefill_tile_s = _meta_number(path, self.meta, "prefill_tile_s")
        self.prefill_schedule: PrefillSchedule | None = None
        if "prefill_schedule" in self.meta:
            try:
                self.prefill_schedule = PrefillSchedule.parse(self.meta["prefill_schedule"])
            except ValueError as exc:
                raise ValueError(f"{path}: metadata {exc}") from None
        self.graph_sizes = _meta_sizes(path, self.meta, "decode_graph_sizes")
        self.token_sizes = _meta_sizes(path, self.meta, "token_graph_sizes")
        self.pad_token_s = self._unpad(self._grid) if self.token_sizes else 0.0
        if self._sync_grid is not None and self.token_sizes:
            self._unpad(self._sync_grid)
        self.swap_axis = sorted(swaps)
        self._swap_times = [statistics.median(swaps[n]) for n in self.swap_axis]
        if len(self.swap_axis) == 1:  # one measurement: proportional through the origin
            self.swap_axis.insert(0, 0)
            self._swap_times.insert(0, 0.0)

    def _build_grid(self, path: Path, points: dict[tuple[int, int, float, float], list[float]],
                    column: str) -> list[list[list[list[float]]]]:
        """grid[prefill][decodes][context][ratio] (a row standing for every ratio fills its line)."""
        grid = []
        for p in self.prefill_axis:
            plane = []
            for d in self.decode_axis:
                line_ = []
                for ctx in self.context_axis:
                    ratios = []
                    for ratio in self.ratio_axis:
                        key = (p, d, ctx if d else -1.0, ratio)
                        key = key if key in points else (*key[:3], ANY_RATIO)
                        if key not in points:
                            shown = "" if ratio == ANY_RATIO else f", {RATIO_COLUMN}={ratio}"
                            raise ValueError(
                                f"latency profile {str(path)!r} lacks the grid point num_prefill_tokens={p}, "
                                f"num_decode_seqs={d}, num_context_tokens={round(ctx * d)}{shown} ({column}): step "
                                "rows must cover every combination of the distinct prefill, decode, "
                                "context-per-decode (and context-ratio) values")
                        ratios.append(statistics.median(points[key]))
                    line_.append(ratios)
                plane.append(line_)
            grid.append(plane)
        return grid

    def _unpad(self, grid: list[list[list[list[float]]]]) -> float:
        """Take each prefill row's padding cost out of `grid` (token_padding.py); returns the cost
        per padding row."""
        sizes = self.token_sizes
        if self.decode_axis[0] != 0:
            return 0.0
        aligned = [(p, grid[i][0][0][0]) for i, p in enumerate(self.prefill_axis) if p > 0 and p in sizes]
        cost = per_token_cost(aligned)
        for i, p in enumerate(self.prefill_axis):
            for j, d in enumerate(self.decode_axis):
                if p:
                    extra = cost * (padded(p + d, sizes) - p - d)
                    grid[i][j] = [[t - extra for t in ratios] for ratios in grid[i][j]]
        return cost

    def step_time(self, out: SchedulerOutput) -> float:
        if not out.scheduled:
            return 0.0
        return self.shape_time(BatchShape.of(out, longest=self.uses_longest_context),
                               sync=self._sync_grid is not None and not out.ahead)

    def decode_times(self, num_seqs: int, num_context_tokens: int, num_samples: int,
                     num_steps: int, max_context_tokens: int = 0) -> list[float]:
        return shape_decode_times(self.shape_time, num_seqs, num_context_tokens, num_samples, num_steps,
                                  max_context_tokens)

    def shape_time(self, b: BatchShape, sync: bool = False) -> float:
        """Step time of a batch that schedules something (`sync`: not scheduled ahead, priced from
        an async profile's sync_time_s)."""
        p, d = b.num_prefill_tokens, b.num_decode_seqs
        if p == 0 and self.graph_sizes:
            d = next((s for s in self.graph_sizes if s >= d), d)
        t = self.lookup(p, d, b.num_context_tokens, self._sync_grid if sync else None, b.max_context_tokens)
        if p and self.pad_token_s:
            t += self.pad_token_s * (padded(p + d, self.token_sizes) - p - d)
        if p and self.prefill_schedule is not None and self.prefill_tile_s and b.prefill_chunks:
            schedule = self.prefill_schedule
            t += self.prefill_tile_s * (schedule.makespan(b.prefill_chunks) - schedule.single(p))
        elif p and self.prefill_pair_s:
            t += self.prefill_pair_s * (b.prefill_attention_pairs - p * (p + 1) // 2)
        return max(t, 0.0)

    def lookup(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
               grid: list[list[list[list[float]]]] | None = None, max_context_tokens: int = 0) -> float:
        """Multilinear in (prefill tokens, decodes, context per decode, longest context / mean);
        `max_context_tokens` 0: the longest context is not known (UNKNOWN_RATIO)."""
        ctx = num_context_tokens / num_decode_seqs if num_decode_seqs else self.context_axis[0]
        ip, wp = _segment(self.prefill_axis, num_prefill_tokens)
        idd, wd = _segment(self.decode_axis, num_decode_seqs)
        ic, wc = _segment(self.context_axis, ctx)
        ratio = UNKNOWN_RATIO
        if max_context_tokens and num_context_tokens:
            ratio = max_context_tokens * num_decode_seqs / num_context_tokens
        ir, wr = _segment(self.ratio_axis, ratio)
        g = self._grid if grid is None else grid
        total = 0.0
        for a, fa in ((ip, 1 - wp), (ip + 1, wp)):
            if fa == 0:
                continue
            for b, fb in ((idd, 1 - wd), (idd + 1, wd)):
                if fb == 0:
                    continue
                for c, fc in ((ic, 1 - wc), (ic + 1, wc)):
                    if fc == 0:
                        continue
                    line_ = g[a][b][c]
                    for r, fr in ((ir, 1 - wr), (ir + 1, wr)):
                        if fr != 0:
                            total += fa * fb * fc * fr * line_[r]
        return max(total, 0.0)

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        x = num_blocks * self._block_scale
        i, w = _segment(self.swap_axis, x)
        ts = self._swap_times
        return max(ts[i] + w * (ts[i + 1] - ts[i]), 0.0)
