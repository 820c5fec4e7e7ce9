"""Roofline calibration: fit the roofline model's efficiency factors and per-step overhead to a
measured latency profile by least squares, and write them as a hardware config.

    python -m experiments.calibrate experiments/profiles/h200-qwen3-0.6b.csv [--hardware h200] [--out PATH]
    python -m experiments.run hardware=h200-calibrated latency=roofline ...

Fitted: `bandwidth_efficiency`, `gemm_efficiency`, `attention_efficiency` (in (0, 1]) and
`step_overhead_s` on the step rows, minimising the squared relative error (steps range from
~1 ms to tens of ms); the overhead has a closed form for given efficiencies and the three
efficiencies are found by coordinate search in log space. `swap_latency_s` and
`swap_block_overhead_s` come from a linear fit of the swap rows. Peaks (bandwidth, FLOP/s, host
link) stay those of the base conf/hardware file. The fit is specific to the profiled model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from experiments.lib.paths import REPO_ROOT
from experiments.lib.profiling.calibration import calibrate, calibrate_to_file


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="a latency profile CSV (experiments/profiles/<gpu>-<model>.csv)")
    ap.add_argument("--hardware", help="base conf/hardware name (default: the profile's file-name prefix)")
    ap.add_argument("--out", help="output yaml (default: conf/hardware/<hardware>-calibrated.yaml; '-' prints)")
    args = ap.parse_args(argv)
    hw_name = args.hardware or Path(args.profile).name.split("-")[0]
    hw = REPO_ROOT / "conf" / "hardware" / f"{hw_name}.yaml"
    try:
        if not Path(args.profile).is_file():
            raise ValueError(f"profile={args.profile!r} is invalid: not a file (a latency profile CSV, "
                             "python -m experiments.profile)")
        if not hw.is_file():
            raise ValueError(f"--hardware={hw_name!r} is invalid: no {hw}")
        if args.out == "-":
            values, report = calibrate(args.profile, hw)
            print(report)
            print(yaml.safe_dump(values, sort_keys=False))
            return
        target = args.out or hw.with_name(f"{hw_name}-calibrated.yaml")
        print(calibrate_to_file(args.profile, hw, target, "python -m experiments.calibrate " + " ".join(sys.argv[1:])))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
