"""One kernel from the qkv projection to attention's inputs: per token, the per-head q/k RMSNorm
(Qwen3; skipped for Llama/Qwen2), rotary embedding of q and k (neox / rotate-half layout), q
written out, and k and v scattered into their KV-cache slot (slot < 0: padding, not written).

It replaces three launches per layer (two compiled q/k norm-and-rope kernels and the KV write,
kernels/cache_write.py): on an H200 decode step of 167 sequences they took 166 us of 28 layers'
time, mostly launch and tail latency of kernels that move ~2 MB each. Arithmetic is in float32,
rounded once to the cache / activation dtype at the store, as the compiled kernels it replaces do.
The attention kernels read K and V back from the cache, so only q is returned.
"""

import torch
import triton
import triton.language as tl

from kernels.validate import check_cache


@triton.jit
def _rope_half(x1, x2, cos1, cos2, sin1, sin2):
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1), on the two halves."""
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _norm_rope(ptr, heads, mask, offs, w_ptr, eps, cos1, cos2, sin1, sin2,
               HALF: tl.constexpr, NORM: tl.constexpr):
    x1 = tl.load(ptr + heads * (2 * HALF) + offs, mask=mask).to(tl.float32)
    x2 = tl.load(ptr + heads * (2 * HALF) + HALF + offs, mask=mask).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = x1 * r * tl.load(w_ptr + offs).to(tl.float32)
        x2 = x2 * r * tl.load(w_ptr + HALF + offs).to(tl.float32)
    return _rope_half(x1, x2, cos1, cos2, sin1, sin2)


@triton.jit
def _qk_norm_rope_write_kernel(
    qkv_ptr, stride_qkv, q_out_ptr, stride_qo, stride_qoh, q_w_ptr, k_w_ptr, rope_ptr, stride_rope, eps,
    k_cache_ptr, v_cache_ptr, slot_ptr, stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF)[None, :]
    rope = rope_ptr + t * stride_rope + offs  # [2, D]: cos then sin
    cos1, cos2 = tl.load(rope).to(tl.float32), tl.load(rope + HALF).to(tl.float32)
    sin1, sin2 = tl.load(rope + 2 * HALF).to(tl.float32), tl.load(rope + 3 * HALF).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = hq < NUM_HEADS
    q1, q2 = _norm_rope(row, hq, q_mask, offs, q_w_ptr, eps, cos1, cos2, sin1, sin2, HALF, NORM)
    q_dst = q_out_ptr + t * stride_qo + hq * stride_qoh + offs
    tl.store(q_dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = hk < NUM_KV_HEADS
    k_row = row + NUM_HEADS * 2 * HALF
    k1, k2 = _norm_rope(k_row, hk, kv_mask, offs, k_w_ptr, eps, cos1, cos2, sin1, sin2, HALF, NORM)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + hk * stride_ch + offs
    tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_src = k_row + NUM_KV_HEADS * 2 * HALF + hk * (2 * HALF) + offs
    tl.store(v_cache_ptr + dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
    tl.store(v_cache_ptr + dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


def qk_norm_rope_write(qkv: torch.Tensor, num_heads: int, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, rope: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] (the projection's output rows, q then k then v), rope [T, 2, D]
    (cos and sin rows of the tokens' positions), caches [num_blocks, block_size, Hkv, D],
    slot_mapping [T] int64 -> q [T, Hq, D] normed (when weights are given) and rotated; k (normed,
    rotated) and v written to their slots. q_weight and k_weight: both or neither ([D] each)."""
    check_cache(k_cache, v_cache)
    tokens, width = qkv.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is invalid: expected [tokens, (num_heads + 2 num_kv_heads) x "
                         f"head_dim] = [{tokens}, {(num_heads + 2 * num_kv_heads) * head_dim}], last dim contiguous")
    if rope.shape != (tokens, 2, head_dim) or not rope.is_contiguous():
        raise ValueError(f"rope {tuple(rope.shape)} is invalid: expected contiguous [{tokens}, 2, {head_dim}]")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} is invalid: "
                         f"expected int64 [{tokens}]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight are invalid: give both (per-head q/k RMSNorm) or neither")
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} is invalid: a power of two")
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    norm = q_weight is not None
    _qk_norm_rope_write_kernel[(tokens,)](
        qkv, qkv.stride(0), q, q.stride(0), q.stride(1), q_weight if norm else qkv, k_weight if norm else qkv,
        rope, rope.stride(0), eps, k_cache, v_cache, slot_mapping, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=block_size, NORM=norm, num_warps=4,
    )  # fmt: skip
    return q
