"""The tensor-parallel process group of one engine: rank 0 (the engine's process) and workers
1..N-1, over torch.distributed.

Two groups: the device group (NCCL on GPUs, gloo on CPUs) carries the model's all-reduces and the
logits gather (on GPUs the small all-reduces go over symmetric memory instead when every rank can,
`engine.distributed.custom_all_reduce`); the host group (gloo) carries each step's message from rank 0 (its header and the
packed input bytes, `engine.distributed.step_message`). On CPUs one gloo group serves both.

Sequence-parallel steps (`sequence_parallel_min_rows`, engine/models/sequence_parallel.py) use
the row collectives instead (`all_gather_rows`, `reduce_scatter_rows`, and the GEMMs fused with
them): torch's async-TP ops over symmetric memory where the group has it, else the plain
collectives (engine/distributed/row_collectives.py).

Ranks meet at a `TCPStore` that rank 0 opens on a free port of 127.0.0.1 (no port guessing). The
groups are torch.distributed's default group, so one process holds at most one tensor-parallel
engine at a time (as in vLLM); `end_group` ends them, in bounded time.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.distributed.all_reduce_path import AllReducePath
from engine.distributed.custom_all_reduce import open_symmetric_all_reduce
from engine.distributed.row_collectives import (
    FusedRowOps,
    open_fused_row_ops,
    plain_all_gather_matmul,
    plain_all_gather_rows,
    plain_matmul_reduce_scatter,
    plain_reduce_scatter_rows,
)
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from engine.parallel_config import ParallelConfig
from policies.sequence_parallel import sequence_parallel_from, takes_sequence_parallel

logger = logging.getLogger("servelab.engine")


@dataclass(slots=True)
class TPGroup:
    rank: int
    size: int
    device_group: dist.ProcessGroup
    host_group: dist.ProcessGroup
    custom: SymmetricAllReduce | None = None  # the symmetric-memory paths, when every rank has them
    all_reduce_path: AllReducePath | None = None  # which all-reduce the group took at start-up (kept after close)
    # Eager forwards of at least this many rows run sequence-parallel (0: never; `takes_sequence_parallel`).
    sequence_parallel_min_rows: int = 0
    # torch's async-TP ops for those steps' boundaries, if the group has them.
    fused_rows: FusedRowOps | None = None

    def takes_sequence_parallel(self, rows: int) -> bool:
        """Whether an eager forward of `rows` rows runs sequence-parallel: the same answer on every
        rank (the step's row count and the config are theirs alike; policies/sequence_parallel.py)."""
        return takes_sequence_parallel(self.size, self.sequence_parallel_min_rows, rows)

    @property
    def sequence_parallel_from(self) -> int:
        """The fewest rows of a sequence-parallel step (0: none is): steps that large run eagerly."""
        return sequence_parallel_from(self.size, self.sequence_parallel_min_rows)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[S, C] on each rank -> [size * S, C]: rank r's rows at [r S, (r + 1) S)."""
        return plain_all_gather_rows(x, self.size, self.device_group)

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[size * S, C] on each rank -> [S, C]: the sum over the ranks of rows [rank S, (rank + 1) S)."""
        return plain_reduce_scatter_rows(x, self.size, self.device_group)

    def all_gather_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """all_gather_rows(x) @ weight.T (weight [out, in]): fused and overlapped where the group
        has it."""
        if self.fused_rows is not None:
            return self.fused_rows.all_gather_matmul(x, weight)
        return plain_all_gather_matmul(x, weight, self.size, self.device_group)

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """reduce_scatter_rows(x @ weight.T) (weight [out, in]): fused and overlapped where the
        group has it."""
        if self.fused_rows is not None:
            return self.fused_rows.matmul_reduce_scatter(x, weight)
        return plain_matmul_reduce_scatter(x, weight, self.size, self.device_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (on the device's stream: capturable in a CUDA graph): a new tensor
        on the symmetric-memory paths, `x` itself summed in place on NCCL's or gloo's."""
        if self.custom is not None:
            summed = self.custom.all_reduce(x)
            if summed is not None:
                return summed
        dist.all_reduce(x, group=self.device_group)
        return x

    def begin_forward(self) -> None:
        """A forward's first collective is next (the symmetric paths' regions restart)."""
        if self.custom is not None:
            self.custom.begin_forward()

    @property
    def fuses_add_norm(self) -> bool:
        """Whether a row-parallel layer that feeds an RMSNorm should hand it its partial sums
        un-reduced (`all_reduce_add_rms_norm` sums them with the residual add and the norm)."""
        return self.custom is not None and self.custom.fused

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float, add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual) * weight, sum + residual), the sum over the ranks of `partial`:
        one kernel where the symmetric-memory path fuses it, else `all_reduce` and then `add_norm`
        (the model's `add_rms_norm(x, residual, weight)`, its `eps` bound)."""
        if self.custom is not None:
            fused = self.custom.all_reduce_add_rms_norm(partial, residual, weight, eps)
            if fused is not None:
                return fused
        return add_norm(self.all_reduce(partial), residual, weight)

    def reduce_input(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where to write an all-reduce's input of `shape` so that it needs no copy in (a view of the
        symmetric buffer), or None: any tensor will do."""
        return None if self.custom is None else self.custom.input_buffer(shape, dtype)

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[R, C] on each rank -> [R, size * C]: rank r's block in columns [r C, (r + 1) C)."""
        rows, cols = x.shape
        return self.all_gather_stacked(x).permute(1, 0, 2).reshape(rows, self.size * cols)

    def all_gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """x on each rank -> [size, *x.shape]: rank r's x at index r."""
        return self.all_gather_rows(x).view(self.size, *x.shape)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (each rank's KV block count, for one block table)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def set_timeout(self, seconds: float) -> None:
        """How long a collective waits for a missing rank before it raises."""
        timeout = datetime.timedelta(seconds=seconds)
        for group in {id(self.device_group): self.device_group, id(self.host_group): self.host_group}.values():
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def open_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (its `.port` goes to the workers)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
               parallel: ParallelConfig | None = None) -> TPGroup:
    """Join the engine's group (every rank calls this; it returns once all have), with the
    symmetric-memory all-reduce unless `parallel` turns it off or a rank cannot have it."""
    if dist.is_initialized():
        raise RuntimeError(f"rank {rank}: this process's torch.distributed default group is already initialized")
    if device.type == "cuda":
        # Abort the communicators and raise on a failed or timed-out collective instead of tearing
        # down the process: rank 0 is the user's process and reports the fault.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kwargs)
    device_group = dist.group.WORLD
    host_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    group = TPGroup(rank, size, device_group, host_group)
    parallel = parallel or ParallelConfig(size)
    group.custom, group.all_reduce_path = open_symmetric_all_reduce(
        parallel, device, rank, size, device_group.group_name, group.min_int)
    group.sequence_parallel_min_rows = parallel.sequence_parallel_min_rows
    if group.sequence_parallel_from and group.custom is not None:  # the custom all-reduce's symmetric memory
        group.fused_rows = open_fused_row_ops(device_group.group_name, rank, device, group.custom.launch)
    if group.sequence_parallel_from and rank == 0:
        logger.info("sequence-parallel steps from %d rows: %s", group.sequence_parallel_min_rows,
                    _row_collectives(group, backend))
    return group


def _row_collectives(group: TPGroup, backend: str) -> str:
    """What carries the sequence-parallel boundaries, as rank 0 logs it."""
    if group.fused_rows is None:
        reason = group.all_reduce_path.off_reason if group.all_reduce_path is not None else None
        return f"plain {backend} reduce-scatter / all-gather (no symmetric memory: {reason})"
    multicast = group.fused_rows.keep_gathered
    kept = " (gathered inputs kept: the GPU reports NVLink multicast)" if multicast else ""
    return "torch's fused symmetric-memory ops" + kept


def end_group(destroy_s: float, abort_s: float) -> bool:
    """End this process's group in bounded time (every rank does so at a normal close): destroy it
    (NCCL's teardown may wait for the other ranks, up to the group's own timeout), and if that has
    not returned within `destroy_s`, abort it within `abort_s`. False if neither returned in time
    (its helper thread is left). Free the CUDA graphs that captured collectives first: NCCL's
    teardown, abort included, waits until no graph holds the communicator."""
    if not dist.is_initialized():
        return True
    if bounded(dist.destroy_process_group, destroy_s) and not dist.is_initialized():
        return True
    return bounded(abort_group, abort_s) and not dist.is_initialized()


def abort_group() -> None:
    """Abort every group of this process: in-flight collectives end without waiting for the other
    ranks (one is gone), then the communicators are freed once no CUDA graph holds them."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # private; in torch >= 2.4
    if abort is not None and dist.is_initialized():
        abort()


def in_background(fn: Callable[[], object]) -> threading.Thread:
    """`fn()` on a started daemon thread; teardown errors (the group already ended) are dropped."""
    helper = threading.Thread(target=_quietly, args=(fn,), name="tp-teardown", daemon=True)
    helper.start()
    return helper


def bounded(fn: Callable[[], object], timeout_s: float) -> bool:
    """`fn()` on a daemon thread, waited for `timeout_s`: True if it returned (or raised a teardown
    error) in time. For teardown calls that may block in native code: the thread is left behind."""
    helper = in_background(fn)
    helper.join(timeout_s)
    return not helper.is_alive()


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except (RuntimeError, ValueError):  # already ended (an abort raced it), or a backend's teardown error
        pass


def abort(group: TPGroup) -> None:
    """Abort the device group's pending collectives (a worker died: they would never finish)."""
    try:
        dist.distributed_c10d._abort_process_group(group.device_group)
    except (RuntimeError, AttributeError, ValueError):  # gloo, or a torch without abort: nothing pending to free
        pass
