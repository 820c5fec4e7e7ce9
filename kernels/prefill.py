"""Prefill / extend attention over a paged prefix (varlen, causal within the new tokens).

Sequence s brings q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s] new tokens at absolute positions
context_lens[s] - q_len .. context_lens[s] - 1; their K/V are already in the cache, so keys come
from the paged cache only (prefix-cache hits and chunked prefill are the same case).
Grid (q_tile, seq, q_head), heaviest q tiles launched first.  A program first runs over the keys
every row of its tile sees (no masks), then over the few tiles that cross the diagonal (causal
mask); tiles past the last row's position are skipped.
With a tile map (`tiles`, [N, 2] int32 rows of (seq, q_tile), seq < 0 = idle) the grid is
(N, 1, q_head) whatever the batch holds: a CUDA graph captures it once for a bounded batch, and the
host fills the map per step (`tile_map`; at most `max_tiles(...)` rows).
"""

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.common import LOG2E, block_dim, device_sms, dot_precision, max_shared_memory, upcast_operands
from kernels.validate import check_attention_inputs, check_out


@dataclass(slots=True, frozen=True)
class PrefillConfig:
    block_m: int = 128  # query rows per program (tokens x packed heads)
    block_n: int = 128  # keys per tile
    num_warps: int = 8
    num_stages: int | None = None  # None: 3 where the GPU has the shared memory (225 KB), else 2
    pack_gqa: bool = True  # put the query heads of one KV head in the same program


def _shared_bytes(config: PrefillConfig, head_dim: int, kv_buffers: int) -> int:
    """Shared memory of one program: the 16-bit query tile and `kv_buffers` K and V tile pairs."""
    return (config.block_m + kv_buffers * 2 * config.block_n) * block_dim(head_dim) * 2


def default_stages(device: torch.device, config: PrefillConfig, head_dim: int) -> int:
    """K/V buffers + 1: as many as fit in one program's shared memory next to the query tile."""
    if device.type != "cuda":
        return 2
    return 3 if _shared_bytes(config, head_dim, 2) + 4096 <= max_shared_memory(device) else 2


def tokens_per_tile(num_heads: int, num_kv_heads: int, config: PrefillConfig | None = None) -> int:
    """New tokens one program covers (its BLOCK_M rows hold that many tokens x the packed heads)."""
    config = config or PrefillConfig()
    return config.block_m // gqa_pack(num_heads // num_kv_heads, config)


def program_geometry(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                     config: PrefillConfig | None = None) -> tuple[int, int, int, int]:
    """(tokens per program, keys per tile, programs per query tile, programs running at once): what
    a latency model needs to pack this kernel's programs onto the GPU (sim/latency/prefill_schedule.py).
    Programs per SM count shared memory only (query tile + K/V buffers); on an H200 one fits."""
    config = config or PrefillConfig()
    pack = gqa_pack(num_heads // num_kv_heads, config)
    stages = config.num_stages or default_stages(device, config, head_dim)
    program_bytes = _shared_bytes(config, head_dim, max(1, stages - 1))
    per_sm = max(1, max_shared_memory(device) // program_bytes) if device.type == "cuda" else 1
    return config.block_m // pack, config.block_n, num_heads // pack, per_sm * device_sms(device)


def max_tiles(num_tokens: int, num_seqs: int, tokens: int) -> int:
    """Tile-map rows enough for any batch of <= num_tokens new tokens in <= num_seqs sequences."""
    return triton.cdiv(num_tokens, tokens) + num_seqs


def tile_map(q_lens: np.ndarray, tokens: int, out: np.ndarray) -> int:
    """Fill `out` ([N, 2] int32) with the (seq, q_tile) of every tile of sequences with these q_lens,
    heaviest (latest) tiles first, then idle rows (-1); returns the number of real tiles."""
    counts = -(-q_lens // tokens)
    num = int(counts.sum())
    if num > len(out):
        raise ValueError(f"tile map of {len(out)} rows is invalid: the batch needs {num} tiles")
    seqs = np.repeat(np.arange(len(q_lens), dtype=np.int32), counts)
    firsts = np.cumsum(counts) - counts
    tiles = np.arange(num, dtype=np.int32) - np.repeat(firsts, counts).astype(np.int32)
    order = np.argsort(-tiles, kind="stable")
    out[:num, 0], out[:num, 1] = seqs[order], tiles[order]
    out[num:] = -1
    return num


def gqa_pack(group: int, config: PrefillConfig) -> int:
    """Query heads per program: the largest power of two dividing the GQA group that leaves at
    least 16 tokens per tile (1 when packing is off)."""
    pack = 1
    while config.pack_gqa and group % (2 * pack) == 0 and config.block_m // (2 * pack) >= 16:
        pack *= 2
    return pack


@triton.jit
def _online_softmax_step(
    q,
    k,
    v,
    acc,
    m_i,
    l_i,
    keys,
    q_pos,
    scale_log2,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of flash attention: scores in fp32, running max / sum, P (in V's dtype) @ V."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        qk = tl.where(keys[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])  # one FMA per score before the exp
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    tiles_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILE_MAP: tl.constexpr,
):
    # The BLOCK_M rows are TOKENS new tokens x PACK query heads sharing one KV head (row r is
    # token r // PACK, head first_head + r % PACK): each K/V tile then serves PACK heads.
    TOKENS: tl.constexpr = BLOCK_M // PACK
    if TILE_MAP:
        s = tl.load(tiles_ptr + 2 * tl.program_id(0))
        m_tile = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
        if s < 0:
            return
    else:
        m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
        s = tl.program_id(1)
    first_head = tl.program_id(2) * PACK
    q_start = tl.load(cu_seqlens_ptr + s)
    q_len = tl.load(cu_seqlens_ptr + s + 1) - q_start
    if m_tile * TOKENS >= q_len:
        return
    context = tl.load(context_lens_ptr + s)
    tile_first = context - q_len + m_tile * TOKENS  # absolute position of the tile's first token

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m_tile * TOKENS + offs_r // PACK
    heads = first_head + offs_r % PACK
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_mask = (offs_m < q_len)[:, None]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q_off = rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tile_first + offs_r // PACK

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + s * stride_bt
    kv_head = first_head // GROUP
    k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
    full_end = (tile_first // BLOCK_N) * BLOCK_N  # keys below this are visible to every row
    kv_end = tl.minimum(context, tile_first + TOKENS)
    d_mask = (offs_d < HEAD_DIM)[None, :]
    # Page ids of the next tile are loaded one iteration ahead (a loop-carried register), so the K/V
    # loads do not depend on a load of their own iteration and Triton pipelines them num_stages deep.
    page = tl.load(table + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0).to(tl.int64)
    for key0 in range(0, full_end, BLOCK_N):
        keys = key0 + offs_n
        slot = keys % BLOCK_SIZE
        if BLOCK_D != HEAD_DIM:
            k = tl.load(k_base + (page * stride_kb + slot * stride_kt)[:, None], mask=d_mask, other=0.0)
            v = tl.load(v_base + (page * stride_vb + slot * stride_vt)[:, None], mask=d_mask, other=0.0)
        else:
            k = tl.load(k_base + (page * stride_kb + slot * stride_kt)[:, None])
            v = tl.load(v_base + (page * stride_vb + slot * stride_vt)[:, None])
        after = keys + BLOCK_N
        page = tl.load(table + after // BLOCK_SIZE, mask=after < kv_end, other=0).to(tl.int64)
        acc, m_i, l_i = _online_softmax_step(
            q, k, v, acc, m_i, l_i, keys, q_pos, scale_log2, False, UPCAST, DOT_PRECISION
        )
    for key0 in range(full_end, kv_end, BLOCK_N):  # tiles crossing the diagonal: causal mask
        keys = key0 + offs_n
        slot = keys % BLOCK_SIZE
        kv_mask = (keys < kv_end)[:, None] & d_mask
        k = tl.load(k_base + (page * stride_kb + slot * stride_kt)[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_base + (page * stride_vb + slot * stride_vt)[:, None], mask=kv_mask, other=0.0)
        after = keys + BLOCK_N
        page = tl.load(table + after // BLOCK_SIZE, mask=after < kv_end, other=0).to(tl.int64)
        acc, m_i, l_i = _online_softmax_step(
            q, k, v, acc, m_i, l_i, keys, q_pos, scale_log2, True, UPCAST, DOT_PRECISION
        )

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    *,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """max_seqlen_q (the longest q_len) sizes the grid; when omitted it is read from
    cu_seqlens_q, which costs one device sync.  `tiles` ([N, 2] int32, from `tile_map` with the
    same config) fixes the grid instead (max_seqlen_q unused).  `out` and `config` as in
    paged_decode_attention; rows of `out` outside every sequence are left as they are."""
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q.dtype={q.dtype} is invalid: Triton kernels take float16, bfloat16 or float32")
    config = config or PrefillConfig()
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, block_size, num_kv_heads = context_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = check_out(out, q)
    group = num_heads // num_kv_heads
    pack = gqa_pack(group, config)
    if tiles is not None:
        if tiles.dim() != 2 or tiles.shape[1] != 2 or tiles.dtype != torch.int32:
            raise ValueError(f"tiles={(tuple(tiles.shape), tiles.dtype)} is invalid: expected int32 [N, 2]")
        grid = (tiles.shape[0], 1, num_heads // pack)
    else:
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs else 0
        grid = (triton.cdiv(max_seqlen_q, config.block_m // pack), num_seqs, num_heads // pack)
    if num_tokens == 0 or grid[0] * grid[1] == 0:
        return out
    upcast = upcast_operands(q.dtype)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        cu_seqlens_q if tiles is None else tiles,  # a stand-in pointer when unused
        out,
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
        HEAD_DIM=head_dim,
        BLOCK_D=block_dim(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PACK=pack,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision(upcast),
        TILE_MAP=tiles is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages or default_stages(q.device, config, head_dim),
    )
    return out
