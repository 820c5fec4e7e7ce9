"""The bytes the read-rate probes stream: decode's K and V at batch 64 x 4k (Qwen3-0.6B: 16 query
heads, 8 KV heads, head_dim 128, bf16, pages of 16 rows), shared by bench_read_rate and its Gluon TMA
reads (bench_read_tma)."""

import torch
import torch.nn.functional as F

from experiments.lib.kernel_timing import graph_ms

B, HQ, HKV, L, D, PAGE = 64, 16, 8, 4096, 128, 16


def sdpa_then_flat(ctx: int, add_bytes) -> torch.Tensor:
    """SDPA over B x ctx (its time reported as `ceiling-<ctx>-sdpa`), then its K and V as one flat
    tensor for the read kernels to stream."""
    k = torch.randn(B, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    ms = graph_ms([lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)])
    add_bytes(f"ceiling-{ctx}-sdpa", ms, k.nbytes + v.nbytes)
    return torch.cat([k.view(-1), v.view(-1)])
