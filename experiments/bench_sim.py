"""`python -m experiments.bench_sim [overrides]`: simulated requests per wall-clock second.

Default: 10,000 requests of the default workload (ShareGPT-like lengths, Poisson arrivals) with the
roofline latency model, fcfs, paged blocks; one process, one core. Timed: the simulation itself
(SimPy loop + scheduler + recorder + latency model). Reported separately: building the workload and
writing the traces. Target: >= 5,000 simulated requests/s. Extra Hydra overrides are passed on,
e.g. `python -m experiments.bench_sim workload=poisson workload.rate=100`.
"""
from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import statistics
import tempfile
import time

from hydra import compose, initialize_config_module

from experiments import factory
from experiments.backends import run_backend
from experiments.traces import write_traces
from policies.trace import TraceRecorder

NUM_REQUESTS = 10_000
TARGET = 5_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (conf/)")
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    args = parser.parse_args()
    overrides = [f"workload.num_requests={args.requests}", "latency=roofline", "progress=false", *args.overrides]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    t0 = time.perf_counter()
    workload = factory.workload(cfg)
    build_s = time.perf_counter() - t0
    times, recorder, result = [], None, None
    for _ in range(args.repeat):
        wl, recorder = workload.fresh(), TraceRecorder()
        t0 = time.perf_counter()
        result = run_backend(cfg, wl, recorder)
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_traces(recorder, tmp)
        write_s = time.perf_counter() - t0
    sim_s = statistics.median(times)
    rate = args.requests / sim_s
    tokens = sum(r["output_len"] for r in recorder.requests)
    print(f"bench_sim: {args.requests} requests, workload={workload.name} ({cfg.workload.get('arrival', '-')}, "
          f"rate={cfg.workload.get('rate')}), policy={cfg.policy.name}, blocks={cfg.blocks.kind}, "
          f"latency={cfg.latency.name}, model={cfg.model.name}, hardware={cfg.hardware.name}")
    print(f"  machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"  simulated {result.elapsed_s:.1f}s in {result.num_steps} steps, {tokens} output tokens")
    print(f"  simulation wall time: {sim_s:.3f}s (median of {args.repeat}: "
          f"{', '.join(f'{t:.3f}' for t in times)})")
    print(f"  -> {rate:,.0f} simulated requests/s, {tokens / sim_s:,.0f} output tokens/s, "
          f"{sim_s / result.num_steps * 1e6:.1f} us/step (target >= {TARGET:,} req/s: "
          f"{'met' if rate >= TARGET else 'NOT met'})")
    print(f"  not timed: building the workload {build_s:.3f}s, writing traces {write_s:.3f}s")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_backend(cfg, workload.fresh(), TraceRecorder())
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
