"""Where a disaggregated pair's front spends its host time in a real run, by part: the engine runs
of a fidelity spec's pair scenarios with the front's methods timed as `experiments.bench_handoff_host`
times them (`instrument`: exclusive time per part, wall clock and the front thread's CPU time).

`python -m experiments.lab.front_parts --runs DIR [--spec conf/fidelity/disagg.yaml] [--scenarios pd_400,pd_500] [overrides]`

Runs the scenarios' engine pairs as `experiments.fidelity --engine-only` does, one run each (their
traces land in DIR/<scenario>/engine, so `experiments.lab.prefill_excess --runs DIR` and
`experiments.fidelity --engine-runs DIR` read the same runs), every pair's front
instrumented once it is built, and prints per scenario: each part's milliseconds per prefill step
(wall, then CPU) and its calls per step, the front's host time per prefill step (every part but
the forward and the idle waits), and what the run's loop spent outside the front (the feed loop,
its sleeps until an arrival). Wall time above CPU time in a part is time its thread waited: for a
core, or for the GIL while the pipe's reader and sender threads or the KV link's waiter ran.
Written to DIR/front_parts.json as well; each decode-side answer's wait, split where the front's
pipe reader saw it (experiments/lib/answer_timing.py), to DIR/<scenario>.answers.csv. The
timers cost ~1-2 us a call, so these are not the runs a fidelity report compares. `--profile-out F` writes the front host profile of one scenario
(sim/fleet/front_host.py): its units from the parts, and `hop_s`, the hop between the two sides'
loops, from the same run's trace (experiments/lib/answer_hop.py).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime as dt
import io
import json
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.disagg.pd_engine import DisaggregatedEngine
from experiments.lib.answer_hop import answer_hop_s
from experiments.lib.answer_timing import AnswerLog, answer_split, format_split, watch_answers
from experiments.lib.front_timers import NOT_HOST, PARTS, PartTimer, instrument, owner_of
from sim.fleet.front_host import FrontHostProfile

ADDED_PARTS = (("", "add_request", "add_request"),)
# The parts each unit of the front host profile sums (sim/fleet/front_host.py); the scheduler's
# schedule and update are not among them: the step profile prices them with the step.
STEP_PARTS = ("front loop (rest)", "prefill step outputs", "front hand-off batch (rest)", "finish transfers (rest)",
              "check decode alive")
HANDOFF_PARTS = ("PrefillSide.hand_off", "front _hand_off (rest)", "hand_over_request", "PrefillSide.finish_transfer")


@dataclass(slots=True)
class FrontRun:
    """One pair's front over its run: its parts' timer, from its build to its close."""

    timer: PartTimer
    start: float
    end: float = 0.0
    profile: cProfile.Profile | None = None  # the `--detail` part's functions
    answers: AnswerLog = field(default_factory=AnswerLog)  # the decode side's answers it acted on
    parts: list[str] = field(default_factory=lambda: [p for _, _, p in PARTS + ADDED_PARTS] + ["idle wait", "arriving wait"])

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


def profile_from(summary: dict, meta: tuple[tuple[str, str], ...] = ()) -> FrontHostProfile:
    """A run's host time per unit of the front's loop (sim/fleet/front_host.py) from its summary
    (`FrontRun.summary`, or a scenario of front_parts.json), wall clock: each unit's parts over its
    count; the step's are the loop's bookkeeping between its parts and the caller's loop outside the
    front, per prefill step."""
    parts = summary["parts"]

    def per(names: tuple[str, ...], unit: str) -> float:
        n = parts[unit]["calls"]
        return sum(parts[p]["wall_ms"] for p in names) / n * 1e-3 if n else 0.0

    step_ms = sum(parts[p]["wall_ms"] for p in STEP_PARTS) + max(summary["outside_front_ms_per_step"], 0.0)
    return FrontHostProfile(
        step_s=step_ms * 1e-3, admission_s=per(("add_request",), "add_request"),
        handoff_s=per(HANDOFF_PARTS, "PrefillSide.hand_off"),
        kv_message_s=per(("KVLink.send", "start transfer (rest)"), "KVLink.send"),
        sent_message_s=per(("pickle + queue message",), "pickle + queue message"),
        # Per decode-step message (`_decode_outputs` once each): the reads of the front's other
        # messages (`Reserved`, a few bytes, mostly during a step) are spread over them.
        read_message_s=per(("recv + unpickle", "take messages (rest)", "decode outputs"), "decode outputs"),
        meta=meta)


def profiled(owner, name: str, profile: cProfile.Profile) -> None:
    """`owner.name` run under `profile` (its functions' time, for a part's breakdown)."""
    fn = getattr(owner, name)

    def inner(*args, **kwargs):
        profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profile.disable()

    setattr(owner, name, inner)


def watch_fronts(detail: str | None = None) -> tuple[list[FrontRun], Callable[[], None]]:
    """Every `DisaggregatedEngine` built from now on is instrumented (`detail`: one part, by name, also
    run under cProfile: `FrontRun.profile`); returns the runs and the undo."""
    runs: list[FrontRun] = []
    original = DisaggregatedEngine.__init__
    where = {part: (path, name) for path, name, part in PARTS}
    if detail is not None and detail not in where:
        raise ValueError(f"--detail={detail!r} is not a part of the front: one of {sorted(where)}")

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        timer = instrument(self)
        for _, name, part in ADDED_PARTS:
            timer.wrap(self, name, part)
        run = FrontRun(timer, time.perf_counter(), answers=watch_answers(self))
        if detail is not None:
            run.profile = cProfile.Profile()
            path, name = where[detail]
            profiled(owner_of(self, path), name, run.profile)
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
    ap.add_argument("--profile-out", type=Path, default=None,
                    help="write the front host profile (sim/fleet/front_host.py) of --profile-from's run here")
    ap.add_argument("--profile-from", default=None, help="the scenario it is timed in (default: the first)")
    ap.add_argument("--detail", default=None,
                    help="one part (e.g. 'KVLink.send') also run under cProfile: its functions' time per call, "
                         "written to DIR/<scenario>.detail.txt (cProfile slows that part)")
    ap.add_argument("--from-json", action="store_true",
                    help="run nothing: write --profile-out from DIR/front_parts.json (an earlier run's)")
    args = ap.parse_args(argv)
    if args.from_json:
        if args.profile_out is None:
            ap.error("--from-json writes a profile: give --profile-out")
        summaries = json.loads((args.runs / "front_parts.json").read_text())
        write_profile(args, list(summaries), summaries, argv)
        return
    from experiments.lib import engine_backend
    from experiments.lib.fidelity_spec import check_overridden, compose_cfg, load_spec, select_scenarios
    from experiments.lib.profiling.versions import versions
    from experiments.lib.run_workload import run as run_workload

    spec = load_spec(args.spec)
    check_overridden(args.overrides, spec, args.spec)
    names = select_scenarios(spec, args.scenarios)
    runs, undo = watch_fronts(args.detail)
    try:
        for name in names:  # as experiments.fidelity --engine-only runs them (its trace layout)
            overrides = [*spec["common"], *args.overrides, *spec["scenarios"][name].get("overrides", [])]
            run_workload(compose_cfg([*overrides, *spec["engine"]]), args.runs / name / "engine", f"{name} engine")
            engine_backend.free_device()
    finally:
        undo()
    args.runs.mkdir(parents=True, exist_ok=True)
    (args.runs / "meta.json").write_text(json.dumps({  # as fidelity --engine-only writes it
        "device": engine_backend.device_name(), "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": versions(),
        "command": "python -m experiments.lab.front_parts " + " ".join(argv if argv is not None else sys.argv[1:]),
        "scenarios": {name: {} for name in names}}, indent=2) + "\n")
    if len(runs) != len(names):
        raise RuntimeError(f"--scenarios={args.scenarios!r}: {len(runs)} engine pairs ran for {len(names)} "
                           "scenarios; each must be a pair scenario (cluster.roles=[prefill,decode])")
    summaries = {name: front.summary() for name, front in zip(names, runs)}
    for name, s in summaries.items():
        print(format_summary(name, s))
    for name, front in zip(names, runs):
        write_answers(args.runs, name, front.answers)
        if front.profile is not None:
            out = io.StringIO()
            pstats.Stats(front.profile, stream=out).sort_stats("tottime").print_stats(30)
            calls = front.timer.calls.get(args.detail, 0)
            text = f"# {args.detail}: {calls} calls in {name}, cProfile by own time\n{out.getvalue()}"
            (args.runs / f"{name}.detail.txt").write_text(text)
            print(text[:3000])
    (args.runs / "front_parts.json").write_text(json.dumps(summaries, indent=2) + "\n")
    if args.profile_out is not None:
        write_profile(args, names, summaries, argv)


def write_answers(runs: Path, name: str, answers: AnswerLog) -> None:
    """DIR/<name>.answers.csv: each answer's wait, split (experiments/lib/answer_timing.py); printed."""
    requests = runs / name / "engine" / "requests.parquet"
    if not answers.posted_s or not requests.is_file():
        return
    import pandas as pd

    split = answer_split(answers.frame(), pd.read_parquet(requests))
    split.to_csv(runs / f"{name}.answers.csv", index=False)
    print(format_split(name, split))


def write_profile(args, names: list[str], summaries: dict, argv: Sequence[str] | None) -> None:
    """The front host profile of --profile-from's scenario (default the first) to --profile-out, with
    its provenance: the model (from the spec), device and date (the runs' meta.json), the command."""
    from experiments.lib.fidelity_spec import compose_cfg, load_spec

    source = args.profile_from or names[0]
    if source not in summaries:
        raise ValueError(f"--profile-from={source!r} is not one of the scenarios timed: {list(summaries)}")
    meta = json.loads((args.runs / "meta.json").read_text()) if (args.runs / "meta.json").is_file() else {}
    spec = load_spec(args.spec)
    model = compose_cfg([*spec["common"], *spec["engine"], *spec["scenarios"][source]["overrides"],
                         *args.overrides]).model.name
    command = "python -m experiments.lab.front_parts " + " ".join(argv if argv is not None else sys.argv[1:])
    provenance = (("model", str(model)), ("device", str(meta.get("device", ""))), ("date", str(meta.get("date", ""))),
                  ("scenario", source), ("command", command))
    profile = profile_from(summaries[source], tuple((k, v) for k, v in provenance if v))
    try:
        hop_s, hops = answer_hop_s(args.runs / source / "engine")  # the same run's trace
    except (OSError, ValueError) as e:  # no trace, or no answer met a running step (the CPU's pair)
        print(f"no hop_s in the profile: {e}")
    else:
        profile = dataclasses.replace(profile, hop_s=hop_s, meta=(*profile.meta, (
            "hop_from", f"mean link_wait of {hops} answers reserved while the front waited for a prefill step")))
    profile.write(args.profile_out)
    print(f"\nfront host profile of {source} -> {args.profile_out}: "
          + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in profile.as_dict().items()))


if __name__ == "__main__":
    main()
