"""Plain-torch references for every kernel in `kernels/`, same signatures as the Triton versions.

They are the ground truth of the tests (call them on float64 copies for a high-precision
reference) and the CPU path of the engine.  Attention math runs in float32, or float64 when
the inputs are float64; outputs come back in the query's dtype.  A sequence with no context
(context_len 0, e.g. a padded CUDA-graph slot) gets a zero output, as in the Triton kernels.
"""

import torch

from kernels.validate import (
    check_attention_inputs,
    check_kv_write,
    check_layer_caches,
    check_pairs,
    check_stage,
    check_swap_lists,
)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather_tokens(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence as [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [M, Hq, D] at absolute positions q_pos [M]; k, v [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    dtype = _compute_dtype(q.dtype)
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.to(dtype), k) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hml,lhd->mhd", probs, v)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens)
    out = torch.zeros_like(q)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = _gather_tokens(k_cache, block_tables[b], length)
        v = _gather_tokens(v_cache, block_tables[b], length)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale)[0].to(q.dtype)
    return out


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
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for s, length in enumerate(context_lens.tolist()):
        start, end = cu[s], cu[s + 1]
        if end == start:
            continue
        k = _gather_tokens(k_cache, block_tables[s], length)
        v = _gather_tokens(v_cache, block_tables[s], length)
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        out[start:end] = _attend(q[start:end], k, v, q_pos, scale).to(q.dtype)
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    check_layer_caches(k_caches, v_caches)
    check_pairs(pairs, same_pool=True)
    src, dst = pairs[:, 0].to(k_caches[0].device), pairs[:, 1].to(k_caches[0].device)
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    check_pairs(pairs, same_pool=False)
    src_idx, dst_idx = pairs[:, 0].to(src.device), pairs[:, 1].to(dst.device)
    dst[dst_idx] = src[src_idx].to(dst.device)


def swap_layers(srcs: list[torch.Tensor], dsts: list[torch.Tensor], pairs: torch.Tensor) -> None:
    check_swap_lists(srcs, dsts)
    for src, dst in zip(srcs, dsts):
        swap_blocks(src, dst, pairs)


def gather_blocks(caches: list[torch.Tensor], block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    check_stage(caches, staging, block_ids)
    index = block_ids.to(caches[0].device)
    for j, cache in enumerate(caches):
        torch.index_select(cache, 0, index, out=staging[j])


def scatter_blocks(staging: torch.Tensor, caches: list[torch.Tensor], block_ids: torch.Tensor) -> None:
    check_stage(caches, staging, block_ids)
    index = block_ids.to(caches[0].device)
    for j, cache in enumerate(caches):
        cache.index_copy_(0, index, staging[j])


def sample_gumbel(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """Gumbel-max draw per row of softmax(logits / T), greedy where T = 0 (kernels.sample's
    arithmetic; torch's generator seeded with `seed` supplies the uniforms, so the stream differs)."""
    gen = torch.Generator(device=logits.device).manual_seed(seed & 0x7FFFFFFF)
    u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp_(min=1e-30)
    scaled = logits.float() / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    drawn = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(temperatures > 0, drawn, logits.argmax(dim=-1))


def sample_gumbel_shard(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col_start: int,
                        vocab: int) -> torch.Tensor:
    """kernels.sample.sample_gumbel_shard's contract: float32 [2, R], each row's best score and its
    global column over columns [col_start, col_start + C) of `vocab`-column rows, the noise of every
    column drawn as `sample_gumbel` draws it for the whole rows (their uniforms, this shard's columns)."""
    rows, width = logits.shape
    end = min(col_start + width, vocab)
    if not 0 <= col_start < end:
        raise ValueError(f"col_start={col_start} is invalid: the shard must hold columns of a {vocab}-column row")
    gen = torch.Generator(device=logits.device).manual_seed(seed & 0x7FFFFFFF)
    u = torch.rand((rows, vocab), generator=gen, device=logits.device)[:, col_start:end].clamp_(min=1e-30)
    x = logits[:, :end - col_start].float()
    noisy = (x / torch.where(temperatures > 0, temperatures, 1.0)[:, None]) - torch.log(-torch.log(u))
    scores = torch.where((temperatures > 0)[:, None], noisy, x)
    best, index = scores.max(dim=-1)  # the first of equal maxima, as argmax
    return torch.stack([best, (index + col_start).float()])
