"""Split-KV bookkeeping shared by the per-head and Gluon decode kernels (kernels/decode.py,
kernels/decode_tma.py): how many splits a batch gets, the order in which a grid launches its
sequences, the partial-output buffers and the kernel that merges them.

With several splits every program writes a normalised partial output plus its log-sum-exp (base 2)
and `merge_splits` combines each (sequence, query head)'s partials in a second launch.

Splits pay off when one split leaves SMs idle: a small batch, or a last wave of equal programs
that runs part full. A ragged batch launched longest first keeps every SM busy once it has two
waves of programs or more (the short programs fill in behind the long ones), and there splits only
add the partials' traffic and the merge: on an H200, Gluon TMA decode over 176 sequences of
100..1900 tokens took 160 us with one split against 173 us with the four the fill rule chose
(experiments/lab/bench_step_parts.py).
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


# With a longest-first launch order, one split from this many waves of one-split programs on.
ORDERED_SINGLE_SPLIT_WAVES = 2


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device, config: SplitConfig,
                      ordered: bool = False) -> int:
    """The split count of a grid (an explicit config.num_splits, any count >= 1, else `splits_for`)."""
    if config.num_splits is not None:
        return config.num_splits
    return splits_for(batch * num_kv_heads, max_context, program_slots(config, device), config.min_split_tokens,
                      ordered)


def splits_for(programs: int, max_context: int, slots: int, min_split_tokens: int, ordered: bool) -> int:
    """Split count for `programs` one-split programs on `slots` program slots: one when they are
    launched longest first (`ordered`) and fill ORDERED_SINGLE_SPLIT_WAVES waves; else the count (a
    power of 2, to bound compiled variants) whose programs best fill whole waves, more splits only
    when that is clearly better, never chunks shorter than min_split_tokens."""
    if ordered and programs >= ORDERED_SINGLE_SPLIT_WAVES * slots:
        return 1
    cap = max(1, max_context // min_split_tokens)
    best, best_fill, splits = 1, 0.0, 1
    while splits <= cap:
        fill = programs * splits / (slots * triton.cdiv(programs * splits, slots))  # busy fraction of the waves
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
    splits = choose_num_splits(batch, num_kv_heads, max_context, device, config, ordered=order is not None)
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
        BLOCK_D=width, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        num_warps=1 if splits <= 8 else 2,  # one warp: 2.7 us against 9.0 at four (176 x 16 heads x 4 splits, H200)
    )  # fmt: skip
