"""Whether a command line is accepted, found without doing its work: its own parser reads it and its
own checks run, up to the first place it would start a simulation, an engine, a server or a
search's simulations, where `Accepted` is raised instead (`stop_before_work`).

- Hydra apps (`experiments.run`, `.search`, `.disagg_sweep`, `.profile`): the config is composed
  as Hydra composes it (a `-m` sweep: jobs that take every value of every swept key) and handed to
  what the app runs on it (`run_workload.run`, `run_search`, `pd_sweep`, the profile entry): a search
  stops where its deployments are about to be priced.
- `MAIN_STOPS` modules: their `main` runs with the command's arguments up to the stop named there.
- Any other module: its `main` runs until its argparse parser has read the arguments; where the
  module composes a run config from them (`RUN_CONFIGS`), that config is checked as a run's.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from command_cache_helpers import cache_compositions
from command_stop_helpers import Accepted, accept, reaches_work, stop_before_work
from omegaconf import DictConfig

from experiments.lib.fidelity_spec import server_overrides


def compose(config_name: str, overrides: list[str], hydra: bool = False) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra)


_CHECKED_RUNS: dict[tuple[str, ...], BaseException | None] = {}  # pages repeat runs: each is checked once


def check_run(overrides: list[str], out_dir: Path) -> None:
    """conf/config.yaml with `overrides`, through `run_workload.run` up to the backend's work."""
    from experiments.lib.run_workload import run
    key = tuple(overrides)
    if key not in _CHECKED_RUNS:
        try:
            cfg = compose("config", overrides)
            reaches_work(lambda: run(cfg, out_dir / f"run{len(_CHECKED_RUNS)}"), f"a run of {overrides}")
            _CHECKED_RUNS[key] = None
        except Exception as exc:  # noqa: BLE001 (raised again for every command making this run)
            _CHECKED_RUNS[key] = exc
    if _CHECKED_RUNS[key] is not None:
        raise _CHECKED_RUNS[key]


# --- Hydra apps ---------------------------------------------------------------------------------

# Hydra launcher plugins the pages name but the project does not install (pip install, as the page
# says): without the plugin, the command's `hydra` launcher overrides are left out of the check.
LAUNCHER_PLUGINS = {"submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
                    "ray": "hydra_plugins.hydra_ray_launcher"}


def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def hydra_jobs(args: tuple[str, ...], config_name: str) -> tuple[str, list[list[str]]]:
    """(config name, each job's overrides) of a Hydra app's command line. A `-m` sweep gives jobs
    that take every value of every swept key at least once (job i the i-th value of each)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    overrides, multirun, words = [], False, iter(args)
    for word in words:
        if word in ("-m", "--multirun"):
            multirun = True
        elif word in ("-cn", "--config-name"):
            config_name = next(words)
        elif word.startswith("-"):
            raise ValueError(f"{word}: a Hydra flag this check does not know")
        else:
            overrides.append(word)
    launcher = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra/launcher=")), None)
    if launcher in LAUNCHER_PLUGINS and not _installed(LAUNCHER_PLUGINS[launcher]):
        overrides = [o for o in overrides if not o.startswith(("hydra/launcher=", "hydra.launcher."))]
    if not multirun:
        return config_name, [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
              else [o.input_line] for o in parsed]
    return config_name, [[v[i % len(v)] for v in values] for i in range(max(map(len, values), default=1))]


def _hydra_app(config_name: str, work: Callable[[DictConfig, Path], Any] | None):
    """The check of a Hydra app's command line: each job's config handed to `work` (None: checked
    as a run, `check_run`)."""
    def check(module: str, args: tuple[str, ...], out_dir: Path) -> None:
        name, jobs = hydra_jobs(args, config_name)
        for overrides in jobs:
            if any(o.startswith("hydra") for o in overrides):
                compose(name, overrides, hydra=True)  # the launcher's settings compose too
            overrides = [o for o in overrides if not o.startswith("hydra")]
            if work is None:
                check_run(overrides, out_dir)
            else:
                cfg = compose(name, overrides)
                reaches_work(lambda cfg=cfg: work(cfg, out_dir), f"{module} {' '.join(overrides)}")
    return check


def _search(cfg: DictConfig, out_dir: Path) -> None:
    from experiments.lib.search.runner import run_search
    run_search(cfg, out_dir, progress=False)


def _disagg_sweep(cfg: DictConfig, out_dir: Path) -> None:
    from experiments.lib.search.pd_sweep import pd_sweep
    pd_sweep(cfg, out_dir, progress=False)


def _profile(cfg: DictConfig, out_dir: Path) -> None:
    import experiments.profile
    experiments.profile._main.__wrapped__(cfg)  # the app's body: the mode, then the steps' or operators' entry


# --- modules run from their main --------------------------------------------------------------

def run_main(module: str, args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> Any:
    """`python -m module args` in this process, up to a stop; what the stop was handed."""
    monkeypatch.setattr(sys, "argv", [f"python -m {module}", *args])
    mod = importlib.import_module(module)
    return reaches_work(mod.main, f"python -m {module}")


def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first argparse parse (the module's own parser, whichever parse method it calls) raises
    `Accepted` with its result; a parse inside it (parse_args calls parse_known_args) runs on."""
    depth = [0]
    for name in ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"):
        original = getattr(argparse.ArgumentParser, name)

        def parse(self, *args, _original=original, **kwargs):
            if depth[0]:
                return _original(self, *args, **kwargs)
            depth[0] += 1
            try:
                result = _original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            raise Accepted(result)
        monkeypatch.setattr(argparse.ArgumentParser, name, parse)


# module -> where its main starts its work (every stop of stop_before_work holds too).
MAIN_STOPS = {
    "engine.serve": "engine.serve.check_listen",  # its last check: the engine is built next
    "experiments.ab": "experiments.ab.compare",  # handed both configs: each is checked as a run
    "experiments.fidelity": "experiments.fidelity.Fidelity.warmup",  # the scenarios: checked as runs
    "experiments.search_check": "experiments.search_check.measure",  # the pick and neighbour chosen
    "experiments.what_if_fleet": None,  # its first search's simulations (stop_before_work)
}


def _bench_sim_runs(ns: argparse.Namespace) -> list[list[str]]:
    return [[f"workload={w}", f"workload.num_requests={ns.requests}", "latency=roofline", "blocks.kv_cache_gib=null",
             "progress=false", *ns.overrides] for w in ns.workloads.split(",")]


def _bench_throughput(ns: argparse.Namespace) -> list[list[str]]:
    from experiments.lib.engine_bench import BASE
    return [[*BASE, f"workload.num_requests={ns.num_requests}", f"workload.max_input_len={ns.max_input_len}",
             f"workload.max_output_len={ns.max_output_len}", *ns.overrides]]


def _profile_engine_step(ns: argparse.Namespace) -> list[list[str]]:
    from experiments.lib.engine_bench import BASE
    return [[*BASE, *ns.overrides]]


def _operator_breakdown(ns: argparse.Namespace) -> list[list[str]]:
    from experiments.lib.engine_bench import BASE
    base = [o for o in BASE if not o.startswith("backend=")] if ns.bench else []
    return [[*base, *ns.overrides, "backend=sim", "backend.fast_forward=false", "latency=operators"]]


# module -> the run configs it composes from its parsed arguments (as its main does).
RUN_CONFIGS: dict[str, Callable[[argparse.Namespace], list[list[str]]]] = {
    "experiments.bench_throughput": _bench_throughput,
    "experiments.lab.profile_engine_step": _profile_engine_step,
    "experiments.bench_online": lambda ns: [[*importlib.import_module("experiments.bench_online").COMMON,
                                             *ns.overrides, "backend=engine", "workload=nanovllm"]],
    "experiments.bench_sim": _bench_sim_runs,
    "experiments.bench_serving": lambda ns: [server_overrides(ns.overrides)],
    "experiments.lab.operator_breakdown": _operator_breakdown,
    "experiments.lab.operator_residuals": lambda ns: [["backend=sim", "latency=operators",
                                                       "scheduler.async_scheduling=true", *ns.overrides]],
    "experiments.profiles.synthetic_operators": lambda ns: [list(ns.overrides)],
}


def _check_fidelity(fid, names: list[str], engine_only: bool, out_dir: Path) -> None:
    """The command's overrides as its first scenario runs them (the capacity one where it runs: the
    module runs it first): the engine's run config, and the simulator's unless the command runs the
    engine only. The other scenarios differ by the spec file's overrides, which
    tests/runs/test_hydra_configs.py checks; a load scenario runs at 1 req/s here (its rate needs
    the capacity run)."""
    scenario = fid.spec["scenarios"][names[0]]
    overrides = [*fid.base, *scenario.get("overrides", []),
                 *(["workload.rate=1.0"] if scenario.get("load") is not None else [])]
    check_run([*overrides, *fid.spec["engine"]], out_dir)
    if not engine_only:
        profile = [f"latency.path={fid.profile_path()}"] if fid.profiled else []
        check_run([*overrides, *fid.spec["sim"], *profile], out_dir)


def check_main(module: str, args: tuple[str, ...], out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m module args` up to its work (`MAIN_STOPS`) or to its parse, then the run configs
    it makes from them."""
    if hasattr(mod := importlib.import_module(module), "default_run_dir"):  # its output folder by default
        monkeypatch.setattr(mod, "default_run_dir", lambda base: out_dir)
    if module == "experiments.fidelity":
        fidelity = mod
        chosen: list[str] = []  # the scenarios the command selects, in the order the module runs them
        select = fidelity.select_scenarios
        monkeypatch.setattr(fidelity, "select_scenarios", lambda *a: chosen.extend(select(*a)) or chosen)
    if module in MAIN_STOPS:
        if MAIN_STOPS[module]:
            monkeypatch.setattr(MAIN_STOPS[module], accept)  # a function, or `module.Class.method`
        value = run_main(module, args, monkeypatch)
        if module == "experiments.ab":  # compare(cfg_a, cfg_b, ...)
            for cfg in value[:2]:
                reaches_work(lambda cfg=cfg: _run_cfg(cfg, out_dir), "experiments.ab's run")
        if module == "experiments.fidelity":  # Fidelity.warmup(self)
            _check_fidelity(value[0], chosen, "--engine-only" in args, out_dir)
        return
    parse_only(monkeypatch)
    parsed = run_main(module, args, monkeypatch)
    ns = parsed[0] if isinstance(parsed, tuple) else parsed
    for overrides in RUN_CONFIGS.get(module, lambda ns: [])(ns):
        check_run(overrides, out_dir)


def _run_cfg(cfg: DictConfig, out_dir: Path) -> None:
    from experiments.lib.run_workload import run
    run(cfg, out_dir / "ab")


HYDRA_APPS = {
    "experiments.run": _hydra_app("config", None),
    "experiments.search": _hydra_app("search", _search),
    "experiments.disagg_sweep": _hydra_app("disagg_sweep", _disagg_sweep),
    "experiments.profile": _hydra_app("profile", _profile),
}


def check_command(module: str, args: tuple[str, ...], out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raises what the command would report (an exception, or SystemExit after printing it)."""
    cache_compositions(monkeypatch)
    stop_before_work(monkeypatch, out_dir)
    if module in HYDRA_APPS:
        HYDRA_APPS[module](module, args, out_dir)
    else:
        check_main(module, args, out_dir, monkeypatch)
