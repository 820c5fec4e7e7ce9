"""One timed simulator run of `experiments.bench_sim`'s setup, as JSON on stdout.

`python sim_bench_probe.py WORKLOAD REQUESTS [overrides]` (a copy of this file outside any package,
run with PYTHONPATH at the tree to measure: `experiments.bench_sim --baseline REF` runs it for this
tree and for a baseline commit in turn, so it imports only what both trees have) prints
{"cpu_s", "wall_s", "steps", "sim_s", "tokens", "digest"}: CPU and wall seconds of the simulation
alone (SimPy loop, scheduler, trace recorder, latency model), and a SHA-256 over the trace files
the run writes (requests, steps and events parquet), so two trees' runs can be checked identical.
"""
from __future__ import annotations

import gc
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path


def config(workload_name: str, requests: int, overrides: list[str]):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[
            f"workload={workload_name}", f"workload.num_requests={requests}", "latency=roofline",
            "blocks.kv_cache_gib=null", "progress=false", *overrides])


def traces_digest(recorder) -> str:
    """SHA-256 over the run's trace files, in a fixed order."""
    from experiments.lib.traces import write_traces

    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        write_traces(recorder, tmp)
        for path in sorted(Path(tmp).iterdir()):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def measure(workload_name: str, requests: int, overrides: list[str]) -> dict:
    from experiments.lib import factory
    from experiments.lib.backends import run_backend
    from policies.trace import TraceRecorder

    cfg = config(workload_name, requests, overrides)
    workload, recorder = factory.workload(cfg).fresh(), TraceRecorder()
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_backend(cfg, workload, recorder)
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {"cpu_s": cpu_s, "wall_s": wall_s, "steps": result.num_steps, "sim_s": result.elapsed_s,
            "tokens": sum(r["output_len"] for r in recorder.requests), "digest": traces_digest(recorder)}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3:])))
