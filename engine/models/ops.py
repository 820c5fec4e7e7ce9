"""The model's elementwise pieces as plain functions: RMSNorm (optionally fused with the residual
add), RoPE application, SiLU-and-mul. Arithmetic is transformers' (float32 RMSNorm rounded to the
activation dtype before the weight multiply; cos/sin cast to the activation dtype).

`fused_ops(compile, eps)` binds the model's RMSNorm epsilon (a constant to torch.compile: a float
argument would be traced as a symbolic input read back with `.item()` on every call) and, with
`compile=True`, wraps each piece in `torch.compile` (one Triton kernel each instead of 5-10 small
ones); the plain versions serve the CPU path and `enforce_eager`. RoPE takes the cos/sin rows of
the step's positions, gathered once per step (`rope_rows`) rather than once per layer; Qwen3's
per-head q/k norms and RoPE form one piece (`qk_norm_rope`: one kernel instead of three).
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


def rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos_sin [max_pos, 2, D] float32, positions [T] -> the step's rows [T, 2, D] in `dtype`."""
    return cos_sin[positions].to(dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D]; cs [T, 2, D] from `rope_rows`."""
    cos, sin = cs[:, 0, None, :], cs[:, 1, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_ops(compile: bool, eps: float) -> SimpleNamespace:
    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm(x: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cs)

    fns = {"rms_norm": norm, "add_rms_norm": add_norm, "apply_rope": apply_rope, "qk_norm_rope": qk_norm_rope,
           "silu_and_mul": silu_and_mul}
    if compile:
        fns = {name: torch.compile(fn, dynamic=True) for name, fn in fns.items()}
    return SimpleNamespace(**fns)
