"""KV-cache write: scatter the new tokens' K and V into their cache slots.

Token t goes to slot slot_mapping[t] = block * block_size + offset, i.e. row
k_cache[block, offset] (all KV heads at once); a negative slot (padding) is skipped.
One program per token copies its [num_kv_heads, head_dim] rows of K and V.
"""

import torch
import triton
import triton.language as tl

from kernels.validate import check_kv_write


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h * stride_kch + offs_d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h * stride_vch + offs_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _write_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )
