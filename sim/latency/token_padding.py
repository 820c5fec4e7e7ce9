"""Padding of steps with prefill tokens to the engine's CUDA-graph token sizes (profiled model).

The engine runs a step of T = P prefill + D decode tokens in the graph of the smallest captured
token count >= T (engine/device/cuda_graph.py), so its linear layers also compute the padding rows. On an
H200 (Qwen3-0.6B) 1024 prefill tokens took 4.0 ms alone and 5.0 ms with one decode
beside them: 1025 tokens ran the 1536-token graph. A profile row measured at (P, D) thus carries
the padding of P + D, which is not the padding of a step between grid points: interpolating the
rows as they are priced the Poisson scenarios' mixed steps 10-16% too slow. With the sizes in the
profile's metadata (`token_graph_sizes`), the profiled model takes each row's padding out before
interpolating and adds the priced step's own back, at `per_token_cost` per padding row.
"""
from __future__ import annotations

import numpy as np


def padded(tokens: int, sizes: list[int]) -> int:
    """The graph size a step of `tokens` tokens runs at (itself past the largest: eager)."""
    return next((s for s in sizes if s >= tokens), tokens)


def per_token_cost(points: list[tuple[int, float]]) -> float:
    """Seconds per padding row from prefill-only rows (P tokens, seconds) at graph sizes (no
    padding): the linear coefficient of time = c + a P + b P^2 (b: attention, which padding rows
    skip), or the slope of two points; 0 with fewer, or if the fit is not positive."""
    if len(points) < 2:
        return 0.0
    p = np.array([x for x, _ in points], dtype=float)
    t = np.array([y for _, y in points], dtype=float)
    if len(points) == 2:
        return max(float((t[1] - t[0]) / (p[1] - p[0])), 0.0)
    _, a, _ = np.polyfit(p, t, 2)[::-1]
    return max(float(a), 0.0)
