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


def mirrored_peers(buffer, world: int = 2, programs: int = 3):
    """The Triton kernels' peer table for `world` ranks that all hold this rank's buffer (so the sum
    is `world` x the message, as `FakeSymmOps` has it), barriers compiled out for the interpreter;
    one-shot only: two-shot's in-place slice sums would be read back by the mirrored ranks."""
    import torch

    from kernels.all_reduce import PeerBuffers

    pads = torch.zeros(world * programs, dtype=torch.int32)
    peers = PeerBuffers((buffer.data_ptr(),) * world, (pads.data_ptr(),) * world, 0, buffer.numel(), programs,
                        barrier=False)
    return peers, pads  # keep the pads alive as long as the peers
