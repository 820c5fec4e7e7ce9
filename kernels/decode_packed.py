"""Paged decode attention over all KV heads of a sequence at once, on a fixed grid that splits the
batch's tiles evenly (selected by a `PackedDecodeConfig`; the engine's default, engine/device/attention.py;
docs/kernels.md has where it wins).

Tile: BLOCK_N tokens x every KV head.  In the NHD cache one block is [block_size, num_kv_heads,
head_dim] contiguous, so a tile inside one block is a single dense chunk (32 KB for Qwen3-0.6B at
16 tokens), loaded by TMA where the cache allows it (`tma_ok`), else by pointer loads.  Rows of
the K tile are (token, kv_head) pairs and all query heads of the sequence form the MMA's M dim:
S = q[Hq, D] @ K[tokens * Hkv, D]^T, each query row keeping only the columns of its own KV head
(the rest are -inf, so P is 0 there and P @ V sums the right rows).  The Hkv-fold extra MMA work
is free in this memory-bound loop (the per-head kernel pads its 2-row GQA group to 16 rows: the
same waste).

Grid: `num_programs` programs (the GPU's SMs x programs_per_sm, fixed per device, so the launch
is graph-capturable).  The batch's tiles are numbered sequence after sequence and each program
walks an equal contiguous range of them in one loop, across sequence boundaries (the K/V pipeline
never drains between sequences).  A program writes the output of a sequence it covers entirely;
for a sequence it shares it writes a normalised partial and its log-sum-exp into slot
(sequence + program), unique because segments are ordered by both.  The merge kernel recomputes
the same split from context_lens and combines the partials of every shared sequence; it is
launched early (programmatic dependent launch) and waits in-kernel for the main grid.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.common import (
    LOG2E,
    block_dim,
    device_sms,
    dot_precision,
    interpreting,
    max_shared_memory,
    upcast_operands,
)


@dataclass(slots=True, frozen=True)
class PackedDecodeConfig:
    """Selects the packed kernel; defaults are its best H200 variant (docs/kernels.md)."""

    block_n: int = 16  # tokens per tile (times num_kv_heads rows)
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1
    min_split_tokens: int = 32  # a program gets at least this many tokens of work
    use_tma: bool = True  # TMA copies where the cache allows them (tma_ok), else pointer loads
    pdl: bool = True  # launch the merge kernel early (programmatic dependent launch); it waits in-kernel


@triton.jit
def attend_tile(q, k, v, keep, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of the rows of q over a K/V tile (both decode kernels): scores where
    `keep` is false are -inf; m_i is the running max in log2 units (scale folded in), l_i the sum."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _pick(values, offs, index):
    """values[index] of a register vector (a masked sum: no gather in Triton)."""
    return tl.sum(tl.where(offs == index, values, 0), 0)


@triton.jit
def _split(context_lens_ptr, batch, num_programs, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
           MIN_TILES: tl.constexpr):  # fmt: skip
    """Tiles per sequence, their running end, the total and how many programs get work."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(context_lens_ptr + offs_b, mask=offs_b < batch, other=0)
    ntiles = (lens + BLOCK_N - 1) // BLOCK_N
    ends = tl.cumsum(ntiles, 0)
    total = tl.sum(ntiles, 0)
    used = tl.maximum(tl.minimum(total // MIN_TILES, num_programs), 1)
    return offs_b, lens, ntiles, ends, total, used


@triton.jit
def _locate(offs_b, lens, starts, ends, t):
    """The sequence that flat tile t belongs to: (b, its first tile, its end tile, its length)."""
    b = tl.sum((ends <= t).to(tl.int32), 0)
    return b, _pick(starts, offs_b, b), _pick(ends, offs_b, b), _pick(lens, offs_b, b)


@triton.jit
def _page(block_tables_ptr, stride_bt, b, tok0, length, row_tok, valid, BLOCK_SIZE: tl.constexpr,
          USE_TMA: tl.constexpr):  # fmt: skip
    """Block id of the tile at token tok0 of sequence b: a scalar (TMA; tiles lie in one block) or
    one per K/V row (pointer loads)."""
    table = block_tables_ptr + b * stride_bt
    if USE_TMA:
        page = tl.load(table + tok0 // BLOCK_SIZE, mask=valid, other=0)
    else:
        tokens = tok0 + row_tok
        page = tl.load(table + tokens // BLOCK_SIZE, mask=valid & (tokens < length), other=0).to(tl.int64)
    return page


@triton.jit
def _finish(acc, m_i, l_i, row_base, whole, out_ptr, part_out_ptr, part_lse_ptr, offs_hq, offs_d, hd_mask,
            out_rows, BLOCK_D: tl.constexpr):  # fmt: skip
    """Store a segment: the output of a sequence covered whole, else a partial and its log-sum-exp."""
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / safe_l[:, None]
    if whole:
        tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        row = row_base + offs_hq
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=hd_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=tl.sum(hd_mask.to(tl.int32), 1) > 0)


@triton.jit
def decode_packed_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_tables_ptr, context_lens_ptr, out_ptr,
    part_out_ptr, part_lse_ptr, scale_log2, batch, num_programs,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One flat loop over this program's tiles [first, last), across sequence boundaries, so the
    K/V pipeline never drains between sequences: the sequence, block id and q rows of a tile are
    loop-carried / loaded with it, the softmax state resets at a segment's first tile and the
    segment is stored after its last."""
    if PDL:
        gdc_launch_dependents()  # the merge kernel may be scheduled now; it waits for this grid to finish
    pid = tl.program_id(0)
    offs_b, lens, ntiles, ends, total, used = _split(context_lens_ptr, batch, num_programs, BLOCK_B, BLOCK_N,
                                                     MIN_TILES)  # fmt: skip
    if pid >= used:
        return
    first = (pid.to(tl.int64) * total // used).to(tl.int32)
    last = ((pid + 1).to(tl.int64) * total // used).to(tl.int32)
    starts = ends - ntiles
    ROWS: tl.constexpr = BLOCK_N * BLOCK_KV
    rows = tl.arange(0, ROWS)
    row_tok = rows // BLOCK_KV
    row_head = rows % BLOCK_KV
    offs_d = tl.arange(0, BLOCK_D)
    offs_hq = tl.arange(0, BLOCK_HQ)
    hd_mask = (offs_hq < NUM_HEADS)[:, None]
    if BLOCK_D != HEAD_DIM:
        hd_mask = hd_mask & (offs_d < HEAD_DIM)[None, :]
    own_head = row_head[None, :] == (offs_hq // GROUP)[:, None]
    m_i = tl.full([BLOCK_HQ], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_HQ], dtype=tl.float32)
    acc = tl.zeros([BLOCK_HQ, BLOCK_D], dtype=tl.float32)
    # The tile's sequence and block ids are computed one iteration ahead (loop-carried registers),
    # so the K/V loads never wait on a load of their own iteration and Triton pipelines them.
    b, seq_start, seq_end, length = _locate(offs_b, lens, starts, ends, first)
    page = _page(block_tables_ptr, stride_bt, b, (first - seq_start) * BLOCK_N, length, row_tok, first < last,
                 BLOCK_SIZE, USE_TMA)  # fmt: skip
    for t in range(first, last):
        tok0 = (t - seq_start) * BLOCK_N
        q = tl.load(q_ptr + b * stride_qb + offs_hq[:, None] * stride_qh + offs_d[None, :], mask=hd_mask,
                    other=0.0)  # fmt: skip
        if USE_TMA:
            # A short last tile is loaded shifted back by its missing tokens: the rows before it are
            # earlier tokens of this block (real, finite data) or, at the block start, out of the
            # box (TMA fills zeros), never stale slots past the context (which may hold NaNs).
            shift = tl.minimum(length - tok0, BLOCK_N) - BLOCK_N
            first_row = (tok0 % BLOCK_SIZE + shift) * NUM_KV_HEADS
            k = k_desc.load([page, first_row, 0]).reshape(ROWS, BLOCK_D)
            v = v_desc.load([page, first_row, 0]).reshape(ROWS, BLOCK_D)
            row_ok = row_tok >= -shift
        else:
            tokens = tok0 + row_tok
            row_ok = tokens < length
            kv_mask = (row_ok & (row_head < NUM_KV_HEADS))[:, None]
            if BLOCK_D != HEAD_DIM:
                kv_mask = kv_mask & (offs_d < HEAD_DIM)[None, :]
            slot = tokens % BLOCK_SIZE
            k_rows = page * stride_kb + slot * stride_kt + row_head * stride_kh
            v_rows = page * stride_vb + slot * stride_vt + row_head * stride_vh
            k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        next_b, next_start, next_end, next_length = b, seq_start, seq_end, length
        if t + 1 >= seq_end:
            next_b, next_start, next_end, next_length = _locate(offs_b, lens, starts, ends, t + 1)
        next_page = _page(block_tables_ptr, stride_bt, next_b, (t + 1 - next_start) * BLOCK_N, next_length,
                          row_tok, t + 1 < last, BLOCK_SIZE, USE_TMA)  # fmt: skip
        if UPCAST:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        reset = (t == seq_start) | (t == first)  # a segment's first tile
        m_i = tl.where(reset, -1.0e30, m_i)
        l_i = tl.where(reset, 0.0, l_i)
        acc = tl.where(reset, 0.0, acc)
        m_i, l_i, acc = attend_tile(
            q, k, v, own_head & row_ok[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION
        )
        if (t + 1 == seq_end) | (t + 1 == last):  # a segment's last tile
            out_rows = out_ptr + b * stride_ob + offs_hq[:, None] * stride_oh + offs_d[None, :]
            whole = (seq_start >= first) & (seq_end <= last)
            _finish(acc, m_i, l_i, (b + pid) * NUM_HEADS, whole, out_ptr, part_out_ptr, part_lse_ptr, offs_hq,
                    offs_d, hd_mask, out_rows, BLOCK_D)  # fmt: skip
        b, seq_start, seq_end, length, page = next_b, next_start, next_end, next_length, next_page


@triton.jit
def decode_packed_merge_kernel(
    part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr, batch, num_programs, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query head): zeros for an empty sequence, nothing for one a
    single program covered, else the log-sum-exp-weighted mean of its partials (programs
    first..last, slots b + p), BLOCK_P partials per step."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_b, _, ntiles, ends, total, used = _split(context_lens_ptr, batch, num_programs, BLOCK_B, BLOCK_N,
                                                     MIN_TILES)  # fmt: skip
    if PDL:
        gdc_wait()  # launched while the main kernel runs: wait until all its partials are written
    seq_end = _pick(ends, offs_b, b).to(tl.int64)
    seq_start = seq_end - _pick(ntiles, offs_b, b)
    first = ((seq_start + 1) * used - 1) // tl.maximum(total, 1)
    last = (seq_end * used - 1) // tl.maximum(total, 1)
    offs_d = tl.arange(0, BLOCK_D)
    out = out_ptr + b * stride_ob + h * stride_oh + offs_d
    if seq_end == seq_start:
        tl.store(out, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    elif first < last:
        offs_p = tl.arange(0, BLOCK_P)
        m = float("-inf")
        total_w = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for p0 in range(first, last + 1, BLOCK_P):
            p = p0 + offs_p
            row = (b + p) * NUM_HEADS + h
            lse = tl.load(part_lse_ptr + row, mask=p <= last, other=float("-inf"))
            parts = tl.load(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=(p <= last)[:, None],
                            other=0.0)  # fmt: skip
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            total_w = total_w * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(parts * w[:, None], 0)
            m = m_new
        acc = acc / tl.where(total_w > 0.0, total_w, 1.0)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def tma_ok(cache: torch.Tensor, block_n: int) -> bool:
    """A tile (block_n tokens x all KV heads) is one TMA box: dense NHD cache, power-of-two head
    counts and head_dim, tiles inside one block, at most 256 rows, 16-byte aligned."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    return (
        cache.is_contiguous()
        and cache.data_ptr() % 16 == 0
        and head_dim == block_dim(head_dim)
        and num_kv_heads == triton.next_power_of_2(num_kv_heads)
        and block_size % block_n == 0
        and block_n * num_kv_heads <= 256
        and head_dim * cache.element_size() >= 16
    )


def paged_decode_packed(
    q, k_cache, v_cache, block_tables, context_lens, scale, out, config: PackedDecodeConfig
):
    """Launch on checked inputs (kernels.decode.paged_decode_attention validates them)."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    block_kv = triton.next_power_of_2(num_kv_heads)
    block_n = max(config.block_n, 16 // block_kv)  # tl.dot needs >= 16 rows
    if q.is_cuda:  # wider elements (fp32) or heads: fewer tokens per tile, so the K/V buffers still fit
        tile_bytes = lambda n: (
            2 * (config.num_stages - 1) * n * block_kv * block_dim(head_dim) * q.element_size()
        )
        while block_n * block_kv > 16 and tile_bytes(block_n) > max_shared_memory(q.device) - 16384:
            block_n //= 2
    bd, block_hq = block_dim(head_dim), max(16, triton.next_power_of_2(num_heads))
    block_b = max(64, triton.next_power_of_2(batch))  # few compiled variants across the engine's batch sizes
    num_programs = config.programs_per_sm * device_sms(q.device)
    min_tiles = max(1, config.min_split_tokens // block_n)
    upcast = upcast_operands(q.dtype)
    part_out = torch.empty((batch + num_programs) * num_heads, bd, dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch + num_programs) * num_heads, dtype=torch.float32, device=q.device)
    use_tma = config.use_tma and tma_ok(k_cache, block_n) and tma_ok(v_cache, block_n)
    pdl = config.pdl and q.is_cuda and not interpreting()
    k_desc = v_desc = None
    if use_tma:
        shape, box = [num_blocks, block_size * num_kv_heads, head_dim], [1, block_n * num_kv_heads, head_dim]
        strides = [block_size * num_kv_heads * head_dim, head_dim, 1]
        k_desc = TensorDescriptor(k_cache, shape, strides, box)
        v_desc = TensorDescriptor(v_cache, shape, strides, box)
    decode_packed_kernel[(num_programs,)](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, context_lens, out, part_out, part_lse,
        scale * LOG2E, batch, num_programs, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, BLOCK_HQ=block_hq,
        BLOCK_KV=block_kv, HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        BLOCK_B=block_b, MIN_TILES=min_tiles, UPCAST=upcast, DOT_PRECISION=dot_precision(upcast),
        USE_TMA=use_tma, PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    decode_packed_merge_kernel[(batch, num_heads)](
        part_out, part_lse, context_lens, out, batch, num_programs, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=block_n, BLOCK_B=block_b, MIN_TILES=min_tiles,
        BLOCK_P=min(64, triton.next_power_of_2(2 * num_programs // batch + 2)),  # ~ partials of a sequence
        PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out
