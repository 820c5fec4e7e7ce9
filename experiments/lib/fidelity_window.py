"""The profile's decode-only rows re-measured inside the fidelity experiment's engine-run window.

A decode-only row is the engine's own step period holding that batch (`profiling/host.py:
decode_periods`); a quarter of a small step is host CPU work, and the device VMs' host speed drifts
for minutes. On H200 device VMs a profile taken minutes before the engine runs priced the same steps 5-12%
below two others on other H200s (1-sequence row: host share 37 us against 168-240) while the engine
itself reproduced within 3% on all three: the fidelity then measured the host's drift, not the
simulator. `--window-profile` makes the GPU stage time those rows again, on the engine it has just
run (the capacity scenario's, each round), with the profiler's settings; the simulator side then
reads the standalone profile with its decode-only rows replaced by the median of those rounds
(`window-profile.csv` in the runs dir; the rows with prefill and the swap rows stay the standalone
profile's). The simulator never sees the scenario runs' own step times.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd

from experiments.lib.profiling.grid import write_profile
from experiments.lib.profiling.host import decode_periods
from sim.latency.profile_io import RATIO_COLUMN, read_profile

WARMUP, REPEATS = 2, 15  # conf/profile.yaml's warmup and host_repeats
PERIODS_CSV = "window_periods.csv"
PROFILE_CSV = "window-profile.csv"


def _decode_shape(row: dict[str, str]) -> tuple[int, int, float] | None:
    """(D, context per decode, context ratio or -1 when the row has none) of a decode-only step row
    of a profile, else None."""
    d = int(row.get("num_decode_seqs") or 0)
    if row.get("kind") != "step" or row.get("num_prefill_tokens") != "0" or not d:
        return None
    ratio = (row.get(RATIO_COLUMN) or "").strip()
    return d, int(row["num_context_tokens"]) // d, float(ratio) if ratio else -1.0


def decode_shapes(profile: str | Path) -> list[tuple[int, int, float]]:
    """(D, context per decode, context ratio or -1) of the profile's decode-only rows."""
    return sorted({shape for _, row in read_profile(profile)[1] if (shape := _decode_shape(row))})


def measure(runner, profile: str | Path, round_index: int, runs_dir: Path) -> None:
    """Time the profile's decode shapes on `runner` and append them to runs_dir/window_periods.csv
    (round 0 starts the file afresh)."""
    if runner is None:
        raise ValueError("--window-profile is invalid here: no engine was kept after the capacity scenario "
                         "(the spec's engine runs must use backend=engine)")
    ahead = read_profile(profile)[0].get("async_scheduling") == "true"  # time them as the profile did
    shapes = [(d, c, None if r < 0 else r) for d, c, r in decode_shapes(profile)]
    periods = decode_periods(runner, shapes, WARMUP, REPEATS, seed=round_index, async_scheduling=ahead)
    frame = pd.DataFrame([{"round": round_index, "num_decode_seqs": d, "context_per_decode": c,
                           RATIO_COLUMN: -1.0 if r is None else r, "time_s": t} for (d, c, r), t in periods.items()])
    path = runs_dir / PERIODS_CSV
    if round_index == 0:
        path.unlink(missing_ok=True)
    frame.to_csv(path, mode="a", header=not path.is_file(), index=False)


def window_profile(profile: str | Path, runs_dir: Path) -> Path | None:
    """runs_dir/window-profile.csv: `profile` with its decode-only rows' time_s replaced by the median
    over rounds of runs_dir/window_periods.csv; None when the runs have no window timings."""
    periods_path = runs_dir / PERIODS_CSV
    if not periods_path.is_file():
        return None
    periods = pd.read_csv(periods_path)
    if RATIO_COLUMN not in periods:  # timings written before the batch-shape axis
        periods[RATIO_COLUMN] = -1.0
    medians = {(int(d), int(c), float(r)): statistics.median(g["time_s"])
               for (d, c, r), g in periods.groupby(["num_decode_seqs", "context_per_decode", RATIO_COLUMN])}
    meta, rows = read_profile(profile)
    replaced = 0
    for _, row in rows:
        t = medians.get(_decode_shape(row))
        if t is not None:
            row["time_s"], replaced = f"{t:.9g}", replaced + 1
    meta["window_profile"] = (f"{replaced} decode-only rows re-timed in the engine-run window (median of "
                              f"{periods['round'].nunique()} rounds, experiments/lib/fidelity_window.py); "
                              f"standalone profile {profile}")
    return write_profile(runs_dir / PROFILE_CSV, meta, [row for _, row in rows])
