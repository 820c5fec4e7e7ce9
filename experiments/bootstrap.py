"""Paired bootstrap confidence intervals (numpy) for A/B comparisons on the same requests."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

Stat = Callable[..., np.ndarray]  # stat(values[resamples, n], axis=1) -> [resamples]

STATS: dict[str, Stat] = {
    "mean": np.mean,
    "p50": lambda x, axis: np.percentile(x, 50, axis=axis),
    "p90": lambda x, axis: np.percentile(x, 90, axis=axis),
    "p99": lambda x, axis: np.percentile(x, 99, axis=axis),
}


def paired_bootstrap(a: np.ndarray, b: np.ndarray, stat: str = "mean", resamples: int = 1000,
                     confidence: float = 0.95, seed: int = 0, chunk: int = 100) -> tuple[float, float, float]:
    """(stat(b) - stat(a), low, high): the confidence interval of the difference from resampling
    request pairs (the same rows of a and b) with replacement."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_bootstrap needs two equal-length non-empty 1-D arrays, got {a.shape} and {b.shape}")
    if stat not in STATS:
        raise ValueError(f"stat={stat!r} is unknown: choose one of {sorted(STATS)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} is invalid: must be in (0, 1)")
    fn = STATS[stat]
    point = float(fn(b[None, :], axis=1)[0] - fn(a[None, :], axis=1)[0])
    rng = np.random.default_rng(seed)
    diffs = []
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, a.size, size=(min(chunk, resamples - start), a.size))
        diffs.append(fn(b[idx], axis=1) - fn(a[idx], axis=1))
    d = np.concatenate(diffs)
    tail = (1 - confidence) / 2
    low, high = np.quantile(d, [tail, 1 - tail])
    return point, float(low), float(high)
