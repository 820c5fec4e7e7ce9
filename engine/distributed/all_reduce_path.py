"""Which all-reduce carries a message: one-shot or two-shot over NVLink peer memory (torch's
symmetric memory, engine/distributed/symmetric_all_reduce.py) for the small messages of decode
steps, NCCL for the large ones, and the record of what a group took at start-up.

At decode sizes (tokens x hidden x 2 bytes: a few KB to a few MB) an NCCL all-reduce is bound by
its latency, not by NVLink's bandwidth. Like vLLM's and SGLang's custom all-reduce, each rank
holds one buffer that every other rank of the group maps, and a sum is one kernel of peer loads:
- one-shot (`symm_mem.one_shot_all_reduce_out`): every rank reads every rank's whole buffer and
  sums it; one barrier. Fewest steps: the smallest messages;
- two-shot (`symm_mem.two_shot_all_reduce_out`): each rank sums its 1/N slice (a reduce-scatter),
  then gathers the others' sums; N times fewer bytes read per rank, one barrier more: medium sizes;
- NCCL above `custom_all_reduce_max_bytes`, for other dtypes (the kernels implement bf16 and
  float32), other world sizes (2, 4, 8 only), and on CPUs (gloo).

The thresholds are `ParallelConfig`'s (engine/parallel_config.py); `experiments/bench_allreduce.py` measures
the three paths by size. Every rank picks the same path for a message, since the choice depends only
on its byte count, dtype and layout, which all ranks share. The simulator prices the same choice
(`choose_path`, `settings_reason`) for a run it models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel_config import ParallelConfig

ONE_SHOT, TWO_SHOT, NCCL = "one-shot", "two-shot", "nccl"
# What torch's symmetric-memory all-reduce kernels implement (the out-of-place two-shot kernel is
# specialized for these world sizes only).
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)
SYMMETRIC_WORLD_SIZES = (2, 4, 8)


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
