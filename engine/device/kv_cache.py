"""The paged KV cache: per layer one K and one V tensor `[num_blocks, block_size, num_kv_heads,
head_dim]` on the device (the layout of `kernels/`), plus a CPU swap pool of the same layout
(pinned when a GPU is used) sized by `CacheConfig.swap_space` GiB.

`apply(swap_out, swap_in, copy)` runs one step's cache operations in the contract's order; a swap
moves every layer's K and V in one launch. On a GPU the swaps run on a side stream that first
waits for the compute stream (the blocks' last writes are done) and that the compute stream then
waits for (the forward neither overwrites a block still being copied out nor reads one still being
copied in).
"""
from __future__ import annotations

from types import ModuleType

import torch

from engine.config import ModelConfig


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes of one block over all layers."""
    return block_size * cfg.kv_bytes_per_token_in(dtype.itemsize)


def num_cpu_blocks(swap_space_gib: float, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return int(swap_space_gib * (1 << 30)) // block_bytes(cfg, block_size, dtype)


def _pairs(mapping: dict[int, int] | list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    items = list(mapping.items()) if isinstance(mapping, dict) else list(mapping)
    return torch.tensor(items, dtype=torch.int64).reshape(-1, 2).to(device)


class KVCache:
    def __init__(self, cfg: ModelConfig, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 device: torch.device, dtype: torch.dtype, ops: ModuleType) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.ops = ops
        shape = (block_size, cfg.num_key_value_heads, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        # Zeros, not empty: CUDA-graph padding rows and stale block-table entries may point at any
        # block, and garbage there must never be NaN.
        self.k_caches = [torch.zeros(num_gpu_blocks, *shape, dtype=dtype, device=device) for _ in layers]
        self.v_caches = [torch.zeros(num_gpu_blocks, *shape, dtype=dtype, device=device) for _ in layers]
        # The swap pool is only ever read where a swap-out wrote: no need to touch its pages now.
        pin = device.type == "cuda"
        self.cpu_k_caches = [torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin) for _ in layers]
        self.cpu_v_caches = [torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin) for _ in layers]
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if device.type == "cuda" and num_gpu_blocks > 1:
            self._compile_block_ops()

    def _compile_block_ops(self) -> None:
        """Run each block op once on zero blocks (a no-op on the zeroed cache), so that Triton
        compiles them here and not in the first step that preempts (a ~0.3 s stall)."""
        self.copy([(0, 1)])
        if self.num_cpu_blocks:
            self.apply({0: 0}, {}, [])
            self.apply({}, {0: 0}, [])
        torch.cuda.synchronize(self.device)

    def apply(self, swap_out: dict[int, int], swap_in: dict[int, int],
              copy: list[tuple[int, int]]) -> None:
        """One step's cache operations, in order: swap out, swap in, copy-on-write copies."""
        if swap_out or swap_in:
            if self.swap_stream is None:
                self._swap(swap_out, swap_in)
            else:
                compute = torch.cuda.current_stream(self.device)
                self.swap_stream.wait_stream(compute)
                with torch.cuda.stream(self.swap_stream):
                    self._swap(swap_out, swap_in)
                compute.wait_stream(self.swap_stream)
        if copy:
            self.copy(copy)

    def _swap(self, swap_out: dict[int, int], swap_in: dict[int, int]) -> None:
        if swap_out:
            self.swap_out(swap_out)
        if swap_in:
            self.swap_in(swap_in)

    def swap_out(self, mapping: dict[int, int]) -> None:
        """GPU block -> CPU block, every layer (on the current stream)."""
        self._check(mapping.keys(), self.num_gpu_blocks, "swap_out GPU block")
        self._check(mapping.values(), self.num_cpu_blocks, "swap_out CPU block")
        pairs = _pairs(mapping, self.device)
        self.ops.swap_layers(self.k_caches + self.v_caches, self.cpu_k_caches + self.cpu_v_caches, pairs)

    def swap_in(self, mapping: dict[int, int]) -> None:
        """CPU block -> GPU block, every layer (on the current stream)."""
        self._check(mapping.keys(), self.num_cpu_blocks, "swap_in CPU block")
        self._check(mapping.values(), self.num_gpu_blocks, "swap_in GPU block")
        pairs = _pairs(mapping, self.device)
        self.ops.swap_layers(self.cpu_k_caches + self.cpu_v_caches, self.k_caches + self.v_caches, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) GPU blocks, every layer."""
        self._check([b for p in pairs for b in p], self.num_gpu_blocks, "copy GPU block")
        self.ops.copy_blocks(self.k_caches, self.v_caches, _pairs(pairs, self.device))

    @staticmethod
    def _check(blocks, limit: int, what: str) -> None:
        bad = [b for b in blocks if not 0 <= b < limit]
        if bad:
            raise ValueError(f"{what} ids {bad[:5]} are out of range [0, {limit})")
