"""All-reduce, all-gather and reduce-scatter times by bytes over N processes, one per GPU, through
the engine's own group and all-reduce paths: NCCL (gloo on the CPU) and, where the GPUs allow it,
the engine's symmetric-memory one-shot and two-shot all-reduces
(engine/distributed/symmetric_all_reduce.py); and, where the grid asks for them, the
sequence-parallel layer boundaries (their GEMMs with their row collectives).

The ranks join the engine's tensor-parallel group (`init_group`, with the symmetric-memory
all-reduce on and a buffer as large as the largest size timed on it), so the symmetric buffer, its
rendezvous and the fallback to NCCL are the engine's; rank 0 keeps the engine's one log line on
which all-reduce runs, which the profiler prints. Rows, per size: `all_reduce` (`dist.all_reduce` in
place, as the engine's NCCL path), `all_gather` (the engine's all-gather), `reduce_scatter` (the
engine's reduce-scatter, `bytes` the input on each rank: a sequence-parallel step's row collective),
and, when the group has the symmetric paths, `all_reduce_one_shot` / `all_reduce_two_shot` (the
engine's `SymmetricAllReduce.reduce` on a message already in the symmetric buffer, where the
engine's row-parallel GEMMs write it) for every size the engine's rule lets them carry
(`choose_path` with the buffer as both bounds: the kernels' dtypes, whole 4-byte vectors). Both
paths are timed at every such size, whatever the thresholds: a run's `parallel` settings pick the
path per message when the simulator prices it (sim/latency/collective_pricing.py), so one profile
serves any setting. Those rows time torch's kernels (`symm_mem` ops) whatever `all_reduce_kernel`
resolves to; the group is opened with the Triton kernels (`all_reduce_kernel=triton_fused`) so that
it also times `all_reduce_add_rms_norm`: the engine's fused layer boundary
(`SymmetricAllReduce.all_reduce_add_rms_norm`: all-reduce, residual add and RMSNorm in one kernel)
on messages of rows `fused_norm_width` wide (the model's hidden size; operator_grid), at each size
the symmetric paths take that holds one row or more (rounded down to whole rows). Where a world size
has those rows, a second pass opens its own group with the barrier-free kernel
(`all_reduce_kernel=triton_lamport`) and times its boundary at the same sizes,
`all_reduce_add_rms_norm_lamport`, each size from a forward's start (the kernel's rounds,
`begin_forward`); a failed pass leaves the Lamport kernel priced from the fused kernel's rows, and
the log says so. The Triton one-shot and two-shot kernels are not timed: the simulator prices them
from torch's rows. Where the group has no symmetric memory (the CPU, GPUs without peer access)
neither is timed, and the log line says so.

Where `operator_grid.sequence_parallel_m` is given, a last pass per world size opens a group of its
own with the sequence-parallel path on and times `all_gather_matmul` / `matmul_reduce_scatter` [m,
k, n] as the engine's group runs them (torch's fused symmetric-memory ops where it has them, else
the collective and the GEMM; experiments/lib/profiling/sequence_parallel_rows.py, which says how);
its log line gives the engine's words on which ran; a failed pass leaves the file without those
rows, and the log says why.

Each size is called 3 times, then `iters` calls are captured in one CUDA graph, as the engine's
steps capture them (eager calls would add the host's launch of each, ~25 us, which the engine's
graphs do not pay), and the graph is replayed after a barrier between CUDA events (wall clock on
the CPU); the boundaries' cells are called back to back eagerly instead, as the engine runs its
sequence-parallel steps. A rank's time is the mean per call; a row's is the fastest rank's: the
ranks leave the barrier at different moments and the earlier ones wait for the last, whose time is
the collectives' own. Every wait is bounded: the process group's timeout and `timeout_s` for each
pass of a world size, after which the workers are killed and the run fails naming the size (the
Lamport and boundary passes: the log says so, and the file goes without their rows).
The calls and their timing are experiments/lib/profiling/collective_calls.py's; experiments/bench_allreduce.py
times the same calls (`all_reduce_call`, `mean_call_s`, and `run_ranks` here).
"""
from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable
from functools import partial

import torch

from engine.distributed.all_reduce_path import ONE_SHOT, TWO_SHOT
from engine.distributed.lamport_all_reduce import LamportAllReduce
from engine.distributed.parallel_state import (
    TPGroup,
    end_group,
    init_group,
    join_store,
    open_store,
)
from engine.distributed.row_collectives import all_gather_tensor, reduce_scatter_tensor
from engine.parallel_config import ParallelConfig
from experiments.lib.profiling.collective_calls import (
    Row,
    all_reduce_call,
    engine_log,
    fastest_s,
    fused_call,
    fused_sizes,
    lamport_call,
    mean_call_s,
    message_numel,
    symmetric_sizes,
)
from experiments.lib.profiling.sequence_parallel_rows import Cell, cells_at, sequence_parallel_worker
from sim.latency.operator_file import ALL_REDUCE_PATH_OPS, FUSED_ALL_REDUCE, LAMPORT_FUSED_ALL_REDUCE


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
    taken = [nbytes for nbytes in fused_sizes(sizes, dtype, group.size, width) if custom.takes(nbytes, dtype)]
    if taken:  # the pass's process is fresh: its first timing ran slow (12.2 us at 8 KiB, 4.3 at 64 KiB)
        mean_call_s(lamport_call(custom, taken[0], width, dtype, device), iters, mode, begin=custom.begin_forward)
    for nbytes in taken:
        call = lamport_call(custom, nbytes, width, dtype, device)
        seconds = fastest_s(mean_call_s(call, iters, mode, begin=custom.begin_forward), group, device)
        rows.append({"op": LAMPORT_FUSED_ALL_REDUCE, "bytes": nbytes, "n": width, "world_size": group.size,
                     "time_s": seconds})
    return rows


def collective_ops(group: TPGroup, sizes: list[int], dtype: torch.dtype, width: int) -> list[str]:
    """The ops a world size's rows hold: NCCL's (gloo's) always, the symmetric paths where the group
    has them and some size can take them, the fused boundary where the group's kernels fuse and some
    size holds a row."""
    symmetric = group.custom is not None and symmetric_sizes(sizes, dtype, group.size)
    fused = symmetric and group.custom.fused and fused_sizes(sizes, dtype, group.size, width)
    return ["all_reduce", "all_gather", "reduce_scatter",
            *([ALL_REDUCE_PATH_OPS[p] for p in (ONE_SHOT, TWO_SHOT)] if symmetric else []),
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
                call = (lambda o=out, p=part: all_gather_tensor(o, p, group=group.device_group))
            elif op == "reduce_scatter":
                whole = torch.ones(numel, device=device, dtype=dtype)
                out = torch.empty(numel // world, device=device, dtype=dtype)
                call = (lambda o=out, w=whole: reduce_scatter_tensor(o, w, group=group.device_group))
            elif op == "all_reduce" or numel * dtype.itemsize in symmetric:
                call = all_reduce_call(group, path_of[op], numel, dtype, device)
            else:
                continue
            seconds = fastest_s(mean_call_s(call, iters, mode), group, device)
            rows.append({"op": op, "bytes": numel * dtype.itemsize, **extra, "world_size": world,
                         "time_s": seconds})
    return rows


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
        with engine_log("all-reduce:") as said:
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


def boundary_pass(world: int, cells: list[Cell], dtype: torch.dtype, cuda: bool, iters: int,
                  timeout_s: float, log) -> tuple[list[Row], str | None]:
    """The sequence-parallel boundaries' rows at `world` ranks, from a group of their own, at the
    cells whose m the world size divides, and which implementation ran ("fused" or "plain"); a
    failed pass gives none, and the log says why."""
    mine = cells_at(cells, world)
    if not mine:
        if cells:
            log(f"collectives: world_size={world}, no sequence-parallel rows: no m of sequence_parallel_m "
                f"splits into {world} equal parts")
        return [], None
    start = time.perf_counter()
    args = (mine, dtype, cuda, iters, timeout_s)
    status, payload = run_ranks(sequence_parallel_worker, world, args, timeout_s)
    if status != "ok":
        log(f"collectives: world_size={world}, no sequence-parallel rows (their pass failed): {payload}")
        return [], None
    got, said, implementation = payload
    log(f"collectives: world_size={world}, {len(got)} sequence-parallel rows (all_gather_matmul, "
        f"matmul_reduce_scatter at {len(mine)} cells) in {time.perf_counter() - start:.1f}s; "
        f"the engine said: {said}")
    return got, implementation


def collective_rows(world_sizes: list[int], sizes: list[int], dtype: torch.dtype, cuda: bool,
                    log, iters: int = 20, timeout_s: float = 120.0, width: int = 4096,
                    cells: list[Cell] | None = None,
                    implementations: dict[str, str] | None = None) -> list[Row]:
    """Rows for every world size the machine has (all GPUs needed on CUDA; any size on the CPU);
    `width`: the fused boundary's row width (elements); `cells`: the sequence-parallel boundaries'
    (m, k, n) (`sequence_parallel_cells`; none: no such rows); `implementations`, if given, gets
    which one timed them at each world size (str(world) -> "fused" / "plain": the file's
    `sequence_parallel_ops` metadata)."""
    available = torch.cuda.device_count() if cuda else max(world_sizes)
    rows: list[Row] = []
    for world in world_sizes:
        if world > available:
            log(f"collectives: world_size={world} skipped (GPUs here: {available})")
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
        boundary, implementation = boundary_pass(world, cells or [], dtype, cuda, iters, timeout_s, log)
        rows.extend(boundary)
        if implementation is not None and implementations is not None:
            implementations[str(world)] = implementation
    return rows
