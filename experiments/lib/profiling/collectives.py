"""All-reduce and all-gather times by bytes over N processes, one per GPU, through the engine's own
group and all-reduce paths: NCCL (gloo on the CPU) and, where the GPUs allow it, the engine's
symmetric-memory one-shot and two-shot all-reduces (engine/distributed/symmetric_all_reduce.py).

The ranks join the engine's tensor-parallel group (`init_group`, with the symmetric-memory
all-reduce on and a buffer as large as the largest size timed on it), so the symmetric buffer, its
rendezvous and the fallback to NCCL are the engine's; rank 0 keeps the engine's one log line on
which all-reduce runs, which the profiler prints. Rows, per size: `all_reduce` (`dist.all_reduce`
in place, as the engine's NCCL path), `all_gather` (the engine's all-gather), and, when the
group has the symmetric paths, `all_reduce_one_shot` / `all_reduce_two_shot` (the engine's
`SymmetricAllReduce.reduce` on a message already in the symmetric buffer, where the engine's
row-parallel GEMMs write it) for every size the engine's rule lets them carry (`choose_path` with
the buffer as both bounds: the kernels' dtypes, whole 4-byte vectors). Both paths are timed at every
such size, whatever the thresholds: a run's `parallel` settings pick the path per message when the
simulator prices it (sim/latency/collective_pricing.py), so one profile serves any setting. Those
rows time torch's kernels (`symm_mem` ops) whatever `all_reduce_kernel` resolves to; the group is
opened with the Triton kernels (`all_reduce_kernel=triton_fused`) so that it also times
`all_reduce_add_rms_norm`: the engine's fused layer boundary (`SymmetricAllReduce.all_reduce_add_rms_norm`:
all-reduce, residual add and RMSNorm in one kernel) on messages of rows `fused_norm_width` wide
(the model's hidden size; operator_grid), at each size the symmetric paths take that holds one row or
more (rounded down to whole rows). Where a world size has those rows, a second pass opens its own
group with the barrier-free kernel (`all_reduce_kernel=triton_lamport`) and times its boundary at
the same sizes, `all_reduce_add_rms_norm_lamport`, each size from a forward's start (the kernel's
rounds, `begin_forward`); a failed pass leaves the Lamport kernel priced from the fused kernel's
rows, and the log says so. The Triton one-shot and two-shot kernels are not timed: the simulator
prices them from torch's rows. Where the group has no symmetric memory (the CPU, GPUs
without peer access) neither is timed, and the log line says so.

Each size is called 3 times, then `iters` calls are captured in one CUDA graph, as the engine's
steps capture them (eager calls would add the host's launch of each, ~25 us, which the engine's
graphs do not pay), and the graph is replayed after a barrier between CUDA events (wall clock on
the CPU). A rank's time is the mean per call; a row's is the fastest rank's: the ranks leave the
barrier at different moments and the earlier ones wait for the last, whose time is the
collectives' own. Every wait is bounded: the process group's timeout and `timeout_s` for the whole
world size, after which the workers are killed and the run fails naming the size.
experiments/bench_allreduce.py times the same calls (`all_reduce_call`, `mean_call_s`, `run_ranks`).
"""
from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from engine.config import CUSTOM_ALL_REDUCE_LIMIT_BYTES, ParallelConfig
from engine.distributed.all_reduce_path import NCCL, ONE_SHOT, TWO_SHOT, choose_path
from engine.distributed.lamport_all_reduce import LamportAllReduce
from engine.distributed.parallel_state import (
    TPGroup,
    _all_gather,
    end_group,
    init_group,
    join_store,
    open_store,
)
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from sim.latency.operator_file import ALL_REDUCE_PATH_OPS, FUSED_ALL_REDUCE, LAMPORT_FUSED_ALL_REDUCE

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


def lamport_rows(group: TPGroup, sizes: list[int], dtype: torch.dtype, device: torch.device, iters: int,
                 width: int) -> list[Row]:
    """One rank's share of the Lamport kernel's fused-boundary rows (a group opened with
    `all_reduce_kernel=triton_lamport`), at the fused rows' sizes that the kernel takes; each timed
    from a forward's start, so its rounds go 0, 1, 2, 1, 2, ... in the graph as in the engine's."""
    custom = group.custom
    if not isinstance(custom, LamportAllReduce):
        raise ValueError(f"op={LAMPORT_FUSED_ALL_REDUCE} needs a group opened with the Lamport kernel")  # noqa: TRY004
    mode = "graph" if device.type == "cuda" else "cpu"
    rows = []
    for nbytes in fused_sizes(sizes, dtype, group.size, width):
        if not custom.takes(nbytes, dtype):
            continue
        call = lamport_call(custom, nbytes, width, dtype, device)
        fastest = torch.tensor([mean_call_s(call, iters, mode, begin=custom.begin_forward)], device=device,
                               dtype=torch.float64)
        dist.all_reduce(fastest, op=dist.ReduceOp.MIN, group=group.device_group)
        rows.append({"op": LAMPORT_FUSED_ALL_REDUCE, "bytes": nbytes, "n": width, "world_size": group.size,
                     "time_s": float(fastest.item())})
    return rows


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


def collective_ops(group: TPGroup, sizes: list[int], dtype: torch.dtype, width: int) -> list[str]:
    """The ops a world size's rows hold: NCCL's always, the symmetric paths where the group has them
    and some size can take them, the fused boundary where the group's kernels fuse and some size
    holds a row."""
    symmetric = group.custom is not None and symmetric_sizes(sizes, dtype, group.size)
    fused = symmetric and group.custom.fused and fused_sizes(sizes, dtype, group.size, width)
    return ["all_reduce", "all_gather", *([ALL_REDUCE_PATH_OPS[p] for p in (ONE_SHOT, TWO_SHOT)] if symmetric else []),
            *([FUSED_ALL_REDUCE] if fused else [])]


def measured_rows(group: TPGroup, sizes: list[int], dtype: torch.dtype, device: torch.device, iters: int,
                  width: int) -> list[Row]:
    """One rank's share of the rows of every op and size (every rank calls this, in step)."""
    mode = "graph" if device.type == "cuda" else "cpu"
    world, rows = group.size, []
    path_of = {op: path for path, op in ALL_REDUCE_PATH_OPS.items()}
    symmetric = set(symmetric_sizes(sizes, dtype, world))
    for op in collective_ops(group, sizes, dtype, width):
        for nbytes in (fused_sizes(sizes, dtype, world, width) if op == FUSED_ALL_REDUCE else sizes):
            numel = message_numel(nbytes, dtype, world)
            extra: Row = {}
            if op == FUSED_ALL_REDUCE:
                numel, extra = nbytes // dtype.itemsize, {"n": width}
                call = fused_call(group, nbytes, width, dtype, device)
            elif op == "all_gather":
                out = torch.empty(numel, device=device, dtype=dtype)
                part = torch.ones(numel // world, device=device, dtype=dtype)
                call = (lambda o=out, p=part: _all_gather(o, p, group=group.device_group))
            elif op == "all_reduce" or numel * dtype.itemsize in symmetric:
                call = all_reduce_call(group, path_of[op], numel, dtype, device)
            else:
                continue
            fastest = torch.tensor([mean_call_s(call, iters, mode)], device=device, dtype=torch.float64)
            dist.all_reduce(fastest, op=dist.ReduceOp.MIN, group=group.device_group)
            rows.append({"op": op, "bytes": numel * dtype.itemsize, **extra, "world_size": world,
                         "time_s": float(fastest.item())})
    return rows


@contextmanager
def engine_all_reduce_log() -> Iterator[list[str]]:
    """The engine's log lines on which all-reduce runs ("all-reduce: ..."), kept while inside."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("all-reduce:"):
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


def _worker(rank: int, world: int, port: int, sizes: list[int], dtype: torch.dtype, cuda: bool, iters: int,
            timeout_s: float, width: int, results, kernel: str = "triton_fused") -> None:
    """One rank: every op's rows with the group opened with `kernel` ("triton_fused"), or only the
    Lamport kernel's fused-boundary rows ("triton_lamport")."""
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(rank)
        largest = max(symmetric_sizes(sizes, dtype, world), default=0)
        parallel = ParallelConfig(world, timeout_s, disable_custom_all_reduce=largest == 0,
                                  custom_all_reduce_max_bytes=-(-largest // 16) * 16,
                                  all_reduce_kernel=kernel)
        with engine_all_reduce_log() as said:
            group = init_group(join_store(port, world, timeout_s), rank, world, device, timeout_s, parallel)
        if not largest:
            said = [f"no message of the grid in {dtype} is one the symmetric-memory kernels take"]
        if kernel == "triton_lamport":
            rows = lamport_rows(group, sizes, dtype, device, iters, width) if group.custom is not None else []
        else:
            rows = measured_rows(group, sizes, dtype, device, iters, width)
        if rank == 0:
            results.put(("ok", (rows, " ".join(said) or "the engine logged no all-reduce line")))
        group.custom = None  # frees the symmetric buffer before the group ends
        end_group(4.0, 2.0)
    except BaseException:  # noqa: BLE001 - the parent reports it, naming the world size
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run_ranks(target: Callable[..., None], world: int, args: tuple, timeout_s: float) -> tuple[str, object]:
    """Spawn `target(rank, world, port, *args, results)` for every rank, meeting at a store opened
    here; ("ok", what rank 0 put) or ("error", why: a rank's error, its exit, the deadline). Every
    rank is joined or killed within `timeout_s` + 10 s."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = open_store(world, timeout_s)
    procs = [ctx.Process(target=target, args=(r, world, store.port, *args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outcome: tuple[str, object] = ("error", f"no result within {timeout_s:.0f}s")
    while time.monotonic() < deadline:
        try:
            outcome = results.get(timeout=1.0)
            break
        except Exception:  # noqa: BLE001 (queue.Empty: poll again; a dead rank ends the wait)
            if any(p.exitcode not in (None, 0) for p in procs):
                outcome = ("error", f"a rank exited with {[p.exitcode for p in procs]}")
                break
    for p in procs:
        p.join(max(0.0, min(10.0, deadline + 10.0 - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(2.0)
    return outcome


def collective_rows(world_sizes: list[int], sizes: list[int], dtype: torch.dtype, cuda: bool,
                    log, iters: int = 20, timeout_s: float = 120.0, width: int = 4096) -> list[Row]:
    """Rows for every world size the machine has (all GPUs needed on CUDA; any size on the CPU);
    `width`: the fused boundary's row width (elements)."""
    available = torch.cuda.device_count() if cuda else max(world_sizes)
    rows: list[Row] = []
    for world in world_sizes:
        if world > available:
            log(f"collectives: world_size={world} skipped ({available} GPUs here)")
            continue
        start = time.perf_counter()
        status, payload = run_ranks(_worker, world, (sizes, dtype, cuda, iters, timeout_s, width), timeout_s)
        if status != "ok":
            raise RuntimeError(f"collectives at world_size={world} failed: {payload}")
        got, said = payload
        rows.extend(got)
        ops = sorted({str(r["op"]) for r in got})
        symmetric = "" if {ALL_REDUCE_PATH_OPS[ONE_SHOT], ALL_REDUCE_PATH_OPS[TWO_SHOT]} <= set(ops) else \
            "NCCL rows only, no symmetric-memory rows: "
        if symmetric or FUSED_ALL_REDUCE not in ops:
            symmetric += (f"no {FUSED_ALL_REDUCE} rows (the simulator prices the fused boundary as all-reduce + "
                          f"add_rms_norm at N={world}): ")
        log(f"collectives: world_size={world}, {len(got)} rows ({', '.join(ops)}) in "
            f"{time.perf_counter() - start:.1f}s; {symmetric}the engine said: {said}")
        if FUSED_ALL_REDUCE in ops:  # the barrier-free kernel's boundary beside it, its group of its own
            status, payload = run_ranks(partial(_worker, kernel="triton_lamport"), world,
                                        (sizes, dtype, cuda, iters, timeout_s, width), timeout_s)
            lamport = payload[0] if status == "ok" else []
            rows.extend(lamport)
            log(f"collectives: world_size={world}, {len(lamport)} {LAMPORT_FUSED_ALL_REDUCE} rows" if lamport else
                f"collectives: world_size={world}, no {LAMPORT_FUSED_ALL_REDUCE} rows (the simulator prices the "
                f"Lamport kernel's boundary from the fused kernel's rows): {payload if status != 'ok' else payload[1]}")
    return rows
