"""Backend dispatch for `experiments.run` / `experiments.ab`: `cfg.backend.name` -> a run function.

A backend is one function `run(cfg, workload, recorder, on_done) -> BackendRun`: it builds its
scheduler (`experiments.lib.factory.build_scheduler`, handing it `recorder`), feeds it `workload`'s
requests at their arrival times, executes every step, calls `on_done(n)` as n requests end, and
returns when all have ended. The `cluster` and `router` groups are checked here for every backend
(`check_cluster`); a backend that runs fleets reads the checked group with `cluster_config(cfg)`.
Adding a backend = one function here (or in a module imported here) registered with its config
dataclass (the keys of its yaml), `@BACKENDS.register("name", config=NameBackend)`, plus
`conf/backend/<name>.yaml` with `name: <name>`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from experiments.lib import factory
from experiments.lib.backend_run import BackendRun
from experiments.lib.fleet_backend import (
    build_router,
    cluster_config,
    replica_config,
    replica_latency,
    run_fleet,
)
from experiments.lib.serving_overhead import ServingOverhead
from experiments.lib.workloads import Workload
from policies.registry import Registry
from policies.trace import TraceRecorder

BackendFn = Callable[[DictConfig, Workload, TraceRecorder, Callable[[int], None]], BackendRun]
BACKENDS: Registry[BackendFn] = Registry("backend", field="name", group="backend")


def run_backend(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
                on_done: Callable[[int], None] = lambda n: None) -> BackendRun:
    name = cfg.backend.get("name")
    run = BACKENDS.get(name, where="backend")
    check_cluster(cfg, name)
    if cfg.get("parallel") is not None:
        factory.parallel_config(cfg)  # the engine's values only, on every backend
    return run(cfg, workload, recorder, on_done)


def check_cluster(cfg: DictConfig, backend: str) -> None:
    """The `cluster` and `router` settings, checked on every run of every backend, a one-replica
    run's included (which routes nothing, but a bad value there is as much a mistake, and
    `cluster.hardware` does change its GPU)."""
    cluster = cluster_config(cfg)
    if cfg.get("router") is not None:
        build_router(cfg)
    if cluster.replicas != 1 and backend not in ("sim", "engine"):
        raise ValueError(f"cluster.replicas={cluster.replicas!r} is invalid with backend={backend}: backend=sim "
                         "and backend=engine run a fleet (docs/fleet.md)")
    if cluster.hardware is not None and backend != "sim":
        raise ValueError(f"cluster.hardware={list(cluster.hardware)!r} is invalid with backend={backend}: it "
                         "picks simulated GPUs (backend=sim); this backend runs on real ones (set it to null)")


@dataclass(kw_only=True)
class SimBackendConfig:
    name: str = "sim"
    fast_forward: bool = True


@BACKENDS.register("sim", config=SimBackendConfig)
def run_sim(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
            on_done: Callable[[int], None]) -> BackendRun:
    from sim import Simulator
    cluster = cluster_config(cfg)
    vocab_size = factory.model_shape(cfg).vocab_size
    for request in workload.requests:  # the engine's add_request refuses these alike (Request.validate)
        request.sampling_params.check_vocabulary(vocab_size)
    if cluster.replicas != 1:
        return run_fleet(cfg, workload, on_done, cluster)
    if cluster.hardware is not None:  # one replica on the GPU it names (the fleet's rule at one replica)
        cfg = replica_config(cfg, cluster.hardware[0])
    gpu, cpu = factory.kv_block_counts(cfg)
    scheduler = factory.build_scheduler(cfg, gpu, cpu, recorder, workload)
    latency = replica_latency(cfg, cluster, 0)
    overhead = ServingOverhead.from_cfg(cfg)  # checked before the run, not after it
    result = Simulator(scheduler, latency, workload.requests, workload.stop_lens, on_done,
                       fast_forward=cfg.backend.get("fast_forward", True)).run()
    overhead.apply(recorder.requests)
    info = {"num_gpu_blocks": gpu, "num_cpu_blocks": cpu, "latency_model": latency.name}
    if cluster.hardware is not None:  # the GPU it ran on (the summary's `hardware` is the run's otherwise)
        info["hardware"] = cfg.hardware.name
    if latency.data_sources():  # what the prices rest on (measured operators, collectives' source)
        info["latency_data"] = latency.data_sources()
    if not overhead.is_zero:
        info["serving_overhead"] = overhead.describe()
    return BackendRun(result.num_steps, result.sim_time_s, "simulated", info)


@dataclass(kw_only=True)
class EngineBackendConfig:
    name: str = "engine"
    device: str | None = None
    dtype: str | None = None
    weights: str | None = None
    enforce_eager: bool = False
    decode_kernel: str | None = None


@BACKENDS.register("engine", config=EngineBackendConfig)
def run_engine(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
               on_done: Callable[[int], None]) -> BackendRun:
    cluster = cluster_config(cfg)
    if (cfg.get("cluster") or {}).get("roles") is not None:  # prefill/decode disaggregation: an engine pair
        from experiments.lib.engine_disagg import run_engine_pair  # imports torch: only when used
        return run_engine_pair(cfg, workload, recorder, on_done, cluster)
    if cluster.replicas != 1:
        from experiments.lib.engine_fleet import run_engine_fleet  # imports torch: only when used
        return run_engine_fleet(cfg, workload, on_done, cluster)
    from experiments.lib.engine_backend import run_engine as run_on_engine
    return run_on_engine(cfg, workload, recorder, on_done)


@dataclass(kw_only=True)
class ServerBackendConfig:
    name: str = "server"
    url: str | None = None
    model: str | None = None
    max_concurrency: int | None = None
    max_request_rate: float | None = None
    timeout_s: float | None = None


@BACKENDS.register("server", config=ServerBackendConfig)
def run_server(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
               on_done: Callable[[int], None]) -> BackendRun:
    """Any OpenAI-compatible server on the loopback address, timed on the client
    (experiments/lib/serving_client.py); the run's rows are the client's, there are no step rows."""
    import asyncio

    from experiments.lib.serving_client import ClientConfig, drive
    b = factory.section(cfg, "backend")
    client = ClientConfig(url=b.get("url"), model=b.get("model"),
                          max_concurrency=b.get("max_concurrency", 1024),
                          max_request_rate=b.get("max_request_rate", 10000.0), timeout_s=b.get("timeout_s", 3600.0))
    rows, info = asyncio.run(drive(workload, client, on_done))
    recorder.requests.extend(rows)
    elapsed = max((row["finish_time"] for row in rows), default=0.0)
    return BackendRun(0, elapsed, "wall", info)
