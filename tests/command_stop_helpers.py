"""Where a command starts its work (a simulation, an engine, a server, a search's simulations, a
profile's timing), `Accepted` is raised instead: everything the command does before that (its
parsing, its config checks, its workload) runs as it would.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class Accepted(BaseException):
    """Raised where a command would start its work; `value` is what it had made by then."""

    def __init__(self, value: Any = None) -> None:
        super().__init__(value)
        self.value = value


def accept(*args: Any, **kwargs: Any) -> None:
    """A stop: what it was handed (its positional arguments) is the `Accepted` value."""
    raise Accepted(args)


def _engine_built(args, *_: Any, **__: Any) -> None:
    args.check()  # what an engine checks before any weight loads
    raise Accepted(args)


def stop_before_work(monkeypatch: pytest.MonkeyPatch, out_dir: Path) -> None:
    """Every place a run or a search starts its work raises `Accepted`; output folders a command
    picks itself go under `out_dir`."""
    import engine.config
    from engine.engine_args import EngineArgs
    from experiments.lib import engine_backend, engine_disagg, engine_fleet, run_dirs, serving_client
    from experiments.lib.profiling import collectives, operators
    from experiments.lib.search import runner
    from sim.fleet.disagg import DisaggFleetSimulator
    from sim.fleet.fleet import FleetSimulator
    from sim.simulator import Simulator
    for cls in (Simulator, FleetSimulator, DisaggFleetSimulator):
        monkeypatch.setattr(cls, "run", accept)
    for module, name in ((runner, "ResultCache"), (serving_client, "drive"), (operators, "compute_rows"),
                         (collectives, "collective_rows")):
        monkeypatch.setattr(module, name, accept)
    for module, name in ((engine_backend, "LLMEngine"), (engine_disagg, "DisaggregatedEngine"),
                         (engine_fleet, "EngineFleet")):
        monkeypatch.setattr(module, name, _engine_built)
    # The pages' engine and profile commands are for a GPU, which this machine may lack: the engine's
    # arguments are made for one, the profile's checks run as on the CPU (its device is not checked).
    monkeypatch.setattr(EngineArgs, "resolve_device", lambda self: self.device or "cuda")
    monkeypatch.setattr(engine.config, "resolve_device", lambda device=None: "cpu")
    monkeypatch.setattr(run_dirs, "default_run_dir", lambda base: out_dir)
    import experiments.profile
    monkeypatch.setattr(experiments.profile, "build_runner", accept)


def reaches_work(call: Callable[[], Any], what: str) -> Any:
    """What the stop `call` reached was handed; an error if it reached none."""
    try:
        call()
    except Accepted as stop:
        return stop.value
    raise AssertionError(f"{what} ended without reaching its work: no stop of stop_before_work covers it")


