"""Rotary position embedding tables (neox / rotate-half layout, as transformers' Llama), with the
`default` and `llama3` frequency schedules. cos/sin are precomputed in float32 per position;
`engine.models.ops.apply_rope` casts them to the activation dtype before use, as transformers does.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_frequencies(
            head_dim, theta, scaling)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # [max_positions, 2, head_dim]: cos and sin; a buffer so .to(device) moves it.
        self.register_buffer("cos_sin", torch.stack([emb.cos(), emb.sin()], dim=1), persistent=False)
