"""Random paged-attention problems (and KV storage layouts) for the kernel tests and the benchmark.

Blocks are handed out in a random order (block tables are non-contiguous), spare pool blocks
and unused block-table columns hold real but unrelated blocks, so wrong indexing shows up as a
wrong answer rather than a lucky one.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedProblem:
    q: torch.Tensor  # decode [B, Hq, D]; prefill [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32
    cu_seqlens_q: torch.Tensor | None  # [S + 1] int32 for prefill, None for decode
    max_seqlen_q: int
    scale: float

    def decode_args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale

    def prefill_args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_seqlens_q,
            self.context_lens,
            self.scale,
        )

    def poison_stale_slots(self) -> None:
        """NaN in every cache slot past a context in its last block: kernels must never use them."""
        block_size = self.k_cache.shape[1]
        for s, n in enumerate(self.context_lens.tolist()):
            if n % block_size:
                block = self.block_tables[s, n // block_size].long()
                self.k_cache[block, n % block_size :] = float("nan")
                self.v_cache[block, n % block_size :] = float("nan")

    def to(self, dtype: torch.dtype) -> "PagedProblem":
        """Same problem in another dtype (e.g. float64 for a high-precision reference)."""
        return PagedProblem(
            self.q.to(dtype),
            self.k_cache.to(dtype),
            self.v_cache.to(dtype),
            self.block_tables,
            self.context_lens,
            self.cu_seqlens_q,
            self.max_seqlen_q,
            self.scale,
        )


KV_LAYOUTS = ("nhd", "hnd", "headmajor")


def kv_cache_storage(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of `cache` (logical [num_blocks, block_size, num_kv_heads, head_dim]) whose storage
    follows `layout`: "nhd" is contiguous as indexed; "hnd" keeps each block's KV heads outermost,
    so one (block, head) page is block_size * head_dim contiguous elements; "headmajor" stores
    [num_kv_heads, num_blocks, block_size, head_dim], so with sequential block tables one head's K
    or V of a sequence is one contiguous run (SDPA's stream).  The result
    is a view with the same logical shape; every kernel reads the cache through its strides."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid: one of {KV_LAYOUTS}")
    if layout == "nhd":
        return cache.contiguous()
    if layout == "headmajor":
        return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def block_is_dense(cache: torch.Tensor) -> bool:
    """True when each block (dim 0) is one dense chunk of memory, in either KV layout."""
    inner = cache[0]
    return cache.stride(0) == inner.numel() and (inner.is_contiguous() or inner.transpose(0, 1).is_contiguous())


def random_paged_problem(
    context_lens: list[int],
    q_lens: list[int] | None,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    extra_columns: int = 1,
    seed: int = 0,
) -> PagedProblem:
    """q_lens None: a decode problem (one query per sequence); else prefill with q_lens[s] new
    tokens ending at context_lens[s].  Values are N(0, 1) in `dtype`, drawn on `device`."""
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq, default=0) + extra_columns
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    if q_lens is None:
        num_q, cu, max_q = len(context_lens), None, 1
    else:
        if any(ql > cl for ql, cl in zip(q_lens, context_lens)) or len(q_lens) != len(context_lens):
            raise ValueError(f"q_lens={q_lens} is invalid: one per sequence, each <= its context_len")
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0)
        num_q, max_q = int(cu[-1]), max(q_lens, default=0)
        cu = cu.to(device)
    q = torch.randn(num_q, num_q_heads, head_dim, generator=dev_gen, device=device, dtype=dtype)
    return PagedProblem(
        q,
        k_cache,
        v_cache,
        tables.to(torch.int32).to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu,
        max_q,
        head_dim**-0.5,
    )
