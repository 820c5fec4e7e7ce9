"""Is the host CPU's speed steady, and is a slow spell one core's or the whole machine's?
`python -m experiments.lab.host_check [--rounds 8] [--samples 20] [--pause 1] [--out FILE.csv]`.

The engine's per-step host work (scheduler, input writes, launches) runs on one Python thread, so
its speed sets the host share of every step (docs/history.md: up to 2.5x drift on the
device VMs).  Each round pins this process to each allowed core in turn and times
`cpu_probe_us`'s fixed pure-Python workload there, then unpinned; with the kernel's steal time
(/proc/stat: time the hypervisor ran other guests on our vCPUs) over the round.  One core slow
across rounds points at placement (pinning helps); all cores slow in the same rounds, with steal
time, points at the host machine (nothing inside the guest helps).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import pandas as pd

from experiments.lib.profiling.host import cpu_probe_us


def steal_ticks() -> int | None:
    """Cumulative steal time of all CPUs in USER_HZ ticks (None where /proc/stat is missing)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    return int(fields[8]) if len(fields) > 8 else None


def system_facts() -> dict[str, str]:
    facts = {"cpus": str(os.cpu_count()), "affinity": str(sorted(os.sched_getaffinity(0)))}
    for name, path in (("cgroup_cpu_max", "/sys/fs/cgroup/cpu.max"), ("loadavg", "/proc/loadavg")):
        try:
            facts[name] = Path(path).read_text().strip()
        except OSError:
            facts[name] = "n/a"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        facts["model"] = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
        facts["mhz"] = " ".join(ln.split(":", 1)[1].strip().split(".")[0] for ln in lines if ln.startswith("cpu MHz"))
    except OSError:
        pass
    return facts


def run(rounds: int, samples: int, pause_s: float = 0.0) -> pd.DataFrame:
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    for r in range(rounds):
        if r:
            time.sleep(pause_s)
        steal0, t0 = steal_ticks(), time.perf_counter()
        for core in [*cores, None]:
            os.sched_setaffinity(0, cores if core is None else [core])
            times = [cpu_probe_us(repeats=1) for _ in range(samples)]
            rows.append({"round": r, "core": "any" if core is None else core, "median_us": statistics.median(times),
                         "min_us": min(times), "max_us": max(times)})
        os.sched_setaffinity(0, cores)
        steal1, wall = steal_ticks(), time.perf_counter() - t0
        steal = None if steal0 is None else (steal1 - steal0) / os.sysconf("SC_CLK_TCK") / wall / len(cores)
        for row in rows[-len(cores) - 1:]:
            row["round_steal_frac"] = steal
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between rounds")
    parser.add_argument("--out", default=None, help="CSV of every (round, core) median")
    args = parser.parse_args()
    for key, value in system_facts().items():
        print(f"{key}: {value}")
    table = run(args.rounds, args.samples, args.pause)
    wide = table.pivot(index="round", columns="core", values="median_us")
    print("probe median (us) per round (rows) and core (columns):")
    print(wide.round(0).to_string())
    print("steal fraction per round:", table.groupby("round")["round_steal_frac"].first().round(4).tolist())
    per_core = table[table.core != "any"].groupby("core")["median_us"]
    print(f"spread across cores (median of rounds): {per_core.median().min():.0f}..{per_core.median().max():.0f} us;"
          f" across rounds (median of cores): {wide.drop(columns='any').median(axis=1).min():.0f}.."
          f"{wide.drop(columns='any').median(axis=1).max():.0f} us")
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
