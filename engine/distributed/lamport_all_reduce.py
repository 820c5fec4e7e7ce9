"""One rank's side of the barrier-free one-shot all-reduce (`all_reduce_kernel=triton_lamport`,
kernels/all_reduce_lamport.py: each rank pushes its values into its peers' buffers and polls its
own for theirs; the data is its own flag, so no barrier).

The symmetric allocation holds two parts: first one region of `custom_all_reduce_max_bytes` for
the barrier kernels (kernels/all_reduce.py's one-shot and two-shot, closing barrier included), which
carry what the Lamport kernel does not take (float32 messages); then the Lamport area, ROUNDS x W
slots of the same size, every element the sentinel (filled and synchronized at start-up, before
the ranks agree they are ready: `LamportAllReduce.__init__` runs inside that agreement).

Which messages: bf16 (the 16-bit dtype the symmetric paths take) up to `custom_all_reduce_max_bytes`,
one-shot at every size (as the fused kernel reads whole rows at every symmetric size); NCCL above.
The row-parallel GEMMs write their partial sums into ordinary tensors (`input_buffer` is None for
those): the kernel reads them and pushes them; at the layer boundary the norm sums them with its
residual add (`all_reduce_add_rms_norm`), the embedding's sum is the plain kernel.

Rounds: consecutive Lamport calls never share one (the kernel's invariant). As the barrier
kernels' regions: a forward's first Lamport call (after `begin_forward`, the vocabulary-parallel
embedding's) takes round 0, the next ones 1, 2, 1, 2, ...; the same sequence in every forward,
eager or replayed from a CUDA graph. The forward boundary is safe because a forward that makes
Lamport calls makes at least two (the embedding's and a layer's: every message of a forward has
its shape and dtype, so all take the Lamport kernel or none does), so it ends on round 1 or 2. A
forward that made exactly one (only outside the engine: a test, a benchmark) is continued rather
than restarted: its next call takes round 1. Calls on the other paths do not count.

Faults: the kernel spins on its polls as the barrier kernels do on theirs, so rank 0's pacing and
polling (`launch`, engine/distributed/step_wait.py) apply unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from engine.distributed.all_reduce_path import NCCL, choose_path
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce, alternating, forward_start
from kernels.all_reduce_lamport import (
    ROUNDS,
    LamportSlots,
    fill_sentinel,
    lamport_all_reduce,
    lamport_all_reduce_add_rms_norm,
)


class LamportAllReduce(SymmetricAllReduce):
    """`buffer`: the barrier kernels' part of the allocation (torch's symmetric memory, viewed as
    bytes; `peers` its Triton view, whose `max_programs` the Lamport grids use too); `area`: the
    Lamport part, whose every rank's address `slots` holds. Fills `area` with the sentinel and
    waits for the fill to finish."""

    def __init__(self, buffer: torch.Tensor, area: torch.Tensor, slots: LamportSlots, group_name: str,
                 one_shot_max: int, two_shot_max: int, handle: Any = None, ops: Any = None, peers: Any = None) -> None:
        if peers is None:
            raise ValueError("the Lamport all-reduce needs the Triton kernels' peer buffers (its grid, its fallbacks)")
        super().__init__(buffer, group_name, one_shot_max, two_shot_max, handle, ops=ops, peers=peers, fused=True)
        need = LamportSlots.area_bytes(slots.world_size, slots.slot_bytes)
        if area.numel() * area.element_size() < need:
            raise ValueError(f"the Lamport area has {area.numel() * area.element_size()} bytes: {ROUNDS} rounds x "
                             f"{slots.world_size} ranks x {slots.slot_bytes} bytes need {need}")
        self.area = area
        self.slots = slots
        self._lamport_calls = 0  # Lamport calls since the forward began
        fill_sentinel(area)
        if area.is_cuda:
            torch.cuda.synchronize(area.device)  # filled before any peer can push (the ranks agree next)

    def begin_forward(self) -> None:
        super().begin_forward()
        self._lamport_calls = forward_start(self._lamport_calls)

    @property
    def kernel(self) -> str:
        return "triton_lamport"

    def takes(self, nbytes: int, dtype: torch.dtype, contiguous: bool = True) -> bool:
        """Whether the Lamport kernel sums a message: 16-bit, of the symmetric paths' dtypes (bf16)
        and sizes, within a slot."""
        return (dtype.itemsize == 2 and nbytes <= self.slots.slot_bytes
                and choose_path(nbytes, dtype, contiguous, self.one_shot_max, self.two_shot_max) != NCCL)

    def _takes(self, x: torch.Tensor) -> bool:
        return self.takes(x.numel() * x.element_size(), x.dtype, x.is_contiguous())

    def round(self) -> int:
        """The round the next Lamport call uses."""
        return alternating(self._lamport_calls, ROUNDS)

    def _next_round(self) -> int:
        round_ = self.round()
        self._lamport_calls += 1
        return round_

    def input_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """None for the Lamport kernel's messages (it reads its input wherever it is)."""
        if self.takes(math.prod(shape) * dtype.itemsize, dtype):
            return None
        return super().input_buffer(shape, dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self._takes(x):
            return super().all_reduce(x)
        round_ = self._next_round()
        return self.launch(lambda: lamport_all_reduce(self.slots, round_, self.peers.max_programs, x))

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not (self._takes(partial) and self.fuses_rows(partial, residual)):
            return super().all_reduce_add_rms_norm(partial, residual, weight, eps)
        round_ = self._next_round()
        programs = self.peers.max_programs
        return self.launch(lambda: lamport_all_reduce_add_rms_norm(self.slots, round_, programs, partial, residual,
                                                                    weight, eps))
