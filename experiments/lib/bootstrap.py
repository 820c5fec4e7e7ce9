"""Paired bootstrap confidence intervals (numpy) for A/B comparisons on the same requests, and the
combination of one comparison repeated in rounds."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


def excludes_zero(ab: Mapping[str, float]) -> bool:
    """Whether an A/B row's interval [ci_low, ci_high] excludes 0 (True when it has no interval)."""
    return not (ab.get("ci_low", math.nan) <= 0 <= ab.get("ci_high", math.nan))


def combine_rounds(rounds: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """One A/B metric ({a, b, diff, ci_low, ci_high}) measured in several rounds, round i's A and B run
    back to back: the means of a, b and diff. Significant only if every round's interval excludes 0,
    all rounds' differences share a sign, and the mean difference exceeds half the range of A's and
    of B's values over the rounds (the engine's own run-to-run noise). The per-request bootstrap of
    one round cannot see the host CPU's speed drift between runs: on the H200 VMs a 1-3% difference
    flipped sign between rounds with each round's interval excluding 0."""
    if len(rounds) == 1:
        return dict(rounds[0])
    a, b, diffs = ([r[k] for r in rounds] for k in ("a", "b", "diff"))
    diff = float(np.mean(diffs))
    agree = len({bool(np.sign(d) > 0) for d in diffs}) == 1 and all(diffs)
    noise = max(max(a) - min(a), max(b) - min(b)) / 2
    return {"a": float(np.mean(a)), "b": float(np.mean(b)), "diff": diff,
            "ci_low": min(r.get("ci_low", math.nan) for r in rounds),
            "ci_high": max(r.get("ci_high", math.nan) for r in rounds), "rounds": len(rounds),
            "significant": agree and abs(diff) > noise and all(map(excludes_zero, rounds))}
