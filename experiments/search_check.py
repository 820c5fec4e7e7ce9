"""`python -m experiments.search_check RESULT [--out DIR] [--backend engine|sim] [--measure ROLE]`:
a capacity search's prediction checked on the engine (docs/search.md, "Checking the answer").

RESULT is a search's output folder (`outputs/search/<date>/<time>`). The check takes the search's
top pick (the cheapest deployment for its target rate) and a rejected neighbour (the best-ranked
deployment below it that differs in one dimension; `--neighbour-dimension` picks which), and runs
each on the backend with the search's workload, SLOs and seconds of arrivals, at (1 - within) and
(1 + within) x its predicted capacity: met, then missed, means the measured capacity is within
`within` of the prediction; otherwise up to `--max-steps` runs `--step` further out bound the
error. Writes measured/<role>.json, check.csv, probes.csv and check.md into --out (default
outputs/search_check/<date>/<time>); `--measure pick` and `--measure neighbour` may run as two
processes into one --out (one GPU each), and each rebuilds the report from what is there.

    python -m experiments.search_check outputs/search/2026-11-27/17-00-00 --out outputs/check
    CUDA_VISIBLE_DEVICES=0 python -m experiments.search_check R --out O --measure pick &
    CUDA_VISIBLE_DEVICES=1 python -m experiments.search_check R --out O --measure neighbour; wait
    python -m experiments.search_check R --backend sim      # the simulator against its own search
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from experiments.lib.cli import run_cli
from experiments.lib.run_dirs import default_run_dir
from experiments.lib.search.check_bracket import bracket_capacity
from experiments.lib.search.check_pick import (
    SearchOutput,
    choose_neighbour,
    choose_pick,
    device_reason,
    label,
    load_output,
)
from experiments.lib.search.check_report import ROLES, Measured, save, write_report
from experiments.lib.search.outputs import DEPLOYMENT_COLUMNS
from experiments.lib.search.simulate import run_at_rate

BACKENDS = ("engine", "sim")


def visible_gpus() -> list[str]:
    import torch
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def measure(search: SearchOutput, role: str, row: pd.Series, backend: str, within: float, step: float,
            max_steps: int, warmup_s: float) -> Measured:
    """One deployment's runs at rates bracketing its predicted capacity, after an unrecorded warm-up
    on a wall-clock backend (the engine's first run compiles kernels for new shapes)."""
    cfg = search.run_config(row, backend)
    device = "simulator"
    if backend == "engine":
        names = visible_gpus()
        reason = device_reason(row, str(cfg.hardware.name), names)
        if reason is not None:
            raise ValueError(f"the {role} ({label(row)}) cannot be checked here: {reason}")
        device = names[0]
    t0 = time.perf_counter()
    predicted = float(row["capacity_rps"])
    if backend != "sim" and warmup_s > 0:
        run_at_rate(cfg, (1 - within) * predicted, search.slo, warmup_s)
    bracket = bracket_capacity(lambda r: run_at_rate(cfg, r, search.slo, search.duration_s), predicted, within, step,
                               max_steps)
    keep = [*DEPLOYMENT_COLUMNS, "num_gpus", "dollars_per_hour", "capacity_rps", "failed_rps", "key"]
    plain = {c: (row[c].item() if hasattr(row[c], "item") else row[c]) for c in keep if c in row}
    return Measured(role, plain, bracket, backend, device, time.perf_counter() - t0)


def _main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m experiments.search_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a search's output folder (outputs/search/<date>/<time>)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default outputs/search_check/<date>/<time>)")
    parser.add_argument("--backend", default="engine", help=f"where to measure: one of {list(BACKENDS)}")
    parser.add_argument("--measure", default="both", help="which to run: pick, neighbour, both, or none (the report only)")
    parser.add_argument("--neighbour-dimension", default=None, help=f"the neighbour differs in this one: {DEPLOYMENT_COLUMNS}")
    parser.add_argument("--within", type=float, default=0.1, help="runs at (1 -/+ within) x predicted (default 0.1)")
    parser.add_argument("--step", type=float, default=0.25, help="each further run this much further out (x predicted)")
    parser.add_argument("--max-steps", type=int, default=1, help="further runs at most when outside (default 1)")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds of arrivals of an unrecorded first run on "
                                                                     "the engine (0: none)")
    args = parser.parse_args(argv)
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend={args.backend!r} is unknown: choose one of {list(BACKENDS)}")
    roles = {"both": ROLES, "none": (), "pick": ("pick",), "neighbour": ("neighbour",)}.get(args.measure)
    if roles is None:
        raise ValueError(f"--measure={args.measure!r} is unknown: choose one of both, pick, neighbour, none")
    if not args.warmup_s >= 0:
        raise ValueError(f"--warmup-s={args.warmup_s!r} is invalid: must be >= 0")
    search = load_output(args.result)
    pick = choose_pick(search, args.backend)
    neighbour = choose_neighbour(search, pick, args.backend, args.neighbour_dimension)
    rows = {"pick": pick, "neighbour": neighbour}
    for role in ROLES:
        print(f"{role}: {label(rows[role])}")
    out = args.out or default_run_dir("outputs/search_check")
    for role in roles:
        m = measure(search, role, rows[role], args.backend, args.within, args.step, args.max_steps, args.warmup_s)
        save(out, m)
        print(f"  {role} on {m.device}: {m.bracket.verdict()} ({len(m.bracket.probes)} runs, {m.wall_s:.0f} s)")
    frame = write_report(out, search, {r: row.to_dict() for r, row in rows.items()})
    print(f"rank order of the pick before the neighbour: {frame['rank_order'].iloc[0]}; check.md, check.csv, "
          f"probes.csv in {out}")
    return frame


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
