"""The engine's replica set routes as the simulated fleet does: one recorded arrival stream of a
simulated fleet, and at each routing decision the engine side (`ReplicaSet.route`, its snapshots
built by `ReplicaView`s from the `ReplicaReport` each replica's scheduler gives, as an engine core
sends it) sees the same snapshots and its router (another instance, same config and seed) picks
the same replica ids."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

import sim.fleet.fleet as sim_fleet
from engine.online.host import EngineHost, NewRequest
from engine.online.replica_set import Replica, ReplicaSet
from experiments.lib import factory, fleet_backend
from policies.routing import RefreshClock, make_router, observe, report

FIELDS = ("replica", "num_waiting", "num_running", "num_swapped", "num_outstanding", "kv_blocks_used",
          "kv_blocks_total", "kv_tokens", "block_size")


class IdleHost(EngineHost):
    """A host that takes nothing: only the set's routing is exercised here."""

    info = None

    def bind(self, loop, sink): ...
    is_running = True
    def add(self, request): ...
    def abort(self, request_id): ...
    def num_waiting(self): return 0
    def stats(self): ...
    def health_problem(self): return None
    async def shutdown(self): ...


class EngineSideRecorder:
    """The simulated fleet's router, which also asks the engine's replica set at every decision."""

    def __init__(self, cfg, reports: dict[int, object], replicas: int) -> None:
        self.inner = fleet_backend.build_router(cfg)  # what the simulator routes with
        self.name = self.inner.name
        self.reports = reports
        self.set = ReplicaSet([Replica(i, IdleHost(), 16, 1) for i in range(replicas)],
                              fleet_backend.build_router(cfg))
        self.sim_choices: list[int] = []
        self.engine_choices: list[int] = []
        self.num_indexed = 0  # decisions where some replica's prefix index was not empty

    def route(self, request, snapshots):
        fleet = self.set.fleet
        for snap in snapshots:
            fleet.update(snap.replica, self.reports[snap.replica])
            fleet.outstanding[snap.replica] = snap.num_outstanding  # the engine side counts its own
            mirrored = fleet.snapshot(snap.replica, snap.taken_at, copy_index=False)
            assert [getattr(mirrored, f) for f in FIELDS] == [getattr(snap, f) for f in FIELDS]
            assert set(mirrored.cached_blocks) == set(snap.cached_blocks)
            self.num_indexed += bool(snap.cached_blocks)
        new = NewRequest(request.request_id, request.prompt_token_ids, request.sampling_params, request.priority,
                         request.tenant, request.arrival_time)
        self.engine_choices.append(self.set.route(new))
        chosen = self.inner.route(request, snapshots)
        self.sim_choices.append(chosen)
        return chosen


@pytest.mark.parametrize("router", ["round_robin", "random", "least_requests", "least_kv", "least_tokens",
                                    "prefix_aware"])
def test_engine_replica_set_routes_a_recorded_stream_as_the_simulator(monkeypatch, router):
    overrides = ["cluster.replicas=3", f"router={router}", "blocks=prefix", "blocks.kv_cache_gib=0.5",
                 "workload=system_prompts", "workload.num_requests=60", "workload.rate=150", "seed=3",
                 "progress=false", "plots=false"]
    if router == "prefix_aware":  # both of its rules (balance, cache match) decide some requests
        overrides.append("router.balance_abs_threshold=4")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    reports, sent = {}, {}

    def observe_and_report(replica, scheduler, num_outstanding, now, copy_index):
        reports[replica] = report(scheduler, sent.setdefault(replica, set()))  # what its core would send
        return observe(replica, scheduler, num_outstanding, now, copy_index)

    recorder = EngineSideRecorder(cfg, reports, 3)
    monkeypatch.setattr(sim_fleet, "observe", observe_and_report)
    monkeypatch.setattr(fleet_backend, "build_router", lambda _: recorder)
    fleet_backend.run_fleet(cfg, factory.workload(cfg), lambda n: None, fleet_backend.cluster_config(cfg))
    assert len(recorder.sim_choices) == 60
    assert recorder.engine_choices == recorder.sim_choices
    assert len(set(recorder.sim_choices)) > 1
    if router == "prefix_aware":
        assert recorder.num_indexed > 0  # the prefix indexes the reports carried were read


def test_refresh_clock_rebuilds_once_per_period():
    clock = RefreshClock(0.1)
    assert [clock.due(t) for t in (0.0, 0.05, 0.1, 0.15, 0.35, 0.36)] == [True, False, True, False, True, False]
    assert all(RefreshClock(0.0).due(t) for t in (0.0, 0.0, 1.0))


def test_kept_snapshots_skip_a_replica_that_stopped():
    cfg = {"name": "least_requests"}
    rs = ReplicaSet([Replica(i, IdleHost(), 16, 8) for i in range(2)], make_router(cfg), refresh_s=60.0)
    assert [s.replica for s in rs.fleet.snapshots(0.0)] == [0, 1]
    rs.fleet.lose(0)
    assert [s.replica for s in rs.fleet.snapshots(1.0)] == [1]
