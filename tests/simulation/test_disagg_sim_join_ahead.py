"""The simulated P/D decode replica runs the scheduler's join rule unchanged (`scheduler.join_ahead`,
policies/lookahead.py): with it, a request received while a step runs joins the step after it,
scheduled ahead, so the replica's synchronous steps are its cold starts alone (a step decided with
nothing in flight); without it, receives while the replica decodes add synchronous steps, which the
latency model prices as synchronous (`SchedulerOutput.ahead` false)."""
from __future__ import annotations

from hydra import compose, initialize_config_module

from experiments.lib import factory
from experiments.lib.fleet_backend import cluster_config, run_fleet

PAIR = ["workload.num_requests=60", "workload.rate=200", "progress=false", "plots=false", "seed=3",
        "cluster.replicas=2", "cluster.roles=[prefill,decode]", "scheduler.async_scheduling=true"]


def decode_steps(monkeypatch, join_ahead: bool) -> tuple[list[tuple[bool, bool]], list[dict]]:
    """The decode replica's steps as (scheduled ahead, cold: the running queue was empty after the
    replica's step before it), and its request rows."""
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*PAIR, f"scheduler.join_ahead={str(join_ahead).lower()}"])
    built, steps, idle = [], [], [True]
    build = factory.build_scheduler

    def recorded(*args, **kwargs):
        scheduler = build(*args, **kwargs)
        built.append(scheduler)
        if len(built) == 2:  # replica 1: the decode replica
            update = scheduler.update

            def noted(out, *rest, **kw):
                ended = update(out, *rest, **kw)
                if out.scheduled:
                    steps.append((out.ahead, idle[0]))
                idle[0] = not scheduler.num_running
                return ended

            scheduler.update = noted
        return scheduler

    monkeypatch.setattr(factory, "build_scheduler", recorded)
    result = run_fleet(cfg, factory.workload(cfg), lambda n: None, cluster_config(cfg))
    return steps, result.replica_recorders[1].requests


def test_join_ahead_leaves_only_cold_starts_synchronous_and_keeps_every_token(monkeypatch):
    on, rows_on = decode_steps(monkeypatch, True)
    off, rows_off = decode_steps(monkeypatch, False)
    assert len(rows_on) == 60 and all(row["status"] == "finished" for row in rows_on)
    sync_on, sync_off = ([cold for ahead, cold in steps if not ahead] for steps in (on, off))
    assert sync_on and all(sync_on)  # cold starts alone (this load: the first step only)
    assert sum(not cold for cold in sync_off) > 10  # without the rule, receives while decoding break it
    assert len(on) == len(off)  # the same steps, but for when they are decided
    tokens = lambda rows: sorted((row["request_id"], row["output_len"]) for row in rows)
    assert tokens(rows_on) == tokens(rows_off)
