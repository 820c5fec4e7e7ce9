"""The collectives of the sequence-parallel layer boundaries (engine/models/sequence_parallel.py):
a rank holds 1/N of a step's rows between two GEMMs, so a row-parallel GEMM's partial sums are
reduce-scattered by rows (each rank gets the sum of its rows) and a column-parallel GEMM's input is
all-gathered by rows first.

Two implementations of the same semantics, chosen once per group at start-up
(`TPGroup.fused_rows`):
- `FusedRowOps`: torch's async-TP ops over symmetric memory (`symm_mem.fused_all_gather_matmul`,
  `symm_mem.fused_matmul_reduce_scatter`), which split the GEMM into one chunk per rank and overlap
  each chunk with the copy engine's transfers of another. Taken on GPUs where the group has the
  symmetric-memory all-reduce (`TPGroup.custom`: every rank mapped the others' memory at start-up);
  a failure of either op raises `SequenceParallelError`, never a silent fallback.
- `plain_*` below: the collective, then the GEMM (or the GEMM, then the collective): NCCL on GPUs
  without symmetric memory, gloo on CPUs (the tests).

Rows: `x` holds N x S rows for a reduce-scatter (rank r gets the sum of rows [r S, (r + 1) S)) and S
rows per rank for an all-gather (rank r's rows land at [r S, (r + 1) S)); the caller pads the step's
rows to a multiple of N. Weights are `nn.Linear`'s [out, in]; torch's ops take B as [in, out], so
they get `weight.t()` (a view: cuBLAS reads the transpose as is).

Symmetric memory: torch's ops stage their chunks in a per-group workspace that grows, collectively,
to the largest message seen (every rank makes the same calls in the same order: every rank runs the
same steps). The first eager step at `max_num_batched_tokens` (the KV cache's memory profile) sizes it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

T = TypeVar("T")
# torch's one-tensor collectives, `(out, x, group=...)`, by their new names where this torch has them
# (all_gather_single, reduce_scatter_single: torch >= 2.12), else all_gather_into_tensor and
# reduce_scatter_tensor: the same collectives. Public: the collectives profiler times them too.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class SequenceParallelError(RuntimeError):
    """A fused symmetric-memory op of the sequence-parallel path failed (the step cannot go on)."""


def plain_all_gather_rows(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[S, C] on each rank -> [size * S, C], rank r's rows at [r S, (r + 1) S)."""
    out = torch.empty(size * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_tensor(out, x.contiguous(), group=group)
    return out


def plain_reduce_scatter_rows(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[size * S, C] on each rank -> [S, C]: rank r's rows of the sum over the ranks."""
    if x.shape[0] % size:
        raise ValueError(f"rows={x.shape[0]} is invalid for a reduce-scatter over {size} ranks: "
                         "pad to a multiple")
    out = torch.empty(x.shape[0] // size, *x.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


@dataclass(slots=True)
class FusedRowOps:
    """torch's async-TP ops over the group `group_name` (symmetric memory set up for it).
    `launch`: runs one op (rank 0 paces eager symmetric-memory kernels through it, as the
    all-reduce's: engine/distributed/symmetric_all_reduce.py); `keep_gathered`: ask torch for the
    gathered input too (`return_A=True`), which keeps its all-gather off the NVLink-multicast branch
    (`multimem_all_gather_out`) on a GPU that reports multicast support; where multicast is off
    (`TORCH_SYMM_MEM_DISABLE_MULTICAST`, as on the hosts this runs on) it is False."""

    group_name: str
    rank: int
    launch: Callable[[Callable[[], Any]], Any]
    keep_gathered: bool = False
    ops: Any = None  # the `symm_mem` op namespace (torch.ops.symm_mem unless a test's stand-in)

    def __post_init__(self) -> None:
        if self.ops is None:
            self.ops = torch.ops.symm_mem

    def all_gather_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """all_gather_rows(x) @ weight.T, each rank's chunk multiplied as it arrives."""
        def run() -> torch.Tensor:
            _, outs = self.ops.fused_all_gather_matmul(x.contiguous(), [weight.t()], 0, self.group_name,
                                                       return_A=self.keep_gathered)
            return outs[0]
        return self._run("fused_all_gather_matmul", run, x, weight)

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """reduce_scatter_rows(x @ weight.T), each destination's chunk sent while the next is multiplied."""
        def run() -> torch.Tensor:
            return self.ops.fused_matmul_reduce_scatter(x.contiguous(), weight.t(), "sum", 0, self.group_name)
        return self._run("fused_matmul_reduce_scatter", run, x, weight)

    def _run(self, name: str, op: Callable[[], T], x: torch.Tensor, weight: torch.Tensor) -> T:
        try:
            return self.launch(op)
        except Exception as e:
            raise SequenceParallelError(
                f"rank {self.rank}: symm_mem.{name} failed on x {tuple(x.shape)} {x.dtype}, weight "
                f"{tuple(weight.shape)} over group {self.group_name!r}: {type(e).__name__}: {e} "
                "(set sequence_parallel_min_rows=0 to turn the sequence-parallel path off)") from e


def open_fused_row_ops(group_name: str, rank: int, device: torch.device,
                       launch: Callable[[Callable[[], Any]], Any]) -> FusedRowOps:
    """The fused ops for a group whose symmetric memory is set up (`TPGroup.custom` is not None)."""
    ops = getattr(torch.ops, "symm_mem", None)
    missing = [n for n in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter") if not hasattr(ops, n)]
    if missing:
        raise SequenceParallelError(f"torch {torch.__version__} has no symm_mem.{', '.join(missing)}: "
                                    "set sequence_parallel_min_rows=0")
    return FusedRowOps(group_name, rank, launch, keep_gathered=_multicast(device))


def _multicast(device: torch.device) -> bool:
    """Whether torch may take its multicast all-gather on `device` (True when it cannot tell)."""
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        return bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, device.index))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return True


def plain_all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, size: int,
                            group: dist.ProcessGroup) -> torch.Tensor:
    return F.linear(plain_all_gather_rows(x, size, group), weight)


def plain_matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, size: int,
                                group: dist.ProcessGroup) -> torch.Tensor:
    return plain_reduce_scatter_rows(F.linear(x, weight), size, group)
