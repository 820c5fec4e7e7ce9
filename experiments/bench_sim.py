"""`python -m experiments.bench_sim [--workloads sharegpt,alpaca,poisson] [overrides]`: simulated
requests per wall-clock second.

For each workload: 10,000 requests with Poisson arrivals at the workload's default rate (ShareGPT-like:
~327 output tokens per request at 50 req/s; Alpaca-like: ~58 at 200 req/s; `poisson`, the conf
default: uniform lengths, ~272 output tokens at 20 req/s), roofline latency model, fcfs, paged
blocks, qwen3-0.6b on h200; one process, one core. Each workload's shape (rate, mean prompt and
output tokens, tokens per step) is printed with its figures. Timed: the simulation itself (SimPy loop
+ scheduler + trace recorder + latency model). Not timed, reported: building the workload and
writing the traces. The simulator fast-forwards runs of decode steps (sim/simulator.py), so the cost
is mostly per request (admission, finishing, ~2 decode runs) and per output token, little per step;
`backend.fast_forward=false` steps one by one (the same traces, for comparison). Target:
>= 5,000 simulated requests/s. Process CPU time is reported too: on a shared machine it is what an
idle core would give, and the load average before and after shows how shared it was. `--profile`
prints the top functions (cProfile) of one extra run of the first workload.

`--baseline REF` measures REF's tree (`git archive`) and this one paired instead: for each workload
and repetition one run of each, alternating, each in a fresh process (experiments/lib/sim_bench_probe.py),
and prints the median CPU-time req/s of both, their ratio, and whether the two trees wrote the same
trace files (requests, steps and events; SHA-256 of each run's files).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_module

from experiments.lib import factory
from experiments.lib.backends import run_backend
from experiments.lib.cli import check_at_least, run_cli
from experiments.lib.traces import write_traces
from policies.trace import TraceRecorder

NUM_REQUESTS = 10_000
TARGET = 5_000


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench(workload_name: str, requests: int, repeat: int, overrides: list[str]) -> dict:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"workload={workload_name}", f"workload.num_requests={requests}", "latency=roofline",
            "blocks.kv_cache_gib=null", "progress=false", *overrides])
    t0 = time.perf_counter()
    workload = factory.workload(cfg)
    build_s = time.perf_counter() - t0
    wall, cpu, recorder, result = [], [], None, None
    for _ in range(repeat):
        wl, recorder = workload.fresh(), TraceRecorder()
        t0, c0 = time.perf_counter(), time.process_time()
        result = run_backend(cfg, wl, recorder)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_traces(recorder, tmp)
        write_s = time.perf_counter() - t0
    tokens = sum(r["output_len"] for r in recorder.requests)
    wall_s, cpu_s = statistics.median(wall), statistics.median(cpu)
    return {"cfg": cfg, "workload": workload, "wall": wall, "wall_s": wall_s, "cpu_s": cpu_s, "tokens": tokens,
            "steps": result.num_steps, "sim_s": result.elapsed_s, "build_s": build_s, "write_s": write_s,
            "batch": tokens / max(result.num_steps, 1)}


def paired(baseline: str, workloads: list[str], requests: int, repeat: int, overrides: list[str]) -> None:
    """REF's tree and this one, one run each per repetition, alternating (module docstring)."""
    from experiments.lib import baseline_tree, sim_bench_probe

    work = Path(tempfile.mkdtemp(prefix="bench_sim_"))
    try:
        probe = work / "sim_bench_probe.py"  # a copy outside any package (see its docstring)
        shutil.copy(sim_bench_probe.__file__, probe)
        trees = {f"baseline {baseline}": baseline_tree.extract(baseline, work / "baseline"),
                 "this tree": baseline_tree.ROOT}
        print(f"{'workload':10s} {'tree':24s} {'cpu s runs':30s} {'req/s(cpu)':>10s} {'ratio':>6s} traces")
        for name in workloads:
            runs: dict[str, list[dict]] = {tree: [] for tree in trees}
            for r in range(repeat):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for tree in order:
                    env = {**os.environ, "PYTHONPATH": str(trees[tree])}
                    done = subprocess.run([sys.executable, str(probe), name, str(requests), *overrides],
                                          check=True, env=env, cwd=trees[tree], capture_output=True, text=True)
                    runs[tree].append(json.loads(done.stdout.splitlines()[-1]))
            rates = {tree: requests / statistics.median(run["cpu_s"] for run in rs) for tree, rs in runs.items()}
            digests = {run["digest"] for rs in runs.values() for run in rs}
            for tree, rs in runs.items():
                ratio = rates[tree] / rates[f"baseline {baseline}"]
                cpu = ", ".join(f"{run['cpu_s']:.2f}" for run in rs)
                print(f"{name:10s} {tree:24s} {cpu:30s} {rates[tree]:10,.0f} {ratio:6.2f} "
                      f"{'identical' if len(digests) == 1 else 'DIFFER'}")
    finally:
        shutil.rmtree(work)
    print(f"load average at the end: {_load()}")


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (conf/), applied to every workload")
    parser.add_argument("--workloads", default="sharegpt,alpaca,poisson",
                        help="conf/workload options, comma-separated")
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="measure REF's tree and this one paired (module docstring)")
    args = parser.parse_args(argv)
    check_at_least(parser, ("--requests", args.requests, 1), ("--repeat", args.repeat, 1))
    if not all(name.strip() for name in args.workloads.split(",")):
        parser.error(f"--workloads={args.workloads!r} is invalid: comma-separated conf/workload names")
    print(f"bench_sim: {args.requests:,} requests per workload, Poisson arrivals, roofline, "
          f"machine {platform.machine()} ({_cpu_name()}), python {platform.python_version()}, "
          f"load average {_load()}")
    if args.baseline is not None:
        paired(args.baseline, args.workloads.split(","), args.requests, args.repeat, args.overrides)
        return
    print(f"{'workload':10s} {'rate':>6s} {'prompt/req':>10s} {'out tok/req':>11s} {'steps':>8s} {'tok/step':>8s} "
          f"{'wall s':>7s} {'req/s':>8s} {'ns/token':>9s} {'cpu s':>7s} {'req/s(cpu)':>10s} target")
    first = None
    for name in args.workloads.split(","):
        r = bench(name, args.requests, args.repeat, args.overrides)
        first = first or r
        rate = args.requests / r["wall_s"]
        prompt = statistics.fmean(req.num_prompt_tokens for req in r["workload"].requests)
        print(f"{name:10s} {r['cfg'].workload.rate:6.0f} {prompt:10.0f} {r['tokens'] / args.requests:11.0f} {r['steps']:8d} "
              f"{r['batch']:8.1f} {r['wall_s']:7.3f} {rate:8,.0f} {r['wall_s'] / r['tokens'] * 1e9:9.0f} "
              f"{r['cpu_s']:7.3f} {args.requests / r['cpu_s']:10,.0f} {'met' if rate >= TARGET else 'NOT met'}")
        print(f"{'':10s} (simulated {r['sim_s']:.1f}s; wall runs {', '.join(f'{t:.2f}' for t in r['wall'])}; "
              f"not timed: workload {r['build_s']:.2f}s, writing traces {r['write_s']:.2f}s)")
    print(f"load average at the end: {_load()}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_backend(first["cfg"], first["workload"].fresh(), TraceRecorder())
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> None:
    """Bad options and config errors (an unknown workload, a bad override or --baseline) are one
    line `error: ...` and exit code 2."""
    run_cli(lambda: _main(argv))


if __name__ == "__main__":
    main()
