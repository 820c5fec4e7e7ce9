"""What the KV-link benchmarks share (experiments/bench_kv_transfer.py, experiments/bench_kv_receive.py):
the link's progress bound, a model's KV caches filled with random values, block ids spread over a
pool as a paged block manager hands them out, and a device sync."""
from __future__ import annotations

import torch

LINK_TIMEOUT_S = 30.0  # every wait for the other process or the link


def random_caches(cfg, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
    """Every layer's K and V cache of `cfg`'s shape (`num_blocks` blocks), random values."""
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.randn(shape, device=device).to(dtype) for _ in range(cfg.num_hidden_layers)]
    v = [torch.randn(shape, device=device).to(dtype) for _ in range(cfg.num_hidden_layers)]
    return k, v


def spread_blocks(num: int, total: int, seed: int) -> list[int]:
    """`num` distinct block ids spread over a cache of `total` (as a paged pool hands them out)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g)[:num].tolist()


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_compute(device: torch.device) -> None:
    """Wait for the compute (current) stream's work only, as the engine's step loop does. A
    device-wide sync would also wait for the link's side stream: for a receive still on the wire,
    and, for a receive posted ahead of its send, until the link gives up."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
