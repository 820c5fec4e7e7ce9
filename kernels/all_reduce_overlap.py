"""The fused all-reduce + residual add + RMSNorm of kernels/all_reduce.py in two column halves, so
that the exchange of the first half runs beside the GEMM that produces the second.

The row-parallel GEMM writes its partial sums [rows, hidden] into the symmetric buffer in two
launches, columns [0, split) and [split, hidden) (each with its half of the weight's output rows:
the weight bytes read are those of one GEMM). Once the first half is written,
`exchange_first_columns` (on a side stream, a few programs: it shares the GPU with the second
GEMM) sums those columns over the ranks, adds the residual and writes the new residual's first
columns and each row's float32 sum of squares of them. After the join, `exchange_rest_add_rms_norm`
does the same for the other columns, adds the two sums of squares and writes the normed rows, all
columns (the first half's read back from the new residual it wrote).

Arithmetic: each element's sum over the ranks, in rank order, and the residual add are those of
the one-kernel version (the same bits); the norm's sum of squares is added in two parts (each half
summed, then the halves), so the normed rows may differ from it by a rounding of the last bit.

Barriers: the signal-pad protocol of kernels/all_reduce.py, on the same slots. On each rank the
two kernels run one after the other (the second waits on the side stream's join), so a slot sees
the same sequence of barriers on every rank: the first kernel's start barrier (every rank's first
half written), then the second kernel's start and end barriers. The first kernel needs no end
barrier: a rank's buffer is rewritten only after its second kernel's end barrier, which every
peer's program reaches only after that peer's first kernel has finished reading.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.all_reduce import PeerBuffers, _barrier, _sum_ranks, fits_add_rms_norm

# The side kernel's programs at most: few enough that the second GEMM keeps most of the SMs.
SIDE_PROGRAMS = 32


def split_column(hidden: int, itemsize: int) -> int | None:
    """Where the second half of a row of `hidden` elements starts (the half), or None where the
    rows do not split: not held by the fused kernel, odd, or halves off 16-byte boundaries."""
    if not fits_add_rms_norm(hidden) or hidden % 2 or (hidden // 2 * itemsize) % 16:
        return None
    return hidden // 2


@triton.jit
def _first_columns_kernel(bufs, pads, res_ptr, res_out_ptr, sumsq_ptr, rows, HIDDEN: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, RANK: tl.constexpr,
                          WORLD: tl.constexpr, BARRIER: tl.constexpr):
    """Columns [0, SPLIT): the sum + residual (new residual) and each row's sum of its squares."""
    pid = tl.program_id(0)
    if BARRIER:
        _barrier(pads, pid, RANK, WORLD)
    dtype = res_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_C)[None, :]
    for first in range(pid * ROWS, rows, tl.num_programs(0) * ROWS):
        row = first + tl.arange(0, ROWS)[:, None]
        mask = (row < rows) & (cols < SPLIT)
        offs = row * HIDDEN + cols
        total = _sum_ranks(bufs, offs, mask, dtype, WORLD).to(dtype)
        h = (total.to(tl.float32) + tl.load(res_ptr + offs, mask=mask).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + offs, h, mask=mask)
        x = h.to(tl.float32)
        tl.store(sumsq_ptr + row, tl.sum(tl.where(mask, x * x, 0.0), 1)[:, None], mask=row < rows)


@triton.jit
def _rest_add_rms_norm_kernel(bufs, pads, res_ptr, w_ptr, sumsq_ptr, res_out_ptr, out_ptr, rows, eps,
                              HIDDEN: tl.constexpr, SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
                              ROWS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, BARRIER: tl.constexpr):
    """Columns [SPLIT, HIDDEN): the sum + residual; then every column's RMSNorm, the row's sum of
    squares the first kernel's plus these columns'."""
    pid = tl.program_id(0)
    if BARRIER:
        _barrier(pads, pid, RANK, WORLD)
    dtype = res_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_C)[None, :]
    first_cols, rest_cols = cols < SPLIT, cols < HIDDEN - SPLIT
    w_first = tl.load(w_ptr + cols, mask=first_cols).to(tl.float32)
    w_rest = tl.load(w_ptr + SPLIT + cols, mask=rest_cols).to(tl.float32)
    for first in range(pid * ROWS, rows, tl.num_programs(0) * ROWS):
        row = first + tl.arange(0, ROWS)[:, None]
        mask = (row < rows) & rest_cols
        offs = row * HIDDEN + SPLIT + cols
        total = _sum_ranks(bufs, offs, mask, dtype, WORLD).to(dtype)
        h = (total.to(tl.float32) + tl.load(res_ptr + offs, mask=mask).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + offs, h, mask=mask)
        x = h.to(tl.float32)
        sumsq = tl.load(sumsq_ptr + row, mask=row < rows, other=0.0) + tl.sum(tl.where(mask, x * x, 0.0), 1)[:, None]
        rstd = tl.rsqrt(sumsq / HIDDEN + eps)
        tl.store(out_ptr + offs, (w_rest * (x * rstd).to(dtype).to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)
        mask_first = (row < rows) & first_cols
        offs_first = row * HIDDEN + cols
        x_first = tl.load(res_out_ptr + offs_first, mask=mask_first).to(tl.float32)  # the first kernel's
        tl.store(out_ptr + offs_first,
                 (w_first * (x_first * rstd).to(dtype).to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask_first)
    if BARRIER:
        tl.debug_barrier()  # every thread's reads are done before the signal
        _barrier(pads, pid, RANK, WORLD)


def _layout(staged: torch.Tensor, split: int, programs: int) -> tuple[int, int, int, int]:
    """(programs, BLOCK_C, rows per program iteration, warps) for half rows of `staged`."""
    rows, hidden = staged.shape
    block_c = triton.next_power_of_2(max(split, hidden - split))
    per_program = min(4, triton.next_power_of_2(triton.cdiv(rows, programs)))  # rows in flight
    warps = max(1, min(16, per_program * block_c // (32 * max(1, 16 // staged.element_size()) * 2)))
    return min(programs, triton.cdiv(rows, per_program)), block_c, per_program, warps


def _check(staged: torch.Tensor, residual: torch.Tensor, split: int) -> None:
    hidden = staged.shape[-1]
    if staged.dim() != 2 or split != split_column(hidden, staged.element_size()) or residual.shape != staged.shape \
            or not residual.is_contiguous() or not staged.is_contiguous():
        raise ValueError(f"split all-reduce + RMSNorm: contiguous rows of {hidden} split at "
                         f"{split_column(hidden, staged.element_size())} and a residual of the same shape; got "
                         f"split {split}, residual {tuple(residual.shape)}")


def exchange_first_columns(peers: PeerBuffers, staged: torch.Tensor, residual: torch.Tensor, split: int,
                           residual_out: torch.Tensor, sumsq: torch.Tensor, max_programs: int | None = None) -> None:
    """Columns [0, split) of `staged` [rows, hidden] (this rank's partial sums, a view of its
    buffer) summed over the ranks + `residual` into `residual_out`; each row's float32 sum of
    squares of those columns into `sumsq` [rows]. At most `max_programs` programs (None:
    SIDE_PROGRAMS; every rank must pass the same)."""
    _check(staged, residual, split)
    limit = SIDE_PROGRAMS if max_programs is None else max_programs
    programs, block_c, per_program, warps = _layout(staged, split, min(limit, peers.max_programs))
    _first_columns_kernel[(programs,)](
        peers.views(staged), peers.signal_pads, residual, residual_out, sumsq, staged.shape[0], HIDDEN=staged.shape[1],
        SPLIT=split, BLOCK_C=block_c, ROWS=per_program, RANK=peers.rank, WORLD=peers.world_size,
        BARRIER=peers.barrier, num_warps=warps)


def exchange_rest_add_rms_norm(peers: PeerBuffers, staged: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float, split: int, residual_out: torch.Tensor, sumsq: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """After `exchange_first_columns` of the same tensors: columns [split, hidden) likewise, then
    (rms_norm(sum + residual) * weight, sum + residual) of every column, as
    one_shot_all_reduce_add_rms_norm returns them."""
    _check(staged, residual, split)
    out = torch.empty(staged.shape, dtype=torch.promote_types(weight.dtype, staged.dtype), device=staged.device)
    programs, block_c, per_program, warps = _layout(staged, split, peers.max_programs)
    _rest_add_rms_norm_kernel[(programs,)](
        peers.views(staged), peers.signal_pads, residual, weight, sumsq, residual_out, out, staged.shape[0], eps,
        HIDDEN=staged.shape[1], SPLIT=split, BLOCK_C=block_c, ROWS=per_program, RANK=peers.rank,
        WORLD=peers.world_size, BARRIER=peers.barrier, num_warps=warps)
    return out, residual_out
