"""All-reduce over a symmetric-memory buffer in Triton, with as many programs as the GPU has SMs:
one-shot, two-shot, and one-shot fused with the next layer's residual add and RMSNorm.

Every rank's buffer is mapped into every rank's address space (torch's symmetric memory); the
kernels get the mapped addresses as plain integers (`PeerBuffers`), fixed for the buffer's life, so
a CUDA graph replays them as captured.

Barriers are blockwise, on the rendezvous's signal pads (one int32 slot per (program, rank) pair in
each rank's pad): program p signals slot `p * W + rank` of every rank's pad (a compare-and-swap
0 -> 1, release, system scope; it spins while the slot still holds the previous barrier's signal)
and then consumes its own pad's W slots (1 -> 0, acquire). Each barrier leaves the pads zero, as
torch's own kernels do, so both kinds of kernels share the pads. Program p of one rank only waits
on program p of the others, so the grid never exceeds what the GPU runs at once (one program per
SM), or programs that wait would hold SMs the ones they wait for need. Every rank launches the same
grid for a message (the grid depends only on its size and `max_programs`, which the ranks agree on).

- one-shot: barrier (every rank's producer has finished writing), each program reads its blocks
  of every rank's buffer and sums them in float32 in rank order (the same bits on every rank),
  barrier (no rank's buffer is rewritten while a peer still reads it; `close=False` leaves it out
  for a caller whose next call writes another part of the buffer, whose opening barrier then
  proves this call's reads done: engine/distributed/symmetric_all_reduce.py);
- two-shot: each rank sums its 1/W slice of every buffer into its own buffer (in place), barrier,
  every rank gathers the slices' sums: W times fewer bytes read per rank, one barrier more;
- one-shot + add + RMSNorm (rows of the hidden size): the sum rounded to the activation dtype (what
  the all-reduce returns), `+ residual` in that dtype (the new residual, written out), then the
  RMSNorm as engine/models/ops.py computes it (float32, rounded before the weight multiply).

`barrier=False` compiles the barriers out: the CPU interpreter runs one process, which cannot play
several ranks, and checks the arithmetic with stand-in peer buffers (tests/kernel/test_all_reduce.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import num_sms

# Bytes each program moves per rank and loop iteration at most (16-byte vectors, a few per thread).
BLOCK_BYTES = 16 * 2**10
# The widest row the fused kernel holds in one program (elements).
NORM_MAX_HIDDEN = 16384


@dataclass(slots=True, frozen=True)
class PeerBuffers:
    """One rank's view of the group's symmetric memory: every rank's buffer and signal pad as
    addresses in this process (index = rank), and how many programs a kernel may launch (the
    same on every rank: the fewest SMs of the group, within the signal pads' slots)."""

    buffers: tuple[int, ...]
    signal_pads: tuple[int, ...]
    rank: int
    nbytes: int  # each buffer's size
    max_programs: int
    barrier: bool = True

    def __post_init__(self) -> None:
        world = len(self.buffers)
        if world < 1 or len(self.signal_pads) != world or not 0 <= self.rank < world:
            raise ValueError(f"PeerBuffers: {world} buffers, {len(self.signal_pads)} signal pads and rank "
                             f"{self.rank} are inconsistent (one of each per rank)")
        if self.max_programs < 1:
            raise ValueError(f"PeerBuffers.max_programs={self.max_programs} is invalid: at least 1")
        if any(b % 16 for b in self.buffers):  # the kernels load 16 bytes at a time
            raise ValueError(f"PeerBuffers.buffers={[hex(b) for b in self.buffers]}: each must be 16-byte aligned")

    @classmethod
    def of_rendezvous(cls, handle, buffer: torch.Tensor) -> PeerBuffers:
        """From torch's rendezvous handle of `buffer`: the ranks' mapped addresses of its first
        byte, at most one program per SM and per signal-pad slot."""
        shift = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]  # the buffer's offset in its allocation
        programs = min(num_sms(buffer.device.index), pad_programs(handle.signal_pad_size, handle.world_size))
        return cls(tuple(p + shift for p in handle.buffer_ptrs), tuple(handle.signal_pad_ptrs), handle.rank,
                   buffer.numel() * buffer.element_size(), programs)

    @property
    def world_size(self) -> int:
        return len(self.buffers)

    def views(self, staged: torch.Tensor) -> tuple[int, ...]:
        """Every rank's address of the bytes `staged` (a view of this rank's buffer) covers."""
        offset = staged.data_ptr() - self.buffers[self.rank]
        if offset < 0 or offset % 16 or offset + staged.numel() * staged.element_size() > self.nbytes:
            raise ValueError(f"a tensor at byte offset {offset} of the {self.nbytes}-byte symmetric buffer: "
                             "the kernels take views of the buffer, 16-byte aligned")
        return tuple(b + offset for b in self.buffers)


def pad_programs(signal_pad_bytes: int, world_size: int) -> int:
    """How many programs' barrier slots one signal pad holds."""
    return signal_pad_bytes // 4 // world_size


@triton.jit
def _barrier(pads, pid, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `pid` of every rank meets: signal each rank's slot for (pid, RANK), then consume the
    W signals sent to this rank's (pid, r) slots. Release on the signal, acquire on the wait."""
    for peer in tl.static_range(WORLD):
        slot = pads[peer].to(tl.pointer_type(tl.int32)) + pid * WORLD + RANK
        while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
            pass
    own = pads[RANK].to(tl.pointer_type(tl.int32)) + pid * WORLD
    for peer in tl.static_range(WORLD):
        while tl.atomic_cas(own + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass


@triton.jit
def _rank_ptr(address, dtype: tl.constexpr):
    """A rank's buffer address as a pointer the compiler knows is 16-byte aligned (16-byte loads)."""
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


@triton.jit
def _sum_ranks(bufs, offs, mask, dtype: tl.constexpr, WORLD: tl.constexpr):
    acc = tl.load(_rank_ptr(bufs[0], dtype) + offs, mask=mask).to(tl.float32)
    for r in tl.static_range(1, WORLD):
        acc += tl.load(_rank_ptr(bufs[r], dtype) + offs, mask=mask).to(tl.float32)
    return acc


@triton.jit
def _one_shot_kernel(bufs, pads, out_ptr, numel, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     BARRIER: tl.constexpr, CLOSE: tl.constexpr):
    pid = tl.program_id(0)
    if BARRIER:
        _barrier(pads, pid, RANK, WORLD)
    dtype = out_ptr.dtype.element_ty
    for start in range(pid * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < numel
        tl.store(out_ptr + offs, _sum_ranks(bufs, offs, mask, dtype, WORLD).to(dtype), mask=mask)
    if BARRIER and CLOSE:
        tl.debug_barrier()  # every thread's reads are done before the signal
        _barrier(pads, pid, RANK, WORLD)


@triton.jit
def _two_shot_kernel(bufs, pads, out_ptr, numel, part, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    """Rank q's slice is [q * part, min((q + 1) * part, numel)), `part` a multiple of 16 elements;
    program p covers the same offsets of every slice, so its own barrier orders a slice's sum
    before its gather."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    dtype = out_ptr.dtype.element_ty
    if BARRIER:
        _barrier(pads, pid, RANK, WORLD)
    own = _rank_ptr(bufs[RANK], dtype)
    lo, hi = RANK * part, tl.minimum((RANK + 1) * part, numel)
    for start in range(pid * BLOCK, part, step):
        offs = tl.max_contiguous(lo + start + tl.arange(0, BLOCK), BLOCK)
        mask = offs < hi
        total = _sum_ranks(bufs, offs, mask, dtype, WORLD).to(dtype)
        tl.store(own + offs, total, mask=mask)  # only this rank reads its own slice before the barrier
        tl.store(out_ptr + offs, total, mask=mask)
    if BARRIER:
        tl.debug_barrier()
        _barrier(pads, pid, RANK, WORLD)
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer = _rank_ptr(bufs[q], dtype)
            for start in range(pid * BLOCK, part, step):
                offs = tl.max_contiguous(q * part + start + tl.arange(0, BLOCK), BLOCK)
                mask = offs < tl.minimum((q + 1) * part, numel)
                tl.store(out_ptr + offs, tl.load(peer + offs, mask=mask), mask=mask)
    if BARRIER:
        tl.debug_barrier()
        _barrier(pads, pid, RANK, WORLD)


@triton.jit
def _norm_weight(w_ptr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """The RMSNorm's weight as a [1, BLOCK_H] float32 row (zero past HIDDEN)."""
    cols = tl.arange(0, BLOCK_H)[None, :]
    return tl.load(w_ptr + cols, mask=cols < HIDDEN).to(tl.float32)


@triton.jit
def _row_block(first, rows, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """(element offsets, mask) of rows first .. first + ROWS - 1 of a [rows, HIDDEN] message."""
    row = first + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    return row * HIDDEN + cols, (row < rows) & (cols < HIDDEN)


@triton.jit
def _add_rms_norm_rows(total, res_ptr, w, res_out_ptr, out_ptr, offs, mask, eps, HIDDEN: tl.constexpr):
    """Rows of the all-reduced sum (float32) -> `+ residual` in the activation dtype (written to
    `res_out_ptr`), then the RMSNorm as engine/models/ops.py computes it (written to `out_ptr`)."""
    dtype = res_out_ptr.dtype.element_ty
    h = (total.to(dtype).to(tl.float32) + tl.load(res_ptr + offs, mask=mask).to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + offs, h, mask=mask)
    x = h.to(tl.float32)
    x = (x * tl.rsqrt(tl.sum(x * x, 1)[:, None] / HIDDEN + eps)).to(dtype)
    tl.store(out_ptr + offs, (w * x.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_add_rms_norm_kernel(bufs, pads, res_ptr, w_ptr, res_out_ptr, out_ptr, rows, eps,
                                  HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                                  RANK: tl.constexpr, WORLD: tl.constexpr, BARRIER: tl.constexpr,
                                  CLOSE: tl.constexpr):
    """ROWS rows per program and loop iteration (all their loads in flight at once)."""
    pid = tl.program_id(0)
    if BARRIER:
        _barrier(pads, pid, RANK, WORLD)
    dtype = res_out_ptr.dtype.element_ty
    w = _norm_weight(w_ptr, HIDDEN, BLOCK_H)
    for first in range(pid * ROWS, rows, tl.num_programs(0) * ROWS):
        offs, mask = _row_block(first, rows, HIDDEN, BLOCK_H, ROWS)
        total = _sum_ranks(bufs, offs, mask, dtype, WORLD)
        _add_rms_norm_rows(total, res_ptr, w, res_out_ptr, out_ptr, offs, mask, eps, HIDDEN)
    if BARRIER and CLOSE:
        tl.debug_barrier()
        _barrier(pads, pid, RANK, WORLD)


def flat_grid(max_programs: int, numel: int, itemsize: int) -> tuple[int, int, int]:
    """(programs, BLOCK elements, warps): blocks small enough to spread a message over the SMs,
    at most BLOCK_BYTES; 16-byte vectors, at most two per thread."""
    vec = max(1, 16 // itemsize)
    block = min(BLOCK_BYTES // itemsize, max(32 * vec, triton.next_power_of_2(triton.cdiv(numel, max_programs))))
    warps = max(1, min(16, block // (32 * vec * 2)))
    return min(max_programs, triton.cdiv(numel, block)), block, warps


def one_shot_all_reduce(peers: PeerBuffers, staged: torch.Tensor, out: torch.Tensor, close: bool = True) -> torch.Tensor:
    """`out` = the sum over the ranks of `staged` (a view of this rank's buffer), read whole from
    every rank. `close=False`: no closing barrier (the caller's next call stages elsewhere)."""
    numel = staged.numel()
    programs, block, warps = flat_grid(peers.max_programs, numel, staged.element_size())
    _one_shot_kernel[(programs,)](peers.views(staged), peers.signal_pads, out, numel, RANK=peers.rank,
                                  WORLD=peers.world_size, BLOCK=block, BARRIER=peers.barrier, CLOSE=close,
                                  num_warps=warps)
    return out


def two_shot_all_reduce(peers: PeerBuffers, staged: torch.Tensor, out: torch.Tensor, close: bool = True) -> torch.Tensor:
    """`out` = the sum over the ranks of `staged`; each rank sums one slice (overwriting it in
    `staged` with the sum) and gathers the others' sums. It always ends with a barrier (`close`
    is taken for a uniform call)."""
    numel, world = staged.numel(), peers.world_size
    part = triton.cdiv(triton.cdiv(numel, world), 16) * 16  # slices start on 16-byte boundaries
    programs, block, warps = flat_grid(peers.max_programs, part, staged.element_size())
    _two_shot_kernel[(programs,)](peers.views(staged), peers.signal_pads, out, numel, part, RANK=peers.rank,
                                  WORLD=world, BLOCK=block, BARRIER=peers.barrier, num_warps=warps)
    return out


def fits_add_rms_norm(hidden: int) -> bool:
    """Whether the fused kernel takes rows of `hidden` elements (one row per program iteration)."""
    return 0 < hidden <= NORM_MAX_HIDDEN


def one_shot_all_reduce_add_rms_norm(peers: PeerBuffers, staged: torch.Tensor, residual: torch.Tensor,
                                     weight: torch.Tensor, eps: float,
                                     close: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum + residual) * weight, sum + residual) for `staged` [rows, hidden] (a view of
    this rank's buffer holding its partial sums), as engine/models/ops.py's add_rms_norm computes
    them on the all-reduced rows. `close=False`: no closing barrier (as `one_shot_all_reduce`)."""
    check_norm_rows(staged, residual)
    rows, hidden = staged.shape
    out, residual_out = norm_outputs(staged, weight)
    programs, per_program, block_h, warps = norm_grid(peers.max_programs, rows, hidden, staged.element_size())
    _one_shot_add_rms_norm_kernel[(programs,)](
        peers.views(staged), peers.signal_pads, residual, weight, residual_out, out, rows, eps, HIDDEN=hidden,
        BLOCK_H=block_h, ROWS=per_program, RANK=peers.rank, WORLD=peers.world_size, BARRIER=peers.barrier,
        CLOSE=close, num_warps=warps)
    return out, residual_out


def check_norm_rows(rows: torch.Tensor, residual: torch.Tensor) -> None:
    """The fused kernels' rows: [rows, hidden] with hidden <= NORM_MAX_HIDDEN, and a contiguous
    residual of the same shape."""
    hidden = rows.shape[-1]
    if rows.dim() != 2 or not fits_add_rms_norm(hidden) or residual.shape != rows.shape or not residual.is_contiguous():
        raise ValueError(f"fused all-reduce + RMSNorm: rows of {hidden} (at most {NORM_MAX_HIDDEN}) and a "
                         f"contiguous residual of the same shape; got residual {tuple(residual.shape)}")


def norm_outputs(rows: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed rows, the new residual), allocated for the fused kernels."""
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, rows.dtype), device=rows.device)
    return out, torch.empty_like(rows)


def norm_grid(max_programs: int, rows: int, hidden: int, itemsize: int) -> tuple[int, int, int, int]:
    """(programs, rows per program and iteration, BLOCK_H, warps) of the fused kernels: up to 4
    rows in flight per program, at most `max_programs` programs."""
    block_h = triton.next_power_of_2(hidden)
    per_program = min(4, triton.next_power_of_2(triton.cdiv(rows, max_programs)))
    warps = max(1, min(16, per_program * block_h // (32 * max(1, 16 // itemsize) * 2)))
    return min(max_programs, triton.cdiv(rows, per_program)), per_program, block_h, warps
