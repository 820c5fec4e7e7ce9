"""All-reduce over NVLink peer memory for the small messages of decode steps, through torch's own
symmetric memory (`torch.distributed._symmetric_memory`); NCCL keeps the large ones.

At decode sizes (tokens x hidden x 2 bytes: a few KB to a few MB) an NCCL all-reduce is bound by
its latency, not by NVLink's bandwidth. Like vLLM's and SGLang's custom all-reduce, each rank here
holds one buffer that every other rank of the group maps (symmetric memory, allocated and
exchanged once at start-up), and a sum is one kernel of peer loads:
- one-shot (`symm_mem.one_shot_all_reduce_out`): every rank reads every rank's whole buffer and
  sums it; one barrier. Fewest steps: the smallest messages;
- two-shot (`symm_mem.two_shot_all_reduce_out`): each rank sums its 1/N slice (a reduce-scatter),
  then gathers the others' sums; N times fewer bytes read per rank, one barrier more: medium sizes;
- NCCL above `custom_all_reduce_max_bytes`, for other dtypes (the kernels implement bf16 and
  float32), other world sizes (2, 4, 8 only), and on CPUs (gloo).
NVLink multicast (`multimem_*` ops) is never used: it is off on the hosts this runs on.

The thresholds are `ParallelConfig`'s (engine/config.py); `experiments/bench_allreduce.py` measures
the three paths by size. Every rank picks the same path for a message, since the choice depends only
on its byte count, dtype and layout, which all ranks share.

CUDA graphs: the kernels read and write only fixed addresses (the buffer, the output, the signal
pads whose flags reset themselves), so a captured step replays them as is. A row-parallel GEMM
writes its output straight into the buffer (`input_buffer`), which saves the copy in.

Start-up is collective: every rank checks what it can (`unavailable_reason`), the ranks agree (all
or none), allocate and exchange the buffer, and agree again; any failure leaves every rank on
NCCL, with one log line saying why.

Faults: the kernels' barriers spin without a deadline and cannot be aborted, so a rank that dies
or hangs in the middle of a step leaves the others' GPUs spinning in it for good. Rank 0 therefore
never blocks on a step: it polls the step's event, watching the workers' processes and a deadline
(`engine.distributed.step_wait`), and raises `WorkerFailure` naming the rank; its own GPU is freed
only when its process exits (`TPModelRunner.device_stuck`). Outside CUDA graphs (eager steps:
prefills beyond the captured sizes, `enforce_eager`) rank 0 also paces its launches (`pace`): before
a symmetric-memory kernel it waits, bounded in the same way, for the one `PACE_LAG` kernels back.
Without that, a step launched behind a spinning kernel fills the GPU's launch queue (an eager step
is hundreds of kernels) and the next launch blocks inside the driver, holding the GIL, for good.

Kernels (`ParallelConfig.all_reduce_kernel`): torch's ("torch", the default), or the Triton ones
of kernels/all_reduce.py ("triton": one program per SM, barriers on the same signal pads), which
also offer the all-reduce fused with the next RMSNorm's residual add ("triton_fused": the model
hands the row-parallel layer's un-reduced partial sums to the norm, `all_reduce_add_rms_norm`).
The Triton kernels spin like torch's and go through the same pacing.

On by default, as vLLM's custom all-reduce (tests/device/test_engine_tp_faults_gpu.py checks those
bounds on two GPUs); `disable_custom_all_reduce=True` sends every all-reduce through NCCL.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.config import ParallelConfig

if TYPE_CHECKING:
    from kernels.all_reduce import PeerBuffers

T = TypeVar("T")
logger = logging.getLogger("servelab.engine")

ONE_SHOT, TWO_SHOT, NCCL = "one-shot", "two-shot", "nccl"
# Whether this process has joined a symmetric-memory rendezvous. torch's exchange of the buffers'
# handles keeps per-process state that a later engine's fresh workers do not share, so a second
# rendezvous in the user's process waits for good (measured on two GPUs: the second TP=2 engine of
# a process hung there, its groups renamed or not): such an engine stays on NCCL, the reason logged.
_rendezvous_joined = False
# Eager launches run at most this many symmetric-memory kernels ahead of the GPU (a layer holds two:
# the queue then holds a few dozen kernels, far below the launch queue's ~1,000, and the GPU always
# has the next layer's work).
PACE_LAG = 2
# What torch's symmetric-memory all-reduce kernels implement (the out-of-place two-shot kernel is
# specialized for these world sizes only).
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)
SYMMETRIC_WORLD_SIZES = (2, 4, 8)
REQUIRED_OPS = ("one_shot_all_reduce_out", "two_shot_all_reduce_out")


@dataclass(slots=True, frozen=True)
class AllReducePath:
    """Which all-reduce an engine's group took at start-up, as rank 0 logs it: the symmetric-memory
    thresholds (`off_reason` None) and whose kernels sum (`kernel`, recorded unless torch's), or why
    NCCL (gloo on CPUs) carries every message. Runs record
    it (`record`: summary.json's `run.all_reduce`), so that a later simulator run can price the
    path the engine ran rather than the one its current defaults would take."""

    world_size: int
    one_shot_max_bytes: int = 0
    two_shot_max_bytes: int = 0
    off_reason: str | None = None
    kernel: str = "torch"

    def record(self) -> dict[str, Any]:
        if self.off_reason is not None:
            return {"path": NCCL, "world_size": self.world_size, "reason": self.off_reason}
        record = {"path": "symmetric", "world_size": self.world_size, "one_shot_max_bytes": self.one_shot_max_bytes,
                  "two_shot_max_bytes": self.two_shot_max_bytes}
        return record if self.kernel == "torch" else {**record, "kernel": self.kernel}

    def describe(self) -> str:
        if self.off_reason is not None:
            return f"NCCL/gloo for every message (custom all-reduce off: {self.off_reason})"
        return (f"one-shot over symmetric memory up to {self.one_shot_max_bytes} bytes, two-shot up to "
                f"{self.two_shot_max_bytes}, NCCL above ({self.world_size} GPUs, {self.kernel} kernels)")


def choose_path(nbytes: int, dtype: torch.dtype, contiguous: bool, one_shot_max: int, two_shot_max: int) -> str:
    """Which all-reduce carries a message of `nbytes` (every rank decides alike)."""
    if dtype not in SYMMETRIC_DTYPES or not contiguous or nbytes <= 0 or nbytes % 4:  # the kernels' 4-byte vectors
        return NCCL
    if nbytes <= one_shot_max:
        return ONE_SHOT
    if nbytes <= two_shot_max:
        return TWO_SHOT
    return NCCL


def symmetric_memory() -> ModuleType | None:
    """torch's symmetric-memory module if this torch has it and the ops used here, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not all(hasattr(ops, name) for name in REQUIRED_OPS):
        return None
    if not (hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")):
        return None
    return symm_mem


def settings_reason(parallel: ParallelConfig, world_size: int) -> str | None:
    """Why the settings and the world size alone keep every all-reduce off the symmetric-memory
    paths, or None (the simulator's operator model asks this of a run it prices)."""
    if parallel.disable_custom_all_reduce:
        return "disable_custom_all_reduce is set"
    if world_size == 1:
        return "one rank: nothing to reduce"
    if world_size not in SYMMETRIC_WORLD_SIZES:
        return f"world size {world_size}: torch's kernels take {SYMMETRIC_WORLD_SIZES}"
    if parallel.custom_all_reduce_max_bytes == 0:
        return "custom_all_reduce_max_bytes=0"
    return None


def unavailable_reason(parallel: ParallelConfig, device: torch.device, rank: int, world_size: int) -> str | None:
    """Why this rank cannot take the symmetric-memory paths, or None if it can. Ranks sit on GPUs
    `device.index - rank` .. `+ world_size - 1` (the engine's layout)."""
    reason = settings_reason(parallel, world_size)
    if reason is not None:
        return reason
    if device.type != "cuda":
        return f"device {device} is not a GPU (gloo carries the all-reduces)"
    if symmetric_memory() is None:
        return (f"torch {torch.__version__} has no torch.distributed._symmetric_memory with the ops "
                f"{', '.join(REQUIRED_OPS)}")
    if _rendezvous_joined:
        return ("this process set up symmetric memory for an earlier engine, and torch's rendezvous "
                "cannot meet a new engine's workers a second time (run each tensor-parallel engine in a "
                "process of its own to have it)")
    first = device.index - rank
    no_peer = [first + r for r in range(world_size)
               if r != rank and not torch.cuda.can_device_access_peer(device.index, first + r)]
    if no_peer:
        return f"GPU {device.index} cannot access the memory of GPUs {no_peer} (no peer access)"
    return None


class SymmetricAllReduce:
    """One rank's side: the symmetric buffer (`max_bytes` bytes, viewed as the message's dtype) and
    the thresholds. `ops`: the `symm_mem` op namespace (the CPU tests pass a stand-in); `peers`:
    where the Triton kernels find every rank's buffer and signal pad (None: torch's kernels);
    `fused`: the model may hand its layer boundaries to `all_reduce_add_rms_norm`."""

    def __init__(self, buffer: torch.Tensor, group_name: str, one_shot_max: int, two_shot_max: int,
                 handle: Any = None, ops: Any = None, peers: PeerBuffers | None = None, fused: bool = False) -> None:
        if fused and peers is None:
            raise ValueError("the fused all-reduce + RMSNorm needs the Triton kernels' peer buffers")
        self.buffer = buffer
        self.group_name = group_name
        self.one_shot_max = one_shot_max
        self.two_shot_max = min(two_shot_max, buffer.numel())
        self.handle = handle  # the rendezvous: keeps the peers' mappings alive
        self.ops = ops if ops is not None else torch.ops.symm_mem
        self.peers = peers
        self.fused = fused
        # Rank 0 while serving: waits (bounded) until an event's work is done (`StepWait.wait`).
        self.pace: Callable[[Any], None] | None = None
        self._launched: deque[Any] = deque()  # events after the last eager kernels, oldest first

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
        return self.reduce(path, self._stage(x))

    def reduce(self, path: str, staged: torch.Tensor) -> torch.Tensor:
        """Sum `staged` (a view of the buffer from its start) by `path`, into a new tensor; the
        buffer is free again when the kernel ends (its last barrier waits for every reader)."""
        if path not in (ONE_SHOT, TWO_SHOT):
            raise ValueError(f"path={path!r} is invalid: {ONE_SHOT!r} or {TWO_SHOT!r}")
        out = torch.empty_like(staged)
        if self.peers is not None:
            from kernels.all_reduce import one_shot_all_reduce, two_shot_all_reduce

            kernel = one_shot_all_reduce if path == ONE_SHOT else two_shot_all_reduce
            return self._launch(lambda: kernel(self.peers, staged, out))
        op = self.ops.one_shot_all_reduce_out if path == ONE_SHOT else self.ops.two_shot_all_reduce_out
        self._launch(lambda: op(staged, "sum", self.group_name, out))
        return out

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(sum + residual) * weight, sum + residual) of `partial` [rows, hidden] in one
        kernel, or None where it does not take the message (not `fused`, NCCL's size, a residual
        of another shape or layout, too wide a row): the caller then all-reduces and norms."""
        from kernels.all_reduce import fits_add_rms_norm, one_shot_all_reduce_add_rms_norm

        if (not self.fused or partial.dim() != 2 or self.path_for(partial) == NCCL
                or not fits_add_rms_norm(partial.shape[1]) or residual.shape != partial.shape
                or residual.dtype != partial.dtype or not residual.is_contiguous()):
            return None
        staged = self._stage(partial)
        return self._launch(lambda: one_shot_all_reduce_add_rms_norm(self.peers, staged, residual, weight, eps))

    def _launch(self, kernel: Callable[[], T]) -> T:
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
        """`x` in the buffer (copied in unless its producer wrote it there)."""
        staged = self._staged(x.numel() * x.element_size(), x.dtype, tuple(x.shape))
        if staged.data_ptr() != x.data_ptr():
            staged.copy_(x)
        return staged

    def _staged(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.buffer[:nbytes].view(dtype).view(shape)


def open_symmetric_all_reduce(parallel: ParallelConfig, device: torch.device, rank: int, world_size: int,
                              group_name: str, agree: Callable[[int], int]
                              ) -> tuple[SymmetricAllReduce | None, AllReducePath]:
    """Every rank calls this at start-up, in the same order as the others; `agree(v)`: the minimum
    of `v` over the ranks (the host group). Returns the symmetric-memory paths (None on every rank
    unless every rank has the symmetric buffer) and which all-reduce runs, which rank 0 logs."""
    reason = unavailable_reason(parallel, device, rank, world_size)
    if agree(0 if reason else 1) == 0:
        return None, _off(rank, world_size, reason or "another rank cannot use symmetric memory")
    symm_mem = symmetric_memory()
    custom = None
    try:
        custom = _allocate(symm_mem, parallel, device, world_size, group_name)
    except Exception as e:  # noqa: BLE001 (any failure falls back to NCCL on every rank, logged)
        reason = f"the symmetric buffer could not be set up: {type(e).__name__}: {e}"
    if agree(0 if custom is None else 1) == 0:
        return None, _off(rank, world_size, reason or "another rank could not set up its symmetric buffer")
    if custom.peers is not None:  # every rank launches the same grids: the fewest programs any rank allows
        custom.peers = dataclasses.replace(custom.peers, max_programs=agree(custom.peers.max_programs))
    path = AllReducePath(world_size, custom.one_shot_max, custom.two_shot_max, kernel=parallel.all_reduce_kernel)
    if rank == 0:
        logger.info("all-reduce: %s", path.describe())
    return custom, path


def _allocate(symm_mem: ModuleType, parallel: ParallelConfig, device: torch.device, world_size: int,
              group_name: str) -> SymmetricAllReduce:
    global _rendezvous_joined
    # No multicast object (NVLink multicast is off here, and its setup fails where it is not
    # supported); no implicit memory pool: a buffer freed by a closed engine is released, so a later
    # engine's buffer is never a reused block still holding the old group's peer mappings.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("TORCH_SYMMMEM_IMPLICIT_POOL", "0")
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not getattr(enable, "__deprecated__", None):  # needed before torch made it a no-op
        enable(group_name)
    size = parallel.custom_all_reduce_max_bytes
    buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
    _rendezvous_joined = True  # even if it fails: the exchange's state has moved on
    handle = symm_mem.rendezvous(buffer, group_name)
    if handle is None:
        raise RuntimeError("rendezvous returned no handle (the buffer is not symmetric memory)")
    peers = None
    if parallel.all_reduce_kernel != "torch":
        from kernels.all_reduce import PeerBuffers

        peers = PeerBuffers.of_rendezvous(handle, buffer)
    return SymmetricAllReduce(buffer, group_name, parallel.one_shot_max_bytes(world_size), size, handle, peers=peers,
                              fused=parallel.all_reduce_kernel == "triton_fused")


def _off(rank: int, world_size: int, reason: str) -> AllReducePath:
    path = AllReducePath(world_size, off_reason=reason)
    if rank == 0:
        logger.info("all-reduce: %s", path.describe())
    return path
