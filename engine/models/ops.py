"""The model's elementwise pieces as plain functions: RMSNorm (optionally fused with the residual
add), RoPE application, SiLU-and-mul. Arithmetic is transformers' (float32 RMSNorm rounded to the
activation dtype before the weight multiply; cos/sin cast to the activation dtype).

`fused_ops(compile=True)` returns them wrapped in `torch.compile` (one Triton kernel each instead of
5-10 small ones: on a GPU this is most of a decode step's launch count); the plain versions serve the
CPU path and `enforce_eager`.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the add in the activation dtype as transformers."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, Hq, D], k [T, Hkv, D]; cos_sin [max_pos, 2, D] float32."""
    cs = cos_sin[positions].to(q.dtype)
    cos, sin = cs[:, 0, None, :], cs[:, 1, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_ops(compile: bool) -> SimpleNamespace:
    fns = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "apply_rope": apply_rope,
           "silu_and_mul": silu_and_mul}
    if compile:
        fns = {name: torch.compile(fn, dynamic=True) for name, fn in fns.items()}
    return SimpleNamespace(**fns)
