"""The hop between a disaggregated pair's two host loops, read from one of its engine runs: for the
hand-offs whose blocks the decode side reserved while the front waited for a prefill step (the
front reads the decode side's answers then, `disaggregation.sends_mid_step`), the time from that
reservation to the front's send (`link_wait`): its `Reserved` over the pipe, the front picking it
up (and the decode side posting its receive, in a run whose decode side posted it before
answering). Answers that arrive while the front does its host work between steps wait for the
next step's launch, which the simulator prices on its own (sim/fleet/disagg.py), so they are left
out. `experiments.lab.front_parts` writes the mean into the
front host profile as `hop_s` (sim/fleet/front_host.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from experiments.lib.kv_receive_duty import wire_intervals

PREFILL_REPLICA = 0  # the pair's front (its prefill engine) in the trace's replica column


def answer_hops(requests: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """`link_wait` (seconds) of the hand-offs reserved while a prefill step ran: between the step's
    start (`time`) and its end (`time + duration`, schedule to update) on the prefill replica."""
    handed = requests[requests["link_time"].notna()]
    reserved = np.array([begin for begin, _ in wire_intervals(handed, posted=True)], dtype=float)
    prefill = steps[steps["replica"] == PREFILL_REPLICA].sort_values("time")
    starts = prefill["time"].to_numpy(dtype=float)
    ends = starts + prefill["duration"].to_numpy(dtype=float)
    step = np.searchsorted(starts, reserved, side="right") - 1
    inside = (step >= 0) & (reserved < ends[np.clip(step, 0, None)])
    return handed["link_wait"].to_numpy(dtype=float)[inside]


def answer_hop_s(engine_dir: str | Path) -> tuple[float, int]:
    """The mean answer hop of an engine run's trace directory (its `requests.parquet` and
    `steps.parquet`) and how many hand-offs it is the mean of; a ValueError if none qualifies."""
    d = Path(engine_dir)
    hops = answer_hops(pd.read_parquet(d / "requests.parquet"), pd.read_parquet(d / "steps.parquet"))
    if not len(hops):
        raise ValueError(f"{d}: no hand-off was reserved while the front waited for a prefill step: "
                         "no answer hop to measure (a run of a disaggregated pair with sends mid-step?)")
    return float(hops.mean()), len(hops)
