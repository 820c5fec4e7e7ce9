"""Paged-KV attention kernels (Triton) and their plain-torch references.

KV layout (engine and kernels): per layer, one K cache and one V cache tensor, each
``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.  Token position p of a
sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``, i.e. row
``cache[block_table[p // block_size], p % block_size]``.  Rows of one block are one contiguous
``block_size * num_kv_heads * head_dim`` chunk (a whole block moves in one piece for swap and
copy-on-write) and each (token, head) vector is ``head_dim`` contiguous elements (16-byte loads).

API (same signatures in `kernels.reference`):
  paged_decode_attention(q[B,Hq,D], k_cache, v_cache, block_tables[B,max_blocks] int32,
                         context_lens[B] int32, scale) -> out[B,Hq,D]
  paged_prefill_attention(q[T,Hq,D], k_cache, v_cache, block_tables[S,max_blocks] int32,
                          cu_seqlens_q[S+1] int32, context_lens[S] int32, scale,
                          max_seqlen_q=None) -> out[T,Hq,D]
  write_kv_cache(k[T,Hkv,D], v[T,Hkv,D], k_cache, v_cache, slot_mapping[T] int64)  (slot < 0 skipped)
  copy_blocks(k_caches, v_caches, pairs[N,2] int64)      (every layer, block src -> dst)
  swap_blocks(src, dst, pairs[N,2] int64)                 (one cache tensor, GPU <-> pinned CPU)
  swap_layers(srcs, dsts, pairs[N,2] int64)               (swap_blocks for every tensor, one launch)
  gather_blocks(caches, block_ids[N] int64, staging[len(caches),N,...])   (blocks -> staging, one launch)
  scatter_blocks(staging, caches, block_ids[N] int64)     (staging -> blocks, one launch)

Dispatch: the names exported here run the Triton kernels when the tensors are on CUDA and the
references otherwise (the engine's CPU path, fp32).  Set `kernels.BACKEND` (initial value from
the environment variable SERVELAB_KERNELS) to "triton" to force Triton (interpreted on the CPU
under TRITON_INTERPRET=1) or "reference" to force the references.  The Triton launchers live in
kernels.decode, kernels.prefill, kernels.cache_write and kernels.copy; they also take an optional
keyword `config` (decode/prefill tile shapes) or `method` (swap), used by the benchmark.
"""

import os

import torch

from kernels import cache_write, copy, decode, prefill, reference, sample

BACKEND = os.environ.get("SERVELAB_KERNELS", "auto")
_BACKENDS = ("auto", "triton", "reference")


def _use_triton(*tensors: torch.Tensor) -> bool:
    if BACKEND not in _BACKENDS:
        raise ValueError(f"kernels.BACKEND={BACKEND!r} is invalid: one of {_BACKENDS}")
    if BACKEND == "auto":
        return any(t.is_cuda for t in tensors)
    return BACKEND == "triton"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    impl = decode.paged_decode_attention if _use_triton(q) else reference.paged_decode_attention
    return impl(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    impl = prefill.paged_prefill_attention if _use_triton(q) else reference.paged_prefill_attention
    return impl(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    impl = cache_write.write_kv_cache if _use_triton(k_cache) else reference.write_kv_cache
    impl(k, v, k_cache, v_cache, slot_mapping)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    impl = copy.copy_blocks if _use_triton(*k_caches) else reference.copy_blocks
    impl(k_caches, v_caches, pairs)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    impl = copy.swap_blocks if _use_triton(src, dst) else reference.swap_blocks
    impl(src, dst, pairs)


def swap_layers(srcs: list[torch.Tensor], dsts: list[torch.Tensor], pairs: torch.Tensor) -> None:
    impl = copy.swap_layers if _use_triton(*srcs, *dsts) else reference.swap_layers
    impl(srcs, dsts, pairs)


def gather_blocks(caches: list[torch.Tensor], block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    impl = copy.gather_blocks if _use_triton(*caches) else reference.gather_blocks
    impl(caches, block_ids, staging)


def scatter_blocks(staging: torch.Tensor, caches: list[torch.Tensor], block_ids: torch.Tensor) -> None:
    impl = copy.scatter_blocks if _use_triton(*caches) else reference.scatter_blocks
    impl(staging, caches, block_ids)


def sample_gumbel(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One categorical draw per row of softmax(logits / T) (greedy where T = 0), from a Philox
    stream fixed by `seed`: the Triton kernel on CUDA, the torch reference on CPU (another stream)."""
    impl = sample.sample_gumbel if _use_triton(logits) else reference.sample_gumbel
    return impl(logits, temperatures, seed)


def sample_gumbel_shard(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col_start: int,
                        vocab: int) -> torch.Tensor:
    """One rank's part of `sample_gumbel` over a vocabulary split by columns (logits [R, C]: columns
    [col_start, col_start + C) of `vocab`) -> float32 [2, R]: each row's best score, then its global
    column; the best over the shards, lowest column on ties, is `sample_gumbel`'s whole-row draw."""
    impl = sample.sample_gumbel_shard if _use_triton(logits) else reference.sample_gumbel_shard
    return impl(logits, temperatures, seed, col_start, vocab)


__all__ = [
    "BACKEND",
    "copy_blocks",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
    "sample_gumbel",
    "sample_gumbel_shard",
    "scatter_blocks",
    "swap_blocks",
    "swap_layers",
    "write_kv_cache",
]
