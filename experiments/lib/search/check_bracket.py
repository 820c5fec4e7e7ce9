"""A predicted capacity checked in a few runs: the SLOs at (1 - within) x predicted and (1 + within) x
predicted (met, then missed: the measured capacity is within `within` of the prediction), and when
not, up to `max_steps` more runs a `step` further out to bound the error. Few runs, where a full
bisection would take eight: each run on the engine is wall-clock time on a GPU."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from experiments.lib.search.capacity import RateProbe
from experiments.lib.search.check_pick import rank_key


@dataclass(slots=True)
class CheckedProbe:
    factor: float  # rate / predicted capacity
    probe: RateProbe
    wall_s: float = 0.0


@dataclass(slots=True)
class Bracket:
    predicted: float  # req/s, the search's capacity
    within: float
    probes: list[CheckedProbe] = field(default_factory=list)

    @property
    def low(self) -> float:
        """The highest rate run that met the SLOs (0: none did)."""
        return max((p.probe.rate for p in self.probes if p.probe.met), default=0.0)

    @property
    def high(self) -> float:
        """The lowest rate run above `low` that missed them (inf: none did)."""
        return min((p.probe.rate for p in self.probes if not p.probe.met and p.probe.rate > self.low), default=math.inf)

    @property
    def monotone(self) -> bool:
        """No run missed the SLOs below a rate that met them (noise near the capacity breaks this)."""
        return not any(not p.probe.met and p.probe.rate < self.low for p in self.probes)

    @property
    def is_within(self) -> bool:
        """Met at (1 - within) x predicted and missed at (1 + within) x predicted."""
        return (self.monotone and self.low >= (1 - self.within) * self.predicted * (1 - 1e-9)
                and self.high <= (1 + self.within) * self.predicted * (1 + 1e-9))

    def error_range(self) -> tuple[float, float]:
        """The measured capacity relative to the prediction: in [low, high) / predicted - 1."""
        return self.low / self.predicted - 1, self.high / self.predicted - 1

    def verdict(self) -> str:
        lo, hi = self.error_range()
        if not self.monotone:
            return "not monotone: a lower rate missed the SLOs (noise near the capacity)"
        if self.is_within:
            return f"within {self.within:.0%}"
        if math.isinf(hi):
            return f"engine above the prediction by >= {lo:+.0%}"
        if self.low == 0:
            return f"engine below the prediction by > {-hi:.0%}"
        return f"engine capacity {lo:+.0%} to {hi:+.0%} of the prediction"


def bracket_capacity(probe: Callable[[float], RateProbe], predicted: float, within: float = 0.1, step: float = 0.25,
                     max_steps: int = 1, clock: Callable[[], float] | None = None) -> Bracket:
    """Runs `probe` at (1 - within) x `predicted`; if met, at (1 + within) x; then, while the result
    stays on one side, up to `max_steps` runs `step` further out (fractions of `predicted`)."""
    if not predicted > 0 or math.isinf(predicted):
        raise ValueError(f"capacity_rps={predicted!r} is invalid for a check: must be a finite number > 0")
    if not 0 < within < 1:
        raise ValueError(f"--within={within!r} is invalid: must be in (0, 1)")
    if not 0 < step < 1:
        raise ValueError(f"--step={step!r} is invalid: must be in (0, 1)")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
        raise ValueError(f"--max-steps={max_steps!r} is invalid: must be an integer >= 0")
    if clock is None:
        from time import perf_counter as clock
    out = Bracket(predicted, within)

    def run(factor: float) -> bool:
        t0 = clock()
        p = probe(factor * predicted)
        out.probes.append(CheckedProbe(factor, p, clock() - t0))
        return p.met

    met = run(1 - within)
    if met:
        factor = 1 + within
        met = run(factor)
        for _ in range(max_steps):
            if not met:
                break
            factor += step
            met = run(factor)
    else:
        factor = 1 - within
        for _ in range(max_steps):
            if met or factor - step <= 0:
                break
            factor -= step
            met = run(factor)
    return out


def rank_order(pick: tuple[Bracket, float], neighbour: tuple[Bracket, float], target: float) -> str:
    """Whether the measured capacities keep the search's order of the pick before the neighbour
    (each given with its $/h): "kept" when it holds for every capacity in both brackets,
    "reversed" when the opposite does, else "undetermined" (the brackets overlap). A bracket is
    [low, high): a capacity is below a rate that missed the SLOs."""
    (bp, cost_p), (bn, cost_n) = pick, neighbour

    def below(rate: float) -> float:
        return math.nextafter(rate, 0.0)

    if rank_key(bp.low, cost_p, target) < rank_key(below(bn.high), cost_n, target):
        return "kept"
    if rank_key(bn.low, cost_n, target) < rank_key(below(bp.high), cost_p, target):
        return "reversed"
    return "undetermined"
