"""All-reduce and all-gather times by bytes over N processes, one per GPU (NCCL), or on the CPU (gloo).

The engine's tensor-parallel ranks sum activations with `dist.all_reduce` and gather logits with
its all-gather (engine/distributed/parallel_state.py); here the same calls run in N
spawned processes (torch.multiprocessing + torch.distributed over a local TCP rendezvous). Each
size is called 3 times, then `iters` calls are captured in one CUDA graph, as the engine's steps
capture them (eager calls would add the host's launch of each, ~25 us, which the engine's graphs
do not pay), and the graph is replayed after a barrier between CUDA events (wall clock on the CPU).
A rank's time is the mean per call; a row's is the fastest rank's: the ranks leave the barrier at
different moments and the earlier ones wait for the last, whose time is the collectives' own.
Every wait is bounded:
the process group's timeout and `timeout_s` for the whole world size, after which the workers
are terminated and the run fails naming the size.
"""
from __future__ import annotations

import datetime
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.parallel_state import _all_gather

Row = dict[str, float | str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: list[int], dtype: torch.dtype, cuda: bool,
            iters: int, results: mp.Queue, timeout_s: float) -> None:
    try:
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        rows = []
        for op in ("all_reduce", "all_gather"):
            for nbytes in sizes:
                numel = max(world, nbytes // dtype.itemsize // world * world)
                out = torch.ones(numel, device=dev, dtype=dtype)
                part = torch.ones(numel // world, device=dev, dtype=dtype)
                call = ((lambda o=out: dist.all_reduce(o)) if op == "all_reduce"
                        else (lambda o=out, p=part: _all_gather(o, p)))
                for _ in range(3):
                    call()
                seconds = _time(call, iters, cuda)
                fastest = torch.tensor([seconds], device=dev, dtype=torch.float64)
                dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
                rows.append({"op": op, "bytes": numel * dtype.itemsize, "world_size": world,
                             "time_s": float(fastest.item())})
        if rank == 0:
            results.put(("ok", rows))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent reports it, naming the world size
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def _time(call, iters: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                call()
        graph.replay()  # the first replay sets up the captured collectives
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def collective_rows(world_sizes: list[int], sizes: list[int], dtype: torch.dtype, cuda: bool,
                    log, iters: int = 20, timeout_s: float = 120.0) -> list[Row]:
    """Rows for every world size the machine has (all GPUs needed on CUDA; any size on the CPU)."""
    available = torch.cuda.device_count() if cuda else max(world_sizes)
    rows: list[Row] = []
    ctx = mp.get_context("spawn")
    for world in world_sizes:
        if world > available:
            log(f"collectives: world_size={world} skipped ({available} GPUs here)")
            continue
        start = time.perf_counter()
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, sizes, dtype, cuda, iters, results, timeout_s),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            status, payload = results.get(timeout=timeout_s)
        except queue.Empty:
            status, payload = "error", f"no result within {timeout_s:.0f}s"
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        if status != "ok":
            raise RuntimeError(f"collectives at world_size={world} failed: {payload}")
        rows.extend(payload)
        log(f"collectives: world_size={world}, {len(payload)} rows in {time.perf_counter() - start:.1f}s")
    return rows
