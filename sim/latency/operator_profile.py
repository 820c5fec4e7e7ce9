"""An operator profile: the rows of one GPU type's and dtype's operator files (their format:
operator_file.py), found by name in a directory (`find_operator_files`), and each operator's time
as an `OpGrid` (sim/latency/op_grid.py).

Each operator's rows must cover every combination of its axes' distinct values (repeats: the
median), except the GEMMs' (`gemm` and the sequence-parallel boundaries', `GEMM_OPS`), whose
unmeasured cells (the grid skips the largest products) are filled from the measured ones
(`_fill_gemm`: the last segment in m extrapolated, else a least-squares fit of time on weight
bytes, activation bytes and FLOPs; never above the fastest measured FLOP rate).
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import numpy as np

from sim.latency.op_grid import Axis, OpGrid
from sim.latency.operator_file import GEMM_OPS, OP_AXES, PER_WORLD_SIZE, ZERO_ALLOWED, read_operator_file

# Operators interpolated in log space (sizes and times: a power law between points), the others
# multilinearly in the sizes (sim/latency/op_grid.py): prefill attention grows with its tokens
# squared and its tokens times its prefix.
LOG_OPS = ("prefill_attention",)
LOG_AXES = ("m", "context")

# An operator's grid: (op, world_size); world_size is 1 except for collectives.
GridKey = tuple[str, int]


def _axis_values(row: Mapping[str, float], axes: tuple[str, ...]) -> tuple[float, ...]:
    return tuple(row["num_heads"] / row["num_kv_heads"] if a == "group" else row[a] for a in axes)


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
            if op not in GEMM_OPS:
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
        if op in GEMM_OPS:
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
