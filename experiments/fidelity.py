"""`python -m experiments.fidelity [COMMON OVERRIDES] [--spec FILE] [--out DIR] [--runs DIR]
[--engine-runs DIR] [--engine-repeats N] [--profile CSV] [--scenarios a,b]`: does the simulator
predict the engine?

Each scenario of the spec (conf/fidelity/default.yaml: the offline nano-vllm benchmark, Poisson
arrivals at three loads, memory pressure with swap and with recompute, two priority policies)
builds one request stream and runs it through `backend=engine` and through `backend=sim` with
`latency=profiled` (the profile of this device and model), the simulator getting the engine's
KV block counts. `load` scenarios arrive at `load x capacity`, capacity being the engine's output
token throughput on the spec's `capacity` scenario divided by the scenario's mean output length.
Writes into --out (default <runs>/report): `fidelity.md` (device, date, command,
error table, policy-ranking table), `fidelity.csv`, `ranking.csv`, `meta.json` and one PNG per
scenario (CDFs, KV usage); full traces go to --runs (default outputs/fidelity/<date>/<time>).
`--engine-runs DIR` reuses the engine traces of an earlier --runs dir (the simulator runs again).
`--sim OVERRIDE` (repeatable) adds Hydra overrides to the simulator side only, after the spec's
`sim` list: `--sim latency=operators` predicts from operator profiles instead of the per-model one
(no profile needed; docs/operator_profiles.md). Under tensor parallelism the simulator side prices
the all-reduce path the engine runs recorded (`run.all_reduce`; experiments/lib/fidelity_all_reduce.py),
and the report's `all-reduce:` line says which it priced and why.
`--engine-repeats N` runs each scenario N times on the engine (same requests), in N rounds over all
scenarios so that a scenario's repeats are minutes apart: the simulator is compared with the runs'
mean and the table shows their spread, the engine's own run-to-run noise. `--window-profile` re-times
the profile's decode-only rows on the engine each round, and the simulator side reads them
(experiments/lib/fidelity_window.py; `--standalone-profile` ignores them).

    python -m experiments.fidelity                      # on the GPU, after experiments.profile
    python -m experiments.fidelity --engine-runs outputs/fidelity/<date>/<time>
    python -m experiments.fidelity --engine-runs outputs/fidelity/<date>/<time> --sim latency=operators
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.lib import engine_backend, factory, fidelity_window
from experiments.lib.cli import run_cli
from experiments.lib.fidelity_all_reduce import SimAllReduce, sim_all_reduce
from experiments.lib.fidelity_report import decode_step_ratio
from experiments.lib.fidelity_spec import (
    DEFAULT_SPEC,
    check_overridden,
    compose_cfg,
    load_spec,
    select_scenarios,
)
from experiments.lib.fidelity_tables import STALL_S, FidelityTables
from experiments.lib.host_hiccups import hiccups
from experiments.lib.paths import resolve_path
from experiments.lib.profiling.host import cpu_probe_us
from experiments.lib.run_dirs import default_run_dir
from experiments.lib.run_workload import run
from experiments.lib.traces import load_run
from sim.latency.profiled import ProfiledModel


def check_decode_kernel(path: str, meta: dict[str, str], scenario: str, runs: list[dict[str, Any]]) -> None:
    """Refuse to compare engine runs with a profile of another decode kernel (where both name theirs:
    `decode_kernel` in a profile's metadata and in a run's summary)."""
    profiled = meta.get("decode_kernel")
    ran = {r["decode_kernel"] for r in runs if r.get("decode_kernel")}
    if profiled and ran and ran != {profiled}:
        raise ValueError(f"latency profile {path!r} was taken with decode_kernel={profiled}, but the engine runs of "
                         f"scenario {scenario} ran {sorted(ran)}: profile with the engine's kernel "
                         f"(python -m experiments.profile decode_kernel=...) or run the spec that names {profiled}")


class Fidelity(FidelityTables):
    """The runs of a fidelity spec: the engine's (`run_engines`) and the simulator's against them
    (`run_scenario`), kept in `results`; the tables and report from them are `FidelityTables`'."""

    def __init__(self, spec: dict[str, Any], common: list[str], runs_dir: Path, engine_runs: Path | None,
                 profile: str | None, engine_repeats: int = 1, window: bool = False,
                 standalone: bool = False) -> None:
        if not isinstance(engine_repeats, int) or isinstance(engine_repeats, bool) or engine_repeats < 1:
            raise ValueError(f"engine_repeats={engine_repeats!r} is invalid: must be an integer >= 1")
        self.spec, self.common, self.runs_dir, self.engine_runs = spec, common, runs_dir, engine_runs
        self.engine_repeats = engine_repeats
        self.window, self.standalone = window, standalone  # fidelity_window.py
        self._sim_profile: str | None = None
        self.base = [*spec["common"], *common]
        self.profile = profile or spec.get("profile")
        self.capacity_tok_s: float | None = None
        self.results: dict[str, dict[str, Any]] = {}  # scenario -> {engine/sim: (summary, requests, steps)}
        self.settings: dict[str, dict[str, Any]] = {}
        self._prepared: dict[str, tuple[list[str], Any]] = {}
        self._engine: dict[str, list[tuple[dict, pd.DataFrame, pd.DataFrame]]] = {}  # scenario -> engine runs
        self.all_reduce: SimAllReduce | None = None  # the simulator's all-reduce (fidelity_all_reduce.py)

    @property
    def profiled(self) -> bool:
        """Whether the simulator side reads a per-model latency profile (`latency=profiled`)."""
        return compose_cfg([*self.base, *self.spec["sim"]]).latency.name == "profiled"

    def profile_path(self) -> str:
        if self.profile:
            return self.profile
        path = resolve_path(str(compose_cfg([*self.base, *self.spec["sim"]]).latency.path))
        if not Path(path).is_file():
            raise ValueError(f"no latency profile at {path}: run `python -m experiments.profile` on this device "
                             "first, or pass --profile")
        return str(path)

    def sim_profile(self) -> str:
        """The profile the simulator reads: the standalone one, or (unless `standalone`) its window
        version when the engine runs carry window timings (fidelity_window.py)."""
        if self._sim_profile is None:
            runs = self.engine_runs if self.engine_runs is not None else self.runs_dir
            path = None if self.standalone else fidelity_window.window_profile(self.profile_path(), runs)
            self._sim_profile = str(path) if path is not None else self.profile_path()
        return self._sim_profile

    def warmup(self) -> None:
        if self.engine_runs is not None or not self.spec.get("warmup"):
            return
        cfg = compose_cfg([*self.base, *self.spec["warmup"], *self.spec["engine"]])
        run(cfg, self.runs_dir / "_warmup", "warm-up")
        engine_backend.free_device()

    def scenario_overrides(self, name: str) -> list[str]:
        scn = self.spec["scenarios"][name]
        overrides = [*self.base, *scn.get("overrides", [])]
        if scn.get("load") is not None:
            if self.capacity_tok_s is None:
                raise ValueError(f"scenario {name} has a load but the capacity scenario did not run first")
            probe = factory.workload(compose_cfg([*overrides, "workload.rate=1.0"]))
            mean_out = sum(probe.output_lens) / len(probe.output_lens)
            rate = scn["load"] * self.capacity_tok_s / mean_out
            overrides.append(f"workload.rate={rate:.6g}")
            self.settings.setdefault(name, {})["rate"] = float(f"{rate:.6g}")
        return overrides

    def prepared(self, name: str) -> tuple[list[str], Any]:
        """The scenario's overrides and request stream, made once (a load scenario's rate needs the
        capacity scenario's first engine run)."""
        if name not in self._prepared:
            overrides = self.scenario_overrides(name)
            self._prepared[name] = (overrides, factory.workload(compose_cfg([*overrides, *self.spec["engine"]])))
        return self._prepared[name]

    def run_engines(self, names: list[str]) -> None:
        """The engine runs of `names` (the capacity scenario first), in `engine_repeats` rounds: round
        i runs every scenario once, so one scenario's repeats lie minutes apart and sample the host
        CPU's speed drift (up to 2.5x on the device VMs) instead of one window of it. Each run stores
        its trace (`engine/`, then `engine_r2/`...) and the host gauge before it (`cpu_probe_us`)."""
        if self.engine_runs is not None:
            stored_meta = self.engine_runs / "meta.json"
            probes = json.loads(stored_meta.read_text()).get("scenarios", {}) if stored_meta.is_file() else {}
            for name in names:
                if probes.get(name, {}).get("host_probe_us"):
                    self.settings.setdefault(name, {})["host_probe_us"] = probes[name]["host_probe_us"]
                stored = self.engine_runs / name
                dirs = sorted(stored.glob("engine_r*"), key=lambda d: int(d.name.removeprefix("engine_r")))
                self._engine[name] = [(r.summary, r.requests, r.steps) for r in map(load_run, [stored / "engine", *dirs])]
                if name == self.spec.get("capacity"):
                    self.capacity_tok_s = float(self._engine[name][0][0]["output_throughput"])
            return
        for i in range(self.engine_repeats):
            for name in names:
                overrides, workload = self.prepared(name)
                out = self.runs_dir / name / ("engine" if i == 0 else f"engine_r{i + 1}")
                label = f"{name} engine" + ("" if i == 0 else f" (round {i + 1})")
                probe = cpu_probe_us()
                run(compose_cfg([*overrides, *self.spec["engine"]]), out, label, workload.fresh())
                engine_backend.free_device()
                r = load_run(out)
                self._engine.setdefault(name, []).append((r.summary, r.requests, r.steps))
                self.settings.setdefault(name, {}).setdefault("host_probe_us", []).append(round(probe, 1))
                if name == self.spec.get("capacity"):
                    if i == 0:
                        self.capacity_tok_s = float(r.summary["output_throughput"])
                    if self.window:  # the decode rows re-timed on this engine, mid-round
                        fidelity_window.measure(engine_backend.kept_runner(), self.profile_path(), i, self.runs_dir)

    def sim_all_reduce(self, overrides: list[str]) -> list[str]:
        """The simulator side's all-reduce overrides: the path every engine run recorded (decided
        once, from the first scenario's overrides; the console and the report say which)."""
        if self.all_reduce is None:
            runs = [r[0].get("run", {}) for runs in self._engine.values() for r in runs]
            self.all_reduce = sim_all_reduce(runs, [*overrides, *self.spec["sim"]], compose_cfg)
            if self.all_reduce.note:
                print(f"[fidelity] all-reduce: {self.all_reduce.note}", flush=True)
        return self.all_reduce.overrides

    def run_scenario(self, name: str, with_sim: bool = True) -> None:
        """The scenario's simulator run against its engine runs (`run_engines` first)."""
        overrides, workload = self.prepared(name)
        engine_runs = self._engine[name]
        engine = engine_runs[0]  # the first run: per-request tables (ranking), steps, plots
        info = engine[0].get("run", {})
        stalls = engine[2]["duration"][engine[2]["duration"] > STALL_S]
        hiccup = hiccups(engine[2])
        self.settings.setdefault(name, {}).update(
            {"overrides": [o for o in overrides if o not in self.base], "num_requests": len(workload),
             "num_gpu_blocks": info.get("num_gpu_blocks"), "num_cpu_blocks": info.get("num_cpu_blocks"),
             "engine_stall_steps": len(stalls), "engine_stall_s": float(stalls.sum()),
             "engine_hiccup_steps": hiccup.steps, "engine_hiccup_s": hiccup.excess_s,
             "engine_hiccup_pct": hiccup.percent})
        if name == self.spec.get("capacity"):
            self.settings[name]["capacity_output_tok_s"] = self.capacity_tok_s
        tok_s = "/".join(f"{r[0]['output_throughput']:.0f}" for r in engine_runs)
        line = (f"[fidelity] {name}: engine {engine[0]['duration_s']:.2f}s ({tok_s} tok/s, {len(stalls)} steps > "
                f"{STALL_S}s)")
        if not with_sim:
            print(line, flush=True)
            return
        blocks = [f"blocks.num_gpu_blocks={info['num_gpu_blocks']}"] if info.get("num_gpu_blocks") else []
        if info.get("num_cpu_blocks") is not None:
            blocks.append(f"blocks.num_cpu_blocks={info['num_cpu_blocks']}")
        blocks = [*self.sim_all_reduce(overrides), *blocks]
        if self.profiled:
            cfg_s = compose_cfg([*overrides, *self.spec["sim"], f"latency.path={self.sim_profile()}", *blocks])
            profile = ProfiledModel(self.sim_profile(), factory.block_size(cfg_s))
            check_decode_kernel(self.sim_profile(), profile.meta, name, [r[0].get("run", {}) for r in engine_runs])
            self.settings[name]["decode_vs_profile"] = [
                round(decode_step_ratio(r[2], lambda d, c: profile.lookup(0, d, c)), 3) for r in engine_runs]
        else:
            cfg_s = compose_cfg([*overrides, *self.spec["sim"], *blocks])
        out = self.runs_dir / name / "sim"
        summary = run(cfg_s, out, f"{name} sim", workload.fresh())
        r = load_run(out)
        self.results[name] = {"engine": engine, "sim": (summary, r.requests, r.steps), "engine_runs": engine_runs,
                              "engine_summaries": [run_[0] for run_ in engine_runs]}
        print(f"{line}, sim {summary['duration_s']:.2f}s ({summary['output_throughput']:.0f} tok/s)", flush=True)


def _main(argv: Sequence[str] | None = None) -> Fidelity:
    parser = argparse.ArgumentParser(prog="python -m experiments.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every run")
    parser.add_argument("--spec", default=str(DEFAULT_SPEC), help="scenario file (conf/fidelity/*.yaml)")
    parser.add_argument("--out", type=Path, default=None, help="report dir (default <runs>/report)")
    parser.add_argument("--runs", type=Path, default=None, help="trace dir (default outputs/fidelity/<date>/<time>)")
    parser.add_argument("--engine-runs", type=Path, default=None, help="reuse the engine runs of this --runs dir")
    parser.add_argument("--profile", default=None, help="latency profile CSV (default: the sim config's latency.path)")
    parser.add_argument("--sim", action="append", default=[], metavar="OVERRIDE",
                        help="Hydra override for the simulator side only (after the spec's sim list), repeatable")
    parser.add_argument("--scenarios", default=None, help="comma-separated subset of the spec's scenarios")
    parser.add_argument("--engine-repeats", type=int, default=1,
                        help="engine runs per scenario (same requests): the sim is compared with their mean and "
                             "the report shows their spread, the engine's own run-to-run noise")
    parser.add_argument("--window-profile", action="store_true",
                        help="GPU stage: re-time the profile's decode-only rows on the engine each round "
                             "(experiments/lib/fidelity_window.py); the simulator side then uses them")
    parser.add_argument("--standalone-profile", action="store_true",
                        help="simulator side: ignore window timings and read the standalone profile")
    parser.add_argument("--engine-only", action="store_true",
                        help="only the engine runs (on the GPU); the simulator side later with --engine-runs")
    args = parser.parse_args(argv)
    spec = load_spec(args.spec)
    check_overridden(args.overrides, spec, args.spec)
    spec["sim"] = [*spec["sim"], *args.sim]
    names = select_scenarios(spec, args.scenarios)
    cap = spec.get("capacity")
    if cap in names:  # the capacity scenario runs first: the loads need it
        names.remove(cap)
        names.insert(0, cap)
    runs_dir = args.runs or default_run_dir("outputs/fidelity")
    fid = Fidelity(spec, list(args.overrides), runs_dir, args.engine_runs, args.profile, args.engine_repeats,
                   args.window_profile, args.standalone_profile)
    old_meta = args.engine_runs / "meta.json" if args.engine_runs else None
    meta: dict[str, Any] = json.loads(old_meta.read_text()) if old_meta and old_meta.is_file() else {}
    if not meta:
        from experiments.lib.profiling.versions import versions
        meta = {"device": engine_backend.device_name(), "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "versions": versions()}
    command = "python -m experiments.fidelity " + " ".join(sys.argv[1:] if argv is None else argv)
    if meta.get("command") and args.engine_runs:
        meta["engine_command"] = meta["command"]
    meta["command"] = command
    if args.engine_only and args.engine_runs:
        raise ValueError("--engine-only with --engine-runs is invalid: there would be nothing to run")
    if not args.engine_only and fid.profiled:
        fid.profile_path()  # fail before any run if the profile is missing
    fid.warmup()
    runs_dir.mkdir(parents=True, exist_ok=True)
    fid.run_engines(names)
    for name in names:
        fid.run_scenario(name, with_sim=not args.engine_only)
        (runs_dir / "meta.json").write_text(json.dumps({**meta, "scenarios": fid.settings}, indent=2) + "\n")
    if args.engine_only:
        print(f"[fidelity] engine runs in {runs_dir}: run the simulator side with --engine-runs {runs_dir}")
        return fid
    latency = fid.sim_profile() if fid.profiled else f"latency={compose_cfg([*fid.base, *spec['sim']]).latency.name}"
    meta.update({"profile": latency, "latency_model": compose_cfg([*fid.base, *spec["sim"]]).latency.name,
                 "runs_dir": str(runs_dir), "spec": str(args.spec)})
    if fid.all_reduce is not None and fid.all_reduce.note:
        meta["all_reduce"] = fid.all_reduce.note
    print(fid.write(args.out or runs_dir / "report", meta))
    return fid


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
