"""`python -m experiments.bench_fleet_hop RUN_DIR [RUN_DIR ...]` or `--cpu OUT`: the engine fleet's
dispatch hop, read off engine traces.

For each run (a directory holding an engine run's `requests.parquet`, `events.parquet` and
`steps.parquet`, found anywhere under each RUN_DIR; a single engine's runs too, as the baseline):
- hop: arrival -> the replica's `arrived` event (the request taken into its engine), mean/p50/p90;
- arrival -> first scheduled, mean/p90;
- steps missed: how many of the replica's steps started between the arrival and the step that
  scheduled it, as shares. A request taken at the first boundary after its arrival misses 1 (the
  engine schedules a step while the one before it runs); each more is a boundary lost in the hop.

`--cpu OUT` first runs a fleet of 2 tiny-model replicas on the CPU (`backend=engine
cluster.replicas=2 model=tiny-qwen3`, Poisson arrivals; `--requests`, `--rate`, `--router`) into
OUT and reads it. On a CPU the steps are long and the cores shared, so the figures say how the
parent's loop behaves (no boundary lost to it), not what a GPU gives: GPU runs come from
`python -m experiments.fidelity --spec conf/fidelity/fleet.yaml --engine-only --runs R`.

`--synthetic` times the parent's loop alone (experiments/lib/fleet_feed.py) on the CPU: 2 stand-in
replica processes that step on a fixed period (`--step-ms`, 1.4: Qwen3-0.6B's decode step on an
H200), taking new requests between steps and reporting after each, as the engine replicas do;
Poisson arrivals (`--rate`, in all; requests alternate between the replicas). It prints the hop (arrival -> taken by the
replica) and the share of requests taken one boundary late. `--plain-wait` runs the loop with a
plain `multiprocessing.connection.wait` to the arrival time (whole milliseconds, rounded up), the
loop as it was before `wait_until`, for the A/B.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

CPU_FLEET = ["backend=engine", "model=tiny-qwen3", "backend.device=cpu", "blocks=prefix", "blocks.num_gpu_blocks=256",
             "blocks.swap_space_gib=0.01", "scheduler.max_model_len=256", "progress=false", "plots=false",
             "cluster.replicas=2", "workload=system_prompts", "workload.system_prompts.len=48",
             "workload.prompt_len.max=24", "workload.output_len.max=16", "workload.vocab_size=200"]


def hop_stats(run: Path) -> dict[str, float]:
    """The figures of one engine run (module docstring); times in ms."""
    r = pd.read_parquet(run / "requests.parquet").set_index("request_id")
    e = pd.read_parquet(run / "events.parquet")
    s = pd.read_parquet(run / "steps.parquet")
    if "replica" not in r:  # a single engine
        r["replica"], s["replica"] = 0, 0
    r["taken"] = e[e["event"] == "arrived"].set_index("request_id")["time"]
    missed = np.empty(len(r), dtype=int)
    for replica, g in r.groupby("replica"):
        starts = np.sort(s.loc[s["replica"] == replica, "time"].to_numpy())
        where = r.index.get_indexer(g.index)
        missed[where] = np.searchsorted(starts, g["first_scheduled_time"]) - np.searchsorted(starts, g["arrival_time"])
    hop = (r["taken"] - r["arrival_time"]) * 1e3
    sched = (r["first_scheduled_time"] - r["arrival_time"]) * 1e3
    shares = pd.Series(missed).value_counts(normalize=True)
    return {"n": len(r), "hop_mean": hop.mean(), "hop_p50": hop.median(), "hop_p90": hop.quantile(0.9),
            "sched_mean": sched.mean(), "sched_p90": sched.quantile(0.9),
            "missed_1": shares.get(1, 0.0), "missed_2+": shares[shares.index >= 2].sum()}


def engine_runs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("events.parquet")
                  if (p.parent / "requests.parquet").exists() and (p.parent / "steps.parquet").exists())


def run_cpu_fleet(out: Path, requests: int, rate: float, router: str) -> None:
    from experiments.lib import engine_fleet
    from experiments.lib.fidelity_spec import compose_cfg
    from experiments.lib.run_workload import run
    try:
        run(compose_cfg([*CPU_FLEET, f"workload.num_requests={requests}", f"workload.rate={rate}",
                         f"router={router}"]), out, "engine")
    finally:
        engine_fleet.release_fleet()


def _stand_in_replica(conn, step_s: float) -> None:
    """Step every `step_s`, taking the requests sent before each step and reporting after it; at the
    end send (times taken by request id, step start times)."""
    import time
    taken: dict[str, float] = {}
    starts: list[float] = []
    more = True
    while more or conn.poll():
        while conn.poll():
            message = conn.recv()
            if message[0] == "end":
                more = False
            else:
                taken[message[1]] = time.perf_counter()
        starts.append(time.perf_counter())
        time.sleep(step_s)
        conn.send(("step", 0, None))
    conn.send(("done", taken, starts))


def run_synthetic(requests: int, rate: float, step_ms: float, plain_wait: bool) -> dict[str, float]:
    """The feed's hop with stand-in replicas (module docstring), times in ms."""
    import multiprocessing
    import time
    from multiprocessing.connection import wait

    from experiments.lib import fleet_feed
    from policies.request import Request
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_stand_in_replica, args=(child, step_ms / 1e3), daemon=True) for _, child in pipes]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    rng = np.random.default_rng(0)
    arrivals = 0.5 + np.cumsum(rng.exponential(1 / rate, requests))
    reqs = [Request(str(k), [1], arrival_time=float(a)) for k, a in enumerate(arrivals)]
    done: dict[int, tuple] = {}

    def receive(i: int, message) -> None:
        if message[0] == "done":
            done[i] = message[1:]

    def dispatch(r, now: float) -> None:
        conns[int(r.request_id) % 2].send(("add", r.request_id))

    if plain_wait:
        fleet_feed.wait_until = lambda objs, deadline, clock=time.perf_counter: wait(objs, max(deadline - clock(), 0))
    start = time.perf_counter()
    try:
        fleet_feed.FleetFeed(conns, [p.sentinel for p in procs], reqs, start, dispatch, receive, 30.0).run(
            lambda: len(done) == 2)
    finally:
        for p in procs:
            p.join(10)
    hops, missed = [], []
    for i, (taken, starts) in done.items():
        starts = np.asarray(starts) - start
        for r in reqs[i::2]:
            t = taken[r.request_id] - start
            hops.append((t - r.arrival_time) * 1e3)
            missed.append(np.searchsorted(starts, t) - np.searchsorted(starts, r.arrival_time))
    missed_a = np.asarray(missed)
    return {"n": len(hops), "hop_mean": float(np.mean(hops)), "hop_p50": float(np.median(hops)),
            "hop_p90": float(np.quantile(hops, 0.9)), "late_share": float(np.mean(missed_a >= 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="directories holding engine runs")
    parser.add_argument("--cpu", type=Path, help="first run 2 tiny-model replicas on the CPU into this directory")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s of the CPU run")
    parser.add_argument("--router", default="prefix_aware")
    parser.add_argument("--synthetic", action="store_true", help="time the loop with stand-in replicas")
    parser.add_argument("--step-ms", type=float, default=1.4)
    parser.add_argument("--plain-wait", action="store_true", help="with --synthetic: the loop before wait_until")
    a = parser.parse_args()
    if a.synthetic:
        print(pd.Series(run_synthetic(a.requests, a.rate, a.step_ms, a.plain_wait)).to_string(float_format="%.3f"))
        return
    roots = list(a.runs)
    if a.cpu is not None:
        run_cpu_fleet(a.cpu, a.requests, a.rate, a.router)
        roots.append(a.cpu)
    if not roots:
        parser.error("give RUN_DIRs or --cpu OUT")
    rows = {str(run): hop_stats(run) for root in roots for run in engine_runs(root)}
    if not rows:
        parser.error(f"no engine run (requests/events/steps.parquet) under {', '.join(map(str, roots))}")
    print(pd.DataFrame.from_dict(rows, orient="index").to_string(float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
