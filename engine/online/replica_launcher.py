"""Start the replicas of a `ReplicaSet` (engine/online/replica_set.py).

    replicas = launch_replica_set(EngineArgs(model=...), data_parallel_size=2,
                                  router=make_router({"name": "least_requests"}))
    engine = AsyncLLMEngine(replicas)          # the server's engine, as for one replica

A launcher (registered in `REPLICA_LAUNCHERS`, chosen by `--replica-launcher`) starts one replica's
engine host from that replica's `EngineArgs` and returns it as a `Replica`:
- `local` (default): an engine core process on this machine (engine/online/engine_core.py);
- `ray`: the engine core in an actor of a Ray cluster, on whichever host has its GPUs
  (engine/online/ray_launcher.py).
Replica i of a set on CUDA gets its own GPUs: `cuda:(first + i x tensor_parallel_size)` and the
tensor-parallel group's next ones (`first`: the device the arguments name, default 0). On the CPU
every replica is a CPU process. The replicas start together; if one cannot start, those started
are stopped and its error is raised.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

from engine.engine_args import EngineArgs
from engine.online.engine_core import EngineCoreClient
from engine.online.process_host import ProcessHost
from engine.online.replica_set import (
    DEFAULT_TIMEOUT_S,
    REPLICA_LAUNCHERS,
    Replica,
    ReplicaSet,
    check_replica_timeout,
)
from policies.routing import Router


@REPLICA_LAUNCHERS.register("local")
def launch_local(replica: int, args: EngineArgs, data_parallel_size: int, keep_trace: bool,
                 report_index: bool) -> Replica:
    args = replica_args(args, replica, data_parallel_size)
    client = EngineCoreClient(args, keep_trace, report_index=report_index)
    return Replica(replica, ProcessHost(client), args.block_size, client.info.num_gpu_blocks)


def replica_args(args: EngineArgs, replica: int, data_parallel_size: int, gpus: int | None = None,
                 cores: int | None = None) -> EngineArgs:
    """Replica `replica`'s arguments: its own GPUs on CUDA (module docstring). `gpus`: the GPUs
    there are (None: count them here). On the CPU each replica is a process with its own engine:
    at most one a core (`cores`; None: `os.cpu_count()`)."""
    device = args.device or args.resolve_device()
    if not device.startswith("cuda"):
        cores = (os.cpu_count() or 1) if cores is None else cores
        if data_parallel_size > cores:
            raise ValueError(f"data_parallel_size={data_parallel_size} is invalid: {data_parallel_size} CPU replicas "
                             f"(each a process with its own engine) on a machine of {cores} cores: at most {cores}")
        return args
    first, tp = int(device.partition(":")[2] or 0), args.tensor_parallel_size
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count()
    if first + data_parallel_size * tp > gpus:
        raise ValueError(f"data_parallel_size={data_parallel_size} is invalid: {data_parallel_size} replicas of "
                         f"{tp} GPU(s) from cuda:{first} need {first + data_parallel_size * tp} GPUs, "
                         f"this machine has {gpus}")
    return dataclasses.replace(args, device=f"cuda:{first + replica * tp}")


def check_data_parallel_size(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"data_parallel_size={n!r} is invalid: must be an integer >= 1")
    return n


def launch_replica_set(args: EngineArgs, data_parallel_size: int, router: Router, refresh_s: float = 0.0,
                       launcher: str = "local", keep_trace: bool = False,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> ReplicaSet:
    """`data_parallel_size` replicas of `args`, started by `launcher`, behind `router`; a replica
    with requests that sends nothing for `timeout_s` is hung (engine/online/replica_set.py)."""
    n = check_data_parallel_size(data_parallel_size)
    check_replica_timeout(timeout_s)
    launch = REPLICA_LAUNCHERS.get(launcher)
    if launcher == "local":
        replica_args(args, n - 1, n)  # enough GPUs: checked before any replica starts
    with ThreadPoolExecutor(n, thread_name_prefix="servelab-replica-start") as pool:
        futures = [pool.submit(launch, i, args, n, keep_trace, router.reads_prefix_index) for i in range(n)]
        started, error = [], None
        for future in futures:
            try:
                started.append(future.result())
            except BaseException as exc:  # noqa: BLE001 (raised below, once the others are stopped)
                error = error or exc
    if error is not None:
        if started:
            asyncio.run(_stop(started))
        raise error
    return ReplicaSet(started, router, refresh_s, timeout_s)


async def _stop(replicas: list[Replica]) -> None:
    await asyncio.gather(*(r.host.shutdown() for r in replicas), return_exceptions=True)


from engine.online import ray_launcher  # noqa: E402, F401 (registers "ray"; imports ray only when it launches)

__all__ = ["REPLICA_LAUNCHERS", "check_data_parallel_size", "launch_local", "launch_replica_set", "replica_args"]
