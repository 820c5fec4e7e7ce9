"""Paged decode attention (one new query token per sequence): the entry point and the default,
per-KV-head kernel.

`paged_decode_attention` runs the per-KV-head kernel below unless given a `PackedDecodeConfig`,
which selects the packed kernel (kernels/decode_packed.py: all KV heads of a block per tile, an
even split of the batch's tiles over one program per SM).  Measured on an H200 (docs/kernels.md): packed is
faster on ragged and long-context batches, slower on short and small ones and at batch 64 x 4k.

Per-KV-head kernel, flash-decoding style.  Grid (batch, kv_head, split): a program takes every
query head of one KV head (GQA), so each K/V tile is read from the cache once, and runs tl.dot on
a [BLOCK_H, head_dim] query tile padded to 16 rows (the tensor-core minimum).  Each sequence's
context is cut into `num_splits` equal chunks; with several splits every program writes a
normalised partial output plus its log-sum-exp and a second kernel merges them, and past one wave
of programs the sequences can be launched in a given order, longest first (kernels/decode_splits.py).
The split count comes from the batch and the block table's width only, never from the context
lengths' values, so the launch needs no device sync and can be captured in a CUDA graph (the packed
kernel's grid is fixed per device, likewise).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import LOG2E, block_dim, dot_precision, upcast_operands
from kernels.decode_packed import PackedDecodeConfig, attend_tile, paged_decode_packed
from kernels.decode_splits import merge_splits, split_grid, split_partials
from kernels.decode_tma import TmaDecodeConfig, paged_decode_tma, tma_decode_supported
from kernels.validate import check_attention_inputs, check_order, check_out


@dataclass(slots=True, frozen=True)
class DecodeConfig:
    """The per-KV-head kernel; defaults are its H200 sweep's best at batch 64 x 4k (docs/kernels.md)."""

    block_n: int = 32  # tokens per K/V tile
    num_warps: int = 4
    num_stages: int = 4  # K/V tiles in flight + 1 (54 KB of shared memory: 4 programs per SM)
    num_splits: int | None = None  # None: heuristic below
    programs_per_sm: int = 4  # how many of these programs run at once on one SM
    min_split_tokens: int = 256  # heuristic never cuts a context finer than this
    heads_fastest: bool = True  # launch the KV heads of one sequence next to each other
    kv_eviction: str = ""  # cache hint for the K/V loads ("evict_first": streamed, keep L2 for the rest)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    KV_EVICTION: tl.constexpr,
    order_ptr=None,
    ORDERED: tl.constexpr = False,
):
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
    if ORDERED:  # the caller's launch order of the sequences (e.g. longest first)
        b = tl.load(order_ptr + b)
    split = tl.program_id(2)
    length = tl.load(context_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(length, start + chunk)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    hd_mask = (offs_h < GROUP)[:, None]
    if BLOCK_D != HEAD_DIM:
        hd_mask = hd_mask & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
    # Page ids of the next tile are loaded one iteration ahead (a loop-carried register), so the K/V
    # loads do not depend on a load of their own iteration and Triton pipelines them num_stages deep.
    page = tl.load(table + (start + offs_n) // BLOCK_SIZE, mask=start + offs_n < end, other=0).to(tl.int64)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        n_mask = tokens < end
        slot = tokens % BLOCK_SIZE
        kv_mask = n_mask[:, None]
        if BLOCK_D != HEAD_DIM:
            kv_mask = kv_mask & (offs_d < HEAD_DIM)[None, :]
        k_rows = (page * stride_kb + slot * stride_kt)[:, None]
        v_rows = (page * stride_vb + slot * stride_vt)[:, None]
        k = tl.load(k_base + k_rows, mask=kv_mask, other=0.0, eviction_policy=KV_EVICTION)
        v = tl.load(v_base + v_rows, mask=kv_mask, other=0.0, eviction_policy=KV_EVICTION)
        after = tokens + BLOCK_N
        page = tl.load(table + after // BLOCK_SIZE, mask=after < end, other=0).to(tl.int64)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION)

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=hd_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=offs_h < GROUP)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    config: DecodeConfig | PackedDecodeConfig | TmaDecodeConfig | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out` (optional, [B, Hq, D] with contiguous head_dim) receives the result, e.g. a static
    CUDA-graph buffer; `config` picks the kernel (DecodeConfig, the default: per KV head;
    PackedDecodeConfig: packed; TmaDecodeConfig: the Gluon TMA kernel where `tma_decode_supported`,
    else the per-head kernel) and its tile shapes.  `order` (optional, [B] int32 on q's device, a
    permutation of the batch rows, not checked for repeats) is the order in which the per-head and
    TMA kernels launch the sequences' programs: longest context first starts the longest programs in
    the first wave (docs/kernels.md).  The packed kernel splits the batch's tokens evenly
    over its programs and has no such order.  Results do not depend on it."""
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens)
    check_order(order, q)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q.dtype={q.dtype} is invalid: Triton kernels take float16, bfloat16 or float32")
    config = config or DecodeConfig()
    if isinstance(config, TmaDecodeConfig) and not tma_decode_supported(q, k_cache, v_cache, config):
        config = DecodeConfig(num_splits=config.num_splits)
    if not isinstance(config, TmaDecodeConfig):  # (TmaDecodeConfig checks its own fields)
        min_n = 1 if isinstance(config, PackedDecodeConfig) else 16  # packed tiles have block_n x Hkv rows
        if config.block_n < min_n or config.block_n & (config.block_n - 1):
            raise ValueError(f"config.block_n={config.block_n} is invalid: a power of two >= {min_n}")
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = check_out(out, q)
    if batch == 0:
        return out
    if isinstance(config, TmaDecodeConfig):
        return _decode_tma(q, k_cache, v_cache, block_tables, context_lens, scale, out, config, order)
    if isinstance(config, PackedDecodeConfig):
        return paged_decode_packed(q, k_cache, v_cache, block_tables, context_lens, scale, out, config)
    group = num_heads // num_kv_heads
    bd = block_dim(head_dim)
    splits, order = split_grid(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device, config, order)
    upcast = upcast_operands(q.dtype)
    part_out, part_lse = split_partials(out, splits, bd)
    grid = (num_kv_heads, batch, splits) if config.heads_fastest else (batch, num_kv_heads, splits)
    _decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        NUM_SPLITS=splits,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision(upcast),
        NUM_HEADS=num_heads,
        HEADS_FASTEST=config.heads_fastest,
        KV_EVICTION=config.kv_eviction,
        order_ptr=order,
        ORDERED=order is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    merge_splits(part_out, part_lse, out, splits, bd)
    return out


def _decode_tma(q, k_cache, v_cache, block_tables, context_lens, scale, out, config: TmaDecodeConfig, order):
    splits, order = split_grid(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], q.device,
                               config, order)  # fmt: skip
    part_out, part_lse = split_partials(out, splits, q.shape[2])
    paged_decode_tma(q, k_cache, v_cache, block_tables, context_lens, scale, out, part_out, part_lse, splits, config,
                     order=order)  # fmt: skip
    merge_splits(part_out, part_lse, out, splits, q.shape[2])
    return out
