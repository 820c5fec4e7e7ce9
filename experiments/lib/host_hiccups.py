"""Host hiccups in an engine run: decode-only steps that took far longer than the decode steps
around them, which no latency model prices.

With async scheduling the host's work overlaps the GPU's, so a step's wall time is its GPU time
unless the host falls behind. On a device VM whose vCPUs are descheduled for milliseconds at a
time, the host does fall behind, in bursts: runs of decode steps of 3-20 ms among steps of 1.5-4 ms
at the same batch. A short-step model shows them in full, a long-step one hides them behind the
GPU's queued step. Consecutive decode-only steps change batch and context by a few entries, so the
centred median of `window` of them is what such a step takes; a step above it by more than
`min_excess_s` and by more than `min_excess_fraction` of it is a hiccup, and its excess is what the
host added. Steps with prefill are left out: their time follows the prompt lengths, which change
from step to step.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

WINDOW = 21  # decode-only steps in the centred median
MIN_EXCESS_S = 5e-4
MIN_EXCESS_FRACTION = 0.25


@dataclass(slots=True, frozen=True)
class Hiccups:
    """Decode-only steps flagged as hiccups, the seconds they took above their neighbours' median,
    and all decode-only steps' seconds."""

    steps: int
    excess_s: float
    decode_s: float

    @property
    def percent(self) -> float:
        return 100.0 * self.excess_s / self.decode_s if self.decode_s else 0.0


def decode_only(steps: pd.DataFrame) -> pd.Series:
    """Which rows of an engine run's steps table are decode-only steps."""
    return (steps["num_prefill_tokens"] == 0) & (steps["num_decode_seqs"] > 0)


def hiccup_excess(steps: pd.DataFrame, window: int = WINDOW, min_excess_s: float = MIN_EXCESS_S,
                  min_excess_fraction: float = MIN_EXCESS_FRACTION) -> pd.Series:
    """Seconds each decode-only step of `steps` (an engine run's steps table, in step order) took
    above the centred median of `window` decode-only steps around it, where that is more than
    `min_excess_s` and `min_excess_fraction` of the median; 0 for the others. Indexed as the
    decode-only rows of `steps`."""
    if window < 1 or min_excess_s < 0 or min_excess_fraction < 0:
        raise ValueError(f"window={window!r}, min_excess_s={min_excess_s!r}, min_excess_fraction="
                         f"{min_excess_fraction!r}: window must be >= 1 and the thresholds >= 0")
    duration = steps.loc[decode_only(steps), "duration"]
    median = duration.rolling(window, center=True, min_periods=1).median()
    excess = duration - median
    flagged = (excess > min_excess_s) & (excess > min_excess_fraction * median)
    return excess.where(flagged, 0.0)


def hiccups(steps: pd.DataFrame) -> Hiccups:
    """The hiccups of an engine run's steps table (`hiccup_excess` with its defaults)."""
    excess = hiccup_excess(steps)
    decode_s = float(steps.loc[decode_only(steps), "duration"].sum())
    return Hiccups(steps=int((excess > 0).sum()), excess_s=float(excess.sum()), decode_s=decode_s)
