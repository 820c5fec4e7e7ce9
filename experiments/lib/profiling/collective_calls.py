"""The calls the collectives profiler times and how it times them (experiments/lib/profiling/collectives.py,
experiments/bench_allreduce.py, experiments/lib/profiling/sequence_parallel_rows.py): each op as a
zero-argument call on the engine's group and buffers, the message sizes each path takes,
`mean_call_s`, a call's mean time captured in a CUDA graph (back to back eagerly, or by wall clock
on the CPU), `fastest_s`, a row's time from the ranks', and `engine_log`, the engine's start-up
lines that say which paths its group took."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from engine.distributed.all_reduce_path import NCCL, choose_path
from engine.distributed.lamport_all_reduce import LamportAllReduce
from engine.distributed.parallel_state import TPGroup
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from engine.parallel_config import CUSTOM_ALL_REDUCE_LIMIT_BYTES
from sim.latency.operator_file import FUSED_ALL_REDUCE, LAMPORT_FUSED_ALL_REDUCE

Row = dict[str, float | str]
ENGINE_LOGGER = "servelab.engine"
FUSED_EPS = 1e-6  # the fused rows' RMSNorm epsilon (its value does not change the kernel's time)


def message_numel(nbytes: int, dtype: torch.dtype, world: int) -> int:
    """Elements of the message timed for `nbytes`: a multiple of the world size (the all-gather's parts)."""
    return max(world, nbytes // dtype.itemsize // world * world)


def symmetric_sizes(sizes: list[int], dtype: torch.dtype, world: int) -> list[int]:
    """The message bytes of `sizes` that the symmetric paths can carry (the engine's rule, with a
    buffer of up to the largest any setting may ask for)."""
    nbytes = [message_numel(n, dtype, world) * dtype.itemsize for n in sizes]
    limit = CUSTOM_ALL_REDUCE_LIMIT_BYTES
    return [n for n in nbytes if choose_path(n, dtype, True, limit, limit) != NCCL]


def all_reduce_call(group: TPGroup, path: str, numel: int, dtype: torch.dtype,
                    device: torch.device) -> Callable[[], object]:
    """The engine's all-reduce of `path` on a message of `numel` elements as a zero-argument call:
    NCCL's (gloo's on the CPU) sums a tensor in place on the device group; one-shot and two-shot
    sum a message already in the symmetric buffer into a new tensor."""
    if path == NCCL:
        x = torch.randn(numel, dtype=dtype, device=device)
        return lambda: dist.all_reduce(x, group=group.device_group)
    if group.custom is None:
        raise ValueError(f"path={path!r} needs the group's symmetric-memory all-reduce, which is off")
    staged = group.custom.buffer[:numel * dtype.itemsize].view(dtype)
    staged.normal_()
    custom = torch_kernels(group.custom)
    return lambda: custom.reduce(path, staged)


def torch_kernels(custom: SymmetricAllReduce) -> SymmetricAllReduce:
    """The group's symmetric buffer summed by torch's kernels, whichever kernels the group opened
    (the Triton ones share the buffer and the signal pads, which every kernel leaves zero)."""
    if custom.peers is None:
        return custom
    return SymmetricAllReduce(custom.buffer, custom.group_name, custom.one_shot_max, custom.two_shot_max,
                              custom.handle, ops=custom.ops)


def fused_sizes(sizes: list[int], dtype: torch.dtype, world: int, width: int) -> list[int]:
    """The message bytes the fused rows are timed at: each symmetric size's whole rows of `width`
    elements (at least one), without repeats."""
    row = width * dtype.itemsize
    return sorted({n // row * row for n in symmetric_sizes(sizes, dtype, world) if n >= row})


def lamport_call(custom: LamportAllReduce, nbytes: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> Callable[[], object]:
    """The barrier-free kernel's fused boundary on a message of `nbytes` (rows of `width` elements),
    read where the row-parallel GEMM leaves it (anywhere: the kernel pushes it to its peers itself)."""
    rows = nbytes // (width * dtype.itemsize)
    partial = torch.randn(rows, width, dtype=dtype, device=device)
    residual = torch.randn(rows, width, dtype=dtype, device=device)
    weight = torch.ones(width, dtype=dtype, device=device)

    def call():
        return custom.all_reduce_add_rms_norm(partial, residual, weight, FUSED_EPS)

    if not (custom.takes(nbytes, dtype) and custom.fuses_rows(partial, residual)):
        raise ValueError(f"op={LAMPORT_FUSED_ALL_REDUCE}: the Lamport kernel does not take {rows} rows of {width} "
                         f"{dtype} ({nbytes} bytes)")
    return call


def fused_call(group: TPGroup, nbytes: int, width: int, dtype: torch.dtype,
               device: torch.device) -> Callable[[], object]:
    """The engine's fused boundary on a message of `nbytes` (rows of `width` elements) already in
    the symmetric buffer, where the row-parallel GEMM writes it: all-reduce + residual add + RMSNorm."""
    custom = group.custom
    if custom is None or not custom.fused:
        raise ValueError(f"op={FUSED_ALL_REDUCE} needs the group's fused symmetric-memory kernels, which are off")
    rows = nbytes // (width * dtype.itemsize)
    usable = custom.buffer.numel() // dtype.itemsize * dtype.itemsize
    custom.buffer[:usable].view(dtype).normal_()  # every region holds rows of partial sums
    residual = torch.randn(rows, width, dtype=dtype, device=device)
    weight = torch.ones(width, dtype=dtype, device=device)

    def call():  # in the region the engine's GEMM would write it to (no copy in)
        staged = custom.input_buffer((rows, width), dtype)
        return None if staged is None else custom.all_reduce_add_rms_norm(staged, residual, weight, FUSED_EPS)

    if call() is None:
        raise ValueError(f"op={FUSED_ALL_REDUCE}: the fused kernel does not take {rows} rows of {width} {dtype} "
                         f"({nbytes} bytes); operator_grid.fused_norm_width must be one it takes")
    return call


def mean_call_s(call: Callable[[], object], iters: int, mode: str = "graph", replays: int = 1,
                begin: Callable[[], object] | None = None) -> float:
    """Mean seconds per call of `call` after 3 warm-up calls and a barrier of the default group:
    `iters` calls captured in one CUDA graph and replayed `replays` times ("graph"), back to back
    between CUDA events ("eager"), or back to back by wall clock ("cpu"). `begin`, if given, runs
    before the captured or timed calls (a forward's start: the Lamport kernel's rounds restart)."""
    if mode not in ("graph", "eager", "cpu"):
        raise ValueError(f"mode={mode!r} is invalid: 'graph', 'eager' or 'cpu'")
    for _ in range(3):
        call()
    if begin is not None:
        begin()
    if mode == "cpu":
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    graph = None
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                call()
        graph.replay()  # the first replay sets up the captured collectives
        torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays if graph is not None else 1):
        if graph is not None:
            graph.replay()
        else:
            for _ in range(iters):
                call()
    end.record()
    end.synchronize()
    if graph is not None:
        graph.reset()  # NCCL's teardown waits until no graph holds the communicator
    return start.elapsed_time(end) / 1e3 / (iters * (replays if graph is not None else 1))


def fastest_s(seconds: float, group: TPGroup, device: torch.device) -> float:
    """The fastest rank's mean seconds (every rank calls this, in step): the ranks leave the timing
    barrier at different moments and the earlier ones wait for the last."""
    fastest = torch.tensor([seconds], device=device, dtype=torch.float64)
    dist.all_reduce(fastest, op=dist.ReduceOp.MIN, group=group.device_group)
    return float(fastest.item())


@contextmanager
def engine_log(prefix: str) -> Iterator[list[str]]:
    """The engine's log lines that start with `prefix` (rank 0's "all-reduce: ..." or
    "sequence-parallel steps ..."), kept while inside."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith(prefix):
                lines.append(record.getMessage())

    logger, handler = logging.getLogger(ENGINE_LOGGER), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
