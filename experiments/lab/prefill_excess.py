"""Where a disaggregated pair's prefill engine spends its time against a step profile, engine runs
beside the simulator's: the prefill replica's steps (replica 0 of a run with hand-offs), their
device part and the host time between them.

`python -m experiments.lab.prefill_excess --runs DIR --profile CSV [--sim-runs DIR] [--scenarios a,b]`
reads `DIR/<scenario>/engine/steps.parquet` and `requests.parquet` (and, with `--sim-runs`, the
simulator's `<scenario>/sim/steps.parquet` of the same scenarios) and prints per scenario:

- steps, prefill tokens and prompts a step, the mean `duration` (schedule to update: the device's
  work and the read-back) and the mean host gap before the next step (update to schedule), and
  the period (step to step);
- the steps' duration over the profile's price of their prefill tokens as the simulator prices a
  step (`shape_time`, the prompts taken as equal in length: the rows keep only their number;
  `sync_time_s`: a prefill engine's steps are not scheduled ahead when requests wait), binned by the share of the step a KV
  message was on the wire out of its GPU (`experiments/lib/kv_receive_duty.py`'s intervals
  and bins): the engine's own side of what sending costs a step.

A diagnostic, not a price: nothing here goes into the simulator (it would be fitted to the runs it
is checked against).
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.lib.kv_receive_duty import format_bins, share_bins, step_shares, wire_intervals
from sim.latency.base import BatchShape


def prefill_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Replica 0's steps with prefill tokens, in step order, with `gap` (host time after the step
    to the next one's schedule; NaN for the last) and `period` (to the next step)."""
    d = steps[steps["replica"] == 0].sort_values("step").reset_index(drop=True)
    d["gap"] = (d["time"].shift(-1) - (d["time"] + d["duration"])).clip(lower=0.0)
    d["period"] = d["time"].shift(-1) - d["time"]
    return d[d["num_prefill_tokens"] > 0].reset_index(drop=True)


def summary(name: str, d: pd.DataFrame) -> str:
    return (f"{name}: {len(d)} prefill steps, {d['num_prefill_tokens'].mean():.0f} tokens and "
            f"{d['num_prefill_seqs'].mean():.2f} prompts a step; duration {d['duration'].mean() * 1e3:.2f} ms, "
            f"host gap after {d['gap'].mean() * 1e3:.2f} ms, period {d['period'].mean() * 1e3:.2f} ms")


def even_prompts(tokens: int, prompts: int) -> BatchShape:
    """A prefill-only step of `tokens` in `prompts` prompts of equal length (the step rows do not
    keep each prompt's length), no cached prefix, one sampled row a prompt."""
    n = max(1, prompts)
    chunks = tuple((tokens // n + (i < tokens % n), 0) for i in range(n))
    return BatchShape(num_prefill_tokens=tokens, num_prefill_seqs=n, num_samples=n, prefill_chunks=chunks,
                      prefill_attention_pairs=sum(q * (q + 1) // 2 for q, _ in chunks))


def by_share(d: pd.DataFrame, requests: pd.DataFrame, price) -> str:
    t0 = d["time"].to_numpy(dtype=float)
    shares = step_shares(t0, t0 + d["duration"].to_numpy(dtype=float), wire_intervals(requests))
    priced = np.array([price(int(t), int(n)) for t, n in zip(d["num_prefill_tokens"], d["num_prefill_seqs"])])
    ratio = d["duration"].to_numpy(dtype=float) / priced
    return (f"  priced {priced.mean() * 1e3:.2f} ms a step (duration / price {ratio.mean():.3f} mean); "
            "by the share of the step a message was on the wire:\n"
            + format_bins(share_bins(shares, ratio), "duration / price"))


def main(argv: Sequence[str] | None = None) -> None:
    from sim.latency.profiled import ProfiledModel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, type=Path, help="a fidelity --runs directory with a pair's engine runs")
    p.add_argument("--profile", required=True, help="the step profile (with sync_time_s)")
    p.add_argument("--sim-runs", type=Path, default=None, help="the simulator's traces of the same scenarios")
    p.add_argument("--scenarios", default="", help="comma-separated; default every scenario with hand-offs")
    a = p.parse_args(argv)
    model = ProfiledModel(a.profile, 16)
    if model.sync_grid is None:
        raise SystemExit(f"--profile {a.profile}: no sync_time_s column (a profile taken with async scheduling)")
    price = lambda tokens, prompts: model.shape_time(even_prompts(tokens, prompts), sync=True)
    names = a.scenarios.split(",") if a.scenarios else sorted(x.parent.parent.name
                                                              for x in a.runs.glob("*/engine/requests.parquet"))
    for name in names:
        engine = a.runs / name / "engine"
        if not (engine / "steps.parquet").exists():
            raise SystemExit(f"--scenarios: {name} has no {engine / 'steps.parquet'}")
        requests = pd.read_parquet(engine / "requests.parquet")
        if "link_time" not in requests.columns or requests["link_time"].isna().all():
            continue  # no hand-offs: not a pair
        d = prefill_steps(pd.read_parquet(engine / "steps.parquet"))
        print(summary(f"{name} engine", d))
        print(by_share(d, requests, price))
        if a.sim_runs is not None:
            sim = a.sim_runs / name / "sim" / "steps.parquet"
            if not sim.exists():
                raise SystemExit(f"--sim-runs: no {sim}")
            print(summary(f"{name} simulator", prefill_steps(pd.read_parquet(sim))))


if __name__ == "__main__":
    main()
