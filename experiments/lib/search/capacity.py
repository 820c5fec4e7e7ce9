"""The highest request rate a deployment sustains: expand, then bisect, in a bounded number of
simulations (as Vidur-Search's binary search on QPS)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class RateProbe:
    rate: float
    met: bool
    metrics: dict = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Capacity:
    rate: float  # the highest rate tried that met the SLOs (0: none did)
    upper: float | None  # the lowest rate tried that failed (None: none failed)
    probes: list[RateProbe]


def max_sustained_rate(probe: Callable[[float], RateProbe], start: float, max_iterations: int,
                       rtol: float, growth: float = 4.0) -> Capacity:
    """Multiplies the rate from `start` by `growth` while `probe` meets the SLOs, then bisects the bracket
    [highest met, lowest failed] until it is `rtol` narrow relative to its top or `max_iterations`
    probes ran. A capacity is assumed monotone in the rate (more load, worse latency)."""
    if not start > 0:
        raise ValueError(f"search.rate.start_per_replica gives a start rate of {start!r}: must be > 0")
    if max_iterations < 1:
        raise ValueError(f"search.rate.max_iterations={max_iterations!r} is invalid: must be >= 1")
    if not 0 < rtol < 1:
        raise ValueError(f"search.rate.rtol={rtol!r} is invalid: must be in (0, 1)")
    if not growth > 1:
        raise ValueError(f"search.rate.growth={growth!r} is invalid: must be > 1")
    lo, hi = 0.0, None
    rate = start
    probes: list[RateProbe] = []
    while len(probes) < max_iterations:
        p = probe(rate)
        probes.append(p)
        if p.met:
            lo = rate
        else:
            hi = rate
        if hi is None:
            rate = growth * rate
        elif hi - lo <= rtol * hi:
            break
        else:
            rate = (lo + hi) / 2
    return Capacity(lo, hi, probes)
