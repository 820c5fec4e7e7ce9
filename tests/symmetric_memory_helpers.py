"""Shared by the CPU tests of the symmetric-memory all-reduce (engine/distributed/custom_all_reduce.py)
and of what times it (experiments/lib/profiling/collectives.py): a stand-in for torch's `symm_mem` ops."""
from __future__ import annotations

from engine.distributed.custom_all_reduce import ONE_SHOT, TWO_SHOT


class FakeSymmOps:
    """torch.ops.symm_mem's two ops as two ranks holding the same input would see them (sum = 2x);
    records which op ran on which buffer address."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def one_shot_all_reduce_out(self, staged, op, group, out):
        self.calls.append((ONE_SHOT, staged.data_ptr()))
        return out.copy_(staged * 2)

    def two_shot_all_reduce_out(self, staged, op, group, out):
        self.calls.append((TWO_SHOT, staged.data_ptr()))
        return out.copy_(staged * 2)
