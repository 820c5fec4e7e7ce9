"""The barrier-free one-shot all-reduce over symmetric memory ("flags in the data"): each rank
pushes its partial sums into every peer's buffer and polls its own buffer until the peers' values
are there. No barrier and no signal pads: the data is its own flag. Plain, or fused with the next
layer's residual add and RMSNorm as kernels/all_reduce.py's fused one-shot.

Layout: each rank's area holds ROUNDS rounds x W slots x `slot_bytes`; slot r of round b of rank
q's area receives rank r's message of a call using round b. Every element of the area starts as
the sentinel, the 16-bit negative zero (bits 0x8000, the same in bf16 and fp16), which a message
never carries: the sender turns -0.0 into +0.0 before pushing (the value is the same; every rank
sums the sent values, so every rank still gets the same bits).

One call (per program, on its rows; the grid depends only on the message and `max_programs`, so
program p of every rank covers the same elements):
1. load this rank's values (any tensor: the row-parallel GEMM's output as it is), -0.0 -> +0.0;
2. store them into slot RANK of round b of every peer's area (stores over NVLink);
3. for r in rank order: this rank's values from registers, a peer's by polling slot r of round b
   of its own area with volatile loads until no element is the sentinel, then writing the
   sentinel back there (the round is clean for its next use); sum in float32 in rank order;
4. write the sum (or `+ residual`, the RMSNorm: the fused kernel).
A program waits only on the same program of the other ranks, which stores before it polls, so
every program is resident (at most one per SM) and none waits on a program that cannot run.

Invariants (the caller keeps the first two: engine/distributed/lamport_all_reduce.py):
- consecutive calls never use the same round;
- the area is all sentinel on every rank, and the fill done on the GPU, before any rank launches
  its first call (start-up fills, synchronizes, then the ranks agree);
- a call leaves every slot it read all sentinel; it writes only its own slot in the peers' areas.
Why a push never lands on values not yet read: a peer pushes call j only after finishing call
j-1 (stream order), which needs this rank's push of call j-1, which this rank makes only after
finishing call j-2, its clearing of that round included. So when call j's values arrive, this
rank has cleared every round it read up to call j-2; round b(j) differs from b(j-1), so it was
last read at j-2 or before: all sentinel. The same chain orders the clears before the next push:
a rank's clears are stores to its own memory, finished when its kernel ends, before its next
kernel's push makes the peer go on (kernel boundaries order a rank's stores; the peers' pushes
land in the owner's memory, where its own stores went).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.all_reduce import (
    _add_rms_norm_rows,
    _norm_weight,
    _row_block,
    check_norm_rows,
    flat_grid,
    norm_grid,
    norm_outputs,
)

# Rounds each area holds: a call uses another round than the call before it (the caller alternates).
ROUNDS = 3
# The sentinel's bits as int16 (0x8000): negative zero in bf16 and fp16.
SENTINEL = -32768
_SENTINEL = tl.constexpr(SENTINEL)
# The message dtypes the kernels take (16-bit floats: one sentinel for both).
LAMPORT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(slots=True, frozen=True)
class LamportSlots:
    """One rank's view of the group's Lamport areas: every rank's area as an address in this
    process (index = rank), this rank, and each slot's size (the largest message)."""

    areas: tuple[int, ...]
    rank: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if not self.areas or not 0 <= self.rank < len(self.areas):
            raise ValueError(f"LamportSlots: rank {self.rank} of {len(self.areas)} areas is inconsistent")
        if self.slot_bytes <= 0 or self.slot_bytes % 16:
            raise ValueError(f"LamportSlots.slot_bytes={self.slot_bytes} is invalid: a positive multiple of 16")
        if any(a % 16 for a in self.areas):
            raise ValueError(f"LamportSlots.areas={[hex(a) for a in self.areas]}: each must be 16-byte aligned")

    @classmethod
    def of_rendezvous(cls, handle, area: torch.Tensor, slot_bytes: int) -> LamportSlots:
        """From torch's rendezvous handle of the allocation `area` is a view of: every rank's
        address of `area`'s first byte."""
        shift = area.data_ptr() - handle.buffer_ptrs[handle.rank]
        return cls(tuple(p + shift for p in handle.buffer_ptrs), handle.rank, slot_bytes)

    @staticmethod
    def area_bytes(world_size: int, slot_bytes: int) -> int:
        return ROUNDS * world_size * slot_bytes

    @property
    def world_size(self) -> int:
        return len(self.areas)

    def _slot(self, area: int, round_: int, sender: int) -> int:
        if not 0 <= round_ < ROUNDS:
            raise ValueError(f"round={round_} is invalid: 0 .. {ROUNDS - 1}")
        return area + (round_ * self.world_size + sender) * self.slot_bytes

    def push(self, round_: int) -> tuple[int, ...]:
        """Where this rank's message of a call in `round_` goes in each rank's area."""
        return tuple(self._slot(a, round_, self.rank) for a in self.areas)

    def poll(self, round_: int) -> tuple[int, ...]:
        """Where each rank's message of a call in `round_` arrives in this rank's area."""
        return tuple(self._slot(self.areas[self.rank], round_, r) for r in range(self.world_size))


def fill_sentinel(area: torch.Tensor) -> torch.Tensor:
    """Every element of `area` (bytes, an even number) the sentinel."""
    return area.view(torch.int16).fill_(SENTINEL)


@triton.jit
def _take(address, offs, mask):
    """A peer's values at `address + offs`: polled (volatile 16-byte loads of the whole block:
    values once there stay until cleared) until no element is the sentinel, then the sentinel
    written back."""
    ptr = tl.multiple_of(address.to(tl.pointer_type(tl.int16)), 16) + offs
    bits = tl.load(ptr, mask=mask, other=0, volatile=True)
    while tl.max(tl.ravel((bits == _SENTINEL).to(tl.int32)), 0) > 0:
        bits = tl.load(ptr, mask=mask, other=0, volatile=True)
    tl.store(ptr, tl.full(bits.shape, _SENTINEL, tl.int16), mask=mask)
    return bits


@triton.jit
def _exchange(src_ptr, push, poll, offs, mask, dtype: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """The sum over the ranks (float32, in rank order) of the elements `offs` of every rank's `src`."""
    own = tl.load(src_ptr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0)
    own = tl.where(own == _SENTINEL, tl.zeros_like(own), own)  # -0.0 -> +0.0: the sentinel is never sent
    for q in tl.static_range(WORLD):
        if q != RANK:
            tl.store(tl.multiple_of(push[q].to(tl.pointer_type(tl.int16)), 16) + offs, own, mask=mask)
    for r in tl.static_range(WORLD):
        if r == RANK:
            bits = own
        else:
            bits = _take(poll[r], offs, mask)
        value = bits.to(dtype, bitcast=True).to(tl.float32)
        if r == 0:
            acc = value
        else:
            acc += value
    return acc


@triton.jit
def _lamport_kernel(src_ptr, push, poll, out_ptr, numel, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    for start in range(pid * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < numel
        tl.store(out_ptr + offs, _exchange(src_ptr, push, poll, offs, mask, dtype, RANK, WORLD).to(dtype), mask=mask)


@triton.jit
def _lamport_add_rms_norm_kernel(src_ptr, push, poll, res_ptr, w_ptr, res_out_ptr, out_ptr, rows, eps,
                                 HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                                 RANK: tl.constexpr, WORLD: tl.constexpr):
    pid = tl.program_id(0)
    dtype = res_out_ptr.dtype.element_ty
    w = _norm_weight(w_ptr, HIDDEN, BLOCK_H)
    for first in range(pid * ROWS, rows, tl.num_programs(0) * ROWS):
        offs, mask = _row_block(first, rows, HIDDEN, BLOCK_H, ROWS)
        total = _exchange(src_ptr, push, poll, offs, mask, dtype, RANK, WORLD)
        _add_rms_norm_rows(total, res_ptr, w, res_out_ptr, out_ptr, offs, mask, eps, HIDDEN)


def _check(slots: LamportSlots, x: torch.Tensor) -> None:
    nbytes = x.numel() * x.element_size()
    if x.dtype not in LAMPORT_DTYPES or not x.is_contiguous() or not 0 < nbytes <= slots.slot_bytes:
        raise ValueError(f"the Lamport all-reduce takes contiguous {LAMPORT_DTYPES} messages of 1 .. "
                         f"{slots.slot_bytes} bytes; got {x.dtype}, {nbytes} bytes, contiguous={x.is_contiguous()}")


def lamport_all_reduce(slots: LamportSlots, round_: int, max_programs: int, x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of `x` (any contiguous 16-bit float tensor) as a new tensor, through
    round `round_` (another than the call before's)."""
    _check(slots, x)
    out = torch.empty_like(x)
    programs, block, warps = flat_grid(max_programs, x.numel(), x.element_size())
    _lamport_kernel[(programs,)](x, slots.push(round_), slots.poll(round_), out, x.numel(), RANK=slots.rank,
                                 WORLD=slots.world_size, BLOCK=block, num_warps=warps)
    return out


def lamport_all_reduce_add_rms_norm(slots: LamportSlots, round_: int, max_programs: int, partial: torch.Tensor,
                                    residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum + residual) * weight, sum + residual) for `partial` [rows, hidden], the sum
    over the ranks, as kernels/all_reduce.py's fused one-shot computes them."""
    _check(slots, partial)
    check_norm_rows(partial, residual)
    rows, hidden = partial.shape
    out, residual_out = norm_outputs(partial, weight)
    programs, per_program, block_h, warps = norm_grid(max_programs, rows, hidden, partial.element_size())
    _lamport_add_rms_norm_kernel[(programs,)](
        partial, slots.push(round_), slots.poll(round_), residual, weight, residual_out, out, rows, eps,
        HIDDEN=hidden, BLOCK_H=block_h, ROWS=per_program, RANK=slots.rank, WORLD=slots.world_size, num_warps=warps)
    return out, residual_out
