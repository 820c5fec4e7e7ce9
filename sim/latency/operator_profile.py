"""Operator profile files (`experiments/profiles/operators/<gpu>-<dtype>-<part>.csv`): schema,
reading with validation, writing, and each operator's time as an `OpGrid`.

Format (v1): leading `# key: value` lines (metadata), then a CSV header and one row per timing:

    op,m,k,n,num_heads,num_kv_heads,head_dim,context,bytes,world_size,time_s

Metadata keys: `format` (`servelab operator profile v1`), `gpu` (the conf/hardware name the file
is for), `device` (the GPU's name), `dtype`, `kernels` (the decode kernel the attention rows ran,
or `collectives`), `versions` (torch, triton, CUDA), `date`, `command`, `time_unit` (`s`), and
`grid` (JSON: the operator grid the rows were measured on; each list strictly increasing).

Rows, by `op` (its axes in brackets; unused columns empty; sizes are integers >= 1 except
`context`, >= 0; `time_s` is seconds, > 0):
- `gemm` [m, k, n]: x[m, k] @ W[k, n] in the engine's dtype (torch.nn.functional.linear).
- `decode_attention` [head_dim, num_kv_heads, group, m, context]: the paged decode kernel over m
  sequences of `context` tokens each (block tables as wide as the engine's graphs hold them), `group` = num_heads / num_kv_heads query heads per KV head.
- `prefill_attention` [same axes]: the paged prefill kernel, one sequence of m new tokens after a
  prefix of `context` cached tokens.
- `qk_rope_write` [head_dim, num_kv_heads, group, m]: q/k RMSNorm + RoPE + KV cache write of m tokens.
- `rms_norm`, `add_rms_norm`, `embedding` [m, n]: m tokens of width n (the hidden size);
  `silu_and_mul` [m, n]: n = its output width (the MLP's intermediate size); `sampler` [m, n]:
  m rows over a vocabulary of n.
- `copy_blocks`, `swap_out`, `swap_in` [bytes]: KV blocks copied on the GPU / to / from pinned
  host memory, `bytes` moved one way.
- `graph_launch` [m]: wall time of launching a CUDA graph of m kernels and waiting for it.
- `all_reduce`, `all_gather` [bytes] per `world_size` (>= 2): `bytes` of the result on each rank
  (NCCL; gloo on the CPU). `all_reduce_one_shot`, `all_reduce_two_shot` [bytes] per `world_size`:
  the engine's symmetric-memory all-reduce paths, where the GPUs had them (`ALL_REDUCE_PATH_OPS`).

Each operator's rows must cover every combination of its axes' distinct values (repeats: the
median), except `gemm`, whose unmeasured cells (the grid skips the largest products) are filled
from the measured ones (`_fill_gemm`: the last segment in m extrapolated, else a least-squares fit
of time on weight bytes, activation bytes and FLOPs; never above the fastest measured FLOP rate).
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise, product
from pathlib import Path

import numpy as np

from sim.latency.op_grid import Axis, OpGrid

FORMAT = "servelab operator profile v1"
COLUMNS = ("op", "m", "k", "n", "num_heads", "num_kv_heads", "head_dim", "context", "bytes", "world_size", "time_s")
ATTENTION_AXES = ("head_dim", "num_kv_heads", "group", "m", "context")
OP_AXES: dict[str, tuple[str, ...]] = {
    "gemm": ("m", "k", "n"),
    "decode_attention": ATTENTION_AXES,
    "prefill_attention": ATTENTION_AXES,
    "qk_rope_write": ("head_dim", "num_kv_heads", "group", "m"),
    "rms_norm": ("m", "n"),
    "add_rms_norm": ("m", "n"),
    "silu_and_mul": ("m", "n"),
    "embedding": ("m", "n"),
    "sampler": ("m", "n"),
    "copy_blocks": ("bytes",),
    "swap_out": ("bytes",),
    "swap_in": ("bytes",),
    "graph_launch": ("m",),
    "all_reduce": ("bytes",),
    "all_gather": ("bytes",),
    "all_reduce_one_shot": ("bytes",),
    "all_reduce_two_shot": ("bytes",),
}
COLLECTIVES = ("all_reduce", "all_gather")  # NCCL's: every collectives file has them
SYMMETRIC_ALL_REDUCES = ("all_reduce_one_shot", "all_reduce_two_shot")  # where symmetric memory was available
PER_WORLD_SIZE = COLLECTIVES + SYMMETRIC_ALL_REDUCES  # ops timed per world size
# The engine's all-reduce paths (engine/distributed/all_reduce_path.py: ONE_SHOT, TWO_SHOT, NCCL)
# and the op whose rows time each.
ALL_REDUCE_PATH_OPS = {"one-shot": "all_reduce_one_shot", "two-shot": "all_reduce_two_shot", "nccl": "all_reduce"}
REQUIRED_META = ("format", "gpu", "device", "dtype", "kernels", "versions", "date", "time_unit", "grid")
ZERO_ALLOWED = ("context",)  # axes whose size may be 0
# Operators interpolated in log space (sizes and times: a power law between points), the others
# multilinearly in the sizes (sim/latency/op_grid.py): prefill attention grows with its tokens
# squared and its tokens times its prefix.
LOG_OPS = ("prefill_attention",)
LOG_AXES = ("m", "context")
MAX_TIME_S = 60.0  # one operator call; anything longer is a unit mistake (ms written as s)

# An operator's grid: (op, world_size); world_size is 1 except for collectives.
GridKey = tuple[str, int]


def _axis_values(row: Mapping[str, float], axes: tuple[str, ...]) -> tuple[float, ...]:
    return tuple(row["num_heads"] / row["num_kv_heads"] if a == "group" else row[a] for a in axes)


def _parse_row(path: Path, line: int, raw: Mapping[str, str]) -> dict[str, float]:
    op = raw.get("op", "")
    if op not in OP_AXES:
        raise ValueError(f"{path}:{line}: op={op!r} is invalid: one of {sorted(OP_AXES)}")
    needed = {"group": ("num_heads", "num_kv_heads")}
    columns = [c for a in OP_AXES[op] for c in needed.get(a, (a,))]
    if op in PER_WORLD_SIZE:
        columns.append("world_size")
    row: dict[str, float] = {"world_size": 1}
    for col in [*columns, "time_s"]:
        text = (raw.get(col) or "").strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{path}:{line}: {col}={text!r} is invalid for op={op}: a number is needed") from None
        if col == "time_s":
            if not (0 < value < MAX_TIME_S) or not math.isfinite(value):
                raise ValueError(f"{path}:{line}: time_s={text} is invalid: seconds, > 0 and < {MAX_TIME_S}")
        elif value != int(value) or value < (0 if col in ZERO_ALLOWED else 1):
            low = 0 if col in ZERO_ALLOWED else 1
            raise ValueError(f"{path}:{line}: {col}={text} is invalid for op={op}: an integer >= {low}")
        row[col] = value
    if op in PER_WORLD_SIZE and row["world_size"] < 2:
        raise ValueError(f"{path}:{line}: world_size={row['world_size']:.0f} is invalid for op={op}: must be >= 2")
    if "num_heads" in row and row["num_heads"] % row["num_kv_heads"]:
        raise ValueError(f"{path}:{line}: num_heads={row['num_heads']:.0f} is invalid: must be a multiple of "
                         f"num_kv_heads={row['num_kv_heads']:.0f}")
    return row


def read_operator_file(path: str | Path) -> tuple[dict[str, str], list[tuple[str, dict[str, float]]]]:
    """(metadata, [(op, parsed row)]); raises ValueError naming the file, line and field."""
    path = Path(path)
    meta: dict[str, str] = {}
    lines = path.read_text().splitlines()
    body_start = 0
    for body_start, text in enumerate(lines):  # noqa: B007 (read after the loop)
        if not text.startswith("#"):
            break
        key, sep, value = text[1:].partition(":")
        if sep:
            meta[key.strip()] = value.strip()
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"{path}: metadata {missing} missing: an operator profile carries {list(REQUIRED_META)}")
    if meta["format"] != FORMAT:
        raise ValueError(f"{path}: format={meta['format']!r} is invalid: expected {FORMAT!r}")
    if meta["time_unit"] != "s":
        raise ValueError(f"{path}: time_unit={meta['time_unit']!r} is invalid: times are written in seconds ('s')")
    try:
        grid = json.loads(meta["grid"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: metadata grid is not JSON ({e})") from None
    for key, values in _grid_lists(grid):
        if any(b <= a for a, b in pairwise(values)):
            raise ValueError(f"{path}: grid.{key}={values} is invalid: must be strictly increasing")
    reader = csv.DictReader(lines[body_start:])
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise ValueError(f"{path}: columns {reader.fieldnames} are invalid: expected {list(COLUMNS)}")
    rows = [(raw["op"], _parse_row(path, body_start + 2 + i, raw)) for i, raw in enumerate(reader)]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return meta, rows


def _grid_lists(grid: object, prefix: str = "") -> Iterable[tuple[str, list]]:
    """Every list of numbers in the grid JSON, with its dotted key."""
    if isinstance(grid, dict):
        for k, v in grid.items():
            yield from _grid_lists(v, f"{prefix}{k}.")
    elif isinstance(grid, list) and grid and all(isinstance(x, (int, float)) for x in grid):
        yield prefix.rstrip("."), grid


def write_operator_file(path: str | Path, meta: Mapping[str, object],
                        rows: Iterable[Mapping[str, float | str]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        for key, value in {"format": FORMAT, "time_unit": "s", **meta}.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c)) for c in COLUMNS})
    return path


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6e}" if not value.is_integer() or value < 1e-3 else str(int(value))
    return str(value)


@dataclass(slots=True)
class OperatorProfile:
    """The rows of one or more operator files (one GPU type and dtype), by operator and world size."""

    paths: list[Path]
    meta: list[dict[str, str]]
    points: dict[GridKey, dict[tuple[float, ...], list[float]]] = field(default_factory=dict)
    origins: dict[GridKey, list[str]] = field(default_factory=dict)  # the file names each grid's rows came from

    @classmethod
    def load(cls, paths: Iterable[str | Path]) -> OperatorProfile:
        profile = cls([], [])
        for path in paths:
            meta, rows = read_operator_file(path)
            profile.paths.append(Path(path))
            profile.meta.append(meta)
            for op, row in rows:
                key = (op, int(row["world_size"]))
                names = profile.origins.setdefault(key, [])
                if Path(path).name not in names:
                    if names:
                        raise ValueError(profile._overlap(op, key[1], names[0], Path(path).name))
                    names.append(Path(path).name)
                profile.points.setdefault(key, {}).setdefault(_axis_values(row, OP_AXES[op]), []).append(
                    row["time_s"])
        for (op, ws), pts in profile.points.items():
            if op != "gemm":
                profile._check_full(op, ws, pts)
        return profile

    @staticmethod
    def _overlap(op: str, world_size: int, first: str, second: str) -> str:
        """Two files of one GPU type and dtype time the same operator: which to price from would be
        a silent choice (their medians mixed), so the files are refused, naming both."""
        where = f" at world_size={world_size}" if op in PER_WORLD_SIZE else ""
        return (f"operator files {first} and {second} both hold op={op}{where}: keep one file per operator "
                "and world size in the directory (a retaken collectives file replaces the one it retakes)")

    def has(self, op: str, world_size: int = 1) -> bool:
        return (op, world_size) in self.points

    def files(self, op: str, world_size: int = 1) -> list[str]:
        """The names of the files that hold the operator's rows."""
        return self.origins.get((op, world_size), [])

    def world_sizes(self, op: str) -> list[int]:
        return sorted(ws for o, ws in self.points if o == op)

    def _check_full(self, op: str, world_size: int, pts: dict[tuple[float, ...], list[float]]) -> None:
        axes = OP_AXES[op]
        values = [sorted({p[i] for p in pts}) for i in range(len(axes))]
        for combo in product(*values):
            if combo not in pts:
                shown = ", ".join(f"{a}={v:g}" for a, v in zip(axes, combo, strict=True))
                where = f" world_size={world_size}" if op in PER_WORLD_SIZE else ""
                raise ValueError(f"operator profile {[str(p) for p in self.paths]}: op={op}{where} lacks the grid "
                                 f"point {shown}: its rows must cover every combination of {list(axes)}")

    def grid(self, op: str, world_size: int = 1) -> OpGrid:
        """The operator's times as an OpGrid over OP_AXES[op]."""
        key = (op, world_size)
        if key not in self.points:
            raise KeyError(key)
        axes_names = OP_AXES[op]
        pts = {k: statistics.median(v) for k, v in self.points[key].items()}
        values = [sorted({p[i] for p in pts}) for i in range(len(axes_names))]
        log = op in LOG_OPS
        axes = tuple(Axis(a, tuple(v), log and a in LOG_AXES, 1.0 if a in ZERO_ALLOWED else 0.0)
                     for a, v in zip(axes_names, values, strict=True))
        shape = tuple(len(v) for v in values)
        if op == "gemm":
            pts = _fill_gemm(pts, values)
        times = np.empty(shape)
        for idx in product(*(range(n) for n in shape)):
            times[idx] = pts[tuple(values[i][j] for i, j in enumerate(idx))]
        return OpGrid.of_times(axes, times, log_values=log)


def gemm_features(m: float, k: float, n: float) -> list[float]:
    """What a GEMM's time is linear in across regimes: a constant, weight elements, activation
    elements, multiply-adds."""
    return [1.0, k * n, m * (k + n), m * k * n]


def _fill_gemm(pts: dict[tuple[float, ...], float], values: list[list[float]]) -> dict[tuple[float, ...], float]:
    """Every (m, k, n) of the full grid: the measured median, else an estimate from the measured ones.

    The grid skips a (k, n)'s largest m (over `gemm_max_flops`), where the GEMM is compute-bound
    and its time grows linearly in m: such a cell extrapolates the last segment in m of its (k, n)'s
    measured rows. A (k, n) with fewer than two measured m (its weight over `gemm_max_weight_bytes`)
    takes a non-negative least-squares fit over all measured cells (relative least squares,
    coefficients clipped at 0), at least the fastest measured time and no faster than the fastest
    FLOP rate any measured GEMM reached: the fit, dominated by the many small cells, otherwise
    prices the largest products above the GPU's peak."""
    missing = [c for c in product(*values) if c not in pts]
    if not missing:
        return pts
    keys = list(pts)
    x = np.array([gemm_features(*c) for c in keys])
    y = np.array([pts[c] for c in keys])
    scale = x.max(axis=0)
    # Relative errors: each row divided by its time, so that microsecond GEMMs count as much as
    # millisecond ones.
    coef, *_ = np.linalg.lstsq(x / scale / y[:, None], np.ones_like(y), rcond=None)
    coef = np.clip(coef, 0.0, None) / scale
    floor = float(y.min())
    peak_flops = max(2.0 * m * k * n / t for (m, k, n), t in pts.items())
    by_weight: dict[tuple[float, float], list[float]] = {}
    for m, k, n in keys:
        by_weight.setdefault((k, n), []).append(m)
    filled = dict(pts)
    for m, k, n in missing:
        measured = sorted(by_weight.get((k, n), []))
        below = [mm for mm in measured if mm < m]
        if len(below) >= 2:
            m1, m2 = below[-2:]
            t1, t2 = pts[(m1, k, n)], pts[(m2, k, n)]
            filled[(m, k, n)] = t2 + (m - m2) * max(t2 - t1, 0.0) / (m2 - m1)
        else:
            fit = float(np.dot(gemm_features(m, k, n), coef))
            filled[(m, k, n)] = max(fit, floor, 2.0 * m * k * n / peak_flops)
    return filled


def find_operator_files(directory: str | Path, gpu: str, dtype: str, kernels: str = "auto") -> list[Path]:
    """The files of one GPU type and dtype in `directory`: its compute file (`<gpu>-<dtype>-<kernels>.csv`;
    "auto": the only one) and every collectives file (`<gpu>-<dtype>-collectives-n*.csv`). Raises
    ValueError naming the `latency` field at fault and what exists."""
    directory = Path(directory)
    everything = sorted(directory.glob("*.csv"))
    available = sorted({p.stem.rsplit("-", 1)[0] for p in everything if "-collectives-" not in p.stem})
    prefix = f"{gpu}-{dtype}-"
    mine = [p for p in everything if p.name.startswith(prefix)]
    compute = [p for p in mine if "-collectives-" not in p.stem]
    if not compute:
        gpus = {a.rsplit("-", 1)[0] for a in available}  # <gpu>-<dtype>: a dtype has no dash
        field_ = "latency.gpu" if gpu not in gpus else "latency.dtype"
        value = gpu if field_ == "latency.gpu" else dtype
        raise ValueError(f"{field_}={value!r} is invalid: no operator profile {prefix}*.csv in {directory}; profiled "
                         f"<gpu>-<dtype>: {available or 'none'} (take one: python -m experiments.profile "
                         "mode=operators on that GPU)")
    if kernels != "auto":
        compute = [p for p in compute if p.stem == f"{prefix}{kernels}"]
        if not compute:
            raise ValueError(f"latency.kernels={kernels!r} is invalid for {gpu}/{dtype}: profiled kernel sets "
                             f"{[p.stem[len(prefix):] for p in mine if '-collectives-' not in p.stem]}")
    elif len(compute) > 1:
        raise ValueError(f"latency.kernels='auto' is ambiguous for {gpu}/{dtype}: pick one of "
                         f"{[p.stem[len(prefix):] for p in compute]}")
    return compute + [p for p in mine if "-collectives-" in p.stem]
