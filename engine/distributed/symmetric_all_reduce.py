"""One rank's side of the all-reduce over NVLink peer memory: its symmetric buffer (torch's
`torch.distributed._symmetric_memory`, mapped by every other rank of the group; opened at start-up
by engine/distributed/custom_all_reduce.py), and the dispatch of a message to the one-shot or
two-shot kernel that sums it (the path by size: engine/distributed/all_reduce_path.py).

Kernels (`ParallelConfig.all_reduce_kernel`): torch's (`symm_mem.one_shot_all_reduce_out`,
`symm_mem.two_shot_all_reduce_out`; "torch", the default), or the Triton ones of
kernels/all_reduce.py ("triton": one program per SM, barriers on the same signal pads), which also
offer the all-reduce fused with the next RMSNorm's residual add ("triton_fused": the model hands
the row-parallel layer's un-reduced partial sums to the norm, `all_reduce_add_rms_norm`), or the
barrier-free one-shot ("triton_lamport": engine/distributed/lamport_all_reduce.py, a subclass).
NVLink multicast (`multimem_*` ops) is never used: it is off on the hosts this runs on.

Regions (the Triton kernels): the buffer holds `REGIONS` messages side by side, and the kernels
end without a closing barrier. A rank's next writes into a region must wait until every peer has
read it; any symmetric-memory kernel's opening barrier proves that every peer has finished the
kernels before it. So no two consecutive calls use one region: the first call of a forward (the
vocabulary-parallel embedding's, `begin_forward`) takes region 0, the rest alternate 1, 2, 1, ...,
the same sequence in every forward, eager or replayed from a CUDA graph, whatever ran before it
(a forward makes at least two calls: the embedding's and a layer's; one that made a single call
is continued instead, `forward_start`). With one region (torch's
kernels, and the benchmarks' Triton kernels beside them) every kernel ends with a barrier.

CUDA graphs: the kernels read and write only fixed addresses (the buffer, the output, the signal
pads whose flags reset themselves), so a captured step replays them as is. A row-parallel GEMM
writes its output straight into the buffer (`input_buffer`), which saves the copy in.

Faults: the kernels' barriers (torch's and the Triton ones alike) spin without a deadline and
cannot be aborted, so a rank that dies or hangs in the middle of a step leaves the others' GPUs
spinning in it for good. Rank 0 therefore never blocks on a step: it polls the step's event,
watching the workers' processes and a deadline (`engine.distributed.step_wait`), and raises
`WorkerFailure` naming the rank; its own GPU is freed only when its process exits
(`TPModelRunner.device_stuck`). Outside CUDA graphs (eager steps: prefills beyond the captured
sizes, `enforce_eager`) rank 0 also paces its launches (`pace`): before a symmetric-memory kernel
it waits, bounded in the same way, for the one `PACE_LAG` kernels back. Without that, a step
launched behind a spinning kernel fills the GPU's launch queue (an eager step is hundreds of
kernels) and the next launch blocks inside the driver, holding the GIL, for good.
tests/device/test_engine_tp_faults_gpu.py checks those bounds on two GPUs.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.distributed.all_reduce_path import NCCL, ONE_SHOT, TWO_SHOT, choose_path

if TYPE_CHECKING:
    from kernels.all_reduce import PeerBuffers

T = TypeVar("T")
# Eager launches run at most this many symmetric-memory kernels ahead of the GPU (a layer holds two:
# the queue then holds a few dozen kernels, far below the launch queue's ~1,000, and the GPU always
# has the next layer's work).
PACE_LAG = 2
# Messages the Triton kernels' buffer holds at once (module docstring: no two consecutive calls share one).
REGIONS = 3


def forward_start(calls: int) -> int:
    """The call count a new forward starts from: 0 (its first call to place 0), unless the forward
    before made exactly one call, which took place 0 itself: that one goes on (its next call to 1),
    so place 0 never serves two calls in a row (only outside the engine: a test, a benchmark)."""
    return calls if calls == 1 else 0


def alternating(calls: int, places: int) -> int:
    """Where a forward's call number `calls` (0 first) goes among `places` (regions, rounds): the
    first to 0, the rest alternating 1, 2, 1, ... (all to 0 with one place)."""
    return 0 if calls == 0 or places == 1 else 1 + (calls - 1) % (places - 1)


class SymmetricAllReduce:
    """One rank's side: the symmetric buffer (viewed as the message's dtype; `regions` of its
    size / regions bytes each, REGIONS for the engine's Triton kernels) and the thresholds. `ops`: the
    `symm_mem` op namespace (the CPU tests pass a stand-in); `peers`: where the Triton kernels find
    every rank's buffer and signal pad (None: torch's kernels); `fused`: the model may hand its
    layer boundaries to `all_reduce_add_rms_norm`."""

    def __init__(self, buffer: torch.Tensor, group_name: str, one_shot_max: int, two_shot_max: int,
                 handle: Any = None, ops: Any = None, peers: PeerBuffers | None = None, fused: bool = False,
                 regions: int = 1) -> None:
        if fused and peers is None:
            raise ValueError("the fused all-reduce + RMSNorm needs the Triton kernels' peer buffers")
        if regions not in (1, REGIONS) or (regions > 1 and peers is None):
            raise ValueError(f"regions={regions} is invalid: 1, or {REGIONS} with the Triton kernels' peer buffers")
        self.buffer = buffer
        self.group_name = group_name
        self.regions = regions
        self.region_bytes = buffer.numel() // self.regions // 16 * 16  # each region 16-byte aligned
        self.one_shot_max = one_shot_max
        self.two_shot_max = min(two_shot_max, self.region_bytes)
        self._calls = 0  # symmetric-memory calls since the forward began (`begin_forward`)
        self.handle = handle  # the rendezvous: keeps the peers' mappings alive
        self.ops = ops if ops is not None else torch.ops.symm_mem
        self.peers = peers
        self.fused = fused
        # Rank 0 while serving: waits (bounded) until an event's work is done (`StepWait.wait`).
        self.pace: Callable[[Any], None] | None = None
        self._launched: deque[Any] = deque()  # events after the last eager kernels, oldest first

    def begin_forward(self) -> None:
        """A forward begins: its first call takes region 0 (module docstring, `forward_start`)."""
        self._calls = forward_start(self._calls)

    @property
    def closes(self) -> bool:
        """Whether the kernels end with a barrier (one region: the next call rewrites it)."""
        return self.regions == 1

    def path_for(self, x: torch.Tensor) -> str:
        return choose_path(x.numel() * x.element_size(), x.dtype, x.is_contiguous(), self.one_shot_max,
                           self.two_shot_max)

    def input_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where the producer of an all-reduce's input of `shape` should write it (a view of the
        buffer), or None if NCCL carries that message."""
        nbytes = math.prod(shape) * dtype.itemsize
        if choose_path(nbytes, dtype, True, self.one_shot_max, self.two_shot_max) == NCCL:
            return None
        return self._staged(nbytes, dtype, shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum over the ranks as a new tensor, or None if the message is NCCL's to carry."""
        path = self.path_for(x)
        if path == NCCL:
            return None
        return self.reduce(path, self._stage(x), close=self.closes)

    def reduce(self, path: str, staged: torch.Tensor, close: bool = True) -> torch.Tensor:
        """Sum `staged` (a view of the buffer) by `path`, into a new tensor. `close=False` only for
        a message staged in its call's region (`all_reduce`): without the closing barrier the next
        call must write elsewhere."""
        if path not in (ONE_SHOT, TWO_SHOT):
            raise ValueError(f"path={path!r} is invalid: {ONE_SHOT!r} or {TWO_SHOT!r}")
        out = torch.empty_like(staged)
        if self.peers is not None:
            from kernels.all_reduce import one_shot_all_reduce, two_shot_all_reduce

            kernel = one_shot_all_reduce if path == ONE_SHOT else two_shot_all_reduce
            return self.launch(lambda: kernel(self.peers, staged, out, close=close))
        op = self.ops.one_shot_all_reduce_out if path == ONE_SHOT else self.ops.two_shot_all_reduce_out
        self.launch(lambda: op(staged, "sum", self.group_name, out))
        return out

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(sum + residual) * weight, sum + residual) of `partial` [rows, hidden] in one
        kernel, or None where it does not take the message (not `fused`, NCCL's size, a residual
        of another shape or layout, too wide a row): the caller then all-reduces and norms."""
        from kernels.all_reduce import one_shot_all_reduce_add_rms_norm

        if not self.fused or self.path_for(partial) == NCCL or not self.fuses_rows(partial, residual):
            return None
        staged = self._stage(partial)
        return self.launch(lambda: one_shot_all_reduce_add_rms_norm(self.peers, staged, residual, weight, eps,
                                                                     close=self.closes))

    @staticmethod
    def fuses_rows(partial: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the fused kernels take `partial` with `residual`: rows no wider than they hold, a
        contiguous residual of the same shape and dtype."""
        from kernels.all_reduce import fits_add_rms_norm

        return (partial.dim() == 2 and fits_add_rms_norm(partial.shape[1]) and residual.shape == partial.shape
                and residual.dtype == partial.dtype and residual.is_contiguous())

    @property
    def kernel(self) -> str:
        """Whose kernels sum (`ParallelConfig.all_reduce_kernel`'s values)."""
        return "torch" if self.peers is None else ("triton_fused" if self.fused else "triton")

    def launch(self, kernel: Callable[[], T]) -> T:
        """Run a symmetric-memory kernel; outside a capture, rank 0 first waits (`pace`) for the
        one PACE_LAG kernels back."""
        paced = self.pace is not None and not torch.cuda.is_current_stream_capturing()
        if paced and len(self._launched) >= PACE_LAG:
            self.pace(self._launched.popleft())
        result = kernel()
        if paced:
            event = torch.cuda.Event()
            event.record()
            self._launched.append(event)
        return result

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        """`x` in this call's region (copied in unless its producer wrote it there); the next call
        takes the next region."""
        staged = self._staged(x.numel() * x.element_size(), x.dtype, tuple(x.shape))
        if staged.data_ptr() != x.data_ptr():
            staged.copy_(x)
        self._calls += 1
        return staged

    def region(self) -> int:
        """The region the next call stages into."""
        return alternating(self._calls, self.regions)

    def _staged(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        start = self.region() * self.region_bytes
        return self.buffer[start:start + nbytes].view(dtype).view(shape)
