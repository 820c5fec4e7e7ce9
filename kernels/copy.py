"""Block copies: copy-on-write inside the GPU pool (all layers in one launch) and swap between
the GPU pool and a pinned CPU pool.

One kernel does both: it reads base addresses from int64 pointer tables, so one launch copies
the same (src, dst) block pairs in every layer's K and V cache.  A GPU program may address pinned
host memory directly (CUDA unified addressing), so a swap is a single launch with no staging:
`swap_blocks(..., method="kernel")`.  `gather_blocks` / `scatter_blocks` move blocks of every
layer between the pool and one contiguous staging buffer (a KV transfer's message), also in one
launch.  `method="torch"` instead gathers into a contiguous pinned
staging buffer, moves it in one copy and scatters; the default was picked by
`python -m experiments.bench_kernels` (docs/kernels.md).  Caches must be contiguous.
"""

import functools

import torch
import triton
import triton.language as tl

from kernels.validate import check_layer_caches, check_pairs, check_stage, check_swap_lists

_RAW_DTYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
CHUNK = 4096  # elements per program
SWAP_METHOD = "kernel"


@triton.jit
def _copy_blocks_kernel(
    src_table,
    dst_table,
    pairs_ptr,
    block_numel,
    src_block_stride,
    dst_block_stride,
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    tensor = tl.program_id(1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    src_base = tl.multiple_of(tl.load(src_table + tensor).to(tl.pointer_type(DTYPE)), 16)
    dst_base = tl.multiple_of(tl.load(dst_table + tensor).to(tl.pointer_type(DTYPE)), 16)
    src_block = tl.load(pairs_ptr + 2 * pair)
    dst_block = tl.load(pairs_ptr + 2 * pair + 1)
    x = tl.load(src_base + src_block * src_block_stride + offs, mask=mask)
    tl.store(dst_base + dst_block * dst_block_stride + offs, x, mask=mask)


@functools.lru_cache(maxsize=64)
def _pointer_table(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(pointers, dtype=torch.int64, device=device)


# The cache sets a transfer stages from or into, each checked once: keyed by its tensors (their
# ids) and their data pointers, so a new set, or the same tensors moved, is checked again (the
# oldest forgotten past 64). A pair's KV caches never change, and checking every layer's K and V on
# every message cost more than the kernel's launch (~0.1 ms a message on the H200 host).
_CHECKED_SETS: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
_CHECKED_SETS_MAX = 64


def _stage_table(caches: list[torch.Tensor]) -> torch.Tensor:
    pointers = tuple(t.data_ptr() for t in caches)
    key = (tuple(map(id, caches)), pointers)
    if key not in _CHECKED_SETS:
        _check_caches(caches)
        if len(_CHECKED_SETS) >= _CHECKED_SETS_MAX:
            _CHECKED_SETS.pop(next(iter(_CHECKED_SETS)))
        _CHECKED_SETS[key] = None
    return _pointer_table(pointers, caches[0].device)


def _check_caches(caches: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    """Every cache a kernel launch addresses through one pointer table: the first's block shape and
    dtype, contiguous, 16-byte aligned."""
    first = caches[0]
    for i, t in enumerate(caches):
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or not t.is_contiguous():
            raise ValueError(
                f"cache #{i} {tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()} is invalid: "
                f"all caches must be contiguous [*, {tuple(first.shape[1:])}] {first.dtype}"
            )
        if t.data_ptr() % 16:
            raise ValueError(f"cache #{i} data_ptr={t.data_ptr():#x} is invalid: must be 16-byte aligned")


def _launch(
    srcs: list[torch.Tensor], dsts: list[torch.Tensor], pairs: torch.Tensor, device: torch.device
) -> None:
    first = srcs[0]
    _check_caches((*srcs, *dsts))
    num_pairs = pairs.shape[0]
    if num_pairs == 0:
        return
    block_numel = first[0].numel()
    src_table = _pointer_table(tuple(t.data_ptr() for t in srcs), device)
    dst_table = _pointer_table(tuple(t.data_ptr() for t in dsts), device)
    pairs = pairs.to(device, non_blocking=True).contiguous()
    grid = (num_pairs, len(srcs), triton.cdiv(block_numel, CHUNK))
    _copy_blocks_kernel[grid](
        src_table,
        dst_table,
        pairs,
        block_numel,
        first.stride(0),
        first.stride(0),
        DTYPE=_RAW_DTYPES[first.element_size()],
        CHUNK=CHUNK,
        num_warps=4,
    )


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy block src -> dst for every (src, dst) row of pairs in every layer's K and V cache."""
    check_layer_caches(k_caches, v_caches)
    check_pairs(pairs, same_pool=True)
    caches = [*k_caches, *v_caches]
    _launch(caches, caches, pairs, caches[0].device)


def _swap_with_torch(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    pin = torch.cuda.is_available()
    src_idx, dst_idx = pairs[:, 0].to(src.device), pairs[:, 1].to(dst.device)
    if src.device.type == "cuda":  # GPU -> CPU: gather on the GPU, one copy, scatter on the CPU
        staging = torch.empty((pairs.shape[0], *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
        staging.copy_(src.index_select(0, src_idx), non_blocking=True)
        torch.cuda.current_stream(src.device).synchronize()
    else:  # CPU -> GPU: gather on the CPU into pinned memory, one copy
        staging = torch.empty((pairs.shape[0], *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
        torch.index_select(src, 0, src_idx, out=staging)
        staging = staging.to(dst.device, non_blocking=True)
    dst.index_copy_(0, dst_idx, staging)


def swap_layers(
    srcs: list[torch.Tensor], dsts: list[torch.Tensor], pairs: torch.Tensor, *, method: str | None = None
) -> None:
    """Copy block pairs[i, 0] of srcs[j] to block pairs[i, 1] of dsts[j] for every j (the engine's
    swap of every layer's K and V): one launch for all the tensors when they share a device or the
    host side is pinned (the kernel method), else the torch method tensor by tensor.  Asynchronous
    on the current stream except the torch method's GPU -> CPU direction, which waits for its copy."""
    check_swap_lists(srcs, dsts)
    check_pairs(pairs, same_pool=False)
    method = method or SWAP_METHOD
    if method not in ("kernel", "torch"):
        raise ValueError(f"method={method!r} is invalid: 'kernel' or 'torch'")
    if all(s.device == d.device for s, d in zip(srcs, dsts)):
        _launch(srcs, dsts, pairs, srcs[0].device)
        return
    to_host = srcs[0].device.type == "cuda"
    gpu, host = (srcs, dsts) if to_host else (dsts, srcs)
    if method == "kernel" and all(t.is_pinned() for t in host):
        _launch(srcs, dsts, pairs, gpu[0].device)
        return
    for src, dst in zip(srcs, dsts):
        _swap_with_torch(src, dst, pairs)


def swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, *, method: str | None = None
) -> None:
    """Copy block pairs[i, 0] of src to block pairs[i, 1] of dst (one cache tensor, any devices;
    the CPU side must be pinned for the kernel method): `swap_layers` of one tensor."""
    swap_layers([src], [dst], pairs, method=method)


@triton.jit(do_not_specialize=["num_ids"])  # one compiled kernel for every transfer size
def _stage_blocks_kernel(
    cache_table,
    staging_ptr,
    ids_ptr,
    num_ids,
    block_numel,
    cache_block_stride,
    GATHER: tl.constexpr,
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    tensor = tl.program_id(1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    cache = tl.multiple_of(tl.load(cache_table + tensor).to(tl.pointer_type(DTYPE)), 16)
    staging = staging_ptr.to(tl.pointer_type(DTYPE))
    block = tl.load(ids_ptr + i)
    cache_at = cache + block * cache_block_stride + offs
    staging_at = staging + (tensor.to(tl.int64) * num_ids + i) * block_numel + offs
    if GATHER:
        tl.store(staging_at, tl.load(cache_at, mask=mask), mask=mask)
    else:
        tl.store(cache_at, tl.load(staging_at, mask=mask), mask=mask)


def _stage(caches: list[torch.Tensor], staging: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    check_stage(caches, staging, block_ids)
    table = _stage_table(caches)
    first = caches[0]
    num_ids = block_ids.shape[0]
    if num_ids == 0:
        return
    block_numel = first[0].numel()
    grid = (num_ids, len(caches), triton.cdiv(block_numel, CHUNK))
    _stage_blocks_kernel[grid](
        table, staging, block_ids.to(first.device, non_blocking=True), num_ids, block_numel, first.stride(0),
        GATHER=gather, DTYPE=_RAW_DTYPES[first.element_size()], CHUNK=CHUNK, num_warps=4,
    )


def gather_blocks(caches: list[torch.Tensor], block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """staging[j, i] = caches[j][block_ids[i]] for every tensor j and block i, in one launch (a KV
    transfer's send buffer: every layer's K and V of a request's blocks, contiguous)."""
    _stage(caches, staging, block_ids, gather=True)


def scatter_blocks(staging: torch.Tensor, caches: list[torch.Tensor], block_ids: torch.Tensor) -> None:
    """caches[j][block_ids[i]] = staging[j, i], in one launch (a received KV transfer into its blocks)."""
    _stage(caches, staging, block_ids, gather=False)
