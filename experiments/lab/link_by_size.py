"""A disaggregated run's KV messages by size: how long each was on the link, engine or simulator,
read from its traces (`requests.parquet`, `steps.parquet`).

`python -m experiments.lab.link_by_size RUN [RUN ...] [--bins 20,40,60,80,120,200]`

A message is the requests of one decode replica whose sends were posted at the same instant (the
pair moves every hand-off reserved together in one); its bytes are theirs summed, its link time the first of
theirs to be noticed (`link_time`: from the send's post to the decode side noticing the KV after
its running step). Per run: the messages' mean link time in each size bin (MB), and a least-squares
line through (MB, wire), the wire being the link time less half the decode step it was noticed
after (the expected wait for that step's end), so that the line's slope reads as the link's
bandwidth in the run, beside whatever the two GPUs were doing. Set it beside
`experiments.bench_kv_transfer`'s line on idle GPUs, the simulator's link price.
"""
from __future__ import annotations

import argparse
import math
from itertools import pairwise
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.lib.kv_receive_duty import send_posts

DEFAULT_BINS = "20,40,60,80,120,200"


def messages(requests: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One row per KV message: `post` (s), `decode_replica`, `requests`, `mb`, `link_s`,
    `decode_step_s` (the step of its decode replica whose end it was noticed at; NaN if none) and
    `wire_s`."""
    columns = ["post", "decode_replica", "requests", "mb", "link_s", "decode_step_s", "wire_s"]
    r = requests[requests["link_time"].notna()]
    if r.empty:
        return pd.DataFrame(columns=columns)
    post = send_posts(r).round(6)
    m = (r.assign(post=post).groupby(["post", "decode_replica"])
         .agg(requests=("request_id", "size"), mb=("transfer_bytes", "sum"), link_s=("link_time", "min"))
         .reset_index())
    m["mb"] = m["mb"] / 1e6
    m["decode_step_s"] = np.nan
    for replica, rows in m.groupby("decode_replica"):
        dec = steps[steps["replica"] == replica].sort_values("time")
        if dec.empty:
            continue
        ends = (dec["time"] + dec["duration"]).to_numpy()
        k = np.searchsorted(ends, (rows["post"] + rows["link_s"]).to_numpy() + 2e-4, side="right") - 1
        m.loc[rows.index, "decode_step_s"] = np.where(k >= 0, dec["duration"].to_numpy()[np.clip(k, 0, None)],
                                                      np.nan)
    m["wire_s"] = m["link_s"] - m["decode_step_s"] / 2
    return m[columns]


def wire_line(m: pd.DataFrame) -> tuple[float, float] | None:
    """(fixed seconds, bytes per second) of the least-squares wire line; None with under 3
    messages or no spread in size."""
    m = m[m["wire_s"].notna()]
    if len(m) < 3 or m["mb"].nunique() < 2:
        return None
    slope, fixed = np.polyfit(m["mb"].to_numpy() * 1e6, m["wire_s"].to_numpy(), 1)
    return float(fixed), float(1 / slope) if slope > 0 else float("inf")


def by_size(m: pd.DataFrame, bins: list[float]) -> pd.DataFrame:
    """Messages and mean link time (ms) per size bin (MB, right-closed; the last open)."""
    edges = [0.0, *bins, float("inf")]
    cut = pd.cut(m["mb"], edges)
    out = m.groupby(cut, observed=False).agg(messages=("mb", "size"), link_ms=("link_s", "mean"))
    out["link_ms"] *= 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="trace directories (requests.parquet, steps.parquet)")
    ap.add_argument("--bins", default=DEFAULT_BINS, help="size bin edges in MB, comma-separated, ascending")
    args = ap.parse_args(argv)
    try:
        bins = [float(b) for b in args.bins.split(",")]
    except ValueError:
        bins = []
    if not bins or not all(math.isfinite(b) for b in bins) or bins[0] <= 0 \
            or any(b <= a for a, b in pairwise(bins)):
        ap.error(f"--bins={args.bins!r} is invalid: MB > 0, comma-separated, ascending")
    for run in args.runs:
        files = [run / "requests.parquet", run / "steps.parquet"]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            ap.error(f"{run}: {', '.join(missing)} not found (a run's trace directory)")
        requests, steps = (pd.read_parquet(f) for f in files)
        if "link_time" not in requests.columns:
            ap.error(f"{run}: its requests have no link_time (not a disaggregated run)")
        m = messages(requests, steps)
        if m.empty:
            print(f"{run}: no KV messages")
            continue
        line = wire_line(m)
        fit = "no line" if line is None \
            else f"wire {line[0] * 1e3:.2f} ms + bytes / {line[1] / 1e9:.0f} GB/s"
        print(f"{run}: {len(m)} messages, {m['requests'].mean():.2f} requests and {m['mb'].mean():.1f} MB "
              f"each, link {m['link_s'].mean() * 1e3:.2f} ms; {fit}")
        print(by_size(m, bins).to_string(float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
