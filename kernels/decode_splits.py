"""Split-KV bookkeeping shared by the per-head and Gluon decode kernels (kernels/decode.py,
kernels/decode_tma.py): how many splits a batch gets, the order in which a grid launches its
sequences, the partial-output buffers and the kernel that merges them.

With several splits every program writes a normalised partial output plus its log-sum-exp (base 2)
and `merge_splits` combines each (sequence, query head)'s partials in a second launch.
"""

from typing import Protocol

import torch
import triton
import triton.language as tl

from kernels.common import device_sms


class SplitConfig(Protocol):
    """The fields of a kernel config (DecodeConfig, TmaDecodeConfig) that size its split-KV grid."""

    num_splits: int | None  # None: choose_num_splits' heuristic
    programs_per_sm: int  # how many of the kernel's programs run at once on one SM
    min_split_tokens: int  # the heuristic never cuts a context finer than this


@triton.jit
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    rows = (b * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    merged = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def program_slots(config: SplitConfig, device: torch.device) -> int:
    """How many of the kernel's programs run at once on the device: one wave."""
    return config.programs_per_sm * device_sms(device)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device, config: SplitConfig) -> int:
    """Split count (a power of 2, to bound compiled variants) whose programs best fill whole waves
    of the GPU's program slots; more splits only when that is clearly better, never chunks shorter
    than min_split_tokens.  An explicit config.num_splits may be any count >= 1."""
    if config.num_splits is not None:
        return config.num_splits
    slots = program_slots(config, device)
    cap = max(1, max_context // config.min_split_tokens)
    best, best_fill, splits = 1, 0.0, 1
    while splits <= cap:
        programs = batch * num_kv_heads * splits
        fill = programs / (slots * triton.cdiv(programs, slots))  # busy fraction of the waves
        if fill > 1.05 * best_fill:
            best, best_fill = splits, fill
        splits *= 2
    return best


def launch_order(order: torch.Tensor | None, programs: int, slots: int) -> torch.Tensor | None:
    """The sequence launch order a grid uses: none while its programs fit one wave of the GPU's
    program slots (all start at once; longest first measured 0.9-2.7% slower there on an
    H200), else `order`."""
    return order if order is not None and programs > slots else None


def split_grid(batch: int, num_kv_heads: int, max_context: int, device: torch.device, config: SplitConfig,
               order: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """The split count and the launch order of a grid with a program per (sequence, KV head, split)."""
    splits = choose_num_splits(batch, num_kv_heads, max_context, device, config)
    return splits, launch_order(order, batch * num_kv_heads * splits, program_slots(config, device))


def split_partials(out: torch.Tensor, splits: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sequence, query head, split) rows: the normalised partial output (`width` wide) and its
    log-sum-exp; with one split the kernels write `out` directly (the pair is unused)."""
    if splits == 1:
        return out, out
    rows = out.shape[0] * out.shape[1] * splits
    return (torch.empty(rows, width, dtype=torch.float32, device=out.device),
            torch.empty(rows, dtype=torch.float32, device=out.device))  # fmt: skip


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, splits: int, width: int) -> None:
    """Combine the splits' partials into `out` (a second launch); nothing with one split."""
    if splits == 1:
        return
    batch, num_heads, head_dim = out.shape
    decode_reduce_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_D=width, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
    )  # fmt: skip
