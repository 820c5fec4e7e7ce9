"""Decode steps grouped by the share of them a KV receive's bytes were on the wire: the table both
`experiments.bench_kv_receive`'s duty-cycle sweep and `experiments.lab.decode_excess --by-share`
print, and the `busy_share_curve` the bench writes for the simulator (sim/latency/kv_receive.py).

A step's share is the part of its wall time (the bench) or period (an engine run's step) that the
union of the wire intervals covers (`sim.latency.kv_receive.wire_share`, the simulator's own rule);
its ratio is its time over the idle step (the bench) or over its profiled price (an engine run).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sim.latency.kv_receive import wire_share

# (label, lowest share, highest share), both ends in the bin; "0" and "1" are the steps the wire
# left idle and the steps it covered whole (a waiter's completion is seen within ~1 ms: 0.999).
SHARE_BINS = (("0", 0.0, 0.001), ("0-0.25", 0.001, 0.25), ("0.25-0.5", 0.25, 0.5), ("0.5-0.75", 0.5, 0.75),
              ("0.75-1", 0.75, 0.999), ("1", 0.999, 1.0))
MIN_BIN_STEPS = 5  # a bin with fewer steps gives no point of the curve


@dataclass(slots=True, frozen=True)
class ShareBin:
    label: str
    steps: int
    share: float  # the steps' mean share
    median: float  # their median ratio
    mean: float  # their mean ratio


def step_shares(starts: Sequence[float], ends: Sequence[float], intervals: Sequence[tuple[float, float]]) -> np.ndarray:
    """Per step [start, end]: the share of it the union of `intervals` covers."""
    spans = sorted(intervals)
    begins = np.array([a for a, _ in spans], dtype=float)
    out = np.zeros(len(starts))
    for i, (t0, t1) in enumerate(zip(starts, ends)):
        near = spans[:int(np.searchsorted(begins, t1))]  # only those that began before the step's end
        out[i] = wire_share(t0, t1, [w for w in near if w[1] > t0])
    return out


def share_bins(shares: np.ndarray, ratios: np.ndarray) -> list[ShareBin]:
    """The steps by SHARE_BINS (bins without steps left out)."""
    shares, ratios = np.asarray(shares, dtype=float), np.asarray(ratios, dtype=float)
    taken = np.zeros(len(shares), dtype=bool)
    out = []
    for label, low, high in SHARE_BINS:
        inside = ~taken & (shares >= low) & (shares <= high)
        taken |= inside
        if inside.any():
            out.append(ShareBin(label, int(inside.sum()), float(shares[inside].mean()),
                                float(np.median(ratios[inside])), float(ratios[inside].mean())))
    return out


def busy_share_curve(bins: Sequence[ShareBin]) -> str:
    """`busy_share_curve` from the bins with the wire busy and MIN_BIN_STEPS steps or more: each
    bin's mean share and median ratio (at least 1); `1:1` (no busy-link price) with none."""
    points = [(b.share, max(1.0, b.median)) for b in bins if b.label != "0" and b.steps >= MIN_BIN_STEPS]
    points = [p for i, p in enumerate(points) if i == 0 or p[0] > points[i - 1][0]]
    return " ".join(f"{s:.4f}:{f:.4f}" for s, f in points) or "1:1"


def format_bins(bins: Sequence[ShareBin], what: str) -> str:
    """The table, `what` naming the ratio (e.g. "step / idle step")."""
    lines = [f"  {'wire share':>10} {'steps':>6} {'mean share':>10} {'median ' + what:>22} {'mean':>7}"]
    lines += [f"  {b.label:>10} {b.steps:>6} {b.share:>10.3f} {b.median:>22.3f} {b.mean:>7.3f}" for b in bins]
    return "\n".join(lines)


def sweep_rows(sweep: dict, sent_at: list[float], idle_s: float) -> list[dict]:
    """Each step of `experiments.bench_kv_receive`'s duty sweep (`sweep`: the receiver's steps and
    receives, `sent_at`: the sender's send returns, in order): its utilisation, start (from the
    sweep's first), seconds, wire share and time over the idle step. A message's wire interval:
    the later of its receive's posting and its send's return, to its completion."""
    if len(sent_at) != len(sweep["receives"]):
        raise RuntimeError(f"the duty sweep posted {len(sweep['receives'])} receives for {len(sent_at)} sends")
    wire = [(max(posted, s), finished) for (_, posted, finished), s in zip(sweep["receives"], sent_at)]
    steps = sweep["steps"]
    if not steps:
        return []
    shares = step_shares([t0 for _, t0, _ in steps], [t1 for _, _, t1 in steps], wire)
    first = steps[0][1]
    return [{"setting": u, "start_s": round(t0 - first, 6), "step_s": t1 - t0, "share": round(share, 4),
             "over_idle": round((t1 - t0) / idle_s, 4)} for (u, t0, t1), share in zip(steps, shares)]


def duty_summary(rows: list[dict]) -> str:
    """One utilisation's steps in a line: how many, their mean share, their median ratio."""
    if not rows:
        return "no steps (budget)"
    return (f"steps {len(rows)} mean share {statistics.fmean(r['share'] for r in rows):.3f} "
            f"median over idle {statistics.median(r['over_idle'] for r in rows):.3f}")

