"""The highest request rate a deployment sustains: expand, then bisect, in a bounded number of
simulations (as Vidur-Search's binary search on QPS)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class RateProbe:
    rate: float  # the rate run: the one asked for, or less where the workload can offer no more
    met: bool
    metrics: dict = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)
    reason: str = ""  # why it missed, with the figures ("TTFT p90 2.41 s > 2 s"); empty when met


@dataclass(slots=True)
class Capacity:
    rate: float  # the highest rate tried that met the SLOs (0: none did)
    upper: float | None  # the lowest rate tried that failed (None: none failed)
    probes: list[RateProbe]
    # The most the probe could offer, where a run there met the SLOs and the search stopped (the
    # capacity is then at least that rate); None when the search never reached such a limit.
    limit: float | None = None


def bracket_width(lo, hi):
    """How wide the bracket [lo met, hi failed) is relative to its top: the bisection stops at
    `rtol`. Numbers or pandas Series alike."""
    return (hi - lo) / hi


def max_sustained_rate(probe: Callable[[float], RateProbe], start: float, max_iterations: int,
                       rtol: float, growth: float = 4.0) -> Capacity:
    """Multiplies the rate from `start` by `growth` while `probe` meets the SLOs, then bisects the bracket
    [highest met, lowest failed] until it is `rtol` narrow relative to its top or `max_iterations`
    probes ran. A capacity is assumed monotone in the rate (more load, worse latency). A probe may
    run a lower rate than asked (the most its workload offers, `RateProbe.rate`): met there, the
    search stops with that rate as the capacity's lower bound (`Capacity.limit`)."""
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
            lo = p.rate
            if p.rate < rate:
                return Capacity(lo, hi, probes, p.rate)
        else:
            hi = p.rate
        if hi is None:
            rate = growth * rate
        elif bracket_width(lo, hi) <= rtol:
            break
        else:
            rate = (lo + hi) / 2
    return Capacity(lo, hi, probes)
