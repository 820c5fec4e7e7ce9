"""Prefill / extend attention over a paged prefix (varlen, causal within the new tokens).

Sequence s brings q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s] new tokens at absolute positions
context_lens[s] - q_len .. context_lens[s] - 1; their K/V are already in the cache, so keys come
from the paged cache only (prefix-cache hits and chunked prefill are the same case).
Grid (q_tile, seq, q_head), heaviest q tiles launched first.  A program first runs over the keys
every row of its tile sees (no masks), then over the few tiles that cross the diagonal (causal
mask); tiles past the last row's position are skipped.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import LOG2E, block_dim, dot_precision, upcast_operands
from kernels.validate import check_attention_inputs, check_out


@dataclass(slots=True, frozen=True)
class PrefillConfig:
    block_m: int = 128  # query rows per program
    block_n: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_base,
    v_base,
    table,
    key0,
    offs_n,
    q_pos,
    kv_end,
    scale_log2,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    keys = key0 + offs_n
    if MASKED:
        n_mask = keys < kv_end
        page = tl.load(table + keys // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None]
    else:
        page = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
        kv_mask = tl.full([offs_n.shape[0], 1], True, tl.int1)
    if BLOCK_D != HEAD_DIM:
        kv_mask = kv_mask & (offs_d < HEAD_DIM)[None, :]
    slot = keys % BLOCK_SIZE
    k = tl.load(k_base + (page * stride_kb + slot * stride_kt)[:, None], mask=kv_mask, other=0.0)
    v = tl.load(v_base + (page * stride_vb + slot * stride_vt)[:, None], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        qk = tl.where(keys[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
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
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + s)
    q_len = tl.load(cu_seqlens_ptr + s + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    context = tl.load(context_lens_ptr + s)
    tile_first = context - q_len + m_tile * BLOCK_M  # absolute position of the tile's first row

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_mask = (offs_m < q_len)[:, None]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tile_first + tl.arange(0, BLOCK_M)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + s * stride_bt
    kv_head = h // GROUP
    k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
    full_end = (tile_first // BLOCK_N) * BLOCK_N  # keys below this are visible to every row
    kv_end = tl.minimum(context, tile_first + BLOCK_M)
    for key0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            k_base,
            v_base,
            table,
            key0,
            offs_n,
            q_pos,
            kv_end,
            scale_log2,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            False,
            UPCAST,
            DOT_PRECISION,
        )
    for key0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            k_base,
            v_base,
            table,
            key0,
            offs_n,
            q_pos,
            kv_end,
            scale_log2,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            True,
            UPCAST,
            DOT_PRECISION,
        )

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
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
) -> torch.Tensor:
    """max_seqlen_q (the longest q_len) sizes the grid; when omitted it is read from
    cu_seqlens_q, which costs one device sync.  `out` and `config` as in paged_decode_attention."""
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q.dtype={q.dtype} is invalid: Triton kernels take float16, bfloat16 or float32")
    config = config or PrefillConfig()
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, block_size, num_kv_heads = context_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = check_out(out, q)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs else 0
    if num_tokens == 0 or max_seqlen_q == 0:
        return out
    upcast = upcast_operands(q.dtype)
    grid = (triton.cdiv(max_seqlen_q, config.block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
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
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_dim(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision(upcast),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
