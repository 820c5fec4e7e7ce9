"""The collectives profiler's sequence-parallel boundary rows (experiments/lib/profiling/collectives.py):
`all_gather_matmul` and `matmul_reduce_scatter` [m, k, n] per world size, as the engine's group runs
them (`TPGroup.all_gather_matmul`, `TPGroup.matmul_reduce_scatter`: torch's fused symmetric-memory
ops where the group has symmetric memory, else the collective and the GEMM one after the other, over
NCCL or gloo; engine/distributed/row_collectives.py).

The ranks join the engine's group in a pass of their own, opened with `sequence_parallel_min_rows`
> 0 so that `init_group` opens the fused ops wherever it can, and otherwise the engine's defaults
(torch's all-reduce kernels: the fused ops take only the group's symmetric memory and `launch`);
rank 0 keeps the engine's line on which implementation carries the boundaries. Cells: each m of
`operator_grid.sequence_parallel_m` that the world size divides, k of `gemm_k`, n of `gemm_n` up to
`MAX_N`, within the compute part's GEMM caps (`OperatorGrid.gemm_cells`); the cells over them are
filled as `gemm`'s (sim/latency/operator_profile.py). Inputs: x of [m/N, k] (all_gather_matmul:
each rank's rows) or [m, k] (matmul_reduce_scatter: the rows of partial sums), a weight [n, k] (as
`nn.Linear`'s), the engine's dtype. Each cell is timed eagerly (3 warm-up calls, then `iters` back
to back between CUDA events: the engine runs its sequence-parallel steps eagerly, never from a CUDA
graph; wall clock on the CPU, where each rank takes its share of the cores); a row's time is the
fastest rank's; a cell's tensors are freed before the next is allocated. The cells are timed in
`PASSES` passes, in ascending then descending order, and each keeps its fastest: a single ascending
pass on two H200s left about 30% of the (k, n) cells faster at 4,096 rows than at 2,048, the
smaller m timed first.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable

import torch

from engine.distributed.parallel_state import TPGroup, end_group, init_group, join_store
from engine.parallel_config import ParallelConfig
from experiments.lib.profiling.collective_calls import Row, engine_log, fastest_s, mean_call_s
from experiments.lib.profiling.operator_grid import OperatorGrid

Cell = tuple[int, int, int]  # (m, k, n): m rows gathered, k input and n output widths
BOUNDARY_OPS = ("all_gather_matmul", "matmul_reduce_scatter")
# The widest GEMM output timed: the boundaries' GEMMs (QKV, MLP up and gate, per GPU at any
# tensor-parallel size) lie below it; the grid's wider n are vocabularies (the LM head, no boundary).
MAX_N = 65536
ENGINE_LINE = "sequence-parallel steps"  # how the engine's start-up line on them begins
PASSES = 2  # over every cell, alternately ascending and descending; each cell keeps its fastest


def sequence_parallel_cells(grid: OperatorGrid, itemsize: int) -> list[Cell]:
    """Every (m, k, n) the grid times the boundaries at (before the world size's divisibility),
    sorted; none without `sequence_parallel_m`."""
    if not grid.sequence_parallel_m:
        return []
    return sorted((m, k, n) for k, n, ms in grid.gemm_cells(itemsize, grid.sequence_parallel_m)
                  if n <= MAX_N for m in ms)


def cells_at(cells: list[Cell], world: int) -> list[Cell]:
    """The cells timed at `world` ranks: those whose m rows split evenly over them."""
    return [c for c in cells if c[0] % world == 0]


def boundary_call(group: TPGroup, op: str, cell: Cell, dtype: torch.dtype,
                  device: torch.device) -> Callable[[], object]:
    """The group's `op` on one cell's inputs (held by the call only) as a zero-argument call."""
    m, k, n = cell
    weight = torch.randn(n, k, device=device, dtype=dtype)
    if op == "all_gather_matmul":
        part = torch.randn(m // group.size, k, device=device, dtype=dtype)
        return lambda: group.all_gather_matmul(part, weight)
    if op == "matmul_reduce_scatter":
        rows = torch.randn(m, k, device=device, dtype=dtype)
        return lambda: group.matmul_reduce_scatter(rows, weight)
    raise ValueError(f"op={op!r} is invalid: one of {BOUNDARY_OPS}")


def boundary_rows(group: TPGroup, cells: list[Cell], dtype: torch.dtype, device: torch.device,
                  iters: int, passes: int = PASSES) -> list[Row]:
    """One rank's share of both ops' rows at every cell, in the cells' order (every rank calls
    this, in step): the fastest of `passes` timings, alternately ascending and descending."""
    if passes < 1:
        raise ValueError(f"passes={passes!r} is invalid: must be an integer >= 1")
    mode = "eager" if device.type == "cuda" else "cpu"
    best: dict[tuple[str, Cell], float] = {}
    for p in range(passes):
        for cell in cells if p % 2 == 0 else cells[::-1]:
            for op in BOUNDARY_OPS:
                call = boundary_call(group, op, cell, dtype, device)
                seconds = fastest_s(mean_call_s(call, iters, mode), group, device)
                del call  # the cell's tensors (GiB at the largest) go before the next cell's
                best[op, cell] = min(seconds, best.get((op, cell), seconds))
    return [{"op": op, "m": m, "k": k, "n": n, "world_size": group.size, "time_s": best[op, (m, k, n)]}
            for m, k, n in cells for op in BOUNDARY_OPS]


def sequence_parallel_worker(rank: int, world: int, port: int, cells: list[Cell], dtype: torch.dtype,
                             cuda: bool, iters: int, timeout_s: float, results) -> None:
    """One rank of the boundaries' pass (`collectives.run_ranks`): rank 0 puts ("ok", (rows, what the
    engine said, "fused" or "plain": which implementation ran)); a rank that fails puts ("error", why)."""
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(rank)
        else:  # the ranks share the CPU's cores (each taking all of them, their GEMMs ran ~10x slow)
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        parallel = ParallelConfig(world, timeout_s, all_reduce_kernel="torch",
                                  sequence_parallel_min_rows=min(m for m, _, _ in cells))
        with engine_log(ENGINE_LINE) as said:
            group = init_group(join_store(port, world, timeout_s), rank, world, device, timeout_s, parallel)
        rows = boundary_rows(group, cells, dtype, device, iters)
        if rank == 0:
            implementation = "plain" if group.fused_rows is None else "fused"
            line = " ".join(said) or f"the engine logged no {ENGINE_LINE} line"
            results.put(("ok", (rows, line, implementation)))
        group.fused_rows = group.custom = None  # frees the symmetric buffer before the group ends
        end_group(4.0, 2.0)
    except BaseException:  # noqa: BLE001 - the parent reports it, naming the world size
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))
