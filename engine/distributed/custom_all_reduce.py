"""Start-up of the custom all-reduce (vLLM's name): whether a tensor-parallel group sums its small
messages over NVLink peer memory (engine/distributed/symmetric_all_reduce.py, the paths by size in
engine/distributed/all_reduce_path.py) or leaves every message to NCCL.

Start-up is collective: every rank checks what it can (`unavailable_reason`), the ranks agree (all
or none), allocate and exchange the symmetric buffer (torch's `symm_mem.empty` and `rendezvous`),
and agree again, on the Triton kernels' grid as well; any failure leaves every rank on NCCL, with
one log line saying why (`AllReducePath.describe`).

On by default, as vLLM's custom all-reduce; `disable_custom_all_reduce=True` sends every
all-reduce through NCCL.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch

from engine.distributed.all_reduce_path import AllReducePath, settings_reason
from engine.distributed.symmetric_all_reduce import REGIONS, SymmetricAllReduce
from engine.parallel_config import ParallelConfig

logger = logging.getLogger("servelab.engine")

# Whether this process has joined a symmetric-memory rendezvous. torch's exchange of the buffers'
# handles keeps per-process state that a later engine's fresh workers do not share, so a second
# rendezvous in the user's process waits for good (measured on two GPUs: the second TP=2 engine of
# a process hung there, its groups renamed or not): such an engine stays on NCCL, the reason logged.
_rendezvous_joined = False
REQUIRED_OPS = ("one_shot_all_reduce_out", "two_shot_all_reduce_out")


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
    path = AllReducePath(world_size, custom.one_shot_max, custom.two_shot_max, kernel=parallel.kernel_for(world_size))
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
    kernel = parallel.kernel_for(world_size)
    # The Triton kernels alternate regions (no closing barrier); torch's kernels and the Lamport
    # kernel's fallbacks use one, the Lamport kernel its rounds after it.
    regions = 1 if kernel in ("torch", "triton_lamport") else REGIONS
    lamport = 0
    if kernel == "triton_lamport":
        from kernels.all_reduce_lamport import LamportSlots

        lamport = LamportSlots.area_bytes(world_size, size)
    buffer = symm_mem.empty(regions * size + lamport, dtype=torch.uint8, device=device)
    _rendezvous_joined = True  # even if it fails: the exchange's state has moved on
    handle = symm_mem.rendezvous(buffer, group_name)
    if handle is None:
        raise RuntimeError("rendezvous returned no handle (the buffer is not symmetric memory)")
    peers = None
    if kernel != "torch":
        from kernels.all_reduce import PeerBuffers

        peers = PeerBuffers.of_rendezvous(handle, buffer[:regions * size])
    one_shot = parallel.one_shot_max_bytes(world_size)
    if lamport:
        from engine.distributed.lamport_all_reduce import LamportAllReduce

        area = buffer[size:]
        slots = LamportSlots.of_rendezvous(handle, area, size)
        return LamportAllReduce(buffer[:size], area, slots, group_name, one_shot, size, handle, peers=peers)
    return SymmetricAllReduce(buffer, group_name, one_shot, size, handle, peers=peers,
                              fused=kernel == "triton_fused", regions=regions)


def _off(rank: int, world_size: int, reason: str) -> AllReducePath:
    path = AllReducePath(world_size, off_reason=reason)
    if rank == 0:
        logger.info("all-reduce: %s", path.describe())
    return path
