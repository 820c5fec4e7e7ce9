"""A measured time over a regular grid of sizes, interpolated multilinearly per axis.

Most operators' times are affine in each of their sizes over a range (bytes or FLOPs: a GEMM's
in m, k and n; decode attention's in batch x context), and multilinear interpolation in the sizes
themselves is exact for such a function (and for products of them); below an axis's smallest point
the time is that point's (small operators are launch-bound), above its largest it is extrapolated
from the last segment. An axis can instead be taken in log space, and the times too
(`log_values`): a power law between points, for an operator quadratic in a size (prefill
attention in its tokens), extrapolated on both sides; an axis whose size can be 0 (a prefix) as
log(1 + x).

`fix` interpolates one axis away, so a latency model fixes a model's shape once (its hidden size,
heads, ...) and prices each step on a 1- or 2-axis grid of what the step varies (tokens, context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.latency.step_grid import segment


@dataclass(frozen=True, slots=True)
class Axis:
    name: str
    points: tuple[float, ...]  # the measured sizes, strictly increasing
    log: bool = False
    offset: float = 0.0  # log axes: 1.0 where the size can be 0 (log1p)

    def coord(self, x: float) -> float:
        if not self.log:
            return float(x)
        if x + self.offset <= 0:
            raise ValueError(f"{self.name}={x!r} is invalid: must be > {-self.offset}")
        return math.log(x + self.offset)

    def weights(self, x: float) -> tuple[int, float]:
        """Index i and weight w of x between points i and i + 1 (w > 1: extrapolated; a linear
        axis holds its first point's value below it)."""
        i, w = segment([self.coord(p) for p in self.points], self.coord(x))
        return (i, max(w, 0.0)) if not self.log and i == 0 else (i, w)


@dataclass(frozen=True, slots=True)
class OpGrid:
    """Times on the grid `axes` (array of shape [len(points) of each axis]), stored as log(time)
    when `log_values`."""

    axes: tuple[Axis, ...]
    values: np.ndarray
    log_values: bool = False

    def __post_init__(self) -> None:
        shape = tuple(len(a.points) for a in self.axes)
        if self.values.shape != shape:
            raise ValueError(f"values shape {self.values.shape} does not match the axes {shape}")

    @classmethod
    def of_times(cls, axes: tuple[Axis, ...], times: np.ndarray, log_values: bool = False) -> OpGrid:
        return cls(axes, np.log(times) if log_values else times, log_values)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def min_time(self) -> float:
        low = float(self.values.min())
        return math.exp(low) if self.log_values else low

    def fix(self, name: str, value: float) -> OpGrid:
        """The grid over the other axes at `name` = value."""
        k = self.names.index(name)
        axis = self.axes[k]
        values = np.moveaxis(self.values, k, 0)
        if len(axis.points) == 1:
            sliced = values[0]
        else:
            i, w = axis.weights(value)
            sliced = (1 - w) * values[i] + w * values[i + 1]
        return OpGrid(self.axes[:k] + self.axes[k + 1:], sliced, self.log_values)

    def fixed(self, **values: float) -> OpGrid:
        grid = self
        for name, value in values.items():
            grid = grid.fix(name, value)
        return grid

    def _time(self, v: float) -> float:
        return math.exp(v) if self.log_values else max(v, 0.0)

    def __call__(self, *xs: float) -> float:
        """Seconds at the sizes `xs`, one per remaining axis in order."""
        if len(xs) != len(self.axes):
            raise ValueError(f"expected {len(self.axes)} sizes ({', '.join(self.names)}), got {len(xs)}")
        if len(xs) == 1:  # the per-step path: plain Python
            t = self.values
            if len(t) == 1:
                return self._time(float(t[0]))
            i, w = self.axes[0].weights(xs[0])
            return self._time((1 - w) * float(t[i]) + w * float(t[i + 1]))
        grid = self
        for axis, x in zip(self.axes, xs, strict=True):
            grid = grid.fix(axis.name, x)
        return self._time(float(grid.values))
