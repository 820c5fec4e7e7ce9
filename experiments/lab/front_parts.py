"""Where a disaggregated pair's front spends its host time in a real run, by part: the engine runs
of a fidelity spec's pair scenarios with the front's methods timed as `experiments.bench_handoff_host`
times them (`instrument`: exclusive time per part, wall clock and the front thread's CPU time).

`python -m experiments.lab.front_parts --runs DIR [--spec conf/fidelity/disagg.yaml] [--scenarios pd_400,pd_500] [overrides]`

Runs the scenarios' engine pairs as `experiments.fidelity --engine-only` does (their traces land in
DIR, so `experiments.lab.prefill_excess --runs DIR` reads the same runs), every pair's front
instrumented once it is built, and prints per scenario: each part's milliseconds per prefill step
(wall, then CPU) and its calls per step, the front's host time per prefill step (every part but
the forward and the idle waits), and what the run's loop spent outside the front (the feed loop,
its sleeps until an arrival). Wall time above CPU time in a part is time its thread waited: for a
core, or for the GIL while the pipe's reader and sender threads or the KV link's waiter ran.
Written to DIR/front_parts.json as well. A diagnostic, not a price: the timers cost ~1-2 us a call,
so these are not the runs a fidelity report compares.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.disagg.pd_engine import DisaggregatedEngine
from experiments.bench_handoff_host import NOT_HOST, PARTS, PartTimer, instrument

ADDED_PARTS = (("", "add_request", "add_request"),)


@dataclass(slots=True)
class FrontRun:
    """One pair's front over its run: its parts' timer, from its build to its close."""

    timer: PartTimer
    start: float
    end: float = 0.0
    parts: list[str] = field(default_factory=lambda: [p for _, _, p in PARTS + ADDED_PARTS] + ["idle wait"])

    def summary(self) -> dict:
        steps = max(self.timer.calls.get("forward", 0), 1)
        per_step = {part: {"wall_ms": self.timer.wall.get(part, 0.0) / steps * 1e3,
                           "cpu_ms": self.timer.cpu.get(part, 0.0) / steps * 1e3,
                           "calls": self.timer.calls.get(part, 0) / steps} for part in self.parts}
        host = [p for p in self.parts if p not in NOT_HOST]
        wall = self.end - self.start
        inside = sum(self.timer.wall.values())
        return {"prefill_steps": self.timer.calls.get("forward", 0), "run_wall_s": wall,
                "host_ms_per_step": sum(per_step[p]["wall_ms"] for p in host),
                "host_cpu_ms_per_step": sum(per_step[p]["cpu_ms"] for p in host),
                "outside_front_ms_per_step": (wall - inside) / steps * 1e3, "parts": per_step}


def watch_fronts() -> tuple[list[FrontRun], Callable[[], None]]:
    """Every `DisaggregatedEngine` built from now on is instrumented; returns the runs and the undo."""
    runs: list[FrontRun] = []
    original = DisaggregatedEngine.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        timer = instrument(self)
        for _, name, part in ADDED_PARTS:
            timer.wrap(self, name, part)
        run = FrontRun(timer, time.perf_counter())
        runs.append(run)
        close = self.close

        def closing() -> None:
            if not run.end:
                run.end = time.perf_counter()
            close()

        self.close = closing

    DisaggregatedEngine.__init__ = init

    def undo() -> None:
        DisaggregatedEngine.__init__ = original

    return runs, undo


def format_summary(name: str, s: dict) -> str:
    lines = [f"\n## {name}: {s['prefill_steps']} prefill steps in {s['run_wall_s']:.2f} s; front host "
             f"{s['host_ms_per_step']:.2f} ms a step ({s['host_cpu_ms_per_step']:.2f} CPU), outside the front "
             f"{s['outside_front_ms_per_step']:.2f} ms a step",
             f"{'part':32s} {'wall ms':>8s} {'cpu ms':>8s} {'calls':>7s}   (a prefill step's)"]
    for part, v in s["parts"].items():
        if v["calls"] or v["wall_ms"]:
            tag = "   (not host)" if part in NOT_HOST else ""
            lines.append(f"{part:32s} {v['wall_ms']:8.3f} {v['cpu_ms']:8.3f} {v['calls']:7.2f}{tag}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides added to every run (experiments.fidelity's)")
    ap.add_argument("--spec", default="conf/fidelity/disagg.yaml")
    ap.add_argument("--scenarios", default="pd_400,pd_500", help="the spec's pair scenarios (roles [prefill, decode])")
    ap.add_argument("--runs", type=Path, required=True, help="trace dir of the engine runs")
    args = ap.parse_args(argv)
    from experiments import fidelity
    from experiments.lib.fidelity_spec import load_spec

    wanted = args.scenarios.split(",")
    names = [n for n in load_spec(args.spec)["scenarios"] if n in wanted]  # the order the spec runs them in
    runs, undo = watch_fronts()
    try:
        fidelity._main([*args.overrides, "--spec", args.spec, "--engine-only", "--runs", str(args.runs),
                        "--scenarios", args.scenarios])
    finally:
        undo()
    if len(runs) != len(names):
        raise RuntimeError(f"--scenarios={args.scenarios!r}: {len(runs)} engine pairs ran for {len(names)} "
                           "scenarios; each must be a pair scenario (cluster.roles=[prefill,decode])")
    summaries = {name: run.summary() for name, run in zip(names, runs)}
    for name, s in summaries.items():
        print(format_summary(name, s))
    (args.runs / "front_parts.json").write_text(json.dumps(summaries, indent=2) + "\n")


if __name__ == "__main__":
    main()
