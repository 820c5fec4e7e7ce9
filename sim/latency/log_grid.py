"""A measured time over a regular grid of sizes, interpolated multilinearly in log space.

An operator's time is close to a power law of each of its sizes over a range (linear in bytes when
memory-bound, in FLOPs when compute-bound, flat when launch-bound), so both the sizes and the
time are interpolated as logarithms: exact at grid points, a power law between two of them, and
extrapolated from the last segment outside the grid. An axis whose size can be 0 (a prefix's
tokens) is taken as log(1 + x).

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
    offset: float = 0.0  # 1.0: the size can be 0 (log1p)

    @property
    def coords(self) -> list[float]:
        return [math.log(p + self.offset) for p in self.points]

    def weights(self, x: float) -> tuple[int, float]:
        """Index i and weight w of x between points i and i + 1 in log space (w outside [0, 1]: extrapolated)."""
        if x + self.offset <= 0:
            raise ValueError(f"{self.name}={x!r} is invalid: must be > {-self.offset}")
        return segment(self.coords, math.log(x + self.offset))


@dataclass(frozen=True, slots=True)
class LogGrid:
    """log(time_s) on the grid `axes` (array of shape [len(points) of each axis])."""

    axes: tuple[Axis, ...]
    log_times: np.ndarray

    def __post_init__(self) -> None:
        shape = tuple(len(a.points) for a in self.axes)
        if self.log_times.shape != shape:
            raise ValueError(f"log_times shape {self.log_times.shape} does not match the axes {shape}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def fix(self, name: str, value: float) -> LogGrid:
        """The grid over the other axes at `name` = value."""
        k = self.names.index(name)
        axis = self.axes[k]
        i, w = axis.weights(value)
        values = np.moveaxis(self.log_times, k, 0)
        sliced = values[0] if len(axis.points) == 1 else (1 - w) * values[i] + w * values[i + 1]
        return LogGrid(self.axes[:k] + self.axes[k + 1:], sliced)

    def fixed(self, **values: float) -> LogGrid:
        grid = self
        for name, value in values.items():
            grid = grid.fix(name, value)
        return grid

    def __call__(self, *xs: float) -> float:
        """Seconds at the sizes `xs`, one per remaining axis in order."""
        if len(xs) != len(self.axes):
            raise ValueError(f"expected {len(self.axes)} sizes ({', '.join(self.names)}), got {len(xs)}")
        if len(xs) == 1:  # the per-step path: plain Python
            i, w = self.axes[0].weights(xs[0])
            t = self.log_times
            return math.exp(t[0]) if len(t) == 1 else math.exp((1 - w) * t[i] + w * t[i + 1])
        grid = self
        for axis, x in zip(self.axes, xs, strict=True):
            grid = grid.fix(axis.name, x)
        return math.exp(float(grid.log_times))
